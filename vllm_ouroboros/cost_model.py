"""When speculation pays on this device: per-forward cost curves and the two decisions built on
them (phrase drafting on/off at load; speculate or not per step under load).

A forward over n tokens costs t(n). On a GPU at these sizes t(n) is nearly flat (memory-bound:
the weights are read once whatever n is); on a CPU it grows with n (compute-bound). Both curves
are measured when the engine loads: the draft's by running our draft model, the target's from
its own weights (patches/target_cost.py: its linear layers and LM head on n rows). Rules
(README "Choosing settings per hardware"):

  phrase drafting (Jacobi window + pool guesses) is on iff
      t_draft(n_lookahead) <= PHRASE_SAVING * t_draft(1)
  where n_lookahead = 2 + (W + G) * (beta - 1) tokens per row and PHRASE_SAVING = 1 / 0.63 is
  the draft forwards per token it saves, measured on the real pair (0.92 -> 0.58 draft forwards
  per token, results/README.md).

  a step with B decoding requests speculates (s tokens each) iff the extra target tokens are
  almost free, t_target(B (1 + s)) <= FLAT * t_target(B), or the modeled rate beats plain
  decoding:
      B E / (t_target(B (1 + s)) + F t_draft(B n_d))  >  B / t_target(B)
  with E tokens per target forward and F draft forwards per step, measured online (optimistic
  priors until a few steps have run), n_d tokens per draft row per forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

PHRASE_SAVING = 0.92 / 0.58
FLAT = 1.25


@dataclass(frozen=True)
class CostCurve:
    """Seconds per forward of one row of n new tokens, at increasing n (measured points)."""

    n: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: float) -> float:
        """t(n) by linear interpolation; beyond the last point, linear in n (compute-bound)."""
        xs, ys = self.n, self.seconds
        if n <= xs[0]:
            return ys[0]
        for a, b, ya, yb in zip(xs, xs[1:], ys, ys[1:]):
            if n <= b:
                return ya + (yb - ya) * (n - a) / (b - a)
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (n - xs[-1])

    def ratio(self, n: float, base: float = 1) -> float:
        return self(n) / max(self(base), 1e-12)


STOP_RATIO = 3.0  # measuring stops once t(n) > STOP_RATIO t(1): past it t(n) is ~linear


def measure_draft_curve(model, max_tokens: int, reps: int = 3) -> CostCurve:
    """Time the draft model's forward over n = 1, 2, 4, ... <= max_tokens new tokens (one row,
    empty prefix, slot 0 of its KV cache; what was written there is overwritten later), until
    t(n) > STOP_RATIO t(1). Fastest of `reps` after one warm-up (the least disturbed: at engine
    start other processes compete for the cores); synchronises around each."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    points, times, n = [], [], 1
    slots = torch.zeros(1, dtype=torch.long, device=model.device)
    zero = torch.zeros(1, dtype=torch.long, device=model.device)
    while n <= max_tokens and (not times or times[-1] <= STOP_RATIO * times[0]):
        ids = torch.full((1, n), 3, dtype=torch.long, device=model.device)
        pos = torch.arange(n, device=model.device)[None]
        mask = torch.ones(n, n, dtype=torch.bool, device=model.device).tril()[None]
        ts = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            model.greedy_tokens(model.forward(ids, pos, slots, zero, mask, max_cache_len=0))
            sync()
            ts.append(time.perf_counter() - t0)
        points.append(n)
        times.append(min(ts[1:]))
        n *= 2
    # A later point measured faster than an earlier one is noise: keep the curve non-decreasing.
    for i in range(1, len(times)):
        times[i] = max(times[i], times[i - 1])
    return CostCurve(tuple(points), tuple(times))


def phrase_drafting_pays(curve: CostCurve, lookahead_tokens: int) -> bool:
    """Whether the Jacobi window and pool guesses (a forward of `lookahead_tokens` per row)
    cost less than the one-token forwards they save."""
    return curve.ratio(lookahead_tokens) <= PHRASE_SAVING


def speculation_pays(target: CostCurve, draft: CostCurve, batch: int, spec_tokens: float,
                     tokens_per_forward: float, draft_forwards: float, draft_row_tokens: float) -> bool:
    """Whether a step of `batch` requests with `spec_tokens` each beats plain decoding (module
    docstring). Curves in seconds; tokens_per_forward: E >= 1; draft_forwards: F per step;
    draft_row_tokens: n_d."""
    t_plain = target(batch)
    t_spec = target(batch * (1 + spec_tokens))
    if t_spec <= FLAT * t_plain:
        return True
    return tokens_per_forward * t_plain > t_spec + draft_forwards * draft(batch * draft_row_tokens)
