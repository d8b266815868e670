"""Per-round traces of fixed vs adaptive draft length (SpecDec++) on the real pair: what each round
drafted, why it stopped, and what the target accepted of it.

    source scripts/env.sh && python scripts/draft_length_traces.py [--thresholds 0.2 0.3]
        [--prompts 4] [--offset 100] [--max-tokens 48]

One engine per setting (fixed gamma, and the acceptance head at each threshold h; speculation
pinned on, as benchmark.py's rows), the same HumanEval prompts (from --offset: past the head's
training tasks), each round written by the proposer's RoundTrace (OUROBOROS_TRACE). Prints
and writes results/draft_length_traces.{md,json}: per setting the rounds, mean draft length,
mean accepted draft tokens, draft tokens rejected per round (draft forwards spent for nothing
when phrase drafting is off), rounds accepted in full; and per draft length, how many rounds
drafted that long and what they accepted. Raw traces: results/draft_length_traces/*.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from generate import REPO, humaneval_prompts, models_dir


def run(name: str, spec: dict | None, prompts: list[str], max_tokens: int, target: Path,
        trace: Path) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_ouroboros.metrics import TRACE_ENV

    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("")
    os.environ[TRACE_ENV] = str(trace)  # the engine's worker inherits it
    llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              max_num_seqs=1, speculative_config=spec, enable_prefix_caching=False)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        llm.generate(["def warm_up():"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        time.sleep(0.5)
        trace.write_text("")  # the writer appends: later rounds land at the new end
        t0 = time.perf_counter()
        outs = [list(o.outputs[0].token_ids) for p in prompts
                for o in llm.generate([p], sp, use_tqdm=False)]
        seconds = time.perf_counter() - t0
    finally:
        del llm
        gc.collect()
        os.environ.pop(TRACE_ENV, None)
    rounds = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return {"name": name, "spec": spec, "outputs": outs, "seconds": seconds,
            "tokens": sum(map(len, outs)), "rounds": rounds}


def summarise(r: dict) -> dict:
    rounds = r["rounds"]
    n = max(len(rounds), 1)
    by_len: dict[int, list[int]] = defaultdict(list)
    for x in rounds:
        by_len[x["draft"]].append(x["accepted_draft"])
    stops = defaultdict(int)
    for x in rounds:
        stops[x["stop"]] += 1
    return {
        "setting": r["name"], "tokens": r["tokens"], "seconds": round(r["seconds"], 1),
        "tok_s": r["tokens"] / r["seconds"], "rounds": len(rounds),
        "mean_draft": sum(x["draft"] for x in rounds) / n,
        "mean_forwards": sum(x["forwards"] for x in rounds) / n,
        "mean_accepted_draft": sum(x["accepted_draft"] for x in rounds) / n,
        "mean_accepted": sum(x["accepted"] for x in rounds) / n,
        "rejected_draft_per_round": sum(x["sent"] - x["accepted_draft"] for x in rounds) / n,
        "full_rounds": sum(x["accepted_draft"] == x["sent"] for x in rounds) / n,
        "stops": dict(stops),
        "by_draft_len": {k: {"rounds": len(v), "mean_accepted_draft": sum(v) / len(v)}
                         for k, v in sorted(by_len.items())},
    }


def markdown(summaries: list[dict], command: str) -> str:
    f = lambda v: f"{v:.2f}"  # noqa: E731
    lines = [f"Command: `{command}`", "",
             "| setting | tok/s | rounds | mean draft | draft fwd/round | accepted of draft | accepted (+suffix) "
             "| rejected draft tokens/round | rounds accepted in full | stops |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['setting']} | {f(s['tok_s'])} | {s['rounds']} | {f(s['mean_draft'])} "
                     f"| {f(s['mean_forwards'])} | {f(s['mean_accepted_draft'])} | {f(s['mean_accepted'])} "
                     f"| {f(s['rejected_draft_per_round'])} | {f(s['full_rounds'])} | {s['stops']} |")
    lines += ["", "Rounds by draft length (count: mean accepted draft tokens):", ""]
    for s in summaries:
        cells = ", ".join(f"{k}: {v['rounds']} ({v['mean_accepted_draft']:.2f})"
                          for k, v in s["by_draft_len"].items())
        lines.append(f"- {s['setting']}: {cells}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.2, 0.3])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--offset", type=int, default=100, help="first HumanEval task")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--head", type=Path, default=None, help="default models/acceptance_head.safetensors")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "draft_length_traces")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    target = models_dir() / "qwen2.5-coder-1.5b-instruct"
    draft = models_dir() / "qwen2.5-coder-0.5b-instruct"
    head = args.head or models_dir() / "acceptance_head.safetensors"
    if not head.is_file():
        sys.exit(f"{head} missing: python scripts/train_acceptance_head.py")
    prompts = humaneval_prompts(args.offset + args.prompts)[args.offset:]
    pinned = {"method": "ouroboros", "model": str(draft), "max_speculative_batch": 64}
    settings = [("fixed gamma=4", pinned)] + [
        (f"adaptive h={h}", {**pinned, "draft_length": "adaptive", "acceptance_head": str(head),
                             "acceptance_threshold": h}) for h in args.thresholds]
    results = []
    for i, (name, spec) in enumerate(settings):
        print(f"== {name}", flush=True)
        results.append(run(name, spec, prompts, args.max_tokens, target, args.out / f"{i}.jsonl"))
    same = all(r["outputs"] == results[0]["outputs"] for r in results)
    summaries = [summarise(r) for r in results]
    command = "python " + " ".join(sys.argv)
    md = markdown(summaries, command) + f"\nGreedy outputs identical across settings: {same}.\n"
    print(md)
    args.out.with_suffix(".md").write_text(md)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "identical": same,
                                                         "summaries": summaries}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
