"""step_plan.build_plan against the TokenTree it must agree with (tree.py), on random layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_ouroboros.step_plan import build_plan, truncate_layout
from vllm_ouroboros.tree import ancestor_bits, build_tree


def _flat_walk(c, n, sl):
    """Truncation by walking the flat list token by token (the obvious way)."""
    n2, sl2 = 0, [0] * len(sl)
    if c > n + sum(sl):
        return c, sl2
    for f in range(c):
        if f < n:
            n2 += 1
        else:
            rest = f - n
            for k, l in enumerate(sl):
                if rest < l:
                    sl2[k] += 1
                    break
                rest -= l
    return n2, sl2


def test_truncate_layout_matches_a_flat_walk():
    rng = np.random.default_rng(0)
    for _ in range(300):
        K = int(rng.integers(0, 4))
        n = int(rng.integers(0, 9))
        sl = rng.integers(0, 5, K)
        c = int(rng.integers(0, n + sl.sum() + 3))
        got_n, got_sl = truncate_layout(np.array([c]), np.array([n]), sl[None])
        want_n, want_sl = _flat_walk(c, n, list(sl))
        assert got_n[0] == want_n and got_sl[0].tolist() == want_sl


def test_plan_matches_tree_masks_and_positions(device):
    rng = np.random.default_rng(1)
    for trial in range(40):
        B, K, L = int(rng.integers(1, 7)), 3, 4
        n = rng.integers(0, 9, B)
        sl = np.where(rng.random((B, K)) < 0.7, L, rng.integers(0, L + 1, (B, K)))
        c = np.minimum(n + sl.sum(1), rng.integers(0, 30, B))
        q_counts = c + 1 + rng.integers(0, 3, B) * (c == 0)  # other rows in vLLM's batch
        qs = np.concatenate([[0], np.cumsum(q_counts)])
        nc = rng.integers(0, 100, B)
        plan = build_plan(c, n, sl, qs, nc)
        n2, sl2 = truncate_layout(c, n, sl)
        # The plan is host numpy; the tree it must agree with lives on the device.
        tree = build_tree(torch.zeros(B, 8 + 1, dtype=torch.long, device=device),
                          torch.from_numpy(n2).to(device),
                          torch.zeros(B, K, L, dtype=torch.long, device=device),
                          torch.from_numpy(sl2).to(device))
        bits = ancestor_bits(tree, with_root=True).cpu().numpy()  # [B, N+1]
        depth = tree.depth.cpu().numpy()
        expect_tree = [b for b in range(B) if (sl2[b, 1:] > 0).any()]
        assert plan.tree_reqs.tolist() == expect_tree
        moved = dict(zip(plan.pos_rows.tolist(), plan.pos_delta.tolist()))
        for t, b in enumerate(expect_tree):
            rows = plan.q_rows[plan.q_start[t]:plan.q_start[t + 1]]
            assert rows.tolist() == list(range(qs[b], qs[b] + c[b] + 1))
            assert plan.prefix_lens[t] == nc[b]
            got = plan.bits[plan.q_start[t]:plan.q_start[t + 1]]
            assert got.tolist() == bits[b, :c[b] + 1].tolist(), (trial, b)
            for f in range(1, c[b] + 1):
                assert moved.get(qs[b] + f, 0) == f - depth[b, f - 1]
            write = plan.write[plan.q_start[t]:plan.q_start[t + 1]]
            branch = tree.branch_of[b, :c[b]].cpu().numpy()
            assert write.tolist() == [False] + (branch >= 1).tolist()
        # Rows of other requests never move.
        tree_rows = set(plan.q_rows.tolist())
        assert all(r in tree_rows for r in plan.pos_rows.tolist())


def test_plan_layout_is_the_truncated_layout_and_rejects_a_narrow_width():
    n, sl = np.array([3, 2]), np.array([[4, 4], [4, 0]])
    c = np.array([9, 4])  # request 0 loses the last two tokens of suffix 1
    plan = build_plan(c, n, sl, np.array([0, 10, 15]), np.array([7, 9]), L=6)
    assert plan.layout.n.tolist() == [3, 2] and plan.layout.slen.tolist() == [[4, 2], [2, 0]]
    assert (plan.layout.D, plan.layout.L) == (3, 6)
    with pytest.raises(ValueError, match="a suffix of 4 tokens exceeds the layout's width L = 3"):
        build_plan(c, n, sl, np.array([0, 10, 15]), np.array([7, 9]), L=3)
