"""A step-by-step timeline of one batch through an in-process engine: for each proposer call, the
seconds since the last one ended (the target's step and vLLM's own work), the seconds of the
call (the back-off's plan, the draft's prefill and round), and what the back-off chose: requests
decoding, requests drafting, the draft cut, requests whose draft cache had to catch up, tokens
sent, the calibration ratios (prefill; whole and chain rounds), and the target's forward before
the call as the engine timed it (tokens, seconds) beside the curve measured at load. Then the same batch without
speculation, and the two wall times; configs alternate --reps times (this host drifts 20-30%).

    source scripts/env.sh && python scripts/step_trace.py --prompts 4 --max-tokens 48 [--temperature 0.7] [--workload mtbench]

The first N HumanEval prompts (or MT-Bench first turns, in the target's chat template, as
scripts/benchmark.py sends them), all submitted together; greedy unless --temperature. What the
back-off decides rests on the cost curves measured at load, which the run logs
(`ouroboros: target forward t(n) ...`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the proposer in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import humaneval_prompts, models_dir  # noqa: E402


def traced(log: list[dict]):
    """Wrap the proposer's per-step call and plan so that each call appends one record."""
    from vllm_ouroboros.device_clock import ForwardClock
    from vllm_ouroboros.proposer import OuroborosProposer

    propose, speculate = OuroborosProposer._propose, OuroborosProposer._speculate
    take = ForwardClock.take
    forward: list = [None]  # the reading propose() took before _propose

    def _take(self):
        forward[0] = take(self)
        return forward[0]

    def _speculate(self, slots, lens):
        plan = speculate(self, slots, lens)
        catch_up = self._catch_up(slots, lens, self._model_est.accepted[slots])
        log[-1].update(B=len(slots), drafting=int(plan.rows.sum()), cut=int(plan.max_tokens),
                       catch_up=int((catch_up.tokens > 0).sum()))
        return plan

    def _propose(self, req_ids, *a, **k):
        log.append({"start": time.perf_counter()})
        out = propose(self, req_ids, *a, **k)
        cal, fwd = self._target_calibration, forward[0]
        log[-1].update(seconds=time.perf_counter() - log[-1]["start"], sent=sum(len(x) for x in out),
                       prefill_scale=self._prefill_scale, draft_scale=tuple(self._draft_scale),
                       forward=None if fwd is None or cal is None else (*fwd, cal.base(fwd[0])))
        forward[0] = None
        return out

    OuroborosProposer._propose, OuroborosProposer._speculate = _propose, _speculate
    ForwardClock.take = _take


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=1, help="no-spec / ouroboros pairs, alternating")
    ap.add_argument("--workload", choices=("humaneval", "mtbench"), default="humaneval")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    log: list[dict] = []
    traced(log)
    target = models_dir() / "qwen2.5-coder-1.5b-instruct"
    if args.workload == "mtbench":
        from transformers import AutoTokenizer

        from benchmark import mtbench_prompts
        prompts = mtbench_prompts(args.prompts, AutoTokenizer.from_pretrained(target))
    else:
        prompts = humaneval_prompts(args.prompts)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=1)
    draft = str(models_dir() / "qwen2.5-coder-0.5b-instruct")
    for rep in range(args.reps):
        for name, spec in (("no-spec", None), ("ouroboros", {"method": "ouroboros", "model": draft})):
            llm = LLM(model=str(target), dtype="float32",
                      max_model_len=2048, enforce_eager=True, seed=0, max_num_seqs=args.prompts,
                      speculative_config=spec)
            llm.generate(["def warm_up():"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            log.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"[{rep}] {name}: {n} tokens in {wall:.2f} s, {n / wall:.2f} tok/s, "
                  f"{len(log)} proposer calls")
            prev = t0
            for e in log:
                e = {"B": 0, "drafting": 0, "cut": "-", "catch_up": 0, **e}  # no plan: nothing decoding
                print(f"  +{e['start'] - prev:6.3f} s, call {e['seconds']:6.3f} s: {e['B']} decoding, "
                      f"{e['drafting']} drafting, cut {e['cut']}, catch-up {e['catch_up']}, sent "
                      f"{e['sent']}; ratios prefill {e['prefill_scale']:.2f}, whole "
                      f"{e['draft_scale'][0]:.2f}, chain {e['draft_scale'][1]:.2f}"
                      + ("" if e["forward"] is None else
                         f"; target forward {e['forward'][0]} tokens {e['forward'][1]:.3f} s "
                         f"(curve at load {e['forward'][2]:.3f})"))
                prev = e["start"] + e["seconds"]
            del llm
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
