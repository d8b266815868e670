"""The drafting round's kernels (kernels/round_steps.py) against their torch references in
draft/device_round.py (`forward_inputs_torch`, `commit_torch`): every output and every state
tensor equal, on random layouts (decode, window only, guesses only, both, 64 columns so the
bitmask's sign bit is used), padded and strided uncached inputs, cache positions past the block
table, rows done or padding, drafts at their length limit, tied guesses and the round's own
aliasing (u read from the next_u the kernel writes). Compiled on a CUDA device when there is
one, else run by Triton's CPU interpreter. tests/test_device_round.py runs whole rounds through
them."""

import random

import pytest
import torch

from conftest import DEVICE, import_kernel_module, needs_triton

rs = import_kernel_module("vllm_ouroboros.kernels.round_steps")

from vllm_ouroboros.draft import device_round as dr  # noqa: E402
from vllm_ouroboros.draft.lookahead import build_layout  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread", "triton_interpreter"),
              needs_triton(rs, rs.commit_kernel)]

# (U, W, G, L): decode, window only, guesses only, both, and Q = 16 + 48 = 64 (bit 63 in use)
LAYOUTS = [(1, 0, 0, 4), (3, 0, 0, 2), (2, 3, 0, 3), (4, 0, 3, 4), (1, 4, 4, 4), (6, 2, 5, 3), (16, 4, 8, 4)]


def _inputs(U, W, G, L, A, seed, page_size=4):
    g = torch.Generator(DEVICE).manual_seed(seed)
    ri = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g, device=DEVICE)  # noqa: E731
    S, MP = A + 3, 5
    # The round's inbox: [slot, kv, u, real, F, cap | uncached tokens]; unc and u are strided views of it.
    box = ri(0, 50, A, dr.INBOX + U)
    box[:, 2] = ri(1, U + 1, A)
    unc, u = box[:, dr.INBOX:], box[:, 2]
    kv = ri(0, MP * page_size, A)  # some rows' new tokens run past the block table (clamped)
    # distinct slots, the last row on the spare padding slot
    slots = torch.cat([torch.randperm(S - 1, generator=g, device=DEVICE)[:A - 1],
                       torch.full((1,), S - 1, device=DEVICE)])
    window = ri(0, 6, S, L, max(W, 1) + 1)  # wider than W: the runtime's windows may be
    guesses = ri(0, 4, A, G, L)
    block_table = ri(0, 40, S, MP).int()
    return unc, u, kv, slots, window, guesses, block_table, ri


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("A", [1, 5])
@pytest.mark.parametrize("U,W,G,L", LAYOUTS)
def test_prepare_matches_torch(U, W, G, L, A, page_size):
    layout = build_layout(U, W, L, G, DEVICE)
    unc, u, kv, slots, window, guesses, block_table, _ = _inputs(U, W, G, L, A, U * 7 + W + A, page_size)
    want = dr.forward_inputs_torch(layout, unc, u, kv, slots, window, guesses, block_table, page_size)
    have = rs.prepare(layout, unc, u, kv, slots, window, guesses, block_table, page_size)
    names = ("ids", "positions", "write_index", "tree_mask", "lens", "query_start", "block_rows", "out_rows")
    assert len(want) == len(have) == len(names)
    for name, a, b in zip(names, want, have):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
    if layout.Q == 64:
        assert (have[3] < 0).any(), "no query saw column 63: the sign bit went untested"


def test_prepare_refuses_wide_layouts():
    layout = build_layout(20, 4, 4, 8, DEVICE)  # Q = 20 + 48 = 68 > 64
    assert layout.static_bits is None
    unc, u, kv, slots, window, guesses, block_table, _ = _inputs(20, 4, 8, 4, 2, 0)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        rs.prepare(layout, unc, u, kv, slots, window, guesses, block_table, 4)


