"""scripts/bench_gpu.py --tiny: the GPU benchmark's code paths on any machine (it must not rot on
CPU-only CI), and its modeled speedup against the numbers benchmark.py wrote."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_gpu  # noqa: E402

CUDA = torch.cuda.is_available()
# One worker for the whole module under pytest-xdist (gpu_check.sh: --dist loadgroup), so the
# module-scoped benchmark run below happens once, not once per worker, on a shared GPU.
pytestmark = pytest.mark.xdist_group("bench_gpu")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(exit status, JSON, md path, output) of one `bench_gpu.py --tiny` run."""
    out = tmp_path_factory.mktemp("bench_gpu")
    js, md = out / "bench.json", out / "bench.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernel's skip is checked
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--tiny", "--json", str(js),
                           "--md", str(md)], capture_output=True, text=True, env=env, timeout=600)
    result = json.loads(js.read_text()) if js.exists() else None
    return proc.returncode, result, md, proc.stdout + proc.stderr


def test_tiny_run_exits_0_and_writes_both_files(tiny_run):
    rc, result, md, output = tiny_run
    assert rc == 0, output[-4000:]
    assert result["errors"] == {}
    assert result["tiny"] and result["torch"] == torch.__version__ and "--tiny" in result["command"]
    assert md.exists() and "## Acceptance" in md.read_text()
    # Seconds per section, to plan a lent GPU's minutes.
    assert {"curves/draft", "curves/target", "rounds", "target_step", "inserts", "pool_fill",
            "cut_rounds"} <= set(result["section_s"])
    assert all(t > 0 for t in result["section_s"].values())


def test_curves_have_every_point(tiny_run):
    _, result, _, _ = tiny_run
    plan = bench_gpu.Plan(tiny=True)
    for tag in ("draft", "target"):
        pts = {(p["batch"], p["n"]): p for p in result["curves"][tag]}
        assert set(pts) == {(1, n) for n in plan.points} | set(plan.batch_points), tag
        assert all(p["eager_ms"] > 0 for p in pts.values())
        assert all((p["graph_ms"] is not None) == CUDA for p in pts.values())


def test_device_round_drafts_what_the_host_loop_drafts(tiny_run):
    """Same contexts, round_forwards = gamma: the device round drafts the host loop's tokens (so
    its per-round figures compare like with like), in exactly gamma forwards."""
    _, result, _, _ = tiny_run
    rounds = {(r["setting"], r["requests"], r["mode"]): r for r in result["rounds"]}
    from vllm_ouroboros.draft.device_round import conditional_nodes_supported

    cuda_modes = {"graph", "graph+fused", bench_gpu.TORCH_POOL, bench_gpu.TORCH_ROUND, bench_gpu.ROPE_APART,
                  bench_gpu.NORM_GEMM, bench_gpu.PADDED_STEPS}
    modes = {"host", "device"} | (cuda_modes if CUDA else set()) | (
        {"graph-fixed"} if CUDA and conditional_nodes_supported() else set())
    plan = bench_gpu.Plan(tiny=True)
    assert set(rounds) == {(s, b, m) for s in bench_gpu.ROUND_SETTINGS for b in plan.round_batches for m in modes
                           if (m not in bench_gpu.ONE_REQUEST_MODES or b == 1)
                           and (m != bench_gpu.PADDED_STEPS or s == "decode-only")}
    for (setting, B, mode), r in rounds.items():
        assert len(r["round_ms"]) == plan.timed_rounds and r["ms_per_round"] > 0 and r["ms_per_forward"] > 0
        assert r["prefill_forwards"] == 0 and not r["cache_regrown"], (setting, B, mode)
        if r["early_exit"]:  # the forwards its rows needed, as the host loop
            assert r["forwards"] == rounds[(setting, B, "host")]["forwards"], (setting, B, mode)
        elif mode != "host":
            assert r["forwards"] == [bench_gpu.GAMMA] * plan.timed_rounds
        # Float rounding may differ between padded and exact shapes on a GPU: there only the
        # decode-only counts (gamma per row, whatever the tokens) must agree.
        if mode != "host" and (not CUDA or setting == "decode-only"):
            assert r["draft_tokens"] == rounds[(setting, B, "host")]["draft_tokens"], (setting, B, mode)
    assert all(t == bench_gpu.GAMMA * B for (s, B, _), r in rounds.items() if s == "decode-only"
               for t in r["draft_tokens"])


