"""Draft slots across vLLM's steps (request_slots.py): a request absent from a step keeps its
slot, a finished one gives it back, and when every slot is taken the absent request seen
longest ago is evicted."""

from __future__ import annotations

import pytest

from vllm_ouroboros.request_slots import RequestSlots


def test_new_requests_take_slots_in_order_and_empty_rows_are_ignored():
    s = RequestSlots(4)
    ch = s.sync(["a", None, "b", "c"])
    assert ch.assigned == [("a", 0), ("b", 1), ("c", 2)] and ch.released == []
    assert s.get("b") == 1 and s.get("zzz") == -1 and "c" in s and None not in s.slot_of


def test_an_absent_request_keeps_its_slot():
    """Preempted, or left out by the token budget: it comes back to the same slot (its draft
    cache and private phrases are still there)."""
    s = RequestSlots(4)
    s.sync(["a", "b", "c"])
    ch = s.sync(["a", "c"])
    assert ch.released == [] and ch.assigned == []
    assert s.get("b") == 1
    assert s.returned == 0
    ch = s.sync(["c", "b", "d"])
    assert ch.assigned == [("d", 3)] and s.get("b") == 1
    assert s.returned == 1
    s.sync(["c", "b", "d"])
    assert s.returned == 1


def test_finished_requests_are_released_at_the_next_sync_and_their_slot_reused():
    s = RequestSlots(3)
    s.sync(["a", "b", "c"])
    s.finished({"b", "never-seen"})
    assert s.get("b") == 1  # nothing happens before the next sync
    ch = s.sync(["a", "c", "d"])
    assert ch.released == [1] and ch.assigned == [("d", 1)]
    # Finished while absent (aborted in vLLM's waiting queue after a preemption).
    s.sync(["a", "d"])
    s.finished(["c"])
    ch = s.sync(["a", "d"])
    assert ch.released == [2] and "c" not in s
    assert s.evicted == 0


def test_when_every_slot_is_taken_the_absent_request_seen_longest_ago_gives_its_slot_up():
    s = RequestSlots(3)
    s.sync(["a", "b", "c"])
    s.sync(["a", "b"])   # c last seen at step 1
    s.sync(["b"])        # a last seen at step 2
    ch = s.sync(["b", "d"])
    assert ch.released == [2] and ch.assigned == [("d", 2)] and s.evicted == 1
    ch = s.sync(["b", "d", "c"])  # c comes back: a (absent since step 2) makes room
    assert ch.released == [0] and ch.assigned == [("c", 0)] and s.evicted == 2
    assert s.slot_of == {"b": 1, "d": 2, "c": 0}


_RANK = """
import random, sys
from vllm_ouroboros.request_slots import RequestSlots
rng, s, out = random.Random(0), RequestSlots(6), []
ids = [f"req-{i}" for i in range(40)]
live = []
for step in range(200):
    done = set(rng.sample(live, min(len(live), rng.randint(0, 2))))
    live = [r for r in live if r not in done]
    live += rng.sample([r for r in ids if r not in live and r not in done], rng.randint(0, 2))
    s.finished(done)
    ch = s.sync(rng.sample(live, min(len(live), 6)))
    out.append((ch.released, ch.assigned))
print(repr((out, sorted(s.slot_of.items()))))
"""


