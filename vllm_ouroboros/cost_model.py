"""When speculation pays on this device: per-forward cost curves and the two decisions built on
them (how to draft, at load; speculate or not per step under load).

A forward over n tokens costs t(n). On a GPU at these sizes t(n) is nearly flat (memory-bound:
the weights are read once whatever n is); on a CPU it grows with n (compute-bound). Both curves
are measured when the engine loads: the draft's by running our draft model, the target's from
its own weights (patches/target_cost.py: its linear layers and LM head on n rows). Rules
(README "Choosing settings per hardware"):

  the drafting mode (MODES: "chain", one token per draft forward; "guesses", pool phrases
  verified in each forward; "phrases", those and the Jacobi window) is the one that minimises
  the modeled time per output token
      t_target(1 + gamma + L) / E_m + d_m t_draft(n_m)
  where n_m = 2 + L (G [guesses] + W [window]) tokens per row, and E_m (tokens per target
  forward) and d_m (draft forwards per output token) are what the mode yielded on the real pair
  (results/README.md, "Drafting modes"). A flat curve picks "phrases" (fewest draft forwards,
  most tokens per target forward); a compute-bound one weighs the wider forwards against that.

  a step with B decoding requests speculates for the m requests, best first, with drafts of at
  most s tokens each, (m, s) chosen to maximise the modeled rate
      (B + sum_{i <= m} (E_i(s) - 1)) / (t_target(B + sum_{i <= m} T_i(s)) + c + F(s) t_draft(m n_d))
  (m = 0 is plain decoding, B / (t_target(B) + c)). There is no shortcut for a flat target
  curve: the draft's forwards are paid there too, so a request whose drafts are rarely
  accepted stops speculating on a GPU as well (until a probe finds it accepting again).
  E_i(s) = 1 + sum_{k <= s} P_i(accepted >= k) and T_i(s) = sum_{k <= s} P_i(sent >= k), from
  per-request survival estimates measured online (optimistic priors for a new request): a
  draft cut to its first s tokens is accepted as far as the whole draft would have been, up to
  s, so one measurement at full length gives every shorter length. F(s): draft forwards per
  step (mean of the m) over n_d(s) tokens per row each: a whole round's (measured online) for
  s >= gamma; below gamma, where the round can stop early (the host loop), a chain draft of s
  forwards over 2 tokens per row (window and guesses off: the same greedy tokens, a narrower
  forward, which is what pays when the forward carries many rows); c the engine's own time per step
  beyond the target forward (scheduling, sampling, output processing), measured online too:
  every step pays it, so it makes speculation's longer step relatively cheaper (26-40 ms at 1-4
  requests on this CPU, beside a ~320 ms one-token forward); a request whose draft cache lacks
  a long stretch (a new prompt, tokens decoded while backed off) adds its share of one batched
  prefill of the chosen rows' stretches (CatchUp), spread over the steps it has left. A
  shorter draft is the lever under load on a compute-bound device: each row's target tokens
  cost time there, and the first tokens of a draft are the likeliest to be accepted (vLLM's
  draft_model at k = 3 gained 1.18x at 4 requests on this CPU where whole 12-token drafts
  could not pay). Each request keeps two sets of these estimates (backoff_estimates.py): the
  draft model's drafts and the pool's (pool_draft.py). The pool mode plans with the pool's, F =
  0 and nothing to catch up; in the draft model's mode the requests it left out are planned the
  same way after its round (pool fill), with its rows as a fixed load on the step (StepLoad).
  The cut s bounds the sentence draft. The candidate suffixes may fill the room past it, up to
  S, each row's by the rule below (proposal_layout.py): a cut is the draft's measured
  acceptance speaking, and the suffixes are priced from their own yield.

  of the drafting rows, those whose candidate suffixes (s_r tokens, expected to add a_r accepted
  tokens) go to the target are the ones, best gain per token first, that maximise
      (G + sum_r a_r) / (t_target(N + sum_r s_r) + c + D)
  or all of them where their tokens are free, t_target(N + sum s) + c + D <= SUFFIX_FREE
  (t_target(N) + c + D) (nothing to lose on a flat curve, and refinement learns from them). N: the step's
  target tokens without suffixes, G: tokens the step is expected to give without them, D: this
  step's drafting time. a_r = P_r(accepted >= n_r) y_r: a suffix adds tokens only where the
  request's draft of n_r tokens is accepted whole (the back-off's survival estimate), and y_r,
  its yield there, is measured online per request over the steps that sent a suffix and
  accepted their draft whole (a new request starts from the mean over requests). On the real
  pair on this CPU a suffix added ~0.2-0.5 tokens per step for 4 target tokens.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.cuda_graph import capture_graph

logger = logging.getLogger(LOGGER_NAME)

# Suffixes whose tokens add at most this factor to the step go whatever their measured gain:
# on a flat curve they cost nothing and keep feeding candidate refinement.
SUFFIX_FREE = 1.02
# Pool fill on auto (proposer._fills_from_pool) runs where the target's tokens are nearly free:
# its curve at FILL_TOKENS tokens at most FILL_FLAT x its one-token forward (the H200's fused
# target-shaped forward: 1.15x; this CPU's: ~3x). On this CPU at 16 requests the fill's pool
# drafts (17-41% of their tokens accepted) gave +2% to -9% per run against none (-2% and -3%
# on average over two versions), inside a wide spread (results/README.md, "Session of
# 2026-11-29 (ninth)"); where tokens cost little every accepted one is a gain.
FILL_TOKENS, FILL_FLAT = 64, 1.5


def is_flat(curve: "CostCurve | None") -> bool:
    """Whether a forward of FILL_TOKENS tokens costs at most FILL_FLAT x a one-token one
    (None, no curve: true)."""
    return curve is None or curve.ratio(FILL_TOKENS) <= FILL_FLAT


def running_mean(mean: float | None, x: float, rate: float, outlier: float | None = None) -> float:
    """A running mean moved by `rate` of each sample x, whose first sample replaces the
    absent (None) prior. outlier: a sample counts at most this many times the mean, for timings
    that a stall (a GC pause, another process on the host) inflates: one such sample would
    otherwise price what it timed out of the plans that would time it again."""
    if mean is None:
        return x
    if outlier is not None:
        x = min(x, outlier * mean)
    return mean + rate * (x - mean)


@dataclass(frozen=True)
class CostCurve:
    """Seconds per forward of one row of n new tokens, at increasing n (measured points)."""

    n: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: float) -> float:
        """t(n) by linear interpolation (the first point's time below it); beyond the last
        point, linear in n with the last segment's slope (compute-bound).

        The same value as `at` (np.interp's arithmetic, in Python floats): a step calls this
        a few times with one n, where `at`'s array set-up is most of its ~15 us."""
        xs, ys, x = self.n, self.seconds, float(n)
        if x > xs[-1]:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) if len(xs) > 1 else 0.0
            return float(ys[-1] + slope * (x - xs[-1]))
        if x <= xs[0]:
            return float(ys[0])
        j = bisect.bisect_right(xs, x) - 1  # xs[j] <= x < xs[j + 1] (x == xs[-1]: j is last)
        if x == xs[j]:
            return float(ys[j])
        return float((ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (x - xs[j]) + ys[j])

    def at(self, n: np.ndarray) -> np.ndarray:
        """t(n) for an array of n (the rule of calling the curve)."""
        xs, ys = np.asarray(self.n, float), np.asarray(self.seconds, float)
        n = np.asarray(n, float)
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) if len(xs) > 1 else 0.0
        return np.where(n > xs[-1], ys[-1] + slope * (n - xs[-1]), np.interp(n, xs, ys))

    def ratio(self, n: float, base: float = 1) -> float:
        return self(n) / max(self(base), 1e-12)


def curve_from_ms(points) -> CostCurve:
    """A configured curve ((n, ms) points sorted by n; config.cost_points) as a CostCurve in
    seconds, kept non-decreasing as measured ones are."""
    n = tuple(p[0] for p in points)
    seconds = np.maximum.accumulate(np.array([p[1] for p in points], float) / 1000)
    return CostCurve(n, tuple(float(t) for t in seconds))


STOP_RATIO = 3.0  # measuring stops once t(n) > STOP_RATIO t(1): past it t(n) is ~linear


def measure_curve(timer_at: Callable[[int], Callable[[], float]], max_tokens: int,
                  reps: int = 3, agree: Callable[[bool], bool] = bool) -> CostCurve:
    """t(n) for n = 1, 2, 4, ... <= max_tokens, until t(n) > STOP_RATIO t(1).

    timer_at(n) prepares inputs of n tokens and returns a callable that runs one forward (or
    what stands for it) and returns its seconds, synchronising the device itself. Each point is
    the fastest of `reps` after one warm-up: the least disturbed (at engine start other
    processes compete for the cores, and one slow repetition once made a server stop
    speculating). A later point measured faster than an earlier one is noise: the curve is
    kept non-decreasing. agree(go) returns the decision to measure the next point: where
    several processes time a collective together they must stop at the same point, so one of
    them decides (patches/distributed.TensorParallel.agree)."""
    points, times, n = [], [], 1
    while n <= max_tokens and agree(not times or times[-1] <= STOP_RATIO * times[0]):
        run = timer_at(n)
        ts = [run() for _ in range(reps + 1)]
        points.append(n)
        times.append(min(ts[1:]))
        n *= 2
    for i in range(1, len(times)):
        times[i] = max(times[i], times[i - 1])
    return CostCurve(tuple(points), tuple(times))


def call_timer(fn: Callable[[], object], device: torch.device | str, graphs: bool = False,
               what: str = "a timed call") -> Callable[[], float]:
    """A callable that runs fn once and returns its seconds, the device synchronised before and
    after (a call's latency, not a queue's throughput).

    graphs (CUDA only): fn is captured once in a CUDA graph and replayed, as the engine runs
    what fn stands for (vLLM its target forward, the graph round the draft's): timed eagerly,
    a GPU forward of these sizes costs what its kernel launches cost. A capture that fails
    leaves fn eager, logged with `what`."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    step = fn
    if graphs and cuda:
        try:
            step = capture_graph(lambda _: fn(), device).replay
        except Exception as e:  # noqa: BLE001 - an eager timing is still a timing
            sync()
            logger.warning("ouroboros: capturing %s in a CUDA graph failed (%s: %s); it is timed eagerly",
                           what, type(e).__name__, e)

    def run() -> float:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - t0
    return run


def draft_forward_timer(model, n: int, graphs: bool = False, prefix: int = 0) -> Callable[[], float]:
    """A call_timer of the draft model's forward over n new tokens in one row behind `prefix`
    cached tokens, slot 0 of its KV cache (given pages for them; what was there or is written
    is overwritten later), with its greedy tokens. graphs: replayed from a CUDA graph (CUDA
    only). The model's switches (fused_ops, norm_gemm, ...) are read where the forward runs:
    at capture, for a graph."""
    slots = torch.zeros(1, dtype=torch.long, device=model.device)
    lens = torch.full((1,), prefix, dtype=torch.long, device=model.device)
    model.kv.reserve([0], [prefix + n])  # pages for the prefix and the n tokens written
    ids = torch.full((1, n), 3, dtype=torch.long, device=model.device)
    pos = torch.arange(prefix, prefix + n, device=model.device)[None]
    mask = torch.ones(n, n, dtype=torch.bool, device=model.device).tril()[None]

    def forward():
        model.greedy_tokens(model.forward(ids, pos, slots, lens, mask, max_cache_len=prefix))

    return call_timer(forward, model.device, graphs, f"the draft's forward of {n} tokens")


def measure_draft_curve(model, max_tokens: int, reps: int = 3, graphs: bool = False) -> CostCurve:
    """The draft model's t(n) (measure_curve): a forward over n new tokens in one row, empty
    prefix (draft_forward_timer).

    graphs: time the forward replayed from a CUDA graph, as the graph drafting round runs it
    (draft/device_round.py); eager GPU forwards cost what their kernel launches cost, ~10x a
    replay at these sizes, and would make the back-off refuse drafts that pay."""
    return measure_curve(lambda n: draft_forward_timer(model, n, graphs), max_tokens, reps)


def rows_sending_suffixes(target: CostCurve, step_tokens: float, suffix_tokens: np.ndarray,
                          base_tokens: float, suffix_gain: np.ndarray,
                          fixed_seconds: float) -> np.ndarray:
    """Which drafting rows of a step also send their candidate suffixes (module docstring).

    step_tokens (N): the target's tokens this step without any suffix (every row's last token
    and draft); suffix_tokens [R] (s_r): tokens row r's suffixes would add (0: it has none);
    suffix_gain [R] (a_r): tokens they are expected to add to its accepted length; base_tokens
    (G): tokens the step is expected to give without suffixes; fixed_seconds: the step's time
    besides the target forward (drafting and the engine's overhead). Returns a bool mask [R].
    """
    S = np.asarray(suffix_tokens, float)
    a = np.asarray(suffix_gain, float)
    has = S > 0
    if not has.any():
        return has
    t0 = target(step_tokens) + fixed_seconds
    if target(step_tokens + S.sum()) + fixed_seconds <= SUFFIX_FREE * t0:
        return has
    cand = np.argsort(-(a / np.maximum(S, 1)), kind="stable")
    cand = cand[has[cand]]
    gain = base_tokens + np.concatenate([[0.0], np.cumsum(a[cand])])
    t = target.at(step_tokens + np.concatenate([[0.0], np.cumsum(S[cand])])) + fixed_seconds
    out = np.zeros(len(S), bool)
    out[cand[:int(np.argmax(gain / t))]] = True
    return out


@dataclass(frozen=True)
class DraftingMode:
    """One way of drafting, with what it yielded on the real pair (MODES)."""

    name: str
    use_lookahead: bool  # the Jacobi window
    use_guesses: bool  # pool phrases verified in each draft forward
    tokens_per_target_forward: float  # E
    draft_forwards_per_token: float  # d
    uses_draft: bool = True  # False: drafts from the pool alone (pool_draft.py)

    def row_tokens(self, window_size: int, num_guesses: int, phrase_len: int) -> int:
        """Tokens per row of a draft forward in this mode (draft_row_tokens)."""
        return draft_row_tokens(window_size * self.use_lookahead, num_guesses * self.use_guesses, phrase_len)


def draft_row_tokens(window_columns: int, guesses: int, phrase_len: int) -> int:
    """Tokens per row of a lookahead draft forward: the current token and one uncached token (the
    common case), plus phrase_len per window column and per guess."""
    return 2 + (window_columns + guesses) * phrase_len


# E and d of each mode on the real pair (8 HumanEval prompts x 128 tokens, greedy, suffix sent
# and speculation at every step; W = G = 4, beta = 5, gamma = 4; the *-pinned rows of
# results/drafting_modes.json; command in results/README.md, "Drafting modes").
MODES = (
    DraftingMode("chain", False, False, 4.78, 0.89),
    DraftingMode("guesses", False, True, 5.39, 0.60),
    DraftingMode("phrases", True, True, 5.51, 0.54),
    # No draft forward: the pool's phrases chained as the draft (pool_draft.py; the same
    # protocol, the pool-pinned row of results/pool_mode.json, results/README.md "Drafting from
    # the pool alone"). E counts every step: 129 of its 395 found no phrase and decoded plainly
    # (the other modes always propose), so 579 tokens / 395 target forwards, not the 1.69 of
    # the steps that proposed.
    DraftingMode("pool", False, False, 1.47, 0.0, uses_draft=False),
)
# The pool mode where its drafts are branches under the root (pool_branches: K >= 2 on the
# tree path): the pool-branches row of results/pool_branches.json (K = 4, the same protocol,
# every step counted; results/README.md, "Branches under the root"). Taken for every K >= 2.
POOL_BRANCHES = DraftingMode("pool", False, False, 1.62, 0.0, uses_draft=False)


def pool_mode(branches: bool) -> DraftingMode:
    """The pool mode's prior: drafting branches under the root, or a chain (MODES' entry)."""
    return POOL_BRANCHES if branches else next(m for m in MODES if not m.uses_draft)


def drafting_mode_costs(draft: CostCurve, target: CostCurve | None, window_size: int, num_guesses: int,
                        phrase_len: int, target_tokens: float, pool_branches: bool = False) -> dict[str, float]:
    """Modeled seconds per output token of each mode in MODES:
    t_target(target_tokens) / E + d * t_draft(row tokens). Without a target curve the target's
    share is left out (every mode then pays the same per target forward), and with it the
    pool mode, which only the target's share prices (infinite). pool_branches: the pool mode's
    E is that of its branches (`pool_mode`)."""
    out = {}
    for m in MODES:
        m = m if m.uses_draft else pool_mode(pool_branches)
        if target is None and not m.uses_draft:
            out[m.name] = math.inf
            continue
        t = target(target_tokens) / m.tokens_per_target_forward if target is not None else 0.0
        out[m.name] = t + m.draft_forwards_per_token * draft(m.row_tokens(window_size, num_guesses, phrase_len))
    return out


def choose_drafting_mode(costs: dict[str, float], use_lookahead: bool | None = None,
                         use_guesses: bool | None = None, use_draft: bool | None = None) -> DraftingMode:
    """The cheapest mode per output token (`drafting_mode_costs`) that agrees with the switches
    the user pinned (None: auto). A pin that no mode in MODES has (the window without guesses)
    is kept as pinned by the caller; the auto switch then follows the cheapest mode that agrees
    with the other pin, or is off. Pinning the window or the guesses (on or off) configures the
    draft model's round, so it keeps the draft model; `use_draft` False is the pool mode
    whatever the other two say."""
    if use_draft is False:
        return next(m for m in MODES if not m.uses_draft)
    drafted = bool(use_draft) or use_lookahead is not None or use_guesses is not None
    fits = [m for m in MODES if use_lookahead in (None, m.use_lookahead) and use_guesses in (None, m.use_guesses)
            and not (drafted and not m.uses_draft)]
    return min(fits or MODES[:1], key=lambda m: costs[m.name])


class StepOverhead:
    """Running estimate of the engine's time per step beyond the target forward, in seconds.

    The proposer marks the end of each of its calls (`end`, with the tokens the target gets next
    step) and the start of the next (`start`): in between run the target forward and the rest of
    vLLM's step. That interval minus t_target(tokens) is one sample, taken only when the batch
    is unchanged (same requests, no prefill in the step: a new or finished request or a chunked
    prefill would charge its own work to the overhead; with the same requests running the
    engine steps without an idle gap, and a pause is capped as a stall). A step counts at most
    OUTLIER x the step modeled so far (t_target + the estimate), as proposer.RATIO_OUTLIER caps
    a round's ratio: a stall (a GC pause, another process on the host, the first launch of a
    Triton kernel compiling) would otherwise add a fifth of itself to every step's price for
    the next dozen steps. Relative to the whole modeled step, not to the estimate, which starts
    at 0: the first sample may still reach t_target, and a real overhead above that is reached
    within a few steps (the cap grows with the estimate)."""

    RATE = 0.2
    OUTLIER = 2.0

    def __init__(self, target: CostCurve | None):
        self.target = target
        self.value = 0.0
        self.samples = 0
        self._pending: tuple[tuple, float, float] | None = None  # (batch key, tokens, time)

    def start(self, batch_key: tuple | None, now: float) -> None:
        """A proposer call begins; batch_key None: this step's batch cannot give a sample."""
        pending, self._pending = self._pending, None
        if pending is None or self.target is None or pending[0] != batch_key:
            return
        forward = self.target(pending[1])
        step = min(now - pending[2], self.OUTLIER * (forward + self.value))
        # A sample below zero is the curve's own noise; clip, so the estimate stays >= 0.
        self.value += self.RATE * (max(step - forward, 0.0) - self.value)
        self.samples += 1

    def end(self, batch_key: tuple, tokens: float, now: float) -> None:
        """A proposer call ends; the target's next step runs `tokens` tokens (all rows)."""
        self._pending = (batch_key, tokens, now)


