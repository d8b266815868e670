"""A phrase pool insert in four kernels instead of 159 launches: the drafting round's largest own cost on a GPU.

`PhrasePool.insert` (vllm_ouroboros/pool.py) is the reference: it drops repeated (key, phrase)
rows, groups rows by key newest first, gives keys without a page free or least recently used pages,
and lets each key's newest phrases take its oldest slots. In torch that is L + 2 stable sorts and
~150 gathers, wheres and scatters, each a launch: on an H200 the pool's inserts were 0.68 ms of a
2.39 ms lookahead forward (results/README.md, "Session of 2026-11-27 (fourth)"). Here:

1. `rows_kernel` (a program per block of rows): whether a newer row repeats this row's key and
   phrase (pairwise, no sort), the page of its key, and the pages this call's keys hold, which
   may not be recycled.
2. `groups_kernel` (a program per block of rows): each kept row's rank among its key's kept rows
   (0 = newest) and its group's newest row; a row of rank < W writes its index into the group's
   member table [N, W] at its rank.
3. `page_scores_kernel` (a program per block of pages): each page's eviction score as the torch
   insert computes it (free pages first, then least recently used, ties by index; this call's
   pages never); torch's topk then picks the candidates.
4. `place_kernel` (a program per row; only each group's newest row works): a key without a page
   takes the candidate of its rank among such keys (newest first), evicting the page's old key;
   then the group's phrases clear their old slots and take the page's oldest ones.

Groups own distinct pages and keys, so no two programs of one launch write the same place. No
host sync: the launches can be captured in a CUDA graph, as the drafting round does.

In this file: the kernels, `insert_triton` (the host side; False where Triton cannot run here, so
the pool inserts in torch), and `check_kernel`, which a pool runs once per device before it
inserts with the kernels.
"""

from __future__ import annotations

import contextlib

import torch

from vllm_ouroboros.pool import _NEVER

from .triton_runtime import check_once, import_triton, pick_kernel

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

# The kernels compare rows pairwise (N^2 / 2 compares where torch sorts): past this many rows
# (a long prompt's context phrases, once per request) the torch insert runs instead. The
# drafting round's and the steps' inserts are far smaller.
MAX_ROWS = 4096

# Rows per program of the pairwise kernels (64 would hold 150-250 registers a thread at 4 warps
# on sm_80/sm_90; 32 holds 48-80, no spills: `scripts/bench_pool_ops.py --compile-only`),
# pages per program of the scores.
_ROWS = 32
_PAGES = 1024

