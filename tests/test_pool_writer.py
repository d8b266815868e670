"""The step's pool inserts replayed from (recorded stand-ins for) CUDA graphs against eager
inserts: padded to a bucket with masked rows, they leave the pool as the eager inserts do, as
every reader sees it (ranked phrases per key and owner, pages, owners, counters), through
evictions, duplicate rows, out-of-range keys and counts past the largest bucket."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.pool import PhrasePool
from vllm_ouroboros.pool_writer import BUCKETS, PoolWriter

V, L, W = 97, 3, 4


def pool_view(pool: PhrasePool) -> list:
    """What a reader sees: every key's ranked phrases for nobody and each of owners 0-3 (the
    lookup's own bookkeeping restored), pages, owners and counters."""
    before = pool.counters.clone(), pool.page_last_used.clone(), pool.clock.clone()
    keys = torch.arange(V).repeat(5)
    owners = torch.arange(-1, 4).repeat_interleave(V)
    phr, valid = pool.lookup(keys, owners, W)
    pool.counters.copy_(before[0]), pool.page_last_used.copy_(before[1]), pool.clock.copy_(before[2])
    return [t.cpu() for t in (phr, valid, pool.page_key, pool.key_to_page, pool.owner, pool.counters)]


def rows(rng, n):
    keys = rng.integers(-2, V, n)  # a few out of range: ignored
    phrases = rng.integers(0, 9, (n, L))  # few distinct tokens: duplicate rows
    owners = rng.integers(-1, 4, n)
    return keys, phrases, owners


@pytest.mark.parametrize("graphs", ["emulated", "cuda"])
@pytest.mark.parametrize("shared", [True, False])
def test_graph_inserts_equal_eager_inserts(shared, graphs, device):
    """"cuda": real CUDA graphs, on the CUDA test device."""
    if graphs == "cuda" and device != "cuda":
        pytest.skip("CUDA graphs need the CUDA test device (OUROBOROS_TEST_DEVICE)")
    budget = PhrasePool.budget_for(V, L, W, 24)  # 24 pages for 97 keys: evictions
    eager = PhrasePool(V, L, W, budget, device=device, shared=shared)
    graphed = PhrasePool(V, L, W, budget, device=device, shared=shared)
    writer = PoolWriter(graphed, graphs=True, emulate_graphs=graphs == "emulated")
    assert writer.capture() == len(BUCKETS)
    rng = np.random.default_rng(0)
    for n in [0, 1, 5, 16, 17, 40, 64, 65, 200, 3, BUCKETS[-1] + 7, 12, 300, 2]:
        k, ph, ow = rows(rng, n)
        if n:
            eager.insert(*(torch.from_numpy(a).to(device) for a in (k, ph, ow)))
        writer.insert(k, ph, ow)
        for a, b in zip(pool_view(eager), pool_view(graphed)):
            assert torch.equal(a, b), f"after an insert of {n} rows"
    assert writer.replayed == 12  # all but the empty insert and the one past the largest bucket
    assert eager.counters[3] > 0, "no page was evicted: the recycling went untested"


def test_failed_capture_inserts_eagerly(caplog):
    budget = PhrasePool.budget_for(V, L, W, 24)
    eager, graphed = PhrasePool(V, L, W, budget), PhrasePool(V, L, W, budget)
    writer = PoolWriter(graphed, graphs=True, emulate_graphs=True)

    def broken(*a, **k):
        raise RuntimeError("capture refused (test)")

    log = logging.getLogger(LOGGER_NAME)  # vLLM's logging config may stop it propagating
    log.addHandler(caplog.handler)
    try:
        graphed.insert, real = broken, graphed.insert  # the warm-up fails like a refused capture
        k, ph, ow = rows(np.random.default_rng(1), 30)
        assert not writer._ready(64)
        graphed.insert = real
        writer.insert(k, ph, ow)
    finally:
        log.removeHandler(caplog.handler)
    eager.insert(torch.from_numpy(k), torch.from_numpy(ph), torch.from_numpy(ow))
    assert not writer.graphs and writer.replayed == 0 and "inserts run eagerly" in caplog.text
    for a, b in zip(pool_view(eager), pool_view(graphed)):
        assert torch.equal(a, b)


