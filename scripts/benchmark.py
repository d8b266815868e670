"""Side-by-side benchmark: no speculation, vLLM's ngram and draft_model, and ouroboros with its
ablations, on the same engine build and machine, in one run.

    source scripts/env.sh && python scripts/benchmark.py            # the real pair, 23 min on 2 CPU cores at 55e4672
    python scripts/benchmark.py --target T --draft D --quick          # plumbing check on any pair

For every (method, workload, concurrency, temperature) cell: output tokens/s and the ratio to
no speculation from this run, tokens per target forward, acceptance rate and acceptance by
position (vLLM's spec-decode counters), draft forwards per output token, and a modeled speedup
from measured per-forward times t_target(n) and t_draft(n) (SpecDec++ eq. 2.3, adapted below)
under the measured curve and under a flat, memory-bound curve t(n) = t(1). A cell whose output
differs from no speculation gets no speed reported: every greedy cell, and ouroboros's sampled
ones (its requests carry a seed, which ouroboros samples as vLLM does without speculation:
vllm_ouroboros/seeded_sampling.py; vLLM's own methods sample other tokens there, "n/a").

Modeled latency per output token of a method (per request, F = forwards, N = output tokens):
    (F_draft * t_draft(n_draft) + F_target * t_target(n_target) + F_plain * t_target(1)) / N
with n_target = tokens per target forward input (draft + 1), F_plain = steps without a draft, n_draft = tokens per draft
forward input; no speculation costs t_target(1). Writes JSON, a markdown table and plots.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from generate import REPO, humaneval_prompts, models_dir

CURVE_POINTS = (1, 2, 4, 8, 16, 32, 64, 128)


def mtbench_prompts(n: int, tokenizer) -> list[str]:
    path = models_dir() / "data" / "mt_bench_questions.jsonl"
    if not path.exists():
        sys.exit(f"{path} missing: run scripts/setup.sh")
    qs = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()][:n]
    if not getattr(tokenizer, "chat_template", None):
        return qs  # a test model without a chat template: raw questions
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in qs]


# SpecDec++ thresholds h of the adaptive-length rows (and the trained head's own, "hhead").
THRESHOLDS = (0.1, 0.2, 0.3, 0.5, 0.7)


def methods(draft: Path, head: Path | None = None) -> dict[str, dict | None]:
    o = {"method": "ouroboros", "model": str(draft)}
    # Fixed vs adaptive draft length (SpecDec++) with speculation pinned on, so that the back-off
    # does not decide which steps each row measures.
    pinned = {**o, "max_speculative_batch": 64}
    adaptive = {f"ouroboros-adaptive-h{h}": {**pinned, "draft_length": "adaptive",
                                            "acceptance_head": str(head), "acceptance_threshold": h}
                for h in THRESHOLDS}
    adaptive["ouroboros-adaptive-hhead"] = {**pinned, "draft_length": "adaptive",
                                           "acceptance_head": str(head)}
    # Longer fixed drafts, to tell the rule's choice of rows from the mean length it drafts.
    adaptive["ouroboros-fixed-g6"] = {**pinned, "gamma": 6}
    return {
        "no-spec": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
        "draft_model-k3": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "draft_model-k5": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 5},
        "ouroboros": o,  # defaults: phrase drafting and back-off decided from this device's curve
        # Speculation pinned on: on a compute-bound CPU the back-off declines every phrase-drafting
        # step (a 34-token draft forward costs ~5 one-token ones), which would measure nothing.
        "ouroboros-phrases": {**o, "use_lookahead": True, "use_guesses": True, "max_speculative_batch": 64},
        "ouroboros-no-phrases": {**o, "use_lookahead": False, "use_guesses": False},
        # Defaults send the suffix only where its measured acceptance pays for its target tokens;
        # these send them at every step: K = 1 (a chain), K = 3 (a token tree).
        "ouroboros-no-suffix": {**o, "use_suffixes": False},
        "ouroboros-k1": {**o, "use_suffixes": True},
        "ouroboros-k3": {**o, "num_suffixes": 3, "use_suffixes": True},
        "ouroboros-no-inspiration": {**o, "use_inspiration": False},
        "ouroboros-no-refinement": {**o, "use_refinement": False},
        "ouroboros-no-warm-start": {**o, "warm_start": False},
        "ouroboros-no-context": {**o, "use_context_phrases": False},
        "ouroboros-fixed": pinned,
        **adaptive,
    }


# Run in the full table (the mechanisms). "ouroboros-no-context" (pool phrases from the
# confirmed text off) runs when --methods names it: the full table must stay under an hour here.
ABLATIONS = {"ouroboros-phrases", "ouroboros-no-phrases", "ouroboros-no-suffix", "ouroboros-k1", "ouroboros-k3",
             "ouroboros-no-inspiration", "ouroboros-no-refinement", "ouroboros-no-warm-start"}
# One cell each, only when named: the adaptive-length comparison is its own run
# (`--methods ouroboros-fixed,ouroboros-adaptive-h0.3,...`, README "Adaptive draft length").
EXTRA = {"ouroboros-no-context", "ouroboros-fixed", *(f"ouroboros-adaptive-h{h}" for h in THRESHOLDS),
         "ouroboros-adaptive-hhead", "ouroboros-fixed-g6"}
ONE_CELL = ABLATIONS | EXTRA


# Prompts per concurrency-1 cell, and tokens per request: 3 x 64 took 66 min at eca2a3f and
# 61 min at e487a88, and this host's speed varies by 20-30% from hour to hour (limit: one hour
# on this 2-core machine). The other cells run one batch of `concurrency` prompts.
PROMPTS_AT_ONE = 2
MAX_TOKENS = 48


def cells(quick: bool) -> list[tuple[str, int, float]]:
    """(workload, concurrency, temperature) measured for the main methods."""
    if quick:
        return [("humaneval", 1, 0.0), ("humaneval", 4, 0.0)]
    # MT-Bench at concurrency 1 only: the full table took 66 min at eca2a3f with an MT-Bench
    # concurrency-4 cell as well (limit: one hour on this 2-core machine).
    return [("humaneval", 1, 0.0), ("humaneval", 4, 0.0), ("humaneval", 16, 0.0),
            ("mtbench", 1, 0.0), ("humaneval", 4, 0.7)]


def spec_counters(llm) -> dict:
    """vLLM's own speculative-decoding counters (drafts, draft tokens, accepted, per position)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in out and hasattr(m, "value"):
            out[name] += m.value
        elif name == "num_accepted_tokens_per_pos" and hasattr(m, "values"):
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(m.values), m.values)] \
                if out["per_pos"] else list(m.values)
    return out


