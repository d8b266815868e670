"""Every kernel compiles for an NVIDIA target the way Triton's launcher compiles it for a call of
one row or one request: each int argument it specialises (not in `do_not_specialize`) equal to 1
becomes the constant 1, so an expression of such arguments alone is a Python int in the kernel.
The CPU interpreter never specialises: `(A * Q).to(tl.int32)` in the drafting round's prepare
kernel ran here for months and failed to compile on the first GPU call with one request
(H200, 2026-11-28). Triton's bundled ptxas compiles without a GPU. The scripts' --compile-only
tables (round_launches, bench_pool_ops, bench_norm_gemm, bench_sampled_verify,
bench_tree_attention) compile their kernels so too (triton_runtime.compile_report); the kernels
without a table are compiled here."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Run in a child process: a kernel imported under the interpreter (other test modules turn it on around
# their imports) is not a JITFunction and cannot be compiled.
PROGRAM = textwrap.dedent('''
    import triton
    import triton.language as tl

    from vllm_ouroboros.kernels import fused_ops as fo, kv_move as km, round_steps as rs
    from vllm_ouroboros.kernels import pool_insert as pi
    from vllm_ouroboros.kernels.triton_runtime import compile_report, ones_specialised, signature_of

    def ptrs(k, t):
        return {p.name: t for p in k.params if p.name.endswith("_ptr")}

    # What ones_specialised makes constant: A (the prepare kernel's rows), not N (the pool's rows
    # kernel keeps it out of the specialisation), not a pointer or a constexpr.
    sig, consts = ones_specialised(rs.prepare_kernel, signature_of(rs.prepare_kernel, {"A": "i32"}, "*i64"),
                                   {"U": 5})
    print("prepare A", sig["A"], consts["A"], "U", consts["U"], "unc_ptr", sig["unc_ptr"])
    sig, _ = ones_specialised(pi.rows_kernel, signature_of(pi.rows_kernel, {"N": "i32", "V": "i32"}, "*i64"), {})
    print("rows N", sig["N"], "V", sig["V"])

    @triton.jit
    def broken(out_ptr, A, Q: tl.constexpr):  # the prepare kernel's old line, alone
        b = tl.program_id(0)
        if b == A - 1:
            tl.store(out_ptr + A, (A * Q).to(tl.int32))

    cases = [
        ("broken", broken, {"out_ptr": "*i32", "A": "i32"}, dict(Q=4), {}),
        ("add_rms_norm", fo.add_rms_norm_kernel,
         {**ptrs(fo.add_rms_norm_kernel, "*bf16"), "hidden_f": "fp32", "eps": "fp32"},
         dict(BLOCK=1024, HAS_RESIDUAL=True, SOFT_BF16=False, LIBDEVICE=True), dict(enable_fp_fusion=False)),
        ("rope_qkv_write", fo.rope_qkv_write_kernel,
         {**ptrs(fo.rope_qkv_write_kernel, "*bf16"), "write_index_ptr": "*i64"},
         dict(NUM_HEADS=14, NUM_KV_HEADS=2, HEAD_DIM=64, HQ_PAD=16, HKV_PAD=2, HALF_PAD=32, SOFT_BF16=False,
              PTX_RN=True), dict(enable_fp_fusion=False)),
        ("silu_mul", fo.silu_mul_kernel, ptrs(fo.silu_mul_kernel, "*bf16"),
         dict(BLOCK=1024, SOFT_BF16=False, LIBDEVICE=True), dict(enable_fp_fusion=False)),
    ] + [
        (f"kv_slots to_buf={to_buf}", km.kv_slots_kernel,
         {**ptrs(km.kv_slots_kernel, "*bf16"), "offsets_ptr": "*i64", "slots_ptr": "*i64"},
         dict(BLOCK_SIZE=16, H=2, D=128, BLOCK_H=2, BLOCK_D=128, TO_BUF=to_buf), {})
        for to_buf in (True, False)]
    for name, kernel, types, consts, opts in cases:
        _, usage, failed = compile_report(kernel, signature_of(kernel, types), consts, dict(num_warps=4, **opts), 90)
        print(f"sm_90 {name}: {usage}")
''')


def test_kernels_compile_with_their_ints_at_one(tmp_path):
    spec = importlib.util.find_spec("triton")
    tools = Path(spec.origin).parent / "backends" / "nvidia" / "bin" if spec else None
    if tools is None or not all((tools / t).exists() for t in ("ptxas", "cuobjdump")):
        pytest.skip(f"this Triton has no bundled ptxas and cuobjdump (looked in {tools})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    program = tmp_path / "compile_ones.py"  # @triton.jit needs its source in a file
    program.write_text(PROGRAM)
    proc = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "prepare A constexpr 1 U 5 unc_ptr *i64" in out and "rows N i32 V constexpr" in out, out
    lines = {ln.split(":")[0]: ln for ln in out.splitlines() if ln.startswith("sm_90 ")}
    # the check fails where it should: the one-request form of the old prepare-kernel line
    assert "FAILED with its int arguments 1" in lines["sm_90 broken"], out
    kernels = [k for k in lines if k != "sm_90 broken"]
    assert len(kernels) == 5 and all("REG:" in lines[k] for k in kernels), out
