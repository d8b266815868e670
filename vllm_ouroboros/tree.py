"""The token tree the target verifies in one forward (README, "How a step runs").

Per request: the sentence draft d[0..n-1] is a chain under the root (the last confirmed token),
and K candidate suffixes s_k[0..len_k-1] are chains under the last draft token (under the root
if n == 0). A suffix sees the prefix and the whole draft but not the other suffixes, and its
token j sits at depth n + 1 + j whatever k is: all suffixes occupy the same positions.

Nodes are numbered per row, compactly: draft chain first, then suffix 0, suffix 1, ...; a
suffix of length 0 takes no node, and nodes num_nodes .. N-1 are padding. N = D + K*L is static
(D, K, L the padded widths of the inputs), so shapes do not depend on the data.

    root ── d0 ── d1 ── ... ── d[n-1] ─┬─ s0[0] ── s0[1] ── ...
                                       ├─ s1[0] ── s1[1] ── ...
                                       └─ ...

Position of node i = position of the root + depth[i]. No vLLM imports.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .host_copy import to_device, to_host

# Padding entries of TokenTree.branch_of (draft nodes are -1, suffix nodes their k).
PAD_BRANCH = -2


def _uploaded_on_first_use(name: str) -> functools.cached_property:
    """A TokenTree field that is TreeLayout's array `name`, uploaded to the tree's device the
    first time it is read (then cached)."""
    def get(tree: "TokenTree") -> torch.Tensor:
        return to_device(tree.tokens.device, getattr(tree.layout, name))[0]

    get.__doc__ = f"TreeLayout.{name} on the tree's device (the class docstring gives its shape)."
    return functools.cached_property(get)


@dataclass
class TokenTree:
    """Draft + suffixes as a tree, batched and padded to N = D + K*L nodes per row.

    Fields (int64 unless stated; entries of node i >= num_nodes[b] are padding:
    token 0, parent -1, depth 0, branch PAD_BRANCH):
      tokens:        [B, N], token of node i.
      parents:       [B, N], parent node index; -1 = child of the root.
      depth:         [B, N], 1-based distance from the root (draft i: i + 1; suffix token j:
                     n + 1 + j); the node's position offset from the root.
      num_nodes:     [B], n + sum_k suffix_len.
      ancestor_mask: (a property, built on first use)
                     [B, N, N] bool, [b, i, j] = node j is node i or an ancestor of it (the
                     root, in the KV cache or the query, is seen by all and not included).
                     A padding node sees only itself, so no softmax row is empty.
      branch_of:     [B, N], -1 for draft nodes, k for suffix k, PAD_BRANCH for padding.
      draft_len:     [B], n.
      suffix_start:  [B, K], node index of suffix k's first token (n + earlier lengths).
      suffix_len:    [B, K], tokens of suffix k in the tree (0 = no suffix k).
      paths:         [B, K, D + L], node indices from the root's first child to the end of
                     suffix k (draft nodes 0..n-1, then suffix k's nodes), -1 padded. The
                     draft chain alone is nodes 0..n-1.
      path_len:      [B, K], n + suffix_len.
      layout:        the TreeLayout (host, numpy) these fields come from: the greedy walk
                     and the pool feedback read it there, not back from the device.
    tokens, valid and what the sampled walk reads (branch_of, draft_len, suffix_start,
    suffix_len) are uploaded with the tree; parents, depth, num_nodes, paths and path_len,
    which no step reads on the device, on first use (properties).
    """

    tokens: torch.Tensor
    branch_of: torch.Tensor
    draft_len: torch.Tensor
    suffix_start: torch.Tensor
    suffix_len: torch.Tensor
    D: int
    K: int
    L: int
    layout: TreeLayout

    # The layout's arrays no step reads on the device (tests do): uploaded on first use.
    parents = _uploaded_on_first_use("parents")
    depth = _uploaded_on_first_use("depth")
    num_nodes = _uploaded_on_first_use("num_nodes")
    paths = _uploaded_on_first_use("paths")
    path_len = _uploaded_on_first_use("path_len")
    # Uploaded with the tree (TreeLayout.tree sets it); the walk and the feedback read it often.
    valid = _uploaded_on_first_use("valid")

    @property
    def B(self) -> int:
        return self.tokens.shape[0]

    @property
    def N(self) -> int:
        return self.tokens.shape[1]

    @functools.cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[B, N, N] bool (see the class docstring). Built on first use: the target's step reads
        the attention pattern from step_plan's bits and the walk needs no mask, so a step that
        builds its trees does not pay for it."""
        col = torch.arange(self.N, device=self.tokens.device)
        valid = self.valid
        # j attends i iff j is a draft node at or before i, or in i's own suffix at or before
        # i: suffixes are contiguous and come after the whole draft, so index order is tree order.
        ci, cj = col[None, :, None], col[None, None, :]
        bi, bj = self.branch_of[:, :, None], self.branch_of[:, None, :]
        mask = valid[:, :, None] & valid[:, None, :] & (cj <= ci) & ((bj == -1) | (bj == bi))
        return mask | ((ci == cj) & ~valid[:, :, None])

    def positions(self, root_pos: torch.Tensor) -> torch.Tensor:
        """Absolute positions. Shape: root_pos [B] -> [B, N] (padding sits at root_pos)."""
        return root_pos[:, None] + self.depth


def build_tree(draft: torch.Tensor, draft_len: torch.Tensor, suffixes: torch.Tensor,
               suffix_len: torch.Tensor) -> TokenTree:
    """Lay out the sentence draft and K suffixes as one token tree per request.

    Shape:
      draft:      [B, D] int64, the first draft_len[b] are real.
      draft_len:  [B] int64 in 0..D.
      suffixes:   [B, K, L] int64, suffix k's first suffix_len[b, k] tokens are real.
      suffix_len: [B, K] int64 in 0..L (0 = invalid suffix; a bool validity mask times L works).
    Lengths outside their range are clamped. The layout is computed on the host (TreeLayout):
    lengths on a GPU are read back first (one sync); the engine's step builds its trees from
    vLLM's flat drafts and lengths the host already has (TreeLayout.tree(flat=...), the step's
    plan). The tree is on draft's device.
    """
    B, D = draft.shape
    K, L = suffixes.shape[1], suffixes.shape[2]
    assert suffixes.shape[0] == B and suffix_len.shape == (B, K) and draft_len.shape == (B,)
    # One read-back for the four (one sync on a GPU, where a .cpu() each waited each time).
    dlen, slen, sfx, drf = to_host(draft_len.long(), suffix_len.long(), suffixes.long(), draft.long())
    lay = TreeLayout(dlen, slen, D, L)
    # One dummy column when D or L is 0 and a dummy empty suffix when K == 0 keep the gathers
    # shape-valid; they are never selected.
    if not (K and L):
        sfx = np.zeros((B, max(K, 1), max(L, 1)), np.int64)
    if not D:
        drf = np.zeros((B, 1), np.int64)
    suf_tok = sfx[np.arange(B)[:, None], lay.k, np.minimum(lay.j, sfx.shape[2] - 1)]
    drf_tok = np.take_along_axis(drf, np.minimum(lay.col, drf.shape[1] - 1), 1)
    tokens = np.where(lay.is_draft, drf_tok, np.where(lay.is_suf, suf_tok, 0)).astype(np.int64)
    return lay.tree(draft.device, tokens=tokens)


class TreeLayout:
    """Everything of the trees but their tokens (build_tree's numbering), numpy on the host:
    per node its suffix k, offset j, kind, parent, depth; per suffix its start; per path its
    nodes. The lengths the proposer sent are host data, so the layout costs no kernel launch;
    `tree()` uploads the fields the walk and the pool feedback read in one copy per dtype.

    Shape: draft_len [B], suffix_len [B, K] (clamped to 0..D and 0..L); node arrays [B, N],
    N = D + K * L; paths [B, K, D + L].
    """

    def __init__(self, draft_len: np.ndarray, suffix_len: np.ndarray, D: int, L: int):
        suffix_len = np.asarray(suffix_len, np.int64)
        B, K = suffix_len.shape
        N = D + K * L
        self.D, self.K, self.L = D, K, L
        # Here and in the step's other host code, np.minimum / np.maximum rather than np.clip
        # and plain indexing rather than np.take_along_axis: the same values for a quarter of
        # the call overhead, which is most of what arrays of a few dozen entries cost
        # (scripts/step_ops.py times the step's host work).
        self.n = n = np.minimum(np.maximum(np.asarray(draft_len, np.int64), 0), D)
        self.slen = slen = np.minimum(np.maximum(suffix_len, 0), L)
        sl = slen if K else np.zeros((B, 1), np.int64)  # a dummy empty suffix when K == 0
        self.sstart = sstart = n[:, None] + sl.cumsum(1) - sl  # [B, K']
        send = sstart + sl
        self.num_nodes = n + sl.sum(1)
        self.col = col = np.arange(N, dtype=np.int64)[None, :].repeat(B, 0)
        self.is_draft = is_draft = col < n[:, None]
        self.valid = valid = col < self.num_nodes[:, None]
        self.is_suf = is_suf = valid & ~is_draft
        # Suffix of node i: how many suffixes end at or before i (empty ones end where they
        # start, so they are skipped); j is its offset inside that suffix.
        self.k = k = np.minimum((col[:, :, None] >= send[:, None, :]).sum(-1), sl.shape[1] - 1)
        self.j = j = np.minimum(np.maximum(col - sstart[np.arange(B)[:, None], k], 0), max(L - 1, 0))
        self.branch_of = np.where(is_draft, -1, np.where(is_suf, k, PAD_BRANCH))
        self.depth = np.where(is_draft, col + 1, np.where(is_suf, n[:, None] + 1 + j, 0))
        # A suffix head hangs off the last draft node (n - 1, which is -1 = root when n == 0).
        self.parents = np.where(is_draft, col - 1,
                                np.where(is_suf, np.where(j == 0, n[:, None] - 1, col - 1), -1))
        t = np.arange(D + L, dtype=np.int64)[None, None, :]
        nn = n[:, None, None]
        self.paths = np.where(t < nn, t, np.where(t < nn + slen[:, :, None],
                                                  sstart[:, :K, None] + t - nn, -1))
        self.path_len = n[:, None] + slen

    def tree(self, device: torch.device | str, tokens: np.ndarray | None = None,
             flat: torch.Tensor | None = None) -> TokenTree:
        """The TokenTree on `device`, its tokens given on the host (tokens [B, N]) or read
        from vLLM's flat drafts on the device; one upload either way.

        flat: [T] int64, per request the draft, then suffix 0, suffix 1, ..., the requests back
        to back (SpecDecodeMetadata.draft_token_ids), T >= sum(num_nodes); node i of request b
        is flat token (b's start) + i (build_tree numbers nodes in this order), one gather."""
        if (tokens is None) == (flat is None):
            raise ValueError("TreeLayout.tree: give the tokens (host) or flat (device), one of them")
        if tokens is None:
            start = np.cumsum(self.num_nodes) - self.num_nodes
            tokens = np.where(self.valid, start[:, None] + self.col, 0)  # flat index of each node
        branch_of, n, sstart, slen, valid, tok = to_device(
            device, self.branch_of, self.n, self.sstart[:, :self.K], self.slen, self.valid, tokens)
        if flat is not None:
            assert flat.numel() >= int(self.num_nodes.sum())
            # Padding nodes read flat token 0 (or nothing in an empty step), then become 0.
            tok = torch.where(valid, flat.long()[tok], 0) if flat.numel() else torch.zeros_like(tok)
        tree = TokenTree(tokens=tok, branch_of=branch_of, draft_len=n, suffix_start=sstart,
                         suffix_len=slen, D=self.D, K=self.K, L=self.L, layout=self)
        tree.__dict__["valid"] = valid  # the cached property, already uploaded
        return tree


@dataclass
class FlatTree:
    """The tree as ragged query rows, for the attention side.

    Fields (T = total query tokens):
      cu_seqlens: [B + 1] int32, row b is tokens[cu_seqlens[b] : cu_seqlens[b+1]].
      tokens:     [T] int64.
      positions:  [T] int64, root_pos + depth (the root itself, if included, at root_pos).
      row:        [T] int64, request of each query token.
      node:       [T] int64, tree node of each query token; -1 for the root.
    """

    cu_seqlens: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    row: torch.Tensor
    node: torch.Tensor


def flatten(tree: TokenTree, root_pos: torch.Tensor,
            root_tokens: torch.Tensor | None = None) -> FlatTree:
    """Concatenate the real nodes of every row, optionally each row's root first.

    Shape: root_pos [B] int64 (position of the root token), root_tokens [B] int64 or None.
    Pass root_tokens when the root's KV is not cached yet (vLLM feeds the last sampled token
    with the drafts): then query slot 0 of a row is the root and node i is query slot 1 + i,
    so the target's outputs per row line up with accept.py's `target_next` / `probs` rows.
    Boolean indexing: one host sync on an accelerator.
    """
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    valid = tree.valid
    tokens, pos = tree.tokens, tree.positions(root_pos)
    node = torch.arange(N, device=dev)[None, :].expand(B, N)
    if root_tokens is not None:
        one = torch.ones(B, 1, dtype=torch.bool, device=dev)
        valid = torch.cat([one, valid], 1)
        tokens = torch.cat([root_tokens.long()[:, None], tokens], 1)
        pos = torch.cat([root_pos[:, None], pos], 1)
        node = torch.cat([node.new_full((B, 1), -1), node], 1)
    row = torch.arange(B, device=dev)[:, None].expand_as(node)
    counts = valid.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    cu[1:] = counts.cumsum(0)
    return FlatTree(cu_seqlens=cu, tokens=tokens[valid], positions=pos[valid], row=row[valid],
                    node=node[valid])


def ancestor_bits(tree: TokenTree, with_root: bool = False) -> torch.Tensor:
    """Per node, the int64 bitmask of the nodes it attends (bit j = node j of its row).

    Shape: -> [B, N], or [B, N + 1] with_root (bit/slot 0 = the root, seen by every real node;
    node i is bit 1 + i; padding nodes see only themselves). Needs N (+ 1) <= 64; bit 63 makes
    the value negative, which is fine for bitwise tests.
    """
    mask = tree.ancestor_mask
    if with_root:
        B, N = tree.tokens.shape
        m = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=mask.device)
        m[:, 0, 0] = True
        m[:, 1:, 0] = tree.valid
        m[:, 1:, 1:] = mask
        mask = m
    W = mask.shape[-1]
    assert W <= 64, f"{W} query slots do not fit an int64 bitmask"
    bit = torch.ones(W, dtype=torch.int64, device=mask.device) << torch.arange(W, device=mask.device)
    # Distinct bits: the sum is the OR and never carries.
    return (mask.long() * bit).sum(-1)