def diff(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    pos_a, pos_b = after.get("per_pos", []), before.get("per_pos", [])
    d["per_pos"] = [a - (pos_b[i] if i < len(pos_b) else 0) for i, a in enumerate(pos_a)]
    return d


def run_method(name, spec, workloads, plan, max_tokens, target, max_num_seqs, progress,
               prompts_at_one=PROMPTS_AT_ONE):
    from vllm import LLM, SamplingParams

    from vllm_ouroboros.metrics import engine_snapshot

    ours = bool(spec) and spec.get("method") == "ouroboros"
    llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              max_num_seqs=max_num_seqs, speculative_config=spec, enable_prefix_caching=False,
              disable_log_stats=False)
    rows = []
    try:
        llm.generate(["def warm_up():"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for workload, conc, temp in plan:
            prompts = workloads[workload][: max(conc, prompts_at_one if conc == 1 else conc)]
            sp = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=0)
            c0, s0 = spec_counters(llm), engine_snapshot(llm) if ours else None
            outputs, t0 = [], time.perf_counter()
            for i in range(0, len(prompts), conc):
                outs = llm.generate(prompts[i:i + conc], sp, use_tqdm=False)
                outputs += [list(o.outputs[0].token_ids) for o in outs]
            seconds = time.perf_counter() - t0
            c = diff(spec_counters(llm), c0)
            row = {"method": name, "workload": workload, "concurrency": conc, "temperature": temp,
                   "outputs": outputs, "tokens": sum(map(len, outputs)), "seconds": seconds,
                   "spec": c}
            if ours:
                snap = engine_snapshot(llm)
                s = diff(snap, s0)
                row["draft_forwards"] = s["draft_forwards"]
                row["backoff_steps"] = s["backoff_steps"]
                row["shortened_steps"] = s.get("shortened_steps", 0)  # drafts the back-off cut
                for k in ("target_forwards", "suffix_accepted", "suffix_skipped"):
                    row[k] = s[k]
                row["ouroboros_tokens_per_target_forward"] = (
                    (s["accepted_tokens"] + s["target_forwards"]) / max(s["target_forwards"], 1))
                # The same steps with suffix 0 only (what chain verification would have taken).
                row["chain_tokens_per_target_forward"] = (
                    (s["accepted_tokens"] - s["tree_gain"] + s["target_forwards"])
                    / max(s["target_forwards"], 1))
                row["settings"] = snap["settings"]  # what "auto" resolved to
                # Sentence-draft length per round, and what stopped adaptive drafts.
                for k in ("draft_rounds", "sentence_draft_tokens", "stops_rule", "stops_cap"):
                    row[k] = s.get(k, 0)
            rows.append(row)
            progress.update(1)
    finally:
        del llm
        gc.collect()
    return rows


def target_curve(target: Path, reps: int = 3) -> dict[int, float]:
    """t_target(n): seconds of one target step over n new tokens of one request, measured in vLLM
    as a one-token generation from an n-token prompt (prefix caching off), engine overhead
    included, the same way for every n."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), dtype="float32", max_model_len=2048, enforce_eager=True,
              seed=0, max_num_seqs=1, enable_prefix_caching=False)
    curve = {}
    try:
        one = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([{"prompt_token_ids": [100] * 8}], one, use_tqdm=False)
        for n in CURVE_POINTS:
            ts = []
            for r in range(reps):
                ids = [3 + (7 * i + r) % 250 for i in range(n)]  # valid in any vocabulary here
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
                ts.append(time.perf_counter() - t0)
            curve[n] = statistics.median(ts)
    finally:
        del llm
        gc.collect()
    return curve


def draft_curve(draft: Path, prefix: int = 128, reps: int = 3) -> dict[int, float]:
    """t_draft(n): one forward of our draft runtime over n new tokens after a cached prefix, with
    the products the proposer uses by default on CPU (oneDNN from 4 rows, patches/cpu_gemm.py)."""
    import torch

    from vllm_ouroboros.draft.model import DraftModel
    from vllm_ouroboros.patches.cpu_gemm import onednn_gemm_factory

    model = DraftModel.from_pretrained(str(draft), dtype=torch.float32, device="cpu")
    factory = onednn_gemm_factory()
    if factory is not None:
        model.use_gemm(factory)
    model.allocate_cache(1, prefix + max(CURVE_POINTS) + 8)
    curve = {}
    for n in CURVE_POINTS:
        ids = torch.randint(3, 250, (1, n))
        pos = torch.arange(prefix, prefix + n)[None]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            model.greedy_tokens(model.forward(ids, pos, torch.tensor([0]), torch.tensor([prefix]),
                                              mask, max_cache_len=prefix))
            ts.append(time.perf_counter() - t0)
        curve[n] = statistics.median(ts[1:])
    return curve


def interp(curve: dict[int, float], n: float) -> float:
    xs = sorted(curve)
    n = min(max(n, xs[0]), xs[-1])
    for a, b in zip(xs, xs[1:]):
        if a <= n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[xs[-1]]


def derive(rows, base_rows, ocfg_tokens, t_curve, d_curve) -> None:
    """Ratios, acceptance, modeled speedups; marks rows whose output differs from no speculation
    (identical: True / False; None where no comparison holds: no baseline, or a sampled cell of
    one of vLLM's own methods)."""
    base = {(r["workload"], r["concurrency"], r["temperature"]): r for r in base_rows}
    flat_t, flat_d = {1: t_curve[1], 128: t_curve[1]}, {1: d_curve[1], 128: d_curve[1]}
    for r in rows:
        b = base.get((r["workload"], r["concurrency"], r["temperature"]))
        r["tok_s"] = r["tokens"] / r["seconds"]
        comparable = b is not None and (r["temperature"] == 0 or r["method"].startswith("ouroboros"))
        r["identical"] = r["outputs"] == b["outputs"] if comparable else None
        r["speedup"] = r["tok_s"] / b["tok_s"] if b else None
        c = r["spec"]
        drafts = c.get("num_drafts", 0)
        if r["method"] == "no-spec" or not drafts:
            r.update(tokens_per_target_forward=1.0, acceptance=None, per_pos=[],
                     draft_forwards_per_token=0.0, modeled=1.0, modeled_flat=1.0)
            continue
        r["tokens_per_target_forward"] = (c["num_accepted_tokens"] + drafts) / drafts
        r["acceptance"] = c["num_accepted_tokens"] / max(c["num_draft_tokens"], 1)
        r["per_pos"] = [a / drafts for a in c["per_pos"]]
        n_target = 1 + c["num_draft_tokens"] / drafts
        if "draft_forwards" in r:
            f_draft, n_draft = r["draft_forwards"], ocfg_tokens(r)
        elif r["method"].startswith("draft_model"):
            k = int(r["method"].split("-k")[-1])
            f_draft, n_draft = k * drafts, 1
        else:  # ngram: no model forward
            f_draft, n_draft = 0, 1
        r["draft_forwards_per_token"] = f_draft / max(r["tokens"], 1)
        # Steps that carried no draft (back-off, or nothing to propose) cost a plain decode step.
        plain = max(r["tokens"] - drafts - c["num_accepted_tokens"], 0)
        for key, tc, dc in (("modeled", t_curve, d_curve), ("modeled_flat", flat_t, flat_d)):
            per_tok = (f_draft * interp(dc, n_draft) + drafts * interp(tc, n_target)
                       + plain * tc[1]) / max(r["tokens"], 1)
            # Per request: drafts counts request-steps, so this is the single-request latency model.
            r[key] = tc[1] / per_tok


def markdown(rows, t_curve, d_curve, header: str) -> str:
    lines = [header, "", "| method | workload | conc | temp | identical | tok/s | x no-spec | tok/target fwd "
             "| accept | draft fwd/tok | modeled (measured t(n)) | modeled (flat t(n)) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
    for r in rows:
        ident = {True: "yes", False: "NO", None: "n/a"}[r["identical"]]
        speed = (f(r["tok_s"]), f(r["speedup"])) if r["identical"] is not False else ("differs", "-")
        lines.append(f"| {r['method']} | {r['workload']} | {r['concurrency']} | {r['temperature']} | {ident} "
                     f"| {speed[0]} | {speed[1]} | {f(r['tokens_per_target_forward'])} | {f(r['acceptance'])} "
                     f"| {f(r['draft_forwards_per_token'])} | {f(r['modeled'])} | {f(r['modeled_flat'])} |")
    lines += adaptive_table(rows)
    lines += ["", "Per-forward time (ms) by tokens per request n:", "",
              "| n | " + " | ".join(map(str, t_curve)) + " |", "|---|" + "---|" * len(t_curve),
              "| t_target | " + " | ".join(f"{1000 * v:.0f}" for v in t_curve.values()) + " |",
              "| t_draft | " + " | ".join(f"{1000 * d_curve[n]:.0f}" for n in t_curve) + " |"]
    return "\n".join(lines) + "\n"


def adaptive_table(rows) -> list[str]:
    """Fixed vs adaptive draft length (SpecDec++), when this run measured them."""
    mine = [r for r in rows if r["method"].startswith(("ouroboros-fixed", "ouroboros-adaptive"))]
    fixed = next((r for r in mine if r["method"] == "ouroboros-fixed"), None)
    if not mine:
        return []
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["", "Draft length, fixed (gamma) vs adaptive (SpecDec++ head, threshold h), speculation "
             "pinned on, same run:", "",
             "| method | tok/s | x fixed | x no-spec | tok/target fwd | draft fwd/tok | mean draft len "
             "| stops rule / cap | modeled (flat t(n)) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in mine:
        rounds = max(r.get("draft_rounds", 0), 1)
        x_fixed = r["tok_s"] / fixed["tok_s"] if fixed else None
        stops = f"{r.get('stops_rule', 0)} / {r.get('stops_cap', 0)}" if "adaptive" in r["method"] else "-"
        lines.append(f"| {r['method']} | {f(r['tok_s'])} | {f(x_fixed)} | {f(r['speedup'])} "
                     f"| {f(r['tokens_per_target_forward'])} | {f(r['draft_forwards_per_token'])} "
                     f"| {f(r.get('sentence_draft_tokens', 0) / rounds)} | {stops} | {f(r['modeled_flat'])} |")
    return lines


def hardware_rule(rows, t_curve, d_curve, target: Path, draft: Path) -> str:
    """The per-hardware defaults rule of vllm_ouroboros/cost_model.py applied to the curves this
    run measured, and to flat (memory-bound, GPU-like) curves: the drafting mode, and the
    largest batch at which a step still speculates (back-off under load)."""
    from vllm_ouroboros import cost_model
    from vllm_ouroboros.config import OuroborosConfig

    cfg = OuroborosConfig(draft_model=str(draft))
    mk = lambda c: cost_model.CostCurve(tuple(c), tuple(c.values()))  # noqa: E731
    flat = lambda c: cost_model.CostCurve(tuple(c), (c[1],) * len(c))  # noqa: E731
    la = 2 + (cfg.window_size + cfg.num_guesses) * cfg.phrase_len
    base = next((x for x in rows if x["method"] == "ouroboros" and x["concurrency"] == 1
                 and x["workload"] == "humaneval" and x["temperature"] == 0), None)
    E = base["ouroboros_tokens_per_target_forward"] if base else 4.0
    F = base["draft_forwards"] / max(base["spec"]["num_drafts"], 1) if base else float(cfg.gamma)
    # The engine's own time per step, as that run's proposer measured it (0 where unknown).
    # In ms, as the curves are.
    c = (base.get("settings") or {}).get("step_overhead_ms", 0.0) if base else 0.0
    s = cfg.spec_tokens()
    # Suffix tokens accepted per step where the suffix went at every step (the K = 1 row).
    k1 = next((x for x in rows if x["method"] == "ouroboros-k1"), None)
    a = k1["suffix_accepted"] / max(k1["target_forwards"], 1) if k1 else 0.5 * cfg.phrase_len
    lines = ["", "Per-hardware defaults (vllm_ouroboros/cost_model.py) under each pair of curves:", "",
             "| curves | drafting mode (modeled ms per output token: " + " / ".join(m.name for m in cost_model.MODES) + ", %d-token "
             "phrase forward) | largest batch whose requests all speculate, whole drafts / drafts cut "
             "to the tokens shown (E=%.2f, F=%.2f, s=%d, step overhead c=%.0f ms) | one request sends its "
             "suffix (%d tokens, a=%.2f accepted per step) |" % (la, E, F, s, c, cfg.phrase_len, a),
             "|---|---|---|---|"]
    # Rounds as each class runs them: the host loop here (a draft cut below gamma is a chain),
    # fixed-shape graph rounds on a GPU (a cut saves target tokens only).
    for name, tc, dc, chain_below in (("measured (this machine)", mk(t_curve), mk(d_curve), cfg.gamma),
                                      ("flat (memory-bound)", flat(t_curve), flat(d_curve), None)):
        costs = cost_model.drafting_mode_costs(dc, tc, cfg.window_size, cfg.num_guesses, cfg.phrase_len,
                                               1 + cfg.gamma + cfg.phrase_len)
        mode = cost_model.choose_drafting_mode(costs)
        n_d = mode.row_tokens(cfg.window_size, cfg.num_guesses, cfg.phrase_len)
        A = cost_model.geometric_survival(E, s)
        plans = {b: cost_model.speculation_plan(tc, dc, np.repeat(A, b, 0), np.ones((b, s)), np.full(b, F),
                                                n_d, c, chain_below, cost_model.draft_row_tokens(0, 0, cfg.phrase_len))
                 for b in range(1, 257)}
        whole = max([b for b, p in plans.items() if p.rows.all() and p.max_tokens == s], default=0)
        cut = [(b, p.max_tokens) for b, p in plans.items() if p.rows.all() and p.max_tokens < s]
        b_max = f"{whole if whole < 256 else '>= 256'} / " + (
            f"{max(b for b, _ in cut)} ({min(t for _, t in cut)}-{max(t for _, t in cut)} tokens)" if cut else "-")
        n = 1 + cfg.gamma  # the step's target tokens without the suffix
        sfx = cost_model.rows_sending_suffixes(tc, n, np.array([cfg.phrase_len]), E - a, np.array([a]),
                                               F * dc(n_d) + c)[0]
        per_token = " / ".join(f"{1000 * costs[m.name]:.0f}" for m in cost_model.MODES)
        lines.append(f"| {name} | {mode.name} ({per_token}) | "
                     f"{b_max} | {'yes' if sfx else 'no'} |")
    return "\n".join(lines) + "\n"


def plots(rows, out_prefix: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)")
        return []
    made = []
    main = [r for r in rows if r["identical"] and r["method"] != "no-spec"]
    if main:
        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [f"{r['method']}\n{r['workload']} c{r['concurrency']}" for r in main]
        ax.bar(range(len(main)), [r["speedup"] for r in main])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(main)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("tokens/s vs no speculation")
        fig.tight_layout()
        made.append(out_prefix.with_name(out_prefix.name + "_speedup.png"))
        fig.savefig(made[-1], dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["per_pos"] and r["workload"] == "humaneval" and r["concurrency"] == 1 and r["temperature"] == 0:
            ax.plot(range(1, len(r["per_pos"]) + 1), r["per_pos"], marker="o", label=r["method"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.legend(fontsize=6)
    fig.tight_layout()
    made.append(out_prefix.with_name(out_prefix.name + "_acceptance.png"))
    fig.savefig(made[-1], dpi=120)
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--methods", default=None, help="comma-separated subset (no-spec is always run)")
    ap.add_argument("--quick", action="store_true", help="two cells for the main methods; ablations only where --methods names them (one cell each)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "benchmark")
    ap.add_argument("--humaneval-offset", type=int, default=0,
                    help="HumanEval tasks from this one on (100: past the acceptance head's training tasks)")
    ap.add_argument("--prompts-at-one", type=int, default=PROMPTS_AT_ONE,
                    help="prompts per concurrency-1 cell (the full table's default fits the hour)")
    ap.add_argument("--acceptance-head", type=Path, default=None,
                    help="head for the adaptive-length rows (default models/acceptance_head.safetensors, "
                         "written by scripts/train_acceptance_head.py)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    # Engines here hold at most 16 short requests (~0.4 GiB of KV). With the 4 GiB scripts/env.sh
    # reserves, beside the target, the draft and their prepacked copies, the worker held 19 of
    # the machine's 23 GiB at eca2a3f, with the kernel reclaiming pages.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
    from tqdm import tqdm
    from transformers import AutoTokenizer

    target = args.target or models_dir() / "qwen2.5-coder-1.5b-instruct"
    draft = args.draft or models_dir() / "qwen2.5-coder-0.5b-instruct"
    head = args.acceptance_head or models_dir() / "acceptance_head.safetensors"
    all_methods = methods(draft, head)
    names = [n for n in all_methods if n not in EXTRA] if not args.methods else ["no-spec"] + [
        m for m in args.methods.split(",") if m != "no-spec"]
    unknown = [n for n in names if n not in all_methods]
    if unknown:
        sys.exit(f"unknown --methods {unknown}; known: {', '.join(all_methods)}")
    if any(n.startswith("ouroboros-adaptive") for n in names) and not head.is_file():
        sys.exit(f"{head} missing: train it first (python scripts/train_acceptance_head.py) or pass "
                 "--acceptance-head")
    if args.quick and not args.methods:  # ablations named in --methods still run (one cell each)
        names = [n for n in names if n not in ABLATIONS]
    plan = cells(args.quick)
    workloads = {"humaneval": humaneval_prompts(args.humaneval_offset + 16)[args.humaneval_offset:], "mtbench": mtbench_prompts(16, AutoTokenizer.from_pretrained(target))}
    command = "python " + " ".join(sys.argv)
    import subprocess

    rev = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip() or "unknown"
    header = (f"Command: `{command}` at commit {rev}\n\nTarget {target.name}, draft {draft.name}, {args.max_tokens} tokens per "
              f"request, float32, greedy unless temp > 0. Cells per method: main methods {plan}; ablations "
              f"(humaneval, 1, 0.0). KV cache 2 GiB per engine. Prompt counts: {args.prompts_at_one} at concurrency 1, else = concurrency (reduced to fit "
              f"one hour on 2 CPU cores). Defaults send K = 1 suffix where its measured acceptance pays for "
              f"its target tokens; the K = 1 and K = 3 rows send them at every step (K = 3: a token tree).")
    print(header.replace("\n\n", "\n"), flush=True)
    one_cell_only = all(n in ONE_CELL for n in names if n != "no-spec")  # no-spec: their baseline only
    plans = {n: [("humaneval", 1, 0.0)] if n in ONE_CELL or one_cell_only else plan for n in names}
    rows = []
    with tqdm(total=sum(map(len, plans.values())), desc="cells") as progress:
        for name in names:
            cell_plan = plans[name]
            rows += run_method(name, all_methods[name], workloads, cell_plan, args.max_tokens,
                               target, 16, progress, args.prompts_at_one)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".raw.json").write_text(json.dumps(rows))  # in case a later step fails
    t_curve, d_curve = target_curve(target), draft_curve(draft)
    from vllm_ouroboros import cost_model

    def ocfg_tokens(row) -> float:
        st = row["settings"]  # the engine's resolved window and guesses
        return cost_model.draft_row_tokens(st["window_size"], st["num_guesses"], st["phrase_len"])

    derive(rows, [r for r in rows if r["method"] == "no-spec"], ocfg_tokens, t_curve, d_curve)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, t_curve, d_curve, header) + hardware_rule(rows, t_curve, d_curve, target, draft)
    table += (f"\nWall time of this run (engines, cells and curves; the issue's limit is 60 min): "
              f"{(time.perf_counter() - t_start) / 60:.1f} min.\n")
    print(table)
    args.out.with_suffix(".md").write_text(table)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "t_target": t_curve, "t_draft": d_curve,
         "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}, indent=1))
    for p in plots(rows, args.out):
        print("plot:", p)
    return 0 if all(r["identical"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
