"""RMSNorm fused into the matrix product that reads it (Triton), for the draft's small forwards.

A graph-replayed draft forward on a GPU pays a few microseconds per kernel node however small the
kernel, and its layer (kernels/fused_ops.py) is

    add_rms_norm -> qkv GEMM -> attention (RoPE + KV write inside) -> o GEMM
                 -> add_rms_norm -> gate_up GEMM -> silu_mul -> down GEMM

`norm_linear` makes each `add_rms_norm -> GEMM` pair one launch, and with `glu` the
`gate_up GEMM -> silu_mul` pair too: five launches per layer instead of eight. The product is
a weight-streaming tile loop (each program: all of a block of rows, one block of output
columns), the shape cuBLAS takes for a few rows: the forwards a drafting round replays have 1 to
a few dozen rows per request. Every program recomputes its rows' RMS (one pass over the rows'
K inputs, which are a few KB and sit in L2) before the product, so no second launch waits on a
reduction. Past `MAX_ROWS` rows that recomputation would cost more than the launch it saves:
the caller keeps the separate kernels there.

Rounding as the torch code's (draft/model.py): the residual add, the normalised value and
`weight * normed` rounded to the dtype where torch rounds them (fused_ops.add_rms_norm's
sequence), the product accumulated in fp32 with the bias added before its one rounding to the
dtype (cuBLAS's bias epilogue), and with `glu` silu(gate) and `* up` rounded as
fused_ops.silu_mul does. The product's summation order is not cuBLAS's or torch's CPU one, so
outputs agree to the fp32 accumulation's last bits before the rounding to the dtype
(tests/test_norm_gemm.py: float32 within summation-order error, bfloat16 within one rounding).

The tile sizes are NOT TUNED ON A GPU: `_tiles` says what they are and why.
"""

from __future__ import annotations

import torch

from .fused_ops import (
    _check,
    _flags,
    _launch_ctx,
    _norm_rows,
    _resolve,
    add_rms_norm_reference,
    silu_mul_reference,
)
from .triton_runtime import import_triton, pick_kernel
from .triton_runtime import is_interpreted as _is_interpreted

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

# Most rows (tokens of all requests) one call takes: each program reads all of them twice
# (the RMS, then the product); the draft's forwards within it are the launch-bound ones.
MAX_ROWS = 64

if triton is not None:
    from .fused_ops import _exp, _round_to, _rsqrt

    @triton.jit
    def _residual_tile(x_ptr, res_ptr, rows, cols, ok, stride_x, stride_res, dtype: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, SOFT_BF16: tl.constexpr):
        # h = x + residual as torch adds them in the model dtype (fp32 add, one rounding).
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=ok, other=0.0)
            h = _round_to(x.to(tl.float32) + r.to(tl.float32), dtype, SOFT_BF16)
        else:
            h = x
        return h

    @triton.jit
    def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
        if UPCAST_DOT:
            # Triton's CPU interpreter multiplies bf16 dot operands as their raw bits (see
            # tree_attention._online_softmax_tile); bf16 x bf16 is exact in fp32. Interpreter only.
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def norm_gemm_kernel(
        x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, y_ptr, res_out_ptr,
        stride_x, stride_res, stride_w, stride_y, stride_res_out,
        M, N, K, K_f, eps,           # K_f: float(K); a float argument is never specialised
        glu_offset,                  # with GLU: the up half's first weight row (= N)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GLU: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        SOFT_BF16: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        # Grid (column blocks, row blocks): the column block is the fast axis, so the programs
        # that read the same rows run together and share them through L2.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        dtype = y_ptr.dtype.element_ty
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M

        # Pass 1: each row's sum of squares; the first column block also stores h (the new
        # residual), which no program reads back (each recomputes h from x and the residual).
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (cols < K)[None, :]
            h = _residual_tile(x_ptr, res_ptr, rows, cols, ok, stride_x, stride_res, dtype,
                               HAS_RESIDUAL, SOFT_BF16)
            if HAS_RESIDUAL:
                if pid_n == 0:
                    tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], h, mask=ok)
            hf = h.to(tl.float32)
            sq += tl.sum(hf * hf, axis=1)
        # div_rn: Triton's fp32 `/` is approximate on CUDA. Padded rows: rsqrt(eps), finite.
        rstd = _rsqrt(tl.div_rn(sq, K_f) + eps, LIBDEVICE)

        # Pass 2: a = weight * round(h * rstd) (rounded as torch does), y = a @ W^T.
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_rows = offs_n.to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            k_ok = cols < K
            ok = row_ok[:, None] & k_ok[None, :]
            h = _residual_tile(x_ptr, res_ptr, rows, cols, ok, stride_x, stride_res, dtype,
                               HAS_RESIDUAL, SOFT_BF16)
            normed = _round_to(h.to(tl.float32) * rstd[:, None], dtype, SOFT_BF16)
            nw = tl.load(norm_w_ptr + cols, mask=k_ok, other=0.0)
            # `weight * normed.to(dtype)`: the product of two bf16/fp16 values is exact in fp32.
            a = _round_to(nw.to(tl.float32)[None, :] * normed.to(tl.float32), dtype, SOFT_BF16)
            w_ok = k_ok[:, None] & n_ok[None, :]
            wt = tl.load(w_ptr + w_rows[None, :] + cols[:, None], mask=w_ok, other=0.0)  # [BK, BN]
            acc = _dot(a, wt, acc, DOT_PRECISION, UPCAST_DOT)
            if GLU:
                wu = tl.load(w_ptr + glu_offset * stride_w + w_rows[None, :] + cols[:, None], mask=w_ok,
                             other=0.0)
                acc_up = _dot(a, wu, acc_up, DOT_PRECISION, UPCAST_DOT)

        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GLU:
                acc_up += tl.load(bias_ptr + glu_offset + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = _round_to(acc, dtype, SOFT_BF16)
        if GLU:
            # fused_ops.silu_mul on the rounded gate and up: silu rounded, then `* up` rounded.
            g = y.to(tl.float32)
            u = _round_to(acc_up, dtype, SOFT_BF16).to(tl.float32)
            s = _round_to(tl.div_rn(g, 1.0 + _exp(-g, LIBDEVICE)), dtype, SOFT_BF16)
            y = _round_to(s.to(tl.float32) * u, dtype, SOFT_BF16)
        out_ok = row_ok[:, None] & n_ok[None, :]
        tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], y, mask=out_ok)

