"""Where the time of one decoding step goes, with and without ouroboros (cProfile, engine in
this process), on the real pair.

    source scripts/env.sh && python scripts/profile_step.py --prompts 2 --max-tokens 64

Runs each configuration's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) under cProfile and
prints, per engine step, the milliseconds spent in: the target forward (vLLM's `_model_forward`),
the draft (`OuroborosProposer.propose`: rollback, prefill and lookahead forwards of the draft
model), the acceptance walk and KV relocation (`tree_verify.sample`), the pool feedback
(`OuroborosProposer.on_verified`), the draft's lookahead and prefill forwards inside `propose`,
and the whole engine step (the rest is vLLM's input preparation, scheduling, output processing). Also writes the full profile
(`--out`, pstats) for `python -m pstats` or snakeviz.

`--torch-step N` also records engine step N of the first prompt (1 = its prefill) with the torch
profiler and prints its operators by self CPU time (and CUDA time where there is a GPU), and writes
a Chrome trace (`--out`/NAME.step-N.trace.json, for chrome://tracing or Perfetto).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from generate import humaneval_prompts, models_dir  # noqa: E402

PHASES = {
    # label: (file suffix, function name)
    "target forward": ("vllm/v1/worker/gpu_model_runner.py", "_model_forward"),
    "draft (propose)": ("vllm_ouroboros/proposer.py", "propose"),
    "  of which draft lookahead forwards": ("vllm_ouroboros/draft/runtime.py", "_lookahead_forward"),
    "  of which draft prefill (catch-up)": ("vllm_ouroboros/draft/runtime.py", "_prefill"),
    "walk + KV relocation": ("vllm_ouroboros/patches/tree_verify.py", "sample"),
    "pool feedback (on_verified)": ("vllm_ouroboros/proposer.py", "on_verified"),
    "engine step (all)": ("vllm/v1/engine/core.py", "step"),
}


def cumulative(stats: pstats.Stats, path_suffix: str, func: str) -> float:
    total = 0.0
    for (file, _, name), (_, _, _, ct, _) in stats.stats.items():
        if name == func and file.endswith(path_suffix):
            total += ct
    return total


def calls(stats: pstats.Stats, path_suffix: str, func: str) -> int:
    return sum(nc for (file, _, name), (_, nc, _, _, _) in stats.stats.items()
               if name == func and file.endswith(path_suffix))


def torch_profile_step(llm, prompt: str, sp, step: int, rows: int, trace: Path) -> None:
    """Record engine step `step` (1-based) of generating `prompt` alone with torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    # The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): its step function is bound
    # at construction, so the wrapper goes on the instance.
    core = llm.llm_engine.engine_core.engine_core
    inner = core.step_fn
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    seen = 0
    with profile(activities=activities, schedule=schedule(wait=step - 1, warmup=0, active=1, repeat=1),
                 record_shapes=False) as prof:
        def step_fn():
            nonlocal seen
            out = inner()
            seen += 1
            prof.step()
            return out

        core.step_fn = step_fn
        try:
            llm.generate([prompt], sp, use_tqdm=False)
        finally:
            core.step_fn = inner
    if seen < step:
        print(f"\n(torch profiler: the prompt took {seen} engine steps, fewer than --torch-step {step})")
        return
    prof.export_chrome_trace(str(trace))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"\n-- torch profiler, engine step {step} of the first prompt (trace: {trace})")
    print(prof.key_averages().table(sort_by=sort, row_limit=rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec", default="{}", help="ouroboros keys as JSON for the ouroboros run")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ouroboros-profile"))
    ap.add_argument("--torch-step", type=int, default=0,
                    help="also record this engine step of the first prompt with the torch profiler")
    ap.add_argument("--torch-rows", type=int, default=25, help="operators printed for --torch-step")
    args = ap.parse_args()
    import json

    from vllm import LLM, SamplingParams

    target, draft = models_dir() / "qwen2.5-coder-1.5b-instruct", models_dir() / "qwen2.5-coder-0.5b-instruct"
    prompts = humaneval_prompts(args.prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    configs = {"no-spec": None,
               "ouroboros": {"method": "ouroboros", "model": str(draft), **json.loads(args.spec)}}
    print(f"{args.prompts} HumanEval prompts x {args.max_tokens} tokens, one at a time; spec {args.spec}")
    for name, spec in configs.items():
        llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
                  max_num_seqs=1, speculative_config=spec)
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        llm.generate(["def warm_up():"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        if args.torch_step > 0:
            torch_profile_step(llm, prompts[0], sp, args.torch_step, args.torch_rows,
                               args.out / f"{name}.step-{args.torch_step}.trace.json")
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        prof.disable()
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        prof.dump_stats(str(args.out / f"{name}.pstats"))
        st = pstats.Stats(prof)
        fwd = max(calls(st, *PHASES["target forward"]), 1)
        print(f"\n== {name}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.2f} tok/s), "
              f"{fwd} target forwards, {tokens / fwd:.2f} tokens per target forward")
        print(f"{'phase':<34}{'ms per target forward':>22}{'share of wall':>15}")
        for label, key in PHASES.items():
            sec = cumulative(st, *key)
            print(f"{label:<34}{1000 * sec / fwd:>22.1f}{sec / wall:>15.1%}")
        del llm
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