def test_inserts_are_timed(tiny_run):
    """A step's pool insert of 16, 64 and 256 rows, eager, and from CUDA graphs where there is
    CUDA (pool_writer.py)."""
    _, result, _, _ = tiny_run
    pts = {p["rows"]: p for p in result["inserts"]}
    assert set(pts) == {16, 64, 256} and all(p["eager_ms"] > 0 for p in pts.values())
    assert all(("graph_ms" in p) == CUDA for p in pts.values())


def test_pool_fill_step_is_timed_both_ways(tiny_run):
    """A pool-filled step with the pool's lookups after the round's read and queued ahead of
    it (pool_draft.queue_pool_drafts), each over the plan's timed rounds."""
    _, result, md, _ = tiny_run
    p = result["pool_fill"]
    plan = bench_gpu.Plan(tiny=True)
    assert p["after_ms"] > 0 and p["queued_ms"] > 0 and p["pool_rows"] == bench_gpu.POOL_FILL_ROWS[True]
    assert p["rounds_each"] == {"after": plan.timed_rounds, "queued": plan.timed_rounds}
    assert p["mode"] == ("graph+fused" if CUDA else "device")
    assert "A pool-filled step" in md.read_text()


def test_cut_rounds_run_the_forwards_their_price_counts(tiny_run):
    """Rounds cut to s < gamma draft tokens against cost_model.round_forwards, the rule the
    back-off's plans price them by: the host loop drafts a chain of s forwards, a fixed-shape
    device round min(F, s) (it ran its whole F), and one that exits early (emulated here,
    conditional nodes on CUDA) F s / gamma, s with random weights (a forward adds one token). On CUDA the
    graph round that serves; what it costs per cut is the GPU's answer, not checked here."""
    _, result, md, output = tiny_run
    rounds = {r["mode"]: r for r in result["cut_rounds"]}
    assert set(rounds) == ({"graph+fused"} if CUDA else {"host", "device", bench_gpu.GRAPH_EMULATED})
    for mode, r in rounds.items():
        assert [c["s"] for c in r["cuts"]] == list(range(1, bench_gpu.GAMMA)), mode
        assert r["whole_ms"] > 0 and all(c["ms"] > 0 for c in r["cuts"]), mode
        for c in r["cuts"]:
            assert 1 <= c["forwards"] <= r["whole_forwards"] and 1 <= c["modeled_forwards"] <= r["whole_forwards"]
            assert c["modeled_share"] == pytest.approx(c["modeled_forwards"] / r["whole_forwards"])
    if not CUDA:  # the tiny draft's rounds (seeded): no guess is accepted, a forward adds one token
        for mode, r in rounds.items():
            assert r["whole_forwards"] == bench_gpu.GAMMA, mode
            assert all(c["forwards"] == c["modeled_forwards"] for c in r["cuts"]), mode
        assert rounds["host"]["chain_below"] == bench_gpu.GAMMA and rounds["host"]["stop_below"] is None
        assert all(c["forwards"] == c["s"] for c in rounds["host"]["cuts"])
        assert rounds["device"]["stop_below"] is None and not rounds["device"]["early_exit"]
        assert all(c["forwards"] == c["s"] for c in rounds["device"]["cuts"])
        early = rounds[bench_gpu.GRAPH_EMULATED]
        assert early["early_exit"] and early["stop_below"] == bench_gpu.GAMMA
        assert all(c["forwards"] == c["s"] for c in early["cuts"])
    assert output.count("  cut rounds (") == len(rounds)
    assert md.read_text().count("## Rounds cut short") == len(rounds)


