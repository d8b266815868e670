"""The pool's kernels (kernels/pool_insert.py, kernels/pool_lookup.py) against PhrasePool's torch
insert and lookup, their references: every table of the pool and every lookup's phrases equal
after every call, through repeats, masked rows, keys out of range, groups larger than a page,
page evictions, own phrases in shared and private pools, and the other operations in between.
Compiled on a CUDA device when there is one, else run by Triton's CPU interpreter
(TRITON_INTERPRET handled as in tests/test_fused_ops.py). tests/test_pool.py runs its behaviour
tests through the kernels as well."""

import random

import pytest
import torch

from conftest import DEVICE, import_kernel_module, needs_triton

pi = import_kernel_module("vllm_ouroboros.kernels.pool_insert")
pl = import_kernel_module("vllm_ouroboros.kernels.pool_lookup")

from vllm_ouroboros.pool import _BUFFERS, PhrasePool  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread", "triton_interpreter"), needs_triton(pi, pi.place_kernel),
              needs_triton(pl, pl.lookup_kernel)]


def pair(V, L, W, pages, shared=True):
    budget = PhrasePool.budget_for(V, L, W, pages)
    return [PhrasePool(V, L, W, budget, device=DEVICE, shared=shared, kernels=b) for b in ("torch", "triton")]


def assert_same(ref, got, where):
    for name in _BUFFERS + ("clock",):
        assert torch.equal(getattr(ref, name), getattr(got, name)), (where, name)


@pytest.mark.parametrize("trial", range(10))
def test_kernels_match_the_torch_pool(trial):
    rng = random.Random(trial)
    V, L, W = rng.choice([9, 24, 60]), rng.randint(1, 4), rng.randint(1, 5)
    pools = pair(V, L, W, pages=rng.randint(1, max(1, V // 3)), shared=trial % 2 == 0)
    g = torch.Generator(DEVICE).manual_seed(trial)
    rnd = lambda hi, *shape, lo=0: torch.randint(lo, hi, shape, generator=g, device=DEVICE)  # noqa: E731
    for step in range(9):
        n = rng.choice([1, 2, rng.randint(3, 40), rng.randint(40, 100)])
        keys = rnd(V + 2, n, lo=-2)  # -2, -1, V and V + 1 are ignored rows
        if rng.random() < 0.5:  # few keys: groups larger than W, more repeats
            keys = keys % 3
        phrases = rnd(3, n, L)
        owners = rnd(4, n, lo=-1)
        valid = None if rng.random() < 0.3 else torch.rand(n, generator=g, device=DEVICE) < 0.8
        if step % 2:  # rows as columns of wider tables, as a packed upload hands them over
            keys, owners = (torch.stack([t, -t, t], 1)[:, 2] for t in (keys, owners))
            valid = None if valid is None else torch.stack([~valid, valid], 1)[:, 1]
            phrases = phrases.T.contiguous().T
        op, new, m, out = rng.random(), rnd(3, n, L), rng.randint(1, W), []
        for p in pools:
            if op < 0.6:
                p.insert(keys, phrases, owners, valid)
            elif op < 0.75:
                p.replace(keys, phrases, new, owners, valid)
            elif op < 0.85:
                out.append(p.lookup(keys, owners, m, None if valid is None else ~valid))
            elif op < 0.93:
                p.remove(keys, phrases, valid)
            else:
                p.release(torch.tensor([0, 2], device=DEVICE))
        assert_same(*pools, (trial, step, op))
        if out:
            assert all(torch.equal(a, b) for a, b in zip(*out)), (trial, step)
        if step % 3 != 2:
            continue
        # every key for every owner: what a reader sees (and the recency and counters it moves);
        # the keys a column of a wider table at every other check
        keys = torch.arange(-1, V + 1, device=DEVICE).repeat(5)
        if step % 6 == 5:
            keys = torch.stack([keys, keys + 1], 1)[:, 0]
        owners = torch.arange(-1, 4, device=DEVICE).repeat_interleave(V + 2)
        got = [p.lookup(keys, owners, W) for p in pools]
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), (trial, step)
        assert_same(*pools, (trial, step, "lookup"))


def test_evictions_go_through_the_kernels():
    # more keys than pages in one call and across calls: the newest keys win, LRU pages go
    ref, got = pair(V=50, L=2, W=2, pages=4)
    g = torch.Generator(DEVICE).manual_seed(5)
    for n in (3, 9, 2, 30, 5):
        keys = torch.randint(0, 50, (n,), generator=g, device=DEVICE)
        phrases = torch.randint(0, 4, (n, 2), generator=g, device=DEVICE)
        owners = torch.zeros(n, dtype=torch.long, device=DEVICE)
        for p in (ref, got):
            p.insert(keys, phrases, owners)
            p.lookup(keys[:1], owners[:1], 1)
        assert_same(ref, got, n)
    assert got.stats()["page_evictions"] >= 5


def test_rows_past_the_limit_insert_in_torch(monkeypatch):
    monkeypatch.setattr(pi, "MAX_ROWS", 5)
    ref, got = pair(V=20, L=2, W=3, pages=20)
    keys = torch.arange(8, device=DEVICE) % 4
    phrases = torch.arange(16, device=DEVICE).view(8, 2)
    owners = torch.zeros(8, dtype=torch.long, device=DEVICE)
    assert not pi.insert_triton(got, keys, phrases, owners, None)
    assert_same(ref, got, "declined")  # nothing done
    for p in (ref, got):
        p.insert(keys, phrases, owners)  # the pool falls back to torch: the same pool
    assert_same(ref, got, "fallback")
    assert pi.insert_triton(got, keys[:5], phrases[:5], owners[:5], None)


def test_lookup_of_masked_rows_and_empty_calls():
    ref, got = pair(V=10, L=2, W=3, pages=10, shared=True)
    keys = torch.tensor([1, 1, 2, 1, 5], device=DEVICE)
    for p in (ref, got):
        p.insert(keys, torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4], [5, 5]], device=DEVICE),
                 torch.tensor([0, 1, 1, -1, 0], device=DEVICE))
    q = torch.tensor([1, 1, 1, 2, 3, -1, 10, 5], device=DEVICE)
    slots = torch.tensor([0, 1, 2, 1, 0, 0, 0, 1], device=DEVICE)
    rows = torch.tensor([True, False, True, True, True, True, False, False], device=DEVICE)
    for n in (1, 2, 3):
        want, have = ref.lookup(q, slots, n, rows), got.lookup(q, slots, n, rows)
        assert torch.equal(want[0], have[0]) and torch.equal(want[1], have[1]), n
        assert have[0].dtype == torch.long and have[1].dtype == torch.bool
        assert_same(ref, got, n)
    # slot 1 sees its own phrase first, then the newest others
    assert have[0][1].tolist() == [[2, 2], [4, 4], [1, 1]] and have[1][1].tolist() == [True] * 3
    assert got.stats()["lookups"] == 3 * 5  # masked rows do not count
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    assert pl.lookup_triton(got, empty, empty, 2, None) is None  # B = 0: the torch lookup serves
    phrases, valid = got.lookup(empty, empty, 2)
    assert phrases.shape == (0, 2, 2) and valid.shape == (0, 2)


