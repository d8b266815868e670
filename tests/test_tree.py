"""Token tree layout on hand-made drafts and suffixes (tree.py).

Node order per row: draft chain, then suffix 0, suffix 1, ...; parents -1 = the root; depth is
the offset from the root's position, the same for token j of every suffix.
"""

import random

import numpy as np
import torch

from conftest import DEVICE

from vllm_ouroboros.tree import PAD_BRANCH, ancestor_bits, build_tree, flatten

T = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731


def ref_ancestors(parents, num_nodes, N):
    """Mask from walking parents up (independent of build_tree's formula)."""
    m = [[False] * N for _ in range(N)]
    for i in range(N):
        if i >= num_nodes:
            m[i][i] = True  # padding sees only itself
            continue
        j = i
        while j != -1:
            m[i][j] = True
            j = parents[j]
    return m


def test_draft_and_two_suffixes_hand_written():
    tree = build_tree(T([[11, 12, 13]]), T([3]), T([[[21, 22], [31, 32]]]), T([[2, 2]]))
    assert tree.tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3, 2, 5]]
    # Suffix 1 sits at the same depths as suffix 0 (tempting: 6, 7, as if chained after it).
    assert tree.depth.tolist() == [[1, 2, 3, 4, 5, 4, 5]]
    assert tree.positions(T([100])).tolist() == [[101, 102, 103, 104, 105, 104, 105]]
    assert tree.branch_of.tolist() == [[-1, -1, -1, 0, 0, 1, 1]]
    assert tree.num_nodes.tolist() == [7]
    assert tree.suffix_start.tolist() == [[3, 5]] and tree.suffix_len.tolist() == [[2, 2]]
    assert tree.paths.tolist() == [[[0, 1, 2, 3, 4], [0, 1, 2, 5, 6]]]
    assert tree.path_len.tolist() == [[5, 5]]
    expected = [  # row i: which nodes node i attends
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],  # suffix 1 head: draft + itself, not suffix 0 (tempting: causal)
        [1, 1, 1, 0, 0, 1, 1],
    ]
    assert tree.ancestor_mask[0].long().tolist() == expected


def test_no_draft_suffixes_hang_off_the_root():
    tree = build_tree(T([[0, 0]]), T([0]), T([[[5, 6, 7], [8, 9, 4]]]), T([[3, 2]]))
    assert tree.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert tree.parents.tolist() == [[-1, 0, 1, -1, 3, -1, -1, -1]]
    assert tree.depth.tolist() == [[1, 2, 3, 1, 2, 0, 0, 0]]
    assert tree.branch_of.tolist() == [[0, 0, 0, 1, 1] + [PAD_BRANCH] * 3]
    assert tree.num_nodes.tolist() == [5]
    assert tree.paths.tolist() == [[[0, 1, 2, -1, -1], [3, 4, -1, -1, -1]]]
    m = tree.ancestor_mask[0].long().tolist()
    assert m[4] == [0, 0, 0, 1, 1, 0, 0, 0]
    assert m[6] == [0, 0, 0, 0, 0, 0, 1, 0]  # padding: itself only