def test_target_step_is_timed_and_charged_to_the_model(tiny_run):
    """Our patches' work around a target forward, every layout at every batch size (the walk
    accepted the planted path and, with 3 suffixes, moved KV, or the section would have
    failed), and the modeled speedups charged with it at one request. The torch-moved tree is
    a comparison only where the KV move kernel serves (CUDA); elsewhere it is skipped, saying why."""
    _, result, _, _ = tiny_run
    plan = bench_gpu.Plan(tiny=True)
    pts = {(p["layout"], p["requests"]): p["ms"] for p in result["target_step"]}
    torch_moved = "tree: draft 8 + 3 suffixes, KV moved in torch"
    kernel_serves = f"target_step/{torch_moved}" not in result["skipped"]
    if result["cuda"] is None:
        assert not kernel_serves
        assert "does not serve here (no CUDA)" in result["skipped"][f"target_step/{torch_moved}"]
    names = [n for n in bench_gpu.TARGET_STEP_LAYOUTS if kernel_serves or n != torch_moved]
    assert set(pts) == {(name, b) for name in names for b in plan.round_batches}
    assert {p["kv_move"] for p in result["target_step"]} == ({"torch", "triton"} if kernel_serves else {"torch"})
    assert all(ms > 0 for ms in pts.values())
    mod = result["modeled"]
    assert mod["target_step_ms"] == pts[("tree: draft 8 + 3 suffixes", 1)]
    rows = [r for v in mod["variants"].values() if v for r in v["rows"]]
    assert rows and all(r["modeled_with_target_step"] < r["modeled"] for r in rows)


def test_with_step_cost():
    # 10 ms target forward, modeled 2x: 5 ms per token; 1 ms more per forward of 4 tokens.
    row = {"modeled": 2.0, "tokens_per_target_forward": 4.0}
    assert bench_gpu.with_step_cost(row, 10.0, 1.0) == pytest.approx(10.0 / 5.25)


def test_skips_say_why_and_nothing_passes_on_tiny_shapes(tiny_run):
    _, result, _, output = tiny_run
    if not CUDA:
        assert result["skipped"]["graph"] == "skipped: no CUDA"
        assert "TRITON_INTERPRET" in result["skipped"]["kernel"] and result["kernel"] is None
        assert "skipped: no CUDA" in output
    assert len(result["acceptance"]) == 6
    for a in result["acceptance"]:
        assert a["status"] not in ("PASS", "FAIL"), a
        assert (a["value"] is None) == a["status"].startswith("NOT MEASURED"), a
    variants = result["modeled"]["variants"]
    assert variants["eager drafting (host round, today)"]["rows"]
    # The default counters: the drafting modes' rows (host loop) and the device round's.
    rows = {r["row"]: r for r in variants["device round"]["rows"]}
    assert {"chain-pinned", "guesses-pinned", "phrases-pinned", "gpu-curves-device"} <= set(rows)
    assert rows["gpu-curves-device"]["draft_round"] == "device" and rows["gpu-curves-device"]["phrase_drafting"]


