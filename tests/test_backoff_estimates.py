"""The back-off's per-request estimates of one draft source (vllm_ouroboros/backoff_estimates.py):
what a verification teaches, the chance a draft is accepted whole, probes, and the pool's prior
learned from the requests before."""

import numpy as np
import pytest

from vllm_ouroboros import cost_model
from vllm_ouroboros.backoff_estimates import PRIOR_DRIFT, PRIOR_RATE, PROBE_GAP, BackoffEstimates
from vllm_ouroboros.cost_model import SpeculationPlan

S = 6


def test_a_learned_prior_follows_every_requests_measurements():
    """learn_prior: the prior moves toward what the requests measured, PRIOR_RATE per
    request-step at each position measured, so a new request (reset) starts there; a fixed
    prior stays. Positions past a cut draft teach neither."""
    prior = cost_model.geometric_survival(3.0, S)[0]
    fixed, learned = BackoffEstimates(4, prior), BackoffEstimates(4, prior, learn_prior=True)
    for est in (fixed, learned):
        # Two requests, drafts cut to 3 tokens, none accepted.
        est.observe(np.array([0, 1]), np.array([3, 3]), np.array([0, 0]), np.array([3, 3]))
    assert (fixed.prior == prior).all()
    w = 1 - (1 - PRIOR_RATE) ** 2
    assert learned.prior[:3] == pytest.approx(prior[:3] * (1 - w))
    assert (learned.prior[3:] == prior[3:]).all()
    learned.reset(2)
    assert (learned.accepted[2] == learned.prior).all() and (learned.sent[2] == 1).all()
    assert learned.probe_gap[2] == learned.probe_wait[2] == PROBE_GAP


def test_a_learned_prior_below_break_even_drifts_back_until_a_probe_measures_again():
    """A probe is decided at the prior: a learned prior pulled below break-even sent none, so
    nothing was measured and the prior never moved again (the pool stopped drafting for good,
    and the pool mode's review with it). Positions no request measured since the last plan move
    back toward the seed, PRIOR_DRIFT per plan; measured ones do not; a probe then pays, and
    what it measures pulls the prior down again."""
    seed = cost_model.geometric_survival(5.0, S)[0]
    est = BackoffEstimates(4, seed, learn_prior=True)
    slots = np.arange(4)
    for _ in range(30):  # hard text: nothing accepted, all four requests, whole drafts
        est.observe(slots, np.full(4, S), np.zeros(4, np.int64), np.full(4, S))
    low = est.prior.copy()
    assert low[0] < 0.05
    decide = lambda A, T: SpeculationPlan(A[:, 0] > 0.5, S)  # noqa: E731 (break-even at 0.5)
    est.accepted[:] = low
    plans = 0
    while not est.plan(slots, decide).rows.any():
        plans += 1
        assert plans < 200, "no probe ever drafted: the learned prior is absorbing"
    # The first plan follows the measurements (no drift); each later one drifts, until position
    # 1 crosses 0.5: seed - (seed - low) (1 - PRIOR_DRIFT)^k.
    k = plans
    assert est.prior == pytest.approx(seed - (seed - low) * (1 - PRIOR_DRIFT) ** k)
    assert k == int(np.ceil(np.log((seed[0] - 0.5) / (seed[0] - low[0])) / np.log(1 - PRIOR_DRIFT)))
    # A plan after a measurement leaves the measured positions where the measurement put them.
    est.observe(slots[:2], np.full(2, 2), np.zeros(2, np.int64), np.full(2, 2))
    measured = est.prior.copy()
    est.plan(slots, decide)
    assert est.prior[:2] == pytest.approx(measured[:2])
    assert est.prior[2:] == pytest.approx(measured[2:] + PRIOR_DRIFT * (seed[2:] - measured[2:]))
    fixed = BackoffEstimates(4, seed)  # a fixed prior does not drift (not learned: not its seed)
    fixed.prior[:] = low
    fixed.plan(slots, decide)
    assert (fixed.prior == low).all()


def test_whole_chance_and_probes():
    """whole_chance: P(accepted >= n), 1 without a draft. plan: a slot left out whose wait ran
    down is decided at the prior; it drafts where that pays, and its gap doubles."""
    est = BackoffEstimates(2, cost_model.geometric_survival(5.0, S)[0])
    est.accepted[:] = cost_model.geometric_survival(np.array([1.2, 5.0]), S)
    assert est.whole_chance(np.array([0, 1, 1]), np.array([2, 2, 0])).tolist() == pytest.approx(
        [est.accepted[0, 1], est.accepted[1, 1], 1.0])
    # A decision that drafts where P(accepted >= 1) > 0.5.
    decide = lambda A, T: SpeculationPlan(A[:, 0] > 0.5, S)  # noqa: E731
    slots = np.array([0, 1])
    steps = [est.plan(slots, decide).rows.tolist() for _ in range(PROBE_GAP + 1)]
    assert steps[:PROBE_GAP] == [[False, True]] * PROBE_GAP
    assert steps[PROBE_GAP] == [True, True] and est.probe_gap[0] == 2 * PROBE_GAP
    assert est.probe_gap[1] == PROBE_GAP


def test_gains_in_place_of_accepted_lengths():
    """The pool's branches (pool_draft.branch_gains): a position's estimate moves toward the
    tokens it added, not toward "accepted >= k"; positions past the cut drift to the prior, and
    the learned prior follows the gains' mean."""
    from vllm_ouroboros.backoff_estimates import ESTIMATE_RATE

    prior = np.array([0, 2.0, 0, 0.5, 0, 0.1])
    est = BackoffEstimates(2, prior, learn_prior=True)
    gains = np.array([[0, 2.0, 0, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]])
    est.observe(np.array([0, 1]), np.array([4, 4]), np.array([9, 9]), np.array([4, 4]), gains)
    expect = prior + ESTIMATE_RATE * (gains - prior)
    expect[:, 4:] = prior[4:]  # past the cut: unmeasured (they start at the prior)
    assert est.accepted == pytest.approx(expect)
    w = 1 - (1 - PRIOR_RATE) ** 2
    assert est.prior[:4] == pytest.approx(prior[:4] + w * (gains.mean(0)[:4] - prior[:4]))
    assert (est.prior[4:] == prior[4:]).all()


def test_a_probing_step_takes_the_probes_plan_whole():
    """The probe's cut is chosen for the probe's rows: a decision that sends long drafts for a
    request alone and short ones for two. Slot 1 drafts alone (its own plan: 6 tokens); slot 0,
    due for a probe at the prior, displaces it in the probe's plan (3 tokens for the better
    alone). The step is the probe's plan, not slot 1 at the probe's cut beside slot 0."""
    prior = cost_model.geometric_survival(5.0, S)[0]
    est = BackoffEstimates(2, prior)
    est.accepted[:] = cost_model.geometric_survival(np.array([1.2, 3.0]), S)
    est.probe_wait[0] = 0

    def decide(A, T):  # the best row alone, 6 tokens if it is slot 1's estimates, else 3
        best = int(np.argmax(A.sum(1)))
        rows = np.arange(len(A)) == best
        return SpeculationPlan(rows, 6 if A[best].sum() < prior.sum() else 3)

    plan = est.plan(np.array([0, 1]), decide)
    assert plan.rows.tolist() == [True, False] and plan.max_tokens == 3
    assert est.probe_gap[0] == 2 * PROBE_GAP and est.probe_wait[1] == PROBE_GAP - 1
