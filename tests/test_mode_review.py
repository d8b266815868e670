"""The drafting mode re-chosen while serving (vllm_ouroboros/mode_review.py): between the draft
model's mode built at load and the pool mode, from the engine's measured step time and each
mode's measured tokens per target forward, at the batch it runs."""

import numpy as np
import pytest

from vllm_ouroboros import cost_model
from vllm_ouroboros.mode_review import ModeReview

MODES = {m.name: m for m in cost_model.MODES}
PHRASES, POOL = MODES["phrases"], MODES["pool"]
ROW = PHRASES.row_tokens(4, 4, 4)  # 34 tokens per row
N_T = 1 + 4 + 4  # the target's tokens per drafting row

# The H200 draft targets: 1.2 ms decode, 1.5 ms for a 34-token forward.
DRAFT = cost_model.curve_from_ms([(1, 1.2), (34, 1.5), (64, 1.6)])


def flat(ms):
    return cost_model.curve_from_ms([(1, ms), (256, ms)])


def review(every=4):
    return ModeReview(PHRASES, POOL, ROW, N_T, every)


def test_load_time_choice_and_review_agree_without_measurements():
    """No overhead, no measured E: the review prices the modes as drafting_mode_costs does at
    load, so it keeps the load-time choice."""
    for target_ms in (1.45, 3.0):
        costs = cost_model.drafting_mode_costs(DRAFT, flat(target_ms), 4, 4, 4, N_T)
        at_load = min(("phrases", "pool"), key=costs.get)
        r = review()
        r.steps = r.every
        assert r.review(at_load, flat(target_ms), None, DRAFT, 1.0, 0.0) is None
        for m in ("phrases", "pool"):
            assert r.last[m].seconds_per_token == pytest.approx(costs[m]), m


def test_a_step_dearer_than_the_target_curve_moves_to_the_draft_model():
    """The load-time risk: the target's curve (linear layers + LM head) said 1.45 ms, so the
    pool was chosen (0.99 vs 1.07 ms per token); the engine's measured step is 1.96 ms (0.51 ms
    of overhead beyond the curve), where the draft model's mode costs 1.17 against the pool's
    1.33. Within the margin (a 1.8 ms step: 7% apart) the mode stays."""
    costs = cost_model.drafting_mode_costs(DRAFT, flat(1.45), 4, 4, 4, N_T)
    assert min(("phrases", "pool"), key=costs.get) == "pool"
    r = review()
    r.steps = r.every
    assert r.review("pool", flat(1.45), 0.35e-3, DRAFT, 1.0, 0.0) is None
    assert r.switches == 0 and r.steps == 0
    r.steps = r.every
    assert r.review("pool", flat(1.45), 0.51e-3, DRAFT, 1.0, 0.0) == "phrases"
    assert r.switches == 1
    # From the draft model's mode the same prices keep it.
    r.steps = r.every
    assert r.review("phrases", flat(1.45), 0.51e-3, DRAFT, 1.0, 0.0) is None
    r.steps = 0
    # Each switch doubles the steps to the next review (16x at most).
    assert r.gap == 2 * r.every and not r.due()
    r.steps = 2 * r.every - 1
    assert not r.due()
    r.steps += 1
    assert r.due()
    for _ in range(10):
        r.steps = r.gap  # back in the pool mode where the step makes phrases the cheaper
        assert r.review("pool", flat(1.45), 0.51e-3, DRAFT, 1.0, 0.0) == "phrases"
    assert r.switches == 11 and r.gap == ModeReview.MAX_GAP * r.every
    assert 1000 * r.last["phrases"].seconds_per_token == pytest.approx(1.96 / 5.51 + 0.54 * 1.5, rel=1e-3)
    assert 1000 * r.last["pool"].seconds_per_token == pytest.approx(1.96 / 1.47, rel=1e-3)


