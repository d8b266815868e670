"""The back-off's per-request estimates of what a draft gives, for one source of drafts.

cost_model.speculation_plan weighs, per request, P(accepted >= k) and P(sent >= k) for
k = 1..S (S: num_speculative_tokens), whose sums are the tokens per target forward and the
target tokens of a draft cut to s tokens. They are running means over the request's verified
steps, from optimistic priors, so that a request starts by speculating and measures; one hard
request does not stop the others. A request the plan leaves out is a probe candidate every few
steps: its estimates are then replaced by the prior for the decision, so it is retried wherever
a request that accepts well would pay, and the probe's verification refreshes them.

The draft model and the pool (pool_draft.py) draft differently for the same request: each keeps
its own BackoffEstimates (proposer.py), so a request whose model drafts fail while the pool's
phrases land is priced for each as measured. So do the pool's branches, whose cut is in whole
branches (pool_draft.branches_under_cut). Host numpy, indexed by the proposer's slots.
No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_ouroboros.cost_model import SpeculationPlan

# Running means move by ESTIMATE_RATE of each new measurement; a request left without a draft
# is retried with the prior after PROBE_GAP steps, the gap doubling after each probe
# that did not bring it back (up to MAX_PROBE_GAP), so a stretch of poor acceptance costs
# little and a recovery is seen soon.
ESTIMATE_RATE = 0.3
# Per step, how far an unmeasured position's P(accepted >= k) (past a cut draft) moves back
# toward the prior: a cut request retries longer drafts after ~10-20 steps.
UNSEEN_DRIFT = 0.05
PROBE_GAP = 4
MAX_PROBE_GAP = 32
# A learned prior (learn_prior) moves by this much per request-step measured at a position:
# the mean over the last few dozen request-steps of every request.
PRIOR_RATE = 0.05
# Per plan, how far a learned prior's positions that no request measured since the last plan
# move back toward their seed (prior_accepted). Without it a prior pulled below break-even was
# absorbing: a probe is decided at the prior, so none paid, nothing was measured, and the prior
# never moved again (8% acceptance for 30 steps at 16 requests stopped the pool's drafts for
# the next 2,000 steps, and with them the pool mode's review). Half-way back in ~23 unmeasured
# steps, about the longest probe gap: a probe then pays again, and measures.
PRIOR_DRIFT = 0.03


class BackoffEstimates:
    """Per-slot survival estimates ([slots, S] each) and probe state for one draft source.

    accepted[slot, k-1] is what the draft's k-th token adds to the tokens per target forward,
    in expectation: P(accepted >= k) for a chain; for the pool's branches of L tokens, position
    b L holds what branch b adds over branches 1..b-1 and the others 0 (pool_draft.branch_gains).
    Either way its cumulative sum is E(s) - 1, all that cost_model.speculation_plan reads."""

    def __init__(self, max_slots: int, prior_accepted: np.ndarray, learn_prior: bool = False):
        """prior_accepted [S]: the `accepted` a new request starts from (sent starts at 1).
        learn_prior: the prior follows what every request measured (a running mean over them,
        PRIOR_RATE per request-step), so a new request starts from what this source gave the
        requests before it, where a fixed optimistic prior would have it send whole drafts that
        a source known to land rarely does not earn (the pool: its first steps per request cost
        a compute-bound target dear); it starts at prior_accepted."""
        self.prior = np.array(prior_accepted, float)
        self.seed = self.prior.copy()
        self.learn_prior = learn_prior
        S = len(self.prior)
        self._measured = np.zeros(S, bool)  # positions measured since the last plan
        self.accepted = np.tile(self.prior, (max_slots, 1))
        self.sent = np.ones((max_slots, S))
        self.probe_gap = np.full(max_slots, PROBE_GAP, np.int64)
        self.probe_wait = np.full(max_slots, PROBE_GAP, np.int64)

    def reset(self, slots) -> None:
        """Start these slots (an index or array; slice(None) for all) from the priors."""
        self.accepted[slots] = self.prior
        self.sent[slots] = 1.0
        self.probe_gap[slots] = PROBE_GAP
        self.probe_wait[slots] = PROBE_GAP

    def observe(self, slots: np.ndarray, cut: np.ndarray, accepted: np.ndarray, sent: np.ndarray,
                gains: np.ndarray | None = None) -> None:
        """One verification per slot ([R] each): the tokens the target accepted and those sent,
        of drafts cut to `cut` tokens. A cut draft says how far the whole draft would have been
        accepted up to the cut only, so positions k <= cut learn from it. Positions past the cut
        go unmeasured: left as they were, one poor stretch would keep a request's drafts short
        for good, so they drift back toward the prior and a longer draft is tried again now and
        then (the probe's idea, per position). gains [R, S] (tokens) or None: what each
        position added to the accepted tokens where that is not "accepted >= k" (the pool's
        branches, pool_draft.branch_gains); `accepted` is then unused."""
        k = np.arange(1, self.accepted.shape[1] + 1)[None, :]
        seen = k <= cut[:, None]
        A, T = self.accepted[slots], self.sent[slots]
        hit = k <= accepted[:, None] if gains is None else gains
        self.accepted[slots] = np.where(seen, A + ESTIMATE_RATE * (hit - A),
                                        A + UNSEEN_DRIFT * (self.prior - A))
        self.sent[slots] = np.where(seen, T + ESTIMATE_RATE * ((k <= sent[:, None]) - T), T)
        if self.learn_prior:
            n = seen.sum(0)  # [S]: request-steps measured at each position
            mean = np.where(seen, hit, 0).sum(0) / np.maximum(n, 1)
            self.prior += (1 - (1 - PRIOR_RATE) ** n) * (mean - self.prior)
            self._measured |= n > 0

    def whole_chance(self, slots: np.ndarray, n: np.ndarray) -> np.ndarray:
        """P(a draft of n [R] tokens is accepted whole) per slot [R] (1 where n = 0)."""
        k = np.clip(n, 1, self.accepted.shape[1]) - 1
        return np.where(n > 0, self.accepted[slots, k], 1.0)

    def plan(self, slots: np.ndarray, decide: Callable[[np.ndarray, np.ndarray], SpeculationPlan]) -> SpeculationPlan:
        """The step's plan for these slots ([B]) from decide(accepted [B, S], sent [B, S]),
        with the probes: a slot left out whose wait ran down is decided again at the prior, and
        drafts where a request at the prior would pay (its gap doubles; a learned prior's
        unmeasured positions drift back toward the seed first, PRIOR_DRIFT); a slot that drafts
        without probing has its gap reset. A probing step takes the probe's plan whole: its
        cut was chosen for its own rows (the plan's rows with the probe's cut sent the cut of
        another set of rows: 7% below the plan's modeled rate in a 6-request case)."""
        if self.learn_prior:
            self.prior += np.where(self._measured, 0.0, PRIOR_DRIFT * (self.seed - self.prior))
            self._measured[:] = False
        A, T = self.accepted[slots], self.sent[slots]
        plan = decide(A, T)
        spec = plan.rows
        due = ~spec & (self.probe_wait[slots] <= 0)
        if due.any():
            probe = decide(np.where(due[:, None], np.maximum(A, self.prior), A), T)
            probing = probe.rows & due
            if probing.any():
                s = slots[probing]
                self.probe_gap[s] = np.minimum(2 * self.probe_gap[s], MAX_PROBE_GAP)
                self.probe_wait[s] = self.probe_gap[s]
                plan, spec = probe, probe.rows
        on, off = slots[spec & ~due], slots[~spec]
        self.probe_gap[on] = self.probe_wait[on] = PROBE_GAP
        self.probe_wait[off] -= 1
        return plan
