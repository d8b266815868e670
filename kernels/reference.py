"""Plain-torch references for the kernels in this package: slow, obvious, float32 math.

Nothing here imports Triton; the parity tests compare each kernel against the function of the
same name with `_reference` appended.
"""

from __future__ import annotations

import torch


def gather_pages(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Logical positions 0..length-1 of one request, read out of a paged cache.

    Shape: cache [num_blocks, block_size, Hkv, D]; block_table_row [max_blocks]; returns [length, Hkv, D].
    """
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    pages = block_table_row.long()[pos // block_size]
    return cache[pages, pos % block_size]


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    query_start: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Tree attention by gathering each request's pages into dense K/V and masking with booleans.

    Same contract as `tree_attention.tree_attention` (see there); computed in float32, returned in
    q.dtype. Node i of request b sits at logical position prefix_lens[b] + i of its paged cache and
    attends every prefix position plus the nodes whose bits are set in its row of `tree_mask`
    (itself always, whether or not bit i is set).

    Shape: q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [B, max_blocks];
    prefix_lens [B]; query_start [B+1]; tree_mask [T] int64; returns [T, Hq, D].
    """
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    starts = query_start.tolist()
    for b, prefix in enumerate(prefix_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        length = prefix + n
        # query head h reads kv head h // group (vLLM / flash-attn GQA convention)
        k = gather_pages(k_cache, block_table[b], length).float().repeat_interleave(group, dim=1)
        v = gather_pages(v_cache, block_table[b], length).float().repeat_interleave(group, dim=1)
        bits = tree_mask[q0:q1].long()  # [n]
        j = torch.arange(n, device=q.device)
        itself = torch.eye(n, dtype=torch.bool, device=q.device)
        tree_part = ((bits[:, None] >> j[None, :]) & 1).bool() | itself
        allowed = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=q.device), tree_part], dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[q0:q1].float(), k) * scale  # [Hq, n, length]
        s = s.masked_fill(~allowed[None], float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", s.softmax(dim=-1), v).to(q.dtype)
    return out
