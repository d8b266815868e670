"""Fused layer kernels (kernels/fused_ops.py) vs their torch references and vs draft/model.py's own
rms_norm / apply_rope / write_kv: compiled on a CUDA device when there is one, else run by
Triton's CPU interpreter.

TRITON_INTERPRET is handled as in test_tree_attention_kernel.py: @triton.jit reads it when a
function is decorated (Triton's library when triton is first imported, the kernels when
fused_ops is), and the interpreter reads it again while running. So on CPU it is set before both
imports and during this module's tests, and put back otherwise. If triton (or fused_ops) was
imported earlier in this process with it unset, the kernel tests skip and say so; the reference
tests still run.

Rounding claims checked here: the residual add, RoPE and the KV write are bit-identical to torch in
float32, float16 and bfloat16. RMSNorm and SiLU are not: the fp32 mean of squares is summed in
another order and exp's last bit is the library's, so float32 results may differ by a few ulps
(bound 8) and bfloat16 ones are bit-identical on >= 99% of elements (99.9% for SiLU), within 2 ulps
for RMSNorm (1 ulp in the normalised value, then `* weight`) and 1 for SiLU.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, set_triton_interpret  # noqa: E402  (cuda when present; OUROBOROS_TEST_DEVICE overrides)

set_triton_interpret(True)
try:
    from vllm_ouroboros.kernels import fused_ops as fo
finally:
    set_triton_interpret(False)

from vllm_ouroboros.draft.attention import build_attention_metadata, write_kv  # noqa: E402
from vllm_ouroboros.draft.model import apply_rope, rms_norm  # noqa: E402

_KERNELS = (fo.add_rms_norm_kernel, fo.rope_qkv_write_kernel, fo.silu_mul_kernel)
_REASON = next((r for r in (fo._pick_kernel(k, torch.device(DEVICE))[1] for k in _KERNELS) if r), None)
needs_triton = pytest.mark.skipif(
    _REASON is not None,
    reason=f"Triton cannot run the kernels in this process: {_REASON}. Usually an earlier test "
           "module imported triton (or fused_ops) with TRITON_INTERPRET unset; run "
           "tests/test_fused_ops.py in its own pytest process")


# Tiny tensors: thread wake-ups cost more than the work (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread", "triton_interpreter")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def ulp(ref: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of ref's dtype at each element's magnitude (as float32)."""
    bits = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[ref.dtype]
    _, exp = torch.frexp(ref.float())  # |ref| in [2^(exp-1), 2^exp)
    tiny = torch.finfo(ref.dtype).tiny
    return torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exp - 1 - bits).clamp_min(tiny)


