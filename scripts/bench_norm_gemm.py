"""RMSNorm (and SiLU*up) inside the matrix product (kernels/norm_gemm.py) vs the separate
kernels and cuBLAS's product, at the real draft's layer shapes: what `draft_norm_gemm` is to be
chosen by.

    python scripts/bench_norm_gemm.py [--rows 1 8 34 64] [--hidden 896] [--qkv 1152] [--inter 4864]
        [--reps 200] [--compile-only [SM ...] [--tiles BLOCK_M BLOCK_N BLOCK_K WARPS]]

Per row count and product (qkv: add+RMSNorm -> product with bias; gate_up: add+RMSNorm ->
product -> SiLU*up): both forms replayed from CUDA graphs of 20 calls each (so a call's time is
its device time with the graph's launch gaps, as in a replayed draft forward), the median over
`--reps` replays, us per call, and the fused form's time over the separate ones'; the outputs
compared. Needs CUDA (there is nothing to time on a CPU: Triton's interpreter runs the kernel
there). `--compile-only` compiles the kernel for NVIDIA targets with Triton's bundled ptxas, no
GPU needed, at the tiles `norm_linear` takes for each row count, and prints registers and stack
(spills) per thread; `--tiles` compiles those tiles instead (for a sweep). Needs no vLLM.
"""

from __future__ import annotations

import argparse
import sys

import torch

CALLS_PER_GRAPH = 20


def compile_only(archs: list[int], rows_list: list[int], hidden: int, qkv: int, inter: int,
                 tiles: list[int] | None = None) -> int:
    """Compile norm_gemm_kernel at each row count's tiles (or `tiles`) for both products; 1 if
    one fails."""
    import triton

    from vllm_ouroboros.kernels import norm_gemm as ng
    from vllm_ouroboros.kernels.triton_runtime import compile_report, not_compilable_reason, signature_of

    kernel = ng.norm_gemm_kernel
    if why := not_compilable_reason(kernel):
        print(why)
        return 1
    sig = signature_of(kernel, {**{p.name: "*bf16" for p in kernel.params if p.name.endswith("_ptr")},
                                "K_f": "fp32", "eps": "fp32"})
    rc = 0
    print(f"triton {triton.__version__}, bf16, K = {hidden}")
    for arch in archs:
        for rows in rows_list:
            for name, n_out, glu in (("qkv", qkv, False), ("gate_up", inter, True)):
                bm, bn, bk, warps = tiles or ng._tiles(rows, n_out)
                if tiles and glu:
                    bn *= 2  # gate_up takes twice qkv's column block, as _tiles does
                cs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_RESIDUAL=True, HAS_BIAS=not glu, GLU=glu,
                          DOT_PRECISION="tf32", UPCAST_DOT=False, SOFT_BF16=False, LIBDEVICE=True)
                _, usage, failed = compile_report(kernel, sig, cs, dict(num_warps=warps, enable_fp_fusion=False), arch)
                rc |= failed
                print(f"sm_{arch} {name:8s} rows {rows:3d} tiles {bm}x{bn}x{bk} warps {warps}: {usage}")
    return rc


def graph_us(fn, reps: int) -> float:
    """Median us per call of fn, CALLS_PER_GRAPH calls per graph replay (bench_gpu's capture
    and timer: each replay on an idle device, timed by CUDA events)."""
    from bench_gpu import cuda_graph, median, time_calls  # scripts/ is on sys.path

    def calls():
        for _ in range(CALLS_PER_GRAPH):
            fn()

    graph = cuda_graph(calls, None)
    return median(time_calls(graph.replay, torch.device("cuda"), 3, reps)) * 1e3 / CALLS_PER_GRAPH


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 34, 64])
    ap.add_argument("--hidden", type=int, default=896)  # Qwen2.5-0.5B's shapes
    ap.add_argument("--qkv", type=int, default=1152)
    ap.add_argument("--inter", type=int, default=4864)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--compile-only", type=int, nargs="*", metavar="SM")
    ap.add_argument("--tiles", type=int, nargs=4, metavar=("BLOCK_M", "BLOCK_N", "BLOCK_K", "WARPS"),
                    help="with --compile-only: these tiles (gate_up: twice BLOCK_N) for every row count")
    a = ap.parse_args()
    if a.compile_only is not None:
        return compile_only(a.compile_only or [90], a.rows, a.hidden, a.qkv, a.inter, a.tiles)
    if not torch.cuda.is_available():
        print("needs CUDA (or --compile-only)")
        return 1
    import torch.nn.functional as F

    from vllm_ouroboros.kernels.fused_ops import add_rms_norm, silu_mul
    from vllm_ouroboros.kernels.norm_gemm import norm_linear

    dev, dt, H = torch.device("cuda"), torch.bfloat16, a.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(dt)  # noqa: E731
    print(f"{torch.cuda.get_device_name()}, bf16, K = {H}; us per call from CUDA graphs "
          f"({CALLS_PER_GRAPH} calls per replay, median of {a.reps})")
    print("| product | rows | separate (norm, cuBLAS[, silu]) | fused | fused / separate | max |diff| |")
    print("|---|---:|---:|---:|---:|---:|")
    for rows in a.rows:
        for name, n_w, glu in (("qkv", a.qkv, False), ("gate_up", 2 * a.inter, True)):
            x, res, nw = rnd(rows, H), rnd(rows, H), 1 + rnd(H, scale=0.1)
            w, b = rnd(n_w, H, scale=H ** -0.5), None if glu else rnd(n_w)

            def separate():
                normed, h = add_rms_norm(x, res, nw, 1e-6)
                y = F.linear(normed, w, b)
                return silu_mul(y) if glu else y

            def fused():
                return norm_linear(x, res, nw, 1e-6, w, b, glu=glu)[0]

            diff = (separate().float() - fused().float()).abs().max().item()
            t_sep, t_fused = graph_us(separate, a.reps), graph_us(fused, a.reps)
            print(f"| {name} | {rows} | {t_sep:.1f} | {t_fused:.1f} | {t_fused / t_sep:.2f} | {diff:.3g} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