class CurveCalibration:
    """A cost curve measured at load, its points replaced by what the forwards it stands for
    take while serving (the proposer reports it; the plan still uses the load-time curve, see
    OuroborosProposer.propose).

    The target's curve is timed once, at load, on its linear layers alone (patches/target_cost.py),
    each point the fastest of three and the curve kept non-decreasing; the engine's own forwards
    differ (on this CPU its 4-token forward took 0.16 s where the curve, carrying t(2) forward,
    said 0.25 s; its 16-token one 0.285 s against 0.289). Each measured forward (n tokens,
    seconds) moves a running measured / modeled ratio at the curve's point nearest n (in log n);
    points no forward has reached keep their load-time time (a ratio read at one n is no
    evidence for another: the small-n error above is the curve's shape, not a slower host). The
    corrected curve is left as measured, not made non-decreasing: a point measured in the
    engine is what that many tokens cost. Forwards far past the curve's last point (long
    prefills) say little of a decode step and are left out."""

    RATE = 0.2
    REACH = 4  # forwards of up to REACH x the last point's tokens are counted

    def __init__(self, base: CostCurve):
        self.base = base
        self._log_n = [math.log(n) for n in base.n]  # a list: one step's lookup in Python floats
        self.ratio = np.ones(len(base.n))
        self.samples = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One measured forward of `tokens` tokens that took `seconds`."""
        if tokens < 1 or tokens > self.REACH * self.base.n[-1] or seconds <= 0:
            return
        r = min(max(seconds / max(self.base(tokens), 1e-12), 0.25), 4.0)
        log_t = math.log(tokens)
        i = min(range(len(self._log_n)), key=lambda p: abs(self._log_n[p] - log_t))
        self.ratio[i] += self.RATE * (r - self.ratio[i])
        self.samples += 1

    @property
    def curve(self) -> CostCurve:
        """The corrected curve (the load-time one until a forward is measured); built when
        asked, not at every step's observation."""
        if self.samples == 0:
            return self.base
        return CostCurve(self.base.n, tuple(float(t) for t in np.asarray(self.base.seconds) * self.ratio))

    def ratios(self) -> dict[int, float]:
        """Measured / load-time seconds by curve point (1.0 where none was measured)."""
        return {int(n): float(r) for n, r in zip(self.base.n, self.ratio)}


