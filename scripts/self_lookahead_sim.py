"""Tokens per forward when a model drafts its own greedy text with the phrase pool and the
lookahead window (DraftRuntime, no engine): what the target would advance per forward if its
own step ran the Jacobi window and verified pool guesses, i.e. lookahead decoding of the target.

Each prompt is prefilled, then rounds of --gamma tokens run until --max-tokens are written; every
round's draft is the model's own greedy continuation (tests/test_draft_runtime.py checks that),
so all of it is taken, as a target verifying itself would take it. Printed per model: tokens per
forward (prefill excluded) and the forward's width. One pool per model, shared across prompts
(warm start, as the plugin's is).

    source scripts/env.sh && python scripts/self_lookahead_sim.py --prompts 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import models_dir, workload_prompts  # noqa: E402


def self_lookahead(model_dir: Path, prompts: list[list[int]], max_tokens: int, gamma: int = 16,
                   beta: int = 4, window: int = 4, guesses: int = 4) -> dict:
    """Each prompt (token ids) written on by max_tokens or more of the model's own tokens, round
    after round of DraftRuntime drafts taken whole. Returns the counts, tokens per forward
    (overall and per prompt) and the written tokens ("texts", one list per prompt)."""
    from vllm_ouroboros.draft import DraftModel
    from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
    from vllm_ouroboros.pool import PhrasePool

    model = DraftModel.from_pretrained(str(model_dir), dtype=torch.float32, device="cpu")
    L, V = beta - 1, model.vocab_size
    pool = PhrasePool(V, L, window, PhrasePool.budget_for(V, L, window, 4096), device="cpu", shared=True)
    settings = DraftSettings(gamma=gamma, beta=beta, window_size=window, num_guesses=guesses,
                             num_suffixes=0, max_draft_forwards=gamma)
    max_len = max(len(p) for p in prompts) + max_tokens + 2 * gamma + 64
    rt = DraftRuntime(model, pool, settings, 1, max_len, "cpu")
    forwards, texts, per_prompt, t0 = 0, [], [], time.perf_counter()
    for p in prompts:
        rt.reset_slots([0])
        ctx, f0 = list(p), forwards
        while len(ctx) - len(p) < max_tokens:
            out = rt.run_round(np.zeros(1, np.int64), np.asarray([ctx], np.int64),
                               np.zeros(1, np.int64), np.asarray([len(ctx)], np.int64))
            ctx += out.drafts[0, : out.draft_lens[0]].tolist()
            forwards += out.forwards
        texts.append(ctx[len(p):])
        per_prompt.append(round(len(texts[-1]) / max(forwards - f0, 1), 3))
    tokens = sum(len(t) for t in texts)
    return dict(model=Path(model_dir).name, tokens=tokens, forwards=forwards,
                tokens_per_forward=round(tokens / max(forwards, 1), 3), per_prompt=per_prompt,
                seconds=round(time.perf_counter() - t0, 1), texts=texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workload", default="humaneval", choices=["humaneval", "mtbench"])
    ap.add_argument("--gamma", type=int, default=16, help="tokens per round (rounds end early)")
    ap.add_argument("--beta", type=int, default=4, help="phrase length + 1")
    ap.add_argument("--window", type=int, default=4, help="W: window columns = phrases per key")
    ap.add_argument("--guesses", type=int, default=4, help="G: pool guesses verified per forward")
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    target = models_dir() / "qwen2.5-coder-1.5b-instruct"
    prompts = workload_prompts(args.workload, args.prompts, target)
    width = 1 + (args.window + args.guesses) * (args.beta - 1)
    from transformers import AutoTokenizer

    rows = []
    for name in args.models:
        ids = [AutoTokenizer.from_pretrained(models_dir() / name)(p).input_ids for p in prompts]
        r = self_lookahead(models_dir() / name, ids, args.max_tokens, args.gamma, args.beta,
                           args.window, args.guesses)
        del r["texts"]
        r.update(width=width, W=args.window, G=args.guesses, beta=args.beta)
        print(json.dumps(r), flush=True)
        rows.append(r)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