def test_measured_tokens_per_forward_replace_the_prior():
    """A text the draft predicts badly: phrases measured at 2 tokens per target forward (3
    forwards a round), against the pool's prior 1.47, on a 1.96 ms step: the pool is cheaper.
    Below MIN_ROWS rows the prior stands."""
    r = review()
    r.observe("phrases", np.full(ModeReview.MIN_ROWS - 1, 2.0))
    assert r.tokens_per_forward("phrases") == (PHRASES.tokens_per_target_forward, False)
    r.observe("phrases", np.array([2.0]))
    E, measured = r.tokens_per_forward("phrases")
    assert measured and E == pytest.approx(2.0)
    for _ in range(r.every):
        r.step("phrases", 1, 3)
    assert r.due()
    assert r.review("phrases", flat(1.96), None, DRAFT, 1.0, 0.0) == "pool"
    assert r.last["phrases"].seconds_per_token == pytest.approx((1.96e-3 + 3 * 1.5e-3) / 2.0)
    assert r.last["phrases"].measured and not r.last["pool"].measured


def test_measured_mean_follows_recent_rows():
    """E is a decayed mean: rows measured long ago weigh less than recent ones."""
    r = review()
    r.observe("pool", np.full(2000, 3.0))
    r.observe("pool", np.full(400, 1.0))
    E, _ = r.tokens_per_forward("pool")
    k = ModeReview.DECAY ** 400  # the older rows' weight after 400 newer ones
    assert E == pytest.approx((3.0 * 2000 * k + 400) / (2000 * k + 400)) and E < 2.0
    r.observe("nonesuch", np.ones(5))  # a mode the review does not hold is ignored
    r.observe("pool", np.zeros(0))
    assert r.rows_measured == {"phrases": 0, "pool": 2400}


def test_under_load_the_pool_wins_where_the_draft_forward_widens():
    """A flat 2 ms target (to 256 tokens, rising after) and a draft whose 34-token rows cost
    6 ms at 32 requests: at one request the draft model's mode is the cheaper, at 32 the pool
    (the target's forward is shared by the batch, the draft's forwards grow with it)."""
    target = cost_model.curve_from_ms([(1, 2.0), (256, 2.0), (512, 3.0)])
    draft = cost_model.curve_from_ms([(1, 1.2), (34, 1.5), (1088, 6.0)])
    r = review()
    for _ in range(r.every):
        r.step("phrases", 1, None)
    assert r.review("phrases", target, 0.0, draft, 1.0, 0.0) is None
    for _ in range(200):
        r.step("phrases", 32, None)
    assert r.batch == pytest.approx(32, rel=1e-3)
    assert r.review("phrases", target, 0.0, draft, 1.0, 0.0) == "pool"


def test_pool_lookups_and_round_forwards_are_priced_as_measured():
    """The pool mode's drafting is the pool lookups' measured time (the proposer's mean, passed
    in); the draft mode's forwards per round its measured mean once rounds ran, and the
    measured round/curve ratio scales them."""
    r = review()
    for _ in range(50):
        r.step("pool", 1, None)
    for _ in range(50):
        r.step("phrases", 1, 2)
    prices = r.price(0.002, DRAFT, 1.5, 0.0005)
    assert prices["pool"].draft_seconds == 0.0005
    assert prices["pool"].seconds_per_token == pytest.approx(0.0025 / POOL.tokens_per_target_forward)
    assert prices["phrases"].draft_seconds == pytest.approx(2 * 1.5 * 1.5e-3, rel=1e-3)


def test_steps_in_which_nothing_drafted_count_toward_the_review():
    """Where the back-off left every row out (the pool landing nothing for a while), the step
    still counts toward the next review: counting drafting steps only, a pool mode whose drafts
    had all stopped was never reviewed again, the engine decoding plainly for good. An idle step
    leaves the batch the review prices at."""
    r = review(every=4)
    r.step("pool", 3, None)
    batch = r.batch
    for _ in range(3):
        assert not r.due()
        r.idle_step()
    assert r.due() and r.batch == batch


def test_bad_arguments():
    with pytest.raises(ValueError, match="not a draft model's mode and the pool's"):
        ModeReview(PHRASES, MODES["chain"], ROW, N_T)
    with pytest.raises(ValueError, match="every=0"):
        ModeReview(PHRASES, POOL, ROW, N_T, 0)
    with pytest.raises(ValueError, match="neither"):
        review().review("chain", flat(1.0), None, DRAFT, 1.0, 0.0)
