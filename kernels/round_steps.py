"""The drafting round's own work around each draft forward in two kernels instead of ~90 launches.

Each forward of a device round (vllm_ouroboros/draft/device_round.py) is wrapped in small torch
work: before it, the fed tokens (uncached | window | guesses), the per-row mask and positions
(`lookahead.row_inputs`) and the attention metadata (`attention.build_attention_metadata`);
after it, the lookahead result (`lookahead.read_output`) and the round's bookkeeping (draft
columns, window, counters, next inputs). In torch that is about 90 launches per forward at
W = G = 4, 20 of them in the model's metadata (`python scripts/round_launches.py --tiny`;
results/README.md, "Session of 2026-11-27 (seventh)"), each a CUDA graph node of ~2 us on an
H200 while the real draft's own kernels are ~230 per forward. Here:

  prepare_kernel   one program per row: the forward's token ids, RoPE positions, write index
                   of each new token's K/V, the tree-attention kernel's ancestor bitmasks, its
                   block-table rows, prefix lengths and query starts;
  commit_kernel    one program per row: the best guess's right prefix, the new tokens, the
                   draft columns they fill, the next window, the phrases for the pool insert
                   and every counter of the row, as `device_round.commit_torch` does.

Their torch references are the round's own torch path (`device_round.forward_inputs_torch`,
`device_round.commit_torch`); `check_kernel` compares them once per device before a round uses
the kernels. The bitmask holds one int64 per query, so the prepared forward serves at most
MAX_KERNEL_QUERIES (64) new tokens per row and runs through the tree-attention kernel; wider forwards
(and the torch attention path) keep the torch preparation. The adaptive draft length
(acceptance head) keeps the torch commit: its rule reads the forward's hidden states.

No vLLM imports.
"""

from __future__ import annotations

import contextlib

import torch

from vllm_ouroboros.draft.attention import MAX_KERNEL_QUERIES

# pick_kernel: every kernel module offers it (tests/conftest.needs_triton reads it from here)
from .triton_runtime import check_once, import_triton, pick_kernel  # noqa: F401

triton, tl, _TRITON_IMPORT_ERROR = import_triton()


