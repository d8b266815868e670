"""Fused elementwise kernels of the draft decoder layer (Triton), rounding as the torch code does.

A graph-captured draft forward is launch-bound: about 36 small kernels per layer, against 4 GEMMs
and one attention. With these three a layer becomes

    add_rms_norm -> qkv GEMM -> rope_qkv_write -> attention -> o GEMM
                 -> add_rms_norm -> gate_up GEMM -> silu_mul -> down GEMM

(the residual add of each sub-block is folded into the next norm, the last one into the final norm).

Every kernel reproduces the rounding sequence of the eager torch code in draft/model.py, not just
its value: each torch op on bf16/fp16 computes in fp32 and rounds its result to the tensor dtype,
so the kernels compute in fp32 and round to the input dtype at exactly the same points. Where each
op is correctly rounded (residual add, RoPE, KV write; the `* weight` and `* up` products given
their inputs), results are bit-identical to torch in every dtype. What cannot be is said where it
happens: the RMS reduction order, and exp / rsqrt, whose fp32 last bit is the library's (Sleef in
CPU torch, numpy in the interpreter, libdevice on CUDA, which torch's CUDA kernels also call).

Kernels launch with `enable_fp_fusion=False`: torch's eager ops round every product, and an FMA
contracted from `x * cos + rot * sin` would not (fp32 RoPE would then differ in the last bit).
The tree-attention kernel runs `_rope_half` inside its launch (ROPE_IN) with fusion on, for its
softmax: there the RoPE itself rounds in inline PTX (PTX_RN), which nothing contracts.

Triton's CPU interpreter (3.9) rounds fp32 -> bf16 casts by truncation, not to nearest even; under
the interpreter only, bf16 results are rounded in integer arithmetic first (`_round_to`,
SOFT_BF16), which is what the hardware cast does on CUDA.

In this file, in order: the Triton kernels, their checked host wrappers (`add_rms_norm`,
`rope_qkv_write`, `silu_mul`), and the plain-torch references (`*_reference`, model.py's math).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from .triton_runtime import import_triton, pick_kernel
from .triton_runtime import is_interpreted as _is_interpreted

logger = logging.getLogger("vllm.ouroboros")

triton, tl, _TRITON_IMPORT_ERROR = import_triton()
if triton is not None:
    from triton.language.extra import libdevice
else:  # pragma: no cover
    libdevice = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NORM_HIDDEN = 16384  # one row per program, held in registers: the block is next_pow2(H)
MAX_HEAD_DIM = 256
SILU_BLOCK = 1024  # columns of the output per program

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _round_to(x, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
        # fp32 -> dtype, round to nearest even (what torch does when it stores an op's result).
        if SOFT_BF16:
            # Interpreter only: its fp32 -> bf16 cast truncates. Add half an ulp of bf16 (minus
            # one when the kept lsb is 0: ties to even) and cut the low 16 bits; the cast is then
            # exact. NaN passes through unchanged (the carry could turn it into inf).
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
            y = tl.where(x != x, x, rounded).to(dtype)
        else:
            y = x.to(dtype)
        return y

    @triton.jit
    def _rsqrt(x, LIBDEVICE: tl.constexpr):
        # torch's CUDA rsqrt is CUDA's rsqrtf, i.e. libdevice's; its CPU rsqrt is 1 / sqrt(x),
        # which is what the interpreter computes for tl.rsqrt.
        if LIBDEVICE:
            y = libdevice.rsqrt(x)
        else:
            y = tl.rsqrt(x)
        return y

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        # torch's CUDA silu calls expf (libdevice's); tl.exp on CUDA is the faster but coarser
        # ex2.approx(x * log2 e). The interpreter's tl.exp is numpy's.
        if LIBDEVICE:
            y = libdevice.exp(x)
        else:
            y = tl.exp(x)
        return y

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        stride_x, stride_res, stride_out, stride_res_out,
        hidden, hidden_f, eps,       # hidden_f: float(hidden); a float argument is never specialised
        BLOCK: tl.constexpr,         # next power of two >= hidden
        HAS_RESIDUAL: tl.constexpr,
        SOFT_BF16: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        # One program per row: the whole row sits in registers, so the sum of squares needs no
        # second pass over memory.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < hidden
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + offs, mask=ok, other=0.0)
            # torch's `h + delta` in the model dtype: fp32 add, one rounding.
            h = _round_to(x.to(tl.float32) + r.to(tl.float32), dtype, SOFT_BF16)
            tl.store(res_out_ptr + row * stride_res_out + offs, h, mask=ok)
        else:
            h = x
        hf = h.to(tl.float32)
        # Padding lanes are 0 and add nothing. div_rn: Triton's fp32 `/` is approximate on CUDA.
        mean_sq = tl.div_rn(tl.sum(hf * hf, axis=0), hidden_f)
        normed = _round_to(hf * _rsqrt(mean_sq + eps, LIBDEVICE), dtype, SOFT_BF16)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        # `weight * normed.to(dtype)`: the product of two bf16/fp16 values is exact in fp32.
        out = _round_to(w.to(tl.float32) * normed.to(tl.float32), dtype, SOFT_BF16)
        tl.store(out_ptr + row * stride_out + offs, out, mask=ok)

    @triton.jit
    def _mul_rn(a, b, PTX_RN: tl.constexpr):
        # fp32 a * b rounded once, never contracted into an FMA with a later add (inline PTX is
        # opaque to LLVM and ptxas; libdevice's mul_rn would do it too, but Triton links libdevice
        # with flush-to-zero, which torch's kernels do not use).
        if PTX_RN:
            y = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            y = a * b
        return y

    @triton.jit
    def _add_rn(a, b, PTX_RN: tl.constexpr):
        if PTX_RN:
            y = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            y = a + b
        return y

    @triton.jit
    def _rope_half(x, rot, c, s, dtype: tl.constexpr, SOFT_BF16: tl.constexpr, PTX_RN: tl.constexpr):
        # torch's `x * cos + rot * sin`: both products rounded to dtype, then the sum rounded.
        # PTX_RN (compiled for NVIDIA): in mul.rn / add.rn, so that a launch with fp fusion on (the
        # tree-attention kernel's, for its softmax) cannot make it x * cos + rot * sin with one
        # rounding fewer, which torch's eager ops never compute (fp32, and bf16 once LLVM narrows
        # the ops: on an H200 every ROPE_IN case was off by an ulp or two before this).
        a = _round_to(_mul_rn(x, c, PTX_RN), dtype, SOFT_BF16).to(tl.float32)
        b = _round_to(_mul_rn(rot, s, PTX_RN), dtype, SOFT_BF16).to(tl.float32)
        return _round_to(_add_rn(a, b, PTX_RN), dtype, SOFT_BF16)

    @triton.jit
    def rope_qkv_write_kernel(
        qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, write_index_ptr, q_out_ptr,
        stride_xb, stride_xq,
        stride_cb, stride_cq, stride_sb, stride_sq,
        stride_kc_p, stride_kc_r, stride_kc_h,
        stride_vc_p, stride_vc_r, stride_vc_h,
        stride_wb, stride_wq,
        num_pages, page_size,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HQ_PAD: tl.constexpr,        # next power of two >= NUM_HEADS
        HKV_PAD: tl.constexpr,       # next power of two >= NUM_KV_HEADS
        HALF_PAD: tl.constexpr,      # next power of two >= HEAD_DIM // 2 (40 -> 64, masked)
        SOFT_BF16: tl.constexpr,
        PTX_RN: tl.constexpr,
    ):
        # One program per token (grid (Q, B)), all its heads as the rows of one tile: the token's
        # cos/sin and write index are read once for its Hq + 2 Hkv heads, and a token is
        # 1-5K elements, enough for one program. Per-(token, head) programs would re-read them and
        # add nothing at these sizes: the kernel is a few us of launch either way.
        j = tl.program_id(0)
        b = tl.program_id(1)
        HALF: tl.constexpr = HEAD_DIM // 2
        dtype = q_out_ptr.dtype.element_ty
        offs = tl.arange(0, HALF_PAD)
        d_ok = offs < HALF
        row = qkv_ptr + b.to(tl.int64) * stride_xb + j.to(tl.int64) * stride_xq

        # Rotate-half with the halves kept apart: out[:D/2] = x1 cos1 - x2 sin1,
        # out[D/2:] = x2 cos2 + x1 sin2 (cos/sin halves read separately: nothing assumes they match).
        c_row = cos_ptr + b.to(tl.int64) * stride_cb + j.to(tl.int64) * stride_cq
        s_row = sin_ptr + b.to(tl.int64) * stride_sb + j.to(tl.int64) * stride_sq
        cos1 = tl.load(c_row + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(c_row + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(s_row + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(s_row + HALF + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]

        # q heads: columns [0, Hq D) of the row, out to q [B, Q, Hq, D] contiguous.
        hq = tl.arange(0, HQ_PAD)
        q_ok = (hq < NUM_HEADS)[:, None] & d_ok[None, :]
        col = hq[:, None] * HEAD_DIM + offs[None, :]
        x1 = tl.load(row + col, mask=q_ok, other=0.0).to(tl.float32)
        x2 = tl.load(row + HALF + col, mask=q_ok, other=0.0).to(tl.float32)
        q_row = q_out_ptr + (b.to(tl.int64) * tl.num_programs(0) + j) * (NUM_HEADS * HEAD_DIM)
        tl.store(q_row + col, _rope_half(x1, -x2, cos1, sin1, dtype, SOFT_BF16, PTX_RN), mask=q_ok)
        tl.store(q_row + HALF + col, _rope_half(x2, x1, cos2, sin2, dtype, SOFT_BF16, PTX_RN), mask=q_ok)

        # k heads (roped) and v heads (copied) to cache[page, row, h] with index = page *
        # page_size + row. An out-of-range index (a caller bug; torch's index_put would raise) is
        # dropped, never written out of bounds: checking it on the host would synchronise.
        index = tl.load(write_index_ptr + b.to(tl.int64) * stride_wb + j.to(tl.int64) * stride_wq)
        index = index.to(tl.int64)
        in_cache = (index >= 0) & (index < num_pages * page_size)
        page = index // page_size
        prow = index % page_size
        hk = tl.arange(0, HKV_PAD)
        kv_ok = (hk < NUM_KV_HEADS)[:, None] & d_ok[None, :]
        col = hk[:, None] * HEAD_DIM + offs[None, :]
        k_col = NUM_HEADS * HEAD_DIM + col
        v_col = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + col
        x1 = tl.load(row + k_col, mask=kv_ok, other=0.0).to(tl.float32)
        x2 = tl.load(row + HALF + k_col, mask=kv_ok, other=0.0).to(tl.float32)
        k_dst = (k_cache_ptr + page * stride_kc_p + prow * stride_kc_r
                 + hk[:, None].to(tl.int64) * stride_kc_h + offs[None, :])
        # where, not `kv_ok & in_cache`: the interpreter (3.9) turns a tensor & scalar bool into
        # int32, which tl.store rejects as a mask.
        w_ok = tl.where(in_cache, kv_ok, False)
        tl.store(k_dst, _rope_half(x1, -x2, cos1, sin1, dtype, SOFT_BF16, PTX_RN), mask=w_ok)
        tl.store(k_dst + HALF, _rope_half(x2, x1, cos2, sin2, dtype, SOFT_BF16, PTX_RN), mask=w_ok)
        v_dst = (v_cache_ptr + page * stride_vc_p + prow * stride_vc_r
                 + hk[:, None].to(tl.int64) * stride_vc_h + offs[None, :])
        # v is copied in its own dtype: no arithmetic, bits unchanged.
        tl.store(v_dst, tl.load(row + v_col, mask=kv_ok), mask=w_ok)
        tl.store(v_dst + HALF, tl.load(row + HALF + v_col, mask=kv_ok), mask=w_ok)

    @triton.jit
    def silu_mul_kernel(
        x_ptr, out_ptr,
        stride_x, stride_out,
        inter,                       # I: the gate half's width
        BLOCK: tl.constexpr,
        SOFT_BF16: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        # Grid (rows, cdiv(I, BLOCK)): elementwise, so fixed-size column blocks, not whole rows.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < inter
        dtype = out_ptr.dtype.element_ty
        g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + offs, mask=ok, other=0.0).to(tl.float32)
        # F.silu: x / (1 + exp(-x)) in fp32 (IEEE division, as nvcc and the CPU compile it),
        # rounded to dtype; then `* up` as its own op, rounded again.
        s = _round_to(tl.div_rn(g, 1.0 + _exp(-g, LIBDEVICE)), dtype, SOFT_BF16)
        out = _round_to(s.to(tl.float32) * u, dtype, SOFT_BF16)
        tl.store(out_ptr + row * stride_out + offs, out, mask=ok)

else:  # pragma: no cover
    add_rms_norm_kernel = rope_qkv_write_kernel = silu_mul_kernel = None


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------
_logged: set[tuple[str, str]] = set()


def _log_once(op: str, reason: str) -> None:
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        logger.info("%s: Triton cannot run, using the torch reference: %s", op, reason)


def _pick_kernel(kernel, device: torch.device) -> tuple[object | None, str | None]:
    """(kernel, None) where Triton can run `kernel` on `device`, else (None, reason)."""
    return pick_kernel(kernel, device, _TRITON_IMPORT_ERROR)


def _resolve(op: str, kernel, device: torch.device, backend: str):
    """The kernel to launch, or None to run the torch reference; raises for backend="triton"."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"{op}: backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return None
    kernel, reason = _pick_kernel(kernel, device)
    if kernel is None:
        if backend == "triton":
            raise RuntimeError(f"{op}: Triton cannot run: {reason}")
        _log_once(op, reason)
    return kernel


