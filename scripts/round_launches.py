"""Kernel launches per draft forward of a device round, by part, with the round's work around each
forward in torch or in its kernels (kernels/round_steps.py).

A graph-replayed round on a GPU pays about 2 us of device time per kernel node however small
the kernel (H200: 5,762 activities in 13.7 ms per W = G = 4 round, results/README.md, "Session
of 2026-11-27 (fourth)"), so the launches a forward carries bound its time from below. This counts
them on any machine: the device round run eagerly at one request (scripts/bench_gpu.py's
RoundRunner, random weights; --tiny: 2-layer shapes), every ATen call that launches (views and
allocations do not) and every Triton launch, charged to the innermost part running:

  model layers   DraftModel.forward (embedding, RoPE rows, layers, final norm)
  LM head        DraftModel.greedy_tokens
  pool           PhrasePool.lookup / insert
  round          everything else in the round's functions: inputs, masks, bookkeeping

Pool, fused layers and tree attention run through their Triton kernels in every form (as on
CUDA); the form "triton+norm-gemm" is the round's kernels with the layers' RMSNorm and SiLU*up
inside the products (kernels/norm_gemm.py, OuroborosConfig.draft_norm_gemm). On a CPU the
script sets TRITON_INTERPRET=1 itself, so Triton's interpreter runs the
kernels; only the counts mean anything there, not the time.

    python scripts/round_launches.py [--tiny] [--window 4] [--guesses 4] [--rounds 2]
    python scripts/round_launches.py --compile-only [90 80]   # the kernels for sm_90 / sm_80, no GPU

--compile-only compiles kernels/round_steps.py's two kernels for NVIDIA targets with Triton's
bundled ptxas (W = G = 4 and W = G = 7, beta 5) and prints registers and stack (spills) per thread.

No vLLM imports.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# ATen calls that launch nothing: views and allocations (as scripts/bench_pool_ops.py counts)
_NO_LAUNCH = {"view", "expand", "slice", "select", "unsqueeze", "squeeze", "alias", "_unsafe_view", "t",
              "permute", "detach", "unbind", "scalar_tensor", "empty", "empty_like", "empty_strided",
              "transpose", "as_strided", "split", "split_with_sizes", "lift_fresh", "reshape"}
PARTS = ("round", "model layers", "LM head", "pool")


class Counts:
    """Launches by part; `part(name)` wraps a function so that its launches count there."""

    def __init__(self):
        self.stack = ["round"]
        self.aten, self.triton = Counter(), Counter()
        self.inside_triton = 0

    def part(self, name, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            self.stack.append(name)
            try:
                return fn(*a, **k)
            finally:
                self.stack.pop()
        return run

    def triton_run(self, run):
        @functools.wraps(run)
        def launch(*a, **k):
            self.triton[self.stack[-1]] += 1
            self.inside_triton += 1  # what the interpreter runs inside a launch is not ours
            try:
                return run(*a, **k)
            finally:
                self.inside_triton -= 1
        return launch


def count_round(setting: tuple[int, int], round_kernels: str, tiny: bool, rounds: int,
                norm_gemm: bool = False) -> dict:
    """Launches per forward by part (ATen, Triton) of `rounds` eager device rounds at one request;
    norm_gemm: the layers with RMSNorm and SiLU*up inside the products (kernels/norm_gemm.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import bench_gpu as bg
    from vllm_ouroboros.draft import runtime as rt_mod
    from vllm_ouroboros.draft.model import DraftModel
    from vllm_ouroboros.pool import PhrasePool

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, _ = bg.load_model("draft", None, tiny, dtype, dev)
    counts = Counts()
    patches = [(DraftModel, "forward", "model layers"), (DraftModel, "greedy_tokens", "LM head"),
               (PhrasePool, "lookup", "pool"), (PhrasePool, "insert", "pool")]
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in patches]
    saved += [(cls, "run", cls.run) for cls in (InterpretedFunction, JITFunction)]
    settings_init = rt_mod.DraftSettings.__init__

    def settings(self, *a, **k):  # the runner's settings, with this form's round kernels
        settings_init(self, *a, **k)
        self.round_kernels = round_kernels

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not counts.inside_triton and func.overloadpacket.__name__ not in _NO_LAUNCH:
                counts.aten[counts.stack[-1]] += 1
            return func(*args, **(kwargs or {}))

    W, G = setting
    plan = bg.Plan(tiny=True)  # sizes of the contexts (64 tokens) and the runner's rounds
    plan.warmup_rounds, plan.timed_rounds = 1, rounds
    try:
        rt_mod.DraftSettings.__init__ = settings
        runner = bg.RoundRunner(model, W, G, 1, "device+fused", plan, seed=0)
        # The tree-attention kernel, as "auto" takes it on CUDA for forwards of <= 64 tokens per
        # row (set after the runner's first round, which prefills longer stretches).
        model.attention_backend = "triton"
        model.norm_gemm = norm_gemm
        if dev.type != "cuda":  # the pool's kernels as CUDA runs them (here under the interpreter)
            pool = runner.rt.pool
            pool._insert_kernels = pool._pick_kernel("insert", "triton")
            pool._lookup_kernel = pool._pick_kernel("lookup", "triton")
        runner.run()  # warm-up: compiles, caches layouts
        for cls, attr, name in patches:
            setattr(cls, attr, counts.part(name, getattr(cls, attr)))
        for cls in (InterpretedFunction, JITFunction):
            cls.run = counts.triton_run(cls.run)
        forwards = 0
        with Count():
            for _ in range(rounds):
                forwards += runner.run().forwards
    finally:
        rt_mod.DraftSettings.__init__ = settings_init
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)
    return {"forwards": forwards, "kernels": runner.rt.device_round.kernels,
            "parts": {p: ((counts.aten[p] + counts.triton[p]) / forwards, counts.triton[p] / forwards)
                      for p in PARTS}}