if triton is not None:

    @triton.jit
    def prepare_kernel(
        unc_ptr, unc_stride,      # [A, >= U] int64: uncached tokens (first u real)
        u_ptr, u_stride,          # [A] int64 (strided view): real uncached tokens, 1..U
        kv_ptr, slots_ptr,        # [A] int64: committed cache lengths, cache slots
        window_ptr,               # [S, L, WA] int64: the runtime's Jacobi windows (first W columns used)
        guesses_ptr,              # [A, G, L] int64: the pool's guesses
        static_bits_ptr, pos_offset_ptr,   # [Q] int64: the layout's mask rows as bits, offsets
        block_table_ptr, MP, page_size,    # [S, MP] int32: the draft cache's block table
        ids_ptr, positions_ptr, write_index_ptr,   # [A, Q] int64 out
        tree_mask_ptr,            # [A * Q] int64 out: bit j' of query j: j sees new token j'
        lens_ptr,                 # [A] int32 out: prefix lengths
        query_start_ptr,          # [A + 1] int32 out
        block_rows_ptr,           # [A, MP] int32 out
        out_rows_ptr,             # [A, 1 + Q - U] int64 out: lookahead.output_index
        A, U: tl.constexpr, W: tl.constexpr, WA: tl.constexpr, L: tl.constexpr, G: tl.constexpr,
        Q: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        u = tl.load(u_ptr + b * u_stride)
        kv = tl.load(kv_ptr + b)
        slot = tl.load(slots_ptr + b)
        j = tl.arange(0, BLOCK_Q)
        in_q = j < Q
        is_unc = j < U
        tok = tl.load(unc_ptr + b * unc_stride + j, mask=is_unc, other=0)
        if W > 0:
            i = j - U  # window token i = l * W + c: level l of column c
            in_win = (i >= 0) & (i < W * L)
            iw = tl.where(in_win, i, 0)
            tok = tl.where(in_win, tl.load(window_ptr + (slot * L + iw // W) * WA + iw % W, mask=in_win,
                                           other=0), tok)
        if G > 0:
            i = j - U - W * L
            in_g = (i >= 0) & (i < G * L)
            tok = tl.where(in_g, tl.load(guesses_ptr + b * (G * L) + tl.where(in_g, i, 0), mask=in_g,
                                         other=0), tok)
        tl.store(ids_ptr + b * Q + j, tok, mask=in_q)
        off = tl.load(pos_offset_ptr + j, mask=in_q, other=0)
        tl.store(positions_ptr + b * Q + j, tl.where(is_unc, kv + off, kv + u - 1 + off), mask=in_q)
        # Padding uncached columns (j in [u, U)) are hidden from every query and see only themselves
        # (lookahead.row_inputs). Distinct powers of two: their sum is their OR.
        pad = is_unc & (j >= u)
        bit = tl.full([BLOCK_Q], 1, tl.int64) << j.to(tl.int64)
        # a vector, not a scalar: Triton's interpreter mistypes `vector & scalar`
        pad_bits = tl.zeros([BLOCK_Q], tl.int64) + tl.sum(tl.where(pad & in_q, bit, 0), axis=0)
        static = tl.load(static_bits_ptr + j, mask=in_q, other=0)
        tl.store(tree_mask_ptr + b * Q + j, tl.where(pad, bit, static & ~pad_bits), mask=in_q)
        # New token j is cache token kv + j of the slot (a position past the table writes to
        # the null page, 0, as build_attention_metadata has it).
        at = kv + j
        col = at // page_size
        page = tl.load(block_table_ptr + slot * MP + tl.minimum(col, MP - 1), mask=in_q & (col < MP), other=0)
        tl.store(write_index_ptr + b * Q + j, page.to(tl.int64) * page_size + at % page_size, mask=in_q)
        # The hidden rows the LM head reads (row b's last real uncached column, then its window
        # and guess columns), as flat rows of the forward's [A * Q, H] output.
        tl.store(out_rows_ptr + b * (1 + Q - U) + j, b * Q + tl.where(j == 0, u - 1, U - 1 + j),
                 mask=j < 1 + Q - U)
        tl.store(lens_ptr + b, kv.to(tl.int32))
        tl.store(query_start_ptr + b, (b * Q).to(tl.int32))
        if b == A - 1:
            # (b + 1) * Q, not A * Q: Triton compiles an int argument equal to 1 as a constant, so
            # where A = 1 (one request) A * Q is a Python int, which has no `.to`.
            tl.store(query_start_ptr + b + 1, ((b + 1) * Q).to(tl.int32))
        for p0 in range(0, MP, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            tl.store(block_rows_ptr + b * MP + p, tl.load(block_table_ptr + slot * MP + p, mask=p < MP),
                     mask=p < MP)

    @triton.jit
    def commit_kernel(
        ids_ptr,                  # [A, Q] int64: the forward's fed tokens (window at U, guesses after)
        tokens_ptr,               # [A, 1 + Q - U] int64: the draft's token after the last real
                                  # uncached one, then after each window and guess column
        gvalid_ptr,               # [A, G] bool
        slots_ptr, u_ptr, u_stride,
        cap_ptr, active_ptr, kv_ptr, dlen_ptr, row_forwards_ptr, guess_tokens_ptr, guess_hits_ptr,
        last_take_ptr,            # the RoundState rows (device_round.RoundState), updated in place
        drafts_ptr, drafts_stride, next_unc_ptr, next_u_ptr,
        window_ptr,               # [S, L, WA] int64: the row's window slides in place
        keys_ptr, phrases_ptr, ins_slots_ptr, ins_valid_ptr,   # [A, W], [A, W, L], [A, W], [A, W] out
        U: tl.constexpr, W: tl.constexpr, WA: tl.constexpr, L: tl.constexpr, G: tl.constexpr,
        Q: tl.constexpr, MAX_DRAFT: tl.constexpr, GOAL: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        R = 1 + Q - U
        rest_ptr = tokens_ptr + 1  # the window and guess columns' tokens: row b at b * R
        # Every read of a tensor this program writes comes first, then a barrier: u may be
        # next_u itself (the round's later forwards), and all threads must read before any writes.
        act = tl.load(active_ptr + b) != 0
        cap = tl.minimum(tl.load(cap_ptr + b), MAX_DRAFT)  # the row's cut, else the round's bound
        slot = tl.load(slots_ptr + b)
        u = tl.load(u_ptr + b * u_stride)
        kv = tl.load(kv_ptr + b)
        dlen = tl.load(dlen_ptr + b)
        row_forwards = tl.load(row_forwards_ptr + b)
        guess_tokens = tl.load(guess_tokens_ptr + b)
        guess_hits = tl.load(guess_hits_ptr + b)
        last_take = tl.load(last_take_ptr + b)
        t1 = tl.load(tokens_ptr + b * R)
        k = tl.arange(0, BLOCK_T)  # token k of the forward's chain, 0..L
        if G > 0:
            g = tl.arange(0, BLOCK_G)
            in_g = g < G
            kk = k[None, :]
            in_k = in_g[:, None] & (kk < L)
            # Guess token k is right iff it equals the draft's prediction at its place: t1 for
            # k = 0, the output after guess token k - 1 otherwise (lookahead.read_output).
            fed = tl.load(ids_ptr + b * Q + U + W * L + g[:, None] * L + kk, mask=in_k, other=0)
            prev = tl.load(rest_ptr + b * R + W * L + g[:, None] * L + kk - 1, mask=in_k & (kk > 0), other=0)
            gv = tl.load(gvalid_ptr + b * G + g, mask=in_g, other=0) != 0
            right = (fed == tl.where(kk == 0, t1, prev)) & in_k & gv[:, None]
            hits = tl.where(in_g, tl.min(tl.where(right, BLOCK_T, kk), axis=1), -1)  # right prefix
            best_hits = tl.max(hits, axis=0)
            best = tl.min(tl.where(hits == best_hits, g, BLOCK_G), axis=0)  # first best on ties
            after = tl.load(rest_ptr + b * R + W * L + best * L + k - 1, mask=(k >= 1) & (k <= L), other=0)
            chain = tl.where(k == 0, t1, after)
        else:
            best_hits = 0
            chain = tl.where(k == 0, t1, 0)
        num_new = best_hits + 1
        new_tokens = tl.where(k < num_new, chain, 0)
        take = tl.where(act, tl.minimum(num_new, tl.maximum(cap - dlen, 0)), 0)
        if W > 0:
            lv = k[:, None]
            c = tl.arange(0, BLOCK_W)[None, :]
            in_lc = (lv < L) & (c < W)
            wout = tl.load(rest_ptr + b * R + lv * W + c, mask=in_lc, other=0)  # [level, column]
            keys = tl.load(ids_ptr + b * Q + U + tl.arange(0, BLOCK_W), mask=tl.arange(0, BLOCK_W) < W, other=0)
        tl.debug_barrier()
        if W > 0:
            cw = tl.arange(0, BLOCK_W)
            # Column c's trajectory [key, o[0][c], .., o[L-1][c]] is a fresh phrase for the pool.
            tl.store(keys_ptr + b * W + cw, keys, mask=cw < W)
            tl.store(phrases_ptr + (b * W + c) * L + lv, wout, mask=in_lc)
            tl.store(ins_slots_ptr + b * W + cw, tl.zeros([BLOCK_W], tl.int64) + slot, mask=cw < W)
            tl.store(ins_valid_ptr + b * W + cw, (tl.zeros([BLOCK_W], tl.int32) + act.to(tl.int32)) != 0,
                     mask=cw < W)
            if act:
                tl.store(window_ptr + (slot * L + lv) * WA + c, wout, mask=in_lc)
        tl.store(drafts_ptr + b * drafts_stride + dlen + k, new_tokens, mask=k < take)
        tl.store(next_unc_ptr + b * (L + 1) + k, new_tokens, mask=k < L + 1)
        new_dlen = dlen + take
        tl.store(dlen_ptr + b, new_dlen)
        if act:
            tl.store(kv_ptr + b, kv + u)
            tl.store(row_forwards_ptr + b, row_forwards + 1)
            tl.store(guess_tokens_ptr + b, guess_tokens + take - 1)
            tl.store(guess_hits_ptr + b, guess_hits + (take > 1).to(tl.int64))
            tl.store(last_take_ptr + b, take)
            tl.store(next_u_ptr + b, take)
            tl.store(active_ptr + b, new_dlen < tl.minimum(cap, GOAL))
        else:
            tl.store(kv_ptr + b, kv)
            tl.store(last_take_ptr + b, last_take)
            tl.store(next_u_ptr + b, tl.full([], 1, tl.int64))
else:  # pragma: no cover
    prepare_kernel = commit_kernel = None


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _launch(dev: torch.device):
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def prepare(layout, unc: torch.Tensor, u: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
            window: torch.Tensor, guesses: torch.Tensor, block_table: torch.Tensor, page_size: int):
    """One forward's inputs and tree-kernel metadata for A rows, in one launch.

    Shape: unc [A, >= U] int64 (rows may be strided); u [A] int64 in 1..U (may be strided);
    kv, slots [A] int64; window [S, L, WA] int64 (the runtime's windows); guesses [A, G, L]
    int64; block_table [S, MP] int32. layout: lookahead.LookaheadLayout with Q <= MAX_KERNEL_QUERIES.
    Returns ids, positions, write_index [A, Q] int64; tree_mask [A * Q] int64; lens [A] int32;
    query_start [A + 1] int32; block_rows [A, MP] int32 (the same values as the torch path:
    lookahead.row_inputs, attention.build_attention_metadata and its kernel_inputs); out_rows
    [A, 1 + Q - U] int64 (lookahead.output_index: the LM head's rows in one gather).
    """
    dev = kv.device
    A, U, W, L, G, Q = kv.shape[0], layout.U, layout.W, layout.L, layout.G, layout.Q
    if layout.static_bits is None:
        raise ValueError(f"a prepared forward carries at most {MAX_KERNEL_QUERIES} tokens per row, got {Q}")
    MP = block_table.shape[1]
    new = lambda *shape, dtype=torch.int64: torch.empty(*shape, dtype=dtype, device=dev)  # noqa: E731
    ids, positions, write_index, tree_mask = new(A, Q), new(A, Q), new(A, Q), new(A * Q)
    lens, query_start, block_rows = new(A, dtype=torch.int32), new(A + 1, dtype=torch.int32), \
        new(A, MP, dtype=torch.int32)
    out_rows = new(A, 1 + Q - U)
    with _launch(dev):
        prepare_kernel[(A,)](unc, unc.stride(0), u, u.stride(0), kv, slots, window, guesses,
                             layout.static_bits, layout.pos_offset, block_table, MP, page_size,
                             ids, positions, write_index, tree_mask, lens, query_start, block_rows,
                             out_rows, A, U=U, W=W, WA=window.shape[2], L=L, G=G, Q=Q, BLOCK_Q=_pow2(Q),
                             BLOCK_P=min(_pow2(MP), 256), num_warps=1)
    return ids, positions, write_index, tree_mask, lens, query_start, block_rows, out_rows


def commit(st, layout, ids: torch.Tensor, tokens: torch.Tensor, gvalid: torch.Tensor, u: torch.Tensor,
           window: torch.Tensor, max_draft: int, goal: int):
    """`device_round.commit_torch` without the adaptive rule, in one launch: reads the forward's
    greedy tokens, updates the round state `st` (device_round.RoundState) and the windows in
    place, and returns the pool insert's rows (keys [A * W], phrases [A * W, L], their slots
    [A * W] and which count [A * W] bool), or None without a window.

    Shape: ids [A, Q] int64 (the fed tokens); tokens [A, 1 + Q - U] int64 (contiguous:
    lookahead.output_rows' tokens); gvalid [A, G] bool; u [A] int64 (may be st.next_u, may be
    strided); window [S, L, WA] int64. goal: a row stops drafting once it holds this many tokens
    (or its st.cap, which also bounds its take with max_draft).
    """
    dev = ids.device
    A, U, W, L, G, Q = ids.shape[0], layout.U, layout.W, layout.L, layout.G, layout.Q
    keys, phrases, ins_slots = (torch.empty(A * W, dtype=torch.int64, device=dev),
                                torch.empty(A * W, L, dtype=torch.int64, device=dev),
                                torch.empty(A * W, dtype=torch.int64, device=dev))
    ins_valid = torch.empty(A * W, dtype=torch.bool, device=dev)
    with _launch(dev):
        commit_kernel[(A,)](ids, tokens.contiguous(), gvalid, st.slots, u, u.stride(0),
                            st.cap, st.active, st.kv, st.dlen, st.row_forwards, st.guess_tokens, st.guess_hits,
                            st.last_take, st.drafts, st.drafts.stride(0), st.next_unc, st.next_u, window,
                            keys, phrases, ins_slots, ins_valid, U=U, W=W, WA=window.shape[2], L=L, G=G,
                            Q=Q, MAX_DRAFT=max_draft, GOAL=goal, BLOCK_T=_pow2(L + 1),
                            BLOCK_G=_pow2(max(G, 1)), BLOCK_W=_pow2(max(W, 1)), num_warps=1)
    return (keys, phrases, ins_slots, ins_valid) if W else None


# Devices whose kernels were compared with the torch path: device -> None (may run) or why not.
_CHECKED: dict[str, str | None] = {}


def _differs(device: torch.device) -> str | None:
    """Why the kernels' results differ from the torch path's on `device` (None: they do not):
    random rounds states, windows and guesses, padding rows and finished rows among them."""
    from vllm_ouroboros.draft import device_round as dr
    from vllm_ouroboros.draft.lookahead import build_layout

    g = torch.Generator(device).manual_seed(0)
    ri = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g, device=device)  # noqa: E731
    for U, W, G, L in ((1, 0, 0, 3), (2, 3, 2, 3), (5, 2, 0, 4), (4, 0, 3, 2), (1, 4, 4, 4)):
        A, S, MP, ps, V = 5, 7, 6, 4, 9
        layout = build_layout(U, W, L, G, device)
        slots = torch.randperm(S, generator=g, device=device)[:A]
        u, kv = ri(1, U + 1, A), ri(0, 9, A)
        unc, window = ri(0, V, A, U + 2), ri(0, V, S, L, max(W, 1))
        guesses, gvalid = ri(0, 3, A, G, L), ri(0, 2, A, G).bool()
        block_table = ri(0, 30, S, MP).int()
        want = dr.forward_inputs_torch(layout, unc[:, :U], u, kv, slots, window, guesses, block_table, ps)
        have = prepare(layout, unc, u, kv, slots, window, guesses, block_table, ps)
        if not all(torch.equal(a, b) for a, b in zip(want, have)):
            return f"the prepared forward inputs differ from torch's (U={U}, W={W}, G={G}, L={L})"
        tokens = ri(0, 3, A, 1 + layout.Q - U)
        ids = have[0]
        gvalid = gvalid & (ri(0, 4, A, G) > 0)
        states = []
        for _ in range(2):
            st = dr.RoundState.empty(A, L, 7 + L + 2, 1, device)
            gen = torch.Generator(device).manual_seed(1)
            st.slots.copy_(slots)
            st.active.copy_(torch.rand(A, generator=gen, device=device) < 0.8)
            st.kv.copy_(kv)
            st.cap.copy_(torch.randint(1, 9, (A,), generator=gen, device=device))  # some past 7
            st.dlen.copy_(torch.randint(0, 7, (A,), generator=gen, device=device))
            st.last_take.copy_(torch.randint(0, 3, (A,), generator=gen, device=device))
            states.append(st)
        windows = [window.clone(), window.clone()]
        ref = dr.commit_torch(states[0], layout, ids, tokens, guesses, gvalid, u, windows[0], 7, 4)
        got = commit(states[1], layout, ids, tokens, gvalid, u, windows[1], 7, 4)
        if not torch.equal(windows[0], windows[1]) or not dr.RoundState.same(states[0], states[1]):
            return f"the kernel's round bookkeeping differs from torch's (U={U}, W={W}, G={G}, L={L})"
        if (ref is None) != (got is None) or (ref is not None and not all(
                torch.equal(a, b) for a, b in zip(ref, got))):
            return f"the kernel's pool insert rows differ from torch's (U={U}, W={W}, G={G}, L={L})"
    return None


def check_kernel(device: torch.device) -> str | None:
    """None if the kernels may serve device rounds on `device` (compiled and compared with the
    round's torch path on random states), else why not (the round then runs its torch path).
    Once per device and process."""
    return check_once(_CHECKED, commit_kernel, device, _TRITON_IMPORT_ERROR, _differs)