def test_a_failed_capture_ends_the_captures_and_frees_the_graphs():
    """capture() walks every bucket: after one failed, the others would warm up and capture
    graphs that no insert replays (eager from then on), and it reported them as captured."""
    pool = PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, 24))
    writer, calls, real = PoolWriter(pool, graphs=True, emulate_graphs=True), [], pool.insert

    def refuses_16(*a, **k):
        calls.append(a[0].shape[0])
        if a[0].shape[0] == 16:
            raise RuntimeError("capture refused (test)")
        return real(*a, **k)

    pool.insert = refuses_16
    assert writer.capture() == 0 and not writer.graphs and calls == [16]
    assert not writer._replays and not writer._boxes


@pytest.mark.parametrize("graphs", [False, True])
def test_rows_of_the_wrong_shape_are_refused(graphs):
    """A phrase narrower than L would be broadcast across a graph's box (stored as L copies of
    its one token): refused when staged, with or without graphs."""
    writer = PoolWriter(PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, 8)), graphs=graphs,
                        emulate_graphs=graphs)
    with pytest.raises(ValueError, match=rf"phrases \[N, {L}\]"):
        writer.insert(np.array([3]), np.array([[7]]), np.array([0]))
    with pytest.raises(ValueError, match="owners"):
        writer.stage(np.array([3, 4]), np.zeros((2, L), np.int64), np.array([0]))
    assert writer.staged == 0
    writer.insert(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))  # empty: nothing


def test_graphs_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for CPU-only machines")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PoolWriter(PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, 8)), graphs=True)
    assert PoolWriter(PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, 8))).capture() == 0


@pytest.mark.parametrize("graphs", [False, True])
def test_staged_rows_go_in_with_the_next_insert(graphs):
    """A step's inspiration rows staged, then its context rows inserted (and a flush with
    nothing after): every reader sees the pool as after separate inserts in the same order
    (phrases by key and owner, counters; which page holds a key may differ), in one call each.
    (With a page for every key: where pages run short, one call protects the pages of all its
    keys from recycling, two calls only their own, so which keys lose their pages may differ.)"""
    budget = PhrasePool.budget_for(V, L, W, V)
    eager, written = PhrasePool(V, L, W, budget), PhrasePool(V, L, W, budget)
    writer = PoolWriter(written, graphs=graphs, emulate_graphs=graphs)
    rng = np.random.default_rng(2)
    for step in range(12):
        staged = [rows(rng, int(n)) for n in rng.integers(0, 20, 2)]
        ctx = rows(rng, int(rng.integers(0, 30)))
        for part in staged:
            writer.stage(*part)
        assert writer.staged == sum(len(k) for k, _, _ in staged)
        calls = writer.calls
        if step % 3 == 2:
            writer.flush()  # e.g. before a replace or a release
            writer.insert(*ctx)
        else:
            writer.insert(*ctx)
            writer.flush()  # nothing left: no call
        assert writer.staged == 0
        n_staged, n_ctx = sum(len(k) for k, _, _ in staged), len(ctx[0])
        expected = (n_staged > 0) + (n_ctx > 0) if step % 3 == 2 else int(n_staged + n_ctx > 0)
        assert writer.calls - calls == expected
        for k, ph, ow in [*staged, ctx]:
            if len(k):
                eager.insert(*(torch.from_numpy(a) for a in (k, ph, ow)))
        (phr, valid, *_, counters), (phr2, valid2, *_, counters2) = pool_view(eager), pool_view(written)
        assert torch.equal(phr, phr2) and torch.equal(valid, valid2) and torch.equal(counters, counters2), \
            f"step {step}"
