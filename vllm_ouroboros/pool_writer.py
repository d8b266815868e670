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
device copy (the eager path makes three), queued from pinned memory without a host wait
(host_copy.py). Masked rows take recency stamps as real ones do: only the order of stamps
matters, and that is unchanged. More rows than the largest bucket, and every insert without
graphs (the CPU), run eagerly. No vLLM imports.
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
        self._boxes: dict[int, torch.Tensor] = {}  # bucket -> [Nb, 3 + L] int64, on the device
        self._replays: dict[int, object] = {}  # bucket -> captured graph
        self._graph_pool = None
        self.replayed = 0  # inserts that ran from a graph (the rest ran eagerly)

    def insert(self, keys: np.ndarray, phrases: np.ndarray, owners: np.ndarray) -> None:
        """Insert phrases as newest (PhrasePool.insert), later rows newer.

        Shape: keys [N] int, phrases [N, L] int, owners [N] int (host arrays)."""
        N = len(keys)
        if N == 0:
            return
        Nb = bucket(N, BUCKETS)
        if not self.graphs or N > BUCKETS[-1] or not self._ready(Nb):
            self.pool.insert(*to_device(self.pool.device, keys, phrases, owners))
            return
        packed = np.zeros((Nb, _HEAD + self.pool.L), np.int64)
        packed[:, 0] = -1
        packed[:N, 0], packed[:N, 1], packed[:N, 2] = keys, owners, 1
        packed[:N, _HEAD:] = phrases
        copy_into(self._boxes[Nb], packed)
        self._replays[Nb].replay()
        self.replayed += 1

    def capture(self, buckets=BUCKETS) -> int:
        """Capture these buckets' graphs now (in load_model, where vLLM's profiler sees their
        memory); returns how many were captured."""
        if not self.graphs:
            return 0
        todo = [b for b in buckets if b not in self._replays]
        return sum(1 for b in todo if self._ready(b))

    def _ready(self, Nb: int) -> bool:
        """The bucket's graph, captured on first use; False (logged once, eager from then on)
        where the capture fails."""
        if Nb in self._replays:
            return True
        box = torch.zeros(Nb, _HEAD + self.pool.L, dtype=torch.long, device=self.pool.device)
        box[:, 0] = -1  # a neutral insert: every row masked
        pool = self.pool

        def fn():
            pool.insert(box[:, 0], box[:, _HEAD:], box[:, 1], valid=box[:, 2] > 0)

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
            return False
        self._boxes[Nb], self._replays[Nb] = box, graph
        return True
