"""Candidate inspiration and refinement on hand-made verification outputs (feedback.py).

Convention (as in feedback.py): draft d[0..n-1] was verified; t[j] is the target's token at
position j (its prediction after context + d[:j]); t[n] is the bonus. -1 pads ragged rows.
"""

import numpy as np

from vllm_ouroboros.feedback import accepted_lengths, correction_phrases, inspiration, refinable, refinement

A = lambda x: np.array(x, dtype=np.int64)  # noqa: E731


def phrases_of(p):
    return [(int(k), list(map(int, t)), int(o)) for k, t, o in zip(p.keys, p.tokens, p.owners)]


# ---- accepted_lengths ------------------------------------------------------------------------

def test_accepted_lengths_basic():
    draft = A([[1, 2, 3, 4],
               [1, 2, 3, 4],
               [1, 2, 3, 4],
               [5, 2, 3, 4],
               [1, 2, -1, -1],
               [1, 2, 3, 4]])
    target = A([[1, 2, 3, 4, 9],    # all accepted
                [1, 2, 7, 4, 9],    # reject at 2; the later agreement at 3 does not count
                [1, 2, 3, 4, 9],    # only 3 verified: agreement beyond lens does not count
                [1, 2, 3, 4, 9],    # reject at 0
                [1, 2, 8, -1, -1],  # padded row: -1 == -1 beyond lens must not count
                [1, 2, 3, 4, 9]])   # nothing verified
    lens = A([4, 4, 3, 4, 2, 0])
    assert accepted_lengths(draft, target, lens).tolist() == [4, 2, 3, 0, 2, 0]


# ---- inspiration -----------------------------------------------------------------------------

def test_inspiration_one_run_after_rejection_L2():
    #             0  1  2  3  4   5
    d = A([[5, 6, 7, 8, 9, 10]])
    t = A([[5, 99, 7, 8, 42, 11, 12]])  # reject at l_d = 1; agree at 2, 3; disagree at 4, 5
    p = inspiration(d, t, A([6]), A([3]), L=2)
    # Run at j = 2 (d[2:4] == t[2:4]): key t[2] = 7, tokens t[3], t[4] = 8, 42. The last one is the
    # target's own prediction after 8, even though the draft had 9 there (tempting: [8, 9]).
    # j = 3 would need d[4] == t[4]: no.
    assert phrases_of(p) == [(7, [8, 42], 3)]


def test_inspiration_overlapping_runs_and_L3():
    d = A([[5, 6, 7, 8, 9, 10, 11]])
    t = A([[5, 99, 7, 8, 9, 10, 50, 60]])  # reject at 1; agree at 2..5; t[6] = 50 != 11
    # L = 2: runs at 2, 3, 4 (j = 5 needs d[6] == t[6]: no).
    p = inspiration(d, t, A([7]), A([0]), L=2)
    assert phrases_of(p) == [(7, [8, 9], 0), (8, [9, 10], 0), (9, [10, 50], 0)]
    # L = 3: runs at 2 (7 -> 8 9 10) and 3 (8 -> 9 10 50).
    p = inspiration(d, t, A([7]), A([0]), L=3)
    assert phrases_of(p) == [(7, [8, 9, 10], 0), (8, [9, 10, 50], 0)]


def test_inspiration_rejected_position_never_starts_a_run():
    d = A([[5, 6, 7]])
    t = A([[5, 99, 7, 8]])  # reject at 1, then agree at 2; t[3] = bonus 8
    # Tempting wrong answers: (99 -> [7, 8]) keyed by the target's correction, but 7 was predicted
    # after the draft's 6, not after 99; or (6 -> [7, 8]) keyed by the rejected draft token, a
    # position where the target disagreed. A run at j = 2 needs t[4]: beyond lens. Nothing.
    assert len(inspiration(d, t, A([3]), A([0]), L=2)) == 0


def test_inspiration_run_needing_target_beyond_verified_length_is_dropped():
    d = A([[5, 6, 7, 8, 9, 10]])
    t = A([[5, 99, 7, 8, 9, 10, 11]])
    # With all 6 verified: runs at 2, 3, 4 (j + L <= 6).
    assert [k for k, _, _ in phrases_of(inspiration(d, t, A([6]), A([0]), L=2))] == [7, 8, 9]
    # Only 5 verified: t[5] is then the bonus, t[6] does not exist; j = 4 would need t[6].
    assert phrases_of(inspiration(d, t, A([5]), A([0]), L=2)) == [(7, [8, 9], 0), (8, [9, 10], 0)]


