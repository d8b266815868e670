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
import os
import time

import numpy as np
import torch

from vllm_ouroboros import feedback
from vllm_ouroboros.config import OuroborosConfig
from vllm_ouroboros.draft.model import DraftModel
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
from vllm_ouroboros.metrics import OuroborosStats
from vllm_ouroboros.metrics_export import ENV_DIR, SnapshotWriter
from vllm_ouroboros.pool import PhrasePool

logger = logging.getLogger("vllm_ouroboros")

POOL_SAVE_INTERVAL = 10.0  # seconds

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        self.stats = OuroborosStats(self.max_slots)
        self.runtime: DraftRuntime | None = None
        self.pool: PhrasePool | None = None
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(self.max_slots - 1, -1, -1))
        self._req_ids: list[str] = []
        self._last_pool_save = -float("inf")
        # What each slot was proposed last step, to read its verification (host arrays):
        # sentence-draft length, the suffix sent after it and the token it hangs off.
        L = self.cfg.phrase_len
        self._last_main = np.zeros(self.max_slots, np.int64)
        self._last_suffix = np.zeros((self.max_slots, L), np.int64)
        self._last_suffix_len = np.zeros(self.max_slots, np.int64)
        self._last_suffix_key = np.zeros(self.max_slots, np.int64)
        self._ctx_seen = np.zeros(self.max_slots, np.int64)  # context length already in the pool
        # Every TP rank drafts the same tokens: the first rank of each engine reports.
        tp = vllm_config.parallel_config.tensor_parallel_size
        first_rank = (not torch.distributed.is_initialized()
                      or torch.distributed.get_rank() % tp == 0)
        self._metrics = SnapshotWriter(os.environ.get(ENV_DIR) if first_rank else None)

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
        """Write the pool (atomically: a reader never sees half a file)."""
        path = path or self.cfg.pool_save_path
        if path and self.pool is not None:
            self.pool.save(path + ".tmp")
            os.replace(path + ".tmp", path)
            self._last_pool_save = time.monotonic()

    def _maybe_save_pool(self) -> None:
        # atexit alone is not enough: vLLM may kill the engine process at shutdown before exit
        # handlers run, so the pool is also written every POOL_SAVE_INTERVAL seconds.
        if self.cfg.pool_save_path and time.monotonic() - self._last_pool_save >= POOL_SAVE_INTERVAL:
            self.save_pool()

    # ---- request lifetime -------------------------------------------------------------------
    def _sync_requests(self, req_ids: list[str]) -> None:
        """Give new requests a slot; release the slots (and pool ownership) of finished ones."""
        live = set(req_ids)
        gone = [r for r in self._slot_of if r not in live]
        if gone:
            slots = [self._slot_of.pop(r) for r in gone]
            self.pool.release(torch.tensor(slots, dtype=torch.long, device=self.device))
            for s in slots:
                self.runtime.reset_slot(s)
                self.stats.finish(s)
                self._last_suffix_len[s] = self._last_main[s] = self._ctx_seen[s] = 0
            self._free_slots += slots
        for r in req_ids:
            if r is not None and r not in self._slot_of:
                slot = self._slot_of[r] = self._free_slots.pop()
                self.stats.start(slot, r)

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
        """Pool updates and counters from one verification. Shapes: draft [B, D], target
        [B, D+1], n [B] (tokens verified per request)."""
        L = self.cfg.phrase_len
        slots = np.array([self._slot_of.get(r, -1) for r in req_ids], np.int64)
        ok = (n > 0) & (slots >= 0)
        if not ok.any():
            return
        slots, draft, target, n = slots[ok], draft[ok], target[ok], n[ok]
        n_main = np.minimum(self._last_main[slots], n)
        s_len = np.minimum(self._last_suffix_len[slots], n - n_main)
        l_d = feedback.accepted_lengths(draft, target, n)
        insp = refn = feedback.Phrases.empty(L)
        if self.cfg.use_inspiration:
            insp = feedback.inspiration(draft, target, n, slots, L, l_d=l_d)
            if len(insp):
                self.pool.insert(*self._to_device(insp.keys, insp.tokens, insp.owners))
        if self.cfg.use_refinement:
            refn = feedback.refinement(target, n_main, s_len, self._last_suffix_key[slots], n, slots, L)
            if len(refn):
                old = self._last_suffix[refn.owners]
                keys, old, new, owners = self._to_device(refn.keys, old, refn.tokens, refn.owners)
                self.pool.replace(keys, old, new, owners)
        self.stats.add(
            slots, target_forwards=np.ones_like(n), drafted_tokens=n, accepted_tokens=l_d,
            suffix_accepted=np.where(s_len > 0, np.maximum(l_d - n_main, 0), 0))
        self.stats.add(insp.owners, inspiration_inserts=np.ones_like(insp.owners))
        self.stats.add(refn.owners, refinement_inserts=np.ones_like(refn.owners))

    def _learn_context(self, slots, token_ids, rows, lens) -> None:
        """Phrases of the text confirmed since the slot's last round (the prompt, at first)."""
        L = self.cfg.phrase_len
        start = np.maximum(self._ctx_seen[slots] - L, np.maximum(lens - self.cfg.context_phrase_window, 0))
        ph = feedback.context_phrases(token_ids, rows, lens, start, slots, L)
        if len(ph):
            self.pool.insert(*self._to_device(ph.keys, ph.tokens, ph.owners))
        self._ctx_seen[slots] = lens

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]

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
        n_new = np.fromiter((len(t) for t in sampled_token_ids), np.int64, B)
        rows = np.nonzero(n_new)[0]
        proposals: list[list[int]] = [[] for _ in range(B)]
        if len(rows) == 0:
            return proposals
        slots = np.array([self._slot_of[req_ids[i]] for i in rows], np.int64)
        lens = np.asarray(num_tokens_no_spec[rows], np.int64)
        if self.cfg.use_context_phrases:
            self._learn_context(slots, token_ids_cpu, rows, lens)
        out = self.runtime.run_round(slots, token_ids_cpu, rows, lens)

        # Chain for the target: sentence draft, then the best suffix, within the token cap.
        cap, L = self.num_spec_tokens, self.cfg.phrase_len
        n_main = np.minimum(out.draft_lens, cap)
        has_suffix = out.suffix_valid[:, 0] if out.suffix_valid.shape[1] else np.zeros(len(rows), bool)
        s_len = np.where(has_suffix, np.minimum(L, cap - n_main), 0)
        chain = np.concatenate([out.drafts, out.suffixes[:, 0] if out.suffixes.shape[1]
                                else np.zeros((len(rows), L), np.int64)], axis=1)
        # Move each row's suffix right behind its draft.
        col = np.arange(chain.shape[1])[None, :]
        src = np.where(col < n_main[:, None], col, out.drafts.shape[1] + col - n_main[:, None])
        chain = np.take_along_axis(chain, np.minimum(src, chain.shape[1] - 1), axis=1)
        total = n_main + s_len
        for b, i in enumerate(rows):
            proposals[i] = chain[b, :total[b]].tolist()

        ctx_last = token_ids_cpu[rows, lens - 1].astype(np.int64)
        self._last_main[slots] = n_main
        self._last_suffix_len[slots] = s_len
        if out.suffixes.shape[1]:
            self._last_suffix[slots] = out.suffixes[:, 0]
        self._last_suffix_key[slots] = np.where(
            n_main > 0, out.drafts[np.arange(len(rows)), np.maximum(n_main - 1, 0)], ctx_last)
        self.stats.round_done(out.forwards, out.prefill_forwards, len(rows))
        self.stats.add(slots, generated_tokens=n_new[rows], draft_forwards=out.row_forwards,
                       prefill_forwards=out.row_prefills, guess_tokens=out.guess_tokens,
                       guess_lookups=out.row_forwards if self.runtime.G else np.zeros_like(slots),
                       guess_hits=out.guess_hit_forwards)
        self._metrics.maybe_write(lambda: self.snapshot(per_request=False))
        self._maybe_save_pool()
        return proposals

    def snapshot(self, per_request: bool = True) -> dict:
        """Aggregate (and per-request) counters, plus the pool's."""
        pool = self.pool.stats() if self.pool is not None else None
        return self.stats.snapshot(pool, per_request=per_request)
