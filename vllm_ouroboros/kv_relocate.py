"""Move the accepted branch's KV into the slots vLLM expects for the accepted tokens.

vLLM wrote tree node i's key/value at the KV slot of flat query row 1 + i. After the step it
believes the j-th accepted token sits right behind the root, in row 1 + j's slot. That holds on the
draft part; when a suffix k >= 1 wins, its nodes are further right (behind the other suffixes)
and are copied left (accept.py's kv_keep_src says from where). No vLLM imports.
"""

from __future__ import annotations

import numpy as np
import torch

from .accept import AcceptResult
from .host_copy import to_device


def relocation_slots(result: AcceptResult, root_rows: np.ndarray,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV slots to copy, (src, dst), only where they differ.

    Shape: result on the host (accept.py), root_rows [B] host array (query row of each
    request's root), slot_mapping [T] on the device (the step's query row -> KV slot) -> two
    [M] int64 tensors on its device. The rows to move are host arithmetic on the walk's result;
    a step that moves nothing (the common case: the draft or suffix 0 won) launches nothing.
    """
    src_node = result.kv_keep_src
    B, N = src_node.shape
    j = np.arange(N)[None, :]
    keep = (j < result.num_accepted[:, None]) & (src_node != j)
    if not keep.any():
        empty = torch.empty(0, dtype=torch.long, device=slot_mapping.device)
        return empty, empty
    base = np.asarray(root_rows, np.int64)[:, None] + 1
    src_row = (base + np.maximum(src_node, 0))[keep]
    dst_row = np.broadcast_to(base + j, (B, N))[keep]
    (rows,) = to_device(slot_mapping.device, np.concatenate([src_row, dst_row]))
    slots = slot_mapping[rows].long()
    return slots[:len(src_row)], slots[len(src_row):]


def move_kv(caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor,
            dst: torch.Tensor, backend: str = "torch") -> None:
    """Copy slot src[m] to slot dst[m] in every layer's key and value cache.

    Shape: each cache [num_blocks, block_size, Hkv, D] (any strides: views of vLLM's layout);
    src, dst [M] int64 slots (block * block_size + offset). Gather then scatter: src and dst of
    one request may overlap (src >= dst, both increasing), so an in-place shift would not do.
    backend: "torch" (two indexing calls per cache) or "triton" (kernels/kv_move.py: two
    launches for all layers, where Triton runs and the caches share one layout; else torch).
    """
    if src.numel() == 0:
        return
    if backend == "triton":
        from vllm_ouroboros.kernels.kv_move import move_kv_triton

        if move_kv_triton(caches, src, dst):
            return
    elif backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    split: dict[int, tuple] = {}  # block size -> (src block, offset, dst block, offset): once, not per layer
    for k_cache, v_cache in caches:
        bs = k_cache.shape[1]
        if bs not in split:
            split[bs] = (src // bs, src % bs, dst // bs, dst % bs)
        sb, so, db, do = split[bs]
        for cache in (k_cache, v_cache):
            cache[db, do] = cache[sb, so]


def warm_move(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Compile move_kv's Triton kernel for these caches before serving, by copying slot 0 onto
    itself (nothing changes). The kernel's check (kernels/kv_move.check_kernel) compiles made-up
    layouts, and the caches' block size, heads and head dim are the kernel's constexprs: without
    this the first step whose winning suffix moves KV would compile, in a request's step
    (patches/tree_verify.py calls it once the check passed). Shape: caches as move_kv's.
    Returns None, or why the kernel cannot move them (the caller then moves in torch: a
    backend "triton" whose kernel declines the caches would look for their layout on every
    move before copying in torch)."""
    from vllm_ouroboros.kernels.kv_move import move_kv_triton

    if not caches:
        return None
    device = caches[0][0].device
    slot = torch.zeros(1, dtype=torch.long, device=device)
    try:
        if not move_kv_triton(caches, slot, slot):
            return "the engine's KV caches do not share one layout (or Triton cannot run on them)"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - the torch copy still serves
        return f"{type(e).__name__}: {e}"
    return None