def test_inspiration_fully_accepted_draft_gives_nothing():
    d = A([[5, 6, 7, 8, 9]])
    t = A([[5, 6, 7, 8, 9, 10]])
    assert len(inspiration(d, t, A([5]), A([0]), L=2)) == 0
    # also when the tail of a longer padded row is unverified
    assert len(inspiration(d, t, A([3]), A([0]), L=2)) == 0


def test_inspiration_no_agreement_run_after_rejection():
    d = A([[5, 6, 7, 8, 9]])
    t = A([[5, 99, 7, 77, 9, 10]])  # after the rejection: agree at 2 and 4, never 2 in a row
    assert len(inspiration(d, t, A([5]), A([0]), L=2)) == 0


def test_inspiration_batched_rows_padding_and_owners():
    d = A([[5, 6, 7, 8, 9, 10],     # row 0: reject at 0, agree 1..3
           [1, 2, 3, -1, -1, -1],   # row 1: padded, lens 3, fully accepted
           [4, 4, 4, 4, -1, -1],    # row 2: padded, lens 4, reject at 1, agree 2, 3
           [1, 1, 1, 1, 1, 1]])     # row 3: reject at 0, then agree everywhere
    t = A([[0, 6, 7, 8, 30, 31, 32],
           [1, 2, 3, 70, -1, -1, -1],
           [4, 0, 4, 4, 80, -1, -1],   # t[4] = bonus of a 4-token row
           [9, 1, 1, 1, 1, 1, 90]])
    lens, owners = A([6, 3, 4, 6]), A([11, 12, 13, 14])
    p = inspiration(d, t, lens, owners, L=2)
    assert phrases_of(p) == [
        (6, [7, 8], 11), (7, [8, 30], 11),          # row 0: runs at 1, 2
        (4, [4, 80], 13),                           # row 2: run at 2 ends with the bonus
        (1, [1, 1], 14), (1, [1, 1], 14), (1, [1, 1], 14), (1, [1, 90], 14),  # row 3: 1..4
    ]
    # Padding -1 == -1 (row 1 beyond lens 3, row 2 beyond lens 4) never forms a run.
    assert p.keys.dtype == p.tokens.dtype == p.owners.dtype == np.int64


def test_inspiration_draft_shorter_than_phrase():
    assert len(inspiration(A([[5]]), A([[6, 7]]), A([1]), A([0]), L=2)) == 0


# ---- refinement ------------------------------------------------------------------------------

def test_refinement_verified_suffix_becomes_targets_tokens():
    # Main draft 3 tokens, suffix of L = 2 hanging off key 8 at draft indices 3, 4.
    t = A([[5, 6, 8, 20, 21, 22],      # row 0: suffix fully verified
           [5, 6, 8, 20, 21, -1],      # row 1: only 1 suffix token sent (truncated suffix)
           [5, 6, 8, 20, -1, -1],      # row 2: no suffix
           [5, 6, 8, 20, 21, 22],      # row 3: suffix_len says L but lens was cut short
           [1, 2, 30, 31, -1, -1]])    # row 4: suffix at indices 1, 2 of a 1-token main draft
    suffix_start = A([3, 3, 3, 3, 1])
    suffix_len = A([2, 1, 0, 2, 2])
    suffix_key = A([8, 8, 8, 8, 9])
    lens = A([5, 4, 3, 4, 3])
    owners = A([1, 2, 3, 4, 5])
    p = refinement(t, suffix_start, suffix_len, suffix_key, lens, owners, L=2)
    # Row 0: key 8, tokens t[3], t[4] = the target's token at each suffix position. Tempting
    # wrong answers: the suffix's own (drafted) tokens, or t[4], t[5] (shifted by one; t[5] is
    # the bonus after the suffix).
    assert phrases_of(p) == [(8, [20, 21], 1), (9, [2, 30], 5)]