def assert_ulps(out, ref, max_ulps, min_identical):
    """|out - ref| <= max_ulps ulps of ref everywhere, and at least a fraction min_identical of the
    elements bit-identical."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    worst = (diff / ulp(ref)).max().item() if out.numel() else 0.0
    identical = (out == ref).float().mean().item() if out.numel() else 1.0
    assert worst <= max_ulps, f"max error {worst:.2f} ulps > {max_ulps}"
    assert identical >= min_identical, f"only {identical:.4%} of elements identical"


def rope_tables(B, Q, D, dtype, gen, theta=1e6):
    """cos, sin [B, Q, 1, D] as DraftModel.forward builds them, at random positions."""
    positions = torch.randint(0, 4096, (B, Q), generator=gen)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------
# add_rms_norm
# ---------------------------------------------------------------------------------------------
# (hidden, rows): the real 0.5B / 1.5B widths with few rows (the interpreter runs programs one by
# one), small widths with up to 70 rows; 80 is not a power of two (masked block).
NORM_CASES = [(64, 70), (80, 33), (896, 9), (1536, 5)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden,rows", NORM_CASES)
def test_add_rms_norm_parity(hidden, rows, with_residual, dtype):
    gen = torch.Generator().manual_seed(hidden * 7 + rows)
    rows = random.Random(hidden).randint(1, rows) if rows > 9 else rows
    x = randn(rows, hidden, dtype=dtype, gen=gen, scale=3.0)
    res = randn(rows, hidden, dtype=dtype, gen=gen) if with_residual else None
    w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    eps = 1e-6

    out, new_res = fo.add_rms_norm(x, res, w, eps, backend="triton")
    ref_out, ref_res = fo.add_rms_norm_reference(x, res, w, eps)
    # The reference is model.py's math: `h = h + delta` then rms_norm(h).
    h = x if res is None else res + x
    assert torch.equal(ref_res, h) and torch.equal(ref_out, rms_norm(h, w, eps))

    if res is None:
        assert new_res is x
    assert torch.equal(new_res, ref_res)  # the add: bit-identical
    if dtype == torch.float32:  # the mean of squares is summed in another order: last bits differ
        assert_ulps(out, ref_out, max_ulps=8, min_identical=0.0)
    else:  # one ulp in the normalised value can become two after `* weight`
        assert_ulps(out, ref_out, max_ulps=2, min_identical=0.99)


@needs_triton
def test_add_rms_norm_strided_rows_and_leading_dims():
    # x [B, Q, H] taken out of a wider buffer (row stride H + 16), residual [B, Q, H] contiguous.
    gen = torch.Generator().manual_seed(1)
    B, Q, H = 2, 3, 80
    buf = randn(B, Q, H + 16, dtype=torch.bfloat16, gen=gen)
    x = buf[..., :H]
    res = randn(B, Q, H, dtype=torch.bfloat16, gen=gen)
    w = randn(H, dtype=torch.bfloat16, gen=gen)
    out, new_res = fo.add_rms_norm(x, res, w, 1e-5, backend="triton")
    ref_out, ref_res = fo.add_rms_norm_reference(x, res, w, 1e-5)
    assert out.shape == new_res.shape == (B, Q, H) and out.is_contiguous()
    assert torch.equal(new_res, ref_res)
    assert_ulps(out, ref_out, max_ulps=2, min_identical=0.99)


# ---------------------------------------------------------------------------------------------
# rope_qkv_write
# ---------------------------------------------------------------------------------------------
PAGE = 4  # tokens per cache page in these cases: a row's tokens span several pages


def rope_case(B, Q, Hq, Hkv, D, dtype, seed, num_pages=None, contiguous_pos=True):
    """A rope_qkv_write case over a paged cache [num_pages, PAGE, Hkv, D]. contiguous_pos: the
    model's layout (tokens cache_lens[b] + j of a row, through a random block table; also
    returned: (cache_lens, block_table, slots)); else any distinct write indices."""
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-(Q + 11) // PAGE)
    num_pages = num_pages or (B + 2) * per_row + 1
    qkv = randn(B, Q, (Hq + 2 * Hkv) * D, dtype=dtype, gen=gen, scale=2.0)
    cos, sin = rope_tables(B, Q, D, dtype, gen)
    k_cache = randn(num_pages, PAGE, Hkv, D, dtype=dtype, gen=gen)
    v_cache = randn(num_pages, PAGE, Hkv, D, dtype=dtype, gen=gen)
    if contiguous_pos:
        num_slots = B + 2
        pages = torch.randperm(num_pages, generator=gen)[:num_slots * per_row]
        table = pages.view(num_slots, per_row).int()
        slots = torch.randperm(num_slots, generator=gen)[:B]
        cache_lens = torch.randint(0, per_row * PAGE - Q + 1, (B,), generator=gen)
        pos = cache_lens[:, None] + torch.arange(Q)
        write_index = table[slots][torch.arange(B)[:, None], pos // PAGE].long() * PAGE + pos % PAGE
        extra = (cache_lens, table.to(DEVICE), slots.to(DEVICE))
    else:
        write_index = torch.randperm(num_pages * PAGE, generator=gen)[:B * Q].view(B, Q)
        extra = None
    return dict(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                write_index=write_index.to(DEVICE),
                num_heads=Hq, num_kv_heads=Hkv, head_dim=D), extra


def run_both(case):
    """(kernel q, kernel caches, reference q, reference caches, original caches)."""
    orig = case["k_cache"].clone(), case["v_cache"].clone()
    ref_case = dict(case, k_cache=orig[0].clone(), v_cache=orig[1].clone())
    q = fo.rope_qkv_write(**case, backend="triton")
    ref_q = fo.rope_qkv_write_reference(**ref_case)
    return q, (case["k_cache"], case["v_cache"]), ref_q, (ref_case["k_cache"], ref_case["v_cache"]), orig


HEADS = [(14, 2), (12, 2), (4, 4)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{a}x{b}" for a, b in HEADS])
def test_rope_qkv_write_parity(heads, head_dim, dtype):
    Hq, Hkv = heads
    rng = random.Random(f"{heads}-{head_dim}")
    B, Q = rng.randint(1, 3), rng.randint(1, 4)
    case, (cache_lens, table, slots) = rope_case(B, Q, Hq, Hkv, head_dim, dtype,
                                                 seed=rng.randrange(1 << 30))
    q, (kc, vc), ref_q, (ref_kc, ref_vc), (kc0, vc0) = run_both(case)
    # Bit-identical to the reference, everywhere in the cache (so untouched outside the writes).
    assert q.shape == (B, Q, Hq, head_dim) and q.is_contiguous()
    assert torch.equal(q, ref_q) and torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)

    # ... and to DraftLayer.forward's own code: split, apply_rope, write_kv with its metadata.
    D = head_dim
    qkv, cos, sin = case["qkv"], case["cos"], case["sin"]
    mq, mk, mv = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    new_mask = torch.ones(B, Q, Q, dtype=torch.bool, device=DEVICE)
    meta = build_attention_metadata(slots, cache_lens.to(DEVICE), new_mask, table, PAGE,
                                    int(cache_lens.max()), backend="torch")
    assert torch.equal(meta.write_index, case["write_index"])
    model_k, model_v = kc0.clone(), vc0.clone()
    write_kv(model_k, model_v, apply_rope(mk.view(B, Q, Hkv, D), cos, sin), mv.view(B, Q, Hkv, D), meta)
    assert torch.equal(q, apply_rope(mq.view(B, Q, Hq, D), cos, sin))
    assert torch.equal(kc, model_k) and torch.equal(vc, model_v)

    # Outside the written tokens the cache is unchanged.
    written = torch.zeros(kc.shape[0] * PAGE, dtype=torch.bool, device=DEVICE)
    written[case["write_index"]] = True
    keep = ~written.view(-1, PAGE)[:, :, None, None].expand_as(kc)
    assert torch.equal(kc[keep], kc0[keep]) and torch.equal(vc[keep], vc0[keep])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qkv_write_real_size(dtype):
    # 0.5B shapes, 70 tokens (2 rows x 35), random distinct positions, int32 indices, and cos/sin
    # as an expanded view (stride 0 over rows).
    B, Q, Hq, Hkv, D = 2, 35, 14, 2, 64
    case, _ = rope_case(B, Q, Hq, Hkv, D, dtype, seed=11, num_pages=48, contiguous_pos=False)
    case["write_index"] = case["write_index"].int()
    case["cos"] = case["cos"][:1].expand(B, Q, 1, D)
    case["sin"] = case["sin"][:1].expand(B, Q, 1, D)
    q, (kc, vc), ref_q, (ref_kc, ref_vc), _ = run_both(case)
    assert torch.equal(q, ref_q) and torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@needs_triton
def test_rope_qkv_write_odd_head_dim_and_fp16():
    # D = 80: half 40 padded to 64 lanes; float16 rounds like bfloat16's path.
    case, _ = rope_case(2, 3, 12, 2, 80, torch.float16, seed=5, contiguous_pos=False)
    q, (kc, vc), ref_q, (ref_kc, ref_vc), _ = run_both(case)
    assert torch.equal(q, ref_q) and torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@needs_triton
def test_rope_qkv_write_drops_out_of_range_writes():
    # A caller bug (an index past the cache, or negative) must not write out of bounds: those
    # tokens' K/V are dropped, the others land, q is still computed.
    case, _ = rope_case(2, 2, 4, 2, 64, torch.float32, seed=2, num_pages=3, contiguous_pos=False)
    case["write_index"] = torch.tensor([[-1, 12], [13, 6]], device=DEVICE)  # 12 = 3 pages x 4: dropped
    k0, v0 = case["k_cache"].clone(), case["v_cache"].clone()
    q = fo.rope_qkv_write(**case, backend="triton")
    changed = (case["k_cache"] != k0).any(-1).any(-1)  # [num_pages, PAGE]
    assert changed.nonzero().tolist() == [[1, 2]]
    assert torch.equal((case["v_cache"] != v0).any(-1).any(-1), changed)
    cos, sin = case["cos"], case["sin"]
    assert torch.equal(q, apply_rope(case["qkv"][..., :4 * 64].view(2, 2, 4, 64), cos, sin))


# ---------------------------------------------------------------------------------------------
# silu_mul
# ---------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter,rows", [(64, 70), (300, 21), (4864, 3)])
def test_silu_mul_parity(inter, rows, dtype):
    gen = torch.Generator().manual_seed(inter + rows)
    rows = random.Random(inter).randint(1, rows)
    gate_up = randn(1, rows, 2 * inter, dtype=dtype, gen=gen, scale=4.0)
    out = fo.silu_mul(gate_up, backend="triton")
    ref = fo.silu_mul_reference(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ref, F.silu(gate) * up)  # DraftLayer.forward's expression
    assert out.shape == (1, rows, inter) and out.is_contiguous()
    if dtype == torch.float32:  # exp's last bit is the library's
        assert_ulps(out, ref, max_ulps=8, min_identical=0.0)
    else:
        assert_ulps(out, ref, max_ulps=1, min_identical=0.999)


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter: exp(100)
def test_silu_mul_strided_rows_and_extremes():
    # rows with a gap (row stride 2I + 8); gates that over/underflow exp: silu(-100) = -0, silu(100) = 100
    gen = torch.Generator().manual_seed(3)
    inter = 40
    buf = randn(5, 2 * inter + 8, dtype=torch.bfloat16, gen=gen, scale=3.0)
    buf[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0], dtype=torch.bfloat16)
    gate_up = buf[:, :2 * inter]
    out = fo.silu_mul(gate_up, backend="triton")
    assert_ulps(out, fo.silu_mul_reference(gate_up), max_ulps=1, min_identical=0.99)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# Backends, empty inputs, input checks
# ---------------------------------------------------------------------------------------------
def test_torch_backend_is_the_reference():
    gen = torch.Generator().manual_seed(0)
    x = randn(3, 64, dtype=torch.bfloat16, gen=gen)
    w = randn(64, dtype=torch.bfloat16, gen=gen)
    out, new_res = fo.add_rms_norm(x, x, w, 1e-6, backend="torch")
    ref_out, ref_res = fo.add_rms_norm_reference(x, x, w, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(new_res, ref_res)
    assert torch.equal(fo.silu_mul(x, backend="torch"), fo.silu_mul_reference(x))
    case, _ = rope_case(2, 3, 4, 2, 64, torch.bfloat16, seed=4)
    ref_case = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    assert torch.equal(fo.rope_qkv_write(**case, backend="torch"),
                       fo.rope_qkv_write_reference(**ref_case))
    assert torch.equal(case["k_cache"], ref_case["k_cache"])


@needs_triton
def test_empty_inputs():
    w = torch.ones(64, device=DEVICE)
    out, res = fo.add_rms_norm(torch.empty(0, 64, device=DEVICE), None, w, 1e-6, backend="triton")
    assert out.shape == (0, 64)
    assert fo.silu_mul(torch.empty(2, 0, 128, device=DEVICE), backend="triton").shape == (2, 0, 64)
    case, _ = rope_case(1, 1, 4, 2, 64, torch.float32, seed=0)
    case.update(qkv=case["qkv"][:, :0], cos=case["cos"][:, :0], sin=case["sin"][:, :0],
                write_index=case["write_index"][:, :0])
    k0 = case["k_cache"].clone()
    assert fo.rope_qkv_write(**case, backend="triton").shape == (1, 0, 4, 64)
    assert torch.equal(case["k_cache"], k0)


def test_bad_inputs_are_rejected():
    f32, bf16 = torch.float32, torch.bfloat16
    x = torch.zeros(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    norm = fo.add_rms_norm
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        norm([1.0], None, w, 1e-6)
    with pytest.raises(TypeError, match="x must have dtype"):
        norm(x.long(), None, w, 1e-6)
    with pytest.raises(TypeError, match="weight must have dtype"):
        norm(x, None, w.to(bf16), 1e-6)
    with pytest.raises(ValueError, match="weight has 32 entries"):
        norm(x, None, w[:32], 1e-6)
    with pytest.raises(ValueError, match="residual .* differ"):
        norm(x, x[:2], w, 1e-6)
    with pytest.raises(ValueError, match="weight is on meta"):
        norm(x, None, w.to("meta"), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last axis"):
        norm(torch.zeros(64, 4, device=DEVICE).t(), None, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="cannot be flattened"):
        norm(torch.zeros(4, 3, 64, device=DEVICE).transpose(0, 1), None, w, 1e-6)
    with pytest.raises(ValueError, match="not supported"):
        norm(torch.zeros(1, 32768, device=DEVICE), None, torch.ones(32768, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="backend must be"):
        norm(x, None, w, 1e-6, backend="cuda")

    with pytest.raises(ValueError, match="last dim must be even"):
        fo.silu_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(TypeError, match="gate_up must have dtype"):
        fo.silu_mul(torch.zeros(2, 8, dtype=torch.float64, device=DEVICE))

    case, _ = rope_case(2, 3, 4, 2, 64, f32, seed=0)

    def rope(**kw):
        fo.rope_qkv_write(**dict(case, **kw))

    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        rope(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope(head_dim=63)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        rope(num_heads=4.0)
    with pytest.raises(ValueError, match="qkv's last dim is 512"):
        rope(num_heads=6)  # 6 % 2 == 0 but qkv is (4 + 2*2) * 64 wide
    with pytest.raises(ValueError, match=r"cos must be \[B, Q, 1, D\]"):
        rope(cos=case["cos"][:1])
    with pytest.raises(TypeError, match="sin must have dtype"):
        rope(sin=case["sin"].to(bf16))
    with pytest.raises(ValueError, match="k_cache must be"):
        rope(k_cache=case["k_cache"][:, :, :1])  # one kv head of two
    with pytest.raises(ValueError, match="k_cache .* and v_cache .* differ"):
        rope(v_cache=case["v_cache"][:2])
    with pytest.raises(TypeError, match="write_index must have dtype"):
        rope(write_index=case["write_index"].float())
    with pytest.raises(ValueError, match="write_index"):
        rope(write_index=case["write_index"][:, :1])
    with pytest.raises(ValueError, match="k_cache must be contiguous in its last axis"):
        rope(k_cache=case["k_cache"].transpose(2, 3).contiguous().transpose(2, 3))


@pytest.mark.skipif(DEVICE != "cpu", reason="the torch fallback is taken only where Triton cannot run")
def test_triton_backend_raises_where_triton_cannot_run(monkeypatch):
    monkeypatch.setattr(fo, "_pick_kernel", lambda kernel, device: (None, "no triton here"))
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="silu_mul: Triton cannot run: no triton here"):
        fo.silu_mul(x, backend="triton")
    assert torch.equal(fo.silu_mul(x), fo.silu_mul_reference(x))  # auto falls back


# ---------------------------------------------------------------------------------------------
# CUDA only: no host synchronisation, graph capture
# ---------------------------------------------------------------------------------------------
def _layer_ops(x, res, w, case, gate_up):
    normed, h = fo.add_rms_norm(x, res, w, 1e-6, backend="triton")
    q = fo.rope_qkv_write(**case, backend="triton")
    return normed, h, q, fo.silu_mul(gate_up, backend="triton")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_no_sync_and_graph_capture():
    gen = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16
    x, res = randn(8, 896, dtype=dtype, gen=gen), randn(8, 896, dtype=dtype, gen=gen)
    w = randn(896, dtype=dtype, gen=gen)
    gate_up = randn(8, 2 * 4864, dtype=dtype, gen=gen)
    case, _ = rope_case(2, 4, 14, 2, 64, dtype, seed=9)
    eager = _layer_ops(x, res, w, case, gate_up)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _layer_ops(x, res, w, case, gate_up)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _layer_ops(x, res, w, case, gate_up)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


@needs_triton
def test_triton_path_is_active():
    # guards the kernel tests: they must have run the kernels (interpreted on CPU), not a fallback
    for kernel in _KERNELS:
        assert fo._pick_kernel(kernel, torch.device(DEVICE)) == (kernel, None)
    if DEVICE == "cpu":
        assert all(fo._is_interpreted(k) for k in _KERNELS)


# ---- the draft model through the fused kernels ------------------------------------------------

@needs_triton
@pytest.mark.parametrize("prefix_then_new", [(0, 9), (7, 5)])
def test_draft_model_fused_layers_equal_the_plain_ones(tiny_models, prefix_then_new):
    """DraftModel.fused_ops: the same hidden states (within RMSNorm's few float32 ulps) and the
    same greedy tokens and KV cache as the plain torch layers, over a prefill and a masked
    forward on top of it."""
    from vllm_ouroboros.draft import DraftModel

    P, Q = prefix_then_new
    runs = []
    for fused in (False, True):
        m = DraftModel.from_pretrained(str(tiny_models["draft"]), dtype=torch.float32, device=DEVICE)
        m.allocate_cache(3, 32)
        m.fused_ops = fused
        g = torch.Generator().manual_seed(1)
        slots = torch.tensor([2, 0], device=DEVICE)
        outs = []
        if P:
            ids = torch.randint(0, m.vocab_size, (2, P), generator=g).to(DEVICE)
            causal = torch.ones(P, P, dtype=torch.bool, device=DEVICE).tril().expand(2, P, P)
            outs.append(m.forward(ids, torch.arange(P, device=DEVICE).expand(2, P), slots,
                                  torch.zeros(2, dtype=torch.long, device=DEVICE), causal, max_cache_len=0))
        ids = torch.randint(0, m.vocab_size, (2, Q), generator=g).to(DEVICE)
        mask = (torch.rand(2, Q, Q, generator=g) < 0.5).to(DEVICE) | torch.eye(Q, dtype=torch.bool, device=DEVICE)
        lens = torch.full((2,), P, device=DEVICE)
        outs.append(m.forward(ids, lens[:, None] + torch.arange(Q, device=DEVICE), slots, lens, mask,
                              max_cache_len=P))
        runs.append((outs, [m.greedy_tokens(h) for h in outs], m.k_cache.clone(), m.v_cache.clone()))
    (h0, t0, k0, v0), (h1, t1, k1, v1) = runs
    for a, b in zip(h0, h1):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5)
    for a, b in zip(t0, t1):
        assert torch.equal(a, b)
    torch.testing.assert_close(k1, k0, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(v1, v0, atol=2e-5, rtol=2e-5)
