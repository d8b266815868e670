"""Layout and readout of one lookahead draft forward, on hand-made arrays (draft/lookahead.py)."""

import pytest
import torch

from conftest import DEVICE

from vllm_ouroboros.draft.lookahead import build_layout, initial_window, read_output, row_inputs


def T(x):
    return torch.tensor(x, device=DEVICE)



# Tiny tensors: thread wake-ups cost more than the work (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# U=2, W=3, L=2, G=2: Q = 2 + 6 + 4 = 12 columns.
#   0, 1          uncached u0 u1 (u1 = current token x_p at position p)
#   2, 3, 4       window level 0, columns 0..2      (index U + l*W + c)
#   5, 6, 7       window level 1, columns 0..2
#   8, 9          guess 0, tokens 0..1
#   10, 11        guess 1, tokens 0..1
MASK_U2_W3_L2_G2 = [
    # u0 u1 | w00 w01 w02 w10 w11 w12 | g00 g01 g10 g11
    [1, 0,   0, 0, 0, 0, 0, 0,   0, 0, 0, 0],  # u0
    [1, 1,   0, 0, 0, 0, 0, 0,   0, 0, 0, 0],  # u1
    [1, 1,   1, 0, 0, 0, 0, 0,   0, 0, 0, 0],  # w00: prefix, itself
    [1, 1,   1, 1, 0, 0, 0, 0,   0, 0, 0, 0],  # w01: level-0 of column 0, itself
    [1, 1,   1, 1, 1, 0, 0, 0,   0, 0, 0, 0],  # w02: level-0 of columns 0,1, itself
    [1, 1,   1, 0, 0, 1, 0, 0,   0, 0, 0, 0],  # w10: own column's level 0, itself
    [1, 1,   1, 1, 0, 0, 1, 0,   0, 0, 0, 0],  # w11: w00, own w01, itself (not w10, w02)
    [1, 1,   1, 1, 1, 0, 0, 1,   0, 0, 0, 0],  # w12: w00, w01, own w02, itself
    [1, 1,   0, 0, 0, 0, 0, 0,   1, 0, 0, 0],  # g00: prefix only, no window
    [1, 1,   0, 0, 0, 0, 0, 0,   1, 1, 0, 0],  # g01: causal within guess 0
    [1, 1,   0, 0, 0, 0, 0, 0,   0, 0, 1, 0],  # g10: never sees guess 0
    [1, 1,   0, 0, 0, 0, 0, 0,   0, 0, 1, 1],  # g11
]
# uncached: offset from u0; window (l, c): 1 + c + l after p; guess token k: 1 + k after p.
OFFSET_U2_W3_L2_G2 = [0, 1,   1, 2, 3, 2, 3, 4,   1, 2, 1, 2]


def test_build_layout_literal():
    lay = build_layout(2, 3, 2, 2, DEVICE)
    assert (lay.U, lay.W, lay.L, lay.G, lay.Q) == (2, 3, 2, 2, 12)
    assert (lay.win_start, lay.guess_start) == (2, 8)
    assert lay.static_mask.dtype == torch.bool
    assert lay.static_mask.int().tolist() == MASK_U2_W3_L2_G2
    assert lay.pos_offset.tolist() == OFFSET_U2_W3_L2_G2


def test_build_layout_without_window_or_guesses():
    lay = build_layout(3, 0, 2, 0, DEVICE)
    assert lay.Q == 3
    assert lay.static_mask.int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert lay.pos_offset.tolist() == [0, 1, 2]
    lay = build_layout(1, 0, 3, 2, DEVICE)  # guesses only
    assert lay.Q == 7 and lay.guess_start == lay.win_start == 1
    assert lay.pos_offset.tolist() == [0, 1, 2, 3, 1, 2, 3]


@pytest.mark.parametrize("U,W,L,G", [(1, 4, 3, 2), (3, 5, 4, 3), (2, 1, 1, 1)])
def test_every_new_token_sees_one_contiguous_sequence(U, W, L, G):
    """Each window / guess token sees all uncached tokens and, among the window/guess tokens,
    exactly one token at each position p+1 .. its own position: a plain sequence to the model."""
    lay = build_layout(U, W, L, G, DEVICE)
    m, off = lay.static_mask, lay.pos_offset
    for q in range(U, lay.Q):
        assert m[q, :U].all()
        seen = torch.nonzero(m[q, U:]).flatten() + U
        assert sorted(off[seen].tolist()) == list(range(1, int(off[q]) + 1)), q


