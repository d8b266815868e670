"""The vLLM-facing Ouroboros proposer (loaded by vLLM's custom_class hook).

One step, as vLLM drives it:
  on_sample()  the target just verified last step's drafts: its tokens at every drafted position
               feed the pool (candidate inspiration + refinement)      -> feedback.py, pool.py
  propose()    draft a sentence phrase by phrase for every running request and lengthen it
               with a candidate suffix from the pool                    -> draft/runtime.py
vLLM then verifies the chain [draft | suffix] in one target forward.
"""

from __future__ import annotations

import atexit
import logging

import numpy as np
import torch

from vllm_ouroboros import feedback
from vllm_ouroboros.config import OuroborosConfig
from vllm_ouroboros.draft.model import DraftModel
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
from vllm_ouroboros.metrics import OuroborosStats
from vllm_ouroboros.pool import PhrasePool

logger = logging.getLogger("vllm_ouroboros")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _LastProposal:
    """What was proposed to a request last step, to read its verification. Host arrays."""

    __slots__ = ("n_main", "suffix", "suffix_key")

    def __init__(self, n_main: int, suffix: np.ndarray, suffix_key: int):
        self.n_main = n_main
        self.suffix = suffix  # [s] int64, s <= L tokens appended after the sentence draft
        self.suffix_key = suffix_key


