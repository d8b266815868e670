"""Tree attention (Triton, paged KV, ancestor bitmask) vs dense causal attention at equal token counts.

    python scripts/bench_tree_attention.py [--batch 1 8 32] [--prefix 512 2048 8192] [--tree 16 32 64]
        [--head-dim 64 128] [--q-heads 32] [--kv-heads 8] [--block-size 16] [--dtype bfloat16]
        [--splits S] [--graph] [--no-tune-splits]

Per configuration: B requests, each with a prefix of P cached tokens and a tree of N nodes (a draft
chain of N/2 plus suffix chains off its last node, the Ouroboros shape). The kernel reads the paged
cache; the baselines get the same N query tokens per request over the same P + N keys as dense
[B, L, H, D] tensors with a bottom-right causal mask: torch SDPA, and flash-attn when importable.
Timed with CUDA events after warmup (mean of a batch of back-to-back calls, best of 5); the kernel's
time includes its host wrapper (shape checks, launches). `--graph` adds both replayed from CUDA
graphs: device time alone, what a captured forward pays. Per configuration: S, the number of
prefix splits (split-KV) the wrapper's heuristic picked (or `--splits S`), the kernel's time with
it, and, where S > 1, the single-pass (S = 1) time beside it, so the heuristic can be checked.
Before the table the heuristic's thresholds are measured on this GPU for each head dim
(kernels/split_tuning.py), as the plugin measures them for its shapes when it checks the kernel at
load; `--no-tune-splits` keeps the shipped ones.
Each configuration is also checked against the plain-torch reference. Without a GPU, runs one tiny
case under Triton's interpreter (single pass and split) and exits 0.
`--compile-only [SM ...]` needs no GPU: it builds cubins with Triton's bundled ptxas for the tile
configurations the wrapper picks (single-pass and split variants, and the merge kernel) and prints
registers and stack (spill) bytes per thread.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import shlex
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "--compile-only" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel import (read by @triton.jit)

from vllm_ouroboros.kernels import tree_attention as ta  # noqa: E402
from vllm_ouroboros.kernels.reference import tree_attention_reference  # noqa: E402
from vllm_ouroboros.kernels.tree_attention import ancestor_bitmask, tree_attention  # noqa: E402


def ouroboros_parents(n: int, suffixes: int = 3) -> list[int]:
    chain = max(1, n // 2)
    parents = [-1] + list(range(chain - 1))
    k = 0
    while len(parents) < n:
        length = -(-(n - chain) // suffixes) if k < suffixes - 1 else n - len(parents)
        length = min(length, n - len(parents))
        parents += [chain - 1] + [len(parents) + t for t in range(length - 1)]
        k += 1
    return parents


def make_inputs(batch, prefix, tree, head_dim, hq, hkv, block_size, dtype, device):
    """Paged inputs for the kernel and the same tokens as dense tensors for the baselines."""
    length = prefix + tree
    pages_per_req = -(-length // block_size)
    num_blocks = batch * pages_per_req
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device=device).int().reshape(batch, pages_per_req)
    parents = torch.tensor([ouroboros_parents(tree)] * batch, device=device)
    num_nodes = torch.full((batch,), tree, device=device)
    kernel_args = dict(
        q=torch.randn(batch * tree, hq, head_dim, dtype=dtype, device=device),
        k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        prefix_lens=torch.full((batch,), prefix, dtype=torch.int32, device=device),
        query_start=torch.arange(0, batch * tree + 1, tree, dtype=torch.int32, device=device),
        tree_mask=ancestor_bitmask(parents, num_nodes, total=batch * tree),
        scale=head_dim ** -0.5,
    )
    pos = torch.arange(length, device=device)
    pages = block_table.long()[:, pos // block_size]  # [B, L]
    dense_k = k_cache[pages, pos % block_size]  # [B, L, Hkv, D]
    dense_v = v_cache[pages, pos % block_size]
    dense_q = kernel_args["q"].reshape(batch, tree, hq, head_dim)
    return kernel_args, dense_q, dense_k, dense_v


def time_ms(fn, warmup=10, reps=50, rounds=5) -> float:
    """ms per call launched back to back (vllm_ouroboros.cuda_graph.time_calls_ms): the host's
    wrapper and launches included where the device waits for them."""
    from vllm_ouroboros.cuda_graph import time_calls_ms

    return time_calls_ms(fn, warmup, reps, rounds)


def time_graph_ms(fn, calls=20, rounds=5) -> float | None:
    """Device time per call replayed from a CUDA graph (vllm_ouroboros.cuda_graph.time_graph_ms);
    None where fn cannot be captured. The host's part of a call (the Python wrapper, Triton's
    launcher) drops out: what a call costs inside a captured forward, or wherever the GPU, not
    the host, is the bottleneck. time_ms keeps the host."""
    from vllm_ouroboros.cuda_graph import time_graph_ms as graph_ms

    try:
        return graph_ms(fn, calls, rounds)
    except Exception:  # noqa: BLE001 - a baseline torch cannot capture: no graph column
        torch.cuda.synchronize()
        return None


def sdpa_fn(dense_q, dense_k, dense_v, scale):
    """Bottom-right causal SDPA over [B, H, S, D]; GQA natively when torch supports it with a
    CausalBias, else K/V expanded beforehand (outside the timing)."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q = dense_q.transpose(1, 2)
    k, v = dense_k.transpose(1, 2), dense_v.transpose(1, 2)
    mask = causal_lower_right(q.shape[2], k.shape[2])
    try:
        sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return (lambda: sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)), "gqa"
    except Exception:  # noqa: BLE001 - older torch: no enable_gqa with CausalBias
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1).contiguous(), v.repeat_interleave(group, 1).contiguous()
        return (lambda: sdpa(q, k, v, attn_mask=mask, scale=scale)), "expanded kv"