def test_row_inputs_padding_and_positions():
    lay = build_layout(2, 3, 2, 2, DEVICE)
    num_uncached, cache_lens = T([2, 1]), T([10, 5])
    mask, pos = row_inputs(lay, num_uncached, cache_lens)
    assert mask.shape == (2, 12, 12) and pos.shape == (2, 12)
    # Row 0 has no padding: the static layout; p = 10 + 2 - 1 = 11.
    assert mask[0].int().tolist() == MASK_U2_W3_L2_G2
    assert pos[0].tolist() == [10, 11,   12, 13, 14, 13, 14, 15,   12, 13, 12, 13]
    # Row 1: column 1 is padding. Nobody else sees it, it sees only itself.
    expect = torch.tensor(MASK_U2_W3_L2_G2, dtype=torch.bool)
    expect[:, 1] = False
    expect[1, :] = False
    expect[1, 1] = True
    assert mask[1].int().tolist() == expect.int().tolist()
    # p = 5 (the only real uncached token): window and guesses are placed after it, not after
    # the padding (tempting wrong answer: cache_lens + U - 1 = 6 as p, shifting all by one).
    assert pos[1, 0] == 5
    assert pos[1, 2:].tolist() == [6, 7, 8, 7, 8, 9,   6, 7, 6, 7]
    assert mask.diagonal(dim1=1, dim2=2).all()  # every query sees something (itself)


def _out(lay, t1_col_vals, win=None, guess=None, B=1, num_uncached=None):
    """An `out` row: uncached columns, window outputs [L, W] (level-major), guess outputs [G, L]."""
    out = torch.full((B, lay.Q), 0, dtype=torch.long, device=DEVICE)
    for b in range(B):
        out[b, : lay.U] = T(t1_col_vals[b])
        if win is not None:
            out[b, lay.win_start: lay.guess_start] = T(win[b]).flatten()
        if guess is not None:
            out[b, lay.guess_start:] = T(guess[b]).flatten()
    return out


# Shared small layout for readout: U=2, W=3, L=2, G=2. Current token x_p is uncached column
# num_uncached-1; its output is t1.
LAY = build_layout(2, 3, 2, 2, DEVICE)
WIN = T([[[10, 11, 12], [13, 14, 15]]])  # the window that was fed, [1, L, W]
WIN_OUT = [[[20, 21, 22], [23, 24, 25]]]  # o[l][c]


def _read(out, guesses, valid, num_uncached=(2,), window=WIN):
    return read_output(LAY, out, T(list(num_uncached)), window, T(guesses), T(valid))


def test_read_output_no_guess_matches_gives_t1_only():
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[50, 51], [52, 53]]])  # t1 = 7 (column 1)
    res = _read(out, [[[8, 50], [9, 52]]], [[True, True]])  # neither guess starts with 7
    assert res.num_new.tolist() == [1] and res.guess_hit.tolist() == [0]
    assert res.new_tokens.tolist() == [[7, 0, 0]]


def test_read_output_t1_is_at_last_real_uncached_column():
    out = _out(LAY, [[7, 99]], WIN_OUT, [[[50, 51], [52, 53]]])
    res = _read(out, [[[8, 50], [9, 52]]], [[True, True]], num_uncached=(1,))
    assert res.new_tokens.tolist() == [[7, 0, 0]]  # not 99, the padding column's output


def test_read_output_fully_right_guess_gives_beta_tokens():
    # Guess 1 = [7, 40]: 7 == t1, and the draft's output after 7 (guess column 0) is 40 ==
    # guess[1]; after 40 the draft predicts 41: the chain is 7, 40, 41 = L + 1 tokens.
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[1, 2], [40, 41]]])
    res = _read(out, [[[8, 8], [7, 40]]], [[True, True]])
    assert res.num_new.tolist() == [3] and res.guess_hit.tolist() == [2]
    assert res.new_tokens.tolist() == [[7, 40, 41]]


def test_read_output_longer_match_wins_and_ties_take_the_first():
    # guess 0 = [7, 30]: right at k=0 only (draft says 31 after 7) -> 1 hit, chain 7, 31.
    # guess 1 = [7, 40]: right at k=0 and k=1 -> 2 hits, chain 7, 40, 41.
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[31, 32], [40, 41]]])
    res = _read(out, [[[7, 30], [7, 40]]], [[True, True]])
    assert res.new_tokens.tolist() == [[7, 40, 41]] and res.num_new.tolist() == [3]
    # Tie (1 hit each): the first (best-ranked) guess gives the token after the match. Both
    # are the draft's own prediction after 7, so they agree here (31).
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[31, 32], [31, 33]]])
    res = _read(out, [[[7, 30], [7, 35]]], [[True, True]])
    assert res.num_new.tolist() == [2] and res.new_tokens.tolist() == [[7, 31, 0]]
    # A hand-made tie whose outputs after the match differ (a real draft cannot do this: both
    # see the same tokens at the same positions). The first guess decides: 31, not 33.
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[31, 32], [33, 34]]])
    res = _read(out, [[[7, 30], [7, 35]]], [[True, True]])
    assert res.guess_hit.tolist() == [1] and res.new_tokens.tolist() == [[7, 31, 0]]
    # Tie at 0 hits with differing guess outputs: only t1, nothing from either guess.
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[31, 32], [36, 37]]])
    res = _read(out, [[[8, 30], [9, 35]]], [[True, True]])
    assert res.new_tokens.tolist() == [[7, 0, 0]]


