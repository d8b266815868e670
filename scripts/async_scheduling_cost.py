"""What vLLM's async scheduling is worth without speculation: two engines that differ only in
`async_scheduling`, the same requests submitted together. vLLM turns async scheduling off for
every `custom_class` proposer (ouroboros included), so this is the floor a speculating engine
that backs off completely is compared against.

    source scripts/env.sh && python scripts/async_scheduling_cost.py --prompts 16
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from generate import humaneval_prompts, models_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="first N HumanEval prompts, all submitted together")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    prompts = humaneval_prompts(args.prompts)
    for async_on in (False, True):
        llm = LLM(model=str(models_dir() / "qwen2.5-coder-1.5b-instruct"), dtype="float32",
                  max_model_len=2048, enforce_eager=True, seed=0, max_num_seqs=len(prompts),
                  async_scheduling=async_on)
        llm.generate(["def warm_up():"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"no speculation, async_scheduling={async_on}: {tokens / dt:.2f} tok/s", flush=True)
        del llm
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