def flash_fn(dense_q, dense_k, dense_v, scale):
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return lambda: flash_attn_func(dense_q, dense_k, dense_v, softmax_scale=scale, causal=True)


def cpu_smoke() -> int:
    print("no CUDA device: this benchmark needs a GPU. Running one tiny correctness case under "
          "TRITON_INTERPRET=1 instead (--compile-only checks the GPU build without a GPU).")
    torch.manual_seed(0)
    args, _, _, _ = make_inputs(batch=2, prefix=21, tree=9, head_dim=32, hq=4, hkv=2, block_size=16,
                                dtype=torch.float32, device="cpu")
    ref = tree_attention_reference(**args)
    worst = 0.0
    for splits in (1, 3):  # the single pass, and split-KV with its merge kernel
        err = (tree_attention(**args, backend="triton", num_splits=splits) - ref).abs().max().item()
        worst = max(worst, err)
        print(f"interpreter: B=2 prefix=21 tree=9 D=32 Hq=4 Hkv=2 block=16 fp32 S={splits}: "
              f"max abs err {err:.2e}")
    print("S the wrapper would pick on a 132-SM H100 for issue 15's grid (Hq 32, Hkv 8, bf16, "
          "block 16, block table as wide as prefix + tree), prefix 512 / 2048 / 8192, with the shipped "
          "thresholds (on a GPU they are measured first: kernels/split_tuning.py):")
    for d, b, n in itertools.product((64, 128), (1, 8, 32), (16, 64)):
        picks = []
        for p in (512, 2048, 8192):
            bound = -(-(p + n) // 16) * 16
            cfg, nq, _ = ta._launch_plan(torch.bfloat16, 32, 8, d, b, n, bound, torch.device("cpu"), 1)
            picks.append(ta.choose_num_splits(b, 8, nq, 132, bound, cfg["BLOCK_N"]))
        print(f"  D={d:<3} B={b:<2} tree={n:<2}: S = {' / '.join(map(str, picks))}")
    return 0 if worst <= 1e-3 else 1


def _signature(kernel, ptr: str) -> dict:
    """Triton types of `kernel`'s arguments for ASTSource: `ptr` for the attention tensors, i32
    for the strides, num_splits, ml_offset and batch."""
    from vllm_ouroboros.kernels.triton_runtime import signature_of

    types = {p.name: "*i32" for p in kernel.params if p.name.endswith("_ptr")}
    types |= dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr", "qkv_ptr", "cos_ptr", "sin_ptr"), ptr)
    types |= {"part_ptr": "*fp32", "tree_mask_ptr": "*i64", "write_index_ptr": "*i64", "scale_log2e": "fp32"}
    return signature_of(kernel, types)


def compile_only(archs: list[int]) -> int:
    """Compile the kernels for NVIDIA targets without a GPU (Triton's bundled ptxas) over the tile
    configurations the wrapper picks, single-pass and split, and the merge kernel, and print
    registers / stack (spills) per thread."""
    from vllm_ouroboros.kernels.triton_runtime import compile_report, not_compilable_reason

    kernel = ta.tree_attention_kernel
    if why := not_compilable_reason(kernel):
        print(why)
        return 1
    ptr_of = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}

    def build(fn, sig, consts, opts, arch) -> tuple[str, str, int]:
        c, usage, failed = compile_report(fn, sig, consts, opts, arch)
        return usage, "      -" if c is None else f"{c.metadata.shared / 1024:7.0f}", failed

    print(f"{'arch':>5} {'dtype':>8} {'G':>2} {'D':>4} {'tree':>4} {'M':>3} {'BN':>3} {'BT':>3} {'warps':>5} "
          f"{'split':>5} {'rope':>4} {'smem KB':>7}  resource usage")
    rc = 0
    for arch in archs:
        # The target's configurations, then the draft's (Qwen2.5-Coder 0.5B: 14 / 2 heads, D = 64;
        # decode, the 34-token lookahead and 64 nodes) with RoPE and the KV write inside (ROPE_IN).
        for dtype, group, head_dim, tree, rope in [
                ("bfloat16", 4, 128, 64, False), ("bfloat16", 4, 128, 16, False),
                ("bfloat16", 1, 128, 16, False), ("bfloat16", 4, 64, 64, False),
                ("bfloat16", 4, 64, 16, False), ("float16", 8, 64, 32, False),
                ("bfloat16", 4, 80, 24, False), ("bfloat16", 4, 256, 32, False),
                ("float32", 4, 128, 32, False), ("float32", 1, 64, 8, False),
                ("bfloat16", 7, 64, 1, True), ("bfloat16", 7, 64, 34, True), ("bfloat16", 7, 64, 64, True),
                ("bfloat16", 6, 128, 34, True)]:
            head_dim_pad = max(16, ta._next_pow2(head_dim))
            cfg = ta._tile_config(getattr(torch, dtype), ta._next_pow2(group), head_dim_pad, tree)
            opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
            for split in (False, True):
                consts = dict(cfg, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, SPLIT_KV=split,
                              UPCAST_DOT=False, ROPE_IN=rope, SOFT_BF16=False, PTX_RN=True)
                usage, smem, bad = build(kernel, _signature(kernel, ptr_of[dtype]), consts, opts, arch)
                rc |= bad
                print(f"{arch:>5} {dtype:>8} {group:>2} {head_dim:>4} {tree:>4} {cfg['BLOCK_M']:>3} "
                      f"{cfg['BLOCK_N']:>3} {cfg['BLOCK_TREE']:>3} {opts['num_warps']:>5} "
                      f"{'S>1' if split else 'S=1':>5} {'yes' if rope else 'no':>4} {smem}  {usage}",
                      flush=True)
        merge = ta.tree_attention_merge_kernel
        for dtype, head_dim, splits in [("bfloat16", 64, 16), ("bfloat16", 128, 16),
                                        ("bfloat16", 128, 64), ("bfloat16", 256, 64)]:
            head_dim_pad, splits_pad = max(16, ta._next_pow2(head_dim)), ta._next_pow2(splits)
            warps = ta._merge_warps(splits_pad, head_dim_pad)
            consts = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=splits_pad)
            usage, smem, bad = build(merge, _signature(merge, ptr_of[dtype]), consts,
                                     {"num_warps": warps}, arch)
            rc |= bad
            print(f"{arch:>5} {dtype:>8} merge D={head_dim} S<={splits_pad} warps={warps} {smem}  {usage}",
                  flush=True)
    return rc


