"""Model-runner area: repetition, frequency and presence penalties on every row of a token tree.

Without speculation vLLM's Sampler penalizes a request's one logit row by the tokens of its
prompt and of its output so far (`apply_penalties`). In a verified tree, the row after node i
predicts the token that follows the node's path, so the plain sampler would have penalized it
by the output so far plus the path's tokens (the root's row: the output alone). Each row is
penalized so, by vLLM's own `apply_penalties` (the same arithmetic, row by row, so a row comes
out as without speculation whatever rows share its call), after the logit bias and before the
greedy argmax, the temperature and min_p, as vLLM's Sampler orders them. The walk then verifies
batches with penalties (tree_verify.unsupported_sampling), where they went to vLLM's rejection
sampler, the tree read as its chain, and a seeded request among them lost its text
(seeded_sampling.py).

Only the requests that set a penalty have their rows penalized, in chunks of at most
`max_rows` rows: the counts are [rows, vocab] tensors (about 1.2 MB a row for a 152k
vocabulary), and what vLLM's profiling sized its sampler for is one row per request.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ouroboros.host_copy import to_device
from vllm_ouroboros.patches._util import require
from vllm_ouroboros.step_plan import ragged_arange
from vllm_ouroboros.tree import TreeLayout


def penalized_requests(input_batch, B: int) -> np.ndarray:
    """Indices of the batch's first B requests that set a penalty (host, from the input batch's
    host copies of the penalties: no device read)."""
    for name in ("frequency_penalties_cpu", "presence_penalties_cpu", "repetition_penalties_cpu"):
        require(input_batch, name)
    freq = input_batch.frequency_penalties_cpu[:B]
    pres = input_batch.presence_penalties_cpu[:B]
    rep = input_batch.repetition_penalties_cpu[:B]
    return np.nonzero((freq != 0) | (pres != 0) | (rep != 1))[0]


def path_nodes(lay: TreeLayout) -> np.ndarray:
    """The nodes on each node's path from the root, in order: [B, N, D + L] int64, node i's
    first depth[i] entries (its ancestors, then i), -1 after them and for padding nodes: the
    start of its suffix's path (TreeLayout.paths; a draft node's, any path's: all begin with
    the draft)."""
    B, N = lay.valid.shape
    W = lay.D + lay.L
    paths = lay.paths if lay.K else np.broadcast_to(np.arange(W, dtype=np.int64), (B, 1, W))  # draft only
    depth = np.where(lay.valid, lay.depth, 0)
    mine = paths[np.arange(B)[:, None], lay.k]  # [B, N, W]
    return np.where(np.arange(W)[None, None, :] < depth[:, :, None], mine, -1)


def penalize_tree_rows(logits: torch.Tensor, sm, requests: np.ndarray, tree_tokens: torch.Tensor,
                       lay: TreeLayout, row_start: np.ndarray, max_rows: int) -> None:
    """Penalize the logit rows of `requests` as vLLM's Sampler would each on its own, in place.

    logits: [R, V] float32, the step's rows (bias added); sm: vLLM's SamplingMetadata (its
    penalties, prompt_token_ids [B, P] padded with V, output_token_ids per request);
    requests: host indices of the requests to penalize (penalized_requests); tree_tokens [B, N]
    (device) and lay: the step's tree; row_start [B] host: each request's root row, node i's row
    is row_start + 1 + i. max_rows bounds the rows per call (>= 1).
    """
    from vllm.model_executor.layers.utils import apply_penalties

    if len(requests) == 0:
        return
    V = logits.shape[1]
    reqs = np.asarray(requests, np.int64)
    count = lay.num_nodes[reqs] + 1  # the root's row, then each node's
    req = np.repeat(reqs, count)
    j = ragged_arange(count)
    rows = np.asarray(row_start, np.int64)[req] + j
    if lay.valid.shape[1]:
        path = path_nodes(lay)[req, np.maximum(j - 1, 0)]
        path[j == 0] = -1
    else:  # no node in any tree: roots only
        path = np.full((len(req), 0), -1, np.int64)
    # The output so far as vLLM pads it for its sampler (V: no token), one row per request.
    outputs = [sm.output_token_ids[r] for r in reqs.tolist()]
    done = np.full((len(reqs), max((len(o) for o in outputs), default=0)), V, np.int64)
    for k, o in enumerate(outputs):  # the requests' own lists, as vLLM's sampler reads them
        done[k, :len(o)] = o
    which = np.repeat(np.arange(len(reqs)), count)
    req_t, path_t, which_t, done_t = to_device(logits.device, req, path, which, done)
    path_tok = (torch.where(path_t >= 0, tree_tokens[req_t[:, None], path_t.clamp(min=0)], V)
                if path.shape[1] else path_t)
    for lo, hi in _chunks(rows, max(1, max_rows)):
        sl = slice(lo, hi)
        r = req_t[sl]
        out = torch.cat([done_t[which_t[sl]], path_tok[sl]], dim=1)
        # A chunk's rows are consecutive (_chunks): penalized in place, on a slice (apply_penalties
        # writes its argument); a gather and scatter of [rows, vocab] cost as much again on a CPU.
        apply_penalties(  # by name: model_runner.apply checks the names
            logits=logits[int(rows[lo]):int(rows[lo]) + hi - lo], prompt_tokens_tensor=sm.prompt_token_ids[r],
            output_tokens_tensor=out, presence_penalties=sm.presence_penalties[r],
            frequency_penalties=sm.frequency_penalties[r], repetition_penalties=sm.repetition_penalties[r])


def _chunks(rows: np.ndarray, max_rows: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of `rows` (ascending logit rows) of at most max_rows entries each, cut
    where the rows stop being consecutive: each is one slice of the logits."""
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    out = []
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(rows)]])):
        out.extend((a, min(a + max_rows, int(hi))) for a in range(int(lo), int(hi), max_rows))
    return out