def test_refinable_suffixes_hang_off_a_draft_accepted_in_full():
    slen = A([[4, 4, 2], [4, 4, 0], [4, 4, 4], [4, 0, 0]])
    num_acc = A([3, 6, 2, 1])
    draft_lens = A([3, 2, 0, 0])
    # Accepted length along the draft + suffix k: past the draft where the suffix's first token
    # was right. Row 1's suffix 1 (length 0) cannot be.
    along = A([[5, 4, 4], [4, 3, 2], [2, 0, 1], [1, 0, 0]])
    got = refinable(num_acc, draft_lens, slen, along)
    # row 0: draft of 3 accepted whole, every suffix's first token right: all; row 1: suffix 0
    # (2 of its tokens accepted) and suffix 1 (its first right, not chosen); rows 2 and 3:
    # branches under the root (no draft), none, whatever they matched.
    assert got.tolist() == [[4, 4, 2], [4, 4, 0], [0, 0, 0], [0, 0, 0]]
    # A suffix whose first token the target rejected: its target tokens follow a wrong token.
    assert refinable(A([3]), A([3]), A([[4, 4, 4]]), A([[3, 5, 3]])).tolist() == [[0, 4, 0]]
    # A draft rejected before its end: its suffixes continue a context the target did not accept.
    assert refinable(A([1]), A([3]), A([[4, 4]]), A([[1, 1]])).tolist() == [[0, 0]]


def test_refinement_L3_and_empty():
    t = A([[1, 2, 3, 4, 5]])
    p = refinement(t, A([1]), A([3]), A([7]), A([4]), A([0]), L=3)
    assert phrases_of(p) == [(7, [2, 3, 4], 0)]
    p = refinement(t, A([1]), A([2]), A([7]), A([3]), A([0]), L=3)
    assert len(p) == 0 and p.tokens.shape == (0, 3)


def test_context_phrases_cover_new_text_only():
    from vllm_ouroboros.feedback import context_phrases

    # Row 0: context 10 11 12 13 14 (5 tokens), already seen up to index 2 -> phrases starting
    # at 2..(5-1-2)=2 only: key 12 -> (13, 14). Tempting wrong answer: re-inserting 10->(11,12)
    # and 11->(12,13), which the pool got last round.
    # Row 1: a fresh prompt 20 21 22 23 -> 20->(21,22), 21->(22,23), oldest first.
    table = np.array([[10, 11, 12, 13, 14, 0], [20, 21, 22, 23, 0, 0]])
    ph = context_phrases(table, rows=np.array([0, 1]), lens=np.array([5, 4]),
                         start=np.array([2, 0]), owners=np.array([7, 3]), L=2)
    assert ph.keys.tolist() == [12, 20, 21]
    assert ph.tokens.tolist() == [[13, 14], [21, 22], [22, 23]]
    assert ph.owners.tolist() == [7, 3, 3]
    # Too short for one phrase: nothing.
    assert len(context_phrases(table, np.array([1]), np.array([2]), np.array([0]), np.array([0]), 2)) == 0


def test_correction_phrase_keyed_by_the_correction():
    d = A([[5, 6, 7, 8, 9]])
    t = A([[5, 99, 7, 8, 42, 11]])  # reject at 1 (the target says 99); agree at 2, 3
    # Key 99 (the next round starts from it), tokens t[2], t[3]: what the target predicted after
    # the rejected 6, taken as a guess for after 99 (tempting: key 6, the rejected draft token,
    # or tokens d[2], d[3]: the draft's, not the target's).
    assert phrases_of(correction_phrases(d, t, A([5]), A([4]), 2, A([1]), 0)) == [(99, [7, 8], 4)]
    # agree = 2 asks d[2:4] == t[2:4] (yes); L = 3 with agree = 2: tokens t[2..4] = 7, 8, 42.
    assert phrases_of(correction_phrases(d, t, A([5]), A([4]), 3, A([1]), 2)) == [(99, [7, 8, 42], 4)]
    # agree = 3 needs d[4] == t[4] too: 9 != 42, nothing.
    assert len(correction_phrases(d, t, A([5]), A([4]), 4, A([1]), 3)) == 0


def test_correction_phrase_needs_verified_positions_and_a_rejection():
    d = A([[5, 6, 7, 8], [5, 6, 7, 8]])
    t = A([[5, 99, 7, 8, 30], [5, 6, 7, 8, 30]])
    # Row 0 with only 2 tokens verified: t[2] is the bonus, t[3] does not exist (L = 2 needs it).
    assert len(correction_phrases(d[:1], t[:1], A([2]), A([0]), 2, A([1]), 0)) == 0
    # Row 1 accepted everything: no correction, no phrase; row 0 gives its own (owner 7).
    p = correction_phrases(d, t, A([4, 4]), A([7, 8]), 2, A([1, 4]), 1)
    assert phrases_of(p) == [(99, [7, 8], 7)]
