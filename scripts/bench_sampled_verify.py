"""Memory and time of a sampled tree verification (verify.verify) in its forms: every node's
row processed at once (the table form, for batches up to max_table_rows), walked by torch or,
on a GPU, by the Triton kernel (kernels/sampled_walk.py); and the rows the walk reads,
processed as it reaches them (beyond max_table_rows); and every request seeded
(seeded_sampling.py: each tree row sampled with a copy of its request's generator, one sampler
call per depth, here a torch stand-in for vLLM's native sampler: an exponential row per draw).

    python scripts/bench_sampled_verify.py [--requests 32] [--draft 8] [--suffixes 3]
        [--suffix-len 4] [--vocab 151936] [--top-p 0.9] [--repeats 3]
    python scripts/bench_sampled_verify.py --compile-only [SM ...]   # no GPU needed

B requests, each a tree of a draft chain plus K suffixes (N nodes, N + 1 logit rows), float32
logits, every request sampled (temperature 0.8, top-p by a sort of the vocabulary, as vLLM's
torch sampler does; top-p 1 skips it). Per form: the memory it needed beyond the logits (on
CUDA the allocator's peak; on CPU the process's peak resident set, each form in a fresh
process so one's peak cannot hide the other's) and the time of one verification (best of
--repeats). All unseeded forms get the same uniforms and must emit the same tokens (checked);
the seeded form samples other tokens (its requests' own draws).
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

from vllm_ouroboros.accept import walk_steps
from vllm_ouroboros.seeded_sampling import SeededDraws
from vllm_ouroboros.tree import build_tree
from vllm_ouroboros.verify import verify

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
    u = torch.rand(B, walk_steps(tree), K + 1, generator=g, device=dev, dtype=torch.float64)  # as served
    return tree, row_start, logits, u


def run_variant(args, variant: str) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tree, row_start, logits, u = case(args, dev)
    greedy = torch.zeros(tree.B, dtype=torch.bool, device=dev)

    def process(x, req):
        x.div_(TEMPERATURE)
        return top_p_cut(x, args.top_p)

    def native_sample(x, generators, req):  # vLLM's random_sample after its top-p
        probs = top_p_cut(x, args.top_p).softmax(dim=-1)
        q = torch.empty_like(probs)
        for i, g in generators.items():
            q[i].exponential_(generator=g)
        return probs.div_(q).argmax(dim=-1)

    table_rows = 0 if variant == "rows" else tree.B * (tree.N + 1)
    walk = "triton" if variant == "kernel" else "torch"
    gens = {b: torch.Generator(dev).manual_seed(b) for b in range(tree.B)} if variant == "seeded" else {}
    fn = lambda: verify(tree, logits, row_start, greedy, process, uniforms=u,  # noqa: E731
                        max_table_rows=table_rows, walk=walk,
                        seeded=SeededDraws(gens, lambda x, req: x.div_(TEMPERATURE), native_sample, table_rows)
                        if gens else None).result
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


def count_calls(args) -> dict[str, int]:
    """Non-view ATen calls (each a kernel launch on a GPU) of one table-form verification of
    --requests[0]... trees, per walk; the Triton walk's own launch is not an ATen call (the
    kernel is replaced by a stub here, so this runs anywhere)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import vllm_ouroboros.kernels.sampled_walk as sw

    views = {"select.int", "unsqueeze.default", "view.default", "slice.Tensor", "expand.default",
             "t.default", "alias.default", "detach.default"}

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.__name__ not in views
            return func(*args, **(kwargs or {}))

    a = argparse.Namespace(**{**vars(args), "requests": 4, "vocab": 1000})
    tree, row_start, logits, u = case(a, torch.device("cpu"))
    greedy = torch.zeros(tree.B, dtype=torch.bool)
    real, counts = sw.sampled_walk_triton, {}
    sw.sampled_walk_triton = lambda *a_, **k: torch.zeros(4, tree.B, dtype=torch.long)  # noqa: E731
    try:
        for walk in ("torch", "triton"):
            Count.calls = 0
            with Count():
                verify(tree, logits, row_start, greedy, lambda x, req: x.div_(TEMPERATURE), uniforms=u,
                       max_table_rows=tree.B * (tree.N + 1), walk=walk)
            counts[walk] = Count.calls
    finally:
        sw.sampled_walk_triton = real
    return counts


