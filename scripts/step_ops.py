"""ATen calls per engine step by region of our code, one greedy request on the tiny test pair
(tests/tiny_models.py; in-process engine): a proxy for the kernels a GPU's host launches one by
one where that code runs eagerly. Views are counted apart (they launch nothing). Then the host
time of each region per step (exclusive of the regions nested in it), from a second run without
the counting: on a GPU the host runs our Python and numpy between the target's forwards while
the GPU waits, so this is time a GPU step pays too (the tiny pair's forwards, inside run_round
and outside our regions, are cheap here; on a GPU the graph round replaces run_round's host loop).

Usage: source scripts/env.sh && python scripts/step_ops.py [--tokens 100] [--window]

Regions: run_round (the drafting round; on a GPU the graph round replays it), on_verified and
propose outside the round, the target side's patches (tree_verify.begin_step: the token tree's
inputs; tree_verify.sample: the tree walk), and the pool's insert / lookup / replace wherever
called (nested calls count for the innermost region). Everything else of the step (vLLM's
target forward and bookkeeping) is "outside".
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its ops are seen
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tiny_models import model_pair  # noqa: E402

VIEWS = ("view", "unsqueeze", "squeeze", "reshape", "detach", "slice", "select", "expand", "alias",
         "resolve_conj", "resolve_neg", "_unsafe_view", "aten.t.", "transpose", "as_strided", "lift_fresh")


class Regions:
    """Counts ATen calls per innermost wrapped region."""

    def __init__(self):
        self.stack = ["outside"]
        self.calls = collections.Counter()
        self.kernels = collections.Counter()
        self.entries = collections.Counter()
        self.ops = collections.defaultdict(collections.Counter)  # region -> non-view op -> calls
        self.seconds = collections.Counter()  # region -> host seconds, nested regions excluded
        self._nested = [0.0]  # per open region: seconds its nested regions took

    def wrap(self, owner, name: str, label: str) -> None:
        orig = getattr(owner, name)

        @functools.wraps(orig)
        def run(*a, **k):
            self.entries[label] += 1
            self.stack.append(label)
            self._nested.append(0.0)
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                took = time.perf_counter() - t0
                self.seconds[label] += took - self._nested.pop()
                self._nested[-1] += took
                self.stack.pop()

        setattr(owner, name, run)

    def mode(self) -> TorchDispatchMode:
        regions = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                label = regions.stack[-1]
                regions.calls[label] += 1
                out = func(*args, **(kwargs or {}))
                # A cast to the dtype a tensor has (`.long()` of a long) returns it: no kernel.
                noop = func.__name__.startswith("to") and args and out is args[0]
                if not noop and not any(v in str(func) for v in VIEWS):
                    regions.kernels[label] += 1
                    regions.ops[label][str(func)] += 1
                return out

        return Count()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--window", action="store_true", help="phrase drafting: the Jacobi window on")
    ap.add_argument("--detail", nargs="*", default=[], metavar="REGION",
                    help="also list these regions' non-view ATen calls per step, most first")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    from vllm_ouroboros import pool, proposer
    from vllm_ouroboros.draft import runtime
    from vllm_ouroboros.patches import tree_verify

    reg = Regions()
    reg.wrap(proposer.OuroborosProposer, "propose", "propose (outside the round)")
    reg.wrap(proposer.OuroborosProposer, "on_verified", "on_verified")
    reg.wrap(runtime.DraftRuntime, "run_round", "run_round")
    reg.wrap(tree_verify, "begin_step", "tree_verify.begin_step")
    reg.wrap(tree_verify, "sample", "tree_verify.sample")
    for name in ("insert", "lookup", "replace"):
        reg.wrap(pool.PhrasePool, name, f"pool.{name}")
    pair = model_pair(Path(tempfile.mkdtemp(prefix="step_ops")))
    # Every timing-dependent choice pinned (the drafting mode: pool guesses, this CPU's; with
    # --window the Jacobi window too, whose inserts then run inside the round).
    spec = {"method": "ouroboros", "model": str(pair["draft"]), "max_speculative_batch": 64,
            "use_suffixes": True, "use_guesses": True, "use_lookahead": args.window}
    llm = LLM(model=str(pair["target"]), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              max_num_seqs=4, enable_prefix_caching=False, speculative_config=spec)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = "def add(a, b):\n    return a + b\n" * 3
    llm.generate([prompt], sp, use_tqdm=False)  # warm-up
    reg.calls.clear(), reg.kernels.clear(), reg.entries.clear()
    with reg.mode():
        llm.generate([prompt], sp, use_tqdm=False)
    steps = reg.entries["propose (outside the round)"]
    entries = dict(reg.entries)  # the timed run below enters the regions again
    reg.seconds.clear()
    t0 = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)  # the same request, timed without the counting
    wall = time.perf_counter() - t0
    print(f"{steps} drafting steps (propose calls), {args.tokens} tokens; host ms per step: "
          f"{1000 * wall / steps:.2f} in all, by region below (nested regions excluded)")
    print(f"{'region':<30}{'calls/step':>11}{'ATen/step':>11}{'non-view/step':>15}{'non-view/call':>15}"
          f"{'host ms/step':>14}")
    outside = wall - sum(reg.seconds.values())
    for label, n in reg.calls.most_common():
        calls = entries.get(label, 0)
        per_call = f"{reg.kernels[label] / calls:15.0f}" if calls else f"{'-':>15}"
        sec = outside if label == "outside" else reg.seconds[label]
        print(f"{label:<30}{calls / steps:11.2f}{n / steps:11.1f}{reg.kernels[label] / steps:15.1f}{per_call}"
              f"{1000 * sec / steps:14.3f}")
    for label in args.detail:
        print(f"\n{label}: non-view ATen calls per step")
        for op, k in reg.ops[label].most_common():
            print(f"  {k / steps:8.2f}  {op}")


if __name__ == "__main__":
    main()