def geometric_survival(tokens_per_forward, max_tokens: int) -> np.ndarray:
    """P(accepted >= k), k = 1..max_tokens, of drafts whose tokens are each accepted with one
    probability a (given the ones before), a chosen so that a full draft gives
    `tokens_per_forward` (E: accepted + 1) tokens per target forward. Shape: [B] -> [B, S].
    The back-off's prior (a new request, a probe) and a way to state a test's E."""
    E = np.atleast_1d(np.asarray(tokens_per_forward, float))
    k = np.arange(1, max_tokens + 1)
    target = np.clip(E - 1, 0.0, max_tokens)
    lo, hi = np.zeros_like(target), np.ones_like(target)
    for _ in range(60):  # bisection on a: sum_k a^k grows with a
        mid = (lo + hi) / 2
        low = (mid[:, None] ** k).sum(1) < target
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return ((lo + hi) / 2)[:, None] ** k


@dataclass(frozen=True)
class CatchUp:
    """What the draft cache lacks before it can draft for each of a step's B requests.

    tokens [B]: the uncached stretch prefilled before the round (0: none, or short enough for
    the round's first forward); share: the part of that prefill charged to this step (the
    caller spreads it over the steps the request has left, at each draft length). The rows
    chosen are prefilled together (DraftRuntime._prefill, its forwards grouped by
    prefill_groups), each row bearing the cost in proportion to its tokens."""

    tokens: np.ndarray
    share: np.ndarray  # [B], or [B, S] by the draft length s = 1..S (tokens per step depend on it)
    scale: float = 1.0  # measured / modeled seconds of recent prefills (the curve's error at large n)
    # Tokens per row of each prefill forward where the prefill replays fixed-width chunks from
    # CUDA graphs (draft/prefill_graph.py): a stretch of u tokens is ceil(u / chunk) forwards of
    # `chunk` tokens per row, all rows in each. None: eager forwards as wide as the stretch.
    chunk: int | None = None

    def seconds(self, prefill: CostCurve, pick, sort) -> np.ndarray:
        """[B + 1, S] seconds per step of the first m rows' catch-up (m = 0..B) in the plan's
        row order: `pick` sums a per-row quantity over those rows, `sort` orders it. The
        runtime groups the rows' forwards to pay least (prefill_groups); modeled here as the
        cheaper of its two ends, one padded forward or one forward per row (exact where the
        curve is flat or the stretches equal, and never below what the grouping pays). With
        `chunk`, the rows' forwards are chunks of every row together: ceil(longest / chunk)
        forwards of rows x chunk tokens."""
        u = np.asarray(self.tokens, float)
        share = np.asarray(self.share, float)
        share = share[:, None] if share.ndim == 1 else share
        rows = pick(u > 0)
        longest = np.maximum.accumulate(sort(u), 0)
        longest = np.concatenate([np.zeros_like(longest[:1]), longest])
        if self.chunk is not None:
            whole = np.ceil(longest / self.chunk) * prefill.at(np.maximum(rows * self.chunk, 1))
            return np.where(rows > 0, self.scale * whole * pick(share * u[:, None]) / np.maximum(pick(u), 1), 0.0)
        together = prefill.at(np.maximum(rows * longest, 1)) * pick(share * u[:, None]) / np.maximum(pick(u), 1)
        apart = pick(np.where(u > 0, prefill.at(np.maximum(u, 1)), 0.0)[:, None] * share)
        return np.where(rows > 0, self.scale * np.minimum(together, apart), 0.0)

    def step_seconds(self, prefill: CostCurve, s: int) -> float:
        """seconds() of a step that drafts for all B rows at drafts of s tokens (1..S): what
        their catch-up adds to it as the plan that chose them charged it."""
        share = np.asarray(self.share, float)
        S = share.shape[1] if share.ndim == 2 else 1
        B = len(np.asarray(self.tokens))

        def sort(x):
            x = np.asarray(x, float)
            return np.broadcast_to(x[:, None] if x.ndim == 1 else x, (B, S))

        pick = lambda x: np.concatenate([np.zeros((1, S)), np.cumsum(sort(x), 0)])  # noqa: E731
        return float(self.seconds(prefill, pick, sort)[B, min(s, S) - 1])


