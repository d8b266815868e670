"""The draft's prefill in fixed-width chunks replayed from CUDA graphs (the graph round's runtime).

A new request's prompt, or the stretch a request decoded while it was backed off, must be in the
draft's KV cache before the request drafts. `DraftRuntime._prefill` runs that as eager causal
forwards of up to `prefill_chunk` tokens per row; on a GPU an eager forward of the 0.5B draft
costs its ~200-400 kernel launches, 19-26 ms on an H200 whatever its width up to 128 tokens,
against 1.2-1.9 ms replayed from a graph (results/gpu_h200_2026-11-27, `t(n)` table). So with
graphs the prefill runs here instead: every forward is CHUNK tokens wide for a bucket of rows
(`BATCH_BUCKETS`, at most MAX_ROWS), its inputs copied into static tensors, one capture per row
bucket, replayed chunk after chunk. A chunk of 64 tokens is what the tree-attention kernel takes
in one program row (`draft/attention.MAX_KERNEL_QUERIES`), so the prefill's attention is the
kernel's, as the round's is.

Padding: a row's tokens past its stretch, and the rows past the batch in its bucket, attend only
themselves and write K/V where nothing reads it before it is written again (past the row's
committed length, or the spare slot's null page); the host records only the real tokens as
cached. The same arithmetic as the eager prefill with prefill_chunk = CHUNK, through a forward of
fixed width.

A capture that fails (on a device where a CUDA graph of the draft's forward cannot be made)
turns this off for the runtime, logged: the prefill then runs eagerly, as before. No vLLM
imports.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.cuda_graph import capture_graph
from vllm_ouroboros.draft.device_round import BATCH_BUCKETS, GraphBounds, RecordedGraph, bucket
from vllm_ouroboros.host_copy import copy_into

logger = logging.getLogger(LOGGER_NAME)

# Tokens per row of a prefill chunk: the tree-attention kernel's query limit per row.
CHUNK = 64
# Rows per chunk forward at most (a pass with more rows runs several forwards per chunk).
MAX_ROWS = 16
# Inbox columns before the chunk's tokens: slot, committed length, real tokens.
INBOX = 3


def prefill_mask(count: torch.Tensor, Q: int, col: torch.Tensor | None = None) -> torch.Tensor:
    """The mask of a prefill forward of Q tokens per row whose first count[r] are real: a
    token sees the real tokens up to itself, a padding token also itself (so that its softmax
    is defined; its output is never read). Shape: count [R] int64 -> [R, Q, Q] bool. The eager and the graph prefill's.
    col: arange(Q) on count's device where the caller keeps one: a captured chunk then builds
    its mask from comparisons alone, with nothing allocated or filled at each replay."""
    col = torch.arange(Q, device=count.device) if col is None else col
    i, j = col[:, None], col[None, :]
    real = col[None, :] < count[:, None]
    return ((i >= j)[None] & real[:, None, :]) | ((i == j)[None] & ~real[:, :, None])


class PrefillGraphs:
    """Prefill forwards of CHUNK tokens per row replayed from CUDA graphs (module docstring).

    runtime: the DraftRuntime whose cache is filled. emulate_graphs: `RecordedGraph` stand-ins
    that record at capture and run at replay, so the capture/replay bookkeeping is tested on a
    CPU (the forward then runs eagerly on the static tensors, as a replay would)."""

    def __init__(self, runtime, emulate_graphs: bool = False, chunk: int = CHUNK):
        if runtime.device.type != "cuda" and not emulate_graphs:
            raise ValueError(f"CUDA graphs need a CUDA device; the draft runs on {runtime.device.type}")
        self.rt = runtime
        self.emulate = emulate_graphs
        self.chunk = chunk
        self.enabled = True  # False after a failed capture: the runtime prefills eagerly
        self._graphs: dict[int, object] = {}
        self.captures = 0  # captures tried, at load and on use (a prefill timed across one is no sample)
        self._inbox: dict[int, torch.Tensor] = {}
        # The cache generation of the graphs, the cache tokens a captured forward may read per
        # row (the attention's bound, fixed at capture; the round's first bound, doubled where
        # a stretch lies further out) and the captures' memory pool: kept as the round keeps its own.
        self.bounds = GraphBounds(runtime)
        self._col = torch.arange(chunk, device=runtime.device)

    def rows_per_forward(self, n: int) -> list[int]:
        """How a pass of n rows is split into forwards: MAX_ROWS each, then the rest."""
        return [MAX_ROWS] * (n // MAX_ROWS) + ([n % MAX_ROWS] if n % MAX_ROWS else [])

    def padded_rows(self, n: int) -> int:
        """Rows a forward of n rows (<= MAX_ROWS) runs: its batch bucket."""
        return bucket(n, BATCH_BUCKETS)

    def _check_generation(self, need: int) -> None:
        """Drop every graph where the cache or window moved or a chunk reads `need` cache
        tokens per row, past graph_len (GraphBounds.stale)."""
        if self.bounds.stale(need):
            self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget every captured chunk forward (captured again on use)."""
        self._graphs.clear()
        self._inbox.clear()
        self.bounds.forget_pool()

    def forward(self, slots: np.ndarray, tokens: np.ndarray, count: np.ndarray) -> None:
        """One chunk for R <= MAX_ROWS rows: tokens [R, Q <= chunk] int64, the next uncached
        tokens of slots[r] (the first count[r] real), written at the slots' committed lengths
        (rt.kv_len, which the caller then advances). Queued on the device, no host wait.
        Raises where the graph cannot be captured (`enabled` is then False: the caller
        prefills this chunk eagerly)."""
        rt, C = self.rt, self.chunk
        R = len(slots)
        if not 0 < R <= MAX_ROWS or int(count.max()) > C or tokens.shape[1] > C:
            raise ValueError(f"a prefill chunk takes 1..{MAX_ROWS} rows of at most {C} tokens, "
                             f"got {R} rows of up to {max(int(count.max(initial=0)), tokens.shape[1])}")
        kv = rt.kv_len[slots]
        self._check_generation(int(kv.max()) + C)
        A = self.padded_rows(R)
        graph = self._graphs.get(A)
        if graph is None:
            graph = self._capture(A)
        box = np.zeros((A, INBOX + C), np.int64)
        box[:, 0] = rt.pad_slot
        box[:R, 0], box[:R, 1], box[:R, 2] = slots, kv, count
        box[:R, INBOX:INBOX + tokens.shape[1]] = tokens
        copy_into(self._inbox[A], box)  # in stream order: the previous chunk's replay has read its inbox
        graph.replay()

    def _run(self, A: int) -> None:
        """The chunk forward on bucket A's inbox (what a graph captures)."""
        rt, C = self.rt, self.chunk
        box = self._inbox[A]
        slots, kv, cnt, ids = box[:, 0], box[:, 1], box[:, 2], box[:, INBOX:]
        model = rt.model
        model.forward(ids, kv[:, None] + self._col[None, :], slots, kv, prefill_mask(cnt, C, self._col),
                      max_cache_len=min(self.bounds.graph_len, model.max_len - C))

    def _capture(self, A: int):
        """Capture bucket A's chunk forward on a neutral inbox (every row padding: the spare
        slot, nothing real), which writes only the null page."""
        rt = self.rt
        self.captures += 1
        box = self._inbox[A] = torch.zeros(A, INBOX + self.chunk, dtype=torch.long, device=rt.device)
        box[:, 0] = rt.pad_slot
        try:
            if self.emulate:
                self._run(A)  # the warm-up; the "capture" records
                graph = RecordedGraph(lambda: self._run(A))
            else:
                graph = capture_graph(lambda _: self._run(A), rt.device, self.bounds.pool(), inference=True)
        except Exception as e:
            self.enabled = False
            self._inbox.pop(A, None)
            logger.warning("ouroboros: capturing the draft's prefill forward in a CUDA graph failed "
                           "(%s: %s); the prefill runs eagerly", type(e).__name__, e)
            raise
        self._graphs[A] = graph
        return graph

    def capture(self, row_counts) -> int:
        """Capture the row buckets of these row counts ahead of time (at load); returns how many."""
        self._check_generation(0)
        n = 0
        for A in sorted({self.padded_rows(min(r, MAX_ROWS)) for r in row_counts}):
            if A not in self._graphs:
                self._capture(A)
                n += 1
        return n
