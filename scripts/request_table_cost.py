"""Host time per step of the proposer's request table (request_slots.RequestSlots) at B requests,
side by side with a walk over every request each step (tests/test_request_slots._Reference, the
table as first written, with a dict lookup per request for each of the step's three slot reads):
a steady batch, a batch with one request swapped, and the step where B requests arrive at once
(the proposer's per-slot resets for them included: OuroborosProposer._start_requests).

Usage: source scripts/env.sh && python scripts/request_table_cost.py [--batch 64 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from test_request_slots import _Reference  # noqa: E402

from vllm_ouroboros.request_slots import RequestSlots  # noqa: E402

READS = 3  # layouts / on_verified before the step's sync, _propose after it


def per_call_us(fn, setup=None, min_s: float = 0.3) -> float:
    """Median of 5 timings of fn (µs per call), setup run untimed before each call."""
    runs = []
    for _ in range(5):
        n, total = 0, 0.0
        while total < min_s / 5:
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
            n += 1
        runs.append(total / n * 1e6)
    return float(np.median(runs))


def step_fast(table, batch):
    table.slots(batch)
    table.sync(batch)
    for _ in range(READS - 1):
        table.slots(batch)


def step_walk(table, batch):
    table.sync(batch)
    for _ in range(READS):
        np.array([table.slot_of.get(r, -1) for r in batch], np.int64)


def arrivals_us(B: int) -> float:
    """_start_requests for B new requests, on a proposer reduced to the arrays it writes."""
    from types import SimpleNamespace

    from vllm_ouroboros.backoff_estimates import BackoffEstimates
    from vllm_ouroboros.metrics import OuroborosStats
    from vllm_ouroboros.proposer import OuroborosProposer

    p = object.__new__(OuroborosProposer)
    S = 20
    p.stats = OuroborosStats(B)
    p._model_est, p._pool_est, p._branch_est = (BackoffEstimates(B, np.full(S, 0.5)) for _ in range(3))
    for name, value in (("_room_cut", False), ("_source", 0), ("_last_cut", S), ("_len_limit", 512),
                        ("_readable", True), ("_draft_forwards", 4.0), ("_base_tokens", 2.0),
                        ("_suffix_yield", 2.0), ("_suffix_gap", 0), ("_suffix_wait", 0)):
        setattr(p, name, np.full(B, value))
    p.num_spec_tokens, p.max_model_len, p.cfg = S, 512, SimpleNamespace(gamma=4)
    p._prior_tokens_per_fwd, p._suffix_yield_all = 2.0, 2.0
    p._length_limit_of, p._prompt_readable_of = (lambda r: 300), (lambda r: True)
    assigned = [(f"new-{i}", i) for i in range(B)]
    return per_call_us(lambda: p._start_requests(assigned), setup=p.stats.req_of_slot.clear)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    print("| requests | case | this table (µs/step) | walk every request (µs/step) |")
    print("|---:|---|---:|---:|")
    for B in args.batch:
        ids = [f"cmpl-{i:032x}-0" for i in range(B)]
        swapped = [[*ids[:-1], f"swap-{k}"] for k in range(2)]  # the last request alternates
        for case, batches in (("steady batch", [ids]), ("one request swapped", swapped)):
            fast, walk = RequestSlots(B + 2), _Reference(B + 2)
            for b in batches:
                fast.sync(b)
                walk.sync(b)
            turn = {"fast": 0, "walk": 0}

            def run(kind, table, step):
                batch = batches[turn[kind] % len(batches)]
                turn[kind] += 1
                step(table, batch)

            t_fast = per_call_us(lambda: run("fast", fast, step_fast))
            t_walk = per_call_us(lambda: run("walk", walk, step_walk))
            print(f"| {B} | {case} | {t_fast:.1f} | {t_walk:.1f} |")
        print(f"| {B} | {B} arrivals (_start_requests) | {arrivals_us(B):.0f} | |")


if __name__ == "__main__":
    main()
