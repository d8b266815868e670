#!/usr/bin/env python
"""Train the SpecDec++ acceptance head for a draft/target pair (draft_length "adaptive").

Data (no vLLM: both models run through vllm_ouroboros/draft/model.py, which loads Llama/Qwen2 HF
directories):
  1. the target's greedy continuation (--gen-tokens) of each prompt (HumanEval tasks, MT-Bench
     questions through the chat template; no ShareGPT-style set is installed by setup);
  2. pass A, target context: the draft reads prompt + continuation in one causal forward; at each
     continuation position its greedy token is labelled accepted iff it equals the target's
     greedy token there (greedy: min(1, p/q) with one-hot q is that indicator);
  3. pass B, mixed context (SpecDec++): each continuation token is replaced, with probability
     --mix, by the draft's own token at that place (pass A's), BERT-style; one target forward and
     one draft forward over the mixed sequence give the labels and features again.
  Features: the draft's final-normed last hidden state at the position whose output is the token.
Training: weighted BCE (rejections weighted --w-rej, the paper's 1/3/6/12), Adam, full batch,
stopped early at the epoch with the best unweighted log-loss on a calibration split of prompts
(--calib); the logit is then Platt-scaled on that split (a * logit + b, folded into the output
layer), which both undoes the weighting's shift of the optimal logit and the head's
over-confidence, so the probabilities the stopping rule multiplies are calibrated. Prompts are
split three ways: train, calibration (early stop, Platt, the threshold h) and held out (AUC,
calibration per bin and ECE, the simulated policies: nothing of the head was fitted on them).
h is picked on the calibration split's target-context positions by simulating the stopping rule
against fixed lengths, under a cost model t_round = t_target + n_draft * --draft-cost * t_target.

The collected features are cached (--data-cache, keyed by the models and the data flags), so a
refit with other training flags takes seconds instead of the collection's CPU minutes.

Writes the head (safetensors, with the draft's identity) and a JSON of the metrics.
  python scripts/train_acceptance_head.py            # real pair under models/, ~CPU minutes
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Where scripts/setup.sh put the models (--models-dir there), as the other scripts read it.
MODELS = Path(os.environ.get("OUROBOROS_MODELS_DIR") or REPO / "models")

from vllm_ouroboros.draft.acceptance_head import (  # noqa: E402
    AcceptanceHead, HeadParams, draft_identity, draft_weights_fingerprint)
from vllm_ouroboros.draft.model import DraftModel  # noqa: E402


def load_prompts(models: Path, n_humaneval: int, n_mtbench: int, tokenizer) -> list[tuple[str, str]]:
    """[(source, text)]: HumanEval prompts as raw code (as scripts/benchmark.py sends them) and
    MT-Bench first turns through the chat template."""
    out = []
    he = models / "data" / "HumanEval.jsonl.gz"
    if n_humaneval:
        with gzip.open(he, "rt") as f:
            out += [("humaneval", json.loads(line)["prompt"]) for line in f][:n_humaneval]
    mt = models / "data" / "mt_bench_questions.jsonl"
    if n_mtbench and mt.exists():
        qs = [json.loads(line)["turns"][0] for line in mt.read_text().splitlines() if line.strip()]
        for q in qs[:n_mtbench]:
            text = (tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True)
                    if getattr(tokenizer, "chat_template", None) else q)
            out.append(("mtbench", text))
    return out


def causal_forward(model: DraftModel, ids: list[int]) -> torch.Tensor:
    """Hidden states [n, H] of one sequence from scratch (slot 0)."""
    n = len(ids)
    if model.max_len < n or model.num_slots < 1:
        model.allocate_cache(max(model.num_slots, 1), max(n, model.max_len))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    return model.forward(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([0]),
                         torch.tensor([0]), mask, max_cache_len=0)[0]


def greedy_generate(model: DraftModel, prompts: list[list[int]], n_new: int, batch: int,
                    eos: set[int], bar) -> list[list[int]]:
    """Target greedy continuations (n_new tokens, cut after an EOS), batched decode per group."""
    outs = []
    for g in range(0, len(prompts), batch):
        group = prompts[g:g + batch]
        B = len(group)
        model.allocate_cache(B, max(len(p) for p in group) + n_new + 1)
        nxt = torch.zeros(B, dtype=torch.long)
        for b, p in enumerate(group):  # prefill each prompt in its slot
            n = len(p)
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
            h = model.forward(torch.tensor([p]), torch.arange(n)[None], torch.tensor([b]),
                              torch.tensor([0]), mask, max_cache_len=0)
            nxt[b] = model.greedy_tokens(h[0, -1])
        lens = torch.tensor([len(p) for p in group])
        gen = [[int(nxt[b])] for b in range(B)]
        slots = torch.arange(B)
        one = torch.ones(B, 1, 1, dtype=torch.bool)
        for _ in range(n_new - 1):
            h = model.forward(nxt[:, None], lens[:, None], slots, lens, one, max_cache_len=int(lens.max()))
            lens = lens + 1
            nxt = model.greedy_tokens(h[:, 0])
            for b in range(B):
                gen[b].append(int(nxt[b]))
            bar.update(B)
        for b in range(B):
            cut = next((i + 1 for i, t in enumerate(gen[b]) if t in eos), len(gen[b]))
            outs.append(gen[b][:cut])
        bar.update(B)
    return outs


# Bumped when collect()'s features or labels change: a cache of another version is not read.
COLLECT_VERSION = 2  # 2: the draft fitted to the target's vocabulary (load_model's fit_to)


def load_model(path: str, fit_to: int | None = None) -> DraftModel:
    """float32 on the CPU, its products through vLLM's prepacked oneDNN GEMM where this vLLM
    build has it (as the proposer runs the draft: patches/cpu_gemm.py), else torch's F.linear.
    fit_to: the target's vocabulary size, for a draft whose embedding has another number of
    rows (DraftModel.fit_vocab, as the proposer fits it: the labels then are serving's)."""
    model = DraftModel.from_pretrained(path, torch.float32, "cpu")
    if fit_to is not None:
        model.fit_vocab(fit_to)
    try:
        from vllm_ouroboros.patches.cpu_gemm import onednn_gemm_factory
    except ImportError:  # no vLLM in this environment
        return model
    factory = onednn_gemm_factory()
    if factory is not None:
        model.use_gemm(factory)
    return model


def collect(draft: DraftModel, target: DraftModel, prompts: list[list[int]], gens: list[list[int]],
            mix: float, rng: np.random.Generator, bar) -> list[dict]:
    """Per prompt: features/labels of pass A (target context) and pass B (mixed context)."""
    data = []
    for p, g in zip(prompts, gens):
        P, T = len(p), len(g)
        if T < 2:
            bar.update(1)
            continue
        seq = p + g
        hA = causal_forward(draft, seq)[P - 1:P + T - 1]  # outputs predict g[0..T-1]
        dA = draft.greedy_tokens(hA)
        yA = (dA == torch.tensor(g)).numpy()
        swap = rng.random(T) < mix
        gm = np.where(swap, dA.numpy(), np.array(g))
        mixed = p + gm.tolist()
        tB = target.greedy_tokens(causal_forward(target, mixed)[P - 1:P + T - 1])
        hB = causal_forward(draft, mixed)[P - 1:P + T - 1]
        yB = (draft.greedy_tokens(hB) == tB).numpy()
        data.append({"hA": hA.float().numpy(), "yA": yA, "hB": hB.float().numpy(), "yB": yB})
        bar.update(1)
    return data


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula (ties get mean ranks)."""
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    s = score[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos, neg = y.sum(), (1 - y).sum()
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2) / max(pos * neg, 1))


def calibration(p: np.ndarray, y: np.ndarray, bins: int = 10) -> tuple[list[dict], float]:
    """Per equal-width bin: count, mean predicted, observed acceptance; and the ECE."""
    rows, ece = [], 0.0
    idx = np.minimum((p * bins).astype(int), bins - 1)
    for b in range(bins):
        m = idx == b
        if m.sum() == 0:
            continue
        pred, obs = float(p[m].mean()), float(y[m].mean())
        rows.append({"bin": f"[{b / bins:.1f},{(b + 1) / bins:.1f})", "n": int(m.sum()),
                     "predicted": round(pred, 4), "observed": round(obs, 4)})
        ece += m.sum() / len(p) * abs(pred - obs)
    return rows, float(ece)


def simulate(seqs: list[tuple[np.ndarray, np.ndarray]], policy, cap: int, draft_cost: float) -> dict:
    """Rounds started at every position of each held-out target-context continuation.

    seqs: [(p_accept [T], accepted [T] bool)]. policy(p [n]) -> draft length for a round starting
    there (>= 1). A round gives min(accepted run, n) + 1 tokens for one target forward plus n
    draft forwards (cost draft_cost each, in target forwards)."""
    gain = cost = drafted = 0.0
    rounds = 0
    for p, y in seqs:
        T = len(p)
        for i in range(T):
            n = min(policy(p[i:i + cap]), T - i)
            run = int(np.argmin(np.append(y[i:i + n], False)))  # leading accepted tokens
            gain += run + 1
            cost += 1 + n * draft_cost
            drafted += n
            rounds += 1
    return {"tokens_per_target_forward": gain / rounds, "mean_draft_length": drafted / rounds,
            "tokens_per_cost": gain / cost}


GRID = [round(x, 2) for x in np.arange(0.1, 0.96, 0.05)]  # thresholds h tried


def platt(logit: torch.Tensor, y: torch.Tensor, iters: int = 200) -> tuple[float, float]:
    """(a, b) minimising the log-loss of sigmoid(a * logit + b) against y (Platt scaling).

    Shape: logit [N] float32, y [N] float32 in {0, 1}."""
    ab = torch.tensor([1.0, 0.0], requires_grad=True)
    opt = torch.optim.LBFGS([ab], lr=0.5, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ab[0] * logit + ab[1], y)
        loss.backward()
        return loss

    opt.step(closure)
    a, b = ab.detach().tolist()
    return a, b


def save_cache(path: str, key: str, data: list[dict]) -> None:
    """Features and labels of every prompt in one .npz (ragged rows by offsets), with the key."""
    arrays = {"key": np.array(key)}
    for k in ("hA", "yA", "hB", "yB"):
        arrays[k] = np.concatenate([d[k] for d in data])
    arrays["offsets"] = np.cumsum([0] + [len(d["yA"]) for d in data])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    Path(tmp).replace(path)


def load_cache(path: str, key: str) -> list[dict] | None:
    """The cached per-prompt data if the file exists and was collected with the same key."""
    if not Path(path).is_file():
        return None
    with np.load(path) as z:
        if str(z["key"]) != key:
            print(f"data cache {path} was collected with other flags: collecting again")
            return None
        off = z["offsets"]
        cols = {k: z[k] for k in ("hA", "yA", "hB", "yB")}
    return [{k: v[off[i]:off[i + 1]] for k, v in cols.items()} for i in range(len(off) - 1)]


def rule_length(h: float):
    def policy(p: np.ndarray) -> int:
        fire = np.nonzero(1 - np.cumprod(p) > h)[0]
        return int(fire[0]) + 1 if len(fire) else len(p)
    return policy


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(MODELS / "qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--target", default=str(MODELS / "qwen2.5-coder-1.5b-instruct"))
    ap.add_argument("--models-dir", default=str(MODELS), help="where data/ lies ($OUROBOROS_MODELS_DIR)")
    ap.add_argument("--humaneval", type=int, default=100, help="HumanEval tasks 0..N-1")
    ap.add_argument("--mtbench", type=int, default=30, help="MT-Bench first turns (chat set)")
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts keep their tail")
    ap.add_argument("--batch", type=int, default=16, help="target greedy decode batch")
    ap.add_argument("--mix", type=float, default=0.15, help="P(a context token is the draft's)")
    ap.add_argument("--w-rej", type=float, default=3.0, choices=[1.0, 3.0, 6.0, 12.0],
                    help="BCE weight of rejected tokens (SpecDec++'s values)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--holdout", type=float, default=0.25, help="fraction of prompts held out")
    ap.add_argument("--calib", type=float, default=0.15,
                    help="fraction of prompts for early stopping, Platt scaling and picking h")
    ap.add_argument("--cap", type=int, default=12, help="max_draft_length in the simulation")
    ap.add_argument("--draft-cost", type=float, default=0.35,
                    help="a draft forward's cost in target forwards, for picking h")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(MODELS / "acceptance_head.safetensors"))
    ap.add_argument("--data-cache", default=str(MODELS / "acceptance_head_data.npz"),
                    help="features cache ('' to disable)")
    ap.add_argument("--metrics", default=str(REPO / "results" / "acceptance_head.json"))
    return ap


def main() -> int:
    args = arg_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    prompts_txt = load_prompts(Path(args.models_dir), args.humaneval, args.mtbench, tok)
    sources = [s for s, _ in prompts_txt]
    print(f"prompts: {sources.count('humaneval')} HumanEval, {sources.count('mtbench')} MT-Bench "
          "(no ShareGPT-style chat set is installed by setup; MT-Bench stands in for chat)")
    prompts = [tok(t)["input_ids"][-args.max_prompt_tokens:] for _, t in prompts_txt]
    gen_cfg = Path(args.target) / "generation_config.json"
    eos_ids = json.loads(gen_cfg.read_text()).get("eos_token_id") if gen_cfg.exists() else None
    eos = {tok.eos_token_id, *(eos_ids if isinstance(eos_ids, list) else [eos_ids])}
    eos = {e for e in eos if e is not None}

    # The features depend on the prompts' source and both models, not only on their paths (a
    # draft replaced in place would otherwise reuse the old one's features under its identity).
    data_key = json.dumps({**{k: getattr(args, k) for k in (
        "draft", "target", "models_dir", "humaneval", "mtbench", "gen_tokens", "max_prompt_tokens",
        "mix", "seed")}, "collect": COLLECT_VERSION,
        "models": [(draft_identity(p), draft_weights_fingerprint(p)) for p in (args.draft, args.target)]},
        sort_keys=True, default=str)
    data = load_cache(args.data_cache, data_key) if args.data_cache else None
    t_gen = 0.0
    if data is not None:
        print(f"features: {len(data)} prompts from the cache {args.data_cache}")
    else:
        target = load_model(args.target)
        draft = load_model(args.draft, fit_to=target.cfg.vocab_size)
        n = len(prompts)
        with tqdm(total=n * args.gen_tokens, desc="target greedy", unit="tok") as bar:
            gens = greedy_generate(target, prompts, args.gen_tokens, args.batch, eos, bar)
        t_gen = time.time() - t0
        with tqdm(total=n, desc="draft/target passes", unit="prompt") as bar:
            data = collect(draft, target, prompts, gens, args.mix, rng, bar)
        del target, draft
        if args.data_cache:
            save_cache(args.data_cache, data_key, data)
    t_data = time.time() - t0

    # Three-way split by prompt: nothing reported as held out was used for fitting or picking.
    split = np.random.default_rng(args.seed + 1).permutation(len(data))
    n_hold = max(1, int(round(args.holdout * len(data))))
    n_cal = max(1, int(round(args.calib * len(data))))
    hold = [data[i] for i in split[:n_hold]]
    cal = [data[i] for i in split[n_hold:n_hold + n_cal]]
    train = [data[i] for i in split[n_hold + n_cal:]]

    def stack(part, keys=("hA", "hB")):
        x = np.concatenate([d[k] for d in part for k in keys])
        y = np.concatenate([d["y" + k[1]] for d in part for k in keys]).astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(y)

    X, Y = stack(train)
    Xc, Yc = stack(cal)
    print(f"train: {len(train)} prompts, {len(Y)} tokens, acceptance {Y.mean():.3f}; "
          f"calibration: {len(cal)} prompts, {len(Yc)} tokens; held out: {len(hold)} prompts")

    head = AcceptanceHead(HeadParams(hidden_size=X.shape[1], width=args.width, depth=args.depth))
    opt = torch.optim.Adam(head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    w = torch.where(Y > 0.5, 1.0, args.w_rej)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    shift = math.log(args.w_rej)  # the weighting moves the optimal logit by -log(w_rej)
    best = (float("inf"), 0, None)
    for epoch in tqdm(range(1, args.epochs + 1), desc="train head", unit="epoch"):
        opt.zero_grad()
        loss = bce(head.logit(X), Y, weight=w)
        loss.backward()
        opt.step()
        if epoch % 5 == 0 or epoch == args.epochs:
            with torch.no_grad():
                cal_loss = float(bce(head.logit(Xc) + shift, Yc))
            if cal_loss < best[0]:
                best = (cal_loss, epoch, {k: v.clone() for k, v in head.state_dict().items()})
    head.load_state_dict(best[2])
    head.requires_grad_(False)
    a, b = platt(head.logit(Xc).detach(), Yc)
    with torch.no_grad():  # sigmoid(a * logit + b), folded into the output layer
        head.out.weight.mul_(a)
        head.out.bias.mul_(a).add_(b)
    print(f"early stop at epoch {best[1]} of {args.epochs} (calibration log-loss {best[0]:.4f}); "
          f"Platt scaling a = {a:.3f}, b = {b:.3f}")

    def predict(h):
        with torch.no_grad():
            return head(torch.as_tensor(h)).numpy()

    Xh, Yh = stack(hold)
    ph = predict(Xh)
    Yh = Yh.numpy().astype(np.int64)
    held_auc = auc(ph, Yh)
    bins, ece = calibration(ph, Yh)
    train_auc = auc(predict(X), Y.numpy().astype(np.int64))
    cal_auc = auc(predict(Xc), Yc.numpy().astype(np.int64))

    def policies(part):
        seqs = [(predict(d["hA"]), d["yA"].astype(bool)) for d in part]
        fixed = {g: simulate(seqs, lambda p, g=g: g, args.cap, args.draft_cost) for g in range(1, 9)}
        adaptive = {h: simulate(seqs, rule_length(h), args.cap, args.draft_cost) for h in GRID}
        return fixed, adaptive

    _, adaptive_cal = policies(cal)
    best_h = max(adaptive_cal, key=lambda h: adaptive_cal[h]["tokens_per_cost"])
    fixed, adaptive = policies(hold)
    best_g = max(fixed, key=lambda g: fixed[g]["tokens_per_cost"])

    print(f"held-out AUC {held_auc:.4f} (train {train_auc:.4f}, calibration {cal_auc:.4f}), "
          f"ECE {ece:.4f}")
    print("calibration (held out):  bin         n   predicted  observed")
    for r in bins:
        print(f"  {r['bin']:>12} {r['n']:>6}   {r['predicted']:.3f}      {r['observed']:.3f}")
    print(f"simulated on held out (cost: draft forward = {args.draft_cost} target forwards, "
          f"cap {args.cap}):")
    print(f"  best fixed gamma={best_g}: {fixed[best_g]}")
    print(f"  fixed gamma=4:        {fixed[4]}")
    for h in sorted({0.3, 0.5, 0.7, 0.9, best_h}):
        if h in adaptive:
            print(f"  adaptive h={h}: {adaptive[h]}")
    print(f"picked h = {best_h} (on the calibration split)")

    ident = draft_identity(args.draft)
    head.save(args.out, ident, best_h, extra={"held_out_auc": held_auc, "ece": ece, "w_rej": args.w_rej},
              draft_weights=draft_weights_fingerprint(args.draft))
    metrics = {
        "command": "python " + " ".join([sys.argv[0].replace(str(REPO) + "/", "")] + sys.argv[1:]),
        "draft": args.draft, "target": args.target, "draft_identity": ident,
        "head_file": args.out, "head_bytes": Path(args.out).stat().st_size,
        "prompts": {"humaneval": sources.count("humaneval"), "mtbench": sources.count("mtbench"),
                    "sharegpt": "none installed"},
        "args": vars(args),
        "train_tokens": int(len(Y)), "train_acceptance": float(Y.mean()),
        "calibration_prompts": len(cal), "calibration_tokens": int(len(Yc)),
        "held_out_prompts": len(hold), "held_out_tokens": int(len(Yh)),
        "held_out_acceptance": float(Yh.mean()),
        "held_out_auc": held_auc, "train_auc": train_auc, "calibration_auc": cal_auc,
        "ece": ece, "calibration": bins,
        "early_stop_epoch": best[1], "platt": {"a": a, "b": b},
        "threshold": best_h, "simulated_fixed": {str(k): v for k, v in fixed.items()},
        "simulated_adaptive": {str(k): v for k, v in adaptive.items()},
        "seconds": {"target_greedy": round(t_gen, 1), "data": round(t_data, 1),
                    "total": round(time.time() - t0, 1)},
        "data_from_cache": t_gen == 0.0,
        "torch_threads": torch.get_num_threads(),
    }
    Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
    Path(args.metrics).write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"head -> {args.out} ({metrics['head_bytes']} bytes), metrics -> {args.metrics}; "
          f"{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