def test_prefill_is_timed_eager_and_from_graphs(tiny_run):
    """The draft's prefill of new prompts: eager everywhere, 64-token chunks replayed from CUDA
    graphs where there is CUDA (draft/prefill_graph.py); skipped there elsewhere, saying why."""
    _, result, md, _ = tiny_run
    pts = result["prefill"]
    assert [(p["requests"], p["prompt"]) for p in pts] == bench_gpu.prefill_cases(bench_gpu.Plan(tiny=True))
    assert all(p["eager_ms"] > 0 and p["eager_forwards"] >= 1 for p in pts)
    if CUDA:
        assert all(p["graph_ms"] > 0 and p["graph_forwards"] >= -(-p["prompt"] // 64) - 1 for p in pts)
    else:
        assert result["skipped"]["prefill/graph"] == "skipped: no CUDA (graph prefill needs CUDA graphs)"
        assert all("graph_ms" not in p for p in pts)
    assert "## Draft prefill of new prompts" in md.read_text()


def test_fusion_choice_is_reported(tiny_run):
    """The load-time choice of the draft's fusions (draft/fusion_choice.py): timed on CUDA, each
    fusion on and off at both widths; skipped, saying why, elsewhere."""
    _, result, md, _ = tiny_run
    if not CUDA:
        assert result["skipped"]["fusion_choice"] == "skipped: no CUDA (the fusions are Triton kernels)"
        return
    fc = result["fusion_choice"]
    assert fc["graphs"] and fc["widths"] == [1, bench_gpu.row_tokens(4, 4)]
    assert {t["name"] for t in fc["timings"]} <= {"rope_in_attention", "norm_gemm"}
    for t in fc["timings"]:
        assert len(t["on_ms"]) == len(t["off_ms"]) == len(t["widths"]) and min(t["on_ms"] + t["off_ms"]) > 0
        assert t["kept"] is (sum(t["on_ms"]) < sum(t["off_ms"]))
    assert "## Fusions kept at load" in md.read_text()


def test_no_cuda_without_tiny_exits_nonzero():
    if CUDA:
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_gpu.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device: run with --tiny" in proc.stderr


def _args(**kw) -> argparse.Namespace:
    base = dict(tokens_per_target_forward=None, draft_forwards_per_token=None, target_tokens_per_forward=5.0,
                draft_tokens_per_forward=34, counters=[REPO / "results" / "benchmark.json"])
    return argparse.Namespace(**{**base, **kw})


def test_modeled_reproduces_benchmark_json():
    """The CPU run's curves and counters give back the "modeled" figures benchmark.py stored."""
    stored = json.loads((REPO / "results" / "benchmark.json").read_text())
    curve = lambda c: {int(n): t for n, t in c.items()}  # noqa: E731 - JSON keys are strings
    got = {r["row"]: r["modeled"] for r in bench_gpu.modeled(
        bench_gpu.counter_rows(_args()), curve(stored["t_target"]), curve(stored["t_draft"]))}
    want = {r["method"]: r["modeled"] for r in stored["rows"] if r["method"] in got
            and r["workload"] == "humaneval" and r["concurrency"] == 1 and r["temperature"] == 0}
    assert set(got) == {"ouroboros", "ouroboros-phrases"}
    assert got == pytest.approx(want, rel=1e-12)


def test_a_config_name_in_two_counter_files_says_whose_it_is():
    files = [REPO / "results" / "phrases_40.json", REPO / "results" / "drafting_modes.json"]
    names = [r["method"] for r in bench_gpu.counter_rows(_args(counters=files))]
    assert names[0] == "phrases-pinned"  # the first file's keeps its name: the acceptance line's row
    assert "phrases-pinned (drafting_modes)" in names and len(set(names)) == len(names)


def test_flag_counters_give_the_rates_asked_for():
    rows = bench_gpu.counter_rows(_args(tokens_per_target_forward=4.75, draft_forwards_per_token=0.8))
    (r,) = bench_gpu.modeled(rows, {1: 10.0, 8: 12.0}, {1: 1.0, 64: 1.0})
    assert r["tokens_per_target_forward"] == pytest.approx(4.75)
    assert r["draft_forwards_per_token"] == pytest.approx(0.8)
    # No plain steps: per token, 0.8 draft forwards (1 ms) + 1/4.75 target forwards of 5 tokens.
    assert r["modeled"] == pytest.approx(10.0 / (0.8 * 1.0 + (10.0 + 2.0 * 4 / 7) / 4.75))


@pytest.mark.skipif(CUDA, reason="on a GPU this suite runs inside scripts/gpu_check.sh itself: a "
                                  "nested run would spend the device call's minutes on the plumbing")
def test_gpu_check_script_runs_a_selection_and_the_tiny_benchmark(tmp_path):
    """scripts/gpu_check.sh (what a session lent a GPU runs through the device tool): the
    benchmark, then a test selection, logs and a summary in $OUT (no more files than the tool
    brings back), a part with no time left marked."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), GPU_CHECK_NO_INSTALL="1", GPU_CHECK_BENCH_ARGS="--tiny",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "all",
                           "tests/test_request_slots.py"], capture_output=True, text=True, env=env,
                          timeout=600)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    selected = (REPO / "tests" / "test_request_slots.py").read_text().count("\ndef test_")
    assert f"{selected} passed" in (tmp_path / "tests.log").read_text()
    for part in ("bench", "tests"):
        assert f"{part}: exit 0" in summary, summary
    assert summary.index("bench: exit") < summary.index("tests: exit")  # the figures first
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert result["tiny"] and result["complete"] and result["budget_s"] > 0
    assert "NOT MEASURED" in summary and "== machine" in summary and f"{selected} passed" in summary
    assert len(list(tmp_path.iterdir())) <= 8  # the device tool brings back 8 files at most
    env["GPU_CHECK_LIMIT"] = "15"
    subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "all", "tests/test_request_slots.py"],
                   capture_output=True, text=True, env=env, timeout=600)
    summary = (tmp_path / "summary.txt").read_text()
    assert "bench: not run (no time left)" in summary and "tests: not run (no time left)" in summary


def test_budget_skips_what_is_left_and_says_why(tmp_path):
    """--budget-s 0: every timed point after the first check is skipped with the budget as its
    reason, the files are still written, and no acceptance line passes on nothing."""
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--tiny", "--budget-s", "0",
                           "--json", str(js), "--md", str(md)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(js.read_text())
    assert result["complete"] and md.exists()
    assert result["curves"]["draft"] == [] and result["rounds"] == [] and result["inserts"] is None
    reasons = {k: v for k, v in result["skipped"].items() if "budget" in v}
    assert any(k.startswith("curves/draft") for k in reasons) and any(k.startswith("rounds/") for k in reasons)
    assert all(v == "skipped: time budget spent (--budget-s 0)" for v in reasons.values())
    assert all(a["status"].startswith("NOT MEASURED") for a in result["acceptance"])
    if CUDA:  # on a CPU the graph round's line says "no CUDA" first
        assert "budget" in result["acceptance"][0]["status"], result["acceptance"][0]


def test_kernel_tiles_are_swept_where_the_table_misses(tmp_path):
    """Under the interpreter (its kernel / SDPA ratio is far above 1.25) the kernel table
    "misses", so the tile sweep runs: each candidate timed and checked against the reference at
    the table's configuration, the best one named, in the JSON, the markdown and the summary."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: there the sweep runs compiled, in gpu_check's benchmark "
                    "(and Triton 3.6's interpreter under numpy 2.5, the lent GPU machines' pair, cannot "
                    "take the kernel's loaded loop bounds: 'only 0-dimensional arrays can be converted')")
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    # The interpreter does not hide a GPU: without CUDA_VISIBLE_DEVICES the benchmark would take
    # its CUDA branch (the real pair's shapes, interpreted).
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--tiny", "--skip", "rounds",
                           "inserts", "graph", "fused", "target", "--json", str(js), "--md", str(md)],
                          capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    result = json.loads(js.read_text())
    tiles = result["kernel_tiles"]
    assert tiles["interpreted"] and tiles["complete"] and list(tiles["head_dims"]) == ["32"]
    v = tiles["head_dims"]["32"]
    assert len(v["candidates"]) == 2 and all(c["max_abs_err"] < 1e-4 for c in v["candidates"])
    assert v["best"]["worst_ratio"] == min(c["worst_ratio"] for c in v["candidates"])
    assert "Kernel tiles swept" in md.read_text() and "[kernel tiles] D=32" in out and "not a timing" in out


