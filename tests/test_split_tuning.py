"""Split thresholds measured on the device (kernels/split_tuning.py): the rule the timings call for,
the measurement's launches, and plans splitting by the rule registered for their shapes and launch
mode. Timings are given by a model timer (the real ones need a GPU, and their numbers say nothing
here); the kernel runs under Triton's interpreter where there is no CUDA device."""

import logging
import math

import pytest
import torch

from conftest import DEVICE, set_triton_interpret

set_triton_interpret(True)
try:
    from vllm_ouroboros.kernels import split_tuning as st
    from vllm_ouroboros.kernels import tree_attention as ta
    from vllm_ouroboros.kernels.reference import tree_attention_reference
finally:
    set_triton_interpret(False)

pytestmark = pytest.mark.usefixtures("one_thread", "triton_interpreter")


@pytest.fixture(autouse=True)
def no_rules():
    ta.clear_split_rules()
    yield
    ta.clear_split_rules()


@pytest.fixture
def many_sms(monkeypatch):
    # As on a 132-SM GPU: one request's grid leaves SMs idle (the interpreter reports 1 SM).
    monkeypatch.setattr(ta, "_num_sms", lambda device: 132)
    monkeypatch.setattr(st, "_num_sms", lambda device: 132)


def model_times(prefixes, splits_of, nodes, fixed, per_tile, merge, block_n=64):
    """times[(n, p, S)] of a latency model: fixed + per_tile * key tiles of the longest chunk
    (+1 for the tree) + merge where S > 1."""
    times = {}
    for n in nodes:
        for p in prefixes:
            for s in {1, *splits_of(n, p)}:
                tiles = math.ceil(math.ceil(p / s) / block_n) + 1
                times[n, p, s] = fixed + per_tile * tiles + (merge if s > 1 else 0)
    return times