class OuroborosProposer:
    """Ouroboros drafting for vLLM's V1 model runner (custom_class interface)."""

    def __init__(self, vllm_config):
        from vllm_ouroboros.patches import ADDITIONAL_CONFIG_KEY, model_runner

        model_runner.apply()
        extra = vllm_config.additional_config or {}
        if ADDITIONAL_CONFIG_KEY not in extra:
            raise RuntimeError(
                "OuroborosProposer needs the ouroboros settings; select it with "
                "speculative_config={'method': 'ouroboros', 'model': DRAFT_DIR}"
            )
        self.cfg = OuroborosConfig.from_dict(extra[ADDITIONAL_CONFIG_KEY])
        self.vllm_config = vllm_config
        self.device = torch.device(vllm_config.device_config.device)
        self.num_spec_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_slots = vllm_config.scheduler_config.max_num_seqs
        self.stats = OuroborosStats()
        self.runtime: DraftRuntime | None = None
        self.pool: PhrasePool | None = None
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(self.max_slots - 1, -1, -1))
        self._last: dict[str, _LastProposal] = {}
        self._req_ids: list[str] = []

    # ---- set-up ------------------------------------------------------------------------------
    def load_model(self, target_model=None) -> None:
        """Load the draft and allocate its KV and the pool (inside vLLM's memory profiling)."""
        cfg = self.cfg
        if cfg.draft_dtype == "auto":
            dtype = self.vllm_config.model_config.dtype
        else:
            dtype = _DTYPES[cfg.draft_dtype]
        model = DraftModel.from_pretrained(cfg.draft_model, dtype=dtype, device=self.device)
        init_slots = min(self.max_slots, 16)
        init_len = min(self.max_model_len, cfg.draft_initial_len)
        model.allocate_cache(init_slots, init_len)
        budget = int(cfg.pool_budget_mb * 2**20)
        if cfg.pool_load_path:
            self.pool = PhrasePool.load(cfg.pool_load_path, device=self.device, budget_bytes=budget,
                                        shared=cfg.warm_start)
            logger.info("ouroboros: loaded phrase pool from %s", cfg.pool_load_path)
        else:
            self.pool = PhrasePool(model.vocab_size, cfg.phrase_len, cfg.window_size, budget,
                                   device=self.device, shared=cfg.warm_start)
        settings = DraftSettings(
            gamma=cfg.gamma, beta=cfg.beta, window_size=cfg.window_size,
            num_guesses=cfg.num_guesses,
            num_suffixes=cfg.num_suffixes if cfg.use_suffixes else 0,
            use_lookahead=cfg.use_lookahead, use_guesses=cfg.use_guesses,
            max_draft_forwards=cfg.max_draft_forwards,
        )
        self.runtime = DraftRuntime(model, self.pool, settings, init_slots, self.max_model_len,
                                    self.device)
        if cfg.pool_save_path:
            atexit.register(self.save_pool)
        logger.info("ouroboros: draft %s loaded (%s), pool budget %.1f MiB", cfg.draft_model,
                    dtype, cfg.pool_budget_mb)

    def save_pool(self, path: str | None = None) -> None:
        path = path or self.cfg.pool_save_path
        if path and self.pool is not None:
            self.pool.save(path)

    # ---- request lifetime -------------------------------------------------------------------
    def _sync_requests(self, req_ids: list[str]) -> None:
        """Give new requests a slot; release the slots (and pool ownership) of finished ones."""
        live = set(req_ids)
        gone = [r for r in self._slot_of if r not in live]
        if gone:
            slots = [self._slot_of.pop(r) for r in gone]
            self.pool.release(torch.tensor(slots, dtype=torch.long, device=self.device))
            for r, s in zip(gone, slots):
                self.runtime.reset_slot(s)
                self._free_slots.append(s)
                self._last.pop(r, None)
                self.stats.finish(r)
        for r in req_ids:
            if r is not None and r not in self._slot_of:
                self._slot_of[r] = self._free_slots.pop()

    # ---- verification feedback ---------------------------------------------------------------
    def on_sample(self, req_ids: list[str], logits: torch.Tensor | None, spec_meta) -> None:
        """Read the target's tokens at every verified position (called by the runner patch).

        `spec_meta` is vLLM's SpecDecodeMetadata for this step (None without drafts); `logits`
        are the target's raw logits, rows ordered as spec_meta's indices expect.
        """
        self._req_ids = list(req_ids)
        if spec_meta is None or logits is None or self.runtime is None:
            return
        n = np.asarray(spec_meta.num_draft_tokens, dtype=np.int64)
        B, total = len(n), int(n.sum())
        if total == 0:
            return
        top = logits.argmax(dim=-1)
        t_draft = top[spec_meta.target_logits_indices.long()].cpu().numpy()
        t_bonus = top[spec_meta.bonus_logits_indices.long()].cpu().numpy()
        d_flat = spec_meta.draft_token_ids.cpu().numpy().astype(np.int64)
        D = int(n.max())
        row = np.repeat(np.arange(B), n)
        col = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
        draft = np.full((B, D), -1, np.int64)
        target = np.full((B, D + 1), -1, np.int64)
        draft[row, col] = d_flat
        target[row, col] = t_draft
        target[np.arange(B), n] = t_bonus
        self._learn(req_ids[:B], draft, target, n)

    def _learn(self, req_ids, draft, target, n) -> None:
        L = self.cfg.phrase_len
        B = len(req_ids)
        owners = np.array([self._slot_of.get(r, -1) for r in req_ids], np.int64)
        last = [self._last.get(r) for r in req_ids]
        n_main = np.array([p.n_main if p else 0 for p in last], np.int64)
        s_len = np.array([min(len(p.suffix), max(int(k) - p.n_main, 0)) if p else 0
                          for p, k in zip(last, n)], np.int64)
        s_key = np.array([p.suffix_key if p else 0 for p in last], np.int64)
        l_d = feedback.accepted_lengths(draft, target, n)
        has = (n > 0) & (owners >= 0)
        insp = refn = None
        if self.cfg.use_inspiration:
            insp = feedback.inspiration(draft, target, n, owners, L)
            self._insert(insp)
        if self.cfg.use_refinement and self.cfg.use_suffixes:
            refn = feedback.refinement(target, n_main, s_len, s_key, n, owners, L)
            if len(refn):
                rows = np.nonzero((s_len == L) & (n_main + L <= n))[0]
                old = np.stack([last[i].suffix for i in rows])
                dev = self.device
                self.pool.replace(torch.from_numpy(refn.keys).to(dev), torch.from_numpy(old).to(dev),
                                  torch.from_numpy(refn.tokens).to(dev),
                                  torch.from_numpy(refn.owners).to(dev))
        for i in np.nonzero(has)[0]:
            self.stats.add(
                req_ids[i], target_forwards=1, drafted_tokens=n[i], accepted_tokens=l_d[i],
                suffix_accepted=max(0, l_d[i] - n_main[i]) if s_len[i] else 0,
                inspiration_inserts=int((insp.owners == owners[i]).sum()) if insp else 0,
                refinement_inserts=int((refn.owners == owners[i]).sum()) if refn else 0,
            )

    def _insert(self, phrases: feedback.Phrases) -> None:
        if len(phrases):
            dev = self.device
            self.pool.insert(torch.from_numpy(phrases.keys).to(dev),
                             torch.from_numpy(phrases.tokens).to(dev),
                             torch.from_numpy(phrases.owners).to(dev))

    # ---- drafting ----------------------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **_) -> list[list[int]]:
        """Draft token ids per request of the batch (vLLM's custom_class interface).

        sampled_token_ids[i] are the tokens request i got this step (empty: no draft wanted,
        e.g. a chunked prefill in progress); its context is token_ids_cpu[i, :num_tokens_no_spec[i]].
        """
        B = len(sampled_token_ids)
        req_ids = self._req_ids[:B]
        self._sync_requests(req_ids)
        for i, toks in enumerate(sampled_token_ids):
            if toks:
                self.stats.add(req_ids[i], generated_tokens=len(toks))
        rows = np.array([i for i, t in enumerate(sampled_token_ids) if t], np.int64)
        proposals: list[list[int]] = [[] for _ in range(B)]
        if len(rows) == 0:
            return proposals
        slots = np.array([self._slot_of[req_ids[i]] for i in rows], np.int64)
        lens = np.asarray(num_tokens_no_spec[rows], np.int64)
        out = self.runtime.run_round(slots, token_ids_cpu, rows, lens)
        self.stats.round_done(out.forwards, out.prefill_forwards, len(rows))
        cap = self.num_spec_tokens
        for b, i in enumerate(rows):
            n_main = int(min(out.draft_lens[b], cap))
            tokens = out.drafts[b, :n_main]
            suffix = np.zeros(0, np.int64)
            if out.suffix_valid.shape[1] and out.suffix_valid[b, 0] and n_main < cap:
                suffix = out.suffixes[b, 0, : cap - n_main]
            key = int(tokens[-1]) if n_main else int(token_ids_cpu[i, lens[b] - 1])
            self._last[req_ids[i]] = _LastProposal(n_main, suffix, key)
            proposals[i] = np.concatenate([tokens, suffix]).tolist()
            self.stats.add(req_ids[i], draft_forwards=out.row_forwards[b],
                           prefill_forwards=out.row_prefills[b],
                           guess_tokens=out.guess_tokens[b],
                           guess_lookups=out.row_forwards[b] if self.runtime.G else 0,
                           guess_hits=out.guess_hit_forwards[b])
        return proposals

    def snapshot(self) -> dict:
        """Aggregate and per-request counters, plus the pool's."""
        return self.stats.snapshot(self.pool.stats() if self.pool is not None else None)