def test_round_cases_put_the_targets_first():
    """A budget-cut run keeps what the issue's targets read: the graph round at one request
    (decode and W=G=4) and at the most requests, before the rest."""
    plan = bench_gpu.Plan(tiny=False)
    cases = plan.round_cases(["graph", "graph+fused", "graph-fixed", bench_gpu.TORCH_POOL, bench_gpu.TORCH_ROUND,
                             "host", "device", bench_gpu.PADDED_STEPS])
    # Padded steps differ from the graph round only without guesses: decode-only, every batch.
    padded = [c for c in cases if c[2] == bench_gpu.PADDED_STEPS]
    assert padded == [("decode-only", b, bench_gpu.PADDED_STEPS) for b in (1, 32, 8)]
    # ... timed after the target step and the kernel table: not among the rounds timed before.
    ahead = plan.target_cases(cases)
    assert ahead and not set(ahead) & set(padded) and {c[:2] for c in ahead} == set(plan.target_groups())
    cases = [c for c in cases if c not in padded]
    assert cases[:3] == [("decode-only", 1, "graph"), ("decode-only", 1, "graph+fused"),
                         ("decode-only", 1, "graph-fixed")]
    first = {c: i for i, c in enumerate(cases)}
    assert first[("phrases W=G=4", 1, "graph")] < first[("decode-only", 32, "graph")] < first[
        ("phrases W=G=7", 1, "graph")] < first[("phrases W=G=15", 1, "graph")] < first[("decode-only", 8, "graph")]
    # 3 request counts x 4 modes, and the 3 one-request modes once
    assert len(cases) == len(set(cases)) == len(bench_gpu.ROUND_SETTINGS) * (3 * 4 + 3)
    groups = list(dict.fromkeys(c[:2] for c in cases))  # (setting, requests) in order of first case
    assert groups[:4] == plan.target_groups() == [("decode-only", 1), ("phrases W=G=4", 1),
                                                  ("decode-only", 32), ("phrases W=G=4", 32)]
    assert all(b == 1 for s, b, m in cases if m in bench_gpu.ONE_REQUEST_MODES)