def test_the_same_calls_give_the_same_slots():
    """Tensor-parallel ranks replay the same scheduler outputs: their slots must agree. Ranks
    are processes with their own string hashing (PYTHONHASHSEED), so nothing may follow a set's
    or a hash's order: the ranks are run as processes with different seeds, over steps where
    evictions tie (requests last seen in the same step)."""
    import os
    import subprocess
    import sys

    calls = [(["a", "b", "c"], ()), (["c", "d"], {"a"}), (["e", "f", "d"], {"c"}), (["b", "g", "h"], ())]
    s = RequestSlots(4)
    for batch, done in calls:
        s.finished(done)
        s.sync(batch)
    # Step 4: d, e and f were all last seen in step 3; g and h take the slots of d and e, the
    # first to have taken theirs.
    assert s.slot_of == {"b": 1, "f": 3, "g": 0, "h": 2}, s.slot_of
    runs = {subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(runs) == 1 and runs.pop().count("req-") > 100


def test_a_batch_larger_than_the_slots_is_an_error():
    s = RequestSlots(2)
    with pytest.raises(ValueError, match="3 requests in one batch, but only 2 draft slots"):
        s.sync(["a", "b", "c"])


def test_absent_lists_the_slots_of_requests_out_of_the_batch_longest_absent_first():
    s = RequestSlots(4)
    s.sync(["a", "b", "c", "d"])
    s.sync(["a", "b", "d"])  # c out from here
    s.sync(["a", "d"])  # b out from here
    assert s.absent(["a", "d"]) == [2, 1]
    assert s.absent(["a", "b", "c", "d"]) == []


def test_a_batchs_slots_are_looked_up_once_a_step_and_follow_every_sync():
    """slots() is memoised per batch (a step reads its batch's slots several times); the same
    batch after a sync that released and reassigned a slot reads the new table, not the old."""
    import numpy as np

    s = RequestSlots(2)
    s.sync(["a", "b"])
    first = s.slots(["a", "b", None, "zzz"])
    assert first.tolist() == [0, 1, -1, -1] and first.dtype == np.int64
    assert s.slots(("a", "b", None, "zzz")) is first  # same batch, same step: no second walk
    with pytest.raises(ValueError):
        first[0] = 5  # shared between the step's readers: nobody writes it
    assert s.slots(["b"]).tolist() == [1]
    s.finished(["a"])
    s.sync(["c", "b"])  # c takes a's slot
    assert s.slots(["a", "b", "c"]).tolist() == [-1, 1, 0]
    s.finished(["b"])
    s.sync(["b2"])  # the same key as no earlier call, the table changed under an unchanged batch
    assert s.slots(["a", "b", "c"]).tolist() == [-1, -1, 0]


class _Reference:
    """RequestSlots as first written: a dict walk per request every step (the spec the
    faster sync must match)."""

    def __init__(self, num_slots):
        import heapq

        self.heapq, self.slot_of, self._free = heapq, {}, list(range(num_slots))
        self._finished, self._last_seen, self._step, self.evicted, self.returned = set(), {}, 0, 0, 0

    def finished(self, req_ids):
        self._finished.update(req_ids)

    def absent(self, req_ids):
        batch = set(req_ids)
        return [self.slot_of[r] for r in sorted((r for r in self.slot_of if r not in batch),
                                                key=lambda r: self._last_seen[r])]

    def sync(self, req_ids):
        released, assigned = [], []
        self._step += 1
        live = [r for r in req_ids if r is not None]
        batch = set(live)
        for r in sorted(self._finished, key=lambda r: self.slot_of.get(r, -1)):  # by slot
            if r in self.slot_of:
                released.append(self._release(r))
        self._finished.clear()
        for r in live:
            if r in self.slot_of and self._last_seen[r] < self._step - 1:
                self.returned += 1
            if r not in self.slot_of:
                if not self._free:
                    absent = [a for a in self.slot_of if a not in batch]
                    released.append(self._release(min(absent, key=lambda a: self._last_seen[a])))
                    self.evicted += 1
                self.slot_of[r] = self.heapq.heappop(self._free)
                assigned.append((r, self.slot_of[r]))
            self._last_seen[r] = self._step
        return released, assigned

    def _release(self, r):
        slot = self.slot_of.pop(r)
        self._last_seen.pop(r, None)
        self.heapq.heappush(self._free, slot)
        return slot


def test_sync_matches_a_walk_over_every_request_on_random_steps():
    """sync touches per request only what changed (a steady batch costs set operations, or
    nothing where it is the last step's); slots, releases, evictions, returns and the absent
    order match a walk over every request each step, over random batches with requests that
    stay, leave, come back, finish and are evicted."""
    import random

    rng = random.Random(7)
    for trial in range(40):
        n = rng.randint(1, 8)
        fast, ref = RequestSlots(n), _Reference(n)
        pool = [f"r{i}" for i in range(3 * n)]
        batch: list = []
        for step in range(60):
            if rng.random() < 0.3 and batch:  # some finish (vLLM says so before the next step)
                done = rng.sample(batch, rng.randint(1, len(batch)))
                done = [r for r in done if r is not None]
                fast.finished(done)
                ref.finished(done)
                batch = [r for r in batch if r not in done]
            if rng.random() < 0.6:  # the batch changes: some leave, some (new or back) come
                batch = [r for r in batch if rng.random() < 0.8]
                extra = [r for r in rng.sample(pool, rng.randint(0, n)) if r not in batch]
                batch = (batch + extra)[:n]
                if batch and rng.random() < 0.2:
                    batch.insert(rng.randrange(len(batch)), None)
            ch = fast.sync(batch)
            assert (ch.released, ch.assigned) == ref.sync(batch), (trial, step)
            assert fast.slot_of == ref.slot_of and fast.slots(batch).tolist() == [ref.slot_of.get(r, -1) for r in batch]
            assert (fast.returned, fast.evicted) == (ref.returned, ref.evicted)
            live = [r for r in batch if r is not None]
            assert fast.absent(live) == ref.absent(live), (trial, step)


def test_a_steady_batch_keeps_its_slots_array_across_steps():
    s = RequestSlots(4)
    s.sync(["a", "b"])
    first = s.slots(["a", "b"])
    s.sync(["a", "b"])  # nothing changed: the step reuses the array
    assert s.slots(["a", "b"]) is first
    s.sync(["b"])  # a out of the batch, keeps its slot: the table is unchanged too
    assert s.slots(["a", "b"]) is first
    s.sync(["b", "c"])  # c takes a slot: a new array
    assert s.slots(["a", "b", "c"]).tolist() == [0, 1, 2]


def test_absent_of_part_of_the_batch_counts_the_rest_as_seen_now():
    """absent() of ids that leave out some of the last sync's batch: those count as seen this
    step (after every request out longer), whatever an earlier absence of theirs recorded."""
    s = RequestSlots(4)
    s.sync(["a", "b", "c"])
    s.sync(["a"])  # b and c out from this step
    s.sync(["a", "b"])  # b back
    assert s.absent(["a", "b"]) == [2]
    assert s.absent(["a"]) == [2, 1]  # c out since step 2, b in the batch: seen now
    assert s.absent([]) == [2, 0, 1]  # a and b alike: in the order they took slots
