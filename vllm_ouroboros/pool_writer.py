"""The step's pool inserts from host rows (context phrases, candidate inspiration), replayed from
CUDA graphs on a GPU.

`PhrasePool.insert` is about 190 ATen calls (stable sorts for the duplicate rows, scatters for the
pages; counted on the tiny pair, results/README.md "Session of 2026-11-25 (sixth)"), none of them
a host sync. Run eagerly on a GPU, the host launches its ~120 kernels one by one, twice a step
(the context confirmed since the last round, the target's output after the first rejection):
host time of the order of a millisecond per step, next to target and draft forwards of a few.
The drafting round already captures its own inserts (draft/device_round.py); these are the
ones around it.

With graphs, an insert of N rows pads them to a bucket (BUCKETS) with masked rows, which change
nothing (the pool's state does not depend on how many rows a call carried, pool.py), copies the
packed rows into the bucket's static device buffer and replays the bucket's graph: one host->
device copy, queued from pinned memory without a host wait (host_copy.py). Masked rows take
recency stamps as real ones do: only the order of stamps matters, and that is unchanged. More rows than the largest bucket, and every insert without
graphs (the CPU), run eagerly.

A step's two sources reach the writer at different times: candidate inspiration after the
target's forward (proposer.on_verified), the context phrases at the next round's start. Nothing
reads the pool in between, so the first are staged (`stage`) and go in with the second: one
insert per step instead of two (on a GPU one graph replay, ~150 kernels, less). Readers see the
pool as after two calls (rows in the same order; which page holds a key may differ) while it
has a page for every key; a full pool may recycle other pages (one call protects the pages of
all its keys, two calls only their own): lossless either way, the pool only proposes. Whoever
reads or changes the pool otherwise first calls `flush`. No vLLM imports.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.cuda_graph import capture_graph
from vllm_ouroboros.draft.device_round import RecordedGraph, bucket
from vllm_ouroboros.host_copy import copy_into, to_device
from vllm_ouroboros.pool import PhrasePool

logger = logging.getLogger(LOGGER_NAME)

# Row counts captured: a step inserts about the tokens it accepted per request.
BUCKETS = (16, 64, 256, 1024)
# Packed row: key, owner, valid, then the L phrase tokens.
_HEAD = 3


class PoolWriter:
    """Inserts host rows into a PhrasePool, from CUDA graphs where `graphs` (module docstring).

    emulate_graphs: with graphs, recorded stand-ins (`RecordedGraph`: a capture records, a replay
    runs), so the padding and buffers are tested on a CPU.
    """

    def __init__(self, pool: PhrasePool, graphs: bool = False, emulate_graphs: bool = False):
        if graphs and pool.device.type != "cuda" and not emulate_graphs:
            raise ValueError(f"CUDA graphs need a CUDA device; the pool is on {pool.device.type}")
        self.pool = pool
        self.graphs = graphs
        self.emulate = emulate_graphs
        # bucket -> [3 + L, Nb] int64 on the device, one row per field: keys, owners and the
        # valid flags are then contiguous, as the pool's insert kernels read them
        self._boxes: dict[int, torch.Tensor] = {}
        self._replays: dict[int, object] = {}  # bucket -> captured graph
        self._graph_pool = None
        self.replayed = 0  # inserts that ran from a graph (the rest ran eagerly)
        self.calls = 0  # pool inserts run (graph replays and eager calls)
        self._staged: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def stage(self, keys: np.ndarray, phrases: np.ndarray, owners: np.ndarray) -> None:
        """Queue rows for the next `insert` or `flush`, older than the rows that call brings
        (module docstring). Shapes as `insert`."""
        keys, phrases, owners = np.asarray(keys), np.asarray(phrases), np.asarray(owners)
        # Checked here as the eager insert checks them: a graph's box would broadcast a narrow
        # phrase across its L rows instead.
        n = len(keys)
        if not n:
            return
        if keys.ndim != 1 or phrases.shape != (n, self.pool.L) or owners.shape != (n,):
            raise ValueError(f"expected keys [N], phrases [N, {self.pool.L}] and owners [N], got "
                             f"{keys.shape}, {phrases.shape} and {owners.shape}")
        self._staged.append((keys, phrases, owners))

    @property
    def staged(self) -> int:
        """Rows queued by `stage` and not inserted yet."""
        return sum(len(k) for k, _, _ in self._staged)

    def insert(self, keys: np.ndarray, phrases: np.ndarray, owners: np.ndarray) -> None:
        """Insert the staged rows, then these, as newest (PhrasePool.insert), later rows
        newer: one pool insert.

        Shape: keys [N] int, phrases [N, L] int, owners [N] int (host arrays)."""
        self.stage(keys, phrases, owners)
        self.flush()

    def flush(self) -> None:
        """Insert the staged rows now (nothing if none): before the pool is read or changed
        by anything but this writer."""
        if not self._staged:
            return
        parts, self._staged = self._staged, []
        keys, phrases, owners = parts[0] if len(parts) == 1 else (np.concatenate(p) for p in zip(*parts))
        N = len(keys)
        self.calls += 1
        Nb = bucket(N, BUCKETS)
        if not self.graphs or N > BUCKETS[-1] or not self._ready(Nb):
            self.pool.insert(*to_device(self.pool.device, keys, phrases, owners))
            return
        packed = np.zeros((_HEAD + self.pool.L, Nb), np.int64)
        packed[0] = -1
        packed[0, :N], packed[1, :N], packed[2, :N] = keys, owners, 1
        packed[_HEAD:, :N] = phrases.T
        copy_into(self._boxes[Nb], packed)
        self._replays[Nb].replay()
        self.replayed += 1

    def capture(self, buckets=BUCKETS) -> int:
        """Capture these buckets' graphs now (in load_model, where vLLM's profiler sees their
        memory); returns how many it holds (0 once a capture failed: inserts run eagerly)."""
        if not self.graphs:
            return 0
        for b in buckets:
            self._ready(b)
        return len(self._replays)

    def _ready(self, Nb: int) -> bool:
        """The bucket's graph, captured on first use; False (logged once, eager from then on)
        where the capture fails."""
        if Nb in self._replays:
            return True
        if not self.graphs:  # a capture failed: no more captures (capture() goes on calling)
            return False
        box = torch.zeros(_HEAD + self.pool.L, Nb, dtype=torch.long, device=self.pool.device)
        box[0] = -1  # a neutral insert: every row masked
        pool = self.pool

        def fn():
            pool.insert(box[0], box[_HEAD:].T, box[1], valid=box[2] > 0)

        try:
            if self.emulate:
                fn()  # the warm-up; the "capture" records
                graph = RecordedGraph(fn)
            else:
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                # The warm-up is a neutral insert: only the recency clock moves.
                graph = capture_graph(lambda _: fn(), self.pool.device, self._graph_pool)
        except Exception as e:  # noqa: BLE001 - eager inserts work everywhere
            logger.warning("ouroboros: capturing the pool insert of %d rows failed (%s: %s); "
                           "inserts run eagerly", Nb, type(e).__name__, e)
            self.graphs = False
            # The graphs captured before would never replay: their memory goes back.
            self._boxes.clear()
            self._replays.clear()
            return False
        self._boxes[Nb], self._replays[Nb] = box, graph
        return True