def test_ragged_batch_with_empty_and_short_suffixes():
    draft = T([[1, 2, 3], [4, 0, 0], [0, 0, 0]])
    n = T([3, 1, 0])
    suffixes = T([[[10, 11], [12, 13], [14, 15]],
                  [[20, 21], [22, 23], [24, 25]],
                  [[30, 31], [32, 33], [34, 35]]])
    slen = T([[2, 0, 1],   # suffix 1 invalid: suffix 2 starts right after suffix 0
              [0, 0, 0],   # draft only
              [1, 2, 0]])
    tree = build_tree(draft, n, suffixes, slen)
    assert tree.N == 3 + 3 * 2
    assert tree.tokens.tolist() == [[1, 2, 3, 10, 11, 14, 0, 0, 0],
                                    [4, 0, 0, 0, 0, 0, 0, 0, 0],
                                    [30, 32, 33, 0, 0, 0, 0, 0, 0]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3, 2, -1, -1, -1],
                                     [-1, -1, -1, -1, -1, -1, -1, -1, -1],
                                     [-1, -1, 1, -1, -1, -1, -1, -1, -1]]
    assert tree.depth.tolist() == [[1, 2, 3, 4, 5, 4, 0, 0, 0],
                                   [1, 0, 0, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 2, 0, 0, 0, 0, 0, 0]]
    P = PAD_BRANCH
    assert tree.branch_of.tolist() == [[-1, -1, -1, 0, 0, 2, P, P, P],
                                       [-1, P, P, P, P, P, P, P, P],
                                       [0, 1, 1, P, P, P, P, P, P]]
    assert tree.num_nodes.tolist() == [6, 1, 3]
    assert tree.suffix_start.tolist() == [[3, 5, 5], [1, 1, 1], [0, 1, 3]]
    assert tree.path_len.tolist() == [[5, 3, 4], [1, 1, 1], [1, 2, 0]]
    assert tree.paths[0].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, -1, -1], [0, 1, 2, 5, -1]]
    assert tree.paths[2].tolist() == [[0, -1, -1, -1, -1], [1, 2, -1, -1, -1], [-1] * 5]
    for b in range(3):
        ref = ref_ancestors(tree.parents[b].tolist(), int(tree.num_nodes[b]), tree.N)
        assert tree.ancestor_mask[b].tolist() == ref


def build_ref(draft, suffixes):
    """Per-row Python reference: tokens, parents, depth, branch lists of one row."""
    tokens, parents, depth, branch = list(draft), list(range(-1, len(draft) - 1)), \
        list(range(1, len(draft) + 1)), [-1] * len(draft)
    for k, s in enumerate(suffixes):
        for j, x in enumerate(s):
            tokens.append(x)
            parents.append(len(draft) - 1 if j == 0 else len(tokens) - 2)
            depth.append(len(draft) + 1 + j)
            branch.append(k)
    return tokens, parents, depth, branch


