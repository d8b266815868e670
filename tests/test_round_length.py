"""The online choice of forwards per device round (vllm_ouroboros/round_length.py)."""

import numpy as np
import pytest

from vllm_ouroboros.round_length import EXPLORE, FIRST_TRIES, RoundLength


def _cost(F):  # a target forward of 1.0 and draft forwards of 0.4 each
    return 1.0 + 0.4 * F


def _run(rl: RoundLength, tokens: dict[int, float], rounds: int, noise=0.0, seed=0) -> list[int]:
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(rounds):
        F = rl.choose(_cost)
        chosen.append(F)
        rl.observe(F, tokens[F] + noise * rng.standard_normal())
    return chosen


def test_tries_every_length_in_turns_from_the_longest_then_keeps_the_best_rate():
    # Rates E_F / (1 + 0.4 F): 1.43, 1.94, 2.05, 1.92: three forwards pay best.
    tokens = {1: 2.0, 2: 3.5, 3: 4.5, 4: 5.0}
    rl = RoundLength(4)
    first = 4 * FIRST_TRIES
    chosen = _run(rl, tokens, first + 10 * EXPLORE)
    assert chosen[:first] == [4, 3, 2, 1] * FIRST_TRIES
    assert rl.best(_cost) == 3
    rest = chosen[first:]
    # Every EXPLORE-th round one of the others in turn, otherwise the best.
    explored = [F for i, F in enumerate(rest, 1) if i % EXPLORE == 0]
    assert explored[:6] == [2, 4, 1, 2, 4, 1] and all(F == 3 for i, F in enumerate(rest, 1) if i % EXPLORE)


def test_follows_a_flat_or_a_steep_draft():
    tokens = {1: 2.0, 2: 3.5, 3: 4.5, 4: 5.0}
    rl = RoundLength(4)
    _run(rl, tokens, 4 * FIRST_TRIES)
    assert rl.best(lambda F: 1.0 + 0.01 * F) == 4  # draft forwards nearly free: draft long
    assert rl.best(lambda F: 1.0 + 2.0 * F) == 2  # rates 0.67, 0.70, 0.64, 0.56
    assert rl.best(lambda F: 1.0 + 5.0 * F) == 1  # draft forwards dear: one


def test_recovers_when_acceptance_changes():
    rl = RoundLength(4)
    _run(rl, {1: 2.0, 2: 3.5, 3: 4.5, 4: 5.0}, 60)
    assert rl.best(_cost) == 3
    # The text got easy: long drafts are accepted whole. Exploration finds F = 4.
    _run(rl, {1: 2.0, 2: 3.6, 3: 5.2, 4: 7.5}, 40 * EXPLORE)
    assert rl.best(_cost) == 4


def test_noisy_rounds_run_near_the_best_rate():
    """Rounds give 1-9 tokens; with per-round noise of 1.5 tokens the F chosen after a warm-up
    runs within a few percent of the best rate (E_F / cost(F) of the true E_F)."""
    tokens = {1: 2.0, 2: 3.5, 3: 4.5, 4: 5.0}
    rate = {F: tokens[F] / _cost(F) for F in tokens}
    for seed in range(5):
        chosen = _run(RoundLength(4), tokens, 400, noise=1.5, seed=seed)
        assert np.mean([rate[F] for F in chosen[100:]]) > 0.95 * max(rate.values())
        # Always drafting 4 (what the device round did before) runs at 0.94 of the best.
        assert rate[4] < 0.95 * max(rate.values())


def test_one_forward_range_and_bad_input():
    rl = RoundLength(1)
    assert [rl.choose(_cost) for _ in range(3)] == [1, 1, 1]  # untried: the only length
    for _ in range(FIRST_TRIES):
        rl.observe(1, 2.0)
    assert all(rl.choose(_cost) == 1 for _ in range(2 * EXPLORE))
    rl.observe(5, 9.0)  # out of range: ignored
    rl.observe_draft(5, 9.0)
    assert rl.stats() == {1: {"tokens_per_target_forward": 2.0, "rounds": FIRST_TRIES, "draft_tokens": None}}
    rl.observe_draft(1, 1.0)
    assert rl.stats()[1]["draft_tokens"] == 1.0 and rl.draft_tokens(5, 7.0) == 7.0
    with pytest.raises(ValueError, match="max_forwards"):
        RoundLength(0)


def test_a_length_misjudged_in_the_first_rounds_is_judged_again():
    """The first rounds of each F ran over a cold pool: F = 4 looked poor there, and it is not a
    neighbour of the best. Exploration still comes back to it, and it wins once measured."""
    rl = RoundLength(4)
    cold = {1: 2.0, 2: 3.0, 3: 3.2, 4: 2.5}
    _run(rl, cold, 4 * FIRST_TRIES)
    assert rl.best(_cost) == 2
    _run(rl, {1: 2.0, 2: 3.5, 3: 4.0, 4: 6.0}, 40 * EXPLORE)
    assert rl.best(_cost) == 4


def test_a_first_try_never_observed_is_passed_over():
    """A round is observed only where none of its rows was cut; under a load that cuts some row
    in every round of one F (its fewer forwards), that F was handed out round after round in
    the first tries, never observed, and no other F was measured. After MAX_OFFERS rounds it is
    passed over: the others are measured and the best of them runs."""
    from vllm_ouroboros.round_length import MAX_OFFERS

    rl = RoundLength(4)
    tokens = {1: 1.5, 2: 2.0, 4: 3.5}
    chosen = []
    for _ in range(20 * EXPLORE):
        F = rl.choose(_cost)
        chosen.append(F)
        if F != 3:  # F = 3's rounds are always cut: never observed
            rl.observe(F, tokens[F])
    assert all(rl.rounds[F] >= FIRST_TRIES for F in (1, 2, 4)), rl.rounds
    # Its first tries, then a turn among the others explored every EXPLORE-th round.
    assert chosen.count(3) <= MAX_OFFERS + 20 // 3 + 1, chosen.count(3)
    assert rl.best(_cost) == 4 and chosen[-EXPLORE:].count(4) >= EXPLORE - 1
