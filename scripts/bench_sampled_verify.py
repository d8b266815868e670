"""Memory and time of a sampled tree verification: processing the rows the walk reads (what the
step does) against processing every node's row first (the walk's table form, what it did before).

    python scripts/bench_sampled_verify.py [--requests 32] [--draft 8] [--suffixes 3]
        [--suffix-len 4] [--vocab 151936] [--top-p 0.9] [--repeats 3]

B requests, each a tree of a draft chain plus K suffixes (N nodes, N + 1 logit rows), float32
logits, every request sampled (temperature 0.8, top-p by a sort of the vocabulary, as vLLM's
torch sampler does; top-p 1 skips it). Per variant: the memory it needed beyond the logits (on
CUDA the allocator's peak; on CPU the process's peak resident set, each variant in a fresh
process so one's peak cannot hide the other's) and the time of one verification (best of
--repeats). Both variants get the same uniforms and must emit the same tokens (checked).
No vLLM import: runs where the draft side does (the lent GPU machines included).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np
import torch

from vllm_ouroboros.accept import accept_sampled, walk_steps
from vllm_ouroboros.tree import build_tree
from vllm_ouroboros.verify import node_rows, verify

TEMPERATURE = 0.8


def top_p_cut(x: torch.Tensor, p: float) -> torch.Tensor:
    """vLLM's torch top-p (apply_top_k_top_p_pytorch) on x [n, V] float32, in place."""
    if p >= 1.0:
        return x
    s, idx = x.sort(dim=-1)
    cum = s.softmax(dim=-1).cumsum(dim=-1)
    cut = cum <= 1 - p
    cut[:, -1] = False
    return x.scatter_(-1, idx, s.masked_fill_(cut, float("-inf")))


def case(args, dev):
    g = torch.Generator(dev).manual_seed(0)
    B, D, K, L, V = args.requests, args.draft, args.suffixes, args.suffix_len, args.vocab
    tree = build_tree(torch.randint(0, 2, (B, D), generator=g, device=dev), torch.full((B,), D, device=dev),
                      torch.randint(0, 2, (B, K, L), generator=g, device=dev),
                      torch.full((B, K), L, device=dev))
    row_start = np.arange(B) * (tree.N + 1)
    logits = torch.randn(B * (tree.N + 1), V, generator=g, device=dev)
    logits[:, :2] += 14.0  # the tree's tokens are likely: walks go deep, as on a real pair
    u = torch.rand(B, walk_steps(tree), K + 1, generator=g, device=dev)
    return tree, row_start, logits, u


def run_variant(args, variant: str) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tree, row_start, logits, u = case(args, dev)
    greedy = torch.zeros(tree.B, dtype=torch.bool, device=dev)

    def rows_form():
        process = lambda x: top_p_cut(x.div_(TEMPERATURE), args.top_p)  # noqa: E731
        return verify(tree, logits, row_start, greedy, process, uniforms=u).result

    def table_form():
        x = top_p_cut(logits.float() / TEMPERATURE, args.top_p)  # a copy, as the step made
        rows = torch.as_tensor(node_rows(tree, row_start), device=dev)
        return accept_sampled(tree, torch.softmax(x[rows], dim=-1), uniforms=u)

    fn = rows_form if variant == "rows" else table_form
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = fn()  # ends in a read-back: synchronised
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"variant": variant, "device": dev.type, "extra_mb": (peak - base) / 2**20,
            "logits_mb": logits.numel() * 4 / 2**20, "ms": 1e3 * min(times),
            "emitted": res.emitted.tolist(), "mean_accepted": float(res.num_accepted.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--suffixes", type=int, default=3)
    ap.add_argument("--suffix-len", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", choices=["rows", "table"], help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args, args.variant)))
        return
    out = {}
    for variant in ("table", "rows"):
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                               check=True, capture_output=True, text=True)
        out[variant] = json.loads(child.stdout.strip().splitlines()[-1])
    t, r = out["table"], out["rows"]
    if t["emitted"] != r["emitted"]:
        sys.exit("FAIL: the two forms emitted different tokens")
    rows = args.requests * (args.draft + args.suffixes * args.suffix_len + 1)
    print(f"{args.requests} requests, {rows} logit rows, vocab {args.vocab}, top-p {args.top_p}, "
          f"{r['device']}: logits {r['logits_mb']:.0f} MB; mean accepted {r['mean_accepted']:.2f}; "
          "same tokens emitted")
    print("| form | memory beyond the logits (MB) | ms per verification |")
    print("|---|---:|---:|")
    for v in (t, r):
        name = "every node's row, then walk (before)" if v is t else "rows the walk reads (now)"
        print(f"| {name} | {v['extra_mb']:.0f} | {v['ms']:.1f} |")
    print(f"memory ratio now/before: {r['extra_mb'] / max(t['extra_mb'], 1e-9):.3f}; "
          f"time ratio now/before: {r['ms'] / t['ms']:.2f}")


if __name__ == "__main__":
    main()
