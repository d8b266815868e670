"""Seconds the draft takes to prefill a batch of new prompts (the first HumanEval prompts, raw
text as the benchmarks send them), one padded forward per pass against the forwards
cost_model.prefill_groups chooses from the draft's t(n) curve measured as the proposer measures
it at load; alternating, on the CPU host loop (vLLM's oneDNN products where available):

    source scripts/env.sh && python scripts/draft_prefill_cost.py [--batch 4 16] [--reps 5]

Each figure: the median of --reps prefills after one warm-up of each way; the caches and
tokens written are the same both ways (tests/test_draft_runtime.py checks it). Beside each, what
the curve says for its forwards' padded sizes: the error the back-off's catch-up calibration
(proposer._calibrate_prefill) corrects at run time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = Path(os.environ.get("OUROBOROS_MODELS_DIR", REPO / "models"))
    ap.add_argument("--draft", type=Path, default=models / "qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from generate import humaneval_prompts
    from train_acceptance_head import load_model
    from vllm_ouroboros import cost_model
    from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
    from vllm_ouroboros.pool import PhrasePool

    torch.set_num_threads(os.cpu_count() or 1)
    m = load_model(str(args.draft))  # the proposer's CPU products (oneDNN where vLLM has it)
    tok = AutoTokenizer.from_pretrained(str(args.draft))
    B = max(args.batch)
    prompts = [tok(p).input_ids for p in humaneval_prompts(B)]
    settings = DraftSettings(gamma=4, beta=5, window_size=4, num_guesses=4, num_suffixes=1)
    pool = PhrasePool(m.vocab_size, 4, 4, 2**24, device="cpu")
    rt = DraftRuntime(m, pool, settings, B, 2048, "cpu")
    curve = cost_model.measure_draft_curve(m, 256)
    print(f"draft {args.draft.name}: t(n) {', '.join(f'{n}: {1000 * t:.0f}' for n, t in zip(curve.n, curve.seconds))} ms")
    for b in args.batch:
        ctx = prompts[:b]
        lens = np.array([len(c) for c in ctx], np.int64)
        tab = np.zeros((b, int(lens.max())), np.int64)
        for i, c in enumerate(ctx):
            tab[i, :len(c)] = c
        slots, rows = np.arange(b), np.arange(b)

        def prefill(grouping):
            rt.reset_slots(slots)
            rt.prefill_cost = grouping
            t0 = time.perf_counter()  # CPU forwards return when done: no sync needed
            forwards, sizes = rt.prefill(slots, tab, rows, lens)
            return time.perf_counter() - t0, forwards, sizes

        times = {"one padded forward per pass": [], "grouped (prefill_groups)": []}
        forwards, sizes = {}, {}
        for rep in range(args.reps + 1):
            for name, grouping in zip(times, (None, curve)):
                t, forwards[name], sizes[name] = prefill(grouping)
                if rep:
                    times[name].append(t)
        pad = b * int(lens.max()) - int(lens.sum())
        print(f"{b} prompts ({lens.min()}-{lens.max()} tokens, {lens.sum()} in all, {pad} padding "
              f"in one forward):")
        med = {k: float(np.median(v)) for k, v in times.items()}
        for name in times:
            modeled = float(curve.at(np.asarray(sizes[name])).sum())
            print(f"  {name:<28} {1000 * med[name]:8.0f} ms, {forwards[name]} forwards; the curve "
                  f"says {1000 * modeled:.0f} ms (measured / modeled {med[name] / modeled:.2f})")
        first, second = med.values()
        print(f"  grouped / one: {second / first:.2f}x")


if __name__ == "__main__":
    main()
