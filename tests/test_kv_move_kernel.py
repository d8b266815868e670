"""The KV move kernel (kernels/kv_move.py) against kv_relocate.move_kv's torch copy: every layer's
key and value caches in two launches, the same bytes moved. Compiled on a CUDA device when there
is one, else run by Triton's CPU interpreter (TRITON_INTERPRET handled as in
tests/test_fused_ops.py)."""

import pytest
import torch

from conftest import DEVICE, import_kernel_module, needs_triton
from triton_keys import Recorder, compile_key

km = import_kernel_module("vllm_ouroboros.kernels.kv_move")

from vllm_ouroboros.kv_relocate import move_kv, warm_move  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread", "triton_interpreter"), needs_triton(km, km.kv_slots_kernel)]


def layers_of(kind, n, blocks, bs, H, D, dtype, g):
    """n layers' (key, value) caches [blocks, bs, H, D] in one of vLLM's layouts."""
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=DEVICE).to(dtype)  # noqa: E731
    if kind == "separate":
        return [(rnd(blocks, bs, H, D), rnd(blocks, bs, H, D)) for _ in range(n)]
    if kind == "stacked":  # FlashAttention's [2, blocks, bs, H, D] per layer: views of one tensor
        return [tuple(rnd(2, blocks, bs, H, D).unbind(0)) for _ in range(n)]
    if kind == "d-major":  # keys stored [blocks, H, D, bs] (vLLM's CPU cache), viewed as ours
        return [tuple(rnd(blocks, H, D, bs).permute(0, 3, 1, 2) for _ in range(2)) for _ in range(n)]
    raise ValueError(kind)


def moves(g, slots, M):
    """M distinct destinations and M distinct sources, some overlapping shifts included."""
    perm = torch.randperm(slots, generator=g, device=DEVICE)
    dst = perm[:M]
    src = torch.where(torch.rand(M, generator=g, device=DEVICE) < 0.5, perm[M:2 * M], (dst + 1) % slots)
    # A shift (src = dst + 1) may read a slot another row writes: gather before scatter.
    return src, dst


@pytest.mark.parametrize("kind", ["separate", "stacked", "d-major"])
@pytest.mark.parametrize("dtype,H,D", [(torch.float32, 2, 16), (torch.float16, 3, 80),
                                       (torch.bfloat16, 1, 64)])
@pytest.mark.parametrize("caches_per_launch", [None, 1, 3])
def test_kernel_moves_what_torch_moves(kind, dtype, H, D, caches_per_launch, monkeypatch):
    """Also with the caches in groups (the gather buffer bounded by MOVE_BUFFER_BYTES): 8
    caches one by one, and in groups of 3 with a last group of 2."""
    if caches_per_launch is not None:
        monkeypatch.setattr(km, "MOVE_BUFFER_BYTES", caches_per_launch * 7 * H * D * dtype.itemsize)
    g = torch.Generator(DEVICE).manual_seed(hash((kind, D)) % 1000)
    layers = layers_of(kind, 4, 5, 16, H, D, dtype, g)
    layers = layers[2:] + layers[:2]  # the first cache is not the lowest address: negative offsets
    want = [tuple(t.clone() for t in pair) for pair in layers]
    src, dst = moves(g, 5 * 16, 7)
    move_kv(want, src, dst, backend="torch")
    assert km.move_kv_triton(layers, src, dst)
    for got, exp in zip(layers, want):
        assert torch.equal(got[0], exp[0]) and torch.equal(got[1], exp[1])


def test_overlapping_left_shift_reads_before_it_writes():
    k = torch.arange(32., device=DEVICE).view(8, 4, 1, 1).clone()
    v = k + 100
    src = torch.tensor([3, 4, 5], device=DEVICE)
    dst = torch.tensor([2, 3, 4], device=DEVICE)
    move_kv([(k, v)], src, dst, backend="triton")
    assert k.flatten()[:7].tolist() == [0., 1., 3., 4., 5., 5., 6.]
    assert v.flatten()[2:5].tolist() == [103., 104., 105.]


