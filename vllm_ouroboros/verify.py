"""Target-side verification of one step's token trees (algorithm.md step 4), batched.

Input is what the target computed in its one forward: logits at every query row of every request
(the root, then each tree node in node order). Greedy requests take the greedy walk, the others
the lossless multi-candidate rejection sampling walk (accept.py); the result is the token rows
vLLM expects from its sampler (accepted tokens, then the correction or bonus; -1 pads) plus the
accepted path, which the KV relocation and the pool feedback read. No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .accept import AcceptResult, accept_greedy, accept_sampled, select, walk_steps
from .tree import TokenTree


@dataclass
class Verified:
    """Outcome of one step.

    Fields:
      result:      AcceptResult per request (accept.py).
      target_next: [B, N + 1] int64, the target's argmax after the root and after each node
                   (the pool feedback reads it, also for sampled requests).
      token_ids:   [B, N + 1] int32, emitted tokens, -1 padded (vLLM's sampled_token_ids).
    """

    result: AcceptResult
    target_next: torch.Tensor
    token_ids: torch.Tensor


def node_rows(tree: TokenTree, row_start: torch.Tensor) -> torch.Tensor:
    """Logit row of the root and of each node per request.

    Shape: row_start [B] (first logit row of each request) -> [B, N + 1] int64; padding nodes
    repeat the request's last row, so every index is in range.
    """
    col = torch.arange(tree.N + 1, device=tree.tokens.device)[None, :]
    return row_start.long()[:, None] + torch.minimum(col, tree.num_nodes[:, None])


def verify(tree: TokenTree, logits: torch.Tensor, row_start: torch.Tensor,
           greedy: torch.Tensor | None = None, processed: torch.Tensor | None = None,
           uniforms: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> Verified:
    """Accept per request.

    Shape: logits [R, V] (raw target logits, one row per query row of the batch), row_start [B],
    greedy [B] bool (None: all greedy; no host sync either way), processed [R, V] float (the same rows after temperature /
    top-k / top-p; needed unless all greedy), uniforms [B, walk_steps(tree), max(K,1)+1] or None.
    """
    rows = node_rows(tree, row_start)
    target_next = logits.argmax(dim=-1)[rows]
    res = accept_greedy(tree, target_next)
    if greedy is not None:  # the caller knows (host flag) when a batch is all greedy
        if processed is None:
            raise ValueError("sampled requests need the processed logits")
        probs = torch.softmax(processed[rows].float(), dim=-1)
        sampled = accept_sampled(tree, probs, generator=generator, uniforms=uniforms)
        res = select(greedy, res, sampled)
    return Verified(result=res, target_next=target_next, token_ids=res.emitted.to(torch.int32))


def draw_uniforms(tree: TokenTree, generators: dict[int, torch.Generator],
                  device: torch.device) -> torch.Tensor:
    """Uniforms for accept_sampled: from each seeded request's own generator, else the global one.

    Shape: -> [B, walk_steps(tree), max(K, 1) + 1].
    """
    shape = (walk_steps(tree), max(tree.K, 1) + 1)
    u = torch.rand(tree.B, *shape, device=device)
    for i, gen in generators.items():  # seeded requests only, as vLLM's own samplers do
        if i < tree.B:
            u[i] = torch.rand(*shape, device=device, generator=gen)
    return u