def test_rule_keeps_the_prefixes_from_which_on_every_split_pays():
    prefixes, chunks, nodes = (128, 256, 512, 1024, 2048), (64, 128, 256), (16,)
    # S = prefix // chunk, as the heuristic picks at one request on an idle GPU
    splits = {(n, p, c): max(1, p // c) for n in nodes for p in prefixes for c in chunks}
    times = model_times(prefixes, lambda n, p: [splits[n, p, c] for c in chunks], nodes,
                        fixed=5e-6, per_tile=1e-6, merge=2e-6)
    rule = st.rule_from_timings(times, splits, nodes, prefixes, chunks, "model")
    # 128 tokens: S = 2 saves 1 tile for a 2 us merge, a loss; from 256 on the splits pay
    assert (rule.min_prefix, rule.min_chunk, rule.measured) == (256, 64, "model")
    # a costlier merge (an eager second launch) moves the start up: at 512 tokens 8 tiles
    # saved no longer pay for it
    times = model_times(prefixes, lambda n, p: [splits[n, p, c] for c in chunks], nodes,
                        fixed=5e-6, per_tile=1e-6, merge=12e-6)
    rule = st.rule_from_timings(times, splits, nodes, prefixes, chunks)
    assert (rule.min_prefix, rule.min_chunk) == (1024, 64), rule


def test_rule_without_a_paying_split_starts_past_the_measured_prefixes():
    prefixes, chunks, nodes = (128, 256), (64,), (1, 32)
    splits = {(n, p, 64): p // 64 for n in nodes for p in prefixes}
    times = {(n, p, s): 10e-6 + (s > 1) * 1e-6 for n in nodes for p in prefixes for s in (1, p // 64)}
    rule = st.rule_from_timings(times, splits, nodes, prefixes, chunks)
    assert rule.min_prefix == 512 and ta.choose_num_splits(1, 2, 1, 132, 500, 64, 64, rule.min_prefix,
                                                          rule.min_chunk) == 1


def test_rule_is_one_threshold_priced_over_every_prefix_and_the_margin():
    prefixes, chunks, nodes = (128, 256, 512, 1024), (64,), (16,)
    splits = {(16, p, 64): p // 64 for p in prefixes}

    def rule(split):
        times = {(16, p, 1): 10.0 for p in prefixes} | {(16, p, p // 64): split[p] for p in prefixes}
        return st.rule_from_timings(times, splits, nodes, prefixes, chunks)

    # a gain at 128 does not pay for the loss at 256 that one threshold would bring with it
    assert rule({128: 9.0, 256: 12.0, 512: 9.0, 1024: 9.0}).min_prefix == 512
    # 2% saved everywhere is under the 3% margin: no split
    assert rule({128: 9.8, 256: 9.8, 512: 9.8, 1024: 9.8}).min_prefix == 2048
    assert rule({128: 9.0, 256: 9.0, 512: 9.0, 1024: 9.0}).min_prefix == 128
    # tree sizes are summed: a loss at one size outweighs a smaller gain at the other
    nodes = (1, 32)
    splits = {(n, p, 64): p // 64 for n in nodes for p in prefixes}
    times = {(n, p, 1): 10.0 for n in nodes for p in prefixes}
    times |= {(1, p, p // 64): 8.0 for p in prefixes} | {(32, p, p // 64): 13.0 for p in prefixes}
    assert st.rule_from_timings(times, splits, nodes, prefixes, chunks).min_prefix == 2048


def test_chunk_ties_go_to_fewer_splits():
    prefixes, chunks, nodes = (1024,), (64, 128), (16,)
    splits = {(16, 1024, 64): 16, (16, 1024, 128): 8}
    times = {(16, 1024, 1): 10.0, (16, 1024, 16): 5.0, (16, 1024, 8): 5.0}
    assert st.rule_from_timings(times, splits, nodes, prefixes, chunks).min_chunk == 128


def test_choose_num_splits_takes_the_rule_thresholds():
    pick = dict(num_kv_heads=8, num_q_blocks=1, num_sms=132, block_n=64)
    assert ta.choose_num_splits(1, max_prefix_len=512, **pick) == 1  # the shipped thresholds
    s = ta.choose_num_splits(1, max_prefix_len=512, min_prefix=256, min_chunk=64, **pick)
    assert 1 < s <= 512 // 64
    assert ta.choose_num_splits(1, max_prefix_len=200, min_prefix=256, min_chunk=64, **pick) == 1
    # chunks of at least min_chunk tokens
    assert ta.choose_num_splits(1, max_prefix_len=512, min_prefix=256, min_chunk=256, **pick) <= 2
    # a full grid is still not split, whatever the rule
    assert ta.choose_num_splits(32, max_prefix_len=8192, min_prefix=0, min_chunk=64, **pick) == 1


def _one_request(prefix=200, n=5, hq=2, hkv=1, d=16, block=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = -(-(prefix + n) // block)
    k = torch.randn(pages + 3, block, hkv, d, generator=gen)
    v = torch.randn(pages + 3, block, hkv, d, generator=gen)
    args = dict(q=torch.randn(n, hq, d, generator=gen), k_cache=k, v_cache=v,
                block_table=torch.randperm(pages + 3, generator=gen)[:pages].int().view(1, pages),
                prefix_lens=torch.tensor([prefix], dtype=torch.int32),
                query_start=torch.tensor([0, n], dtype=torch.int32),
                tree_mask=ta.ancestor_bitmask(torch.arange(-1, n - 1).view(1, n), torch.tensor([n])),
                scale=d ** -0.5)
    return {key: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for key, t in args.items()}


def test_plans_split_by_the_rule_of_their_shapes_and_launch_mode(many_sms, monkeypatch):
    args = _one_request()
    device = args["q"].device
    key = dict(device=str(device), dtype=torch.float32, num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)

    def splits(capturing=False):
        monkeypatch.setattr(ta, "_capturing", lambda device: capturing)
        return ta.TreeAttentionPlan(**args, max_query_len=5, max_prefix_len=200).num_splits

    assert splits() == 1 and splits(True) == 1  # 200 tokens: under the shipped 1024
    ta.register_split_rule(ta.SplitKey(**key, graphed=True), ta.SplitRule(128, 32, "test"))
    assert splits() == 1, "an eager plan took the graph rule"
    assert splits(True) > 1
    ta.register_split_rule(ta.SplitKey(**key, graphed=False), ta.SplitRule(128, 64, "test"))
    assert 1 < splits() <= 200 // 64
    # the mode may also be given (the benchmarks print each mode's S outside a capture)
    plan_splits = [ta._launch_plan(torch.float32, 2, 1, 16, 1, 5, 200, device, block_size=4, graphed=g)[2]
                   for g in (False, True)]
    assert plan_splits == [splits(False), splits(True)]
    # other shapes keep the shipped thresholds
    ta.register_split_rule(ta.SplitKey(**{**key, "block_size": 16}, graphed=False), ta.SplitRule(4096, 256))
    assert 1 < splits()
    # and the split plan computes what the reference does
    monkeypatch.setattr(ta, "_capturing", lambda device: False)
    out = ta.tree_attention(**args, max_query_len=5, max_prefix_len=200, backend="triton")
    assert (out.cpu() - tree_attention_reference(**{k: (t.cpu() if isinstance(t, torch.Tensor) else t)
                                                      for k, t in args.items()})).abs().max() <= 1e-3


def _one_request_with_rules_that_differ() -> dict:
    """_one_request's arguments, with a graph rule that splits its 200-token prefix and an
    eager one that does not."""
    args = _one_request()
    key = dict(device=str(args["q"].device), dtype=torch.float32, num_heads=2, num_kv_heads=1, head_dim=16,
               block_size=4)
    ta.register_split_rule(ta.SplitKey(**key, graphed=True), ta.SplitRule(128, 32, "test"))
    ta.register_split_rule(ta.SplitKey(**key, graphed=False), ta.SplitRule(4096, 256, "test"))
    return args


def test_a_graphs_warm_ups_plan_as_its_capture_does(many_sms):
    # capture_graph warms up on a stream that is not capturing: without graph_plans its plans
    # took the eager rule, and the split path ran for the first time inside the capture.
    args = _one_request_with_rules_that_differ()

    def splits():
        return ta.TreeAttentionPlan(**args, max_query_len=5, max_prefix_len=200).num_splits

    eager = splits()
    with ta.graph_plans():
        graphed = splits()
    assert eager == 1 and graphed > 1
    assert splits() == eager, "graph_plans outlived its block"


@pytest.mark.skipif(DEVICE != "cuda", reason="captures a CUDA graph")
def test_capture_graph_warms_up_the_plans_it_captures(many_sms):
    from vllm_ouroboros.cuda_graph import capture_graph

    args = _one_request_with_rules_that_differ()
    seen = []

    def run(graph):
        plan = ta.TreeAttentionPlan(**args, max_query_len=5, max_prefix_len=200)
        seen.append((graph is not None, plan.num_splits))
        plan.run(args["q"], args["k_cache"], args["v_cache"], torch.empty_like(args["q"]))

    capture_graph(run, args["q"].device, warmups=2).replay()
    torch.cuda.synchronize()
    assert [captured for captured, _ in seen] == [False, False, True]
    assert len({s for _, s in seen}) == 1 and seen[0][1] > 1, seen


def test_tune_splits_measures_registers_and_logs(many_sms, monkeypatch, caplog):
    logging.getLogger("vllm.ouroboros").addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="vllm.ouroboros")
    args = _one_request(prefix=256, n=4)
    k, v = args["k_cache"], args["v_cache"]
    launched, merges = [], []
    real_merge = ta.tree_attention_merge_kernel

    class MergeSpy:
        def __getitem__(self, grid):
            merges.append(grid)
            return real_merge[grid]

    monkeypatch.setattr(ta, "tree_attention_merge_kernel", MergeSpy())

    def timer(merge_s):
        def time(run, label):
            n, p, s = label
            before = len(merges)
            out = run()  # the measured configuration runs, with the S it claims
            assert torch.isfinite(out).all() and len(merges) - before == (s > 1), label
            launched.append(label)
            tiles = math.ceil(math.ceil(p / s) / 32) + 1  # fp32 key tiles are 32 wide
            return 5e-6 + 1e-6 * tiles + (merge_s if s > 1 else 0)
        return time

    prefixes, chunks = (64, 128, 256), (32, 64)
    try:
        graph = st.tune_splits(k, v, 2, nodes=(1, 4), modes=(True,), timer=timer(1e-6),
                               prefixes=prefixes, chunks=chunks)
        eager = st.tune_splits(k, v, 2, nodes=(1, 4), modes=(False,), timer=timer(30e-6),
                               prefixes=prefixes, chunks=chunks)
    finally:
        logging.getLogger("vllm.ouroboros").removeHandler(caplog.handler)
    # graph: a split of 64 tokens saves one tile for its merge (a tie, not 3%); from 128 on it pays
    assert (graph[True].min_prefix, graph[True].min_chunk) == (128, 32)
    # eager: the merge costs more than any prefix here saves: no split up to twice the longest
    assert eager[False].min_prefix == 512
    assert {(n, p) for n, p, _ in launched} == {(n, p) for n in (1, 4) for p in prefixes}
    assert any(s > 1 for *_, s in launched)
    # registered: later plans of these shapes split by them
    key = dict(device=str(k.device), dtype=k.dtype, num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    assert ta.split_rule(ta.SplitKey(**key, graphed=True)) == graph[True]
    assert ta.split_rule(ta.SplitKey(**key, graphed=False)) == eager[False]
    # (a record may come twice: through our handler and through the root logger's)
    logged = list(dict.fromkeys(r.getMessage() for r in caplog.records if "tree attention on" in r.getMessage()))
    assert len(logged) == 2 and "splits from 128 prefix tokens, chunks of >= 32 (graph-replayed" in logged[0]
    assert "256: " in logged[0]
    # measured once per key and process: a second check of the same shapes times nothing
    launched.clear()
    again = st.tune_splits(k, v, 2, nodes=(1, 4), modes=(True, False), timer=timer(1e-6),
                           prefixes=prefixes, chunks=chunks)
    assert again == {True: graph[True], False: eager[False]} and launched == []


def test_a_chunk_floor_longer_than_the_prefix_keeps_one_pass(many_sms):
    """The tuner's own grid asks for chunks of >= 256 tokens over a 128-token prefix: one pass,
    not an error (it raised "max() arg is an empty sequence", and every GPU start kept the
    shipped thresholds with a warning)."""
    assert ta.choose_num_splits(1, 8, 1, 132, 128, 64, min_prefix=0, min_chunk=256) == 1
    assert ta.choose_num_splits(1, 8, 1, 132, 255, 64, min_prefix=0, min_chunk=128) == 1
    assert ta.choose_num_splits(1, 8, 1, 132, 256, 64, min_prefix=0, min_chunk=128) == 2
    args = _one_request(prefix=256, n=4)
    rule, data = st.measure_split_rule(args["k_cache"], args["v_cache"], 2, nodes=(1,),
                                       timer=lambda run, label: 1e-5 * (1 + label[2] / 10))
    assert data["splits"][1, 128, 256] == 1 and rule.min_prefix > max(st.PREFIXES)


def test_a_failed_measurement_keeps_the_shipped_thresholds(caplog):
    logging.getLogger("vllm.ouroboros").addHandler(caplog.handler)
    args = _one_request(prefix=64, n=2)

    def broken(run, label):
        raise RuntimeError("no timer today")

    try:
        rules = st.tune_splits(args["k_cache"], args["v_cache"], 2, modes=(True, False), timer=broken,
                               prefixes=(64,), chunks=(32,))
    finally:
        logging.getLogger("vllm.ouroboros").removeHandler(caplog.handler)
    assert rules == {} and not ta._SPLIT_RULES
    warned = {r.getMessage() for r in caplog.records if "stay at the shipped thresholds" in r.getMessage()}
    assert len(warned) == 2 and all("no timer today" in m for m in warned)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU path: nothing is measured without CUDA")
def test_nothing_is_measured_without_cuda_or_a_timer():
    args = _one_request(prefix=64, n=2)
    assert st.tune_splits(args["k_cache"], args["v_cache"], 2) == {}
    with pytest.raises(ValueError, match="needs CUDA"):
        st.measure_split_rule(args["k_cache"], args["v_cache"], 2)


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA-event and graph timers need a CUDA device")
def test_real_timers_measure_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(2, 16, 16, 2, 64, generator=gen, device="cuda").to(torch.bfloat16)
    rules = st.tune_splits(kv[0], kv[1], 14, nodes=(1, 32), prefixes=(128, 512, 2048))
    assert set(rules) == {True, False}
    for graphed, rule in rules.items():
        assert rule.min_chunk in st.CHUNKS and rule.min_prefix in (128, 512, 2048, 4096), rule
        assert ("graph-replayed" if graphed else "eager") in rule.measured
