"""draft/prefill_graph.py: the draft's prefill in fixed-width chunks replayed from CUDA graphs,
checked on any machine with recorded stand-ins for the graphs (a capture records, a replay runs
the forward on the static inputs): the same drafts, cache lengths and cached K/V as the eager
prefill of the same chunk width, over rounds with new prompts and catch-up stretches, in host,
device and (emulated) graph rounds; passes of more rows than a graph takes; graphs captured
again when the cache moves or a stretch reads past them; a failed capture leaves the eager
prefill, logged; bad inputs refused. On CUDA the same tests run real graphs where the round is
"graph" (scripts/bench_gpu.py times them against the eager prefill)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from conftest import import_kernel_module
from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.draft import DraftModel
from vllm_ouroboros.draft import prefill_graph as pg
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
from vllm_ouroboros.pool import PhrasePool

# Imported before anything here imports triton, so that Triton's interpreter can run the pool's
# and the round's kernels on a CPU where a test asks for them.
import_kernel_module("vllm_ouroboros.kernels.pool_insert")
import_kernel_module("vllm_ouroboros.kernels.pool_lookup")
import_kernel_module("vllm_ouroboros.kernels.round_steps")

MAX_LEN = 1024


def make(path, device, draft_round="host", graphs=False, slots=4, max_len=MAX_LEN, **kw):
    """A runtime with its own draft (float32) and pool; graphs: the prefill through
    PrefillGraphs (recorded stand-ins on a CPU); the eager one otherwise, at the graphs' chunk
    width so that both run the same chunks."""
    model = DraftModel.from_pretrained(path, dtype=torch.float32, device=device)
    settings = DraftSettings(**{**dict(gamma=4, beta=5, window_size=4, num_guesses=4, num_suffixes=1,
                                       draft_round=draft_round, prefill_chunk=pg.CHUNK,
                                       round_kernels="torch"), **kw})
    pool = PhrasePool(model.vocab_size, 4, 4, 8 << 20, device=device)
    rt = DraftRuntime(model, pool, settings, slots, max_len, device)
    if draft_round == "graph-emulated":
        raise AssertionError("use emulate_round")
    rt.prefill_graphs = pg.PrefillGraphs(rt, emulate_graphs=device != "cuda") if graphs else None
    return rt


def emulate_round(rt):
    from vllm_ouroboros.draft.device_round import DeviceRound

    rt.device_round = DeviceRound(rt, graphs=True, emulate_graphs=True)
    return rt


def rounds(runtimes, contexts, rng, n, extend=(1, 40)):
    """n rounds of every runtime over the same contexts; each round a context takes half its
    draft and a token, and every third round one context takes a stretch of extend[1] tokens (a
    request that decoded while backed off: a catch-up prefill). Yields each round's outputs."""
    V = runtimes[0].model.vocab_size
    for r in range(n):
        lens = np.array([len(c) for c in contexts], np.int64)
        tab = np.zeros((len(contexts), int(lens.max())), np.int64)
        for i, c in enumerate(contexts):
            tab[i, :len(c)] = c
        slots = np.arange(len(contexts), dtype=np.int64)
        outs = [rt.run_round(slots, tab, slots, lens) for rt in runtimes]
        yield outs
        for i, c in enumerate(contexts):
            take = max(int(outs[0].draft_lens[i]) // 2, 1)
            c += outs[0].drafts[i, :take].tolist()
            c += rng.integers(3, V, extend[1] if (r % 3 == 2 and i == r % len(contexts)) else extend[0]).tolist()


def cached_kv(rt, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K and V of the slot's committed tokens, [kv_len, Hkv, D] each."""
    n = int(rt.kv_len[slot])
    pos = torch.arange(n, device=rt.device)
    pages = rt.kv.block_table[slot].long()[pos // rt.kv.page_size]
    k, v = rt.model.k_cache[0], rt.model.v_cache[0]
    return k[pages, pos % rt.kv.page_size], v[pages, pos % rt.kv.page_size]


def assert_same_caches(a, b, slots):
    assert np.array_equal(a.kv_len[slots], b.kv_len[slots])
    for s in slots:
        for x, y in zip(cached_kv(a, s), cached_kv(b, s)):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_prefill_mask_written_out():
    """prefill_mask by hand: row r's token i sees the real tokens j <= i, and a padding token
    also itself (its softmax row is never empty); the same with a kept arange as with its own."""
    count = torch.tensor([3, 0, 5])
    Q = 5
    want = torch.zeros(3, Q, Q, dtype=torch.bool)
    for r, c in enumerate(count.tolist()):
        for i in range(Q):
            for j in range(Q):
                want[r, i, j] = (j <= i and j < c) or (i == j and i >= c)
    assert torch.equal(pg.prefill_mask(count, Q), want)
    assert torch.equal(pg.prefill_mask(count, Q, torch.arange(Q)), want)


@pytest.mark.parametrize("round_kind", ["host", "device", "graph-emulated"])
def test_graph_prefill_drafts_what_the_eager_prefill_drafts(tiny_models, device, round_kind):
    path = str(tiny_models["draft"])
    kind = "device" if round_kind != "host" else "host"
    eager = make(path, device, kind)
    graph = make(path, device, kind, graphs=True)
    if round_kind == "graph-emulated":
        emulate_round(eager), emulate_round(graph)
    rng = np.random.default_rng(3)
    V = eager.model.vocab_size
    contexts = [rng.integers(3, V, n).tolist() for n in (300, 150, 90, 20)]
    prefilled = 0
    for out_e, out_g in rounds([eager, graph], contexts, rng, 7):
        assert out_e.prefill_forwards == out_g.prefill_forwards
        prefilled += out_g.prefill_forwards
        assert np.array_equal(out_e.draft_lens, out_g.draft_lens)
        assert np.array_equal(out_e.drafts, out_g.drafts)
        # the graph prefill's forwards are CHUNK wide and pad its rows to a bucket
        assert all(s % pg.CHUNK == 0 for s in out_g.prefill_sizes)
    assert prefilled >= 6, "the rounds prefilled too little to test"  # the prompts, then catch-ups
    assert_same_caches(eager, graph, range(4))
    assert set(graph.prefill_graphs._graphs) <= set(pg.BATCH_BUCKETS) and graph.prefill_graphs._graphs


def test_more_rows_than_a_graph_takes(tiny_models, device):
    """A pass of 18 rows runs MAX_ROWS rows per forward, then the rest, chunk by chunk."""
    path = str(tiny_models["draft"])
    n = pg.MAX_ROWS + 2
    eager, graph = make(path, device, slots=n), make(path, device, graphs=True, slots=n)
    rng = np.random.default_rng(5)
    contexts = [rng.integers(3, eager.model.vocab_size, 60 + 7 * i).tolist() for i in range(n)]
    graph.prefill_graphs.capture(pg.BATCH_BUCKETS[:5])  # as at load: a prefill timed across a capture gives no sizes
    out_e, out_g = next(rounds([eager, graph], contexts, rng, 1))
    assert np.array_equal(out_e.drafts, out_g.drafts) and graph.prefill_graphs.captures == 5
    # the first pass: 16 rows, then 2 (padded to their buckets); later passes the rows left
    assert out_g.prefill_sizes[:2] == (16 * pg.CHUNK, 2 * pg.CHUNK)
    assert out_g.prefill_forwards == len(out_g.prefill_sizes) >= 3
    assert {2, 16} <= set(graph.prefill_graphs._graphs) <= set(pg.BATCH_BUCKETS[:5])
    assert graph.prefill_graphs.rows_per_forward(n) == [16, 2] and graph.prefill_graphs.rows_per_forward(16) == [16]
    assert_same_caches(eager, graph, range(n))


def test_a_chunk_near_max_model_len_in_a_small_round_room(tiny_models, device):
    """A round room under a chunk (no lookahead, a 2-token draft: 24 columns past max_len): a
    catch-up chunk at ~170 cached tokens of a 200-token max_len pads 64 tokens, past
    max_len + round_room. The block table covers the chunk (its padding wrote past the table,
    clamped onto the row's last page, and the kernel's padding queries read the next row's
    table entries), and graph and eager prefill leave the same caches and drafts."""
    path = str(tiny_models["draft"])
    kw = dict(gamma=2, beta=2, use_lookahead=False, use_guesses=False, max_len=200)
    eager, graph = make(path, device, **kw), make(path, device, graphs=True, **kw)
    assert graph._round_room < pg.CHUNK and graph.kv.max_seq_len >= 200 + pg.CHUNK
    rng = np.random.default_rng(11)
    V = eager.model.vocab_size
    contexts = [rng.integers(3, V, 170).tolist(), rng.integers(3, V, 40).tolist()]
    for out_e, out_g in rounds([eager, graph], contexts, rng, 4, extend=(1, 16)):
        assert np.array_equal(out_e.draft_lens, out_g.draft_lens)
        assert np.array_equal(out_e.drafts, out_g.drafts)
        if len(contexts[0]) > 190:
            break
    assert int(graph.kv_len[0]) > 200 - 40  # the catch-up chunk ran past the old bound
    assert_same_caches(eager, graph, range(2))


def test_graphs_are_captured_again_when_the_cache_moves_or_reads_further(tiny_models, device, monkeypatch):
    path = str(tiny_models["draft"])
    eager, graph = make(path, device), make(path, device, graphs=True)
    pgs = graph.prefill_graphs
    assert pgs.capture([1, 3]) == 2 and sorted(pgs._graphs) == [1, 4]  # ahead of time, at load
    assert pgs.capture([1]) == 0
    captures = []
    real = pgs._capture
    monkeypatch.setattr(pgs, "_capture", lambda A: captures.append((A, pgs.bounds.graph_len)) or real(A))
    pgs.bounds.graph_len = 128  # a 300-token prompt reads past it: doubled until it fits, captured again
    rng = np.random.default_rng(8)
    V = eager.model.vocab_size
    contexts = [rng.integers(3, V, 300).tolist()]
    for out_e, out_g in rounds([eager, graph], contexts, rng, 3):
        assert np.array_equal(out_e.drafts, out_g.drafts)
    assert pgs.bounds.graph_len >= 300 and len(captures) >= 2, captures
    lens = [g for _, g in captures]
    assert lens == sorted(lens) and lens[-1] == pgs.bounds.graph_len
    # the cache reallocated (more slots: a new block table): the graphs go, captured again on use
    before = len(captures)
    contexts.append(rng.integers(3, V, 200).tolist())
    graph._grow(8), eager._grow(8)
    for out_e, out_g in rounds([eager, graph], contexts, rng, 1):
        assert np.array_equal(out_e.drafts, out_g.drafts)
    assert len(captures) > before and pgs.bounds.generation == graph.generation
    assert_same_caches(eager, graph, range(2))


def test_a_failed_capture_leaves_the_eager_prefill(tiny_models, device, monkeypatch, caplog):
    path = str(tiny_models["draft"])
    eager, graph = make(path, device), make(path, device, graphs=True)

    tries = []

    def broken(*a, **k):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing (test)")

    monkeypatch.setattr(pg, "RecordedGraph", broken)
    monkeypatch.setattr(pg, "capture_graph", broken)
    log = logging.getLogger(LOGGER_NAME)  # vLLM's logging config may stop it propagating
    log.addHandler(caplog.handler)
    try:
        rng = np.random.default_rng(2)
        contexts = [rng.integers(3, eager.model.vocab_size, n).tolist() for n in (200, 120)]
        for out_e, out_g in rounds([eager, graph], contexts, rng, 4):
            assert np.array_equal(out_e.drafts, out_g.drafts)
            assert out_e.prefill_forwards == out_g.prefill_forwards
    finally:
        log.removeHandler(caplog.handler)
    assert not graph.prefill_graphs.enabled and not graph.prefill_graphs._graphs
    assert len(tries) == 1  # tried once: the runtime then prefills eagerly, without trying again
    assert "prefill forward in a CUDA graph failed" in caplog.text and "runs eagerly" in caplog.text
    assert_same_caches(eager, graph, range(2))


def test_bad_inputs_are_refused(tiny_models, device):
    rt = make(str(tiny_models["draft"]), device, graphs=True, slots=pg.MAX_ROWS + 1)
    pgs = rt.prefill_graphs
    slots = np.arange(pg.MAX_ROWS + 1, dtype=np.int64)
    with pytest.raises(ValueError, match="1..16 rows of at most 64"):
        pgs.forward(slots, np.zeros((pg.MAX_ROWS + 1, 1), np.int64), np.ones(pg.MAX_ROWS + 1, np.int64))
    with pytest.raises(ValueError, match="at most 64 tokens, got 1 rows of up to 65"):
        pgs.forward(slots[:1], np.zeros((1, 65), np.int64), np.array([65]))
    if device != "cuda":
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            pg.PrefillGraphs(rt)


def test_dropped_graphs_are_captured_again_on_use(tiny_models, device):
    """DraftRuntime.drop_graphs (after a drafting step that raised, whose captures may be half
    made) forgets the round's and the prefill's graphs, and their memory pools (torch's allocator
    refuses a capture into a pool whose graphs were all freed: on a GPU the prefill's graphs went
    off for good and every round's capture raised); the next round captures them again and
    drafts as the eager runtime does, with its prefill graphs still on."""
    path = str(tiny_models["draft"])
    eager, graph = emulate_round(make(path, device, "device")), emulate_round(make(path, device, "device", graphs=True))
    rng = np.random.default_rng(4)
    contexts = [rng.integers(3, eager.model.vocab_size, n).tolist() for n in (120, 30)]
    runs = rounds([eager, graph], contexts, rng, 3)
    out_e, out_g = next(runs)
    assert graph.prefill_graphs._graphs and graph.device_round._states
    graph.prefill_graphs.bounds._pool = graph.device_round.bounds._pool = "the old pool"
    graph.drop_graphs()
    assert not graph.prefill_graphs._graphs and not graph.device_round._states
    assert graph.prefill_graphs.bounds._pool is None and graph.device_round.bounds._pool is None
    for out_e, out_g in runs:
        assert np.array_equal(out_e.drafts, out_g.drafts)
    assert graph.device_round._states and graph.prefill_graphs.enabled


def test_a_prefill_timed_across_a_capture_is_no_sample_of_its_cost(tiny_models, device):
    """A prefill graph captured on use (the cache grew, or none captured at load) inside the
    timed prefill: the round's prefill seconds still come off its drafting time, but the sizes
    the catch-up cost is calibrated with are left out (a capture's seconds priced every later
    catch-up dearer). The next prefill, replayed, is a sample again."""
    rt = make(str(tiny_models["draft"]), device, graphs=True)
    pgs = rt.prefill_graphs
    rng = np.random.default_rng(3)
    V = rt.model.vocab_size
    slots = np.arange(1, dtype=np.int64)
    context = rng.integers(3, V, 200)
    out = rt.run_round(slots, context[None], slots, np.array([200]))
    assert pgs.captures == 1 and out.prefill_forwards > 0
    assert out.prefill_sizes == () and out.prefill_seconds > 0
    context = np.concatenate([context, out.drafts[0, :1], rng.integers(3, V, 40)])
    out = rt.run_round(slots, context[None], slots, np.array([len(context)]))
    assert pgs.captures == 1 and out.prefill_forwards > 0
    assert len(out.prefill_sizes) == out.prefill_forwards and out.prefill_seconds > 0
