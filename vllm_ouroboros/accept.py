"""Acceptance walk over the verified token tree (algorithm.md step 4).

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
are what the KV relocation moves into the first slots behind the root. No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .tree import TokenTree


@dataclass
class AcceptResult:
    """Outcome of one verification per request (N = tree.N, -1 pads every int tensor).

    Fields (int64):
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

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    emitted: torch.Tensor
    num_emitted: torch.Tensor
    kv_keep_src: torch.Tensor
    draft_accepted: torch.Tensor
    suffix_index: torch.Tensor
    suffix_accepted: torch.Tensor


def select(mask: torch.Tensor, a: AcceptResult, b: AcceptResult) -> AcceptResult:
    """Per row: a where mask [B] is true, else b (e.g. greedy rows vs sampled rows)."""
    def pick(x, y):
        return torch.where(mask.view(-1, *([1] * (x.dim() - 1))), x, y)
    return AcceptResult(**{f.name: pick(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)})


def _assemble(tree: TokenTree, l_d: torch.Tensor, branch: torch.Tensor, hits: torch.Tensor,
              last_token: torch.Tensor) -> AcceptResult:
    """Result from the draft prefix l_d [B], then hits [B] tokens of suffix branch [B], and
    the emitted token after the last accepted node last_token [B]."""
    B, N, K = tree.B, tree.N, tree.K
    dev = tree.tokens.device
    t = torch.arange(N, device=dev)[None, :]
    num_acc = l_d + hits
    if K:
        start = tree.suffix_start.gather(1, branch.clamp(0, K - 1)[:, None])  # [B, 1]
    else:
        start = torch.zeros(B, 1, dtype=torch.long, device=dev)
    nodes = torch.where(t < l_d[:, None], t,
                        torch.where(t < num_acc[:, None], start + t - l_d[:, None], -1))
    tok = tree.tokens.gather(1, nodes.clamp(min=0))
    emitted = torch.full((B, N + 1), -1, dtype=torch.long, device=dev)
    emitted[:, :N] = torch.where(nodes >= 0, tok, -1)
    emitted.scatter_(1, num_acc[:, None], last_token.long()[:, None])
    return AcceptResult(accepted_nodes=nodes, num_accepted=num_acc, emitted=emitted,
                        num_emitted=num_acc + 1, kv_keep_src=nodes.clone(), draft_accepted=l_d,
                        suffix_index=torch.where(hits > 0, branch, -1), suffix_accepted=hits)


def accept_greedy(tree: TokenTree, target_next: torch.Tensor) -> AcceptResult:
    """Greedy verification.

    Shape: target_next [B, N + 1] int64, the target's argmax after the root (column 0) and
    after each node i (column 1 + i); columns of padding nodes are ignored.
    """
    B, N, K, L = tree.B, tree.N, tree.K, tree.L
    dev = tree.tokens.device
    target_next = target_next.long()
    # Node i is right iff it is the target's prediction after its parent.
    match = (tree.tokens == target_next.gather(1, tree.parents + 1)) & tree.valid
    n = tree.draft_len
    col = torch.arange(N, device=dev)[None, :]
    l_d = (match & (col < n[:, None])).long().cumprod(1).sum(1)
    if K and L:
        j = torch.arange(L, device=dev)[None, None, :]
        idx = (tree.suffix_start[:, :, None] + j).clamp(max=N - 1)  # [B, K, L]
        sm = match.gather(1, idx.view(B, -1)).view(B, K, L) & (j < tree.suffix_len[:, :, None])
        hits = sm.long().cumprod(2).sum(2) * (l_d == n)[:, None]  # suffixes only after a full draft
        # Longest match, lowest k on ties (explicit: argmax's tie rule is not relied upon).
        k = torch.arange(K, device=dev)[None, :]
        best = (hits * K + (K - 1 - k)).argmax(1)
        best_hits = hits.gather(1, best[:, None])[:, 0]
        last_sfx = tree.suffix_start.gather(1, best[:, None])[:, 0] + best_hits - 1
        last = torch.where(best_hits > 0, last_sfx, l_d - 1)  # last accepted node, -1 = root
    else:
        best = torch.zeros(B, dtype=torch.long, device=dev)
        best_hits = torch.zeros_like(best)
        last = l_d - 1
    return _assemble(tree, l_d, best, best_hits, target_next.gather(1, (last + 1)[:, None])[:, 0])