def test_lookups_agree_after_the_clock_moves_back(monkeypatch):
    """Many phrases of one key, then the clock past its limit: the move back keeps the stamps
    distinct, so the kernel (lower slot first on ties) and torch's topk (any tied slot) still
    pick the same phrases (an offset made old stamps all 1, and the two disagreed)."""
    ref, got = pair(V=20, L=2, W=8, pages=4, shared=True)
    for p in (ref, got):
        p.insert(torch.full((8,), 3, device=DEVICE), torch.arange(16, device=DEVICE).view(8, 2),
                 torch.full((8,), -1, device=DEVICE))
        p.insert(torch.full((4,), 3, device=DEVICE), torch.zeros(4, 2, dtype=torch.long, device=DEVICE),
                 torch.zeros(4, dtype=torch.long, device=DEVICE), torch.zeros(4, dtype=torch.bool, device=DEVICE))
    monkeypatch.setattr(PhrasePool, "clock_limit", lambda self: 4)
    assert ref.rebase_clock() and got.rebase_clock()
    assert_same(ref, got, "rebased")
    assert ref.stamp[ref.stamp > 0].unique().numel() == 8
    q, slots = torch.tensor([3], device=DEVICE), torch.tensor([0], device=DEVICE)
    for n in (1, 3, 8):
        want, have = ref.lookup(q, slots, n), got.lookup(q, slots, n)
        assert torch.equal(want[0], have[0]) and torch.equal(want[1], have[1]), n
    assert have[0][0, :3].tolist() == [[14, 15], [12, 13], [10, 11]]  # newest first


def test_check_and_choice():
    assert pi.check_kernel(torch.device(DEVICE)) is None
    assert pl.check_kernel(torch.device(DEVICE)) is None
    auto = PhrasePool(20, 2, 2, PhrasePool.budget_for(20, 2, 2, 4), device=DEVICE)
    # auto: the kernels where they run compiled (CUDA), torch elsewhere (the interpreter is for tests)
    want = "triton" if DEVICE == "cuda" else "torch"
    assert auto.insert_backend == auto.lookup_backend == want and auto.backend_reasons == {}
    with pytest.raises(ValueError, match="kernels='cuda'"):
        PhrasePool(20, 2, 2, PhrasePool.budget_for(20, 2, 2, 4), device=DEVICE, kernels="cuda")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and CUDA's sync debug mode need a CUDA device")
def test_kernels_replay_from_a_cuda_graph_without_host_sync():
    from vllm_ouroboros.cuda_graph import capture_graph

    ref, got = pair(V=1000, L=4, W=4, pages=64)
    g = torch.Generator(DEVICE).manual_seed(0)
    keys = torch.randint(0, 100, (48,), generator=g, device=DEVICE)
    phrases = torch.randint(0, 5, (48, 4), generator=g, device=DEVICE)
    owners = torch.zeros(48, dtype=torch.long, device=DEVICE)
    valid = torch.rand(48, generator=g, device=DEVICE) < 0.9
    out = {}

    def step(p):
        p.insert(keys, phrases, owners, valid)
        out[p] = p.lookup(keys.flip(0), owners, 3, valid)

    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = capture_graph(lambda _: step(got), DEVICE)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    step(ref)  # capture_graph's one warm-up ran the step once
    for i in range(3):
        keys.random_(0, 100, generator=g)
        graph.replay()
        step(ref)
        assert_same(ref, got, i)
        assert torch.equal(out[ref][0], out[got][0]) and torch.equal(out[ref][1], out[got][1])
