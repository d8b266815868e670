"""kernels/norm_gemm.py (results/norm_gemm.patch, not merged) against its torch reference, under
Triton's interpreter on a CPU (compiled on CUDA): float32 within fp32 summation-order error,
bfloat16 within one rounding of it, with and without residual, bias and the SiLU*up epilogue;
its check before serving; the draft's fused layers through it."""

import pytest
import torch

from conftest import DEVICE, needs_triton, set_triton_interpret
from tiny_models import prefill_then_masked_forward

set_triton_interpret(True)
try:
    from vllm_ouroboros.kernels import norm_gemm as ng
finally:
    set_triton_interpret(False)

pytestmark = [pytest.mark.usefixtures("one_thread", "triton_interpreter"), needs_triton(ng, ng.norm_gemm_kernel)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,K,N,glu,res,bias", [
    (1, 64, 48, False, True, True), (5, 96, 40, True, True, False), (34, 128, 72, False, False, True),
    (64, 200, 30, True, True, True), (0, 64, 16, False, True, False), (3, 64, 0, False, True, False)])
def test_norm_linear_matches_reference(dtype, rows, K, N, glu, res, bias):
    g = torch.Generator().manual_seed(rows * 7 + K)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(DEVICE)  # noqa: E731
    x, resid = r(rows, K), (r(rows, K) if res else None)
    nw, w = (1 + r(K, scale=0.1).float()).to(dtype), r(N, K, scale=K ** -0.5)
    b = r(N) if bias else None
    y, h = ng.norm_linear(x, resid, nw, 1e-6, w, b, glu=glu, backend="triton")
    yr, hr = ng.norm_linear_reference(x, resid, nw, 1e-6, w, b, glu)
    assert y.shape == yr.shape and torch.equal(h, hr)
    if dtype == torch.bfloat16:  # fp32 sums in another order, then one rounding: <= 1 bf16 ulp
        torch.testing.assert_close(y.float(), yr.float(), rtol=2 ** -7, atol=1e-6)
    else:
        torch.testing.assert_close(y, yr, rtol=0, atol=1e-5)


def test_norm_linear_refuses_more_rows_than_it_takes():
    x = torch.zeros(ng.MAX_ROWS + 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="MAX_ROWS"):
        ng.norm_linear(x, None, torch.ones(16, device=DEVICE), 1e-6, torch.zeros(8, 16, device=DEVICE))


def test_max_rows_is_the_models():
    from vllm_ouroboros.draft.model import NORM_GEMM_MAX_ROWS

    assert ng.MAX_ROWS == NORM_GEMM_MAX_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_kernel_passes_and_names_a_wrong_kernel(dtype, monkeypatch):
    assert ng.check_kernel(torch.device(DEVICE), dtype) is None
    real = ng.norm_linear

    def half_epilogue(*a, **k):  # the SiLU*up epilogue dropped: the gate half alone
        y, h = real(*a, **{**k, "glu": False})
        return (y[..., :y.shape[-1] // 2] if k.get("glu") else y), h

    monkeypatch.setattr(ng, "norm_linear", half_epilogue)
    why = ng.check_kernel(torch.device(DEVICE), dtype)
    assert why is not None and "differs" in why and "glu=True" in why, why


def test_draft_forward_with_norm_in_the_products(tiny_models, monkeypatch):
    """The fused layers with norm_linear give the hidden states and caches of the separate
    kernels (float32: the products' summation order only), the forward past MAX_ROWS rows
    identical (it does not take them), and the small forward takes them: 2 per layer."""
    from vllm_ouroboros.draft.model import DraftModel

    outs, calls = {}, []
    real = ng.norm_linear
    monkeypatch.setattr(ng, "norm_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    for on in (False, True):
        m = DraftModel.from_pretrained(tiny_models["draft"], dtype=torch.float32, device=DEVICE)
        g = torch.Generator().manual_seed(1)
        for layer in m.layers:  # norms unlike each other, so that taking the wrong one shows
            for w in (layer.input_norm, layer.post_norm):
                w.copy_(1 + 0.5 * torch.randn(w.shape, generator=g))
        m.allocate_cache(3, 96)
        m.fused_ops, m.norm_gemm = True, on
        # an 80-row prefill (past MAX_ROWS: the separate kernels), then 24 rows (inside)
        outs[on] = (*prefill_then_masked_forward(m, DEVICE, prefill=40, lens=(40, 33)),
                    m.k_cache.cpu(), m.v_cache.cpu())
    assert len(calls) == 2 * m.num_layers and all(s[:2] == (2, 12) for s in calls)
    assert torch.equal(outs[False][0], outs[True][0])  # the prefill: separate kernels both times
    for a, b in zip(outs[False][1:], outs[True][1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_enable_norm_gemm_needs_the_fused_layers_and_a_passing_check(tiny_models, monkeypatch):
    from vllm_ouroboros.draft.model import DraftModel

    m = DraftModel.from_pretrained(tiny_models["draft"], dtype=torch.float32, device=DEVICE)
    assert not m.norm_gemm and "fused layers" in m.enable_norm_gemm() and not m.norm_gemm
    m.fused_ops = True
    assert m.enable_norm_gemm() is None and m.norm_gemm
    monkeypatch.setattr(ng, "check_kernel", lambda device, dtype: "differs")
    assert m.enable_norm_gemm() == "differs" and not m.norm_gemm


def test_kernel_compiles_for_nvidia_without_spills():
    """scripts/bench_norm_gemm.py --compile-only: Triton's bundled ptxas compiles the kernel for
    sm_90 at the tiles norm_linear takes for 1 to 64 rows, no GPU needed; a spill (STACK > 0)
    means tiles too large for the registers (norm_gemm._tiles)."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    spec = importlib.util.find_spec("triton")
    tools = Path(spec.origin).parent / "backends" / "nvidia" / "bin" if spec else None
    if tools is None or not all((tools / t).exists() for t in ("ptxas", "cuobjdump")):
        pytest.skip(f"this Triton has no bundled ptxas and cuobjdump (looked in {tools})")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    script = [sys.executable, str(repo / "scripts" / "bench_norm_gemm.py"), "--compile-only", "90"]
    proc = subprocess.run(script + ["--rows", "1", "16", "17", "64"], env=env, capture_output=True, text=True,
                          timeout=600)
    usage = [ln for ln in proc.stdout.splitlines() if ln.startswith("sm_90 ")]
    assert proc.returncode == 0 and len(usage) == 8 and all("STACK:0" in ln for ln in usage), proc.stdout
    # A configuration the compiler refuses is a line of the table and the exit status, not a crash
    # (triton_runtime.compile_report, which every --compile-only table uses).
    proc = subprocess.run(script + ["--rows", "1", "--tiles", "16", "16", "16", "3"], env=env, capture_output=True,
                          text=True, timeout=600)
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("sm_90 ")]
    assert proc.returncode == 1 and len(failed) == 2, proc.stdout + proc.stderr
    assert all("FAILED: AssertionError: num_warps must be a power of 2" in ln for ln in failed), proc.stdout