def prefill_groups(counts: np.ndarray, prefill: CostCurve | None) -> list[np.ndarray]:
    """The rows of each forward of one prefill pass: counts [R] (tokens each row prefills) ->
    lists of row indices. A forward pads its rows to the longest, so rows of very different
    lengths cost less apart where a token costs more than a forward's fixed cost (a CPU);
    on a flat curve (a launch-bound GPU) one forward is cheapest. Chosen exactly: rows sorted
    by count, groups contiguous in that order, the sum of t(rows x longest) minimal (O(R^2)
    curve points, all read in one call). prefill None: one forward."""
    counts = np.asarray(counts, np.int64)
    R = len(counts)
    if prefill is None or R <= 1:
        return [np.arange(R)]
    order = np.argsort(counts, kind="stable")
    c = counts[order].astype(float)
    j, i = np.arange(1, R + 1)[:, None], np.arange(R)[None, :]
    group = prefill.at(np.maximum(j - i, 0) * c[:, None])  # [j-1, i]: one forward over rows i..j-1
    best, cut = np.zeros(R + 1), np.zeros(R + 1, np.int64)
    for j in range(1, R + 1):  # best[j]: the first j rows; the last group is rows i..j-1
        cost = best[:j] + group[j - 1, :j]
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    groups, j = [], R
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