if triton is not None:

    @triton.jit
    def _kept_rows(keys_ptr, valid_ptr, idx, N, V, HAS_VALID: tl.constexpr):
        """(keys, whether each row counts) at row indices idx: in range, key in the vocabulary,
        valid where given."""
        inside = idx < N
        key = tl.load(keys_ptr + idx, mask=inside, other=-1)
        keep = inside & (key >= 0) & (key < V)
        if HAS_VALID:
            keep = keep & (tl.load(valid_ptr + idx, mask=inside, other=0) != 0)
        return key, keep

    @triton.jit(do_not_specialize=["N"])
    def rows_kernel(
        keys_ptr,              # [N] int64
        phrases_ptr,           # [N, L] any integer dtype
        owners_ptr,            # [N] int64 (read if OWNED)
        valid_ptr,             # [N] bool (read if HAS_VALID)
        key_to_page_ptr,       # [V] int32, the pool's
        kept_ptr,              # [N] int32 out: 1 = the newest row of its (key, phrase)
        page_ptr,              # [N] int32 out: the page of the row's key before this call, -1 none
        protect_ptr,           # [P] int8, zeros in: 1 at the pages this call's keys hold
        N, V, s_ph0, s_ph1,
        L: tl.constexpr, HAS_VALID: tl.constexpr, OWNED: tl.constexpr, BLOCK: tl.constexpr,
    ):
        start = tl.program_id(0) * BLOCK
        i = start + tl.arange(0, BLOCK)
        in_i = i < N
        key_i, keep_i = _kept_rows(keys_ptr, valid_ptr, i, N, V, HAS_VALID)
        dup = tl.zeros([BLOCK], dtype=tl.int32)
        # Later rows are newer; only they can make this row a repeat, so blocks before this one
        # are skipped.
        for j0 in range(start, N, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            in_j = j < N
            key_j, keep_j = _kept_rows(keys_ptr, valid_ptr, j, N, V, HAS_VALID)
            # token ids and keys fit int32: half the registers of the [BLOCK, BLOCK] compares
            eq = ((key_i.to(tl.int32)[:, None] == key_j.to(tl.int32)[None, :]) & keep_j[None, :]
                  & (j[None, :] > i[:, None]))
            for c in tl.static_range(L):
                p_i = tl.load(phrases_ptr + i * s_ph0 + c * s_ph1, mask=in_i, other=0).to(tl.int32)
                p_j = tl.load(phrases_ptr + j * s_ph0 + c * s_ph1, mask=in_j, other=0).to(tl.int32)
                eq = eq & (p_i[:, None] == p_j[None, :])
            if OWNED:  # a private pool: (key, phrase, owner) is the phrase
                o_i = tl.load(owners_ptr + i, mask=in_i, other=-1).to(tl.int32)
                o_j = tl.load(owners_ptr + j, mask=in_j, other=-1).to(tl.int32)
                eq = eq & (o_i[:, None] == o_j[None, :])
            dup = tl.maximum(dup, tl.max(eq.to(tl.int32), axis=1))
        page = tl.load(key_to_page_ptr + tl.where(keep_i, key_i, 0), mask=keep_i, other=-1)
        tl.store(kept_ptr + i, (keep_i & (dup == 0)).to(tl.int32), mask=in_i)
        tl.store(page_ptr + i, page, mask=in_i)
        tl.store(protect_ptr + tl.maximum(page, 0), tl.full([BLOCK], 1, tl.int8), mask=keep_i & (page >= 0))

    @triton.jit(do_not_specialize=["N"])
    def groups_kernel(
        keys_ptr,              # [N] int64
        kept_ptr,              # [N] int32 (rows_kernel)
        rank_ptr,              # [N] int32 out: rank among the key's kept rows, 0 = newest; -1 not kept
        members_ptr,           # [N, W] int32 out, rows of group leaders: the rows of rank 0..W-1, -1 past the group
        N,
        W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_i = i < N
        key_i = tl.load(keys_ptr + i, mask=in_i, other=-1)
        kept_i = tl.load(kept_ptr + i, mask=in_i, other=0) != 0
        newer = tl.zeros([BLOCK], dtype=tl.int32)
        older = tl.zeros([BLOCK], dtype=tl.int32)
        leader = i
        for j0 in range(0, N, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            in_j = j < N
            key_j = tl.load(keys_ptr + j, mask=in_j, other=-1)
            kept_j = tl.load(kept_ptr + j, mask=in_j, other=0) != 0
            same = (key_i.to(tl.int32)[:, None] == key_j.to(tl.int32)[None, :]) & kept_j[None, :] & kept_i[:, None]
            newer += tl.sum((same & (j[None, :] > i[:, None])).to(tl.int32), axis=1)
            older += tl.sum((same & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
            leader = tl.maximum(leader, tl.max(tl.where(same, j[None, :], -1), axis=1))
        tl.store(rank_ptr + i, tl.where(kept_i, newer, -1), mask=in_i)
        tl.store(members_ptr + leader * W + newer, i, mask=kept_i & (newer < W))
        r = tl.arange(0, BLOCK_W)[None, :]
        past = (kept_i & (newer == 0))[:, None] & (r >= older[:, None] + 1) & (r < W)
        tl.store(members_ptr + i[:, None] * W + r, tl.full([BLOCK, BLOCK_W], -1, tl.int32), mask=past)

    @triton.jit(do_not_specialize=["P"])
    def page_scores_kernel(
        page_key_ptr,          # [P] int32, the pool's
        page_last_used_ptr,    # [P] int64, the pool's
        protect_ptr,           # [P] int8 (rows_kernel)
        score_ptr,             # [P] int64 out
        P, NEVER,
        BLOCK: tl.constexpr,
    ):
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = p < P
        free = tl.load(page_key_ptr + p, mask=ok, other=-1) < 0
        last = tl.load(page_last_used_ptr + p, mask=ok, other=0)
        # recency * P + index: unique scores, so the k smallest are the same pages whatever k
        score = tl.where(free, -1, last) * P + p.to(tl.int64)
        held = tl.load(protect_ptr + p, mask=ok, other=0) != 0
        tl.store(score_ptr + p, tl.where(held, NEVER, score), mask=ok)

    @triton.jit(do_not_specialize=["N", "K"])
    def place_kernel(
        keys_ptr, phrases_ptr, owners_ptr,   # [N] int64, [N, L], [N] int64
        rank_ptr, page_ptr, members_ptr,     # groups_kernel's and rows_kernel's outputs
        cand_ptr, cand_score_ptr,            # [K] int64: pages by eviction order, their scores
        key_to_page_ptr, page_key_ptr, page_last_used_ptr,   # the pool's tables
        tokens_ptr, stamp_ptr, owner_ptr,    # [P, W, L] int32, [P, W] int64, [P, W] int32
        clock_ptr, counters_ptr,             # [] int64 (before this call's stamps), [4] int64
        N, K, NEVER, s_ph0, s_ph1,
        L: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK: tl.constexpr,
        OWNED: tl.constexpr,
    ):
        i = tl.program_id(0)
        if tl.load(rank_ptr + i) == 0:  # the newest row of its key works for the whole group
            key = tl.load(keys_ptr + i)
            page = tl.load(page_ptr + i)
            need = page < 0
            # Keys without a page take candidates in order, newest key first: count the newer ones.
            ahead = tl.zeros([BLOCK], dtype=tl.int32)
            if need:
                for j0 in range(i + 1, N, BLOCK):
                    j = j0 + tl.arange(0, BLOCK)
                    in_j = j < N
                    r_j = tl.load(rank_ptr + j, mask=in_j, other=-1)
                    p_j = tl.load(page_ptr + j, mask=in_j, other=0)
                    ahead += ((r_j == 0) & (p_j < 0)).to(tl.int32)
            ahead_n = tl.sum(ahead, axis=0)
            at = tl.minimum(ahead_n, K - 1)
            c_page = tl.load(cand_ptr + at).to(tl.int32)
            got = need & (ahead_n < K) & (tl.load(cand_score_ptr + at) < NEVER)
            old_key = tl.load(page_key_ptr + c_page, mask=got, other=-1)
            evict = got & (old_key >= 0)
            tl.store(key_to_page_ptr + tl.maximum(old_key, 0), -1, mask=evict)
            tl.atomic_add(counters_ptr + 3, evict.to(tl.int64), mask=evict)
            tl.store(key_to_page_ptr + key, c_page, mask=got)
            tl.store(page_key_ptr + c_page, key.to(tl.int32), mask=got)
            page = tl.where(got, c_page, page)
            if page >= 0:
                pg = page.to(tl.int64)
                s = tl.arange(0, BLOCK_W)
                in_s = s < W
                st = tl.load(stamp_ptr + pg * W + s, mask=in_s, other=0)
                st = tl.where(got, 0, st)  # a recycled page starts empty
                # A re-inserted phrase gives up its old slot, so it is stored once, as newest.
                mem = tl.load(members_ptr + i * W + s, mask=in_s, other=-1)  # by rank
                live = mem >= 0
                row_r = tl.maximum(mem, 0).to(tl.int64)
                same = live[:, None] & (st > 0)[None, :] & in_s[None, :]
                for c in tl.static_range(L):
                    mine = tl.load(phrases_ptr + row_r * s_ph0 + c * s_ph1, mask=live, other=0)
                    theirs = tl.load(tokens_ptr + (pg * W + s) * L + c, mask=in_s, other=0)
                    same = same & (mine.to(tl.int64)[:, None] == theirs.to(tl.int64)[None, :])
                if OWNED:  # a private pool: only the row's owner's copy gives up its slot
                    mine_o = tl.load(owners_ptr + row_r, mask=live, other=-1)
                    theirs_o = tl.load(owner_ptr + pg * W + s, mask=in_s, other=-1)
                    same = same & (mine_o.to(tl.int64)[:, None] == theirs_o.to(tl.int64)[None, :])
                st = tl.where(tl.max(same.to(tl.int32), axis=0) > 0, 0, st)
                # The c newest phrases take the c oldest (or empty) slots: slot s's place in a
                # stable sort by stamp, compared with the group's rank.
                first = ((st[None, :] < st[:, None]) |
                         ((st[None, :] == st[:, None]) & (s[None, :] < s[:, None]))) & in_s[None, :]
                pos = tl.sum(first.to(tl.int32), axis=1)
                take = in_s & (pos < tl.sum(live.to(tl.int32), axis=0))
                row = tl.load(members_ptr + i * W + pos, mask=take, other=0).to(tl.int64)
                t0 = tl.load(clock_ptr)
                tl.store(stamp_ptr + pg * W + s, tl.where(take, t0 + 1 + row, st), mask=in_s)
                for c in tl.static_range(L):
                    tok = tl.load(phrases_ptr + row * s_ph0 + c * s_ph1, mask=take, other=0)
                    tl.store(tokens_ptr + (pg * W + s) * L + c, tok.to(tl.int32), mask=take)
                own = tl.load(owners_ptr + row, mask=take, other=-1)
                tl.store(owner_ptr + pg * W + s, own.to(tl.int32), mask=take)
                last = tl.load(page_last_used_ptr + pg)
                tl.store(page_last_used_ptr + pg, tl.maximum(last, t0 + N))
else:  # pragma: no cover
    rows_kernel = groups_kernel = page_scores_kernel = place_kernel = None


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def insert_triton(pool, keys: torch.Tensor, phrases: torch.Tensor, owners: torch.Tensor,
                  valid: torch.Tensor | None) -> bool:
    """PhrasePool.insert's effect on `pool` in four kernels (and torch's topk); False (nothing
    done) where Triton cannot run on the pool's device or N > MAX_ROWS, so the caller inserts
    in torch.

    Shape: keys [N] (int), phrases [N, L] (int), owners [N] (int), valid [N] (bool) or None,
    N >= 1; already checked by the caller. The pool's tables must be contiguous (as it makes them)."""
    dev = pool.device
    kernel, _ = pick_kernel(place_kernel, dev, _TRITON_IMPORT_ERROR)
    if kernel is None or keys.shape[0] > MAX_ROWS:
        return False
    N, L, W, P = keys.shape[0], pool.L, pool.W, pool.num_pages
    # The kernels step keys, owners and valid by one element (phrases by their strides): a column
    # of a wider table (a caller's packed upload) is copied first, a no-op where contiguous.
    keys, owners = keys.to(dev).long().contiguous(), owners.to(dev).long().contiguous()
    phrases = phrases.to(dev)
    valid = None if valid is None else valid.to(dev, torch.bool).contiguous()
    scratch = torch.empty(3, N, dtype=torch.int32, device=dev)
    kept, page, rank = scratch.unbind(0)
    members = torch.empty(N, W, dtype=torch.int32, device=dev)
    protect = torch.zeros(P, dtype=torch.int8, device=dev)
    score = torch.empty(P, dtype=torch.int64, device=dev)
    block = min(_ROWS, max(16, _pow2(N)))
    rows_grid = (triton.cdiv(N, block),)
    ph = dict(s_ph0=phrases.stride(0), s_ph1=phrases.stride(1))
    launch = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with launch:
        rows_kernel[rows_grid](keys, phrases, owners, keys if valid is None else valid, pool.key_to_page,
                               kept, page, protect, N, pool.vocab_size, **ph,
                               L=L, HAS_VALID=valid is not None, OWNED=not pool.shared, BLOCK=block)
        groups_kernel[rows_grid](keys, kept, rank, members, N, W=W, BLOCK_W=_pow2(W), BLOCK=block)
        page_scores_kernel[(triton.cdiv(P, _PAGES),)](pool.page_key, pool.page_last_used, protect,
                                                      score, P, _NEVER, BLOCK=_PAGES)
        k = min(N, P)
        cand_score, cand = score.topk(k, largest=False)
        place_kernel[(N,)](keys, phrases, owners, rank, page, members, cand, cand_score,
                           pool.key_to_page, pool.page_key, pool.page_last_used, pool.tokens,
                           pool.stamp, pool.owner, pool.clock, pool.counters, N, k, _NEVER, **ph,
                           L=L, W=W, BLOCK_W=_pow2(W), BLOCK=block, OWNED=not pool.shared, num_warps=1)
    pool.clock += N
    return True


# Devices whose kernels were compared with the torch insert: device -> None (may insert) or why not.
_CHECKED: dict[str, str | None] = {}


def _differs(device: torch.device) -> str | None:
    """Where the kernels' inserts leave a pool unlike torch's on `device` (None: nowhere)."""
    from vllm_ouroboros.pool import _BUFFERS, PhrasePool

    V, L, W, pages = 40, 3, 4, 6
    budget = PhrasePool.budget_for(V, L, W, pages)
    for shared in (True, False):  # private pools compile and run the OWNED variant
        ref, got = (PhrasePool(V, L, W, budget, device=device, shared=shared, kernels=b) for b in ("torch", "triton"))
        g = torch.Generator(device).manual_seed(0)
        for n in (5, 37, 70, 12):
            keys = torch.randint(-2, V + 2, (n,), generator=g, device=device)
            keys[n // 2:] = keys[:n - n // 2] % 7  # repeated keys: groups larger than W
            phrases = torch.randint(0, 3, (n, L), generator=g, device=device)
            owners = torch.randint(-1, 3, (n,), generator=g, device=device)
            valid = torch.rand(n, generator=g, device=device) < 0.85
            for p in (ref, got):
                p.insert(keys, phrases, owners, valid)
        for b in _BUFFERS + ("clock",):
            if not torch.equal(getattr(ref, b), getattr(got, b)):
                return (f"the kernels' insert left the {'shared' if shared else 'private'} pool's {b} "
                        "unlike the torch insert's")
    return None


def check_kernel(device: torch.device) -> str | None:
    """None if the kernels may insert into pools on `device` (compiled and compared with the
    torch insert on small pools, shared and private: repeats, masked rows, more rows per key
    than slots, evictions), else why not (the pool then inserts in torch). Checked once per
    device and process."""
    return check_once(_CHECKED, place_kernel, device, _TRITON_IMPORT_ERROR, _differs)