def test_counters_from_generate_json(tmp_path):
    """scripts/generate.py --json rows give the counters too: tokens per target forward as
    generate.py printed them, draft forwards as the rounds ran them (one request at a time: a
    device round's F, not only what its row needed), the draft's row width from the settings
    the proposer resolved, the phrase-drafting row found by its settings, a device round's row
    preferred for the device and graph variants (the host loop's where the graph round exits
    early)."""
    def row(name, calls, row_forwards, W, G, draft_round="host"):
        return {"config": name, "concurrency": 1, "tokens": 400, "seconds": 70.0,
                "counters": {"draft_forwards": row_forwards, "draft_forward_calls": calls,
                             "target_forwards": 70, "accepted_tokens": 332, "drafted_tokens": 560},
                "settings": {"window_size": W, "num_guesses": G, "phrase_len": 4, "draft_round": draft_round}}

    rows = [{"config": "no-spec", "tokens": 400, "seconds": 100.0},
            row("chain", 380, 380, 0, 0), row("host-loop", 200, 200, 4, 4)]
    path = tmp_path / "generate.json"
    path.write_text(json.dumps(rows))
    path2 = tmp_path / "device.json"
    path2.write_text(json.dumps([row("device", 300, 200, 4, 4, "device")]))
    got = bench_gpu.modeled(bench_gpu.counter_rows(_args(counters=[path, path2])), {1: 10.0, 64: 10.0},
                            {1: 4.0, 64: 4.0})
    assert [r["row"] for r in got] == ["chain", "host-loop", "device"]
    chain, host, dev = got
    assert host["tokens_per_target_forward"] == pytest.approx((332 + 70) / 70)
    assert (host["draft_forwards_per_token"], dev["draft_forwards_per_token"]) == (0.5, 0.75)
    assert (chain["draft_row_tokens"], host["draft_row_tokens"]) == (2, 34)
    assert (chain["phrase_drafting"], host["phrase_drafting"], dev["phrase_drafting"]) == (False, True, True)
    # Flat curves: per token, 0.5 draft forwards of 4 ms and 70 target forwards of 10 ms over 400 tokens.
    assert host["modeled"] == pytest.approx(10.0 / (0.5 * 4.0 + 70 * 10.0 / 400))
    mod = {"variants": {name: {"rows": got} for name in ("eager drafting (host round, today)",
                                                          "graph drafting (graph round)")}}
    assert bench_gpu.phrase_modeled(mod, "eager drafting (host round, today)") == host["modeled"]
    assert bench_gpu.phrase_modeled(mod, "graph drafting (graph round)") == dev["modeled"]
    # Graph rounds that exit early (conditional nodes) draft what the host loop drafts.
    mod["variants"]["graph drafting (graph round)"]["early_exit"] = True
    assert bench_gpu.phrase_modeled(mod, "graph drafting (graph round)") == host["modeled"]