def compile_only(archs: list[int]) -> int:
    """Compile both kernels for each arch and setting; print registers / stack; 1 if one fails."""
    import triton

    from vllm_ouroboros.kernels import round_steps as rs
    from vllm_ouroboros.kernels.triton_runtime import compile_report, not_compilable_reason, signature_of

    if why := not_compilable_reason(rs.commit_kernel):
        print(why)
        return 1
    i32 = {"unc_stride", "u_stride", "MP", "page_size", "A", "drafts_stride"}
    bools = {"gvalid_ptr", "active_ptr", "ins_valid_ptr"}
    int32_ptrs = {"block_table_ptr", "lens_ptr", "query_start_ptr", "block_rows_ptr"}
    rc = 0
    print(f"triton {triton.__version__}")
    for arch in archs:
        for W, G, U in ((4, 4, 5), (7, 7, 5), (0, 0, 8), (0, 0, 1)):  # (0, 0, 1): a decode step
            L = 4
            Q = U + (W + G) * L
            consts = dict(U=U, W=W, WA=max(W, 1), L=L, G=G, Q=Q, BLOCK_Q=triton.next_power_of_2(Q), BLOCK_P=64,
                          MAX_DRAFT=9, GOAL=4, BLOCK_T=triton.next_power_of_2(L + 1),
                          BLOCK_G=triton.next_power_of_2(max(G, 1)), BLOCK_W=triton.next_power_of_2(max(W, 1)))
            for kernel in (rs.prepare_kernel, rs.commit_kernel):
                sig = signature_of(kernel, {**dict.fromkeys(i32, "i32"), **dict.fromkeys(bools, "*i1"),
                                            **dict.fromkeys(int32_ptrs, "*i32")}, default="*i64")
                cs = {p.name: consts[p.name] for p in kernel.params if p.is_constexpr}
                _, usage, failed = compile_report(kernel, sig, cs, dict(num_warps=1), arch)
                rc |= failed
                print(f"sm_{arch} {kernel.fn.__name__} W={W} G={G} U={U} num_warps=1: {usage}")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="2-layer shapes (the parts outside the layers "
                    "do not depend on the shapes; the layers' count scales with the layers)")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--guesses", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile-only", type=int, nargs="*", metavar="SM",
                    help="compile the round's kernels for these NVIDIA archs (default 90) and stop")
    a = ap.parse_args()
    if a.compile_only is not None:
        return compile_only(a.compile_only or [90])
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    settings = [(0, 0), (a.window, a.guesses)]
    print(f"device {'cuda' if torch.cuda.is_available() else 'cpu (Triton interpreter)'}, "
          f"{'tiny' if a.tiny else 'real-pair draft'} shapes, 1 request, eager device round, "
          "launches per forward (of which Triton)")
    print("| setting | round work in | " + " | ".join(PARTS) + " | all |")
    print("|---|---|" + "---|" * (len(PARTS) + 1))
    for W, G in settings:
        for form in ("torch", "triton", "triton+norm-gemm"):
            r = count_round((W, G), form.split("+")[0], a.tiny, a.rounds, norm_gemm=form.endswith("+norm-gemm"))
            if r["kernels"] != form.split("+")[0]:
                raise SystemExit(f"the round took {r['kernels']} where {form} was asked")
            cells = [f"{n:.1f} ({t:.1f})" for n, t in r["parts"].values()]
            total = sum(n for n, _ in r["parts"].values())
            print(f"| {'decode' if not W and not G else f'W={W} G={G}'} | {form} | " + " | ".join(cells)
                  + f" | {total:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