@dataclass(frozen=True)
class StepLoad:
    """What a step carries beside the requests a plan chooses among (the rows another plan
    drafted this step): tokens for the target forward, output tokens it is expected to give,
    and seconds beyond the target forward and the engine's overhead (their drafting)."""

    target_tokens: float = 0.0
    output_tokens: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class SpeculationPlan:
    """A step's back-off decision: which requests draft ([B] bool) and the most draft tokens
    each sends to the target (the full length S where the cut does not bind; suffixes may fill
    the room past a cut: proposal_layout.py)."""

    rows: np.ndarray
    max_tokens: int


def round_forwards(whole, s, chain_below: int | None = None, stop_below: int | None = None) -> np.ndarray:
    """Draft forwards of a round cut to s draft tokens, for rows whose whole rounds run `whole`
    forwards (arrays, broadcast together): a chain's one per token below chain_below (the host
    loop), an early-exit device round's share F s / stop_below (at least one) below stop_below,
    else a whole round's (speculation_plan); never more than s: every forward gives each
    drafting row a token at least, and a fixed-F device round cut to s runs min(F, s)
    (DeviceRound.run)."""
    whole, s = np.asarray(whole, float), np.asarray(s, float)
    f = np.broadcast_to(whole, np.broadcast_shapes(whole.shape, s.shape))
    if stop_below is not None:
        f = np.where(s < stop_below, np.maximum(whole * s / stop_below, 1.0), f)
    if chain_below is not None:
        f = np.where(s < chain_below, np.maximum(s, 1.0), f)
    return np.minimum(f, np.maximum(s, 1.0))