def test_builtin_draft_model_rows_are_priced_beside_ours(tmp_path):
    """A generate.py row of vLLM's draft_model-k3 (vLLM's counters, no proposer settings) is
    priced as benchmark.py prices that method: k one-token draft forwards per verified step of
    k + 1 tokens, steps without a draft as plain decodes; its name says its workload (every
    other row is HumanEval's), and the file's name marks it where a name repeats."""
    rows = [{"config": "no-spec", "tokens": 100, "seconds": 20.0},
            {"config": "draft_model-k3", "concurrency": 1, "tokens": 100, "seconds": 15.0,
             "overrides": {"method": "draft_model", "num_speculative_tokens": 3},
             "workload": "mtbench", "spec": {"num_drafts": 30, "num_draft_tokens": 90,
                                             "num_accepted_tokens": 60, "per_pos": [25, 20, 15]}}]
    path = tmp_path / "mt.json"
    path.write_text(json.dumps(rows))
    (r,) = bench_gpu.modeled(bench_gpu.counter_rows(_args(counters=[path])), {1: 10.0, 4: 13.0},
                             {1: 2.0, 64: 50.0})
    assert r["row"] == "draft_model-k3 [mtbench]" and not r["phrase_drafting"] and r["draft_row_tokens"] == 1
    assert r["draft_round"] == "vllm"
    assert r["draft_forwards_per_token"] == pytest.approx(0.9)
    # 90 draft forwards of 2 ms, 30 verifications of 4 tokens (13 ms), 10 plain decodes (10 ms).
    assert r["modeled"] == pytest.approx(10.0 / ((90 * 2.0 + 30 * 13.0 + 10 * 10.0) / 100))
    again = bench_gpu.counter_rows(_args(counters=[path, path]))
    assert [x["method"] for x in again] == ["draft_model-k3 [mtbench]", "draft_model-k3 [mtbench] (mt)"]
    assert bench_gpu.modeled(again, {1: 10.0, 4: 13.0}, {1: 2.0, 64: 50.0})[1]["modeled"] == r["modeled"]


def test_pool_mode_row_is_modeled_from_target_forwards_alone():
    """results/pool_mode.json's row (the pool mode: no draft forward, though its settings carry
    the runtime's window and guesses) is not phrase drafting, and its modeled speedup on a flat
    target curve is tokens per target forward over every step, plain ones included."""
    (r,) = bench_gpu.modeled(bench_gpu.counter_rows(_args(counters=[REPO / "results" / "pool_mode.json"])),
                             {1: 2.0, 64: 2.0}, {1: 1.0, 64: 1.0})
    rows = json.loads((REPO / "results" / "pool_mode.json").read_text())
    c = next(x for x in rows if x["config"] == "pool-pinned")
    assert r["row"] == "pool-pinned" and not r["phrase_drafting"] and r["draft_forwards_per_token"] == 0
    assert r["modeled"] == pytest.approx(c["tokens"] / (c["tokens"] - c["counters"]["accepted_tokens"]))
    assert r["modeled"] == pytest.approx(1.47, abs=0.01)


