"""Draft-model attention: new tokens over [committed prefix of their slot | new tokens, custom mask].

Cache layout (one layer, draft/kv_cache.py): k_cache, v_cache [num_pages, page_size, Hkv, D];
token t of slot s lives in page block_table[s, t // page_size], row t % page_size. Row b of a
forward owns slot slots[b]; its committed prefix is tokens [0, cache_lens[b]) and its Q new tokens
are written (by `write_kv`) as tokens cache_lens[b] .. cache_lens[b]+Q-1, a scratch area that the
caller commits later, or not, by advancing its own cache_lens. The caller has reserved pages for
every token a forward writes.

`prefix_and_masked_attention` is the plain-torch path (pages gathered into a dense block, dense
mask, SDPA) and the reference. On CUDA, forwards of at most 64 new tokens per row (the lookahead
and decode forwards; not long prefills) run through the target's tree-attention kernel instead
(kernels/tree_attention.py), which walks the same block table in place; the row's new-token mask
is its ancestor bitmask. `masked_attention` picks between them. Everything that does not depend
on the layer (block-table rows, write indices, the dense mask or the bitmask) lives in
`DraftAttentionMetadata`, built once per forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DraftAttentionMetadata:
    """Per-forward attention inputs, shared by every layer."""

    cache_lens: torch.Tensor  # [B] int64: committed prefix length of each row's slot
    # [B, Q, Q] bool: query j sees new token j' iff new_mask[b, j, j'] (None: `prepared`)
    new_mask: torch.Tensor | None
    block_rows: torch.Tensor  # [B, max_pages] int32: each row's block-table row
    page_size: int
    write_index: torch.Tensor  # [B, Q] int64: page * page_size + row of new token j's K/V
    # The caller's bound on cache_lens (max_cache_len, else their max) + Q, capped at the block
    # table's capacity: the tokens [0, kv_len) any row can read.
    kv_len: int
    use_kernel: bool = False  # masked_attention runs the Triton tree-attention kernel
    # The kernel's checks and launch plan (kernels.tree_attention.TreeAttentionPlan), made at the
    # first layer and reused by the others, by (dtype, heads, head dim, cache shape).
    kernel_plans: dict = field(default_factory=dict)

    @classmethod
    def prepared(cls, cache_lens: torch.Tensor, write_index: torch.Tensor, page_size: int, kv_len: int,
                 kernel_inputs: tuple, use_kernel: bool) -> DraftAttentionMetadata:
        """Metadata from inputs made elsewhere (one launch in the device round:
        kernels/round_steps.prepare): kernel_inputs as `kernel_inputs` returns them (block rows,
        prefix lengths, query starts, bitmasks). The torch path reads the mask from the bits."""
        meta = cls(cache_lens, None, kernel_inputs[0], page_size, write_index, kv_len, use_kernel)
        meta.__dict__["kernel_inputs"] = tuple(kernel_inputs)  # the cached_property's slot
        return meta

    def _new_mask(self) -> torch.Tensor:
        """new_mask, or for `prepared` metadata the same [B, Q, Q] bool from the bitmasks."""
        if self.new_mask is not None:
            return self.new_mask
        bits = self.kernel_inputs[3]
        B = self.cache_lens.shape[0]
        Q = bits.shape[0] // B
        shift = torch.arange(Q, device=bits.device)
        return ((bits.view(B, Q, 1) >> shift) & 1).bool()

    @functools.cached_property
    def dense_mask(self) -> torch.Tensor:
        """[B, 1, Q, kv_len] bool: True where query j of row b sees cache column c.

        Column c is visible iff c < cache_lens[b] (committed prefix), or c = cache_lens[b] + j' with
        new_mask[b, j, j'] (a new token). Columns past cache_lens[b] + Q are stale or empty: never visible.
        """
        new_mask = self._new_mask()
        B, Q, _ = new_mask.shape
        cols = torch.arange(self.kv_len, device=self.cache_lens.device)  # [kv_len]
        rel = cols[None, :] - self.cache_lens[:, None]  # [B, kv_len]: index among new tokens
        in_new = (rel >= 0) & (rel < Q)  # [B, kv_len]
        rel_idx = rel.clamp(0, Q - 1)[:, None, :].expand(B, Q, self.kv_len)  # [B, Q, kv_len]
        sees_new = torch.gather(new_mask, 2, rel_idx) & in_new[:, None, :]  # [B, Q, kv_len]
        return ((rel < 0)[:, None, :] | sees_new)[:, None]

    @functools.cached_property
    def read_pages(self) -> torch.Tensor:
        """[B, P] int64: the pages holding tokens [0, kv_len) of each row, P = ceil(kv_len /
        page_size) (past a row's own pages: the null page, masked)."""
        P = min(-(-self.kv_len // self.page_size), self.block_rows.shape[1])
        return self.block_rows[:, :P].long()

    @functools.cached_property
    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tree-attention kernel's batch description (kernels/tree_attention.py): block_table
        [B, max_pages] int32, prefix_lens [B] int32, query_start [B+1] int32 (Q rows each) and
        tree_mask [B*Q] int64 (bit j' of query j = new_mask[b, j, j']; Q <= 64)."""
        B, Q, _ = self.new_mask.shape
        dev = self.new_mask.device
        tree_mask = ancestor_bits(self.new_mask).reshape(B * Q)
        query_start = torch.arange(B + 1, dtype=torch.int32, device=dev) * Q
        return self.block_rows, self.cache_lens.to(torch.int32), query_start, tree_mask


def build_attention_metadata(
    slots: torch.Tensor,
    cache_lens: torch.Tensor,
    new_mask: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    max_cache_len: int | None = None,
    backend: str = "auto",
) -> DraftAttentionMetadata:
    """Shape: slots [B] int64, cache_lens [B] int64, new_mask [B, Q, Q] bool, block_table
    [num_slots, max_pages] int32 (draft/kv_cache.PagedKVCache.block_table).

    max_cache_len: max(cache_lens) if the caller knows it on the host; otherwise it is read from the
    device (one synchronisation). Any value >= max(cache_lens) is correct (the extra columns are
    masked; none past the block table's are read).
    backend: "auto" (the Triton kernel on CUDA when Q <= 64, else torch), "torch", or "triton"
    (the kernel wherever Triton can run it, e.g. its CPU interpreter in tests; Q <= 64).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"draft attention backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    B, Q, Q2 = new_mask.shape
    assert Q == Q2 and slots.shape == (B,) and cache_lens.shape == (B,), (
        slots.shape, cache_lens.shape, new_mask.shape)
    if max_cache_len is None:
        max_cache_len = int(cache_lens.max().item()) if B > 0 else 0
    if backend == "triton" and Q > MAX_KERNEL_QUERIES:
        raise ValueError(f"the tree-attention kernel takes at most {MAX_KERNEL_QUERIES} new tokens per "
                         f"row, got {Q}")
    use_kernel = kernel_chosen(backend, new_mask.device, Q)
    block_rows = block_table[slots]  # [B, max_pages]
    write_pos = cache_lens[:, None] + torch.arange(Q, device=cache_lens.device)  # [B, Q]
    # A position past the table (a caller bug) writes to the null page (0), where padding
    # writes go, rather than faulting or landing on the row's last page.
    col = write_pos // page_size
    inside = col < block_rows.shape[1]
    page = block_rows.gather(1, col.clamp(max=block_rows.shape[1] - 1)) * inside
    write_index = page.long() * page_size + write_pos % page_size
    return DraftAttentionMetadata(cache_lens, new_mask.to(torch.bool), block_rows, page_size,
                                  write_index, min(max_cache_len + Q, block_rows.shape[1] * page_size),
                                  use_kernel)


# The kernel's ancestor bitmask is one int64 per query (kernels/tree_attention.MAX_TREE_NODES).
MAX_KERNEL_QUERIES = 64


def ancestor_bits(mask: torch.Tensor) -> torch.Tensor:
    """The tree-attention kernel's form of a mask: [..., Q, Q] bool -> [..., Q] int64, bit j' of
    row j = mask[..., j, j'] (Q <= MAX_KERNEL_QUERIES)."""
    Q = mask.shape[-1]
    bit = torch.ones(Q, dtype=torch.int64, device=mask.device) << torch.arange(Q, device=mask.device)
    # Distinct powers of two: the sum is their OR (bit 63 wraps to the sign, as intended).
    return (mask.long() * bit).sum(-1)


def kernel_chosen(backend: str, device: torch.device, Q: int) -> bool:
    """Whether a forward of Q new tokens per row on `device` runs through the tree-attention
    kernel under `backend` (build_attention_metadata's choice; "triton" past the kernel's
    limit raises there)."""
    return backend == "triton" or (backend == "auto" and device.type == "cuda" and Q <= MAX_KERNEL_QUERIES
                                   and kernel_importable())


@functools.cache
def kernel_importable() -> bool:
    # Imported on first use, not with this module: triton reads TRITON_INTERPRET at import.
    try:
        from vllm_ouroboros.kernels import tree_attention  # noqa: F401
    except ImportError:
        return False
    return True


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: DraftAttentionMetadata,
) -> None:
    """Write the new tokens' K/V into their rows' scratch area: token cache_lens[b] + j of slot
    slots[b] gets k[b, j] (at meta.write_index[b, j]).

    Shape: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim] (one layer, contiguous);
           k, v [B, Q, num_kv_heads, head_dim].
    The caller guarantees reserved pages for cache_lens[b] + Q tokens (not checked: that would
    synchronise).
    """
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, Hkv, D)[meta.write_index] = k
    v_cache.view(-1, Hkv, D)[meta.write_index] = v


def prefix_and_masked_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DraftAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of Q new tokens per row over their slot's committed prefix and the new tokens it may see.

    out[b, h, j] = softmax_c(scale * q[b, h, j] . K[c]) V[c] over tokens c of slot slots[b] with
    c < cache_lens[b], or c = cache_lens[b] + j' and new_mask[b, j, j']. The new K/V must already be
    in the cache (`write_kv`). Query head h uses kv head h // (Hq // Hkv) (as HF `repeat_kv`).
    The caller guarantees new_mask[b, j, j] (no query sees nothing).

    Shape: q [B, Hq, Q, D] (RoPE applied);
           k_cache, v_cache [num_pages, page_size, Hkv, D] (one layer);
           returns [B, Hq, Q, D] in q's dtype.
    """
    B, Hq, Q, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    kv_len = meta.kv_len
    # The folded mask below is a copy of G x Q x kv_len per row in every layer (and SDPA may
    # make it a bias of the model's dtype): a prefill of 32 8k-token prompts in one eager
    # forward of 512 tokens per row (GQA 7) would take ~1 GB of bools a layer. Rows go in
    # groups under MASK_BUDGET elements (one group but for such forwards).
    per = max(1, MASK_BUDGET // max(G * Q * kv_len, 1))
    pages = meta.read_pages
    mask = meta.dense_mask  # [B, 1, Q, kv_len]
    if per >= B:
        return _folded_attention(q, k_cache, v_cache, pages, mask, kv_len, scale)
    return torch.cat([_folded_attention(q[b:b + per], k_cache, v_cache, pages[b:b + per], mask[b:b + per],
                                        kv_len, scale) for b in range(0, B, per)])


# Elements of the folded attention mask one SDPA call gets at most (prefix_and_masked_attention).
MASK_BUDGET = 1 << 26


def _folded_attention(q, k_cache, v_cache, pages, mask, kv_len: int, scale: float) -> torch.Tensor:
    """prefix_and_masked_attention's SDPA for rows q [B, Hq, Q, D] reading `pages` [B, P] of
    the caches, mask [B, 1, Q, kv_len] bool -> [B, Hq, Q, D]."""
    B, Hq, Q, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    # Only the pages any row can read, whole pages at once (index_select: ~3x advanced
    # indexing's speed on CPU): [B, P * page_size, Hkv, D], then a head-major view for SDPA
    # (one copy of the rows, no head repeat).
    pages = pages.reshape(-1)
    k = k_cache.index_select(0, pages).view(B, -1, Hkv, D)[:, :kv_len].transpose(1, 2)
    v = v_cache.index_select(0, pages).view(B, -1, Hkv, D)[:, :kv_len].transpose(1, 2)
    # GQA without repeating K/V: fold the G query heads of a kv head into the query axis.
    q = q.reshape(B, Hkv, G * Q, D)  # row g*Q + j = query head kv*G + g, token j
    if G > 1:
        mask = mask[:, :, None].expand(B, 1, G, Q, kv_len).reshape(B, 1, G * Q, kv_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G*Q, D]
    # reshape, not view: CUDA's SDPA kernels return a token-major layout that view cannot split.
    return out.reshape(B, Hq, Q, D)


def masked_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DraftAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`prefix_and_masked_attention` in token-major layout, through the path `meta` chose.

    Shape: q [B, Q, Hq, D] (RoPE applied); k_cache, v_cache [num_pages, page_size, Hkv, D] (one
           layer); returns [B, Q, Hq, D] in q's dtype.
    """
    if not meta.use_kernel:
        return prefix_and_masked_attention(q.transpose(1, 2), k_cache, v_cache, meta, scale).transpose(1, 2)
    B, Q, Hq, D = q.shape
    q = q.reshape(B * Q, Hq, D)
    return _kernel_plan(q, k_cache, v_cache, meta, scale, Q)(q, k_cache, v_cache).view(B, Q, Hq, D)


# Head dims up to which the draft's layers take RoPE and the KV write into the attention kernel
# (`rope_masked_attention`). Compiled for sm_90 (`python scripts/bench_tree_attention.py
# --compile-only 90`, Triton 3.9): D = 64, GQA 7, bf16, 34 and 64 nodes: 183 registers, no spill
# single-pass (split-KV: 64 B per thread); D = 128 spills 816-904 B per thread, against 192-240 B
# without RoPE inside: there the separate rope_qkv_write launch is the cheaper one.
ROPE_IN_MAX_HEAD_DIM = 64


def rope_masked_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DraftAttentionMetadata,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """kernels/fused_ops.rope_qkv_write followed by `masked_attention`, in one launch of the
    tree-attention kernel (TreeAttentionPlan.run's `rope`): RoPE on q and the new k, the new
    k, v into the cache at meta.write_index, the attention. Only where meta.use_kernel.

    Shape: qkv [B, Q, (Hq + 2 Hkv) D], unit last stride (heads q | k | v); cos, sin [B, Q, 1, D]
           (DraftModel.rope_rows' strided views are fine); k_cache, v_cache [num_pages,
           page_size, Hkv, D]; returns [B, Q, Hq, D] in qkv's dtype.
    """
    B, Q, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    flat = qkv.reshape(B * Q, width)
    q = flat[:, :num_heads * D].view(B * Q, num_heads, D)  # the plan's shape; not read
    plan = _kernel_plan(q, k_cache, v_cache, meta, scale, Q)
    out = torch.empty((B * Q, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    rope = (flat, cos.reshape(B * Q, D), sin.reshape(B * Q, D), meta.write_index.reshape(B * Q))
    return plan(q, k_cache, v_cache, out, rope=rope).view(B, Q, num_heads, D)


def _kernel_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: DraftAttentionMetadata, scale: float, Q: int):
    """The forward's TreeAttentionPlan for these shapes, made at the first layer."""
    from vllm_ouroboros.kernels.tree_attention import TreeAttentionPlan

    key = (q.dtype, q.shape[1], q.shape[2], tuple(k_cache.shape), scale)
    plan = meta.kernel_plans.get(key)
    if plan is None:
        # kv_len - Q bounds every row's prefix (the whole slot inside a CUDA graph): it sizes the
        # split-KV grid; a loose bound only leaves the last splits empty.
        plan = meta.kernel_plans[key] = TreeAttentionPlan(
            q, k_cache, v_cache, *meta.kernel_inputs, scale, max_query_len=Q,
            max_prefix_len=meta.kv_len - Q, backend="triton")
    return plan
