"""Milliseconds of one draft forward (DraftModel.forward + the LM head's argmax) over a cached
context, by context length and new tokens per forward, as the CPU host loop runs it (vLLM's
oneDNN products where available, `draft_cpu_gemm` auto). To compare two checkouts, run it from
each, alternating (this host drifts 20-30% hour to hour):

    source scripts/env.sh && python scripts/draft_forward_cost.py [--contexts 300 2000] [--new 1 34]

Each point: the mean of the fastest half of --reps forwards, after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = Path(os.environ.get("OUROBOROS_MODELS_DIR", REPO / "models"))
    ap.add_argument("--draft", type=Path, default=models / "qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 2000])
    ap.add_argument("--new", type=int, nargs="+", default=[1, 34])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    from vllm_ouroboros.draft.model import DraftModel

    torch.set_num_threads(os.cpu_count() or 1)
    m = DraftModel.from_pretrained(str(args.draft), dtype=getattr(torch, args.dtype), device="cpu")
    try:
        from vllm_ouroboros.patches.cpu_gemm import onednn_gemm_factory

        factory = onednn_gemm_factory(dtype=m.dtype)
        if factory is not None:
            m.use_gemm(factory)
    except ImportError:  # no vLLM: F.linear
        pass
    m.allocate_cache(1, max(args.contexts) + max(args.new))
    slot = torch.zeros(1, dtype=torch.long)
    print(f"draft {args.draft.name} ({args.dtype}), ms per forward:")
    for ctx in args.contexts:
        ids = torch.randint(0, 1000, (1, ctx))
        m.forward(ids, torch.arange(ctx)[None], slot, torch.zeros(1, dtype=torch.long),
                  torch.ones(ctx, ctx, dtype=torch.bool).tril()[None], max_cache_len=0)
        lens = torch.tensor([ctx])
        for n in args.new:
            x = torch.randint(0, 1000, (1, n))
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
            times = []
            for _ in range(args.reps + 1):
                t0 = time.perf_counter()
                m.greedy_tokens(m.forward(x, lens[:, None] + torch.arange(n), slot, lens, mask,
                                          max_cache_len=ctx)[:, -1])
                times.append(time.perf_counter() - t0)
            best = sorted(times[1:])[: max(args.reps // 2, 1)]
            print(f"  context {ctx:>5}, {n:>3} new tokens: {1000 * sum(best) / len(best):8.1f}")


if __name__ == "__main__":
    main()
