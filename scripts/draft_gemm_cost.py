"""The draft's cost curve on CPU with torch F.linear and with vLLM's oneDNN GEMM, side by side.

    source scripts/env.sh && python scripts/draft_gemm_cost.py [--draft models/qwen2.5-coder-0.5b-instruct]

Prints, for n new tokens in one row (empty prefix, causal mask, greedy LM head as the runtime does):
the forward's time with each product, one decoder layer's four products alone, and the LM head
alone (median of --reps after a warm-up). Source of the numbers in vllm_ouroboros/patches/cpu_gemm.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--points", default="1,2,3,4,8,16,24,32,48,64")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from vllm_ouroboros.draft.model import LAYER_PROJECTIONS, DraftModel
    from vllm_ouroboros.patches.cpu_gemm import MIN_ROWS, onednn_gemm_factory

    torch.manual_seed(0)
    factory = onednn_gemm_factory(min_rows=1)  # oneDNN at every size, to show where it wins
    if factory is None:
        print("this vLLM build has no oneDNN GEMM: nothing to compare")
        return 1
    torch_model = DraftModel.from_pretrained(str(args.draft), dtype=torch.float32, device="cpu")
    torch_model.allocate_cache(1, 256)
    layer = torch_model.layers[0]
    onednn_layer = {n: factory(getattr(layer, n + "_weight")) for n in LAYER_PROJECTIONS}
    onednn_head = factory(torch_model.lm_head_weight)
    ins = {"qkv": layer.qkv_weight.shape[1], "o": layer.o_weight.shape[1],
           "gate_up": layer.gate_up_weight.shape[1], "down": layer.down_weight.shape[1]}
    slots = torch.zeros(1, dtype=torch.long)
    zero = torch.zeros(1, dtype=torch.long)
    print(f"draft {args.draft.name}, float32, torch threads {torch.get_num_threads()}; ms, median of "
          f"{args.reps}")
    print(f"| n | forward F.linear | forward oneDNN (>= {MIN_ROWS} rows) | layer products F.linear | "
          "layer products oneDNN | LM head F.linear | LM head oneDNN |")
    print("|---|---|---|---|---|---|---|")
    # What the engine uses (oneDNN from MIN_ROWS rows): the factory above while MIN_ROWS is 1.
    hybrid = factory if MIN_ROWS <= 1 else onednn_gemm_factory()
    for n in [int(p) for p in args.points.split(",")]:
        ids = torch.full((1, n), 3)
        pos = torch.arange(n)[None]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]

        def fwd(m=torch_model):
            m.greedy_tokens(m.forward(ids, pos, slots, zero, mask, max_cache_len=0))

        torch_model.head_gemm = None
        for lyr in torch_model.layers:
            lyr.gemms = {}
        t_torch = timed(fwd, args.reps)
        torch_model.use_gemm(hybrid)
        t_hybrid = timed(fwd, args.reps)
        xs = {k: torch.randn(1, n, d) for k, d in ins.items()}
        bias = {k: getattr(layer, k + "_bias") for k in ins}
        p_torch = sum(timed(lambda k=k: torch.nn.functional.linear(
            xs[k], getattr(layer, k + "_weight"), bias[k]), args.reps) for k in ins)
        p_dnn = sum(timed(lambda k=k: onednn_layer[k](xs[k], bias[k]), args.reps) for k in ins)
        h = torch.randn(n, torch_model.hidden_size)
        head_torch = timed(lambda: torch.nn.functional.linear(h, torch_model.lm_head_weight), args.reps)
        head_dnn = timed(lambda: onednn_head(h, None), args.reps)
        print(f"| {n} | {t_torch:.1f} | {t_hybrid:.1f} | {p_torch:.2f} | {p_dnn:.2f} | "
              f"{head_torch:.1f} | {head_dnn:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