def walk_steps(tree: TokenTree) -> int:
    """Depth steps the sampled walk takes: one per depth level plus the bonus step."""
    return tree.D + tree.L + 1


def accept_sampled(tree: TokenTree, probs: torch.Tensor, generator: torch.Generator | None = None,
                   uniforms: torch.Tensor | None = None) -> AcceptResult:
    """Lossless random verification (temperature > 0) for a deterministic draft.

    Shape:
      probs:    [B, N + 1, V] float, the target's (processed: temperature, top-k/p) next-token
                distribution after the root (row 0) and after node i (row 1 + i). Rows need not
                be normalised. Only rows along the walked path are read.
      uniforms: [B, walk_steps(tree), max(K, 1) + 1] in [0, 1): per depth step one number per
                child try and one for the final sample; drawn from `generator` if None (pass
                them to use per-request generators).
    """
    B, N, K = tree.B, tree.N, tree.K
    V = probs.shape[-1]
    dev = probs.device
    C = max(K, 1)  # children per step: the draft child alone, or up to K suffix nodes
    S = walk_steps(tree)
    if uniforms is None:
        uniforms = torch.rand(B, S, C + 1, generator=generator, device=dev)
    n = tree.draft_len
    rows = torch.arange(B, device=dev)
    if K:
        sstart, slen = tree.suffix_start, tree.suffix_len
    else:
        sstart = slen = torch.zeros(B, 1, dtype=torch.long, device=dev)
    rdtype = torch.promote_types(probs.dtype, torch.float32)  # half-precision sums drift
    first = torch.arange(C, device=dev)[None, :] == 0

    cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # node we stand on; -1 = root
    live = slen > 0  # suffixes still consistent with the accepted path [B, C]
    active = torch.ones(B, dtype=torch.bool, device=dev)
    num_acc = torch.zeros(B, dtype=torch.long, device=dev)
    last_tok = torch.zeros(B, dtype=torch.long, device=dev)
    for t in range(S):
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
        cand_tok = cand_tok.clamp(0, V - 1)

        r = probs[rows, cur + 1].to(rdtype)  # residual [B, V], a copy
        acc = torch.zeros(B, dtype=torch.bool, device=dev)
        acc_tok = torch.zeros(B, dtype=torch.long, device=dev)
        acc_node = torch.zeros(B, dtype=torch.long, device=dev)
        for c in range(C):
            try_ = active & cand_ok[:, c] & ~acc
            x = cand_tok[:, c:c + 1]
            rx, mass = r.gather(1, x)[:, 0], r.sum(1)
            # u < r(x) / sum(r) without a division; a child holding all the remaining mass is
            # accepted even if u * mass rounds up to mass.
            ok = try_ & (rx > 0) & ((uniforms[:, t, c] * mass < rx) | (rx >= mass))
            acc |= ok
            acc_tok = torch.where(ok, x[:, 0], acc_tok)
            acc_node = torch.where(ok, cand_node[:, c], acc_node)
            r.scatter_(1, x, torch.where(try_ & ~ok, 0.0, rx)[:, None])
        # Rows whose children were all rejected (or that stand on a leaf) stop here with a
        # token sampled from the residual by inverse CDF: the first token whose CDF exceeds
        # u * mass has r > 0, so a rejected child never comes out; the clamp to the last
        # positive token covers u * mass rounding up to the mass.
        cdf = r.cumsum(1)
        y = torch.searchsorted(cdf, (uniforms[:, t, C] * cdf[:, -1])[:, None], right=True)[:, 0]
        last_pos = V - 1 - (r > 0).flip(1).int().argmax(1)
        stop = active & ~acc
        last_tok = torch.where(stop, torch.minimum(y, last_pos), last_tok)
        num_acc += acc.long()
        # In the suffix part the walk continues on every live branch carrying the accepted
        # token; cur is the first of them (same tokens, same context, same distribution).
        live = torch.where((acc & ~in_draft)[:, None], s_ok & (cand_tok == acc_tok[:, None]), live)
        cur = torch.where(acc, acc_node, cur)
        active = acc

    l_d = torch.minimum(num_acc, n)
    hits = num_acc - l_d
    # cur is on the lowest live branch, the one the path is reported (and KV moved) along.
    branch = tree.branch_of.gather(1, cur.clamp(min=0)[:, None])[:, 0] if N else cur
    branch = torch.where(hits > 0, branch, 0)
    return _assemble(tree, l_d, branch, hits, last_tok)