def bench_one(b: int, p: int, n: int, d: int, a: argparse.Namespace, dtype: torch.dtype) -> str:
    args, dq, dk, dv = make_inputs(b, p, n, d, a.q_heads, a.kv_heads, a.block_size, dtype, "cuda")
    out = torch.empty_like(args["q"])
    q, bt = args["q"], args["block_table"]
    # The S the wrapper picks for this call (from the same host values), or --splits; the timed call
    # runs the heuristic itself, as a caller's would.
    _, _, splits = ta._launch_plan(dtype, a.q_heads, a.kv_heads, d, b, n, bt.shape[1] * a.block_size,
                                   q.device, a.splits, None, a.block_size)
    t_kernel = time_ms(lambda: tree_attention(**args, out=out, max_query_len=n, num_splits=a.splits))
    t_single = float("nan")
    if splits > 1:
        t_single = time_ms(lambda: tree_attention(**args, out=out, max_query_len=n, num_splits=1))
    sdpa, mode = sdpa_fn(dq, dk, dv, args["scale"])
    t_sdpa = time_ms(sdpa)
    fl = flash_fn(dq, dk, dv, args["scale"])
    t_flash = time_ms(fl) if fl is not None else float("nan")
    graph = ""
    if a.graph:
        g_kernel = time_graph_ms(lambda: tree_attention(**args, out=out, max_query_len=n, num_splits=a.splits))
        g_sdpa = time_graph_ms(sdpa)
        ratio = g_kernel / g_sdpa if g_kernel and g_sdpa else float("nan")
        graph = f" {g_kernel or float('nan'):>9.4f} {g_sdpa or float('nan'):>9.4f} {ratio:>6.2f}"
    err = float("nan")
    if not a.no_check:
        tree_attention(**args, out=out, max_query_len=n, num_splits=a.splits)
        ref = tree_attention_reference(**args)
        err = (out.float() - ref.float()).abs().max().item()
    return (f"{b:>5} {p:>6} {n:>4} {d:>4} {splits:>3} {t_kernel:>10.4f} {t_single:>9.4f} {t_sdpa:>9.4f} "
            f"{t_kernel / t_sdpa:>6.2f} {t_flash:>9.4f} {t_kernel / t_flash:>6.2f}{graph} {err:>8.1e}  {mode}")


