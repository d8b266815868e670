"""Tree attention for the speculative rows of a batch, over vLLM's paged KV cache (Triton).

Each request b of the batch verifies a token tree of n_b <= 64 nodes. Its cached context (the
prefix, prefix_lens[b] tokens) and the tree's own K/V are already in the paged cache: node i sits at
logical position prefix_lens[b] + i, i.e. in page block_table[b, p // block_size], slot
p % block_size, with p = prefix_lens[b] + i. Node i attends every prefix token plus the tree nodes
whose bits are set in its ancestor bitmask (bit j of tree_mask[query_start[b] + i]; itself always).

Split-KV (flash-decoding): one program per (block of tree nodes, kv head, request) leaves most SMs
idle when a batch has few requests, so each request's prefix can be cut into S chunks, one program
each; every program writes its unnormalised online-softmax state (m, l, acc) and a second small
kernel merges the S states of each (node, query head). S is picked on the host from shapes alone
(`choose_num_splits`), never from the device's prefix lengths: the wrapper never synchronises.

In this file, in order: the Triton kernels (`tree_attention_kernel`, and
`tree_attention_merge_kernel` for the split path), their checked host wrapper (`tree_attention`)
with its tile table and split heuristic, the batched torch path, and `ancestor_bitmask`, which
builds the bitmask from a parent table. The plain-torch reference is
`reference.tree_attention_reference`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from dataclasses import dataclass

import torch

from .fused_ops import ptx_rn
from .reference import tree_attention_reference
from .triton_runtime import import_triton, pick_kernel
from .triton_runtime import is_interpreted as _is_interpreted

logger = logging.getLogger("vllm.ouroboros")

triton, tl, _TRITON_IMPORT_ERROR = import_triton()

MAX_TREE_NODES = 64  # one int64 ancestor bitmask per node


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
if triton is not None:
    from .fused_ops import _rope_half  # RoPE with torch's roundings (defined where Triton is)

    @triton.jit
    def _load_kv_tile(cache_ptr, stride_b, stride_s, stride_h, bt_row_ptr, kvh, pos, pos_ok,
                      offs_d, d_ok, BLOCK_SIZE: tl.constexpr, TRANSPOSED: tl.constexpr):
        # Token-granular page walk: each position looks up its own page, so the tile width is
        # independent of the page size (any vLLM block size, prefixes ending mid-page, trees
        # straddling a page boundary all take the same path). The block-table reads hit L1/L2.
        page = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        # int64: num_blocks * page stride overflows int32 on large caches.
        row = page * stride_b + (pos % BLOCK_SIZE).to(tl.int64) * stride_s + kvh * stride_h
        if TRANSPOSED:  # [D, N], ready to be the right operand of q @ k^T
            ptrs = cache_ptr + row[None, :] + offs_d[:, None]
            mask = d_ok[:, None] & pos_ok[None, :]
        else:  # [N, D]
            ptrs = cache_ptr + row[:, None] + offs_d[None, :]
            mask = pos_ok[:, None] & d_ok[None, :]
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _online_softmax_tile(q, k_t, v, allowed, m_i, l_i, acc, scale_log2e,
                             DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
        # One flash-attention step in base 2 (exp2 is the native instruction; log2(e) is folded
        # into the scale on the host).
        if UPCAST_DOT:
            # Triton's CPU interpreter (3.9) multiplies bf16 operands of tl.dot as their raw uint16
            # bits; fp32 dots of the upcast values give the same products (bf16 x bf16 is exact in
            # fp32). Only the interpreter sets this.
            s = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # [M, N] fp32
        s = tl.where(allowed, s * scale_log2e, float("-inf"))
        # m_i starts finite (-1e30), so m_new is finite even when a whole row of the tile is
        # masked: then p = exp2(-inf) = 0 and alpha is finite, never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # half-precision p @ v on the tensor cores, fp32 accumulator
        if UPCAST_DOT:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    # Triton compiles a binary per specialisation key: each int argument's "== 1" and "% 16 == 0"
    # and each pointer's 16-byte alignment are part of it. The arguments below change from step
    # to step in serving (the step's index arrays are views at any offset of one packed upload,
    # host_copy.packed_copy; S, ml_offset and the batch follow the step's size; the block
    # table's width is the engine's), so they are not specialised: every launch a server makes
    # then reuses a binary that check_kernel compiled before serving, instead of compiling on
    # the clock in the first steps (tests/test_tree_attention_kernel.py checks the keys). They
    # only address scalars and gathers, which alignment hints would not vectorise anyway.
    _VARYING = ["num_splits", "ml_offset", "stride_bt",
                "block_table_ptr", "prefix_lens_ptr", "query_start_ptr", "tree_mask_ptr",
                # ROPE_IN only (dummies otherwise: kept out of the key either way)
                "qkv_ptr", "cos_ptr", "sin_ptr", "write_index_ptr", "stride_xt", "stride_ct",
                "stride_st", "num_cache_rows"]

    @triton.jit(do_not_specialize=_VARYING)
    def tree_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr,
        block_table_ptr, prefix_lens_ptr, query_start_ptr, tree_mask_ptr,
        part_ptr,                    # SPLIT_KV only: fp32 partial states, layout at the merge kernel
        qkv_ptr, cos_ptr, sin_ptr,   # ROPE_IN only: [T, (Hq + 2 Hkv) D] projection, [T, D] cos, sin
        write_index_ptr,             # ROPE_IN only: [T] int64 cache row (page * BLOCK_SIZE + slot)
        stride_xt, stride_ct, stride_st,
        num_cache_rows,              # ROPE_IN only: num_blocks * BLOCK_SIZE
        scale_log2e,
        num_splits,                  # S, SPLIT_KV only
        ml_offset,                   # SPLIT_KV only: where (m, l) start in part_ptr
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh,
        stride_bt,
        GROUP: tl.constexpr,         # Hq // Hkv
        GROUP_PAD: tl.constexpr,     # next power of two >= GROUP
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM (80, 96 -> 128, masked)
        BLOCK_SIZE: tl.constexpr,    # vLLM page size (tokens per block)
        BLOCK_Q: tl.constexpr,       # tree nodes per program
        BLOCK_M: tl.constexpr,       # BLOCK_Q * GROUP_PAD tile rows
        BLOCK_N: tl.constexpr,       # prefix tokens per tile
        BLOCK_TREE: tl.constexpr,    # tree nodes per tile (>= max n_b normally: one tile)
        SPLIT_KV: tl.constexpr,      # S > 1: write partial states for tree_attention_merge_kernel
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,    # interpreter + bf16 only, see _online_softmax_tile
        ROPE_IN: tl.constexpr,       # q and the tree's k, v from the projection (RoPE applied
                                     # here), the tree's k, v written to the cache (the draft's)
        SOFT_BF16: tl.constexpr,     # interpreter + bf16 only (fused_ops._round_to)
        PTX_RN: tl.constexpr,        # ROPE_IN's RoPE in mul.rn / add.rn PTX (fused_ops._rope_half)
    ):
        # One program per (block of BLOCK_Q tree nodes, kv head, request), times S with SPLIT_KV.
        # Its tile rows are the BLOCK_Q nodes x the GROUP query heads of this kv head (row m = node
        # m // GROUP_PAD, head m % GROUP_PAD): every K/V tile is loaded once and used by all GROUP
        # heads (GQA), and a tree's few nodes times the group give the M >= 16 rows that tl.dot wants.
        if SPLIT_KV:
            # Axis 0 is split-major: the programs of one (split, kv head, request) differ only in
            # their q block, start together and share their K/V chunk through L2.
            n_qblk = tl.num_programs(0) // num_splits
            qblk = tl.program_id(0) % n_qblk
            split = tl.program_id(0) // n_qblk
        else:
            qblk = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        q_start = tl.load(query_start_ptr + b)
        n_nodes = tl.load(query_start_ptr + b + 1) - q_start
        if qblk * BLOCK_Q >= n_nodes:
            return
        prefix_len = tl.load(prefix_lens_ptr + b)
        if SPLIT_KV:
            # Whole tiles per split, sized from this request's own prefix (S was chosen without
            # reading it): with a short prefix the last splits get nothing and store a neutral state
            # (m = -1e30, l = 0) that the merge weighs by 0. The tree goes to the last split, whose
            # chunk is the shortest, so each node's self key keeps that split's state non-empty.
            chunk = ((prefix_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            kv_lo = split * chunk
            kv_hi = tl.minimum(kv_lo + chunk, prefix_len)
            tree_hi = tl.where(split == num_splits - 1, n_nodes, 0)
        else:
            kv_lo = 0
            kv_hi = prefix_len
            tree_hi = n_nodes

        offs_m = tl.arange(0, BLOCK_M)
        node = qblk * BLOCK_Q + offs_m // GROUP_PAD
        g = offs_m % GROUP_PAD
        row_ok = (node < n_nodes) & (g < GROUP)
        q_row = (q_start + node).to(tl.int64)
        head = kvh * GROUP + g
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM

        if ROPE_IN:
            # Rotate-half RoPE of fused_ops.rope_qkv_write, same roundings: q as that kernel
            # would have stored it. Column d pairs with d +- D/2 (`rot` = [-x2, x1]).
            dtype = out_ptr.dtype.element_ty
            first = offs_d < HEAD_DIM // 2
            partner = tl.where(first, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)
            num_kv = tl.num_programs(1)
            qmask = row_ok[:, None] & d_ok[None, :]
            x_row = qkv_ptr + q_row[:, None] * stride_xt + head[:, None] * HEAD_DIM
            x = tl.load(x_row + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32)
            xp = tl.load(x_row + partner[None, :], mask=qmask, other=0.0).to(tl.float32)
            c = tl.load(cos_ptr + q_row[:, None] * stride_ct + offs_d[None, :], mask=qmask, other=0.0)
            sn = tl.load(sin_ptr + q_row[:, None] * stride_st + offs_d[None, :], mask=qmask, other=0.0)
            q = _rope_half(x, tl.where(first[None, :], -xp, xp), c.to(tl.float32), sn.to(tl.float32),
                           dtype, SOFT_BF16, PTX_RN)
        else:
            q_off = q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
            q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        bt_row = block_table_ptr + b.to(tl.int64) * stride_bt

        # 1) The prefix: every node sees all of it, so the only mask is the tail of the last tile.
        offs_n = tl.arange(0, BLOCK_N)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            pos = start + offs_n
            pos_ok = pos < kv_hi
            k_t = _load_kv_tile(k_ptr, stride_kb, stride_ks, stride_kh, bt_row, kvh, pos, pos_ok,
                                offs_d, d_ok, BLOCK_SIZE, True)
            v = _load_kv_tile(v_ptr, stride_vb, stride_vs, stride_vh, bt_row, kvh, pos, pos_ok,
                              offs_d, d_ok, BLOCK_SIZE, False)
            m_i, l_i, acc = _online_softmax_tile(q, k_t, v, pos_ok[None, :], m_i, l_i, acc,
                                                 scale_log2e, DOT_PRECISION, UPCAST_DOT)

        # 2) The tree: node j at position prefix_len + j, visible where bit j of the row's mask is
        # set. The self bit is forced on here, so no row is ever left without a key.
        one = tl.full([BLOCK_M], 1, tl.int64)
        self_bit = tl.where(row_ok, one << node.to(tl.int64), 0)
        bits = tl.load(tree_mask_ptr + q_row, mask=row_ok, other=0) | self_bit
        offs_t = tl.arange(0, BLOCK_TREE)
        for t0 in range(0, tree_hi, BLOCK_TREE):
            j = t0 + offs_t
            j_ok = j < n_nodes
            if ROPE_IN:
                # The tree's k (roped) and v from the projection, not the cache: no program reads
                # what another writes in this launch (they read only prefix positions there).
                t_row = (q_start + j).to(tl.int64)
                kmask = d_ok[:, None] & j_ok[None, :]
                k_row = qkv_ptr + t_row[None, :] * stride_xt + (num_kv * GROUP + kvh) * HEAD_DIM
                xk = tl.load(k_row + offs_d[:, None], mask=kmask, other=0.0).to(tl.float32)  # [D, N]
                xkp = tl.load(k_row + partner[:, None], mask=kmask, other=0.0).to(tl.float32)
                ck = tl.load(cos_ptr + t_row[None, :] * stride_ct + offs_d[:, None], mask=kmask, other=0.0)
                sk = tl.load(sin_ptr + t_row[None, :] * stride_st + offs_d[:, None], mask=kmask, other=0.0)
                k_t = _rope_half(xk, tl.where(first[:, None], -xkp, xkp), ck.to(tl.float32),
                                 sk.to(tl.float32), dtype, SOFT_BF16, PTX_RN)
                vmask = j_ok[:, None] & d_ok[None, :]
                v_src = qkv_ptr + t_row[:, None] * stride_xt + ((num_kv * GROUP + num_kv + kvh) * HEAD_DIM
                                                                + offs_d[None, :])
                v = tl.load(v_src, mask=vmask, other=0.0)
                if qblk == 0:  # one program per (request, kv head) writes the tree's k, v
                    idx = tl.load(write_index_ptr + t_row, mask=j_ok, other=-1).to(tl.int64)
                    # A row out of the cache (a caller bug) is dropped, as rope_qkv_write does.
                    w_ok = j_ok & (idx >= 0) & (idx < num_cache_rows)
                    page = idx // BLOCK_SIZE
                    slot = idx % BLOCK_SIZE
                    k_dst = k_ptr + page[None, :] * stride_kb + slot[None, :] * stride_ks + kvh * stride_kh
                    tl.store(k_dst + offs_d[:, None], k_t, mask=d_ok[:, None] & w_ok[None, :])
                    v_dst = v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh
                    tl.store(v_dst + offs_d[None, :], v, mask=w_ok[:, None] & d_ok[None, :])
            else:
                pos = prefix_len + j
                k_t = _load_kv_tile(k_ptr, stride_kb, stride_ks, stride_kh, bt_row, kvh, pos, j_ok,
                                    offs_d, d_ok, BLOCK_SIZE, True)
                v = _load_kv_tile(v_ptr, stride_vb, stride_vs, stride_vh, bt_row, kvh, pos, j_ok,
                                  offs_d, d_ok, BLOCK_SIZE, False)
            allowed = (((bits[:, None] >> j[None, :].to(tl.int64)) & 1) != 0) & j_ok[None, :]
            m_i, l_i, acc = _online_softmax_tile(q, k_t, v, allowed, m_i, l_i, acc,
                                                 scale_log2e, DOT_PRECISION, UPCAST_DOT)

        if SPLIT_KV:
            # Unnormalised: the merge rescales each split's (l, acc) by exp2(m_s - max_s m_s).
            # Grid axis 1 is the kv heads, so it gives Hq without one more argument.
            p_row = (q_row * (tl.num_programs(1) * GROUP) + head) * num_splits + split
            tl.store(part_ptr + p_row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.store(part_ptr + ml_offset + p_row * 2, m_i, mask=row_ok)
            tl.store(part_ptr + ml_offset + p_row * 2 + 1, l_i, mask=row_ok)
        else:
            l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only
            out = acc / l_i[:, None]
            o_off = q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit(do_not_specialize=["num_splits", "ml_offset", "batch", "query_start_ptr"])
    def tree_attention_merge_kernel(
        part_ptr, out_ptr, query_start_ptr,
        num_splits, ml_offset, batch,
        stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,    # next power of two >= num_splits
    ):
        # part_ptr, one fp32 buffer: acc [T, Hq, S, D] (unnormalised), then from ml_offset (m, l)
        # [T, Hq, S, 2], m in log2 units of the scaled scores. One program per (tree row, query
        # head): the log-sum-exp merge of its S partial states, all loaded at once (S x D fp32, a
        # few KB) so the loads overlap instead of chaining.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        # Rows past the last request's nodes belong to no request: left untouched, as the
        # single-pass kernel leaves them.
        if t >= tl.load(query_start_ptr + batch):
            return
        offs_s = tl.arange(0, SPLITS_PAD)
        s_ok = offs_s < num_splits
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        p_row = (t * tl.num_programs(1) + h) * num_splits + offs_s
        m = tl.load(part_ptr + ml_offset + p_row * 2, mask=s_ok, other=float("-inf"))
        l = tl.load(part_ptr + ml_offset + p_row * 2 + 1, mask=s_ok, other=0.0)
        acc = tl.load(part_ptr + p_row[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        # The last split attended this node's own key, so max m is finite and its weight is 1:
        # the denominator is > 0. Empty splits (m = -1e30) and padding (-inf) weigh exp2(-huge) = 0.
        w = tl.exp2(m - tl.max(m, 0))
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
                 mask=d_ok)

else:  # pragma: no cover
    tree_attention_kernel = tree_attention_merge_kernel = None


# ----------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------
_logged: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.info("tree_attention: Triton cannot run, using the batched torch path: %s", reason)


def _pick_kernel(device: torch.device):
    """(kernel, None) where Triton can run this kernel on `device`, else (None, reason)."""
    return pick_kernel(tree_attention_kernel, device, _TRITON_IMPORT_ERROR)


def _check(name: str, t: torch.Tensor, ndim: int, dtypes, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# Tiles per (input dtype, padded head dim): max rows per program M, key tile BLOCK_N, warps when
# M < 64, warps when M >= 64. bf16 D = 64 and 128 were timed on an H200 (scripts/bench_gpu.py's
# kernel tiles, issue 15's 36 configurations, device time from CUDA graphs): M = 128 halves the
# time of 64-node trees (fewer programs re-reading the prefix; e.g. 32 requests, 8192-token
# prefix, D = 64: 1.12x -> 0.57x SDPA; D = 128, eager: 1.35x -> 0.81x) and leaves trees of <= 16
# nodes as they were (M is capped by the tree: 16 nodes x 4 heads). Its only loss, 1-request
# 512-token prefixes, is ~4 us. D = 16, 32 and 256 are still untimed (register notes in
# _tile_config).
_TILES = {
    **{("half", d): (64, 64, 4, 8) for d in (16, 32)},
    ("half", 64): (128, 64, 8, 8),
    ("half", 128): (128, 64, 8, 8),
    # D = 256 at M = 64, 64-wide key tiles spilled 776 B per thread on sm_90 (2.4 KB on sm_80);
    # M = 32, 32-wide tiles: 64 B (sm_90), 0 (sm_80); split-KV variant 144 B, 32 B.
    ("half", 256): (32, 32, 8, 8),
    **{("fp32", d): (16, 32, 4, 4) for d in (16, 32, 64, 128, 256)},
}
# What scripts/bench_gpu.py times on a GPU where the table above misses the 1.25x of SDPA
# (half inputs, D <= 128): the table's own rows, then fewer / more rows per program, narrower /
# wider key tiles, more warps. Each entry is a `_TILES` value; tests check every one under the
# interpreter, so a swept entry is a correct one.
TILE_CANDIDATES = (
    (64, 64, 4, 8), (64, 64, 8, 8), (32, 64, 4, 4), (16, 64, 4, 4),
    (64, 128, 4, 8), (32, 128, 4, 4), (64, 32, 4, 4), (128, 64, 8, 8),
)


def check_tiles(tiles) -> tuple[int, int, int, int]:
    """A `_TILES` entry given by a caller (tree_attention's `tiles`), checked: (max rows per
    program M in 16..128, key tile BLOCK_N in 16..256, warps when M < 64, warps when M >= 64),
    powers of two; warps in 1..16."""
    ok = (isinstance(tiles, tuple) and len(tiles) == 4 and all(type(x) is int and x > 0 and x & (x - 1) == 0
                                                                for x in tiles)
          and 16 <= tiles[0] <= 128 and 16 <= tiles[1] <= 256 and tiles[2] <= 16 and tiles[3] <= 16)
    if not ok:
        raise ValueError("tiles must be a tuple of 4 powers of two (max rows M in 16..128, BLOCK_N in "
                         f"16..256, warps for M < 64, warps for M >= 64, each <= 16), got {tiles!r}")
    return tiles


def _tile_config(dtype: torch.dtype, group_pad: int, head_dim_pad: int, max_query_len: int,
                 tiles: tuple[int, int, int, int] | None = None) -> dict:
    """Tile sizes and launch options from `_TILES` (or `tiles`, the same four numbers, where a
    caller sweeps them: scripts/bench_gpu.py's kernel tiles). Register use below was read with cuobjdump
    from sm_90 / sm_80 cubins compiled on a machine without a GPU (Triton 3.9,
    `scripts/bench_tree_attention.py --compile-only`); the bf16 D = 64 / 128 rows were then
    timed on an H200 (notes at `_TILES`).

    Rows per program M = BLOCK_Q * GROUP_PAD: at least 16 (tl.dot's minimum), no more tree nodes
    than the largest tree has, and at most the table's M: 128 for bf16 D = 64 and 128 (timed
    faster, with 8 warps, although at D = 128 it spills 192-240 B per thread on sm_90 with
    Triton 3.9; at M = 64, D = 128 already needed 8 warps to stay at 255 registers without
    spilling on sm_90, 120 B on sm_80, and 4 warps spilled 1.4 KB), 64 for smaller half head dims.
    Fewer rows per program means more programs re-reading the same prefix, so M is not made
    smaller than that.
    fp32 runs its dots as 3xTF32 (about fp32 accuracy on the tensor cores): IEEE fp32 dots compile
    to a scalar FMA loop that spills 3-9 KB per thread, and plain TF32 (10-bit mantissa) is too
    coarse for fp32 parity checks. fp32 tiles are kept small (M = 16, 32-wide key tiles) for the same reason.
    The split-KV variant (SPLIT_KV) uses the same tiles: it adds a few scalars and stores fp32
    partials instead of `out`; its register counts are printed by the same `--compile-only`.
    """
    fp32 = dtype == torch.float32
    max_rows, block_n, warps_small, warps_full = tiles or _TILES["fp32" if fp32 else "half", head_dim_pad]
    block_q = min(_next_pow2(max_query_len), max(1, max_rows // group_pad))
    block_q = max(block_q, max(1, 16 // group_pad))
    block_m = block_q * group_pad
    return dict(
        GROUP_PAD=group_pad, HEAD_DIM_PAD=head_dim_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_TREE=min(32 if fp32 else MAX_TREE_NODES, max(16, _next_pow2(max_query_len))),
        # tf32x3 is NVIDIA-only; ROCm gets IEEE. None: the default (exact products for fp16/bf16)
        DOT_PRECISION=("ieee" if torch.version.hip else "tf32x3") if fp32 else None,
        num_warps=warps_full if block_m >= 64 else warps_small,
        num_stages=2,
    )


# Split-KV heuristic constants.
MAX_SPLITS = 64  # bounds the scratch (T x Hq x S x (D + 2) fp32) and the merge tile (S x D)
# The two thresholds below are guesses, never timed on a GPU, and serve only where no rule was
# measured for the shapes and device (`SplitRule`, kernels/split_tuning.py, which the draft's and
# the target's kernel checks run on CUDA).
# A split shorter than this costs about as much in its partial-state store (M x (D + 2) fp32 ~ one
# bf16 K+V tile) and in the merge as it saves in key tiles.
MIN_SPLIT_TOKENS = 256
# Below this many prefix tokens the single pass is a few key tiles per program: a second launch
# (the merge) is not worth it.
MIN_PREFIX_TO_SPLIT = 1024


@dataclass(frozen=True)
class SplitRule:
    """choose_num_splits' two thresholds: no split below `min_prefix` prefix tokens, no chunk
    shorter than `min_chunk` tokens. `measured`: how they were measured, "" for the shipped
    guesses."""

    min_prefix: int = MIN_PREFIX_TO_SPLIT
    min_chunk: int = MIN_SPLIT_TOKENS
    measured: str = ""


@dataclass(frozen=True)
class SplitKey:
    """What a measured SplitRule holds for: the device, the kernel's dtype and shapes, and whether
    the call is replayed from a CUDA graph (device time alone) or launched eagerly (the merge's
    second launch also costs host time)."""

    device: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    graphed: bool


_SPLIT_RULES: dict[SplitKey, SplitRule] = {}


def register_split_rule(key: SplitKey, rule: SplitRule) -> None:
    """Every later plan for `key` splits by `rule` (a process-wide table, like an autotuner's
    cache). Plans made already keep their S."""
    _SPLIT_RULES[key] = rule


def split_rule(key: SplitKey) -> SplitRule:
    """The rule measured for `key`, else the shipped thresholds."""
    return _SPLIT_RULES.get(key, _DEFAULT_SPLIT_RULE)


def registered_split_rule(key: SplitKey) -> SplitRule | None:
    """The rule registered for `key`, None where none was."""
    return _SPLIT_RULES.get(key)


def clear_split_rules() -> None:
    """Forget every measured rule (tests)."""
    _SPLIT_RULES.clear()


_DEFAULT_SPLIT_RULE = SplitRule()


@functools.lru_cache(maxsize=1024)  # called on every launch: a dict hit instead of the S loop
def choose_num_splits(batch: int, num_kv_heads: int, num_q_blocks: int, num_sms: int,
                      max_prefix_len: int, block_n: int, max_splits: int = MAX_SPLITS,
                      min_prefix: int = MIN_PREFIX_TO_SPLIT, min_chunk: int = MIN_SPLIT_TOKENS) -> int:
    """How many chunks S to cut each request's prefix into, from host-known shapes only.

    FlashAttention-2's `num_splits_heuristic` with this kernel's tiles: no split once the
    single-pass grid (batch x num_kv_heads x num_q_blocks programs, one per SM at the register use
    of `_TILES`) covers 80% of the SMs, nor below `min_prefix` prefix tokens; otherwise the
    smallest S whose last wave of programs is at least 85% as full as the best S's, among the S
    that each shorten the longest chunk (in key tiles of block_n) and leave chunks of at least
    `min_chunk` tokens (min_prefix, min_chunk: a SplitRule's). `max_prefix_len` is an
    upper bound (the block table's width in tokens, or the caller's hint); a loose bound only makes
    the last splits empty.
    """
    programs = batch * num_kv_heads * num_q_blocks
    if programs <= 0 or programs >= 0.8 * num_sms or max_prefix_len < max(1, min_prefix):
        return 1
    tiles = -(-max_prefix_len // block_n)
    most = min(max_splits, num_sms, max_prefix_len // max(1, min_chunk))
    if most < 2:  # no two chunks of min_chunk tokens fit (split tuning asks for such floors)
        return 1

    def wave_efficiency(s: int) -> float:
        waves = programs * s / num_sms
        return waves / math.ceil(waves)

    eligible = [s for s in range(1, most + 1) if s == 1 or -(-tiles // s) < -(-tiles // (s - 1))]
    best = max(wave_efficiency(s) for s in eligible)
    return next(s for s in eligible if wave_efficiency(s) >= 0.85 * best)


@functools.cache
def _sm_count(device_index: int) -> int:
    # A host-side property query (no sync, allowed during CUDA graph capture); cached because it
    # costs microseconds on every call otherwise.
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: no idle SMs to fill
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _merge_warps(splits_pad: int, head_dim_pad: int) -> int:
    # About 16 fp32 partial values per thread, at most 64: at 4 warps the S = 64, D = 256 tile
    # took 254 registers on sm_90.
    return max(1, min(8, splits_pad * head_dim_pad // 512))


# Set by graph_plans(): the plans made now are for a CUDA graph, its capture or the warm-ups
# before it.
_GRAPH_PLANS = contextvars.ContextVar("tree_attention_graph_plans", default=False)


@contextlib.contextmanager
def graph_plans():
    """Plans made inside choose S by the graph-replayed SplitRule, as a capture's plans do
    (cuda_graph.capture_graph opens it around its warm-ups and the capture). Without it a
    warm-up, which runs on a side stream that is not capturing, would choose by the eager rule:
    where the two measured rules differ, the split path and its merge launch would run (and
    compile) for the first time inside the capture, and eager and replayed forwards would round
    differently for no reason."""
    token = _GRAPH_PLANS.set(True)
    try:
        yield
    finally:
        _GRAPH_PLANS.reset(token)


def _capturing(device: torch.device) -> bool:
    # Host-side queries (no sync); a plan made under capture is replayed from the graph.
    return _GRAPH_PLANS.get() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _launch_plan(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, batch: int,
                 max_query_len: int, prefix_bound: int, device: torch.device,
                 num_splits: int | None = None,
                 tiles: tuple[int, int, int, int] | None = None,
                 block_size: int = 0, graphed: bool | None = None) -> tuple[dict, int, int]:
    """(tile config, q blocks per request, S) of one `tree_attention` call; host values only.
    S follows the SplitRule measured for these shapes on `device` for graph-replayed calls
    (`graphed`; None: whether a CUDA graph is being captured now, or warmed up for one:
    graph_plans) or eager ones, else the shipped thresholds. The benchmarks print the S chosen
    here."""
    group_pad = _next_pow2(num_heads // num_kv_heads)
    cfg = _tile_config(dtype, group_pad, max(16, _next_pow2(head_dim)), max_query_len, tiles)
    num_q_blocks = -(-max_query_len // cfg["BLOCK_Q"])
    if num_splits is None:
        graphed = _capturing(device) if graphed is None else graphed
        rule = split_rule(SplitKey(str(device), dtype, num_heads, num_kv_heads, head_dim, block_size,
                                   graphed)) if _SPLIT_RULES else _DEFAULT_SPLIT_RULE
        num_splits = choose_num_splits(batch, num_kv_heads, num_q_blocks, _num_sms(device),
                                       prefix_bound, cfg["BLOCK_N"], MAX_SPLITS,
                                       rule.min_prefix, rule.min_chunk)
    return cfg, num_q_blocks, num_splits


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    query_start: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    backend: str = "auto",
    num_splits: int | None = None,
    max_prefix_len: int | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of every tree node to its request's prefix and to its tree ancestors.

    Shape: q [T, Hq, D], all tree nodes of the batch, request b's n_b nodes in rows
        query_start[b] .. query_start[b+1]-1 in node order; fp32, fp16 or bf16.
    Shape: k_cache, v_cache [num_blocks, block_size, Hkv, D], one layer of vLLM's paged cache, q's
        dtype; Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)). Node i of request b
        must already be written at logical position prefix_lens[b] + i.
    Shape: block_table [B, max_blocks] int32, physical page of each logical page of each request.
    Shape: prefix_lens [B] int32, cached context tokens each request attends in full.
    Shape: query_start [B+1] int32, cumulative node counts (query_start[0] = 0, n_b <= 64).
    Shape: tree_mask [T] int64, bit j of row query_start[b] + i set <=> node i attends node j of
        request b (`ancestor_bitmask` builds it); the self bit is implied.
    Shape: out [T, Hq, D] (optional, q's dtype), returned.

    `scale` multiplies q.k (usually D ** -0.5). `max_query_len` (max n_b), when given, saves a
    device->host sync; it sizes the grid and must not be smaller than the true maximum.
    `backend`: "auto" (Triton when it can run: CUDA tensors, or TRITON_INTERPRET=1; otherwise the
    batched torch path `tree_attention_torch`, with the reason logged once), "triton" (raise if
    it cannot run), "torch" or "reference" (the per-request loop the tests compare against). Accumulation is in fp32 throughout; fp32 inputs use 3xTF32 dot products (about fp32
    accuracy; IEEE on ROCm), fp16/bf16 round the softmax weights to the input dtype before p @ v.

    `num_splits` (Triton only): S > 1 cuts each request's prefix into S chunks, one program each,
    then merges the S partial softmax states per (node, head) in a second kernel (split-KV); 1 is
    the single-pass kernel; None (default) lets `choose_num_splits` pick from shapes and the SM
    count, never from prefix_lens' values, so no call synchronises and any can be captured in a
    CUDA graph (the fp32 scratch, T x Hq x S x (D + 2), comes from torch.empty). `max_prefix_len`,
    an upper bound on max(prefix_lens) known on the host, only tightens that choice (the default
    bound is the block table's width in tokens); on the Triton path a wrong value changes speed,
    never the result. On the torch path (off CUDA, or where the kernel failed its check)
    `max_query_len` and `max_prefix_len` size the padding: they must be true upper bounds (rows
    or keys past them are dropped); a looser bound only pads.
    `tiles` (Triton only): this call's `_TILES` entry (check_tiles), for measuring candidates;
    None: the table's.
    """
    plan = TreeAttentionPlan(q, k_cache, v_cache, block_table, prefix_lens, query_start, tree_mask,
                             scale, max_query_len, backend, num_splits, max_prefix_len, tiles)
    return plan.run(q, k_cache, v_cache, out)  # the plan was made from these: checked already


class TreeAttentionPlan:
    """`tree_attention`'s checks and launch decisions for one batch of trees, made once; calling
    the plan with a layer's (q, k_cache, v_cache[, out]) checks only that they have the shapes,
    dtype and device of the ones it was made with, and launches.

    The arguments are tree_attention's; q, k_cache and v_cache stand for every layer's (one
    layer's tensors or any of the same shape). A target forward's layers share one plan (the
    attention patch makes it at the first layer), where tree_attention would check the same
    metadata in each: some 14 us of host time per layer, on the host-bound path of a GPU step.
    """

    def __init__(self, q, k_cache, v_cache, block_table, prefix_lens, query_start, tree_mask,
                 scale: float, max_query_len: int | None = None, backend: str = "auto",
                 num_splits: int | None = None, max_prefix_len: int | None = None,
                 tiles: tuple[int, int, int, int] | None = None):
        if backend not in ("auto", "triton", "torch", "reference"):
            raise ValueError(f"backend must be 'auto', 'triton', 'torch' or 'reference', got {backend!r}")
        if num_splits is not None and (type(num_splits) is not int or not 1 <= num_splits <= MAX_SPLITS):
            raise ValueError(f"num_splits must be None or an int in 1..{MAX_SPLITS}, got {num_splits!r}")
        if max_prefix_len is not None and (type(max_prefix_len) is not int or max_prefix_len < 0):
            raise ValueError(f"max_prefix_len must be None or an int >= 0, got {max_prefix_len!r}")
        if tiles is not None:
            check_tiles(tiles)
        device = q.device
        floats = (torch.float32, torch.float16, torch.bfloat16)
        _check("q", q, 3, floats, device)
        _check("k_cache", k_cache, 4, (q.dtype,), device)
        _check("v_cache", v_cache, 4, (q.dtype,), device)
        _check("block_table", block_table, 2, (torch.int32,), device)
        _check("prefix_lens", prefix_lens, 1, (torch.int32,), device)
        _check("query_start", query_start, 1, (torch.int32,), device)
        _check("tree_mask", tree_mask, 1, (torch.int64,), device)
        num_tokens, hq, head_dim = q.shape
        _, block_size, hkv, _ = k_cache.shape
        batch = block_table.shape[0]
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
        if k_cache.shape[3] != head_dim:
            raise ValueError(f"head dim of q ({head_dim}) and of the cache ({k_cache.shape[3]}) differ")
        if hq % hkv != 0:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
        if head_dim > 256:
            raise ValueError(f"head dim {head_dim} > 256 is not supported")
        if prefix_lens.shape[0] != batch or query_start.shape[0] != batch + 1:
            raise ValueError(
                f"block_table has {batch} rows: prefix_lens must have {batch} entries (got "
                f"{prefix_lens.shape[0]}) and query_start {batch + 1} (got {query_start.shape[0]})")
        if tree_mask.shape[0] != num_tokens:
            raise ValueError(f"tree_mask has {tree_mask.shape[0]} rows, q has {num_tokens}")
        kernel, reason = (None, f"backend={backend!r}") if backend in ("torch", "reference") \
            else _pick_kernel(device)
        for name, t in (("block_table", block_table), ("prefix_lens", prefix_lens),
                        ("query_start", query_start), ("tree_mask", tree_mask)):
            # A one-entry axis has any stride (a column of an [A, n] inbox at A = 1 keeps the
            # row stride through `.to(int32)`): the kernel never steps along it.
            if t.stride(-1) != 1 and t.shape[-1] > 1:
                raise ValueError(f"{name} must be contiguous in its last axis, strides {t.stride()}")
        self.q_shape, self.kv_shape, self.dtype, self.device = q.shape, k_cache.shape, q.dtype, device
        self.meta = (block_table, prefix_lens, query_start, tree_mask)
        self.scale, self.kernel, self.empty = scale, kernel, num_tokens == 0 or batch == 0
        self._check_strides(q, k_cache, v_cache)
        self.fallback = None
        if kernel is None:
            if backend == "triton" and not self.empty:
                raise RuntimeError(f"tree_attention: Triton cannot run: {reason}")
            if backend == "auto":
                _log_once(reason)
            self.fallback = tree_attention_reference if backend == "reference" else tree_attention_torch
            self.bounds = dict(max_query_len=max_query_len, max_prefix_len=max_prefix_len)
            return
        if self.empty:
            return
        if max_query_len is None:
            max_query_len = int((query_start[1:] - query_start[:-1]).max())  # syncs
        if max_query_len > MAX_TREE_NODES:
            raise ValueError(f"a request has {max_query_len} tree nodes; at most {MAX_TREE_NODES} are supported")
        self.empty = max_query_len <= 0
        prefix_bound = block_table.shape[1] * block_size if max_prefix_len is None else max_prefix_len
        cfg, num_q_blocks, self.num_splits = _launch_plan(q.dtype, hq, hkv, head_dim, batch, max_query_len,
                                                          prefix_bound, device, num_splits, tiles, block_size)
        interpreted_bf16 = q.dtype == torch.bfloat16 and _is_interpreted(kernel)
        cfg.update(GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SPLIT_KV=self.num_splits > 1,
                   UPCAST_DOT=interpreted_bf16, SOFT_BF16=interpreted_bf16,
                   PTX_RN=ptx_rn(kernel))
        self.cfg = cfg
        # The q block is the fastest grid axis: the programs that stream the same request's K/V
        # (same b, same kv head, same split) are launched together and share those reads through L2.
        self.grid = (num_q_blocks * self.num_splits, hkv, batch)
        # One allocation for both partial arrays (acc, then (m, l) from ml_offset) per call.
        self.ml_offset = num_tokens * hq * self.num_splits * head_dim
        self.part_size = self.ml_offset + num_tokens * hq * self.num_splits * 2
        self.scale_log2e = float(scale) * math.log2(math.e)

    def _check_strides(self, q, k_cache, v_cache) -> None:
        # The torch paths read any strides (vLLM's CPU cache stores keys d-major); Triton needs a
        # unit head-dim stride.
        if self.kernel is None:
            return
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last (head dim) axis, strides {t.stride()}")

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
        """Attention for one layer: q [T, Hq, D], k_cache / v_cache [num_blocks, block_size, Hkv, D]
        of the plan's shapes, dtype and device; out [T, Hq, D] (optional), returned; rope
        (optional) as `run`'s. Checks every tensor (a few us per layer), then `run`."""
        if (q.shape != self.q_shape or k_cache.shape != self.kv_shape or v_cache.shape != self.kv_shape
                or q.dtype != self.dtype or k_cache.dtype != self.dtype or v_cache.dtype != self.dtype
                or q.device != self.device or k_cache.device != self.device or v_cache.device != self.device):
            raise ValueError(
                f"q {tuple(q.shape)} {q.dtype}, k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                f"{tuple(v_cache.shape)} {v_cache.dtype} ({q.device}) must match the plan's q "
                f"{tuple(self.q_shape)}, caches {tuple(self.kv_shape)}, {self.dtype} on {self.device}")
        self._check_strides(q, k_cache, v_cache)
        if rope is not None:
            self._check_rope(q, rope)
        return self.run(q, k_cache, v_cache, out, rope)

    def _check_rope(self, q: torch.Tensor, rope: tuple) -> None:
        # The kernel's presence is `run`'s check: the only one a rope call without these makes.
        T, hq, d = q.shape
        hkv = self.kv_shape[2]
        qkv, cos, sin, write_index = rope
        want = {"qkv": (T, (hq + 2 * hkv) * d), "cos": (T, d), "sin": (T, d), "write_index": (T,)}
        for name, t in zip(want, rope):
            dtype = torch.int64 if name == "write_index" else self.dtype
            strided = t.stride(-1) != 1 and t.shape[-1] > 1  # a one-entry axis has any stride
            if tuple(t.shape) != want[name] or t.dtype != dtype or t.device != self.device or strided:
                raise ValueError(f"rope's {name} must be {want[name]} {dtype} on {self.device} with a unit "
                                 f"last stride, got {tuple(t.shape)} {t.dtype} on {t.device}, strides "
                                 f"{t.stride()}")
        if d % 2:
            raise ValueError(f"rope needs an even head dim, got {d}")

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
        """`__call__` without its checks of q, the caches and rope: for tensors checked
        already (`tree_attention` checks the ones the plan was made from once).

        rope (Triton only): (qkv [T, (Hq + 2 Hkv) D], cos [T, D], sin [T, D], write_index [T]
        int64), each with a unit last stride, q's dtype (write_index aside). The kernel then
        takes q and the tree's own k, v from the projection qkv (heads q | k | v), applies
        rotate-half RoPE to q and k with fused_ops.rope_qkv_write's roundings, writes the
        tree's k, v to cache row write_index (page * block_size + slot; rows outside the cache
        are dropped), and attends: rope_qkv_write and the attention in one launch (the draft's
        layers). q is then only the plan's shape (e.g. a view of qkv's q columns): not read.
        The tree's k, v are read from qkv, never from the cache, so no program reads what
        another writes; the prefix is read from the cache as usual."""
        if rope is not None and self.kernel is None:
            raise ValueError("tree_attention: rope needs the Triton kernel")
        if out is None:
            out = torch.empty_like(q)
        else:
            _check("out", out, 3, (q.dtype,), self.device)
            if out.shape != q.shape or out.stride(-1) != 1:
                raise ValueError(f"out must have q's shape {tuple(q.shape)} and a unit last stride, got "
                                 f"shape {tuple(out.shape)} strides {out.stride()}")
        if self.fallback is tree_attention_torch:
            if not self.empty:
                tree_attention_torch(q, k_cache, v_cache, *self.meta, self.scale, out=out, **self.bounds)
            return out
        if self.fallback is not None:  # the reference (tests): reads the lengths on the host anyway
            if not self.empty:
                n = int(self.meta[2][-1])  # rows past every request's keep what `out` had, as in the kernel
                out[:n].copy_(self.fallback(q, k_cache, v_cache, *self.meta, self.scale)[:n])
            return out
        if self.empty:
            return out
        block_table, prefix_lens, query_start, tree_mask = self.meta
        S, split, cfg = self.num_splits, self.num_splits > 1, self.cfg
        # Never touched where S = 1: SPLIT_KV=False compiles the partial stores away.
        part = torch.empty(self.part_size, dtype=torch.float32, device=self.device) if split else out
        launch = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        if rope is None:  # dummies that ROPE_IN=False compiles away
            qkv, cos, sin, write_index, stride_xt, stride_ct, stride_st = q, q, q, tree_mask, 0, 0, 0
        else:
            qkv, cos, sin, write_index = rope
            stride_xt, stride_ct, stride_st = qkv.stride(0), cos.stride(0), sin.stride(0)
        with launch:  # Triton launches on the current CUDA device
            self.kernel[self.grid](
                q, k_cache, v_cache, out,
                block_table, prefix_lens, query_start, tree_mask,
                part,
                qkv, cos, sin, write_index, stride_xt, stride_ct, stride_st,
                k_cache.shape[0] * k_cache.shape[1],
                self.scale_log2e,
                S, self.ml_offset,
                q.stride(0), q.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                out.stride(0), out.stride(1),
                block_table.stride(0),
                ROPE_IN=rope is not None,
                **cfg,
            )
            if split:
                splits_pad = _next_pow2(S)
                tree_attention_merge_kernel[(q.shape[0], q.shape[1])](
                    part, out, query_start,
                    S, self.ml_offset, block_table.shape[0],
                    out.stride(0), out.stride(1),
                    HEAD_DIM=cfg["HEAD_DIM"], HEAD_DIM_PAD=cfg["HEAD_DIM_PAD"], SPLITS_PAD=splits_pad,
                    num_warps=_merge_warps(splits_pad, cfg["HEAD_DIM_PAD"]),
                )
        return out


# ----------------------------------------------------------------------------------------------
# Check before serving
# ----------------------------------------------------------------------------------------------
# Twice the parity tests' tolerances: only a broken build fails the check, not rounding.
_CHECK_TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def check_kernel(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                 max_query_len: int = MAX_TREE_NODES, max_splits: int = MAX_SPLITS,
                 seed: int = 0) -> str | None:
    """Compile and run the kernel where it is about to serve, for every launch configuration that
    calls with these caches' layout and `num_heads` can pick, against the torch path: each power
    of two max_query_len up to `max_query_len`'s (at most 64), single-pass and split in two, and the merge kernel
    for each power of two S up to `max_splits`. Compiling them here also means no request waits
    for Triton later.

    Shape: k_cache, v_cache [num_blocks, block_size, Hkv, D], with the dtype and strides of the
        caches the kernel will read (Triton compiles per dtype, block size and stride alignment),
        filled with random values by the caller; only read. num_blocks * block_size must hold
        max_query_len rounded up to a power of two.
    Returns None, or why the kernel must not be used on this device: a compilation or launch
    error (e.g. a GPU with less shared memory than a tile needs), or the largest difference to
    the torch path. Synchronises (it reads each result).
    """
    device, dtype, head_dim = k_cache.device, k_cache.dtype, k_cache.shape[3]
    sizes, meta = _check_sizes(k_cache, max_query_len)
    gen = torch.Generator().manual_seed(seed)
    splits = [1 << i for i in range(2, max_splits.bit_length())]
    runs = [(m, 1) for m in sizes] + [(m, 2) for m in sizes] + [(1, s) for s in splits]
    tol = _CHECK_TOL[dtype]
    for m, num_splits in runs:
        q = torch.randn(m, num_heads, head_dim, generator=gen).to(device, dtype)
        args = (q, k_cache, v_cache, *meta(m), head_dim ** -0.5)
        what = f"{m} tree nodes, S = {num_splits}, {dtype}, {num_heads}/{k_cache.shape[2]} heads, D = {head_dim}"
        try:
            got = tree_attention(*args, backend="triton", num_splits=num_splits, max_query_len=m)
            want = tree_attention(*args, backend="torch")
            err = (got.float() - want.float()).abs().max().item()  # also surfaces launch errors
        except Exception as e:  # noqa: BLE001 (any failure means: do not serve with it)
            return _failed(what, e)
        if not err <= tol:  # NaN fails too
            return f"{what}: differs from the torch path by {err:.3g} (tolerance {tol})"
    return None


def _check_sizes(k_cache: torch.Tensor, max_query_len: int):
    """The checks' tree sizes (each power of two up to max_query_len's: launches differ by its
    next power of two, in tile rows and tree width) and m -> tree_attention's (block_table,
    prefix_lens, query_start, tree_mask) for a chain of m nodes behind the longest prefix the
    caches hold (node i sees nodes < i), in the caches' last m positions."""
    device = k_cache.device
    num_blocks, block_size = k_cache.shape[:2]
    capacity = num_blocks * block_size
    top = _next_pow2(min(max(max_query_len, 1), MAX_TREE_NODES))
    if capacity < top:
        raise ValueError(f"caches of {capacity} positions cannot hold {top} tree nodes")
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]

    def meta(m: int) -> tuple:
        bits = torch.ones(m, dtype=torch.long).bitwise_left_shift(torch.arange(m)) - 1
        return (block_table, torch.tensor([capacity - m], dtype=torch.int32, device=device),
                torch.tensor([0, m], dtype=torch.int32, device=device), bits.to(device))

    return [1 << i for i in range(top.bit_length())], meta


def _failed(what: str, e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{what}: {type(e).__name__}: {first}"


def check_rope_kernel(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                      max_query_len: int = MAX_TREE_NODES, seed: int = 0) -> str | None:
    """`check_kernel` for the kernel with RoPE and the tree's K/V write inside (`rope` of
    TreeAttentionPlan.run, the draft's layers): for each power of two max_query_len up to
    `max_query_len`'s, single pass and split in two, against RoPE and the K/V write in torch
    (fused_ops.rope_qkv_write_reference) and the torch attention: the output and the caches.
    k_cache, v_cache: scratch pages of the serving layout (written). Returns None or why not to
    use it. Synchronises."""
    from .fused_ops import rope_qkv_write_reference

    device, dtype = k_cache.device, k_cache.dtype
    capacity, hkv, head_dim = k_cache.shape[0] * k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    sizes, chain = _check_sizes(k_cache, max_query_len)
    gen = torch.Generator().manual_seed(seed)
    tol = _CHECK_TOL[dtype]
    for m, num_splits in [(m, s) for s in (1, 2) for m in sizes]:
        rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
        qkv, cos, sin = rnd(m, (num_heads + 2 * hkv) * head_dim), rnd(m, head_dim), rnd(m, head_dim)
        rows = torch.arange(capacity - m, capacity, device=device)
        q = qkv.view(m, -1, head_dim)[:, :num_heads]  # the plan's shape
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want_q = rope_qkv_write_reference(qkv[None], cos[None, :, None], sin[None, :, None], want_k, want_v,
                                          rows[None], num_heads, hkv, head_dim)[0]
        meta = chain(m)
        what = f"rope: {m} tree nodes, S = {num_splits}, {dtype}, {num_heads}/{hkv} heads, D = {head_dim}"
        try:
            want = tree_attention(want_q, want_k, want_v, *meta, head_dim ** -0.5, backend="torch")
            plan = TreeAttentionPlan(q, k_cache, v_cache, *meta, head_dim ** -0.5, max_query_len=m,
                                     backend="triton", num_splits=num_splits)
            got = plan(q, k_cache, v_cache, rope=(qkv, cos, sin, rows))
            err = max((got.float() - want.float()).abs().max().item(),
                      (k_cache.float() - want_k.float()).abs().max().item(),
                      (v_cache.float() - want_v.float()).abs().max().item())
        except Exception as e:  # noqa: BLE001 (any failure means: do not serve with it)
            return _failed(what, e)
        if not err <= tol:  # NaN fails too
            return f"{what}: differs from RoPE, K/V write and attention apart by {err:.3g} (tolerance {tol})"
    return None


# ----------------------------------------------------------------------------------------------
# Batched torch path (where Triton cannot run: CPU)
# ----------------------------------------------------------------------------------------------
def tree_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, prefix_lens: torch.Tensor,
                         query_start: torch.Tensor, tree_mask: torch.Tensor,
                         scale: float, out: torch.Tensor | None = None,
                         max_query_len: int | None = None,
                         max_prefix_len: int | None = None) -> torch.Tensor:
    """`tree_attention`'s contract in plain torch, batched over requests (no Python loop over
    them): each request's pages are gathered into a padded dense [B, S, Hkv, D] block and one
    masked softmax runs for all. float32 math, returned in q's dtype, written into `out`
    ([T, Hq, D], q's dtype) where given: its rows past every request's are left as they were.
    max_query_len (max n_b) and max_prefix_len (max prefix_lens), host ints, size the padding
    (bounds; larger only pads); where either is None the lengths are read on the host (one
    synchronisation each on a GPU, the torch path's when the kernel failed its check).
    """
    B = block_table.shape[0]
    T, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    counts = (query_start[1:] - query_start[:-1]).long()
    prefix = prefix_lens.long()
    if max_query_len is None or max_prefix_len is None:
        n_max = int(counts.max())
        S = int((prefix + counts).max())
    else:
        n_max, S = max_query_len, max_prefix_len + max_query_len
    pos = torch.arange(S, device=dev)
    page_idx = (pos // block_size).clamp(max=block_table.shape[1] - 1)
    pages = block_table.long()[:, page_idx]  # [B, S]
    # Positions past a request's length may point at any page (even NaN garbage): their scores
    # are replaced by -inf below and their values zeroed (0 * NaN would still be NaN).
    owned = pos[None, :] < (prefix + counts)[:, None]  # [B, S]
    k = k_cache[pages, pos % block_size].float()  # [B, S, Hkv, D]
    v = v_cache[pages, pos % block_size].float().masked_fill(~owned[:, :, None, None], 0.0)
    # Queries padded to [B, n_max, Hq, D].
    i = torch.arange(n_max, device=dev)
    live = i[None, :] < counts[:, None]  # [B, n_max]
    rows = (query_start[:-1].long()[:, None] + i[None, :]).clamp(max=max(T - 1, 0))
    qp = q[rows].float()  # [B, n_max, Hq, D]
    bits = tree_mask[rows]  # [B, n_max]
    rel = pos[None, None, :] - prefix[:, None, None]  # [B, 1, S] tree index of each key position
    in_tree = (rel >= 0) & (rel < counts[:, None, None])
    bit = (bits[:, :, None] >> rel.clamp(0, 63)) & 1
    allowed = (rel < 0) | (in_tree & ((bit == 1) | (rel == i[None, :, None])))  # [B, n_max, S]
    g = hq // hkv
    qg = qp.view(B, n_max, hkv, g, d)
    s = torch.einsum("bnkgd,bskd->bkgns", qg, k) * scale
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # padded query rows have no allowed key
    o = torch.einsum("bkgns,bskd->bnkgd", p, v).reshape(B * n_max, hq, d)
    # Padded rows go to a sink row T: a boolean index (rows[live]) would read its size on the host.
    full = torch.empty((T + 1, hq, d), dtype=q.dtype, device=dev)
    if out is not None:
        full[:T] = out
    full[torch.where(live, rows, T).flatten()] = o.to(q.dtype)
    if out is None:
        return full[:T]
    out.copy_(full[:T])
    return out


# ----------------------------------------------------------------------------------------------
# Ancestor bitmask
# ----------------------------------------------------------------------------------------------
def ancestor_bitmask(parents: torch.Tensor, num_nodes: torch.Tensor,
                     total: int | None = None) -> torch.Tensor:
    """Row i of request b: bit j set for j = i and every ancestor j of node i.

    Shape: parents [B, N] int, parent node index (< N) within the same request, -1 for a root or
        padding; entries at i >= num_nodes[b] are ignored. N <= 64.
    Shape: num_nodes [B] int, nodes of each request; returns [T] int64, T = num_nodes.sum(), request b's
        rows back to back (the layout of `tree_attention`'s q and tree_mask).

    Vectorised over requests and nodes; loops over depth (N times at most). Sync-free when `total`
    (= T) is given.
    """
    if parents.dim() != 2 or num_nodes.dim() != 1 or num_nodes.shape[0] != parents.shape[0]:
        raise ValueError(f"parents must be [B, N] and num_nodes [B], got {tuple(parents.shape)}, "
                         f"{tuple(num_nodes.shape)}")
    batch, n = parents.shape
    if n > MAX_TREE_NODES:
        raise ValueError(f"at most {MAX_TREE_NODES} nodes per request, parents has {n} columns")
    device = parents.device
    num_nodes = num_nodes.to(device=device, dtype=torch.long)
    idx = torch.arange(n, device=device)
    valid = idx[None, :] < num_nodes[:, None]  # [B, N]
    parents = torch.where(valid, parents.long(), -1)
    one = torch.ones((), dtype=torch.long, device=device)
    mask = torch.where(valid, one << idx, 0).expand(batch, n).clone()  # self bits
    anc = parents
    for _ in range(n):  # depth <= n; 1 << 63 wraps to int64's sign bit, which is what we want
        has = anc >= 0
        mask |= torch.where(has, one << anc.clamp(min=0), 0)
        anc = torch.where(has, parents.gather(1, anc.clamp(min=0)), -1)
    if total is None:
        total = int(num_nodes.sum())
    # rows of request b start at the cumulative count; padding goes to a dropped extra slot
    starts = torch.cumsum(num_nodes, 0) - num_nodes
    dest = torch.where(valid, starts[:, None] + idx[None, :], total)
    flat = torch.zeros(total + 1, dtype=torch.long, device=device)
    flat.scatter_(0, dest.reshape(-1), mask.reshape(-1))
    return flat[:total]
