"""Whether the speculative path costs anything when it backs off: 16 HumanEval prompts x 48
tokens at once (the benchmark's concurrency-16 cell), greedy, engines in the order given, each
timing the same batch `--reps` times back to back. Prints tok/s, output identity, and for
ouroboros its draft forwards and back-off steps in that batch.

Engines alternate so that the host's drift (20-30% hour to hour on this shared 2-core machine,
up to 15% between two back-to-back batches) lands on both sides; compare the spread of each
method's readings, not one pair.

Configs: `none` (no speculation), `ouroboros` (defaults: backs off under load), `never`
(ouroboros with max_speculative_batch 1: never drafts at 16 requests), `sync` (no speculation,
async scheduling off, which vLLM forces for custom_class proposers).

Usage: source scripts/env.sh && VLLM_CPU_KVCACHE_SPACE=2 python scripts/spec_path_overhead.py \
           --order none,ouroboros,none,ouroboros --reps 2
"""
import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchmark import diff
from generate import humaneval_prompts, models_dir


def spec_config(name: str, draft: Path) -> tuple[dict | None, dict]:
    if name == "none":
        return None, {}
    if name == "sync":
        return None, {"async_scheduling": False}
    spec = {"method": "ouroboros", "model": str(draft)}
    if name == "never":
        spec["max_speculative_batch"] = 1
    elif name != "ouroboros":
        raise SystemExit(f"unknown config {name!r}: use none, sync, ouroboros or never")
    return spec, {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", default="none,ouroboros,none,ouroboros")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_ouroboros.metrics import engine_snapshot

    target = models_dir() / "qwen2.5-coder-1.5b-instruct"
    draft = models_dir() / "qwen2.5-coder-0.5b-instruct"
    prompts = humaneval_prompts(args.prompts)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, seed=0)
    base, readings = None, {}
    for name in args.order.split(","):
        spec, kw = spec_config(name, draft)
        llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
                  max_num_seqs=args.prompts, enable_prefix_caching=False, speculative_config=spec,
                  disable_log_stats=False, **kw)
        print(f"{name}: async_scheduling = "
              f"{llm.llm_engine.vllm_config.scheduler_config.async_scheduling}", flush=True)
        llm.generate(["def warm_up():"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for rep in range(args.reps):
            s0 = engine_snapshot(llm) if spec else None
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            ids = [list(o.outputs[0].token_ids) for o in outs]
            base = base or ids
            toks = sum(map(len, ids))
            readings.setdefault(name, []).append(toks / dt)
            extra = ""
            if spec:
                s = diff(engine_snapshot(llm), s0)
                extra = f", draft forwards {s['draft_forwards']}, back-off steps {s['backoff_steps']}"
            print(f"RESULT {name} batch {rep}: {toks / dt:.2f} tok/s ({toks} tokens, {dt:.1f} s), "
                  f"identical {ids == base}{extra}", flush=True)
        del llm
        gc.collect()
    ref = statistics.mean(readings.get("none", [float("nan")]))
    for name, r in readings.items():
        print(f"SUMMARY {name}: mean {statistics.mean(r):.2f} tok/s over {len(r)} batches "
              f"(min {min(r):.2f}, max {max(r):.2f}), {statistics.mean(r) / ref:.2f}x the mean of none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
