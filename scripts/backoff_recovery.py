"""The pool's learned back-off prior after a stretch of hard text: does the pool draft again?

The back-off plans each step from per-request estimates (vllm_ouroboros/backoff_estimates.py);
the pool's prior is learned from every request's measurements and a probe is decided at it.
This replays the real BackoffEstimates and cost_model.speculation_plan on a GPU-shaped flat
target curve (2 ms a forward, 0.5 ms of step overhead) at 16 requests, with geometric
acceptance: per step, a drafted row's tokens are accepted one by one with the text's chance.

  hard-then-easy: the chance is 8% for 30 steps, then 70%; prints the first step after the
      text turned easy in which the pool drafted (none: the prior is stuck below break-even)
  hard-throughout: 8% for all steps; prints the share of row-steps drafted (probes' cost)

Both for the pool's lookups at 0.3 and 0.9 ms a step, and with the prior's drift toward its seed
switched off (--no-drift), as before it existed. No vLLM, no model: seconds.

    python scripts/backoff_recovery.py [--steps 2000] [--no-drift]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_ouroboros import backoff_estimates, cost_model  # noqa: E402

S, B = 8, 16
TARGET = cost_model.CostCurve((1, 2, 4, 8, 16, 32, 64, 128, 256), (2.0e-3,) * 6 + (2.1e-3, 2.3e-3, 2.8e-3))
DRAFT = cost_model.CostCurve((1, 2), (1e-3, 1e-3))  # unused by the pool's plan (no draft forward)
OVERHEAD = 0.5e-3


def replay(chance, steps: int, lookup_seconds: float, seed: int = 0) -> tuple[int | None, float]:
    """(first drafting step at or after the chance's change, None if none; share of row-steps
    drafted). chance(step) -> per-token acceptance chance."""
    rng = np.random.default_rng(seed)
    prior = cost_model.geometric_survival(1 + 0.5 * S, S)[0]
    est = backoff_estimates.BackoffEstimates(B, prior, learn_prior=True)
    slots = np.arange(B)

    def decide(A, T):
        return cost_model.speculation_plan(TARGET, DRAFT, A, T, np.zeros(B), 1, OVERHEAD,
                                           lookup_seconds=lookup_seconds)

    first, rows, changed = None, 0, None
    for step in range(steps):
        p = chance(step)
        if changed is None and step > 0 and p != chance(step - 1):
            changed = step
        plan = est.plan(slots, decide)
        n = int(plan.rows.sum())
        if not n:
            continue
        rows += n
        if changed is not None and first is None:
            first = step
        accepted = np.minimum(rng.geometric(1 - p, n) - 1, plan.max_tokens)
        est.observe(slots[plan.rows], np.full(n, plan.max_tokens), accepted, np.full(n, plan.max_tokens))
    return first, rows / (steps * B)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--no-drift", action="store_true", help="the learned prior without its drift (as before)")
    a = ap.parse_args()
    if a.no_drift:
        backoff_estimates.PRIOR_DRIFT = 0.0
    print(f"PRIOR_DRIFT {backoff_estimates.PRIOR_DRIFT}, {B} requests, {a.steps} steps")
    for lookup in (0.3e-3, 0.9e-3):
        first, _ = replay(lambda t: 0.08 if t < 30 else 0.7, a.steps, lookup)
        _, share = replay(lambda t: 0.08, a.steps, lookup)
        again = ("never drafts again after" if first is None else
                 f"drafts again {first - 30} steps after")
        print(f"lookup {lookup * 1e3:.1f} ms: hard-then-easy: the pool {again} the text turned easy; "
              f"hard-throughout: {share:.3f} of row-steps drafted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