def test_random_ragged_batch_matches_reference():
    rnd = random.Random(0)
    B, D, K, L = 16, 5, 3, 4
    draft = torch.randint(0, 50, (B, D), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    suffixes = torch.randint(0, 50, (B, K, L), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    n = T([rnd.randint(0, D) for _ in range(B)])
    slen = T([[rnd.choice([0, 0, 1, L, L - 1, L]) for _ in range(K)] for _ in range(B)])
    tree = build_tree(draft, n, suffixes, slen)
    for b in range(B):
        d = draft[b, :n[b]].tolist()
        ss = [suffixes[b, k, :slen[b, k]].tolist() for k in range(K)]
        tok, par, dep, br = build_ref(d, ss)
        m = len(tok)
        assert int(tree.num_nodes[b]) == m
        assert tree.tokens[b, :m].tolist() == tok
        assert tree.parents[b, :m].tolist() == par
        assert tree.depth[b, :m].tolist() == dep
        assert tree.branch_of[b, :m].tolist() == br
        assert tree.ancestor_mask[b].tolist() == ref_ancestors(par, m, tree.N)
        for k in range(K):
            path = tree.paths[b, k, :tree.path_len[b, k]].tolist()
            assert [tok[i] for i in path] == d + ss[k]


def test_no_suffixes_and_no_draft_shapes():
    empty = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=DEVICE)  # noqa: E731
    tree = build_tree(T([[1, 2]]), T([2]), empty(1, 0, 3), empty(1, 0))
    assert tree.tokens.tolist() == [[1, 2]] and tree.parents.tolist() == [[-1, 0]]
    assert tree.paths.shape == (1, 0, 5)
    tree = build_tree(empty(2, 0), T([0, 0]), T([[[7, 8]], [[9, 6]]]), T([[2], [1]]))
    assert tree.tokens.tolist() == [[7, 8], [9, 0]]
    assert tree.parents.tolist() == [[-1, 0], [-1, -1]]
    assert tree.depth.tolist() == [[1, 2], [1, 0]]


def test_flatten_with_and_without_root():
    tree = build_tree(T([[5, 6], [7, 0]]), T([2, 0]), T([[[1, 2]], [[3, 4]]]), T([[1], [2]]))
    flat = flatten(tree, T([10, 20]))
    assert flat.cu_seqlens.tolist() == [0, 3, 5] and flat.cu_seqlens.dtype == torch.int32
    assert flat.tokens.tolist() == [5, 6, 1, 3, 4]
    assert flat.positions.tolist() == [11, 12, 13, 21, 22]
    assert flat.row.tolist() == [0, 0, 0, 1, 1] and flat.node.tolist() == [0, 1, 2, 0, 1]
    flat = flatten(tree, T([10, 20]), root_tokens=T([99, 98]))
    assert flat.cu_seqlens.tolist() == [0, 4, 7]
    assert flat.tokens.tolist() == [99, 5, 6, 1, 98, 3, 4]
    assert flat.positions.tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert flat.node.tolist() == [-1, 0, 1, 2, -1, 0, 1]


def test_ancestor_bits_match_mask():
    tree = build_tree(T([[11, 12, 13]]), T([3]), T([[[21, 22], [31, 32]]]), T([[2, 2]]))
    bits = ancestor_bits(tree)[0].tolist()
    assert bits == [0b1, 0b11, 0b111, 0b1111, 0b11111, 0b100111, 0b1100111]
    bits = ancestor_bits(tree, with_root=True)[0].tolist()
    assert bits == [0b1, 0b11, 0b111, 0b1111, 0b11111, 0b111111, 0b1001111, 0b11001111]


def test_ancestor_bits_use_all_64_bits():
    # 63 draft nodes + the root fill an int64: the last node's word has bit 63 set (negative).
    D = 63
    tree = build_tree(torch.arange(D, device=DEVICE)[None], T([D]),
                      torch.zeros(1, 0, 1, dtype=torch.long, device=DEVICE),
                      torch.zeros(1, 0, dtype=torch.long, device=DEVICE))
    bits = ancestor_bits(tree, with_root=True)[0]
    assert int(bits[-1]) == -1  # all 64 bits
    assert int(bits[-2]) == (1 << 63) - 1
    for i in range(D + 1):
        word = int(bits[i]) & ((1 << 64) - 1)
        assert word == (1 << (i + 1)) - 1


def test_flat_layout_tree_equals_build_tree():
    """vLLM's flat layout (per request the draft, then the suffixes; requests back to back), read
    through TreeLayout.tree(flat=...) as the target step does, gives the tree build_tree lays out
    from the draft and the suffixes, field for field: empty drafts, empty and short suffixes, one
    suffix, no suffix, rows of different widths."""
    from vllm_ouroboros.tree import TreeLayout

    rng = random.Random(7)
    for D, K, L in [(4, 3, 3), (6, 1, 4), (3, 0, 2), (1, 2, 1), (8, 3, 4)]:
        B = 5
        n = [rng.randint(0, D) for _ in range(B)]
        sl = [[rng.randint(0, L) for _ in range(K)] for _ in range(B)]
        draft = [[rng.randint(2, 99) for _ in range(D)] for _ in range(B)]
        sfx = [[[rng.randint(2, 99) for _ in range(L)] for _ in range(K)] for _ in range(B)]
        rows = [draft[b][:n[b]] + [t for k in range(K) for t in sfx[b][k][:sl[b][k]]] for b in range(B)]
        flat = T([t for r in rows for t in r] + [-5])  # -5: what lies past the drafts is never read
        want = build_tree(T(draft).view(B, D), T(n), T(sfx).view(B, K, L), T(sl).view(B, K))
        got = TreeLayout(np.array(n), np.array(sl).reshape(B, K), D, L).tree(flat.device, flat=flat)
        for name in ("tokens", "parents", "depth", "num_nodes", "branch_of", "draft_len", "suffix_start",
                     "suffix_len", "paths", "path_len", "ancestor_mask"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (D, K, L, name)
        assert (got.D, got.K, got.L) == (want.D, want.K, want.L)