def _check(op: str, name: str, t, ndim: int | None, dtypes, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


def _rows(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as a [rows, N] view with a unit last stride (no copy), or ValueError."""
    if t.dim() == 0:
        raise ValueError(f"{op}: {name} must have at least 1 dim, got a scalar")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last axis, strides {t.stride()}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{op}: {name}'s leading dims {tuple(t.shape[:-1])} with strides "
                         f"{t.stride()[:-1]} cannot be flattened into rows without a copy") from None


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _launch_ctx(device: torch.device):
    # Triton launches on the current CUDA device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def ptx_rn(kernel) -> bool:
    """Whether `kernel` compiles for an NVIDIA GPU, where _rope_half's PTX_RN rounds in inline
    PTX (not under the interpreter, which never fuses, nor on ROCm, whose torch has no PTX)."""
    return not _is_interpreted(kernel) and torch.version.hip is None


def _flags(kernel, dtype: torch.dtype) -> dict:
    interpreted = _is_interpreted(kernel)
    return dict(SOFT_BF16=interpreted and dtype == torch.bfloat16)


def _norm_rows(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
               weight_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The checks of an add+RMSNorm's inputs (x [..., H] float, residual like x or None, the
    norm's weight [H] contiguous, all one dtype and device), then x and residual as [rows, H]
    views (no copy)."""
    _check(op, "x", x, None, FLOAT_DTYPES, None)
    device, dtype = x.device, x.dtype
    _check(op, weight_name, weight, 1, (dtype,), device)
    if residual is not None:
        _check(op, "residual", residual, None, (dtype,), device)
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    x2 = _rows(op, "x", x)
    hidden = x2.shape[1]
    if weight.shape[0] != hidden:
        raise ValueError(f"{op}: {weight_name} has {weight.shape[0]} entries, rows of x have {hidden}")
    if weight.stride(0) != 1 and hidden > 1:
        raise ValueError(f"{op}: {weight_name} must be contiguous, stride {weight.stride()}")
    if hidden > MAX_NORM_HIDDEN:
        raise ValueError(f"{op}: rows of {hidden} > {MAX_NORM_HIDDEN} elements are not supported")
    return x2, None if residual is None else _rows(op, "residual", residual)


def _norm_warps(block: int) -> int:
    # About 8 fp32 values of the row per thread (32 at H = 16384), NOT TUNED ON A GPU.
    return max(1, min(16, block // 256))


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (x itself when residual is None); normed = RMSNorm(new_residual).

    RMSNorm is HF LlamaRMSNorm, draft/model.py's `rms_norm`: normalise in float32, round to the
    input dtype, multiply by weight in that dtype.
    Shape: x [..., H], float32, float16 or bfloat16; rows are the leading dims flattened.
    Shape: residual [..., H] | None, x's shape and dtype.
    Shape: weight [H], x's dtype.
    Returns (normed [..., H], new_residual [..., H]), both contiguous in x's dtype; with residual
    None, new_residual is x itself (not a copy).

    Rounding: the add is bit-identical to torch's; normed matches model.py's rms_norm up to the
    fp32 mean of squares (another summation order) and rsqrt's last bit: in bf16, on rare elements
    (12 in 268,800 in one test), the normalised value is one ulp off, up to two after `* weight`;
    in fp32, a few ulps.
    backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the torch reference, logged
    once), "triton" (raise if it cannot run) or "torch" (`add_rms_norm_reference`). No host sync.
    """
    op = "add_rms_norm"
    x2, r2 = _norm_rows(op, x, residual, weight, "weight")
    device, dtype, hidden = x.device, x.dtype, x2.shape[1]
    kernel = _resolve(op, add_rms_norm_kernel, device, backend)
    if kernel is None:
        return add_rms_norm_reference(x, residual, weight, eps)

    out = torch.empty(x.shape, dtype=dtype, device=device)
    new_res = x if residual is None else torch.empty(x.shape, dtype=dtype, device=device)
    rows = x2.shape[0]
    if rows == 0 or hidden == 0:
        return out, new_res
    out2, res_out2 = out.view(rows, hidden), new_res.view(rows, hidden)
    block = _next_pow2(hidden)
    with _launch_ctx(device):
        kernel[(rows,)](
            x2, x2 if r2 is None else r2, weight, out2, res_out2,
            x2.stride(0), 0 if r2 is None else r2.stride(0), out2.stride(0), res_out2.stride(0),
            hidden, float(hidden), float(eps),
            BLOCK=block, HAS_RESIDUAL=r2 is not None, LIBDEVICE=not _is_interpreted(kernel),
            num_warps=_norm_warps(block), enable_fp_fusion=False, **_flags(kernel, dtype),
        )
    return out, new_res


def rope_qkv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_index: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate-half RoPE on q and k of the fused projection, k and v into the cache, q returned.

    Shape: qkv [B, Q, (Hq + 2 Hkv) D], float32, float16 or bfloat16; each token's columns are
        q heads | k heads | v heads (DraftLayer.qkv_weight's rows), unit last stride.
    Shape: cos, sin [B, Q, 1, D], qkv's dtype (model.forward's; expanded views are fine).
    Shape: k_cache, v_cache [num_pages, page_size, Hkv, D] (draft/kv_cache.py), qkv's dtype,
        unit last stride.
    Shape: write_index [B, Q] int32/int64: page * page_size + row of token j of row b
        (draft/attention.DraftAttentionMetadata.write_index).
    Returns q [B, Q, Hq, D] contiguous, RoPE applied.

    Writes k_cache[i // page_size, i % page_size] = rope(k)[b, j] for i = write_index[b, j], and
    the same for the plain v: exactly draft/attention.write_kv. The caller guarantees in-range,
    distinct indices (checking would synchronise); the kernel drops an out-of-range write
    instead of writing out of bounds, where the torch path would raise.
    Rounding: apply_rope's (`x * cos` and `rot * sin` each rounded to the dtype, then their sum):
    bit-identical to draft/model.apply_rope and write_kv in every dtype.
    backend: as `add_rms_norm`'s. No host sync.
    """
    op = "rope_qkv_write"
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if type(v) is not int or v <= 0:
            raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{op}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim must be even and <= {MAX_HEAD_DIM}, got {head_dim}")
    _check(op, "qkv", qkv, 3, FLOAT_DTYPES, None)
    device, dtype = qkv.device, qkv.dtype
    B, Q, width = qkv.shape
    D = head_dim
    if width != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"{op}: qkv's last dim is {width}, expected (num_heads + 2 num_kv_heads) "
                         f"* head_dim = {(num_heads + 2 * num_kv_heads) * D}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(op, name, t, 4, (dtype,), device)
        if tuple(t.shape) != (B, Q, 1, D):
            raise ValueError(f"{op}: {name} must be [B, Q, 1, D] = {(B, Q, 1, D)}, got {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(op, name, t, 4, (dtype,), device)
        if t.shape[2] != num_kv_heads or t.shape[3] != D:
            raise ValueError(f"{op}: {name} must be [num_pages, page_size, {num_kv_heads}, {D}], "
                             f"got {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    _check(op, "write_index", write_index, 2, (torch.int32, torch.int64), device)
    if tuple(write_index.shape) != (B, Q):
        raise ValueError(f"{op}: write_index must be [{B}, {Q}], got {tuple(write_index.shape)}")
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last axis, strides {t.stride()}")
    kernel = _resolve(op, rope_qkv_write_kernel, device, backend)
    if kernel is None:
        return rope_qkv_write_reference(qkv, cos, sin, k_cache, v_cache, write_index,
                                        num_heads, num_kv_heads, head_dim)

    q = torch.empty((B, Q, num_heads, D), dtype=dtype, device=device)
    if B == 0 or Q == 0:
        return q
    if B > 65535:  # CUDA's grid y limit
        raise ValueError(f"{op}: at most 65535 rows per call, got {B}")
    with _launch_ctx(device):
        kernel[(Q, B)](
            qkv, cos, sin, k_cache, v_cache, write_index, q,
            qkv.stride(0), qkv.stride(1),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            write_index.stride(0), write_index.stride(1),
            k_cache.shape[0], k_cache.shape[1],
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=D,
            HQ_PAD=_next_pow2(num_heads), HKV_PAD=_next_pow2(num_kv_heads),
            HALF_PAD=_next_pow2(D // 2), PTX_RN=ptx_rn(kernel),
            num_warps=4, enable_fp_fusion=False, **_flags(kernel, dtype),
        )
    return q


def silu_mul(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up of the fused gate_up projection.

    Shape: gate_up [..., 2 I], float32, float16 or bfloat16: gate | up halves of each row; rows are
        the leading dims flattened (unit last stride).
    Returns [..., I] contiguous, gate_up's dtype.

    Rounding: torch's `F.silu(gate) * up`: silu = g / (1 + exp(-g)) in float32, rounded to the
    dtype, then the product rounded again. exp's last fp32 bit is the library's (libdevice on CUDA,
    as torch's CUDA kernel; numpy under the interpreter vs Sleef in torch on CPU), so on rare
    elements bf16 results can differ from torch by one bf16 ulp.
    backend: as `add_rms_norm`'s. No host sync.
    """
    op = "silu_mul"
    _check(op, "gate_up", gate_up, None, FLOAT_DTYPES, None)
    x2 = _rows(op, "gate_up", gate_up)
    if x2.shape[1] % 2:
        raise ValueError(f"{op}: gate_up's last dim must be even (gate | up), got {x2.shape[1]}")
    inter = x2.shape[1] // 2
    kernel = _resolve(op, silu_mul_kernel, gate_up.device, backend)
    if kernel is None:
        return silu_mul_reference(gate_up)

    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    out2 = out.view(rows, inter)
    block = min(SILU_BLOCK, _next_pow2(inter))
    col_blocks = triton.cdiv(inter, block)
    if col_blocks > 65535:
        raise ValueError(f"{op}: I = {inter} is too wide ({col_blocks} column blocks > 65535)")
    with _launch_ctx(gate_up.device):
        kernel[(rows, col_blocks)](
            x2, out2, x2.stride(0), out2.stride(0), inter,
            BLOCK=block, LIBDEVICE=not _is_interpreted(kernel),
            num_warps=4, enable_fp_fusion=False, **_flags(kernel, gate_up.dtype),
        )
    return out


# ----------------------------------------------------------------------------------------------
# Plain-torch references: draft/model.py's math, op for op
# ----------------------------------------------------------------------------------------------
def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` in torch: (rms_norm(h), h) with h = x + residual, or x when residual is None."""
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), h


def rope_qkv_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             write_index: torch.Tensor, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> torch.Tensor:
    """`rope_qkv_write` in torch: DraftLayer.forward's split, apply_rope and write_kv."""
    B, Q, _ = qkv.shape
    D = head_dim
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    q = rope(q.view(B, Q, num_heads, D))
    k = rope(k.view(B, Q, num_kv_heads, D))
    page_size = k_cache.shape[1]
    idx = write_index.long()
    k_cache[idx // page_size, idx % page_size] = k
    v_cache[idx // page_size, idx % page_size] = v.view(B, Q, num_kv_heads, D)
    return q.contiguous()


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` in torch: F.silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
