"""kv_relocate: the accepted branch's KV ends up in the slots behind the root."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from vllm_ouroboros.accept import accept_greedy
from vllm_ouroboros.kv_relocate import move_kv, relocation_slots
from vllm_ouroboros.tree import build_tree


def test_accepted_suffix_is_moved_behind_the_draft(device):
    T = partial(torch.tensor, device=device)
    # Request 0: draft [5, 6], suffixes [[7, 8], [9, 10], [11, 12]]; the target follows suffix 2.
    # Request 1: a chain that is fully accepted: nothing moves.
    draft = T([[5, 6], [1, 2]])
    sfx = T([[[7, 8], [9, 10], [11, 12]], [[3, 4], [0, 0], [0, 0]]])
    slen = T([[2, 2, 2], [2, 0, 0]])
    tree = build_tree(draft, T([2, 2]), sfx, slen)
    tn = torch.full((2, tree.N + 1), 99, device=device)
    tn[0, :3] = T([5, 6, 11])  # after root, d0, d1
    tn[0, 1 + 6] = 12  # after node 6 (suffix 2 head = 11)
    tn[1, :5] = T([1, 2, 3, 4, 50])
    res = accept_greedy(tree, tn)
    assert res.num_accepted.tolist() == [4, 4] and res.suffix_index.tolist() == [2, 0]

    bs, H, D = 4, 2, 3
    root_rows = np.array([0, 9])  # request 1's rows start at 9
    slot_mapping = torch.arange(20, device=device) + 3  # row r -> slot r + 3 (crosses blocks)
    k = torch.randn(8, bs, H, D, device=device)
    v = torch.randn(8, bs, H, D, device=device)
    k0, v0 = k.clone(), v.clone()
    src, dst = relocation_slots(res, root_rows, slot_mapping)
    # Request 0: nodes 6, 7 (rows 7, 8) -> accepted positions 2, 3 (rows 3, 4).
    assert src.tolist() == [7 + 3, 8 + 3] and dst.tolist() == [3 + 3, 4 + 3]
    move_kv([(k, v)], src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(k[d // bs, d % bs], k0[s // bs, s % bs])
        assert torch.equal(v[d // bs, d % bs], v0[s // bs, s % bs])
    moved = {d for d in dst.tolist()}
    for slot in range(8 * bs):
        if slot not in moved:
            assert torch.equal(k[slot // bs, slot % bs], k0[slot // bs, slot % bs])


def test_overlapping_moves_read_before_write(device):
    T = partial(torch.tensor, device=device)
    # Suffix 0 has 1 token, suffix 1 three: its rows 3..5 move to rows 2..4 (overlapping).
    draft = T([[5]])
    sfx = T([[[7, 0, 0], [10, 11, 12]]])
    tree = build_tree(draft, T([1]), sfx, T([[1, 3]]))
    tn = torch.full((1, tree.N + 1), 99, device=device)
    tn[0, 0], tn[0, 1] = 5, 10
    tn[0, 1 + 2], tn[0, 1 + 3], tn[0, 1 + 4] = 11, 12, 13
    res = accept_greedy(tree, tn)
    assert res.num_accepted.tolist() == [4] and res.suffix_index.tolist() == [1]
    src, dst = relocation_slots(res, np.array([0]), torch.arange(16, device=device))
    assert src.tolist() == [3, 4, 5] and dst.tolist() == [2, 3, 4]
    k = torch.arange(16., device=device).view(4, 4, 1, 1).clone()
    v = k.clone() + 100
    move_kv([(k, v)], src, dst)
    assert k.flatten()[2:5].tolist() == [3., 4., 5.] and v.flatten()[2:5].tolist() == [103., 104., 105.]


def test_every_layer_moves_whatever_its_block_size(device):
    """Layers of two block sizes in one call (the split of slots into block and offset is
    computed once per block size, not per layer): each layer's slots move, nothing else."""
    src = torch.tensor([9, 10, 11], device=device)
    dst = torch.tensor([5, 6, 7], device=device)
    layers = [tuple(torch.randn(64 // bs, bs, 2, 3, device=device) for _ in range(2)) for bs in (4, 8, 4, 16)]
    before = [(k.clone(), v.clone()) for k, v in layers]
    move_kv(layers, src, dst)
    for (k, v), (k0, v0) in zip(layers, before):
        for cache, old in ((k, k0), (v, v0)):
            flat, flat0 = cache.flatten(0, 1), old.flatten(0, 1)
            assert torch.equal(flat[dst], flat0[src])
            keep = torch.ones(64, dtype=torch.bool, device=device)
            keep[dst] = False
            assert torch.equal(flat[keep], flat0[keep])
