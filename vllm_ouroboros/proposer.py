"""The vLLM-facing Ouroboros proposer (loaded by vLLM's custom_class hook).

One step, as vLLM drives it:
  on_verified() the target just verified last step's tree: its tokens at every node, also
               after the first rejection and on every suffix, feed the pool (candidate
               inspiration + refinement)                                -> feedback.py, pool.py
  propose()    draft a sentence phrase by phrase for every running request and lengthen it
               with K candidate suffixes from the pool                  -> draft/runtime.py
vLLM then verifies [draft | suffix 0 | suffix 1 | ...] as one token tree in one target forward
(patches/tree_verify.py); with K = 1, or where the tree path is off, that is a plain chain.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time

import numpy as np
import torch

from vllm_ouroboros import LOGGER_NAME, cost_model, feedback, proposal_layout
from vllm_ouroboros.backoff_estimates import ESTIMATE_RATE, MAX_PROBE_GAP, PROBE_GAP, BackoffEstimates
from vllm_ouroboros.config import OuroborosConfig, cost_points, resolved_draft_round, resolved_threshold
from vllm_ouroboros.device_clock import ForwardClock
from vllm_ouroboros.draft.acceptance_head import load_head
from vllm_ouroboros.draft.kv_cache import PAGE_SIZE, DraftCacheFull, pages_for
from vllm_ouroboros.draft.model import DraftModel
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings, cache_growth_warning
from vllm_ouroboros.host_copy import to_device
from vllm_ouroboros.metrics import TRACE_ENV, OuroborosStats, RoundTrace
from vllm_ouroboros.metrics_export import ENV_DIR, CounterFile, SnapshotWriter, new_writer_id
from vllm_ouroboros.mode_review import ModeReview
from vllm_ouroboros.patches.distributed import TensorParallel
from vllm_ouroboros.pool import PhrasePool
from vllm_ouroboros.pool_draft import (branch_gains, branch_prior, branches_under_cut, queue_pool_drafts,
                                       unsent_branch_gain)
from vllm_ouroboros.pool_warmup import warm_pool_kernels
from vllm_ouroboros.pool_saver import PoolSaver
from vllm_ouroboros.pool_writer import PoolWriter
from vllm_ouroboros.request_slots import RequestSlots
from vllm_ouroboros.round_length import RoundLength

logger = logging.getLogger(LOGGER_NAME)

# Steps whose drafting raised, in a row, after which drafting is off for the engine's life.
MAX_FAILURES_IN_A_ROW = 3
# Seconds between checks of the pool's recency clock (it is moved back before it overflows).
CLOCK_CHECK_INTERVAL = 10.0
POOL_OUTLIER = 3.0  # a pool lookup's timing counts at most this many times the running mean
# A round's or a catch-up prefill's measured / modeled ratio counts at most this many times the
# running ratio. One stalled round (its ratio clamped at 4) moved a whole round's price from 0.8
# to 1.76: whole rounds then lose the back-off's plans and the draft model's mode the review,
# and no whole round runs again to bring the price back. In two of five MT-Bench runs on this
# CPU it ended at 1.18 and 2.22 (0.73-0.80 in the others) and the review moved to the pool mode
# (results/README.md, "Session of 2026-12-02 (fifteenth)"). Capped upward only: a price set too
# low draws the rounds that measure it again, one set too high does not. A real rise of cost is
# still followed within a few rounds (x2 a round at most).
RATIO_OUTLIER = 2.0


def _holds_pool(method):
    """Run `method` holding the proposer's pool lock: under vLLM's Ray executors a worker's
    steps run on the compiled graph's thread while the engine core's shutdown RPC saves the
    pool on the actor's own thread; the save must not read the pool halfway through a step's
    inserts. Re-entrant: the step writes the metrics snapshot (`snapshot`, held too) inside
    itself. Uncontended otherwise (one acquire per call, well under a microsecond)."""
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self._pool_lock:
            return method(self, *args, **kwargs)

    return held


def _changes_pool(method):
    """`_holds_pool`, and the pool's version moves on (`_pool_version`): a save at shutdown
    skips a pool its file holds already (pool_saver.PoolSaver.shutdown). Over-counting only
    costs a write; a change outside these methods would be lost at shutdown."""
    @functools.wraps(method)
    def changes(self, *args, **kwargs):
        self._pool_version += 1
        return method(self, *args, **kwargs)

    return _holds_pool(changes)


def _pool_guard(proposer) -> None:
    """The state `_holds_pool` and `_changes_pool` read, set on a new proposer (tests that build
    one bare call it too: tests/conftest.py `bare_proposer`)."""
    proposer._pool_lock = threading.RLock()  # a step's pool work vs a save from another thread
    proposer._pool_version = 0  # moves on with every call that may change the pool (_changes_pool)


# What drafted a slot's last proposal (_source): the back-off's estimates it teaches.
NO_DRAFT, MODEL_DRAFT, POOL_DRAFT = 0, 1, 2
# After the draft cache failed to grow (device memory), steps that draft only for the requests
# that fit before growing is tried again; the wait doubles with each failure, up to this.
MAX_CACHE_RETRY_GAP = 256
# Seconds between warnings that the draft cache could not grow: under load that fluctuates it
# fills again every few steps (86 warnings in 40 s in a serving test), counted in between.
CACHE_FULL_LOG_INTERVAL_S = 60.0
CAPTURED_BATCH = 64  # draft_round "graph": batches captured at load (larger ones on first use)
# A bound on the tokens a round writes past a request's context (DraftRuntime's round room:
# 72 at the defaults), for the smallest draft_cache_max_mb that can work.
ROUND_ROOM_BOUND = 128

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _ms(curve: cost_model.CostCurve) -> str:
    """A cost curve for the log: "n:ms" points."""
    return ", ".join(f"{n}:{1000 * t:.1f}" for n, t in zip(curve.n, curve.seconds))


def initial_cache_tokens(page_bytes: int, tokens: int, limit: int | None,
                         min_tokens: int = 64) -> int:
    """Tokens of draft-cache pages allocated at load (draft/kv_cache.py, PAGE_SIZE tokens a
    page, page_bytes bytes each): `tokens`, or as many as `limit` bytes hold beside the null
    page. Raises ValueError where the limit holds less than one request of `min_tokens` tokens
    and what its round writes past them (ROUND_ROOM_BOUND)."""
    if limit is None:
        return tokens
    fit = (limit // page_bytes - 1) * PAGE_SIZE
    least = pages_for(min_tokens + ROUND_ROOM_BOUND) * PAGE_SIZE
    if fit < least:
        need = (least // PAGE_SIZE + 1) * page_bytes / 2**20
        raise ValueError(f"ouroboros: draft_cache_max_mb = {limit / 2**20:g} holds less than one "
                         f"request of {min_tokens} tokens and its draft ({need:.2f} MiB)")
    return min(tokens, fit)


class OuroborosProposer:
    """Ouroboros drafting for vLLM's V1 model runner (custom_class interface)."""

    is_ouroboros = True  # the runner patches look for this

    # The drafting mode in force (cost_model.MODES): chosen at load, switched by the review; the
    # "pool" mode drafts from the pool alone (pool_draft.py). None before load_model, which
    # drafts with the model.
    _mode: cost_model.DraftingMode | None = None
    drafting_mode_at_load: str | None = None
    # Switches between the draft model's mode and the pool mode while serving (mode_review.py);
    # None: the mode stays as chosen (a switch pinned, no target curve, or calibrate_costs off).
    _mode_review: ModeReview | None = None

    @property
    def drafting_mode(self) -> str | None:
        """The name of the drafting mode in force (cost_model.MODES), None before load_model."""
        return None if self._mode is None else self._mode.name

    @property
    def pool_only(self) -> bool:
        """Whether this step drafts from the pool alone (no draft forward)."""
        return self._mode is not None and not self._mode.uses_draft

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
        self.target_vocab = vllm_config.model_config.get_vocab_size()
        self.max_slots = vllm_config.scheduler_config.max_num_seqs
        self.stats = OuroborosStats(self.max_slots)
        self.runtime: DraftRuntime | None = None
        self.pool: PhrasePool | None = None
        self._writer: PoolWriter | None = None  # the step's inserts around the round (pool_writer.py)
        self._slot_of = RequestSlots(self.max_slots)
        self._req_ids: list[str] = []
        self._saver: PoolSaver | None = None  # where the pool has a file (pool_saver.py)
        _pool_guard(self)
        self._last_clock_check = time.monotonic()
        # Drafting that raised (_draft_failed): steps in all, in a row, the kinds logged, and
        # why drafting is off (None: on).
        self.draft_failures = 0
        self._failures_in_a_row = 0
        self._failure_kinds: set[str] = set()
        self._drafting_off: str | None = None
        # What each slot was proposed last step, to read its verification (host arrays):
        # sentence-draft length, the suffixes sent after it (in flat order) and the token they
        # hang off.
        L, K = self.cfg.phrase_len, max(self.cfg.num_suffixes, 1)
        self._last_main = np.zeros(self.max_slots, np.int64)
        self._last_suffix = np.zeros((self.max_slots, K, L), np.int64)
        self._last_suffix_len = np.zeros((self.max_slots, K), np.int64)
        self._last_suffix_key = np.zeros(self.max_slots, np.int64)
        # Tree verification: available (decided by the runner once its KV cache is allocated:
        # None until then, "available", or why not) and allowed for the current batch (no
        # structured outputs; sampling features the walk honours).
        self._tree_decision: str | None = None
        self._tree_ok_structured = True
        self._tree_ok_sampling = True
        # Why nothing is drafted now (a request samples with settings no verifier of drafts
        # applies: set_drafting_allowed_for_sampling), None while drafting runs; reasons logged.
        self._sampling_pause: str | None = None
        self._pause_reasons: set[str] = set()
        # Drafting steps that sent chains where the tree was on (a request in the batch needs
        # what the tree path does not do), and the reasons logged so far.
        self._chain_steps = 0
        self._chain_reasons: set[str] = set()
        self._ctx_seen = np.zeros(self.max_slots, np.int64)  # context length already in the pool
        # Back-off (cost_model.speculation_plan): both cost curves, measured at load, and per
        # request running means of what a step gives (P(accepted >= k) and P(sent >= k) for
        # k = 1..S, whose sums are the tokens per target forward and the target tokens of a
        # draft cut to s tokens) and costs (draft forwards at full length). Optimistic priors,
        # so that a request starts by speculating and measures; one hard request does not stop
        # the others.
        self.cost: cost_model.CostCurve | None = None  # the draft's
        # The draft's prefill forwards: `cost` itself (chunks replayed from graphs in the graph
        # round, eager forwards elsewhere), or an eager curve where the prefill graphs failed at load.
        self.prefill_cost: cost_model.CostCurve | None = None
        self._prefill_scale = 1.0  # measured / modeled prefill seconds (_calibrate_prefill)
        self._prefill_scale_graphed = False  # whether that scale was measured on graph replays
        self._draft_scale = np.ones(2)  # measured / modeled round seconds: whole, chain (_calibrate_draft)
        self._draft_scale_rounds = np.zeros(2, np.int64)  # rounds measured into each
        self.drafting_costs: dict[str, float] = {}  # modeled seconds per output token, by mode
        # Forwards per device / graph round, chosen online (round_length.py); None: host loop,
        # or no target curve to weigh them against.
        self._round_length: RoundLength | None = None
        self._round_forwards = 0  # F of the round whose drafts the next on_verified reads
        self.target_cost: cost_model.CostCurve | None = None
        # The target's forwards timed as they run (the patched runner, through target_clock)
        # against its measured curve (not a configured one): reported in the snapshot.
        self._target_calibration: cost_model.CurveCalibration | None = None
        self.target_clock: ForwardClock | None = None
        self._prior_tokens_per_fwd = 1.0 + 0.5 * self.num_spec_tokens
        S = self.num_spec_tokens
        prior = cost_model.geometric_survival(self._prior_tokens_per_fwd, S)[0]
        # The draft model's drafts and the pool's (pool mode, pool fill) are measured apart
        # (backoff_estimates.py): a request may accept one's and not the other's. Both start
        # optimistic; the pool's prior then follows what the pool gave the requests before (a
        # new request and a probe start there). With the prior fixed, every request's pool
        # drafts went whole at its start and at each probe: 0.65x no speculation against 0.79x
        # without pool fill at 16 requests on this CPU, 11% accepted. Seeded low instead (the
        # pool mode's E, 1.47, as a geometric survival), it never measured the positions past
        # its first cut drafts: on a flat curve the pool mode sent no suffix and the mode review
        # measured no whole pool row (results/README.md, "Session of 2026-11-29 (ninth)").
        self._model_est = BackoffEstimates(self.max_slots, prior)
        self._pool_est = BackoffEstimates(self.max_slots, prior, learn_prior=True)
        # The pool's branches apart again: what their k-th token adds is not the chain's.
        self._branch_est = BackoffEstimates(
            self.max_slots, branch_prior(prior, self.cfg.phrase_len, max(self.cfg.tree_suffixes, 1)),
            learn_prior=True)
        self._branched = np.zeros(self.max_slots, bool)  # the pool drafted branches last step
        self._source = np.zeros(self.max_slots, np.int8)  # NO_DRAFT, MODEL_DRAFT, POOL_DRAFT
        # The pool's lookups per step it drafts in (seconds, running mean): what the pool's
        # plans and the mode review charge it beside its target tokens (None: not yet timed).
        self._pool_seconds: float | None = None
        self._last_cut = np.full(self.max_slots, S, np.int64)  # most tokens sent last step
        # The last proposal was bounded by its room (max_model_len, max_tokens) rather than by
        # the plan's cut: whole or cut, it says nothing of what the mode gives a row with room
        # (mode review).
        self._room_cut = np.zeros(self.max_slots, bool)
        # The most tokens each request's context can reach (prompt + max_tokens, else
        # max_model_len): what a draft cache that must catch up is weighed against, and what
        # bounds each proposal (only what the request can still emit).
        self._len_limit = np.full(self.max_slots, self.max_model_len, np.int64)
        self._length_limit_of = None  # req_id -> limit or None (set_batch, from the runner)
        # Whether the draft can read the request's prompt: not where it came as embeddings
        # (prompt_embeds), whose token ids vLLM never had. Its rows of the input batch hold the
        # ids of whatever request had the row before (or zeros): a draft from them is noise
        # that the target would verify at full price.
        self._readable = np.ones(self.max_slots, bool)
        self._prompt_readable_of = None  # req_id -> bool (set_batch, from the runner)
        self._told_unreadable = False
        self._draft_forwards = np.full(self.max_slots, float(self.cfg.gamma))
        # Sentence-draft tokens per model row in a whole round (_round_cost, where no round of
        # its F was measured): gamma for a fixed length; measured where the acceptance head
        # sets it (from gamma: no round yet).
        self._draft_tokens = float(self.cfg.gamma)
        self._cache_retry_gap, self._cache_retry_wait = PROBE_GAP, 0
        self._cache_full_logged_at, self._cache_full_unlogged = -float("inf"), 0
        self._caches_dropped = 0  # absent requests' draft-cache pages released under pressure
        self._overhead = cost_model.StepOverhead(None)  # its curve is set at load
        # Suffixes on auto (cost_model.rows_sending_suffixes): per request, running means of the
        # tokens a step gives from the draft alone (+1) and of the suffix tokens accepted in
        # steps whose draft was accepted whole (the only steps where a suffix can add any: its
        # yield); a step's expected gain is that yield times the chance its draft is accepted
        # whole (the back-off's survival estimate at the draft's length). A new request starts
        # from the mean yield over all requests (optimistic before any), and one whose suffixes
        # are off sends them again as a probe (same gaps as the back-off).
        self._base_tokens = np.full(self.max_slots, self._prior_tokens_per_fwd)
        self._suffix_yield_all = 0.5 * self.cfg.phrase_len
        self._suffix_yield = np.full(self.max_slots, self._suffix_yield_all)
        self._suffix_gap = np.full(self.max_slots, PROBE_GAP, np.int64)
        self._suffix_wait = np.full(self.max_slots, PROBE_GAP, np.int64)
        # Under tensor parallelism the first rank of the group drafts and the others take its
        # proposals (patches/distributed.py); it alone reports.
        self._tp = TensorParallel.current()
        metrics_dir, writer = os.environ.get(ENV_DIR) if self._tp.leads else None, new_writer_id()
        self._metrics = SnapshotWriter(metrics_dir, writer=writer)
        self._counters = CounterFile(metrics_dir, writer=writer)
        self._trace = RoundTrace(os.environ.get(TRACE_ENV) if self._tp.leads else None)
        self.fusions: list = []  # what _choose_fusions timed at load (CUDA)

    # ---- set-up ------------------------------------------------------------------------------
    def load_model(self, target_model=None) -> None:
        """Load the draft and allocate its KV and the pool (inside vLLM's memory profiling):
        the draft model and its cache, the cost curves, the drafting mode, the pool, the
        runtime and its graphs, in that order (each step reads the ones before). A TP rank
        other than the first loads nothing: it only joins the collectives of the target's cost
        curve."""
        cfg = self.cfg
        if not self._tp.leads:
            if target_model is not None and cfg.target_cost_ms is None:
                from vllm_ouroboros.patches.target_cost import measure_target_curve

                measure_target_curve(target_model, 256, agree=self._tp.agree, all_ok=self._tp.all_ok)
            logger.info("ouroboros: TP rank %d of %d takes the first rank's drafts (no draft "
                        "model loaded here)", self._tp.rank, self._tp.size)
            return
        draft_round = resolved_draft_round(cfg, self.device.type,
                                           bool(getattr(self.vllm_config.model_config, "enforce_eager", False)))
        # With graphs, slots for every batch captured below: a block table or page store that
        # grows drops the graphs (they hold its address), so the 17th request, or the pages of
        # 16 requests of draft_initial_len tokens, would otherwise cost a recapture.
        init_slots = min(self.max_slots, CAPTURED_BATCH if draft_round == "graph" else 16)
        init_len = min(self.max_model_len, cfg.draft_initial_len)
        limit = None if cfg.draft_cache_max_mb is None else int(cfg.draft_cache_max_mb * 2**20)
        model = self._load_draft(draft_round, init_slots, init_len, limit)
        self._measure_curves(model, target_model, draft_round, init_len)
        use_lookahead, use_guesses = self._choose_mode()
        # Keyed by every id the target can emit (a draft with fewer rows reads some as one).
        self.pool = self._make_pool(self.target_vocab)
        # Compiled now, not in a serving step (and its timings): pool_warmup.py.
        warm_pool_kernels(self.pool, cfg.max_draft_len, cfg.tree_suffixes)
        self._make_runtime(model, draft_round, init_slots, init_len, use_lookahead, use_guesses)
        if self.device.type == "cuda":
            worst = model.cache_bytes(self.max_slots * self.runtime.max_slot_len)
            warning = cache_growth_warning(
                worst if limit is None else min(worst, limit), model.kv.bytes,
                (1 - self.vllm_config.cache_config.gpu_memory_utilization)
                * torch.cuda.get_device_properties(self.device).total_memory,
                self.max_slots, self.runtime.max_slot_len)
            if warning:
                logger.warning("ouroboros: %s", warning)
        if self._saver is not None:  # a second load: its pool is gone
            self._saver.close()
            self._saver = None
        if cfg.pool_save_path and self.pool is not None:
            self._saver = PoolSaver(self.pool, cfg.pool_save_path, self._pool_lock, self._flush_staged,
                                    version=lambda: self._pool_version)
            self._saver.register_exit()
        logger.info("ouroboros: draft %s loaded (%s), pool budget %.1f MiB, draft KV cache %.1f MiB "
                    "(%d pages of %d tokens shared by the requests; grows on demand%s)",
                    cfg.draft_model, model.dtype, cfg.pool_budget_mb, model.kv.bytes / 2**20,
                    model.kv.num_pages, model.kv.page_size,
                    "" if limit is None else f" up to {cfg.draft_cache_max_mb:g} MiB")
        # /metrics' gauges from the start (a warm start's loaded pool read 0 until a step ran).
        self._metrics.maybe_write(lambda: self.snapshot(per_request=False), force=True)

    def _load_draft(self, draft_round: str, init_slots: int, init_len: int, limit: int | None) -> DraftModel:
        """The draft model with its options (fused layers, norm-in-product, the CPU's oneDNN
        products), a paged cache for init_slots requests of init_len tokens (at most `limit`
        bytes, None: unbounded), its attention kernel checked and, on CUDA, its fusions chosen
        by timing (self.fusions)."""
        cfg = self.cfg
        if cfg.draft_dtype == "auto":
            dtype = self.vllm_config.model_config.dtype
        else:
            dtype = _DTYPES[cfg.draft_dtype]
        model = DraftModel.from_pretrained(cfg.draft_model, dtype=dtype, device=self.device)
        # One tokenizer, embeddings padded to other sizes (config._validate_draft checked it).
        model.fit_vocab(self.target_vocab)
        model.attention_backend = cfg.draft_attention
        model.fused_ops = (self.device.type == "cuda" if cfg.draft_fused_ops is None
                           else cfg.draft_fused_ops)
        # auto (None) turns it on only on CUDA, where _choose_fusions then times it.
        if (cfg.draft_norm_gemm or (cfg.draft_norm_gemm is None and self.device.type == "cuda"
                                    and model.fused_ops)) and (why := model.enable_norm_gemm()) is not None:
            logger.warning("ouroboros: draft_norm_gemm stays off: %s", why)
        if self.device.type == "cpu" and cfg.draft_cpu_gemm == "auto":
            from vllm_ouroboros.patches.cpu_gemm import onednn_gemm_factory

            factory = onednn_gemm_factory(dtype=model.dtype)
            if factory is not None:
                model.use_gemm(factory)
        tokens = initial_cache_tokens(model.cache_bytes(PAGE_SIZE), init_slots * init_len, limit)
        # Pages shared by the requests: one long request takes more of them, not every slot.
        model.allocate_cache(init_slots + 1, init_len, num_tokens=tokens, limit_bytes=limit)
        # On CUDA: the kernel checked (and compiled) before anything is timed or captured.
        reason = model.check_attention_kernel()
        if reason is not None:
            logger.warning("ouroboros: the tree-attention kernel failed its check on this GPU, so "
                           "the draft's attention uses torch SDPA: %s", reason)
        if self.device.type == "cuda":
            self.fusions = self._choose_fusions(model, draft_round, init_len)
        return model

    def _measure_curves(self, model: DraftModel, target_model, draft_round: str, init_len: int) -> None:
        """The cost curves the back-off and the mode choice read: the draft's t(n) (timed as
        the round will run it, or as configured), its prefill's, and the target's (configured,
        timed on target_model, or the draft's scaled by the size ratio), with the step overhead
        (measured only where calibrate_costs is on) and the target's calibration beside it."""
        cfg = self.cfg
        if cfg.draft_cost_ms is not None:
            self.cost = cost_model.curve_from_ms(cost_points(cfg.draft_cost_ms))
        else:  # timed as the round will run it: replayed from CUDA graphs in graph mode
            self.cost = cost_model.measure_draft_curve(model, min(init_len, 256),
                                                       graphs=draft_round == "graph")
        # The prefill's forwards: with graphs, chunks replayed from them (draft/prefill_graph.py),
        # each costing the graph curve at its rows x chunk tokens; else eager, the curve as timed.
        self.prefill_cost = self.cost
        if cfg.target_cost_ms is not None:
            self.target_cost = cost_model.curve_from_ms(cost_points(cfg.target_cost_ms))
            logger.info("ouroboros: target forward t(n) as configured (target_cost_ms): %s ms",
                        _ms(self.target_cost))
        elif target_model is not None:
            from vllm_ouroboros.patches.target_cost import measure_target_curve, target_parameter_count

            self.target_cost = measure_target_curve(target_model, 256, agree=self._tp.agree,
                                                    all_ok=self._tp.all_ok)
            if self.target_cost is None:  # same shape as the draft's, scaled by the size ratio
                r = sum(p.numel() for p in model.parameters()) / max(target_parameter_count(target_model), 1)
                self.target_cost = cost_model.CostCurve(self.cost.n, tuple(t / r for t in self.cost.seconds))
            logger.info("ouroboros: target forward t(n) (linear layers + LM head): %s ms",
                        _ms(self.target_cost))
            self._target_calibration = cost_model.CurveCalibration(self.target_cost)
            self.target_clock = ForwardClock(self.device)
        if self.target_cost is not None and cfg.calibrate_costs:
            # Not with calibrate_costs off: against another device's curve (an H200's 2 ms
            # forward reproduced on this CPU), this host's whole forward would count as the
            # engine's overhead per step (243 ms), which prices any speculation as paying.
            self._overhead = cost_model.StepOverhead(self.target_cost)

    def _choose_mode(self) -> tuple[bool, bool]:
        """The drafting mode at load from the curves (cost_model.choose_drafting_mode; pinned
        options kept), and its review while serving where nothing is pinned. Returns the
        runtime's (use_lookahead, use_guesses): the draft model's best mode, also where the
        pool mode was chosen (the review may switch to the draft model)."""
        cfg = self.cfg
        # Target tokens per step: the current token, a gamma-token draft and one suffix.
        # The pool's drafts are branches where the tree will be sent (the tree is decided when
        # the target's KV cache is allocated, after this; a refusal then leaves the chain).
        branches = cfg.pool_drafts_branches
        costs = cost_model.drafting_mode_costs(self.cost, self.target_cost, cfg.window_size,
                                               cfg.num_guesses, cfg.phrase_len, 1 + cfg.gamma + cfg.phrase_len,
                                               branches)
        # An adaptive draft length is the draft model's (its acceptance head stops its drafts).
        use_draft = True if cfg.use_draft is None and cfg.draft_length == "adaptive" else cfg.use_draft
        mode = cost_model.choose_drafting_mode(costs, cfg.use_lookahead, cfg.use_guesses, use_draft)
        # The runtime is built for the draft model's best mode even where the pool mode was
        # chosen: the review below may switch to it.
        drafted = mode if mode.uses_draft else cost_model.choose_drafting_mode(
            costs, cfg.use_lookahead, cfg.use_guesses, True)
        use_lookahead = drafted.use_lookahead if cfg.use_lookahead is None else cfg.use_lookahead
        use_guesses = drafted.use_guesses if cfg.use_guesses is None else cfg.use_guesses
        self.drafting_costs = costs
        self._mode, self.drafting_mode_at_load = mode, mode.name
        if (self.target_cost is not None and cfg.calibrate_costs and cfg.mode_review_steps and use_draft is None
                and cfg.use_lookahead is None and cfg.use_guesses is None):
            pool = cost_model.pool_mode(branches)
            self._mode_review = ModeReview(
                drafted, pool,
                drafted.row_tokens(cfg.window_size, cfg.num_guesses, cfg.phrase_len),
                1 + cfg.gamma + cfg.phrase_len, cfg.mode_review_steps)
        logger.info(
            "ouroboros: draft forward t(n) on %s%s: %s ms; modeled ms per output token: %s -> %s%s",
            self.device.type, " as configured (draft_cost_ms)" if cfg.draft_cost_ms is not None else "",
            _ms(self.cost),
            ", ".join(f"{m.name} ({m.row_tokens(cfg.window_size, cfg.num_guesses, cfg.phrase_len)} tokens "
                      f"per row) {1000 * costs[m.name]:.1f}" if m.uses_draft else
                      f"{m.name} (no draft forward) {1000 * costs[m.name]:.1f}" for m in cost_model.MODES),
            "drafts from the pool alone, no draft forward (pool_draft.py)" if self.pool_only else
            f"Jacobi window {'on' if use_lookahead else 'off'}, pool guesses {'on' if use_guesses else 'off'}",
            "" if cfg.use_lookahead is None and cfg.use_guesses is None and cfg.use_draft is None
            else " (as configured where pinned)")
        if self._mode_review is not None:
            logger.info("ouroboros: the drafting mode is reviewed every %d decoding steps from what the "
                        "engine measures, between %s and the pool alone (mode_review.py)",
                        cfg.mode_review_steps, drafted.name)
        return use_lookahead, use_guesses

    def _make_pool(self, vocab_size: int) -> PhrasePool:
        """The phrase pool: loaded from pool_load_path, else empty, under pool_budget_mb."""
        cfg = self.cfg
        budget = int(cfg.pool_budget_mb * 2**20)
        if cfg.pool_load_path:
            pool = PhrasePool.load(cfg.pool_load_path, device=self.device, budget_bytes=budget,
                                   shared=cfg.warm_start, phrases_per_key=cfg.window_size)
            logger.info("ouroboros: loaded phrase pool from %s", cfg.pool_load_path)
        else:
            pool = PhrasePool(vocab_size, cfg.phrase_len, cfg.window_size, budget,
                              device=self.device, shared=cfg.warm_start)
        logger.info("ouroboros: phrase pool inserts and lookups through %s and %s", *(
            "Triton kernels" if b == "triton" else
            f"torch ({pool.backend_reasons.get(op, 'its kernels serve CUDA only')})"
            for op, b in (("insert", pool.insert_backend), ("lookup", pool.lookup_backend))))
        return pool

    def _make_runtime(self, model: DraftModel, draft_round: str, init_slots: int, init_len: int,
                      use_lookahead: bool, use_guesses: bool) -> None:
        """The drafting runtime (with the acceptance head where the draft length is adaptive),
        its round's and prefill's CUDA graphs in graph mode (captured now, while vLLM profiles
        memory), the pool writer, and the online choice of forwards per round where the round
        runs a fixed F."""
        cfg = self.cfg
        head, threshold = None, 0.5
        if cfg.draft_length == "adaptive":
            loaded = load_head(cfg.acceptance_head, cfg.draft_model, self.device)
            head, threshold = loaded.head, resolved_threshold(cfg, loaded.threshold)
            logger.info("ouroboros: adaptive draft length, head %s, h=%.3f, cap %d tokens",
                        cfg.acceptance_head, threshold, cfg.max_draft_length)
        settings = DraftSettings(
            gamma=cfg.gamma, beta=cfg.beta, window_size=cfg.window_size,
            num_guesses=cfg.num_guesses,
            num_suffixes=cfg.tree_suffixes,
            use_lookahead=use_lookahead, use_guesses=use_guesses,
            max_draft_forwards=cfg.max_draft_forwards,
            draft_length=cfg.draft_length, acceptance_threshold=threshold,
            max_draft_length=cfg.max_draft_length,
            draft_round=draft_round,
            round_kernels="torch" if cfg.draft_fused_ops is False else "auto",
        )
        self.runtime = DraftRuntime(model, self.pool, settings, init_slots, self.max_model_len,
                                    self.device, head=head, max_slots=self.max_slots)
        rnd = self.runtime.device_round
        if rnd is not None:
            logger.info("ouroboros: the drafting round's inputs and bookkeeping through %s", (
                "Triton kernels" + (" (the adaptive rule's commit in torch)" if rnd._commit is None else "")
                if rnd.kernels == "triton" else
                f"torch ({rnd.kernel_reason or 'as configured, or the kernels serve CUDA only'})"))
        self.runtime.prefill_cost = self.prefill_cost
        if settings.draft_round == "graph" and self._may_draft:
            # Captured now, while vLLM profiles memory, for the batch sizes it may schedule.
            t0 = time.perf_counter()
            n = self.runtime.device_round.capture(range(1, min(self.max_slots, CAPTURED_BATCH) + 1))
            logger.info("ouroboros: captured %d CUDA graphs of the drafting round in %.1f s", n,
                        time.perf_counter() - t0)
            # The prefill's chunk forwards for one to four rows (more are captured when first used).
            with contextlib.suppress(Exception):  # a failure is logged; the prefill then runs eagerly
                n = self.runtime.prefill_graphs.capture([1, 2, 4])
                logger.info("ouroboros: captured %d CUDA graphs of the draft's prefill (%d-token chunks)",
                            n, self.runtime.prefill_graphs.chunk)
            if not self._prefill_graphed() and cfg.draft_cost_ms is None:
                # Eager prefill forwards cost ~10x the graph curve on an H200: the catch-up is
                # planned on an eager curve of its own.
                self.prefill_cost = self.runtime.prefill_cost = cost_model.measure_draft_curve(
                    model, min(init_len, 256), graphs=False)
        self._prefill_scale_graphed = self._prefill_graphed()
        self._writer = PoolWriter(self.pool, graphs=settings.draft_round == "graph")
        if self._writer.graphs:
            logger.info("ouroboros: captured %d CUDA graphs of the step's pool inserts",
                        self._writer.capture())
        dr = self.runtime.device_round
        # A round that exits early runs the forwards its rows need, as the host loop does: no F
        # to choose. (Graphs captured at load fell back above if conditional nodes failed; one
        # failing later leaves F to DeviceRound.forwards_for_next_round.)
        if dr is not None and not dr.early_exit and self.target_cost is not None and self._may_draft:
            self._round_length = RoundLength(dr.max_forwards)
        logger.info("ouroboros: drafting loop: %s%s", "none (pool mode)" if not self._may_draft else
                    f"{settings.draft_round} once the mode review moves to the draft model" if self.pool_only
                    else settings.draft_round,
                    "" if not self._may_draft else
                    " (early exit: CUDA graph conditional nodes)" if dr is not None and dr.early_exit
                    else "" if self._round_length is None else
                    f" (forwards per round chosen online, 1..{self._round_length.max_forwards})")

    @property
    def _may_draft(self) -> bool:
        """Whether the draft model may run: its mode was chosen, or a review may choose it."""
        return not self.pool_only or self._mode_review is not None

    def _choose_fusions(self, model: DraftModel, draft_round: str, init_len: int) -> list:
        """The draft's optional fusions timed on this GPU and kept where faster
        (draft/fusion_choice.py): RoPE inside the attention always, the norm-in-product kernels
        where draft_norm_gemm is auto. Timed as the round runs the draft (graph replays in graph
        mode), at a decode forward and the configured lookahead width, behind a prefix of up to
        256 tokens. Returns the timings (also logged)."""
        from vllm_ouroboros.draft.fusion_choice import choose_all

        cfg = self.cfg
        names = ["rope_in_attention"] + (["norm_gemm"] if cfg.draft_norm_gemm is None else [])
        widths = [1, cost_model.draft_row_tokens(cfg.window_size, cfg.num_guesses, cfg.phrase_len)]
        return choose_all(model, widths, graphs=draft_round == "graph",
                          prefix=max(0, min(256, init_len - max(widths))), names=names)

    @_holds_pool
    def save_pool(self, path: str | None = None) -> None:
        """Write the pool to `path` (default pool_save_path) now, atomically."""
        if self._saver is not None:
            self._saver.save(path)  # the next periodic save counts from this one
        elif path and self.pool is not None:  # no pool_save_path: a one-off writer to `path`
            PoolSaver(self.pool, path, self._pool_lock, self._flush_staged).save()

    @_holds_pool
    def on_idle(self) -> None:
        """The engine's last request was removed (patches/model_runner.py): write the pool file
        unless it holds this pool already (pool_saver.PoolSaver.save_when_idle), where
        `pool_save_on_idle` is on."""
        if self._saver is not None and self.cfg.pool_save_on_idle:
            self._saver.save_when_idle()

    def shutdown(self) -> None:
        """The engine is stopping (the engine core's save RPC, then the worker's shutdown:
        patches/engine_shutdown.py): write the pool file now, unless it holds this pool already
        (pool_saver.PoolSaver.shutdown; a TP rank that follows the first holds no pool)."""
        if self._saver is not None:
            self._saver.shutdown()

    def _flush_staged(self) -> None:
        """Insert the rows staged for the next round's insert (pool_writer.py) before the pool
        is read or changed by anything else."""
        if self._writer is not None:
            self._writer.flush()

    # ---- request lifetime -------------------------------------------------------------------
    def note_finished(self, req_ids) -> None:
        """Requests vLLM finished or aborted this step (called by the runner patch from
        `_update_states`, on every step, scheduled work or not); their slots go at the next sync."""
        self._slot_of.finished(req_ids)

    def note_rewound(self, req_ids, lens) -> None:
        """Requests whose output vLLM cut back to `lens` tokens of context (the runner patch,
        from `_update_states`): what they grow next may differ from what the draft cache and
        the pool's context learning saw past there."""
        slots = self._slot_of.slots(req_ids)
        lens = np.asarray(lens, np.int64)
        mine = slots >= 0
        slots, lens = slots[mine], lens[mine]
        if self.runtime is not None:
            self.runtime.rewind(slots, lens)
        self._ctx_seen[slots] = np.minimum(self._ctx_seen[slots], lens)

    def _sync_requests(self, req_ids) -> None:
        """Give new requests a slot; release the slots (and pool ownership) of finished ones.
        A request absent from this batch (preempted, or left out by the token budget) keeps
        its slot: request_slots.py."""
        changes = self._slot_of.sync(req_ids)
        # The slot table changed already: a new request's state is reset even where a release
        # raised (its step then decodes plainly), or it would inherit the previous occupant's.
        try:
            if changes.released:
                slots = np.asarray(changes.released, np.int64)
                # The host's own state first (nothing here raises): a device release that
                # raises below must not leave a reused slot its old request's proposal.
                for s in changes.released:
                    self.stats.finish(s)
                self._last_suffix_len[slots] = 0
                self._last_main[slots] = self._ctx_seen[slots] = 0
                if self.pool is not None:  # None on a TP rank that follows the first
                    self._flush_staged()  # staged rows keep the owner they were written for
                    self.pool.release(*to_device(self.device, slots))
                if self.runtime is not None:
                    self.runtime.reset_slots(slots)
        finally:
            if changes.assigned:
                self._start_requests(changes.assigned)

    def _start_requests(self, assigned: list[tuple[str, int]]) -> None:
        """New requests in their slots ((request id, slot) each): every per-slot estimate from
        its prior, the request's own limits read from vLLM's runner. The arrays written once
        for all of them (a burst of 256 arrivals took 0.8 ms written a slot at a time)."""
        req_ids = [r for r, _ in assigned]
        new = np.fromiter((slot for _, slot in assigned), np.int64, len(assigned))
        for r, slot in assigned:
            self.stats.start(slot, r)
        for est in (self._model_est, self._pool_est, self._branch_est):
            est.reset(new)
        self._room_cut[new] = False
        self._source[new] = NO_DRAFT
        self._last_cut[new] = self.num_spec_tokens
        limit_of, cap = self._length_limit_of, self.max_model_len
        self._len_limit[new] = cap if limit_of is None else [
            cap if limit is None else min(limit, cap) for limit in map(limit_of, req_ids)]
        readable = self._prompt_readable_of
        self._readable[new] = True if readable is None else [bool(readable(r)) for r in req_ids]
        self._draft_forwards[new] = self.cfg.gamma
        self._base_tokens[new] = self._prior_tokens_per_fwd
        self._suffix_yield[new] = self._suffix_yield_all
        self._suffix_gap[new] = self._suffix_wait[new] = PROBE_GAP

    def update_max_model_len(self, max_model_len: int) -> None:
        """vLLM fitted max_model_len to the KV memory after load (the runner patch calls this):
        proposals end by it, and every request's length limit is at most it."""
        self.max_model_len = max_model_len
        np.minimum(self._len_limit, max_model_len, out=self._len_limit)

    # ---- tree verification switches (set by the runner patches) --------------------------
    def all_ranks_ok(self, ok: bool) -> bool:
        """True on every tensor-parallel rank where every rank passes True (a collective: every
        rank calls it at the same point). For what each rank decides by itself but all must
        share: whether the tree runs, how a sampled tree is walked (the ranks sample alike)."""
        return self._tp.all_ok(ok)

    def set_tree_available(self, reason: str | None) -> None:
        """The runner's decision (tree_verify.TreeState): None where the tree path can run on
        this engine, else why not."""
        self._tree_decision = "available" if reason is None else reason

    def set_tree_allowed(self, ok: bool) -> None:
        """False while a structured-output request is in the batch: vLLM's grammar checks a
        proposal as one chain."""
        self._tree_ok_structured = ok
        if not ok:
            self._log_chain_reason("structured output")

    def set_tree_allowed_for_sampling(self, ok: bool, reason: str | None = None) -> None:
        """False while a request samples with a setting the tree walk does not apply (`reason`,
        patches/tree_verify.unsupported_sampling): vLLM's rejection sampler verifies chains."""
        self._tree_ok_sampling = ok
        if not ok:
            self._log_chain_reason(reason or "a sampling setting the tree walk does not apply")

    def set_drafting_allowed_for_sampling(self, reason: str | None) -> None:
        """`reason` (tree_verify.drafting_pause) while a request in the batch samples with a
        setting that neither the tree walk applies nor vLLM's rejection sampler gets right: a
        step with drafts then rejects them all and samples its roots plainly, so every request
        decodes without drafts until it leaves (counted in sampling_pause_steps), not drafting
        for nothing; None resumes drafting."""
        self._sampling_pause = reason
        if reason is not None and reason not in self._pause_reasons:
            self._pause_reasons.add(reason)
            logger.info("ouroboros: while a request with %s is in the batch, no verifier of drafts "
                        "samples it as vLLM would (the tree walk does not apply to the batch, vLLM's "
                        "rejection sampler gets it wrong): its steps decode without drafts, sampled "
                        "as without speculation; drafting resumes after it (counted in "
                        "sampling_pause_steps)", reason)

    @property
    def drafting_paused(self) -> bool:
        """Whether set_drafting_allowed_for_sampling holds drafting off now."""
        return self._sampling_pause is not None

    def _log_chain_reason(self, why: str) -> None:
        """Say once per reason that steps send chains while such a request is in the batch."""
        if self._tree_decision != "available" or self.cfg.tree_suffixes < 2 or why in self._chain_reasons:
            return
        self._chain_reasons.add(why)
        logger.info("ouroboros: while a request with %s is in the batch, steps send chains (the draft "
                    "and its best suffix, verified by vLLM's rejection sampler) instead of the token "
                    "tree; the tree resumes after it (counted in chain_fallback_steps)", why)

    @property
    def sends_tree(self) -> bool:
        """Whether the next proposals carry all K suffixes (else only the best one)."""
        return self._tree_decision == "available" and self._tree_ok_structured and self._tree_ok_sampling

    def set_batch(self, req_ids: list[str], length_limit=None, prompt_readable=None) -> None:
        """The batch order of this step (propose() receives rows in this order). length_limit:
        req_id -> the most tokens its context can reach (prompt + max_tokens) or None;
        prompt_readable: req_id -> whether its prompt is token ids the draft can read (not
        embeddings); both read once per request when it gets a slot."""
        self._req_ids = list(req_ids)
        self._length_limit_of = length_limit
        self._prompt_readable_of = prompt_readable

    def layouts(self, req_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """What was proposed to each request: draft length [B] and suffix lengths [B, K]."""
        slots = self._slot_of.slots(req_ids)
        known = slots >= 0
        s = np.where(known, slots, 0)
        n = np.where(known, self._last_main[s], 0)
        sl = np.where(known[:, None], self._last_suffix_len[s], 0)
        return n, sl

    # ---- verification feedback ---------------------------------------------------------------
    @_changes_pool
    def on_verified(self, req_ids: list[str], outcome) -> None:
        """Read the target's tokens at every tree node (called by the runner patch).

        `outcome` is target_step.StepOutcome, on the host: the step's TokenTree (its layout)
        and tokens, the target's argmax after the root and after every node, and what each
        request accepted.
        """
        if self.runtime is None:
            return
        tree, lay = outcome.tree, outcome.tree.layout
        B = tree.B
        slots = self._slot_of.slots(req_ids)[:B]
        n, num_nodes, plen, slen, paths = lay.n, lay.num_nodes, lay.path_len, lay.slen, lay.paths
        num_acc, sfx_idx = outcome.num_accepted, outcome.suffix_index
        tokens, tn = outcome.tokens, outcome.target_next
        ok = (num_nodes > 0) & (slots >= 0)
        if not ok.any():
            return
        if paths.shape[1] == 0:  # no suffix slots: the draft chain alone
            paths = np.where(np.arange(tree.D)[None, :] < n[:, None], np.arange(tree.D)[None, :], -1)[:, None]
            plen, slen = n[:, None], np.zeros((B, 1), np.int64)
        sel = np.nonzero(ok)[0]
        s = slots[sel]

        read = (s, n[sel], num_nodes[sel], paths[sel], plen[sel], slen[sel], tokens[sel], tn[sel], num_acc[sel],
                sfx_idx[sel])  # what _learn reads of the rows that verified

        if not outcome.drafts_judged:  # the target's tokens hold; the rejections were not earned
            self._learn(*read)
            return
        # A draft cut to c tokens by the back-off says how far the full draft would have been
        # accepted up to c only: the estimates of its first c positions learn from it. So does
        # a draft that vLLM's scheduler cut to fewer tokens than proposed (the token budget went
        # to other requests): its tokens past the cut were never verified, and counting them as
        # rejected would make the back-off shorten drafts for want of budget, not acceptance.
        proposed = self._last_main[s] + self._last_suffix_len[s].sum(1)
        scheduled = num_nodes[sel]
        by_scheduler = scheduled < proposed
        cut = np.where(by_scheduler, np.minimum(self._last_cut[s], scheduled), self._last_cut[s])
        self.stats.add(s[by_scheduler], scheduler_cut_steps=np.ones(int(by_scheduler.sum()), np.int64))
        whole = cut >= self.num_spec_tokens
        src = self._source[s]
        by_model = src == MODEL_DRAFT
        if self._round_length is not None and self._round_forwards:
            if by_model.any() and whole[by_model].all():  # a cut round's tokens would understate its F
                self._round_length.observe(self._round_forwards, float(num_acc[sel][by_model].mean()) + 1)
            self._round_forwards = 0
        sent = n[sel] + slen[sel].sum(1)
        branched = (src == POOL_DRAFT) & self._branched[s]
        for est, k in ((self._model_est, by_model), (self._pool_est, (src == POOL_DRAFT) & ~branched)):
            if k.any():
                est.observe(s[k], cut[k], num_acc[sel][k], sent[k])
        if self._mode_review is not None:
            # The rows the mode in force drafted (a review, the only switch, runs in propose,
            # after the verification of the step it drafted is read here); pool-filled rows in
            # the draft model's mode are the rows it left, not what the pool mode would yield.
            mine = src == (POOL_DRAFT if self.pool_only else MODEL_DRAFT)
            per_row = num_acc[sel] + 1.0
            counted = whole
            if self.pool_only:
                # A row whose branches the back-off cut counts too, with what its unsent branches
                # are estimated to add (before this step's gains are learnt below): under load
                # the back-off may cut every row, and the mode was then never measured (priced
                # at its prior however the pool did). The scheduler's cuts and max_model_len's
                # stay out: a branch cut in the middle was partly verified, and a row without
                # room is not what the mode gives.
                part = branched & ~whole & ~by_scheduler & ~self._room_cut[s] & mine
                if part.any():
                    per_row[part] += unsent_branch_gain(self._branch_est.accepted[s[part]],
                                                    cut[part] // self.cfg.phrase_len, self.cfg.phrase_len)
                    counted = whole | part
            self._mode_review.observe(self.drafting_mode, per_row[counted & mine],
                                      estimated=int((counted & mine & ~whole).sum()))
        # The suffix decision's two estimates are of a sentence draft and the suffixes after it:
        # the pool's branches (no draft; their suffixes are the whole draft, always sent) would
        # pull a slot's tokens-from-the-draft toward 1 and its yield toward the branches' for
        # the model rows the same slot drafts in pool fill.
        chained = whole & ~branched
        sw = s[chained]
        self._base_tokens[sw] += ESTIMATE_RATE * (
            np.minimum(num_acc[sel][chained], n[sel][chained]) + 1 - self._base_tokens[sw])
        # Suffix tokens accepted in a step that sent them and accepted its draft whole: a step
        # whose draft failed says nothing of its suffixes (they were never reached), and
        # counting it as 0 made the estimate swing with the draft's luck (rate 0.3 over values
        # of 0 or a few tokens), which flipped the decision near its margin.
        reached = (slen[sel].sum(1) > 0) & (num_acc[sel] >= n[sel]) & ~branched
        if reached.any():
            got = (num_acc[sel] - n[sel])[reached]
            self._suffix_yield[s[reached]] += ESTIMATE_RATE * (got - self._suffix_yield[s[reached]])
            self._suffix_yield_all += ESTIMATE_RATE * (float(got.mean()) - self._suffix_yield_all)
        along = self._learn(*read)
        if branched.any():
            # What each branch added over the better-ranked ones, greedy along each (exact for
            # greedy requests; a sampled one's accepted branch counts what it accepted).
            along = along[branched]
            won = sfx_idx[sel][branched]
            rows = np.nonzero(won >= 0)[0]
            along[rows, won[rows]] = num_acc[sel][branched][rows]
            gains = branch_gains(along, (slen[sel][branched] > 0).sum(1), self.cfg.phrase_len,
                                 self.num_spec_tokens)
            self._branch_est.observe(s[branched], cut[branched], num_acc[sel][branched],
                                     sent[branched], gains)

    def _learn(self, slots, n, num_nodes, paths, plen, slen, tokens, tn, num_acc, sfx_idx) -> np.ndarray:
        """Pool updates and counters from one verification, through one chain per suffix:
        the draft followed by suffix k. Shapes: slots/n/num_nodes/num_acc/sfx_idx [B],
        paths [B, K, P] (tree nodes, -1 pad), plen/slen [B, K], tokens [B, N], tn [B, N+1].
        Returns the greedy accepted length along each chain, [B, K]."""
        L = self.cfg.phrase_len
        B, K, P = paths.shape
        rows = np.arange(B)[:, None, None]
        node = np.maximum(paths, 0)
        real = paths >= 0
        chain = np.where(real, tokens[rows, node], -1).reshape(B * K, P)
        # The target's token at path position j is its prediction after the node before it
        # (the root for j = 0); the last column is its prediction after the path's end.
        after = np.concatenate([np.zeros((B, K, 1), np.int64), node + 1], axis=2)
        target = tn[rows, after]
        flat_len = plen.reshape(-1)
        col = np.arange(P + 1)[None, :]
        target = np.where(col <= flat_len[:, None], target.reshape(B * K, P + 1), -1)
        owners = np.repeat(slots, K)
        # Greedy accepted length along each chain (draft + suffix k): the accepted path's feeds
        # inspiration; suffix 0's is what K = 1 would have accepted (the tree's gain below).
        along = feedback.accepted_lengths(chain, target, flat_len).reshape(B, K)
        insp = refn = feedback.Phrases.empty(L)
        if self.cfg.use_inspiration:
            # Along the accepted path (suffix 0's chain when no suffix token was accepted).
            k_acc = np.maximum(sfx_idx, 0)
            r = np.arange(B) * K + k_acc
            l_d = along[np.arange(B), k_acc]
            insp = feedback.inspiration(chain[r], target[r], flat_len[r], slots, L, l_d=l_d)
            corr = feedback.Phrases.empty(L) if self.cfg.correction_phrases is None else \
                feedback.correction_phrases(chain[r], target[r], flat_len[r], slots, L, l_d,
                                            self.cfg.correction_phrases)
            # Staged: inserted with the next round's context phrases (pool_writer.py).
            self._writer.stage(insp.keys, insp.tokens, insp.owners)
            self._writer.stage(corr.keys, corr.tokens, corr.owners)
        if self.cfg.use_refinement:
            key = np.repeat(self._last_suffix_key[slots], K)
            s_len = feedback.refinable(num_acc, n, slen, along).reshape(-1)
            refn = feedback.refinement(target, np.repeat(n, K), s_len, key, flat_len, owners, L)
            if len(refn):
                # refinement returns rows in (b, k) order; find each one's k for the old phrase.
                idx = np.nonzero((s_len == L) & (np.repeat(n, K) + L <= flat_len))[0]
                old = self._last_suffix[owners[idx], idx % K]
                keys, old, new, own = to_device(self.device, refn.keys, old, refn.tokens, refn.owners)
                self._flush_staged()  # the replace sees what it saw when inserts were immediate
                self.pool.replace(keys, old, new, own)
        # What the tree added over chain verification in this very step (against the argmax, so
        # exact for greedy requests).
        tree_gain = along.max(1) - along[:, 0]
        self._trace.verified(slots, num_acc)
        self.stats.add(
            slots, target_forwards=np.ones_like(n), drafted_tokens=num_nodes, tree_gain=tree_gain,
            accepted_tokens=num_acc,
            suffix_accepted=np.where(sfx_idx >= 0, np.maximum(num_acc - n, 0), 0),
            tree_suffix_accepted=np.where(sfx_idx >= 1, np.maximum(num_acc - n, 0), 0))
        self.stats.add(insp.owners, inspiration_inserts=np.ones_like(insp.owners))
        self.stats.add(refn.owners, refinement_inserts=np.ones_like(refn.owners))
        return along

    def _learn_context(self, slots, token_ids, rows, lens) -> None:
        """Phrases of the text confirmed since the slot's last round (the prompt, at first)."""
        L = self.cfg.phrase_len
        start = np.maximum(self._ctx_seen[slots] - L, np.maximum(lens - self.cfg.context_phrase_window, 0))
        ph = feedback.context_phrases(token_ids, rows, lens, start, slots, L)
        if len(ph):
            self._writer.insert(ph.keys, ph.tokens, ph.owners)
        self._ctx_seen[slots] = lens

    # ---- drafting ----------------------------------------------------------------------------
    @_changes_pool
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **_) -> list[list[int]]:
        """Draft token ids per request of the batch (vLLM's custom_class interface).

        sampled_token_ids[i] are the tokens request i got this step (empty: no draft wanted,
        e.g. a chunked prefill in progress); its context is token_ids_cpu[i, :num_tokens_no_spec[i]].
        """
        B = len(sampled_token_ids)
        req_ids = tuple(self._req_ids[:B])
        if not self._tp.leads:
            return self._follow(req_ids)
        # The time since our last call is the target's step: a sample of the engine's overhead
        # when that step had the same requests, all decoding (cost_model.StepOverhead).
        now = time.perf_counter()
        decoding = all(map(len, sampled_token_ids))
        self._overhead.start(req_ids if decoding else None, now)
        # The step's forward as the engine timed it, against the load-time curve: reported
        # (snapshot settings.target_cost_ratio), and read by the mode review where no step
        # overhead was measured (_review_mode); the back-off's plan keeps the load-time curve.
        # Given the corrected curve the plan cut one request's drafts and skipped its suffixes,
        # 3% fewer tokens/s at 128 tokens (three runs against four; results/README.md, "Session
        # of 2026-11-26 (sixth)"): the model's other terms were fitted beside the curve's error.
        forward = self.target_clock.take() if self.target_clock is not None else None
        if forward is not None:
            self._target_calibration.observe(*forward)
        if self._drafting_off is not None:
            try:
                self._sync_requests(req_ids)
            except Exception as e:  # noqa: BLE001 - the followers wait in share() below
                self._table_update_failed(e)
            proposals = [[] for _ in range(B)]
        else:
            try:
                proposals = self._propose(req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
                self._failures_in_a_row = 0
            except Exception as e:  # noqa: BLE001 - the step decodes plainly (_draft_failed)
                proposals = self._draft_failed(req_ids, e)
        if self._counters.active:
            self._counters.publish(self.stats.exported_totals(
                requests_returned=self._slot_of.returned, slots_evicted=self._slot_of.evicted,
                absent_caches_dropped=self._caches_dropped,
                mode_switches=0 if self._mode_review is None else self._mode_review.switches,
                chain_fallback_steps=self._chain_steps))
        self._overhead.end(req_ids, B + sum(map(len, proposals)), time.perf_counter())
        if self._tp.size > 1:
            self._tp.share((proposals, *self.layouts(req_ids)))
        return proposals

    def _draft_failed(self, req_ids: tuple[str, ...], error: Exception) -> list[list[int]]:
        """A step whose drafting raised (device memory for a graph capture or the draft's
        activations outside what vLLM profiled, a driver error) decodes plainly, as a step of
        backed-off requests: it failed the engine, every request in it. The step's slots start
        afresh (their draft caches may hold half a round) and the graphs are dropped (captured
        again on use); logged with its traceback once per kind. MAX_FAILURES_IN_A_ROW steps in
        a row that fail turn drafting off for the engine's life, logged: the engine serves on
        without speculation."""
        self._failures_in_a_row += 1
        kind = self._count_failure(error, "ouroboros: drafting failed (%s: %s); this step decodes "
                                          "without drafts, its requests' draft caches start afresh")
        slots = self._slot_of.slots(req_ids)
        slots = slots[slots >= 0]
        self._last_main[slots] = 0
        self._last_suffix_len[slots] = 0
        self._source[slots] = NO_DRAFT
        with contextlib.suppress(Exception):  # best effort: the step goes on whatever fails here
            self.runtime.reset_slots(slots)
            self.runtime.drop_graphs()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if self._failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
            self._drafting_off = f"{kind}: {error}"
            logger.error("ouroboros: drafting failed in %d steps in a row (last: %s); speculation "
                         "is off for this engine, which serves on without it",
                         self._failures_in_a_row, self._drafting_off)
        return [[] for _ in req_ids]

    def _count_failure(self, error: Exception, message: str) -> str:
        """Count a failure in draft_failures and log `message` % (kind, error) with its
        traceback, once per kind of error. Returns the kind."""
        self.draft_failures += 1
        kind = type(error).__name__
        if kind not in self._failure_kinds:
            self._failure_kinds.add(kind)
            logger.error(message, kind, error, exc_info=error)
        return kind

    def _table_update_failed(self, error: Exception) -> None:
        """The request table's update raised outside drafting (a follower rank, or any rank once
        drafting is off): counted and logged; the step goes on, into the TP broadcast."""
        self._count_failure(error, f"ouroboros: TP rank {self._tp.rank}: updating the request table "
                                   "failed (%s: %s); the step goes on without drafts from its table")

    def _follow(self, req_ids: tuple[str, ...]) -> list[list[int]]:
        """A TP rank other than the first: the first rank's proposals, and what it records of
        them for the next step's tree (layouts()), so that every rank builds the same tree."""
        try:
            self._sync_requests(req_ids)
        except Exception as e:  # noqa: BLE001 - the first rank waits in share(): join it
            # What fails here fails on the first rank too (same code, same ids), where the step
            # decodes plainly (_draft_failed); a rank leaving the collective would stop the
            # engine. Its requests' ids missing from the table read as no draft below.
            self._table_update_failed(e)
        proposals, n, sl = self._tp.share(None)
        slots = self._slot_of.slots(req_ids)
        known = slots >= 0
        self._last_main[slots[known]] = n[known]
        self._last_suffix_len[slots[known]] = sl[known]
        return proposals

    def _propose(self, req_ids: tuple[str, ...], sampled_token_ids, num_tokens_no_spec,
                 token_ids_cpu) -> list[list[int]]:
        B = len(req_ids)
        self._sync_requests(req_ids)
        n_new = np.fromiter(map(len, sampled_token_ids), np.int64, B)
        rows = np.nonzero(n_new)[0]
        proposals: list[list[int]] = [[] for _ in range(B)]
        if len(rows) == 0:
            return proposals
        slots = self._slot_of.slots(req_ids)[rows]
        # Every decoding request's tokens of the step just verified, whether or not it drafts
        # now (counted only where it drafted, a request the back-off left out lost its tokens,
        # and draft_forwards_per_token read high under load).
        self.stats.add(slots, generated_tokens=n_new[rows])
        if self._sampling_pause is not None:
            self._no_draft(slots, "sampling_pause_steps")
            return proposals
        lens_ctx = np.asarray(num_tokens_no_spec[rows], np.int64)
        # A request one token from its length limit (max_tokens, max_model_len) emits that token
        # whatever is drafted: a round for it would be paid for nothing (at the end of every
        # request; a max_tokens=1 request's whole prompt prefilled by the draft).
        last = lens_ctx >= self._len_limit[slots] - 1
        if last.any():
            self._send_nothing(slots[last])
            rows, slots, lens_ctx = rows[~last], slots[~last], lens_ctx[~last]
            if len(rows) == 0:
                return proposals
        if self._mode_review is not None and self._mode_review.due():
            self._review_mode()  # before the plan: a switch changes what drafting costs (F, catch-up)
        S = self.num_spec_tokens
        readable = self._readable[slots]
        by_model, out_m, t_draft = np.zeros(len(rows), bool), None, 0.0
        by_pool, cut_model, cut_pool = np.zeros(len(rows), bool), S, S
        if self.pool_only:
            plan = self._speculate(slots, lens_ctx)
            self._no_draft(slots[~plan.rows], "backoff_steps")
            by_pool, cut_pool = plan.rows, plan.max_tokens
        else:
            by_model, cut_model = self._model_rows(req_ids, slots, lens_ctx, readable)
            if self._fills_from_pool and not by_model.all():
                # Rows the draft model does not draft this step (back-off, unreadable prompt,
                # full cache) draft from the pool where its own estimates say that pays beside
                # the rows the model drafts. Planned before the round, at its modeled cost, so
                # that the pool's lookups queue ahead of it and come back with its one read.
                idle = np.nonzero(~by_model)[0]
                plan = self._pool_plan(slots[idle], self._model_load(slots[by_model], lens_ctx[by_model], cut_model))
                by_pool[idle[plan.rows]] = True
                cut_pool = plan.max_tokens
        pending, t_pool = None, 0.0
        if by_pool.any():
            learn = by_pool & readable  # an unreadable prompt's ids are another request's
            if self.cfg.use_context_phrases and learn.any():
                self._learn_context(slots[learn], token_ids_cpu, rows[learn], lens_ctx[learn])
            self._flush_staged()
            t_pool = time.perf_counter()
            # Drafts end at the plan's cut, so their suffixes follow them (proposal_layout.py).
            pending = queue_pool_drafts(self.pool, token_ids_cpu[rows[by_pool], lens_ctx[by_pool] - 1],
                                        slots[by_pool], min(self.cfg.max_draft_len, cut_pool),
                                        self.cfg.tree_suffixes, self._pool_branches)
            t_pool = time.perf_counter() - t_pool
        if by_model.any():
            # A row the draft cache cannot hold now decodes plainly this step (counted).
            by_model, out_m, t_draft = self._draft_with_model(
                req_ids, slots, lens_ctx, token_ids_cpu, rows, by_model, cut_model)
        out_p = None
        if pending is not None:
            # What the step pays for the pool: queuing its lookups, and waiting for their read
            # where no round's read waited first (the pool mode, or a step without a round).
            t0 = time.perf_counter()
            out_p = pending.output()
            self._time_pool(t_pool + time.perf_counter() - t0)
        # A round cut below its length ran fewer forwards than a whole one: the host loop drafted
        # a chain (speculation_plan's F(s) = s), a device round's rows stopped at the cut.
        whole_round = cut_model >= self.runtime.s.draft_room
        if self._mode_review is not None:
            if self.pool_only and by_pool.any():
                self._mode_review.step(self.drafting_mode, int(by_pool.sum()), None)
            elif out_m is not None:
                self._mode_review.step(
                    self.drafting_mode, int(by_model.sum()),
                    None if not whole_round else out_m.forwards if self.runtime.device_round is not None
                    else float(out_m.row_forwards.mean()))
            else:
                self._mode_review.idle_step()
        if out_m is None and out_p is None:
            self._metrics.maybe_write(lambda: self.snapshot(per_request=False))
            return proposals
        # The model's rows first, then the pool's: one set of drafts for the build below.
        order = np.concatenate([np.nonzero(by_model)[0], np.nonzero(by_pool)[0]])
        out = out_m if out_p is None else out_p if out_m is None else out_m.followed_by(out_p)
        from_pool = np.arange(len(order)) >= int(by_model.sum())
        cut = np.where(from_pool, cut_pool, cut_model)
        rows, slots, lens_ctx = rows[order], slots[order], lens_ctx[order]
        self._source[slots] = np.where(from_pool, POOL_DRAFT, MODEL_DRAFT)
        self.stats.add(slots[from_pool], pool_draft_steps=np.ones(int(from_pool.sum()), np.int64))

        # For the target: the sentence draft, then the candidate suffixes (all K when the tree
        # path is on, else the best one), in flat order (proposal_layout.py). The back-off's
        # cut bounds the draft; the suffixes fill the room to S, where the suffix decision
        # sends them. Near max_model_len a row gets only what the scheduler can place: the root
        # sits at position len - 1, so the proposal ends by max_model_len - 1. Near max_tokens,
        # only what can be emitted: the accepted draft and one token more.
        room = np.maximum(self._len_limit[slots] - 1 - lens_ctx, 0)
        R = len(rows)
        K = min(out.suffixes.shape[1], self._last_suffix.shape[1] if self.sends_tree else 1)
        if self._tree_decision == "available" and self.cfg.tree_suffixes >= 2 and not self.sends_tree:
            self._chain_steps += 1
        valid = out.suffix_valid[:, :K]
        found = valid.sum(1)
        branched = from_pool & self._pool_branches
        if branched.any():
            # The back-off's cut counts whole branches, the best ranked first (pool_draft.py);
            # a row sending all K records no cut.
            n_b = branches_under_cut(cut, self.cfg.phrase_len, max(K, 1))
            valid = valid & (np.cumsum(valid, 1) <= np.where(branched, n_b, K)[:, None])
            self.stats.add(slots, branches_cut=found - valid.sum(1))
            cut = np.where(branched & (n_b < K), n_b * self.cfg.phrase_len, np.where(branched, S, cut))
        place = proposal_layout.place_suffixes(out.draft_lens, valid, self.cfg.phrase_len,
                                               np.minimum(room, cut), np.minimum(room, S))
        n_main, lens = place.n_main, place.lens
        if self.cfg.use_suffixes is None and lens.any():
            # The pool's branches are its whole draft: the back-off's plan chose to send them.
            send = self._send_suffixes(slots, n_main, lens.sum(1), B, t_draft + t_pool,
                                       forced=branched)
            lens[~send] = 0
        sfx = place.ordered(out.suffixes[:, :K])
        chain, total = proposal_layout.proposal_tokens(out.drafts, sfx, place)
        # One host conversion for the batch, then list slices (a tolist per row: 112 us at 256).
        flat = chain[np.arange(chain.shape[1]) < total[:, None]].tolist()
        start = 0
        for i, end in zip(rows.tolist(), np.cumsum(total).tolist()):
            proposals[i], start = flat[start:end], end
        # (branches: a row that found none sent all it had, whatever the cut)
        empty = self.pool_only & from_pool & ((cut >= S) | (branched & (found == 0))) & (total == 0)
        if self._mode_review is not None and empty.any():
            # A row the pool had no phrase for decodes plainly: one token for its target forward
            # (on_verified never sees it), part of what the pool mode yields.
            self._mode_review.observe(self.drafting_mode, np.ones(int(empty.sum())))

        ctx_last = token_ids_cpu[rows, lens_ctx - 1].astype(np.int64)
        self._last_main[slots] = n_main
        self._last_suffix_len[slots] = 0
        self._last_suffix_len[slots, :K] = lens
        self._last_suffix[slots, :K] = sfx
        self._last_suffix_key[slots] = np.where(
            n_main > 0, out.drafts[np.arange(R), np.maximum(n_main - 1, 0)], ctx_last)
        if out_m is not None:
            # What the back-off weighs: a whole round's forwards per row (a device round's rows
            # all pay its F).
            m = slots[~from_pool]
            if whole_round:
                ran = out_m.forwards if self.runtime.device_round is not None else out_m.row_forwards
                self._draft_forwards[m] += ESTIMATE_RATE * (ran - self._draft_forwards[m])
                if len(m):
                    drafted = float(out.draft_lens[~from_pool].mean())
                    if self.cfg.draft_length == "adaptive":
                        self._draft_tokens += ESTIMATE_RATE * (drafted - self._draft_tokens)
                    if self._round_length is not None:
                        self._round_length.observe_draft(out.forwards, drafted)
        # What the row could send: near max_model_len the room, not the plan, bounds it. The
        # estimates must not learn the positions past the room as rejected (they were never sent).
        self._last_cut[slots] = np.minimum(cut, room)
        self._room_cut[slots] = room < np.minimum(cut, S)
        self._branched[slots] = branched
        self.stats.add(slots[cut < S], shortened_steps=np.ones(int((cut < S).sum()), np.int64))
        self._round_forwards = out.forwards if self._round_length is not None else 0
        self.stats.round_done(out.forwards, out.prefill_forwards, len(rows))
        # A round the back-off cut to a chain looked up no guesses; the pool's rows ran no round.
        # A sentence draft is the model's, or the pool's chain of phrases where it found one;
        # the pool's branches have none (counted as rounds, they read a mean draft length of 0).
        looked_up = bool(self.runtime.G) and not self.runtime.drafts_chain(int(cut_model))
        self.stats.add(slots, draft_forwards=out.row_forwards,
                       prefill_forwards=out.row_prefills, guess_tokens=out.guess_tokens,
                       guess_lookups=out.row_forwards * looked_up,
                       guess_hits=out.guess_hit_forwards,
                       draft_rounds=(~from_pool | (out.draft_lens > 0)).astype(np.int64),
                       sentence_draft_tokens=out.draft_lens)
        if out.stopped_by_rule is not None:
            # The cap stopped a model row the rule did not, in a round the back-off left whole
            # (a cut row stopped at the cut; the pool's rows had no rule to run).
            capped = ~from_pool & ~out.stopped_by_rule & (cut >= self.runtime.s.draft_room)
            self.stats.add(slots, stops_rule=out.stopped_by_rule & ~from_pool, stops_cap=capped)
        if self._trace.on:
            self._trace.drafted(slots, [req_ids[i] for i in rows], out.draft_lens, n_main,
                                out.row_forwards, out.stopped_by_rule, cut, from_pool)
        self._metrics.maybe_write(lambda: self.snapshot(per_request=False))
        if self._saver is not None:
            self._saver.maybe_save()
        self._maybe_rebase_pool_clock()
        return proposals

    def _maybe_rebase_pool_clock(self) -> None:
        # Every CLOCK_CHECK_INTERVAL seconds, not per step: the check reads the pool's clock.
        now = time.monotonic()
        if self.pool is not None and now - self._last_clock_check >= CLOCK_CHECK_INTERVAL:
            self._last_clock_check = now
            if self.pool.rebase_clock():
                logger.info("ouroboros: the phrase pool's recency clock was moved back")

    def _time_pool(self, seconds: float) -> None:
        """What one step paid for the pool's lookups: `seconds` of wall time queuing them, and
        waiting for their read where no round's read waited first. A sample counts at most
        POOL_OUTLIER x the mean: a stall (a GC pause, another process) would otherwise price
        the pool out of every plan, and a pool that drafts nowhere is never timed again."""
        self._pool_seconds = cost_model.running_mean(self._pool_seconds, seconds, ESTIMATE_RATE, POOL_OUTLIER)

    def _model_rows(self, req_ids, slots: np.ndarray, lens: np.ndarray,
                    readable: np.ndarray) -> tuple[np.ndarray, int]:
        """Which of the step's decoding requests (by slot, [R]; context lengths lens [R]) the
        draft model drafts for (a bool mask [R]) and the most tokens each may send: the
        back-off's plan over those whose prompt it can read, less those the draft cache cannot
        hold while it is full (retried every few steps). The others are counted by why."""
        R = len(slots)
        by_model = np.zeros(R, bool)
        blind = ~readable
        if blind.any():
            if not self._told_unreadable:
                self._told_unreadable = True
                logger.info("ouroboros: requests whose prompt came as embeddings (prompt_embeds) "
                            "get no draft from the draft model, which cannot read their prompt "
                            "(counted in unreadable_prompt_steps); the pool may draft for them")
            self._no_draft(slots[blind], "unreadable_prompt_steps")
        if blind.all():
            return by_model, self.num_spec_tokens
        ok = np.nonzero(readable)[0]
        # The unreadable rows share the step's target forward (a token each at least).
        n_blind = float(blind.sum())
        plan = self._speculate(slots[ok], lens[ok], cost_model.StepLoad(n_blind, n_blind))
        self._no_draft(slots[ok[~plan.rows]], "backoff_steps")
        by_model[ok[plan.rows]] = True
        if self._cache_retry_wait > 0 and by_model.any():  # the draft cache is full for now
            self._cache_retry_wait -= 1
            by_model = self._keep_rows_that_fit(req_ids, slots, lens, by_model)
        return by_model, plan.max_tokens  # max_tokens: the back-off's shorter draft under load

    def _draft_with_model(self, req_ids, slots: np.ndarray, lens: np.ndarray, token_ids_cpu,
                          rows: np.ndarray, by_model: np.ndarray, cut: int):
        """The draft model's round for the rows by_model marks (of the step's R; slots, context
        lengths lens and batch rows `rows` [R] each), drafts of at most `cut` tokens. Where the
        draft cache cannot grow to hold them all, the rows that fit draft and the others wait
        (counted). Returns (the rows that drafted [R] bool, their RoundOutput or None where
        none did, the round's wall seconds)."""
        m = np.nonzero(by_model)[0]
        if self.cfg.use_context_phrases:
            self._learn_context(slots[m], token_ids_cpu, rows[m], lens[m])
        self._flush_staged()  # what the context insert did not take (none where it ran)
        t_draft = time.perf_counter()
        forwards = None if self._round_length is None else self._round_length.choose(self._round_cost(len(m)))
        try:
            out = self.runtime.run_round(slots[m], token_ids_cpu, rows[m], lens[m], forwards, cut)
        except DraftCacheFull as e:  # nothing changed
            kept = self._keep_rows_that_fit(req_ids, slots, lens, by_model)
            if kept.sum() < len(m):  # the rows that fit draft, the others wait
                self._cache_retry_wait = self._cache_retry_gap
                self._cache_retry_gap = min(2 * self._cache_retry_gap, MAX_CACHE_RETRY_GAP)
                self._log_cache_full(e, int(kept.sum()), len(m))
                by_model = kept
                m = np.nonzero(kept)[0]
                if len(m) == 0:
                    return by_model, None, time.perf_counter() - t_draft
            out = self.runtime.run_round(slots[m], token_ids_cpu, rows[m], lens[m], forwards, cut)
        else:  # the cache held every row: after a full spell, try growing again soon
            self._cache_retry_gap = PROBE_GAP
        t_draft = time.perf_counter() - t_draft  # the round returns host arrays: synced
        self._calibrate_prefill(out)
        self._calibrate_draft(out, cut, t_draft)
        return by_model, out, t_draft

    def _log_cache_full(self, error, drafting: int, wanted: int) -> None:
        """Warn that the draft cache could not grow, at most every CACHE_FULL_LOG_INTERVAL_S
        (the times in between counted; every request-step left out is in cache_full_steps)."""
        now = time.monotonic()
        if now - self._cache_full_logged_at < CACHE_FULL_LOG_INTERVAL_S:
            self._cache_full_unlogged += 1
            return
        since = (f" ({self._cache_full_unlogged} more times since the last warning)"
                 if self._cache_full_unlogged else "")
        self._cache_full_logged_at, self._cache_full_unlogged = now, 0
        logger.warning(
            "ouroboros: the draft KV cache could not grow to %s%s; %d of %d requests draft, the "
            "others decode without a draft from the model (lossless) until growing is tried again "
            "in %d steps. Fewer concurrent requests (max_num_seqs) or a shorter max_model_len leave "
            "it room, as do a larger draft_cache_max_mb where it is the bound, or a lower "
            "gpu_memory_utilization where device memory is.", error, since, drafting, wanted,
            self._cache_retry_wait)

    def _model_load(self, slots: np.ndarray, lens: np.ndarray, cut: int) -> cost_model.StepLoad:
        """What the draft model's rows (by slot, [R]; context lengths lens [R]) bring to this
        step, by their estimates at drafts of `cut` tokens: target tokens, output tokens, and
        their round's seconds as the back-off's plan models them (F forwards x its measured
        scale x t_draft(rows x row tokens), and the catch-up's prefills at the share the plan
        charged them: a step whose model rows prefill is dearer, and the fill weighs its rows
        against that step)."""
        if len(slots) == 0:
            return cost_model.StepLoad()
        est, rt = self._model_est, self.runtime
        seconds = 0.0
        if self.cost is not None:
            chain, n_d = self._round_width(cut)
            F = float(cost_model.round_forwards(self._draft_forwards[slots], cut, rt.chain_below,
                                                rt.stop_below).mean())
            seconds = F * float(self._draft_scale[int(chain)]) * float(self.cost(len(slots) * n_d))
            catch_up = self._catch_up(slots, lens, est.accepted[slots])
            if (catch_up.tokens > 0).any():
                seconds += catch_up.step_seconds(self.cost if self.prefill_cost is None else self.prefill_cost, cut)
        return cost_model.StepLoad(len(slots) + float(est.sent[slots, :cut].sum()),
                                   len(slots) + float(est.accepted[slots, :cut].sum()), seconds)

    def _review_mode(self) -> None:
        """Price the draft model's mode and the pool mode at this engine's measurements
        (mode_review.py) and switch where the other is cheaper. The step without drafting is the
        target's load-time curve plus the overhead measured beyond it where steps were measured,
        else the curve corrected by the target's timed forwards."""
        review = self._mode_review
        if self._overhead.samples:
            target, overhead = self.target_cost, self._overhead.value
        elif self._target_calibration is not None:
            target, overhead = self._target_calibration.curve, None
        else:
            target, overhead = self.target_cost, None
        old = self.drafting_mode
        new = review.review(old, target, overhead, self.cost, float(self._draft_scale[0]),
                            self._pool_seconds or 0.0)
        if new is None:
            return
        self._mode = review.modes[new]
        # The back-off's estimates stay: each source's measured its own drafts (the model's
        # before the switch, the pool's in pool fill). The tokens a draft gives alone, which the
        # suffixes' decision weighs, measured the other source's: every request starts from
        # the prior, as a new request does.
        self._base_tokens[:] = self._prior_tokens_per_fwd
        logger.info("ouroboros: drafting mode %s -> %s at %.1f requests per step: modeled ms per output "
                    "token %s (E %s; review every %d decoding steps, mode_review.py)%s", old, new,
                    review.batch, {m: round(1000 * p.seconds_per_token, 2) for m, p in review.last.items()},
                    {m: f"{p.tokens_per_forward:.2f}{'' if p.measured else ' prior'}"
                     for m, p in review.last.items()}, review.every,
                    "; the draft catches up on the requests' contexts first" if not self.pool_only else "")

    def _round_cost(self, rows: int):
        """cost(F): modeled seconds of a step whose device round for `rows` requests runs F
        forwards: the target over each row's token, its draft (the mean of whole rounds' drafts
        of F forwards: fewer forwards draft less where rows needed more, and an acceptance head
        stops drafts anywhere up to max_draft_length; before any such round, gamma, or with an
        adaptive length the mean over all F) and one suffix, the engine's own time, F draft
        forwards as wide as the round's fixed shapes (every window and guess column), scaled as
        the plan scales whole rounds (_calibrate_draft)."""
        rt, lengths = self.runtime, self._round_length
        fixed = self._overhead.value
        t_draft = self._draft_scale[0] * self.cost(rows * cost_model.draft_row_tokens(rt.W, rt.G, rt.L))

        def cost(F: int) -> float:
            drafted = self._draft_tokens if lengths is None else lengths.draft_tokens(F, self._draft_tokens)
            return self.target_cost(rows * (1 + drafted + rt.L)) + fixed + F * t_draft

        return cost

    def _keep_rows_that_fit(self, req_ids, slots: np.ndarray, lens: np.ndarray,
                            by_model: np.ndarray) -> np.ndarray:
        """by_model [R] (of the step's rows: slots, context lengths lens [R]) less the rows the
        draft cache cannot hold now (_rows_that_fit), which decode without a draft (counted in
        cache_full_steps). A new mask [R]."""
        m = np.nonzero(by_model)[0]
        out = by_model.copy()
        if len(m):
            fit = self._rows_that_fit(req_ids, slots[m], lens[m])
            self._no_draft(slots[m[~fit]], "cache_full_steps")
            out[m[~fit]] = False
        return out

    def _rows_that_fit(self, req_ids, slots: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Which drafting rows ([R] by slot, context lengths [R]) the draft cache holds without
        growing, as a bool mask [R], after releasing the pages of requests out of this batch
        where some do not fit: such a request drafts again from a prefill when it is back
        (lossless), where the requests here would not draft at all."""
        fit = self.runtime.fits(slots, lens)
        if not fit.all() and self._drop_absent_caches(req_ids):
            fit = self.runtime.fits(slots, lens)
        return fit

    def _drop_absent_caches(self, req_ids) -> int:
        """Release the draft-cache pages of requests that hold a slot but are out of this
        batch (preempted, or left out by the token budget); they keep the slot and their pool
        phrases. Returns how many slots gave pages back."""
        held = self.runtime.kv.held  # [rows of the block table]: a slot past them holds nothing
        dropped = [s for s in self._slot_of.absent(req_ids) if s < len(held) and held[s] > 0]
        self.runtime.reset_slots(dropped)
        self._caches_dropped += len(dropped)
        return len(dropped)

    def _no_draft(self, slots: np.ndarray, counter: str) -> None:
        """Plain decoding this step for these slots: nothing sent, nothing drafted; the draft
        catches up on the skipped tokens (chunked prefill) when speculation resumes. `counter`:
        the per-request counter that says why (backoff_steps, cache_full_steps, ...)."""
        self._send_nothing(slots)
        self.stats.add(slots, **{counter: np.ones_like(slots)})

    def _send_nothing(self, slots: np.ndarray) -> None:
        """No proposal from these slots this step: nothing to verify or learn from for them."""
        self._last_main[slots] = 0
        self._last_suffix_len[slots] = 0
        self._source[slots] = NO_DRAFT

    def _speculate(self, slots: np.ndarray, lens: np.ndarray,
                   load: cost_model.StepLoad = cost_model.StepLoad()) -> cost_model.SpeculationPlan:
        """Which of this step's decoding requests (by slot, [B]) get a draft in the mode in
        force (plan.rows, a bool mask [B]) and the most tokens each may send (plan.max_tokens):
        all of them, whole, up to max_speculative_batch when it is set, else those for which the
        cost model says speculation pays at this batch size, with a shorter draft where load
        makes the target's tokens dear (cost_model.speculation_plan), from their own estimates
        (with probes: backoff_estimates.py); lens [B]: context lengths (tokens), for the draft
        cache's catch-up (_catch_up); load: the step's rows outside the plan (StepLoad). The
        pool mode: _pool_plan."""
        B, S = len(slots), self.num_spec_tokens
        if self.cfg.max_speculative_batch is not None:
            return cost_model.SpeculationPlan(np.full(B, B <= self.cfg.max_speculative_batch), S)
        if self.cost is None or self.target_cost is None:
            return cost_model.SpeculationPlan(np.ones(B, bool), S)
        if self.pool_only:
            return self._pool_plan(slots, load)
        rt = self.runtime
        F = self._draft_forwards[slots]
        n_d = cost_model.draft_row_tokens(rt.W, rt.G, rt.L)
        decide = lambda A, T: cost_model.speculation_plan(  # noqa: E731
            self.target_cost, self.cost, A, T, F, n_d, self._overhead.value, rt.chain_below,
            cost_model.draft_row_tokens(0, 0, rt.L), self._catch_up(slots, lens, A), self.prefill_cost,
            tuple(self._draft_scale), load=load, stop_below=rt.stop_below)
        return self._model_est.plan(slots, decide)

    def _pool_plan(self, slots: np.ndarray, load: cost_model.StepLoad = cost_model.StepLoad()
                   ) -> cost_model.SpeculationPlan:
        """Which of these requests (by slot, [B]) draft from the pool alone (plan.rows [B]) and
        the most tokens each may send: cost_model.speculation_plan with no draft forward and no
        draft cache to catch up, from the pool's estimates of each request (probes as the
        model's; the branches' apart, whose cut is in whole branches: pool_draft.py). load: what
        the draft model's rows bring to the step (pool fill; none in the pool mode). A step the
        pool drafts in pays its lookups (_pool_seconds, measured). Without cost curves, every
        one."""
        B, S = len(slots), self.num_spec_tokens
        if self.cost is None or self.target_cost is None:
            return cost_model.SpeculationPlan(np.ones(B, bool), S)
        decide = lambda A, T: cost_model.speculation_plan(  # noqa: E731
            self.target_cost, self.cost, A, T, np.zeros(B), 1, self._overhead.value, load=load,
            lookup_seconds=self._pool_seconds or 0.0)
        return (self._branch_est if self._pool_branches else self._pool_est).plan(slots, decide)

    @property
    def _pool_branches(self) -> bool:
        """Whether the pool drafts K branches under the root this step (pool_branches; on
        auto wherever the step sends the tree), else a chain with K suffixes at its end."""
        return self.cfg.pool_drafts_branches and self.sends_tree

    @property
    def _fills_from_pool(self) -> bool:
        """Whether rows the draft model leaves this step may draft from the pool (pool_fill):
        on auto, where the back-off plans per request and the target's curve is flat
        (cost_model.is_flat: the pool's tokens cost it little)."""
        if self.pool is None:
            return False
        if self.cfg.pool_fill is not None:
            return self.cfg.pool_fill
        return self.cfg.max_speculative_batch is None and cost_model.is_flat(self.target_cost)

    def _catch_up(self, slots: np.ndarray, lens: np.ndarray, accepted: np.ndarray) -> cost_model.CatchUp:
        """What the draft must catch up on before it can draft for each request (by slot,
        [B]; context lengths lens [B]): a stretch its cache lacks that is longer than a round's
        first forward takes (a new prompt, tokens decoded while backed off) is prefilled once;
        that pays only over the steps the request has left, so each step is charged the share
        E(s) / r of it, r the tokens left before its length limit, E(s) its tokens per step
        with drafts of s tokens (at most the whole), scaled by what recent prefills measured
        against the curve (_calibrate_prefill). Without this the back-off drafted for requests
        a few tokens from their end at the tail of a batch, each prefilling its whole context
        first."""
        rt = self.runtime
        cached = np.zeros_like(slots)
        known = slots < len(rt.kv_len)  # a slot past them has drafted nothing yet
        cached[known] = rt.kv_len[slots[known]]
        u = lens - cached
        left = np.maximum(self._len_limit[slots] - lens, 1)
        share = np.minimum((1 + np.cumsum(accepted, 1)) / left[:, None], 1.0)  # [B, S]: by draft length
        return cost_model.CatchUp(np.where(u > rt.prefill_threshold, u, 0), share, self._prefill_scale,
                                  rt.prefill_graphs.chunk if self._prefill_graphed() else None)

    def _prefill_graphed(self) -> bool:
        """Whether the draft's prefill replays chunks from CUDA graphs (else eager forwards:
        no graph round, or its prefill capture failed, at load or since)."""
        graphs = self.runtime.prefill_graphs
        return graphs is not None and graphs.enabled

    def _round_width(self, cut: int) -> tuple[bool, int]:
        """(whether a round cut to `cut` draft tokens drafts a chain, its forwards' tokens per
        row): a chain's current and uncached token, else the window's and guesses' too."""
        rt = self.runtime
        chain = rt.drafts_chain(cut)
        return chain, cost_model.draft_row_tokens(0, 0, rt.L) if chain else \
            cost_model.draft_row_tokens(rt.W, rt.G, rt.L)

    def _calibrate_draft(self, out, cut: int, seconds: float) -> None:
        """The back-off's draft cost from the rounds that ran: a running ratio, for whole rounds
        and for chain-drafted cuts apart, of a round's wall seconds (its prefill left out) to
        what the plan modeled for it, its rows' mean forwards x t_draft(rows x row tokens).
        A round costs more than its forwards' curve (the host's work per forward, the pool's
        suffix lookup) and less where the host loop trims guess columns and finished rows;
        whole and chain rounds differ in both, so each keeps its own ratio (4 requests x 48
        tokens on this CPU: whole 0.74, 3-token chains 0.91 falling to 0.74,
        scripts/step_trace.py). Until a kind has run, it takes the other's ratio: the same
        device and host loop err alike, and a kind left at the prior 1.0 beside a measured 0.25
        looked 4x dearer than it was, so the plan never chose it and never measured it (in
        CI, one request after a loaded batch was cut to chains for its whole life)."""
        if self.cost is None or out.forwards == 0 or not self.cfg.calibrate_costs:
            return
        rt = self.runtime
        chain, n_d = self._round_width(cut)
        R = len(out.row_forwards)
        forwards = out.forwards if rt.device_round is not None else int(out.row_forwards.sum()) / R
        modeled = forwards * self.cost(R * n_d)
        ratio = min(max((seconds - out.prefill_seconds) / max(modeled, 1e-9), 0.25), 4.0)
        k = int(chain)
        self._draft_scale[k] = cost_model.running_mean(float(self._draft_scale[k]), ratio, ESTIMATE_RATE,
                                                       RATIO_OUTLIER)
        self._draft_scale_rounds[k] += 1
        if self._draft_scale_rounds[1 - k] == 0:
            self._draft_scale[1 - k] = self._draft_scale[k]

    def _calibrate_prefill(self, out) -> None:
        """The catch-up's cost from the prefills that ran: a running ratio of their measured
        seconds to what the prefill curve says for their padded sizes. The curve is measured
        up to a few dozen tokens on a CPU and extrapolated linearly past them, where it
        overstated 4- and 16-prompt prefills by 30-45% (scripts/draft_prefill_cost.py)."""
        if not out.prefill_sizes or self.prefill_cost is None or not self.cfg.calibrate_costs:
            return
        modeled = float(self.prefill_cost.at(np.asarray(out.prefill_sizes)).sum())
        ratio = min(max(out.prefill_seconds / max(modeled, 1e-9), 0.1), 10.0)
        graphed = self._prefill_graphed()
        if graphed == self._prefill_scale_graphed:
            self._prefill_scale = cost_model.running_mean(self._prefill_scale, ratio, ESTIMATE_RATE,
                                                          RATIO_OUTLIER)
        else:
            # A prefill capture failed while serving: the prefill is eager from now on, priced
            # on the graph curve. Its first measured ratio replaces the graphs' at once, where a
            # running mean would plan several more catch-ups at a fraction of their cost.
            self._prefill_scale, self._prefill_scale_graphed = ratio, graphed

    def _send_suffixes(self, slots: np.ndarray, n_main: np.ndarray, suffix_tokens: np.ndarray,
                       batch: int, draft_seconds: float, forced: np.ndarray | None = None) -> np.ndarray:
        """Which drafting requests (by slot, [R]) send their candidate suffixes this step, as a
        bool mask [R] (cost_model.rows_sending_suffixes, from their own estimates; a request
        whose suffixes stayed off sends them again every few steps, gap doubling, to measure).
        n_main [R]: draft tokens per row; suffix_tokens [R]: suffix tokens per row; batch: the
        step's requests (plain rows give one token each); draft_seconds: this step's drafting;
        forced [R] (bool) or None: rows that send theirs undecided (the pool's branches, its
        whole draft), counted in the step's tokens like drafts."""
        forced = np.zeros(len(slots), bool) if forced is None else forced
        if self.target_cost is None:
            return suffix_tokens > 0
        base = self._base_tokens[slots].sum() + (batch - len(slots))
        step_tokens = batch + n_main.sum() + suffix_tokens[forced].sum()
        suffix_tokens = np.where(forced, 0, suffix_tokens)
        send = cost_model.rows_sending_suffixes(
            self.target_cost, step_tokens, suffix_tokens, base, self._suffix_gain(slots, n_main),
            draft_seconds + self._overhead.value)
        has = suffix_tokens > 0
        due = has & ~send & (self._suffix_wait[slots] <= 0)
        skipped = has & ~send & ~due
        s = slots[due]
        self._suffix_gap[s] = np.minimum(2 * self._suffix_gap[s], MAX_PROBE_GAP)
        self._suffix_wait[s] = self._suffix_gap[s]
        on, off = slots[send], slots[skipped]
        self._suffix_gap[on] = self._suffix_wait[on] = PROBE_GAP
        self._suffix_wait[off] -= 1
        self.stats.add(off, suffix_skipped=np.ones_like(off))
        return send | due | forced

    def _suffix_gain(self, slots: np.ndarray, n_main: np.ndarray) -> np.ndarray:
        """Suffix tokens each drafting row (by slot, [R]) may expect to add this step: its
        suffixes' yield times the chance its draft of n_main [R] tokens is accepted whole
        (P(accepted >= n_main) of the back-off's estimates; 1 without a draft)."""
        pool = self._source[slots] == POOL_DRAFT  # the source that drafted this step's rows
        whole = np.where(pool, self._pool_est.whole_chance(slots, n_main),
                         self._model_est.whole_chance(slots, n_main))
        return whole * self._suffix_yield[slots]

    @_holds_pool
    def snapshot(self, per_request: bool = True) -> dict:
        """Aggregate (and per-request) counters, plus the pool's."""
        self._flush_staged()
        pool = self.pool.stats() if self.pool is not None else None
        out = self.stats.snapshot(pool, per_request=per_request)
        out["requests_returned"] = self._slot_of.returned
        out["slots_evicted"] = self._slot_of.evicted
        out["absent_caches_dropped"] = self._caches_dropped
        out["mode_switches"] = 0 if self._mode_review is None else self._mode_review.switches
        out["chain_fallback_steps"] = self._chain_steps
        out["draft_failures"] = self.draft_failures
        out["drafting_off"] = self._drafting_off
        if self.runtime is not None:
            out["draft_cache"] = self.runtime.kv.stats()
        if self.runtime is not None:  # what "auto" resolved to on this device
            out["settings"] = {"drafting_mode": self.drafting_mode,
                               "drafting_mode_at_load": self.drafting_mode_at_load,
                               "mode_review": None if self._mode_review is None else self._mode_review.stats(),
                               "window_size": self.runtime.W, "num_guesses": self.runtime.G,
                               "phrase_len": self.runtime.L,
                               "draft_round": self.runtime.s.draft_round,
                               "tree_verification": self._tree_decision,
                               "pool_branches": self._pool_branches,
                               # What each of the pool's branches adds, in tokens per target
                               # forward, as a new request's plan starts (learned; pool_draft.py).
                               # None while the pool drafts a chain.
                               "pool_branch_gains": self._branch_est.prior[
                                   self.cfg.phrase_len - 1::self.cfg.phrase_len][:self.cfg.tree_suffixes].tolist()
                               if self._pool_branches else None,
                               "draft_cost_ms": dict(zip(self.cost.n, (1000 * t for t in self.cost.seconds))),
                               "target_cost_ms": dict(zip(self.target_cost.n, (
                                   1000 * t for t in self.target_cost.seconds)))
                               if self.target_cost is not None else None,
                               "drafting_mode_ms_per_token": {k: 1000 * v for k, v in self.drafting_costs.items()},
                               "round_forwards": None if self._round_length is None
                               else self._round_length.stats(),
                               "step_overhead_ms": 1000 * self._overhead.value,
                               "step_overhead_samples": self._overhead.samples,
                               "pool_lookup_ms": None if self._pool_seconds is None else 1000 * self._pool_seconds,
                               # the target's forwards measured / its curve at load, by point
                               "target_cost_ratio": None if self._target_calibration is None
                               else self._target_calibration.ratios(),
                               "target_forward_samples": 0 if self._target_calibration is None
                               else self._target_calibration.samples,
                               # measured / modeled seconds: the back-off's calibrations
                               "prefill_cost_ratio": float(self._prefill_scale),
                               "round_cost_ratio": {"whole": float(self._draft_scale[0]),
                                                    "chain": float(self._draft_scale[1])},
                               "round_cost_rounds": {"whole": int(self._draft_scale_rounds[0]),
                                                     "chain": int(self._draft_scale_rounds[1])},
                               "suffix_yield_mean": float(self._suffix_yield_all)}
        return out