def _state(A, L, max_draft, slots, kv, seed, aliased_u):
    g = torch.Generator(DEVICE).manual_seed(seed)
    st = dr.RoundState.empty(A, L, max_draft + L + 2, 1, DEVICE)
    st.slots.copy_(slots)
    st.kv.copy_(kv)
    st.active.copy_(torch.rand(A, generator=g, device=DEVICE) < 0.75)
    st.real.copy_(st.active | (torch.rand(A, generator=g, device=DEVICE) < 0.5))
    st.dlen.copy_(torch.randint(0, max_draft, (A,), generator=g, device=DEVICE))  # some near the limit
    # Cut rows (some at or past their cut already) and uncut ones (a cap past max_draft).
    st.cap.copy_(torch.randint(1, max_draft + 3, (A,), generator=g, device=DEVICE))
    for t in (st.row_forwards, st.guess_tokens, st.guess_hits, st.last_take):
        t.copy_(torch.randint(0, 4, (A,), generator=g, device=DEVICE))
    st.drafts.copy_(torch.randint(0, 9, st.drafts.shape, generator=g, device=DEVICE))
    st.drafts[:, -1] = 0  # the write sink holds 0 (a round starts zeroed; torch writes 0 there)
    if aliased_u:  # the round's later forwards read u from next_u, which commit writes
        st.next_u.copy_(torch.randint(1, L + 2, (A,), generator=g, device=DEVICE))
    return st


# u is next_u itself in the round's later forwards, whose uncached width is L + 1.
COMMIT_CASES = [(*lay, False) for lay in LAYOUTS] + [(3, 0, 0, 2, True), (4, 3, 0, 3, True), (5, 4, 4, 4, True)]


@pytest.mark.parametrize("U,W,G,L,aliased_u", COMMIT_CASES)
@pytest.mark.parametrize("trial", range(4))
def test_commit_matches_torch(U, W, G, L, aliased_u, trial):
    rng = random.Random(trial)
    A = rng.choice([1, 8, 8])
    max_draft, goal = rng.choice([(5, 4), (8, 4), (3, 3)])
    layout = build_layout(U, W, L, G, DEVICE)
    unc, u, kv, slots, window, _, block_table, ri = _inputs(U, W, G, L, A, 100 * trial + U + G)
    # Two token values: guesses are often right, and several guesses tie for the best.
    guesses = ri(0, 2, A, G, L)
    ids = dr.forward_inputs_torch(layout, unc, u, kv, slots, window, guesses, block_table, 4)[0]
    tokens = ri(0, 2, A, 1 + layout.Q - U)
    gvalid = ri(0, 4, A, G) > 0
    states = [_state(A, L, max_draft, slots, kv, trial, aliased_u) for _ in range(2)]
    windows = [window.clone(), window.clone()]
    us = [s.next_u if aliased_u else u for s in states]
    want = dr.commit_torch(states[0], layout, ids, tokens, guesses, gvalid, us[0], windows[0], max_draft, goal)
    have = rs.commit(states[1], layout, ids, tokens, gvalid, us[1], windows[1], max_draft, goal)
    for f in dr.RoundState.tensor_fields():
        assert torch.equal(getattr(states[0], f), getattr(states[1], f)), (f, getattr(states[0], f),
                                                                          getattr(states[1], f))
    assert torch.equal(windows[0], windows[1])
    assert (want is None) == (have is None) == (W == 0)
    if want is not None:
        for name, a, b in zip(("keys", "phrases", "owners", "valid"), want, have):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
    before = _state(A, L, max_draft, slots, kv, trial, aliased_u)
    took = states[1].dlen - before.dlen
    assert (states[1].dlen <= max_draft).all()
    assert ((took == 0) | (states[1].dlen <= before.cap)).all(), "a row took tokens past its cut"
    assert not (states[1].active & (states[1].dlen >= before.cap)).any(), "a row at its cut drafts on"


def test_the_check_passes_here():
    """The comparison a round runs before it takes the kernels ("auto") passes on this device."""
    rs._CHECKED.clear()
    assert rs.check_kernel(torch.device(DEVICE)) is None
