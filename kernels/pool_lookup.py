"""A phrase pool lookup in one kernel instead of 39 launches: the drafting round's guesses and suffixes.

`PhrasePool.lookup` (vllm_ouroboros/pool.py) is the reference: each row's key's page, its
visible phrases ranked (own phrases first where the pool is shared, then newest first), the n
best returned, the page's recency and the pool's counters advanced. In torch that is gathers,
a topk, a scatter_reduce and the counters' sums, 39 launches; the drafting round looks up once
per forward and once for its suffixes (5 lookups, 218 device activities per W = G = 4 round on an
H200: results/README.md, "Session of 2026-11-27 (fourth)"). Here one program per row ranks its
page's W slots by pairwise comparison (a page's stamps are unique, so the order is topk's; only
`PhrasePool.rebase_clock`'s fallback where memory is short ties old ones), writes the
phrases in place, and moves recency and counters with atomics (rows may share a page).

In this file: the kernel, `lookup_triton` (the host side; None where Triton cannot run here,
so the pool looks up in torch), and `check_kernel`, which a pool runs once per device before it
looks up with the kernel.
"""

from __future__ import annotations

import contextlib

import torch

from vllm_ouroboros.pool import _OWN

from .triton_runtime import check_once, import_triton, pick_kernel

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

if triton is not None:

    @triton.jit
    def lookup_kernel(
        keys_ptr, slots_ptr,      # [B] int64: keys, the requesting rows' slots
        rows_ptr,                 # [B] bool (read if HAS_ROWS): rows that count and touch recency
        key_to_page_ptr, page_last_used_ptr,   # the pool's [V] int32, [P] int64
        tokens_ptr, stamp_ptr, owner_ptr,      # the pool's [P, W, L] int32, [P, W] int64, [P, W] int32
        clock_ptr, counters_ptr,               # [] int64 (before this lookup), [4] int64
        out_ptr, valid_ptr,       # [B, n, L] int64, [B, n] bool out
        V, OWN,
        n: tl.constexpr, L: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_L: tl.constexpr, SHARED: tl.constexpr, HAS_ROWS: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        key = tl.load(keys_ptr + b)
        slot = tl.load(slots_ptr + b)
        in_vocab = (key >= 0) & (key < V)
        page = tl.load(key_to_page_ptr + tl.where(in_vocab, key, 0))
        has = in_vocab & (page >= 0)
        pg = tl.maximum(page, 0).to(tl.int64)
        s = tl.arange(0, BLOCK_W)
        in_s = s < W
        # the row's "has a page" as a vector: Triton's interpreter mistypes `vector & scalar`
        has_v = (tl.zeros([BLOCK_W], tl.int32) + has.to(tl.int32)) != 0
        st = tl.load(stamp_ptr + pg * W + s, mask=in_s, other=0)
        own = tl.load(owner_ptr + pg * W + s, mask=in_s, other=-1).to(tl.int64) == slot
        visible = in_s & has_v & (st > 0)
        if SHARED:
            score = st + own.to(tl.int64) * OWN
        else:
            score = st
            visible = visible & own
        # Each visible slot's place: the visible slots ranked above it (scores are unique; ties
        # would go to the lower slot).
        above = ((score[None, :] > score[:, None]) |
                 ((score[None, :] == score[:, None]) & (s[None, :] < s[:, None]))) & visible[None, :]
        place = tl.sum(above.to(tl.int32), axis=1)
        shown = visible & (place < n)
        count = tl.minimum(tl.sum(visible.to(tl.int32), axis=0), n)
        c = tl.arange(0, BLOCK_L)[None, :]
        in_c = c < L
        tok = tl.load(tokens_ptr + (pg * W + s)[:, None] * L + c, mask=shown[:, None] & in_c, other=0)
        tl.store(out_ptr + (b * n + place)[:, None] * L + c, tok.to(tl.int64), mask=shown[:, None] & in_c)
        k = tl.arange(0, BLOCK_N)
        empty = (k >= count) & (k < n)
        tl.store(out_ptr + (b * n + k)[:, None] * L + c, tl.zeros([BLOCK_N, BLOCK_L], tl.int64),
                 mask=empty[:, None] & in_c)
        tl.store(valid_ptr + b * n + k, k < count, mask=k < n)
        if HAS_ROWS:
            real = tl.load(rows_ptr + b) != 0
        else:
            real = b >= 0
        if real:
            if has:
                tl.atomic_max(page_last_used_ptr + pg, tl.load(clock_ptr) + 1)
            tl.atomic_add(counters_ptr + 0, 1)
            tl.atomic_add(counters_ptr + 1, (count > 0).to(tl.int64))
            tl.atomic_add(counters_ptr + 2, count.to(tl.int64))
else:  # pragma: no cover
    lookup_kernel = None


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def lookup_triton(pool, keys: torch.Tensor, slots: torch.Tensor, n: int, rows: torch.Tensor | None):
    """PhrasePool.lookup in one kernel: (phrases [B, n, L] int64, valid [B, n] bool), or None
    (nothing done) where Triton cannot run on the pool's device or B is 0, so the caller looks
    up in torch. Shape: keys [B] (int), slots [B] (int), rows [B] (bool) or None; 1 <= n <= W,
    checked by the caller."""
    dev = pool.device
    kernel, _ = pick_kernel(lookup_kernel, dev, _TRITON_IMPORT_ERROR)
    B = keys.shape[0]
    if kernel is None or B == 0:
        return None
    # The kernel steps keys, slots and rows by one element: a column of a wider table is copied
    # first, a no-op where contiguous.
    keys, slots = keys.to(dev).long().contiguous(), slots.to(dev).long().contiguous()
    rows = None if rows is None else rows.to(dev, torch.bool).contiguous()
    L, W = pool.L, pool.W
    phrases = torch.empty(B, n, L, dtype=torch.int64, device=dev)
    valid = torch.empty(B, n, dtype=torch.bool, device=dev)
    launch = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with launch:
        kernel[(B,)](keys, slots, keys if rows is None else rows, pool.key_to_page, pool.page_last_used,
                     pool.tokens, pool.stamp, pool.owner, pool.clock, pool.counters, phrases, valid,
                     pool.vocab_size, _OWN, n=n, L=L, W=W, BLOCK_W=_pow2(W), BLOCK_N=_pow2(n),
                     BLOCK_L=_pow2(L), SHARED=pool.shared, HAS_ROWS=rows is not None, num_warps=1)
    pool.clock += 1
    return phrases, valid


# Devices whose kernel was compared with the torch lookup: device -> None (may look up) or why not.
_CHECKED: dict[str, str | None] = {}


def _differs(device: torch.device) -> str | None:
    """Why the kernel's lookups differ from torch's on `device` (None: they do not)."""
    from vllm_ouroboros.pool import _BUFFERS, PhrasePool

    V, L, W = 30, 3, 4
    g = torch.Generator(device).manual_seed(0)
    for shared in (True, False):
        ref, got = (PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, 8), device=device, shared=shared,
                               kernels="torch") for _ in range(2))
        keys = torch.randint(0, 12, (60,), generator=g, device=device)
        phrases = torch.randint(0, 5, (60, L), generator=g, device=device)
        owners = torch.randint(-1, 3, (60,), generator=g, device=device)
        for p in (ref, got):
            p.insert(keys, phrases, owners)
        q = torch.randint(-2, V + 2, (40,), generator=g, device=device)
        slots = torch.randint(-1, 3, (40,), generator=g, device=device)
        for rows in (None, torch.rand(40, generator=g, device=device) < 0.7):
            for n in (1, W):
                want, have = ref.lookup(q, slots, n, rows), lookup_triton(got, q, slots, n, rows)
                if have is None or not all(torch.equal(a, b) for a, b in zip(want, have)):
                    return f"the kernel's phrases differ from the torch lookup's (shared={shared}, n={n})"
                if not all(torch.equal(getattr(ref, b), getattr(got, b)) for b in _BUFFERS + ("clock",)):
                    return f"the kernel's lookup left the pool unlike torch's (shared={shared}, n={n})"
    return None


def check_kernel(device: torch.device) -> str | None:
    """None if the kernel may look up in pools on `device` (compiled and compared with the torch
    lookup, shared and not, with and without masked rows, on a pool with repeated keys, unseen
    keys and keys out of range), else why not (the pool then looks up in torch). Once per device
    and process."""
    return check_once(_CHECKED, lookup_kernel, device, _TRITON_IMPORT_ERROR, _differs)
