"""Target-side verification of one step's token trees, batched (README, "How a step runs").

Input is what the target computed in its one forward: logits at every query row of every request
(the root, then each tree node in node order). Greedy requests take the greedy walk, seeded ones
walk the choices vLLM's sampler makes with their own generators (seeded_sampling.py), the others
the lossless multi-candidate rejection sampling walk (accept.py); the result is the token rows
vLLM expects from its sampler (accepted tokens, then the correction or bonus; -1 pads) plus the
accepted path, which the KV relocation and the pool feedback read.

One read-back per step: the target's argmax at every node and the tree's tokens (and, for a
batch with sampled requests, the sampled walk's four numbers per request) come to the host in
one copy, where the greedy walk runs (accept.py says why) and where vLLM reads the step's tokens
right after anyway. No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .accept import AcceptResult, accept_greedy, assemble_walk, sampled_walk, walk_uniforms_shape
from .host_copy import to_device, to_host
from .seeded_sampling import SeededDraws
from .tree import TokenTree


@dataclass
class Verified:
    """Outcome of one step, on the host.

    Fields:
      result:      AcceptResult per request (accept.py).
      target_next: [B, N + 1] int64, the target's argmax after the root and after each node
                   (the pool feedback reads it, also for sampled requests).
      tokens:      [B, N] int64, the tree's tokens.
      token_ids:   [B, N + 1] int32, emitted tokens, -1 padded (vLLM's sampled_token_ids).
    """

    result: AcceptResult
    target_next: np.ndarray
    tokens: np.ndarray
    token_ids: np.ndarray


def node_rows(tree: TokenTree, row_start: np.ndarray) -> np.ndarray:
    """Logit row of the root and of each node per request, on the host.

    Shape: row_start [B] (first logit row of each request) -> [B, N + 1] int64; padding nodes
    repeat the request's last row, so every index is in range.
    """
    col = np.arange(tree.N + 1)[None, :]
    return np.asarray(row_start, np.int64)[:, None] + np.minimum(col, tree.layout.num_nodes[:, None])


def verify(tree: TokenTree, logits: torch.Tensor, row_start: np.ndarray,
           greedy: torch.Tensor | None = None,
           process: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
           uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None,
           max_table_rows: int = 0, walk: str = "torch", seeded: SeededDraws | None = None) -> Verified:
    """Accept per request.

    Shape: logits [R, V] (raw target logits, one row per query row of the batch), row_start [B]
    host array, greedy [B] bool on the device (None: all greedy; either way no host sync but
    the one read-back), uniforms [B, walk_steps(tree), max(K,1)+1] or None.

    process (needed unless all greedy): what sampling does to logits before the softmax
    (temperature, min_p, top-k / top-p): process(x, req) takes x [n, V] float32 raw logit rows,
    a new tensor it may overwrite, and req [n] int64, the request of each row (None: row b is
    request b's), and returns the processed rows [n, V].

    The walk reads one row per request and depth step, along the path it takes. Where the
    batch's B * (N + 1) node rows are at most max_table_rows, they are processed at once, in a
    few launches (the walk's table form); beyond, row by row as the walk reaches them, so that a
    sampled step holds a few [B, V] float32 rows at a time, not the distribution at every node
    (several [R, V] copies: 0.6 GB each for 1,000 rows of a 152k vocabulary). The caller passes
    the rows its memory was sized for: vLLM's profiling run sizes sampling for one row per
    request (two for its rejection sampler), not one per tree node.

    walk: "torch" (accept.sampled_walk) or "triton" (kernels/sampled_walk.py, the caller having
    checked it, check_kernel: the table form in chunks of at most max_table_rows rows, each
    walked in one launch instead of some 140 per depth step; where Triton cannot run, torch).

    seeded: the batch's seeded requests (seeded_sampling.py), walked along the choices vLLM's
    sampler makes with their generators' draws, which are then moved on by the emitted tokens;
    the other sampled requests take the rejection walk with the global generator.
    """
    if walk not in ("torch", "triton"):
        raise ValueError(f"walk must be 'torch' or 'triton', got {walk!r}")
    rows_host = node_rows(tree, row_start)
    (rows,) = to_device(logits.device, rows_host)
    target_next = logits.argmax(dim=-1)[rows]
    if greedy is None:  # the caller knows (host flag) when a batch is all greedy
        tn, tokens = to_host(target_next, tree.tokens)
        res = accept_greedy(tree, tn, tokens)
    else:
        if process is None:
            raise ValueError("sampled requests need the processing of their logits (process)")
        # A seeded request walks its choices as a greedy one walks the argmax; the pool still
        # learns the argmax (target_next), as from the other sampled requests.
        walk_next, walk_greedy, skip = target_next, greedy, None
        chosen = None if seeded is None else seeded.choices(tree, logits, rows_host, target_next)
        if chosen is not None:
            walk_next, skip = chosen
            (chosen_t,) = to_device(logits.device, skip)
            walk_greedy = greedy | chosen_t
        out = None
        if walk == "triton":
            if uniforms is None:  # as sampled_walk draws them
                uniforms = torch.rand(walk_uniforms_shape(tree), generator=generator, device=logits.device,
                                      dtype=torch.float64)
            out = _kernel_walk(tree, logits, rows, walk_next, walk_greedy, process, uniforms, max_table_rows,
                               skip)
        if out is None:
            out = sampled_walk(tree, _torch_walk_rows(logits, rows, walk_next, walk_greedy, process,
                                                      max_table_rows, skip), generator, uniforms)
        path, tn, tokens = to_host(out, target_next, tree.tokens)
        res = assemble_walk(tree, tokens, path)
        if chosen is not None:
            seeded.advance(res.num_emitted)
    return Verified(result=res, target_next=tn, tokens=tokens, token_ids=res.emitted.astype(np.int32))


def _kept_rows(keep: np.ndarray | None, device) -> torch.Tensor | None:
    """The device index [k] int64 of the rows to process, from keep [n] (host bool per row;
    False: a seeded request's, which walks its own choices); None where every row is kept.
    Made once per step (per chunk) and reused by every depth step's rows."""
    if keep is None or keep.all():
        return None
    (idx,) = to_device(device, np.nonzero(keep)[0])
    return idx


def _process_some(process, x: torch.Tensor, req: torch.Tensor | None, kept: torch.Tensor | None) -> torch.Tensor:
    """process(x, req), or, where kept (_kept_rows) is given, on those rows alone: the others
    stay raw, as the walk reads them one-hot; their top-k / top-p sort is not paid twice."""
    if kept is None:
        return process(x, req)
    if kept.numel():
        x[kept] = process(x[kept], kept if req is None else req[kept])
    return x


def _torch_walk_rows(logits, rows, target_next, greedy, process, max_table_rows: int,
                     skip: np.ndarray | None = None):
    """What accept.sampled_walk walks: the table [B, N + 1, V] of every node's processed
    distribution where the rows fit in max_table_rows, else a function giving the rows it reads.
    Greedy rows are the one-hot of the raw argmax, with which the sampled walk accepts exactly
    what the greedy walk would (tests/test_accept.py): one walk for the batch. skip [B] (host
    bool): requests whose rows are not processed (they are greedy in `greedy`)."""
    sampled = (~greedy).float()
    B, N1 = rows.shape
    keep = None if skip is None else ~np.asarray(skip, bool)
    if rows.numel() <= max_table_rows:
        req = torch.arange(B, device=logits.device).repeat_interleave(N1)
        kept = _kept_rows(None if keep is None else keep.repeat(N1), logits.device)
        x = _process_some(process, logits[rows.reshape(-1)].float(), req, kept)
        probs = torch.softmax(x, dim=-1).view(B, N1, -1)
        probs.mul_(sampled[:, None, None])
        return probs.scatter_add_(2, target_next[:, :, None], greedy[:, None, None].expand(B, N1, 1).float())
    req = torch.arange(B, device=logits.device)
    kept = _kept_rows(keep, logits.device)

    def row_probs(col: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(_process_some(process, logits[rows[req, col]].float(), None, kept), dim=-1)
        p.mul_(sampled[:, None])
        return p.scatter_add_(1, target_next[req, col][:, None], greedy[:, None].float())

    return row_probs


def _kernel_walk(tree: TokenTree, logits, rows, target_next, greedy, process, uniforms,
                 max_table_rows: int, skip: np.ndarray | None = None) -> torch.Tensor | None:
    """The walk by kernels/sampled_walk.py, [4, B], or None where Triton cannot run. Requests
    go in chunks of at most max_table_rows node rows (one request at least), each chunk's rows
    processed at once and walked in one launch: the memory of the table form, and some 12
    launches a chunk instead of the torch walk's ~140 a depth step. skip: as _torch_walk_rows."""
    from .kernels.sampled_walk import sampled_walk_triton  # imports Triton

    B, N1 = rows.shape
    per_chunk = max(1, max_table_rows // max(N1, 1))
    outs = []
    for b0 in range(0, B, per_chunk):
        b1 = min(B, b0 + per_chunk)
        req = torch.arange(b0, b1, device=logits.device).repeat_interleave(N1)
        keep = None if skip is None else ~np.asarray(skip[b0:b1], bool).repeat(N1)
        x = _process_some(process, logits[rows[b0:b1].reshape(-1)].float(), req,
                          _kept_rows(keep, logits.device)).contiguous()
        out = sampled_walk_triton(x, target_next[b0:b1], greedy[b0:b1], tree.tokens[b0:b1],
                                  tree.branch_of[b0:b1], tree.draft_len[b0:b1], tree.suffix_start[b0:b1],
                                  tree.suffix_len[b0:b1], uniforms[b0:b1])
        if out is None:
            return None
        outs.append(out)
    if not outs:  # no request
        return torch.zeros(4, 0, dtype=torch.int64, device=logits.device)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