def measure_split_rules(d: int, dtype: torch.dtype, q_heads: int, kv_heads: int, block_size: int,
                        trees: tuple[int, ...], modes: tuple[bool, ...]) -> dict:
    """The split rules for these shapes, measured and registered on the current GPU as the plugin's
    kernel check does at load (kernels/split_tuning.tune_splits; modes: True graph-replayed,
    False eager): {mode: SplitRule} of those measured."""
    from vllm_ouroboros.kernels.split_tuning import tune_splits

    blocks = -(-256 // block_size)  # the measured prefixes map onto these pages (only read)
    kv = torch.randn(2, blocks, block_size, kv_heads, d, device="cuda").to(dtype)
    return tune_splits(kv[0], kv[1], q_heads, nodes=trees, modes=modes)


def tune_split_rules(a: argparse.Namespace, d: int, dtype: torch.dtype) -> str:
    """`measure_split_rules` for head dim d at this run's shapes (eager; graph-replayed too with
    --graph); one line."""
    rules = measure_split_rules(d, dtype, a.q_heads, a.kv_heads, a.block_size, tuple(a.tree),
                                (False, True) if a.graph else (False,))
    return "; ".join(f"{'graph' if g else 'eager'}: split from {r.min_prefix} tokens, chunks >= {r.min_chunk}"
                     for g, r in rules.items()) or "split rules not measured (see the log): shipped thresholds"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefix", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--tree", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with the reference")
    ap.add_argument("--splits", type=int, default=None, metavar="S",
                    help="force S prefix splits (1 = single pass) instead of the wrapper's heuristic")
    ap.add_argument("--no-tune-splits", action="store_true",
                    help="keep the shipped split thresholds instead of measuring them first on this GPU, "
                         "as the plugin does at load (kernels/split_tuning.py)")
    ap.add_argument("--graph", action="store_true",
                    help="also time kernel and SDPA replayed from CUDA graphs (device time, no host "
                         "wrapper): three more columns")
    ap.add_argument("--compile-only", type=int, nargs="*", metavar="SM",
                    help="no GPU needed: compile for these sm versions (default 80 90), print register use")
    a = ap.parse_args()

    print("# " + " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv))
    if a.compile_only is not None:
        return compile_only(a.compile_only or [80, 90])
    if not HAS_CUDA:
        return cpu_smoke()
    dtype = getattr(torch, a.dtype)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"Hq={a.q_heads} Hkv={a.kv_heads} block={a.block_size} {a.dtype}")
    flash_note = "" if importlib.util.find_spec("flash_attn") else " (flash-attn not importable)"
    print(f"# ms: CUDA events, best of 5 rounds of 50 calls after 10 warmup{flash_note}")
    print("# S: prefix splits used (heuristic unless --splits); ms S=1: the single pass, timed "
          "where S > 1; ratio: kernel / SDPA, then kernel / flash-attn"
          + ("; graph: 20 calls in one CUDA graph, ms per call (device time)" if a.graph else ""))
    graph_cols = f" {'graph krn':>9} {'graph SDPA':>9} {'ratio':>6}" if a.graph else ""
    header = (f"{'batch':>5} {'prefix':>6} {'tree':>4} {'D':>4} {'S':>3} {'ms kernel':>10} {'ms S=1':>9} "
              f"{'ms SDPA':>9} {'ratio':>6} {'ms flash':>9} {'ratio':>6}{graph_cols} {'max err':>8}  sdpa mode")
    for d in a.head_dim:
        if a.splits is None and not a.no_tune_splits:
            print(f"# D={d}: " + tune_split_rules(a, d, dtype))
    print(header)
    for d in a.head_dim:
        for b in a.batch:
            for p in a.prefix:
                for n in a.tree:
                    print(bench_one(b, p, n, d, a, dtype), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
