"""What a decode step's padding cost the device round: decode-only rounds (no window, no
guesses) whose forwards after the first carry one uncached column per row (DeviceRound.step_width)
against L + 1 of them (DeviceRound(padded_steps=True), the shape before), alternating in one run.

Runs the device round eagerly on any device (CPU included) with random weights in the real
draft's shapes (scripts/bench_gpu.py's table and RoundRunner: 300-token contexts, gamma 4,
beta 5, each round's draft accepted plus one token). On CUDA, scripts/bench_gpu.py times the
graph round both ways (mode graph+fused+padded-steps). No vLLM imports.

    python scripts/step_width_cost.py [--batches 1 8] [--rounds 6] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402 - the runner and the model table live there

from vllm_ouroboros.draft.device_round import DeviceRound  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds per form (after one warm-up)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tiny", action="store_true", help="bench_gpu's 2-layer shapes (seconds)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = bench_gpu.Plan(tiny=a.tiny)
    plan.warmup_rounds, plan.timed_rounds = 1, a.rounds
    model, _ = bench_gpu.load_model("draft", None, a.tiny, getattr(torch, a.dtype), dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"device {dev}, {a.dtype}, {'tiny' if a.tiny else 'real'} draft shapes; ms per round "
          f"(median of {a.rounds}), decode-only, gamma {bench_gpu.GAMMA}")
    for B in a.batches:
        runners = {}
        for padded in (False, True):
            r = bench_gpu.RoundRunner(model, 0, 0, B, "device", plan, seed=7)  # the same contexts
            r.rt.device_round = DeviceRound(r.rt, padded_steps=padded)
            r.run()
            runners[padded] = r
        ms: dict[bool, list[float]] = {False: [], True: []}
        widths = {p: r.rt.device_round.step_width for p, r in runners.items()}
        for _ in range(a.rounds):
            for padded, r in runners.items():
                sync()
                t0 = time.perf_counter()
                r.run()
                sync()
                ms[padded].append(1e3 * (time.perf_counter() - t0))
        one, pad = float(np.median(ms[False])), float(np.median(ms[True]))
        print(f"B={B}: {widths[False]} column {one:.1f} ms, {widths[True]} columns {pad:.1f} ms, "
              f"ratio {one / pad:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