def test_modeled_only_prints_the_counters_under_given_curves():
    """--modeled-only needs no GPU: the modeled speedup of each counters row under the curves given
    (flat curves here: per token, d draft forwards of 1 ms and 1/E target forwards of 4 ms)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--modeled-only",
                           '{"1": 4.0, "64": 4.0}', '{"1": 1.0, "64": 1.0}', "--counters",
                           str(REPO / "results" / "drafting_modes.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["config"]: r for r in json.loads((REPO / "results" / "drafting_modes.json").read_text())}
    line = next(x for x in proc.stdout.splitlines() if x.startswith("phrases-pinned"))
    r = rows["phrases-pinned"]
    c = r["counters"]
    plain = max(r["tokens"] - c["target_forwards"] - c["accepted_tokens"], 0)
    per_token = (c["draft_forward_calls"] * 1.0 + (c["target_forwards"] + plain) * 4.0) / r["tokens"]
    assert float(line.split()[-1]) == pytest.approx(4.0 / per_token, abs=0.006)


def test_round_profile_charges_each_region(tiny_run):
    """The profile section (scripts/profile_round.py) on the tiny shapes: host time by region
    of the eager device round (no device activities on a CPU), the regions' functions restored
    after it, its lines in the output."""
    import profile_round
    from vllm_ouroboros.draft.model import DraftLayer
    from vllm_ouroboros.pool import PhrasePool

    _, result, md, output = tiny_run
    prof = result["profile"]
    assert set(prof) == ({"device", "device+fused", "graph+fused", "graph+fused, decode-only"} if CUDA
                         else {"device"})
    p = prof["device"]
    regions = {r["region"]: r for r in p["regions"]}
    for name in ("pool: lookup", "pool: insert", "draft: matrix products", "draft: attention",
                 "draft: LM head + argmax", "round: row inputs (masks, positions)"):
        assert regions[name]["calls"] > 0 and regions[name]["host_ms"] > 0, name
    # Two layers, four projections each (qkv, o, gate_up, down), every forward.
    fwd = regions["draft forward, rest (embedding, RoPE rows)"]["calls"]
    assert regions["draft: matrix products"]["calls"] == 4 * 2 * fwd
    assert sum(r["host_ms"] for r in p["regions"]) <= p["wall_ms"] * 1.05
    assert (p["device_activities"] > 0) == CUDA
    assert "[profile] device round, 1 request, phrases W=G=4" in output and "## Profile: device round" in md.read_text()
    # In this process: wrapped inside annotated(), the very same functions after it.
    before = PhrasePool.__dict__["insert"], DraftLayer.__dict__["project"], profile_round._owner(
        "vllm_ouroboros.draft.model").rms_norm
    with profile_round.annotated():
        assert PhrasePool.__dict__["insert"] is not before[0] and DraftLayer.__dict__["project"] is not before[1]
    after = PhrasePool.__dict__["insert"], DraftLayer.__dict__["project"], profile_round._owner(
        "vllm_ouroboros.draft.model").rms_norm
    assert all(x is y for x, y in zip(before, after))


def test_profile_names_the_kernels_a_graph_round_spends_its_time_in():
    """A graph-replayed round has no regions to charge: its device time by kernel name is what
    the profile reports (scripts/profile_round.summarize / report_lines), the costliest first."""
    from types import SimpleNamespace

    import profile_round
    from torch.autograd import DeviceType

    def kernel(name, us):
        return SimpleNamespace(device_type=DeviceType.CUDA, name=name,
                               time_range=SimpleNamespace(elapsed_us=lambda us=us: us))

    events = [kernel("prepare_kernel", 10.0), kernel("prepare_kernel", 20.0), kernel("gemm", 50.0),
              kernel("commit_kernel", 5.0)]
    p = profile_round.summarize(events, rounds=2, wall_ms=1.0)
    assert [k["name"] for k in p["kernels"]] == ["gemm", "prepare_kernel", "commit_kernel"]
    assert p["kernels"][1] == {"name": "prepare_kernel", "calls": 1.0, "device_ms": pytest.approx(0.015)}
    assert p["device_ms"] == pytest.approx(0.0425) and p["device_activities"] == 2
    lines = profile_round.report_lines("graph+fused round", {**p, "attributed": False})
    assert any("kernel gemm" in line and "0.025 device ms" in line for line in lines), lines
    # an eager round's regions carry its kernels: they are what is listed
    assert not any("kernel " in line for line in profile_round.report_lines("device round", {**p, "attributed": True}))
