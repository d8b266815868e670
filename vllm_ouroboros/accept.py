"""Acceptance walk over the verified token tree (README, "How a step runs").

Row convention for the target's outputs (both walks): row 0 is the target's prediction after
the root (the last confirmed token), row 1 + i the prediction after tree node i. With the root
in the query (tree.flatten(..., root_tokens=...)) these are simply the query rows in order.

* Greedy: accept the longest draft prefix equal to the target's argmax; only if the whole draft
  is accepted, follow the suffix with the longest match (tie: lowest k). Emit the accepted
  tokens plus the target's token after the last accepted node: the correction, or the bonus,
  also after a fully matched suffix (the reference code drops that one: a bug).
* Sampling: multi-candidate rejection sampling for one-hot (deterministic) draft proposals, as
  in SpecInfer / Lookahead Decoding. At the current node with target distribution p, the
  children are tried in a fixed order (draft child; at the last draft node the suffix heads in k
  order): child x is accepted with probability r(x) / sum(r), r the residual (initially p); on
  rejection r(x) = 0. If all are rejected the token is sampled from r. Child x is then emitted
  with probability p(x) and every other token y with p(y), whatever came before, so the emitted
  sequence has exactly the target's distribution. Siblings with the same token: the second try
  meets r(x) = 0 and is rejected, as it must be (x was already given its chance). Accepting x
  moves to ALL live branches whose next token is x (the suffixes as a trie): the next step's
  children are their next tokens, so a duplicate suffix head does not cut a longer suffix off.

The accepted path is reported on one branch (the lowest k among those that match it): its nodes
are what the KV relocation moves into the first slots behind the root.

Where each walk runs: the greedy walk reads only the target's argmax at each node, a few
integers per node, so it runs on the host in numpy after one small read-back (verify.py), where
on a GPU it would be some fifty kernel launches of a few elements each; the sampled walk reads
whole distributions and runs on the device, and only its four per-request results come back.
Both results are host arrays: the KV move, vLLM's sampled tokens and the pool feedback all read
them there. No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .host_copy import to_host
from .tree import TokenTree, TreeLayout


@dataclass
class AcceptResult:
    """Outcome of one verification per request (N = tree.N, -1 pads every int array).

    Fields (int64 numpy arrays, on the host):
      accepted_nodes:  [B, N], tree nodes on the accepted path, root's child first.
      num_accepted:    [B], accepted draft + suffix tokens.
      emitted:         [B, N + 1], the accepted tokens, then the correction / bonus token.
      num_emitted:     [B], num_accepted + 1.
      kv_keep_src:     [B, N], for accepted token j, the node whose KV must end up in the j-th
                       slot behind the root (node j's own slot). Equal to accepted_nodes; it is
                       the identity on the draft part, and for a suffix k whose first node is
                       not n, the suffix's nodes are relocated. src >= j always and src is
                       increasing in j, so an in-order or a gather-then-scatter copy is safe.
      draft_accepted:  [B], accepted draft tokens (l_d).
      suffix_index:    [B], the suffix on the accepted path, -1 if no suffix token accepted.
      suffix_accepted: [B], accepted suffix tokens.
    """

    accepted_nodes: np.ndarray
    num_accepted: np.ndarray
    emitted: np.ndarray
    num_emitted: np.ndarray
    kv_keep_src: np.ndarray
    draft_accepted: np.ndarray
    suffix_index: np.ndarray
    suffix_accepted: np.ndarray


def _assemble(lay: TreeLayout, tokens: np.ndarray, l_d: np.ndarray, branch: np.ndarray,
              hits: np.ndarray, last_token: np.ndarray) -> AcceptResult:
    """Result from the draft prefix l_d [B], then hits [B] tokens of suffix branch [B], and
    the emitted token after the last accepted node last_token [B] (tokens [B, N]: the tree's)."""
    B, N = tokens.shape
    rows = np.arange(B)
    t = np.arange(N)[None, :]
    l_d, branch, hits = (np.asarray(x, np.int64) for x in (l_d, branch, hits))
    num_acc = l_d + hits
    # K == 0 keeps one dummy suffix column in the layout; hits are 0 there.
    start = lay.sstart[rows, np.minimum(np.maximum(branch, 0), lay.sstart.shape[1] - 1)][:, None]
    nodes = np.where(t < l_d[:, None], t, np.where(t < num_acc[:, None], start + t - l_d[:, None], -1))
    emitted = np.full((B, N + 1), -1, np.int64)
    emitted[:, :N] = np.where(nodes >= 0, tokens[rows[:, None], np.maximum(nodes, 0)], -1)
    emitted[rows, num_acc] = last_token
    return AcceptResult(accepted_nodes=nodes, num_accepted=num_acc, emitted=emitted,
                        num_emitted=num_acc + 1, kv_keep_src=nodes.copy(), draft_accepted=l_d,
                        suffix_index=np.where(hits > 0, branch, -1), suffix_accepted=hits)


def _host(x) -> np.ndarray:
    return to_host(x)[0] if isinstance(x, torch.Tensor) else np.asarray(x)


def accept_greedy(tree: TokenTree, target_next: np.ndarray | torch.Tensor,
                  tokens: np.ndarray | None = None) -> AcceptResult:
    """Greedy verification, on the host.

    Shape: target_next [B, N + 1] int, the target's argmax after the root (column 0) and after
    each node i (column 1 + i); columns of padding nodes are ignored. tokens [B, N]: the tree's
    tokens on the host (read back from tree.tokens where None; a tensor target_next likewise).
    """
    lay = tree.layout
    B, N, K, L = tree.B, tree.N, tree.K, tree.L
    tn = _host(target_next).astype(np.int64, copy=False)
    tok = _host(tree.tokens) if tokens is None else tokens
    rows = np.arange(B)
    # Node i is right iff it is the target's prediction after its parent.
    match = (tok == tn[rows[:, None], lay.parents + 1]) & lay.valid
    n = lay.n
    l_d = np.cumprod(match & lay.is_draft, 1).sum(1)
    if K and L:
        j = np.arange(L)[None, None, :]
        idx = np.minimum(lay.sstart[:, :K, None] + j, N - 1)  # [B, K, L]
        sm = match[rows[:, None, None], idx] & (j < lay.slen[:, :, None])
        hits = np.cumprod(sm, 2).sum(2) * (l_d == n)[:, None]  # suffixes only after a full draft
        # Longest match, lowest k on ties (explicit: argmax's tie rule is not relied upon).
        best = (hits * K + (K - 1 - np.arange(K))[None, :]).argmax(1)
        best_hits = hits[rows, best]
        last_sfx = lay.sstart[rows, best] + best_hits - 1
        last = np.where(best_hits > 0, last_sfx, l_d - 1)  # last accepted node, -1 = root
    else:
        best = np.zeros(B, np.int64)
        best_hits = np.zeros(B, np.int64)
        last = l_d - 1
    return _assemble(lay, tok, l_d, best, best_hits, tn[rows, last + 1])


def walk_steps(tree: TokenTree) -> int:
    """Depth steps the sampled walk takes: one per depth level plus the bonus step."""
    return tree.D + tree.L + 1


def walk_uniforms_shape(tree: TokenTree) -> tuple[int, int, int]:
    """The uniforms a sampled walk reads: [B, walk_steps(tree), max(K, 1) + 1], per request and
    depth step one per child try and one for the final sample."""
    return tree.B, walk_steps(tree), max(tree.K, 1) + 1


def accept_sampled(tree: TokenTree, probs: torch.Tensor, generator: torch.Generator | None = None,
                   uniforms: torch.Tensor | None = None) -> AcceptResult:
    """Lossless random verification (temperature > 0) for a deterministic draft: sampled_walk
    on the device, its result and the tree's tokens read back in one copy, assembled on the host."""
    walk, tokens = to_host(sampled_walk(tree, probs, generator, uniforms), tree.tokens)
    return assemble_walk(tree, tokens, walk)


def assemble_walk(tree: TokenTree, tokens: np.ndarray, walk: np.ndarray) -> AcceptResult:
    """The AcceptResult of a sampled_walk read back to the host (walk [4, B]; tokens [B, N])."""
    return _assemble(tree.layout, tokens, *walk)


def sampled_walk(tree: TokenTree, probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                 generator: torch.Generator | None = None,
                 uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """The walk of accept_sampled, on probs' device, no host synchronisation.

    Returns [4, B] int64: draft tokens accepted, suffix branch, suffix tokens accepted, and the
    token emitted after the last accepted node (assemble_walk turns them into an AcceptResult).

    Shape:
      probs:    [B, N + 1, V] float, the target's (processed: temperature, top-k/p) next-token
                distribution after the root (row 0) and after node i (row 1 + i). Rows need not
                be normalised. Only rows along the walked path are read, one per request and
                depth step: so probs may instead be a function of col [B] int64 (0 = root,
                1 + i = node i) returning those rows [B, V] as a new tensor (the walk writes to
                it), which spares a caller materialising the distribution at every node.
      uniforms: [B, walk_steps(tree), max(K, 1) + 1] in [0, 1), float64 (float32 is widened):
                per depth step one number per child try and one for the final sample; drawn
                from `generator` if None (pass them to use per-request generators).
    """
    B, N, K = tree.B, tree.N, tree.K
    dev = tree.tokens.device
    rows = torch.arange(B, device=dev)
    if callable(probs):
        row_probs = probs
    else:
        table = probs
        row_probs = lambda col: table[rows, col]  # noqa: E731 (advanced indexing: a copy)
    C = max(K, 1)  # children per step: the draft child alone, or up to K suffix nodes
    S = walk_steps(tree)
    if uniforms is None:
        uniforms = torch.rand(walk_uniforms_shape(tree), generator=generator, device=dev, dtype=torch.float64)
    uniforms = uniforms.to(torch.float64)
    n = tree.draft_len
    if K:
        sstart, slen = tree.suffix_start, tree.suffix_len
    else:
        sstart = slen = torch.zeros(B, 1, dtype=torch.long, device=dev)
    first = torch.arange(C, device=dev)[None, :] == 0

    cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # node we stand on; -1 = root
    live = slen > 0  # suffixes still consistent with the accepted path [B, C]
    active = torch.ones(B, dtype=torch.bool, device=dev)
    num_acc = torch.zeros(B, dtype=torch.long, device=dev)
    last_tok = torch.zeros(B, dtype=torch.long, device=dev)
    for t in range(S):
        # The residual [B, V], written below: float32 terms (half precision's sums drift),
        # summed in float64. Its CDF must resolve probabilities below float32's 2^-24 steps (a
        # float32 cumsum over 152k tokens drew a token of 2.2e-8 at 6e-8, and never 26k others
        # holding 4.3e-4), and so must the uniforms.
        r = row_probs(cur + 1)
        if r.dtype in (torch.float16, torch.bfloat16):
            r = r.float()
        V = r.shape[1]
        # Children of the current node, at depth t + 1.
        in_draft = t < n
        j = (t - n)[:, None]
        s_ok = live & (j >= 0) & (j < slen)
        s_node = (sstart + j).clamp(0, max(N - 1, 0))
        cand_ok = torch.where(in_draft[:, None], first & (n > t)[:, None], s_ok)
        cand_node = torch.where(in_draft[:, None], torch.full_like(s_node, t), s_node)
        cand_tok = tree.tokens.gather(1, cand_node.clamp(max=max(N - 1, 0))) if N else cand_node
        # A token id outside the vocabulary (vLLM's -1 placeholder drafts) can never be accepted.
        cand_ok = cand_ok & (cand_tok >= 0) & (cand_tok < V)
        cand_tok = cand_tok.clamp(0, V - 1)  # read only where cand_ok

        acc = torch.zeros(B, dtype=torch.bool, device=dev)
        acc_tok = torch.zeros(B, dtype=torch.long, device=dev)
        acc_node = torch.zeros(B, dtype=torch.long, device=dev)
        for c in range(C):
            try_ = active & cand_ok[:, c] & ~acc
            x = cand_tok[:, c:c + 1]
            rx, mass = r.gather(1, x)[:, 0].double(), r.sum(1, dtype=torch.float64)
            # u < r(x) / sum(r) without a division; a child holding all the remaining mass is
            # accepted even if u * mass rounds up to mass.
            ok = try_ & (rx > 0) & ((uniforms[:, t, c] * mass < rx) | (rx >= mass))
            acc |= ok
            acc_tok = torch.where(ok, x[:, 0], acc_tok)
            acc_node = torch.where(ok, cand_node[:, c], acc_node)
            r.scatter_(1, x, torch.where(try_ & ~ok, 0.0, rx).to(r.dtype)[:, None])
        # Rows whose children were all rejected (or that stand on a leaf) stop here with a
        # token sampled from the residual by inverse CDF: the first token whose CDF exceeds
        # u * mass has r > 0, so a rejected child never comes out; the clamp to the last
        # positive token covers u * mass rounding up to the mass.
        cdf = r.cumsum(1, dtype=torch.float64)
        y = torch.searchsorted(cdf, (uniforms[:, t, C] * cdf[:, -1])[:, None], right=True)[:, 0]
        last_pos = V - 1 - (r > 0).flip(1).int().argmax(1)
        stop = active & ~acc
        last_tok = torch.where(stop, torch.minimum(y, last_pos), last_tok)
        num_acc += acc.long()
        # In the suffix part the walk continues on every live branch carrying the accepted
        # token; cur is the first of them (same tokens, same context, same distribution).
        # cand_ok, not s_ok: a branch whose token lies outside the vocabulary (clamped to
        # the accepted id above) is not the accepted path.
        live = torch.where((acc & ~in_draft)[:, None], cand_ok & (cand_tok == acc_tok[:, None]), live)
        cur = torch.where(acc, acc_node, cur)
        active = acc

    l_d = torch.minimum(num_acc, n)
    hits = num_acc - l_d
    # cur is on the lowest live branch, the one the path is reported (and KV moved) along.
    branch = tree.branch_of.gather(1, cur.clamp(min=0)[:, None])[:, 0] if N else cur
    branch = torch.where(hits > 0, branch, 0)
    return torch.stack([l_d, branch, hits, last_tok])
