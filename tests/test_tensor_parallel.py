"""Tensor parallelism in the real engine: two TP ranks on this CPU (vLLM's multiprocessing
executor, gloo), tiny models, the token tree on (K = 3).

Under TP each rank runs its own proposer and builds the target's tree from it; the first rank
drafts and hands its proposals and their layouts to the other (patches/distributed.py), so the
ranks cannot disagree on a tree even where decisions come from timings. Greedy output must equal
the same TP engine without speculation, and the second rank must have drafted nothing itself.
"""

from __future__ import annotations

import gc
import os

import pytest
from conftest import pool_lookups_when_idle

pytestmark = pytest.mark.engine

TEXT = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
        "The quick brown fox jumps over the lazy dog while the small model drafts tokens. ")
PROMPTS = [(TEXT * 4)[i * 13: i * 13 + c] for i, c in enumerate([5, 40, 120, 260, 17, 90])]


def run_tp2(target, spec):
    """Greedy outputs of a TP = 2 engine, with speculation each rank's counters (the first's
    "idle_file_lookups": the pool file's before the engine stops), and the engine-core
    processes (to tell, where the pool file is wrong, whether they ended, and how)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
              max_num_seqs=8, tensor_parallel_size=2, speculative_config=spec)
    try:
        outs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=48 + 8 * i)
                                      for i in range(len(PROMPTS))], use_tqdm=False)
        snaps = llm.collective_rpc("ouroboros_snapshot") if spec else None
        if spec and spec.get("pool_save_path"):
            snaps[0]["idle_file_lookups"] = pool_lookups_when_idle(spec["pool_save_path"],
                                                                   snaps[0]["pool"]["lookups"])
        procs = list(getattr(llm.llm_engine.engine_core.resources.engine_manager, "processes", []))
        return [list(o.outputs[0].token_ids) for o in outs], snaps, procs
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def tp_env():
    """One core per rank: vLLM's CPU workers bind their OpenMP threads per rank."""
    cpus = sorted(os.sched_getaffinity(0))  # this process's (a container's cpuset), not the host's
    if len(cpus) < 2:
        pytest.skip("tensor parallelism on CPU needs two cores, one per rank")
    h = len(cpus) // 2
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{','.join(map(str, cpus[:h]))}|{','.join(map(str, cpus[h:]))}")
    yield
    mp.undo()


def shutdown_report(procs, printed: str) -> str:
    """What a wrong pool file needs explained: how each engine-core process ended (its exit
    code; -9: killed) and the engine's shutdown and pool lines as printed."""
    lines = [ln for ln in printed.splitlines() if "[shutdown]" in ln or ("ouroboros:" in ln and "pool" in ln)]
    return "\n".join([f"engine-core processes: {[(p.name, p.exitcode) for p in procs]}", *lines[-40:]])


def test_tp2_greedy_identical_and_only_the_first_rank_drafts(tp_env, tiny_models, tmp_path, capfd):
    """Also the pool file under TP: the first rank writes its pool when the engine goes idle
    and the file holds it still after the shutdown (whose save RPC reaches both ranks: the
    first finds its file current, the second holds no pool)."""
    from vllm_ouroboros.pool import PhrasePool

    base, _, _ = run_tp2(tiny_models["target"], None)
    # The close draft: its drafts are accepted in full often enough that later suffixes are
    # accepted whatever the CPU's rounding (tests/tiny_models.py model_pair).
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), "num_suffixes": 3,
            "use_lookahead": True, "use_guesses": True, "max_speculative_batch": 64,
            "use_suffixes": True, "pool_save_path": str(tmp_path / "pool.pt")}
    capfd.readouterr()  # the engine without speculation's lines
    ours, snaps, procs = run_tp2(tiny_models["target"], spec)
    printed = "".join(capfd.readouterr())
    print(printed)  # as captured without capfd, for pytest's report
    for i, (b, o) in enumerate(zip(base, ours)):
        assert o == b, f"request {i}: TP = 2 with ouroboros differs from TP = 2 without"
    first, second = snaps
    print(f"rank 0: {first['draft_forwards']} draft forwards, {first['accepted_tokens']} tokens "
          f"accepted, {first['tree_suffix_accepted']} from suffixes k >= 1; rank 1: "
          f"{second['draft_forwards']} draft forwards")
    assert first["draft_forwards"] > 0 and first["accepted_tokens"] > 0
    assert first["tree_suffix_accepted"] > 0, "no tree branch other than the first was accepted"
    # The second rank loaded no draft and ran none: its trees came from the first rank's layouts.
    assert second["draft_forwards"] == 0 and "settings" not in second and "pool" not in second
    assert first["idle_file_lookups"] == first["pool"]["lookups"] > 0, (
        "the idle engine did not write its pool", first["idle_file_lookups"], first["pool"])
    state = PhrasePool.read_state(str(tmp_path / "pool.pt"))  # the pool after the last step
    assert int(state["counters"][0]) == first["pool"]["lookups"] > 0, (
        f"the pool file's lookups {int(state['counters'][0])}, the last snapshot's "
        f"{first['pool']['lookups']}\n{shutdown_report(procs, printed)}")
