"""Copying KV slots in every attention layer at once: two launches (per group of caches under
MOVE_BUFFER_BYTES: one group in the usual case) instead of two per layer cache.

When a suffix k >= 1 wins a tree step, its nodes' keys and values are copied left into the slots
vLLM expects (kv_relocate.move_kv). In torch that is a gather and a scatter per key cache and per
value cache of every layer: 4 x layers advanced-indexing calls (112 for a 28-layer target), each
a launch with its host overhead, on every step that relocates. The layers' caches are separate
tensors of one shape, dtype and strides, so one program grid covers them all: each cache is
addressed by its element offset from the first one's data pointer. A gather into a scratch
buffer, then a scatter from it, as the torch path does: a request's source and destination slots
may overlap (a left shift), and one launch that read and wrote them would race.

In this file: the two kernels, the host wrapper `move_kv_triton` (None where Triton cannot run or
the caches do not share a layout: the caller keeps the torch path), and `check_kernel`, which an
engine runs at its start.
"""

from __future__ import annotations

import contextlib

import torch

from .triton_runtime import import_triton, pick_kernel

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

if triton is not None:

    # Slot counts and offsets change every step: nothing but the layout picks the binary.
    @triton.jit(do_not_specialize=["offsets_ptr", "slots_ptr", "buf_ptr", "M"])
    def kv_slots_kernel(
        base_ptr,               # the first cache's data: every cache is addressed from it
        offsets_ptr,            # [C] int64 element offset of cache c from base_ptr
        slots_ptr,              # [M] int64 slots (block * BLOCK_SIZE + position in the block)
        buf_ptr,                # [C, M, H, D] scratch, the caches' dtype
        M,
        s_blk, s_pos, s_head, s_dim,  # the caches' strides (elements), shared by all
        BLOCK_SIZE: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TO_BUF: tl.constexpr,
    ):
        c = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots_ptr + m)
        base = tl.load(offsets_ptr + c) + (slot // BLOCK_SIZE) * s_blk + (slot % BLOCK_SIZE) * s_pos
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < H) & (d < D)
        cache = base_ptr + base + h * s_head + d * s_dim
        buf = buf_ptr + ((c * M + m) * H + h) * D + d
        if TO_BUF:
            tl.store(buf, tl.load(cache, mask=ok), mask=ok)
        else:
            tl.store(cache, tl.load(buf, mask=ok), mask=ok)
else:  # pragma: no cover
    kv_slots_kernel = None

# Layouts whose offsets were computed: the same caches come back every step.
_OFFSETS: dict[tuple, torch.Tensor] = {}
# Bytes of the gather buffer of one launch pair: the caches go in groups under it. All of a
# large model's caches at once took M tokens x 56 caches x Hkv x D (235 MB for 2,048 tokens of
# 8 x 128 bf16), memory vLLM's profiling run never saw.
MOVE_BUFFER_BYTES = 32 << 20


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _offsets(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """[C] int64 element offsets of each cache from the first, on their device (cached per set
    of caches); None where the caches differ in shape, dtype, strides or device, or one does not
    start on an element boundary of the first."""
    first = caches[0]
    # Every cache's address, and the first's layout: the others' layouts were checked equal to
    # it when these addresses were first seen (a key of every cache's layout cost ~56 us per
    # step for 56 caches on the 2-core CPU here, this one ~9 us).
    key = (tuple(c.data_ptr() for c in caches), first.shape, first.stride(), first.dtype, first.device)
    hit = _OFFSETS.get(key)
    if hit is not None:
        return hit
    size = first.element_size()
    deltas = []
    for c in caches:
        if (c.shape, c.stride(), c.dtype, c.device) != (first.shape, first.stride(), first.dtype, first.device):
            return None
        delta = c.data_ptr() - first.data_ptr()
        if delta % size:
            return None
        deltas.append(delta // size)
    if len(_OFFSETS) > 64:  # caches reallocated (a new engine in this process): forget the old
        _OFFSETS.clear()
    out = _OFFSETS[key] = torch.tensor(deltas, dtype=torch.int64, device=first.device)
    return out


def move_kv_triton(caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor,
                   dst: torch.Tensor) -> bool:
    """kv_relocate.move_kv's copy in two launches per group of caches; False (nothing done)
    where Triton cannot run here or the caches do not share one layout, so the caller copies
    in torch.

    Shape: each cache [num_blocks, block_size, Hkv, D] (any strides, the same for all); src, dst
    [M] int64 slots on the caches' device."""
    flat = [t for pair in caches for t in pair]
    if not flat:
        return True
    first = flat[0]
    kernel, _ = pick_kernel(kv_slots_kernel, first.device, _TRITON_IMPORT_ERROR)
    if kernel is None:
        return False
    offsets = _offsets(flat)
    if offsets is None:
        return False
    M = src.numel()
    if M == 0:
        return True
    _, bs, H, D = first.shape
    meta = dict(BLOCK_SIZE=bs, H=H, D=D, BLOCK_H=_pow2(H), BLOCK_D=_pow2(D),
                num_warps=4 if H * D >= 1024 else 1)
    moves = ((src.long().contiguous(), True), (dst.long().contiguous(), False))
    group = max(1, MOVE_BUFFER_BYTES // (M * H * D * first.element_size()))
    launch = torch.cuda.device(first.device) if first.device.type == "cuda" else contextlib.nullcontext()
    with launch:
        for i in range(0, len(flat), group):  # offsets stay relative to `first`
            offs = offsets[i:i + group]
            buf = torch.empty(offs.numel(), M, H, D, dtype=first.dtype, device=first.device)
            for slots, to_buf in moves:
                kernel[(offs.numel(), M)](first, offs, slots, buf, M, *first.stride(), TO_BUF=to_buf, **meta)
    return True


def check_kernel(device: torch.device) -> str | None:
    """Compile and compare with the torch copy before serving: None if the kernel may serve,
    else why not (the caller then copies in torch). Small caches of a few layouts and dtypes,
    a left shift that overlaps its source (as a winning suffix's move does)."""
    from vllm_ouroboros.kv_relocate import move_kv

    kernel, reason = pick_kernel(kv_slots_kernel, device, _TRITON_IMPORT_ERROR)
    if kernel is None:
        return reason
    try:
        g = torch.Generator(device).manual_seed(0)
        for dtype, H, D in ((torch.bfloat16, 2, 64), (torch.float16, 3, 80), (torch.float32, 1, 16)):
            caches = [tuple(torch.randn(6, 16, H, D, generator=g, device=device).to(dtype) for _ in range(2))
                      for _ in range(3)]
            want = [tuple(t.clone() for t in pair) for pair in caches]
            src = torch.tensor([21, 22, 23, 40, 41], device=device)
            dst = torch.tensor([19, 20, 21, 33, 34], device=device)  # 21 is read and written
            move_kv(want, src, dst, backend="torch")
            if not move_kv_triton(caches, src, dst):
                return "the kernel declined caches of one layout"
            if not all(torch.equal(a, b) for p, q in zip(caches, want) for a, b in zip(p, q)):
                return f"the kernel's copy differs from torch's ({dtype}, H={H}, D={D})"
    except Exception as e:  # noqa: BLE001 - any failure means: keep the torch copy
        return f"the kernel failed its check: {type(e).__name__}: {e}"
    return None