def test_read_output_invalid_guess_never_counts():
    # Guess 1 would match fully but is padding from the pool (valid False): only t1.
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[1, 2], [40, 41]]])
    res = _read(out, [[[8, 8], [7, 40]]], [[True, False]])
    assert res.num_new.tolist() == [1] and res.new_tokens.tolist() == [[7, 0, 0]]


def test_read_output_wrong_first_token_gives_zero_hits():
    # Guess 0 = [8, 40]: token 0 is wrong (t1 = 7), token 1 equals the draft's output after
    # guess token 0 (40). Tempting wrong answer: 1 hit (count matches) -> tokens 7, 40. But the
    # output after a wrong token is a prediction in the wrong context: 0 hits, only t1.
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[40, 41], [1, 2]]])
    res = _read(out, [[[8, 40], [9, 9]]], [[True, True]])
    assert res.guess_hit.tolist() == [0] and res.new_tokens.tolist() == [[7, 0, 0]]


def test_read_output_window_and_jacobi_phrases():
    out = _out(LAY, [[99, 7]], WIN_OUT, [[[1, 2], [3, 4]]])
    res = _read(out, [[[8, 8], [9, 9]]], [[True, True]])
    # The next window is the window's own outputs: column c slides one token.
    assert res.next_window.tolist() == [[[20, 21, 22], [23, 24, 25]]]
    # Phrase of column c: key w[0][c], tokens o[0][c], o[1][c].
    assert res.phrase_keys.tolist() == [[10, 11, 12]]
    assert res.phrases.tolist() == [[[20, 23], [21, 24], [22, 25]]]


def test_read_output_batched_rows_are_independent():
    out = _out(LAY, [[99, 7], [5, 6]], WIN_OUT * 2, [[[1, 2], [40, 41]], [[60, 61], [62, 63]]], B=2)
    window = torch.cat([WIN, WIN + 100])
    res = read_output(LAY, out, T([2, 1]), window, T([[[8, 8], [7, 40]], [[5, 60], [5, 62]]]),
                      T([[True, True], [True, False]]))
    # row 0: guess 1 fully right; row 1: t1 = 5 (column 0), guess 0 = [5, 60] fully right.
    assert res.new_tokens.tolist() == [[7, 40, 41], [5, 60, 61]]
    assert res.num_new.tolist() == [3, 3]
    assert res.phrase_keys.tolist() == [[10, 11, 12], [110, 111, 112]]


def test_read_output_without_guesses_or_window():
    lay = build_layout(2, 0, 2, 0, DEVICE)
    out = T([[4, 9]])
    win = torch.zeros(1, 2, 0, dtype=torch.long, device=DEVICE)
    res = read_output(lay, out, T([2]), win, torch.zeros(1, 0, 2, dtype=torch.long, device=DEVICE),
                      torch.zeros(1, 0, dtype=torch.bool, device=DEVICE))
    assert res.new_tokens.tolist() == [[9, 0, 0]] and res.num_new.tolist() == [1]
    assert res.phrase_keys.shape == (1, 0) and res.phrases.shape == (1, 0, 2)


def test_initial_window_takes_the_tail_cyclically():
    tail = T([[10, 11, 12, 13], [20, 21, 22, 23]])
    w = initial_window(tail, L=2, W=3)
    assert w.shape == (2, 2, 3)
    assert w.tolist() == [[[10, 11, 12], [13, 10, 11]], [[20, 21, 22], [23, 20, 21]]]
    # exactly L*W tokens: level 0 = first W, level 1 = next W
    assert initial_window(T([[1, 2, 3, 4, 5, 6]]), L=2, W=3).tolist() == [[[1, 2, 3], [4, 5, 6]]]
    assert initial_window(T([[7]]), L=2, W=2).tolist() == [[[7, 7], [7, 7]]]


@pytest.mark.parametrize("U,Q", [(1, 1), (3, 3), (1, 9), (4, 20)])
def test_output_index_gathers_output_rows(U, Q):
    """The prepared forward's one gather (`output_index`) reads the rows `output_rows` takes:
    the last real uncached column, then every window and guess column, row by row."""
    from vllm_ouroboros.draft.lookahead import output_index, output_rows

    g = torch.Generator().manual_seed(U * 31 + Q)
    A, H = 5, 3
    hidden = torch.randn(A, Q, H, generator=g)
    u = torch.randint(1, U + 1, (A,), generator=g)
    idx = output_index(u, Q, U)
    assert idx.shape == (A, 1 + Q - U) and idx.dtype == torch.long
    # Row by row, as the definition says (output_rows is defined through output_index).
    want = torch.stack([torch.cat([hidden[b, u[b] - 1][None], hidden[b, U:]]) for b in range(A)])
    assert torch.equal(hidden.reshape(A * Q, H)[idx], want)
    assert torch.equal(output_rows(hidden, u, U), want)