def test_mixed_layouts_fall_back_to_torch():
    """Caches of two block sizes share no layout: the kernel declines, move_kv copies in torch."""
    g = torch.Generator(DEVICE).manual_seed(3)
    layers = layers_of("separate", 2, 4, 16, 2, 8, torch.float32, g) + layers_of("separate", 1, 8, 8, 2, 8,
                                                                                  torch.float32, g)
    want = [tuple(t.clone() for t in pair) for pair in layers]
    src, dst = torch.tensor([9, 10], device=DEVICE), torch.tensor([5, 6], device=DEVICE)
    assert not km.move_kv_triton(layers, src, dst)
    assert all(torch.equal(a, b) for p, q in zip(layers, want) for a, b in zip(p, q))  # untouched
    move_kv(want, src, dst, backend="torch")
    move_kv(layers, src, dst, backend="triton")
    assert all(torch.equal(a, b) for p, q in zip(layers, want) for a, b in zip(p, q))


def test_nothing_to_move_and_bad_backend():
    k = torch.zeros(2, 4, 1, 8, device=DEVICE)
    empty = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert km.move_kv_triton([(k, k.clone())], empty, empty)
    with pytest.raises(ValueError, match="backend"):
        move_kv([(k, k.clone())], torch.tensor([1], device=DEVICE), torch.tensor([0], device=DEVICE),
                backend="cuda")


def test_check_kernel_passes_where_triton_runs():
    assert km.check_kernel(torch.device(DEVICE)) is None


def test_serving_moves_reuse_the_warm_ups_binaries(monkeypatch):
    """kv_relocate.warm_move, run at the engine's start on its own caches, compiles what the
    moves of a serving step launch; the check's made-up layouts do not (the caches' block size,
    heads and head dim are constexprs). The warm-up changes no cache."""
    g = torch.Generator(DEVICE).manual_seed(3)
    caches = layers_of("stacked", 3, blocks=6, bs=16, H=4, D=32, dtype=torch.float32, g=g)
    before = [tuple(t.clone() for t in pair) for pair in caches]
    launches = []
    monkeypatch.setattr(km, "pick_kernel", lambda kernel, device, error: (kernel, None))
    monkeypatch.setattr(km, "kv_slots_kernel", Recorder(km.kv_slots_kernel, launches))
    assert km.check_kernel(torch.device(DEVICE)) is None
    checked = {compile_key(*launch) for launch in launches}
    del launches[:]
    assert warm_move(caches) is None
    assert all(torch.equal(a, b) for pair, old in zip(caches, before) for a, b in zip(pair, old))
    warmed = {compile_key(*launch) for launch in launches}
    del launches[:]
    for M in (1, 3, 16, 17):
        move_kv(caches, *moves(g, 6 * 16, M), backend="triton")
    served = {compile_key(*launch) for launch in launches}
    assert len(served) == 2 and served <= warmed  # to the buffer and back
    assert not served <= checked, "the check compiles these caches' move: the warm-up is not needed"


def test_a_failed_warm_up_says_why(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(km, "move_kv_triton", broken)
    k = torch.zeros(2, 4, 1, 8, device=DEVICE)
    assert warm_move([(k, k.clone())]) == "RuntimeError: no kernel today"


def test_a_warm_up_on_caches_the_kernel_declines_says_so(monkeypatch):
    """Caches of two layouts: the kernel declines them (each move would look for one layout,
    then copy in torch), so the warm-up says why and the engine moves in torch; it reported
    success."""
    monkeypatch.setattr(km, "pick_kernel", lambda kernel, device, error: (kernel, None))
    a = torch.zeros(2, 4, 1, 8, device=DEVICE)
    b = torch.zeros(2, 4, 2, 8, device=DEVICE)
    assert "do not share one layout" in warm_move([(a, a.clone()), (b, b.clone())])
