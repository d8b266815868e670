"""Per-step time of vLLM's and our per-step work at 16 requests (16 HumanEval prompts x 32 tokens,
greedy, in-process engine under cProfile): no-spec vs ouroboros with drafting off
(max_speculative_batch 1), ms per engine step (prefill steps included).

Usage: source scripts/env.sh && VLLM_CPU_KVCACHE_SPACE=2 python scripts/profile_spec_path.py
"""
import cProfile
import gc
import os
import pstats
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).parent))
from generate import humaneval_prompts, models_dir
from profile_step import cumulative, calls

FUNCS = [("engine step", "vllm/v1/engine/core.py", "step"),
         ("execute_model", "vllm/v1/worker/gpu_model_runner.py", "execute_model"),
         ("target forward", "vllm/v1/worker/gpu_model_runner.py", "_model_forward"),
         ("_prepare_inputs", "vllm/v1/worker/gpu_model_runner.py", "_prepare_inputs"),
         ("  ours: begin_step", "vllm_ouroboros/patches/tree_verify.py", "begin_step"),
         ("sample_tokens", "vllm/v1/worker/gpu_model_runner.py", "sample_tokens"),
         ("_sample", "vllm_ouroboros/patches/model_runner.py", "sample"),
         ("propose_draft_token_ids", "vllm/v1/worker/gpu_model_runner.py", "propose_draft_token_ids"),
         ("  ours: propose", "vllm_ouroboros/proposer.py", "propose"),
         ("schedule", "vllm/v1/core/sched/scheduler.py", "schedule"),
         ("update_from_output", "vllm/v1/core/sched/scheduler.py", "update_from_output")]

def main():
    from vllm import LLM, SamplingParams
    target = models_dir() / "qwen2.5-coder-1.5b-instruct"
    draft = models_dir() / "qwen2.5-coder-0.5b-instruct"
    prompts = humaneval_prompts(16)
    sp = SamplingParams(temperature=0, max_tokens=32)
    for name, spec in (("no-spec", None), ("ouroboros drafting off", {"method": "ouroboros", "model": str(draft), "max_speculative_batch": 1})):
        llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
                  max_num_seqs=16, enable_prefix_caching=False, speculative_config=spec)
        llm.generate(["def warm_up():"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        pr = cProfile.Profile(); t0 = time.perf_counter(); pr.enable()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        pr.disable(); dt = time.perf_counter() - t0
        st = pstats.Stats(pr)
        steps = calls(st, "vllm/v1/engine/core.py", "step") or 1
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"PROF {name}: {toks / dt:.2f} tok/s under cProfile, {steps} engine steps; ms per step:")
        for label, f, fn in FUNCS:
            print(f"PROF   {label:<28}{1000 * cumulative(st, f, fn) / steps:8.1f}")
        del llm; gc.collect()

if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