def compile_only(archs: list[int]) -> int:
    """Compile the Triton walk for NVIDIA targets without a GPU (Triton's bundled ptxas), for
    K = 1-8 suffixes and both tile widths, and print registers / stack (spills) per thread."""
    import triton

    from vllm_ouroboros.kernels import sampled_walk as sw
    from vllm_ouroboros.kernels.triton_runtime import compile_report, not_compilable_reason, signature_of

    kernel = sw.sampled_walk_kernel
    if why := not_compilable_reason(kernel):
        print(why)
        return 1
    types = dict(x_ptr="*fp32", tn_ptr="*i64", greedy_ptr="*i8", tokens_ptr="*i64", branch_ptr="*i64",
                 draft_len_ptr="*i64", sstart_ptr="*i64", slen_ptr="*i64", u_ptr="*fp64", out_ptr="*i64")
    sig = signature_of(kernel, types)
    rc = 0
    print(f"triton {triton.__version__}")
    for arch in archs:
        for C in (1, 2, 3, 4, 8):
            for bv in (sw.BLOCK_V, 64):
                _, usage, failed = compile_report(kernel, sig, dict(C=C, BLOCK_C=triton.next_power_of_2(C), BLOCK_V=bv),
                                                  dict(num_warps=8 if bv >= 1024 else 4), arch)
                rc |= failed
                print(f"sm_{arch} K={C} BLOCK_V={bv}: {usage}")
    return rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--suffixes", type=int, default=3)
    ap.add_argument("--suffix-len", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-only", type=int, nargs="*", metavar="SM",
                    help="compile the Triton walk for these NVIDIA archs (default 80 90) without a GPU")
    ap.add_argument("--variant", choices=["rows", "table", "kernel", "seeded"], help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    if args.compile_only is not None:
        sys.exit(compile_only(args.compile_only or [80, 90]))
    if args.variant:
        args.requests = args.requests[0]
        print(json.dumps(run_variant(args, args.variant)))
        return
    node_rows = args.draft + args.suffixes * args.suffix_len + 1
    print(f"vocab {args.vocab}, {node_rows} logit rows per request, top-p {args.top_p}, float32 logits")
    print("| requests | form | memory beyond the logits (MB) | ms per verification | mean accepted |")
    print("|---:|---|---:|---:|---:|")
    ratios = []
    for B in args.requests:
        out = {}
        # The kernel's walk on a GPU only: the CPU would run it in Triton's interpreter.
        for variant in ("table", "rows", "seeded") + (("kernel",) if torch.cuda.is_available() else ()):
            child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--requests", str(B),
                                    "--variant", variant], check=True, capture_output=True, text=True)
            out[variant] = json.loads(child.stdout.strip().splitlines()[-1])
        t, r, k, sd = out["table"], out["rows"], out.get("kernel"), out["seeded"]
        if any(v["emitted"] != t["emitted"] for n, v in out.items() if n != "seeded"):
            sys.exit(f"FAIL: the forms emitted different tokens at {B} requests")
        names = {"table": "every node's row at once (table form), torch walk",
                 "rows": "rows the walk reads, as it reads them", "kernel": "table form, Triton walk",
                 "seeded": "every request seeded: each row sampled with its generator's draw"}
        for name, v in out.items():
            print(f"| {B} | {names[name]} | {v['extra_mb']:.0f} | {v['ms']:.1f} | {v['mean_accepted']:.2f} |")
        ratios.append(f"{B} requests: rows / table memory {r['extra_mb'] / max(t['extra_mb'], 1e-9):.3f}x, "
                      f"time {r['ms'] / t['ms']:.2f}x; seeded / table time {sd['ms'] / t['ms']:.2f}x"
                      + (f"; kernel / table time {k['ms'] / t['ms']:.2f}x" if k else ""))
    print(f"device {r['device']}; same tokens emitted by every unseeded form; " + "; ".join(ratios)
          + ("" if torch.cuda.is_available() else " (the Triton walk: CUDA only, not run)"))
    calls = count_calls(args)
    print(f"ATen calls (GPU launches) of one table-form verification, 4 requests, top-p off: torch walk "
          f"{calls['torch']}, Triton walk {calls['triton']} + its one launch")


if __name__ == "__main__":
    main()