def speculation_plan(target: CostCurve, draft: CostCurve, accepted: np.ndarray, sent: np.ndarray,
                     draft_forwards: np.ndarray, draft_row_tokens: float, step_overhead: float = 0.0,
                     chain_below: int | None = None, chain_row_tokens: float = 2,
                     catch_up: CatchUp | None = None, prefill: CostCurve | None = None,
                     draft_scale: tuple[float, float] = (1.0, 1.0),
                     load: StepLoad = StepLoad(), lookup_seconds: float = 0.0,
                     stop_below: int | None = None) -> SpeculationPlan:
    """Which of a step's B decoding requests speculate, and how long their drafts may be
    (module docstring).

    accepted [B, S]: P_i(accepted >= k) and sent [B, S]: P_i(sent >= k), k = 1..S, for drafts of
    the full length S (num_speculative_tokens); draft_forwards [B] (F_i): draft forwards per
    step of a whole round, each over draft_row_tokens tokens per row. chain_below: a draft cut
    below this many tokens (the round's gamma) is drafted one token per forward, F = s forwards
    over chain_row_tokens tokens per row (the host loop without window or guesses: the same
    greedy tokens, a narrower forward); None where rounds have fixed shapes (device rounds): a
    cut draft then costs a whole round and saves target tokens only, unless stop_below is
    given: a device round with early exit, whose rows stop at the cut and which stops once they
    have, runs F_i s / stop_below forwards (at least one) for a draft cut below stop_below (the
    round's length) tokens, as wide as a whole round's. step_overhead (c,
    seconds): the engine's time per step beyond the target forward. catch_up: the stretches
    the draft cache lacks per request, prefilled before the round (CatchUp); the requests
    chosen share one batched prefill, timed by the `prefill` curve (default: draft's).
    draft_scale (whole, chain): measured / modeled seconds of recent whole and chain rounds
    (what a round costs beyond its forwards' curve: host work, pool lookups, trimmed widths).
    load: the step's other rows (drafted by another plan; StepLoad), in its forward and its
    output alike. lookup_seconds: what a step pays once any request drafts, beside draft
    forwards (the pool's lookups where the pool drafts). Ties go to fewer requests and to
    longer drafts.
    """
    A, T = np.asarray(accepted, float), np.asarray(sent, float)
    F = np.asarray(draft_forwards, float)
    B, S = A.shape
    if B == 0:
        return SpeculationPlan(np.zeros(0, bool), S)
    gain, tokens = np.cumsum(A, 1), np.cumsum(T, 1)  # [B, S]: E_i(s) - 1, T_i(s) at s = 1..S
    s = np.arange(1, S + 1)
    chain = np.zeros(S, bool) if chain_below is None else s < chain_below
    f = round_forwards(F[:, None], s[None, :], chain_below, stop_below)  # [B, S]
    n_d = np.where(chain, chain_row_tokens, draft_row_tokens)  # [S]
    k_d = np.where(chain, draft_scale[1], draft_scale[0])  # [S]
    m = np.arange(B + 1)[:, None]
    orders = [np.argsort(-gain, axis=0, kind="stable")]  # [B, S]: per s, rows best first
    if catch_up is not None and (np.asarray(catch_up.tokens) > 0).any():
        # Rows ready to draft first: the optimistic prior ranks a new request (whose prompt the
        # draft must prefill) above measured ones, so the gain order alone would weigh every
        # cached request only behind the prefills.
        late = (np.asarray(catch_up.tokens) > 0)[:, None]
        orders.append(np.lexsort((-gain, np.broadcast_to(late, (B, S))), axis=0))
        # Then the cheapest catch-up first among those rows: at a burst's start every new
        # request ranks at the prior, and in index order one long prompt near its end (its
        # prefill charged to the few steps it has left) kept a short one behind it from
        # drafting (6.06 tokens/s against 9.67 for the short one alone, in a review's case).
        share = np.asarray(catch_up.share, float)
        cost = (share[:, None] if share.ndim == 1 else share) * np.asarray(catch_up.tokens, float)[:, None]
        orders.append(np.lexsort((-gain, np.broadcast_to(cost, (B, S)), np.broadcast_to(late, (B, S))), axis=0))
    best = None
    for order in orders:
        def sort(x):  # a per-row quantity ([B], or [B, S] by draft length) in each s's row order
            x = np.asarray(x, float)
            return np.take_along_axis(np.broadcast_to(x[:, None] if x.ndim == 1 else x, (B, S)), order, 0)

        pick = lambda x: np.concatenate([np.zeros((1, S)), np.cumsum(sort(x), 0)])  # noqa: E731
        t = (target.at(load.target_tokens + B + pick(tokens)) + step_overhead + load.seconds
             + np.where(m > 0, pick(f) / np.maximum(m, 1) * k_d * draft.at(np.maximum(m, 1) * n_d)
                        + lookup_seconds, 0))
        if catch_up is not None:
            t = t + catch_up.seconds(draft if prefill is None else prefill, pick, sort)
        rate = (load.output_tokens + B + pick(gain)) / t  # [B + 1, S]: the first m requests at s tokens
        if best is None or rate.max() > best[0].max() + 1e-12:
            best = rate, order
    rate, order = best
    best_m = rate.argmax(0)  # fewest requests on ties
    best_rate = rate[best_m, np.arange(S)]
    j = S - 1 - int(np.argmax(best_rate[::-1]))  # the longest draft on ties
    rows = np.zeros(B, bool)
    rows[order[:best_m[j], j]] = True
    return SpeculationPlan(rows, int(s[j]) if best_m[j] else S)