else:  # pragma: no cover
    norm_gemm_kernel = None


def _tiles(rows: int, out_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps), NOT TUNED ON A GPU. BLOCK_M: all rows in one
    block, so the weight is streamed once: 16 (the smallest tl.dot takes) or MAX_ROWS (32
    spills 8 B per thread with the GLU epilogue at sm_90, where 64 does not).
    BLOCK_N: small enough that the narrow products (the draft's qkv: 1152 columns) still make
    ~70 programs, wide enough that gate_up's 4864 makes ~150: about one wave of an H100's 132
    SMs either way. BLOCK_K and warps: the largest K step that compiles for sm_90 without
    spills (Triton 3.9's ptxas, bf16, with the GLU epilogue: 16 rows, BLOCK_K 128, 8 warps: 219
    registers; 64 rows, BLOCK_K 32: 118; at 4 warps or twice the K step they spill), so that
    the K loop (896 for the 0.5B draft) takes few steps, each a memory latency where it is not
    pipelined (`python scripts/bench_norm_gemm.py --compile-only 90 --tiles ...` for others)."""
    block_m = 16 if rows <= 16 else MAX_ROWS
    block_n = 16 if out_cols <= 2048 else 32
    return block_m, block_n, 128 if block_m <= 16 else 32, 8


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    glu: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_ops.add_rms_norm, then the projection (and with `glu`, fused_ops.silu_mul), in one
    launch: h = x + residual (x where residual is None), a = RMSNorm(h) * norm_weight,
    y = a @ weight^T + bias; with glu, y = silu(y[:, :N]) * y[:, N:] for weight's 2N rows
    (gate | up, DraftLayer.gate_up_weight's layout).

    Shape: x [..., K], float32, float16 or bfloat16, at most MAX_ROWS rows (leading dims
        flattened, unit last stride); residual like x or None; norm_weight [K];
        weight [N_w, K] (unit last stride), bias [N_w] | None, all in x's dtype.
    Returns (y [..., N_w] (glu: [..., N_w / 2]), new_residual [..., K]), contiguous; with
    residual None, new_residual is x itself.

    Rounding: the module docstring's. backend: "auto" (Triton on CUDA or under
    TRITON_INTERPRET=1, else `norm_linear_reference`), "triton" (raise if it cannot run) or
    "torch". No host sync.
    """
    op = "norm_linear"
    x2, r2 = _norm_rows(op, x, residual, norm_weight, "norm_weight")
    device, dtype = x.device, x.dtype
    rows, K = x2.shape
    _check(op, "weight", weight, 2, (dtype,), device)
    n_w = weight.shape[0]
    if weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"{op}: weight must be [N, {K}] with a unit last stride, got "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    if bias is not None:
        _check(op, "bias", bias, 1, (dtype,), device)
        if bias.shape[0] != n_w or bias.stride(0) != 1:
            raise ValueError(f"{op}: bias must be contiguous [{n_w}], got {tuple(bias.shape)}")
    if glu and n_w % 2:
        raise ValueError(f"{op}: glu needs an even number of weight rows (gate | up), got {n_w}")
    if rows > MAX_ROWS:
        raise ValueError(f"{op}: {rows} rows > MAX_ROWS = {MAX_ROWS}: use add_rms_norm and the product")
    kernel = _resolve(op, norm_gemm_kernel, device, backend)
    if kernel is None:
        return norm_linear_reference(x, residual, norm_weight, eps, weight, bias, glu)

    N = n_w // 2 if glu else n_w
    y = torch.empty((*x.shape[:-1], N), dtype=dtype, device=device)
    new_res = x if residual is None else torch.empty(x.shape, dtype=dtype, device=device)
    if rows == 0:
        return y, new_res
    if N == 0:  # no product: only the kernel would have written the sum
        if residual is not None:
            torch.add(x, residual, out=new_res)
        return y, new_res
    y2, res_out2 = y.view(rows, N), new_res.view(rows, K)
    block_m, block_n, block_k, warps = _tiles(rows, N)
    interpreted_bf16 = dtype == torch.bfloat16 and _is_interpreted(kernel)
    with _launch_ctx(device):
        kernel[(triton.cdiv(N, block_n), triton.cdiv(rows, block_m))](
            x2, x2 if r2 is None else r2, norm_weight, weight, weight if bias is None else bias,
            y2, res_out2,
            x2.stride(0), 0 if r2 is None else r2.stride(0), weight.stride(0), y2.stride(0),
            res_out2.stride(0),
            rows, N, K, float(K), float(eps), N if glu else 0,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            HAS_RESIDUAL=r2 is not None, HAS_BIAS=bias is not None, GLU=glu,
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", UPCAST_DOT=interpreted_bf16,
            LIBDEVICE=not _is_interpreted(kernel),
            num_warps=warps, enable_fp_fusion=False, **_flags(kernel, dtype),
        )
    return y, new_res


def norm_linear_reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear` in torch: fused_ops' add_rms_norm and silu_mul references around F.linear."""
    normed, h = add_rms_norm_reference(x, residual, norm_weight, eps)
    y = torch.nn.functional.linear(normed, weight, bias)
    return (silu_mul_reference(y) if glu else y), h


def check_kernel(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Compile and compare with `norm_linear_reference` before the draft serves with it: None
    if the kernel may serve on `device` in `dtype`, else why not (the caller then keeps the
    separate kernels). Rows 1 and 34 (a decode and a W = G = 4 lookahead forward's width per
    request), with and without residual, bias and the SiLU*up epilogue. Tolerances: a few of
    the dtype's ulps at these magnitudes, far below what a wrong row, column or rounding gives."""
    device = torch.device(device)
    kernel, reason = pick_kernel(norm_gemm_kernel, device, _TRITON_IMPORT_ERROR)
    if kernel is None:
        return reason
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
    try:
        g = torch.Generator().manual_seed(0)
        rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device, dtype)  # noqa: E731
        K = 96
        for rows, N, glu, with_residual, with_bias in ((1, 80, False, False, True), (34, 80, True, True, False),
                                                       (34, 48, False, True, True)):
            x, res = rnd(rows, K), rnd(rows, K) if with_residual else None
            nw, w, b = 1 + rnd(K, scale=0.1), rnd(N, K, scale=K ** -0.5), rnd(N) if with_bias else None
            y, h = norm_linear(x, res, nw, 1e-6, w, b, glu=glu, backend="triton")
            want_y, want_h = norm_linear_reference(x, res, nw, 1e-6, w, b, glu)
            err = (y.float() - want_y.float()).abs().max().item()
            if not torch.equal(h, want_h) or not err <= tol:
                return (f"the kernel differs from torch ({dtype}, {rows} rows, N = {N}, glu={glu}): "
                        f"max |y - want| = {err:.3g} (tolerance {tol:g}), residual equal: "
                        f"{torch.equal(h, want_h)}")
    except Exception as e:  # noqa: BLE001 - any failure means: keep the separate kernels
        return f"the kernel failed its check: {type(e).__name__}: {e}"
    return None
