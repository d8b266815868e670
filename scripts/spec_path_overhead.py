"""What the speculative path costs when nothing is drafted: 16 HumanEval prompts x 64 tokens at
once, greedy, one engine each: no-spec with vLLM's default scheduling, no-spec with async
scheduling off (what vLLM forces for custom_class proposers), and ouroboros with
max_speculative_batch 1 (never drafts at 16 requests). Prints tok/s and output identity.

Usage: source scripts/env.sh && VLLM_CPU_KVCACHE_SPACE=2 python scripts/spec_path_overhead.py
"""
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from generate import humaneval_prompts, models_dir
from vllm import LLM, SamplingParams


def main():
    target = models_dir() / "qwen2.5-coder-1.5b-instruct"
    draft = models_dir() / "qwen2.5-coder-0.5b-instruct"
    prompts = humaneval_prompts(16)
    sp = SamplingParams(temperature=0, max_tokens=64)
    runs = [("no-spec, async scheduling (default)", {}),
            ("no-spec, async scheduling off", {"async_scheduling": False}),
            ("ouroboros, max_speculative_batch 1 (never at 16)",
             {"speculative_config": {"method": "ouroboros", "model": str(draft), "max_speculative_batch": 1}})]
    base = None
    for name, kw in runs:
        llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
                  max_num_seqs=16, enable_prefix_caching=False, **kw)
        print("async_scheduling =", llm.llm_engine.vllm_config.scheduler_config.async_scheduling, flush=True)
        llm.generate(["def warm_up():"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        base = base or ids
        print(f"RESULT {name}: {toks / dt:.2f} tok/s ({toks} tokens, {dt:.1f} s), identical {ids == base}", flush=True)
        del llm; gc.collect()

if __name__ == '__main__':
    main()
