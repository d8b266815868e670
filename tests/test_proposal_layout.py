"""proposal_layout: what a step sends per request, draft then suffixes, under its two caps."""

import numpy as np

from vllm_ouroboros.proposal_layout import place_suffixes, proposal_tokens


def _by_hand(drafts, draft_lens, suffixes, valid, draft_cap, total_cap):
    """Each row's proposal built one token at a time: the draft up to its cap, then, where the
    draft went whole, the valid suffixes in pool order while room is left under the total cap."""
    out = []
    for b in range(len(drafts)):
        room = int(total_cap[b])
        seq = list(drafts[b, :min(draft_lens[b], draft_cap[b], room)])
        whole = len(seq) == draft_lens[b]
        for k in range(valid.shape[1]):
            if valid[b, k] and whole:
                seq += list(suffixes[b, k, :max(room - len(seq), 0)])
        out.append(seq)
    return out


def test_random_rows_match_the_layout_built_by_hand():
    rng = np.random.default_rng(0)
    for _ in range(200):
        R, K, L, Dd = rng.integers(1, 6), rng.integers(0, 4), rng.integers(1, 5), rng.integers(1, 9)
        drafts = rng.integers(0, 1000, (R, Dd))
        draft_lens = rng.integers(0, Dd + 1, R)
        suffixes = rng.integers(1000, 2000, (R, K, L))
        valid = rng.random((R, K)) < 0.6
        total_cap = rng.integers(0, Dd + K * L + 2, R)
        draft_cap = rng.integers(0, Dd + 2, R)
        place = place_suffixes(draft_lens, valid, L, draft_cap, total_cap)
        tokens, total = proposal_tokens(drafts, place.ordered(suffixes), place)
        got = [tokens[b, :total[b]].tolist() for b in range(R)]
        assert got == _by_hand(drafts, draft_lens, suffixes, valid, draft_cap, total_cap)
        assert (place.n_main <= np.minimum(draft_cap, total_cap)).all()
        assert (total <= total_cap).all()


def test_a_cut_leaves_its_room_to_the_suffixes_of_a_draft_that_ends_there():
    """The back-off's cut bounds the draft only: a draft of 2 tokens under a cut of 3 sends
    both 4-token suffixes after it, up to S = 12 (before, the cut bounded the suffixes too: 1
    suffix token). A 6-token draft cut to 3 sends its 3 tokens alone: its suffixes hang off
    its 6th token."""
    drafts = np.array([[0, 1, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]])
    suffixes = np.array([[[10, 11, 12, 13], [20, 21, 22, 23]]] * 2)
    place = place_suffixes(np.array([2, 6]), np.ones((2, 2), bool), 4, np.array([3, 3]), np.array([12, 12]))
    tokens, total = proposal_tokens(drafts, place.ordered(suffixes), place)
    assert tokens[0, :total[0]].tolist() == [0, 1, 10, 11, 12, 13, 20, 21, 22, 23]
    assert tokens[1, :total[1]].tolist() == [0, 1, 2]
    assert place.lens.tolist() == [[4, 4], [0, 0]]


def test_an_invalid_suffix_goes_last_and_the_room_trims_the_rest():
    drafts = np.array([[5, 6, 7]])
    suffixes = np.array([[[1, 1], [2, 2], [3, 3]]])
    place = place_suffixes(np.array([3]), np.array([[False, True, True]]), 2, np.array([3]), np.array([6]))
    tokens, total = proposal_tokens(drafts, place.ordered(suffixes), place)
    assert tokens[0, :total[0]].tolist() == [5, 6, 7, 2, 2, 3]
    assert place.lens.tolist() == [[2, 1, 0]]
    assert place.order.tolist() == [[1, 2, 0]]


def test_a_row_sending_nothing_and_no_suffix_slots():
    drafts = np.array([[4, 4], [9, 8]])
    place = place_suffixes(np.array([2, 2]), np.zeros((2, 0), bool), 3, np.array([0, 2]), np.array([5, 1]))
    tokens, total = proposal_tokens(drafts, place.ordered(np.zeros((2, 0, 3), np.int64)), place)
    assert total.tolist() == [0, 1]
    assert tokens[1, :1].tolist() == [9]
