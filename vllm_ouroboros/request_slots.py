"""Which draft slot (draft KV cache row, pool owner, per-request statistics) each request holds.

vLLM's runner drops from its batch every request the scheduler did not schedule this step: a
preempted one, and also a running one that the token budget left out. Such a request comes back
later with the same context (or a longer one), so it keeps its slot: its draft cache is still
valid up to the rollback point and its private pool phrases still apply. A slot is released when
vLLM says the request finished (or was aborted: `finished_req_ids`), or, if every slot is taken,
the absent request seen longest ago gives its slot up (a preempted request may wait in vLLM's
queue while max_num_seqs others run). No vLLM imports.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SlotChanges:
    """What one `sync` changed: slots to reset (finished requests' by slot, then the evicted in
    the order they gave way) and the new requests' slots in the order they took them."""

    released: list[int] = field(default_factory=list)
    assigned: list[tuple[str, int]] = field(default_factory=list)


class RequestSlots:
    """Slots 0..num_slots-1 for requests; absent requests keep theirs (see the module docstring).

    Deterministic for a given sequence of calls, also across processes (no set or hash order
    decides anything), so every tensor-parallel rank that replays the same scheduler outputs
    holds the same slots and reports the same changes.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}
        # A min-heap: a new request takes the lowest free slot, whatever order slots were freed
        # in, so the slots in use stay few and low (the draft's block table and the device
        # round's windows stay small).
        self._free = list(range(num_slots))
        self._finished: set[str] = set()
        # Absent request -> the last step it was in the batch (written as it leaves the batch:
        # a request in the batch has a stale entry or none).
        self._last_seen: dict[str, int] = {}
        self._batch: set[str] = set()  # the last sync's requests, and its batch as given
        self._batch_key: tuple | None = None
        self._step = 0
        self.evicted = 0  # absent requests that gave their slot up before they finished
        self.returned = 0  # requests back in a batch, to the slot they kept, after steps out
        self._memo: tuple[tuple, np.ndarray] | None = None  # slots(): the last batch's

    def slots(self, req_ids) -> np.ndarray:
        """int64 [len(req_ids)]: each request's slot, -1 where it holds none (None rows too).
        Read-only, and the same array for the same batch until a `sync` changes the table: a
        step looks its batch up several times (layouts, verification, proposals: 4 dict walks
        of 256 requests took 83 us a step here), and a batch is often the last step's."""
        key = tuple(req_ids)
        if self._memo is None or self._memo[0] != key:
            out = np.fromiter(map(self.slot_of.get, key, itertools.repeat(-1)), np.int64, len(key))
            out.flags.writeable = False
            self._memo = (key, out)
        return self._memo[1]

    def get(self, req_id: str, default: int = -1) -> int:
        return self.slot_of.get(req_id, default)

    def __getitem__(self, req_id: str) -> int:
        return self.slot_of[req_id]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.slot_of

    def absent(self, req_ids) -> list[int]:
        """Slots of the requests that hold one but are not in `req_ids`, longest absent first (one
        of the last sync's batch left out here counts as seen this step)."""
        batch = set(req_ids)
        out = [r for r in self.slot_of if r not in batch]
        return [self.slot_of[r] for r in sorted(
            out, key=lambda r: self._step if r in self._batch else self._last_seen[r])]

    def finished(self, req_ids) -> None:
        """Requests vLLM finished or aborted (released at the next `sync`)."""
        self._finished.update(req_ids)

    def sync(self, req_ids) -> SlotChanges:
        """The batch of this step (None entries are empty batch rows): release finished
        requests' slots, give new ones a slot. Raises if the batch alone needs more slots
        than there are. Costs per request only where the batch changed (set operations
        otherwise): a steady batch of 256 took 31 us a step with a dict walk per request."""
        out = SlotChanges()
        self._step += 1
        key = tuple(req_ids)
        if key == self._batch_key and not self._finished:
            return out  # the last step's batch again, nothing finished: nothing moves
        live = [r for r in key if r is not None]
        batch = set(live)
        if len(batch) > self.num_slots:
            raise ValueError(f"{len(batch)} requests in one batch, but only {self.num_slots} "
                             "draft slots (max_num_seqs)")
        if self._finished:
            # By slot, not in the set's order (string hashing differs between processes).
            for r in sorted(self._finished & self.slot_of.keys(), key=self.slot_of.__getitem__):
                out.released.append(self._release(r))
            self._finished.clear()
        for r in self._batch - batch:  # out of the batch from this step: last seen the step before
            if r in self.slot_of:
                self._last_seen[r] = self._step - 1
        self.returned += len((batch - self._batch) & self.slot_of.keys())
        for r in live:  # in batch order: it decides which new request takes which slot
            if r not in self.slot_of:
                if not self._free:
                    out.released.append(self._release(self._oldest_absent(batch)))
                self.slot_of[r] = heapq.heappop(self._free)
                out.assigned.append((r, self.slot_of[r]))
        self._batch, self._batch_key = batch, key
        if out.released or out.assigned:
            self._memo = None
        return out

    def _oldest_absent(self, batch: set[str]) -> str:
        absent = [r for r in self.slot_of if r not in batch]
        r = min(absent, key=lambda r: self._last_seen[r])
        self.evicted += 1
        return r

    def _release(self, req_id: str) -> int:
        slot = self.slot_of.pop(req_id)
        self._last_seen.pop(req_id, None)
        heapq.heappush(self._free, slot)
        return slot
