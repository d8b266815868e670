"""The layout of one target verification step, from what vLLM scheduled (host side).

The proposer sends vLLM one flat token list per request: the sentence draft (n tokens), then
candidate suffix 0, suffix 1, ... (l_k tokens each). vLLM schedules the root (the last sampled
token) plus the first c of those tokens at consecutive KV slots; c may be smaller than what was
proposed (token budget, max_model_len), which cuts the flat list, so the scheduled part is still
a tree: a draft prefix, or the full draft and the first suffixes. Flat index f (0 = root) is the
query row, the KV slot and, for f >= 1, TokenTree node f - 1 (tree.py numbers nodes in the same
order). What changes for a suffix k >= 1 node is its position (depth, not f) and the tokens it
attends (the draft and its own suffix, not the earlier suffixes): the two things this plan gives
the runner and the attention. Both are read from the step's TreeLayout (tree.py), the same
numbering the walk and the pool feedback read. No vLLM imports: numpy on the host, as vLLM
builds its own per-step metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import TreeLayout

# Tree query rows per request: the ancestor masks are int64 bitmasks.
MAX_TREE_ROWS = 64


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """0..counts[0]-1, 0..counts[1]-1, ... concatenated. Shape: counts [B] -> [sum(counts)]."""
    counts = np.asarray(counts, np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def truncate_layout(num_scheduled: np.ndarray, draft_len: np.ndarray,
                    suffix_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The proposed layout cut to the first num_scheduled flat tokens.

    Shape: num_scheduled [B], draft_len [B], suffix_len [B, K] -> (draft_len [B], suffix_len [B, K]).
    A request whose scheduled count exceeds its known layout (no layout recorded) is a plain chain.
    """
    c = np.asarray(num_scheduled, np.int64)
    n = np.asarray(draft_len, np.int64)
    sl = np.asarray(suffix_len, np.int64)
    known = c <= n + sl.sum(1)
    n_cut = np.where(known, np.minimum(n, c), c)
    rem = np.where(known, c - n_cut, 0)
    before = sl.cumsum(1) - sl
    sl_cut = np.minimum(np.maximum(rem[:, None] - before, 0), sl)
    return n_cut, sl_cut


@dataclass
class StepPlan:
    """One step's trees (all B requests of the batch) and the rows that need tree treatment.

    Batch fields (B requests, K suffix slots):
      num_drafts:  [B] int64, scheduled draft tokens c (= n + sum(suffix_len)).
      draft_len:   [B] int64, n after truncation.
      suffix_len:  [B, K] int64, l_k after truncation.
    Tree requests (those with a scheduled node in a suffix k >= 1; Bt of them):
      tree_reqs:   [Bt] int64, batch index.
      q_rows:      [Tt] int64, query rows (into vLLM's flat batch) of all their 1 + c rows.
      q_start:     [Bt + 1] int32, cumulative row counts (the kernel's query_start).
      prefix_lens: [Bt] int32, tokens cached before the root (its position).
      bits:        [Tt] int64, bit j set = row attends row j of its request (the kernel's mask).
      write:       [Tt] bool, rows whose attention differs from causal (suffix k >= 1 nodes).
      pos_rows:    [P] int64, query rows whose position is not root + f, and
      pos_delta:   [P] int64, how much to subtract from vLLM's position there.
    layout:        the TreeLayout of all B requests (truncated lengths; tree.py), which the
                   step's TokenTree is built from.
    """

    num_drafts: np.ndarray
    draft_len: np.ndarray
    suffix_len: np.ndarray
    tree_reqs: np.ndarray
    q_rows: np.ndarray
    q_start: np.ndarray
    prefix_lens: np.ndarray
    bits: np.ndarray
    write: np.ndarray
    pos_rows: np.ndarray
    pos_delta: np.ndarray
    layout: TreeLayout

    @property
    def has_tree(self) -> bool:
        return len(self.tree_reqs) > 0

    @property
    def max_rows(self) -> int:
        """Largest tree (rows incl. root) among the tree requests; 0 if none."""
        return int(np.diff(self.q_start).max()) if self.has_tree else 0


def build_plan(num_scheduled: np.ndarray, draft_len: np.ndarray, suffix_len: np.ndarray,
               query_start: np.ndarray, num_computed: np.ndarray, L: int | None = None) -> StepPlan:
    """Plan one step.

    Shape: num_scheduled [B] (draft tokens vLLM scheduled per request), draft_len [B] and
    suffix_len [B, K] (the layout proposed), query_start [B + 1] (first query row of each
    request; its root), num_computed [B] (the root's position). L: the layout's padded suffix
    width (>= every suffix length; default their maximum).
    """
    n, sl = truncate_layout(num_scheduled, draft_len, suffix_len)
    c = n + sl.sum(1)
    L_max = int(sl.max(initial=0))
    if L is not None and L < L_max:
        raise ValueError(f"a suffix of {L_max} tokens exceeds the layout's width L = {L}")
    L = L_max if L is None else L
    layout = TreeLayout(n, sl, D=int(n.max(initial=0)), L=L)
    tree = np.nonzero((sl[:, 1:] > 0).any(1))[0] if sl.shape[1] > 1 else np.zeros(0, np.int64)
    if len(tree) and (c[tree] + 1).max() > MAX_TREE_ROWS:
        raise ValueError(f"a tree of {(c[tree] + 1).max()} rows exceeds {MAX_TREE_ROWS}")
    counts = c[tree] + 1
    q_start = np.zeros(len(tree) + 1, np.int32)
    q_start[1:] = np.cumsum(counts)
    req = np.repeat(np.arange(len(tree)), counts)  # index into tree
    f = ragged_arange(counts)
    rb, node = tree[req], np.maximum(f - 1, 0)  # row f >= 1 is node f - 1; row 0 the root
    nr = n[rb]
    in_sfx = (f >= 1) & layout.is_suf[rb, node]
    j = layout.j[rb, node]
    depth = np.where(in_sfx, layout.depth[rb, node], f)
    branch = np.where(in_sfx, layout.branch_of[rb, node], -1)

    u = np.uint64
    f_u, nr_u, j_u = f.astype(u), nr.astype(u), np.maximum(j, 0).astype(u)
    # Bits 0..x set, written so that x = 63 does not shift by 64.
    def low_bits(x):
        return np.where(x >= u(63), ~u(0), (u(1) << (x + u(1))) - u(1))
    bits = np.where(in_sfx, low_bits(nr_u) | (low_bits(j_u) << (f_u - j_u)), low_bits(f_u))

    q_rows = query_start[tree][req].astype(np.int64) + f
    delta = f - depth
    moved = delta > 0
    return StepPlan(
        num_drafts=c, draft_len=n, suffix_len=sl, tree_reqs=tree.astype(np.int64),
        q_rows=q_rows, q_start=q_start,
        prefix_lens=np.asarray(num_computed, np.int64)[tree].astype(np.int32),
        bits=bits.view(np.int64), write=branch >= 1,
        pos_rows=q_rows[moved], pos_delta=delta[moved], layout=layout,
    )
