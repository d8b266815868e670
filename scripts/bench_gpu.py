"""The draft side on a GPU without vLLM: forward curves, drafting rounds, the tree-attention kernel,
and the speedup they model, checked against issue 15's targets.

    pip install --no-deps --no-build-isolation -e .      # once, on the lent GPU machine
    python scripts/bench_gpu.py                          # real pair's shapes, random weights, bf16
    python scripts/bench_gpu.py --tiny                   # tiny shapes, any machine (CPU: < 1 min)

Models: random-weight DraftModels in the Qwen2.5-Coder 0.5B (draft) and 1.5B (target) shapes
(PAIR below; weights drawn on the device, no checkpoint needed), or --draft DIR / --target DIR
(real weights where the directory has *.safetensors, else its config.json with random weights).
Timings are for shapes, not weights: acceptance comes from the CPU run's counters.

Sections (each one's failure is recorded and the others still run; the exit status is then 1):
  curves  t(n) of one forward of n new tokens over a cached prefix, draft (argmax of the last
          position) and target-shaped (argmax of every position, as verification reads them),
          eager and replayed from a CUDA graph.
  fusion_choice  (CUDA) what an engine's load keeps of the draft's optional fusions (RoPE inside
          the attention, norm_gemm), each timed on and off (draft/fusion_choice.py).
  rounds  DraftRuntime.run_round per round and per draft forward, decode-only and phrase
          drafting, draft_round = host / device / graph (graph-fixed: without the conditional
          nodes; graph+fused: through kernels/fused_ops.py, OuroborosConfig.draft_fused_ops;
          graph+fused+torch-pool: the pool inserting and looking up in torch, not through
          kernels/pool_insert.py and pool_lookup.py, which the others use on CUDA;
          graph+fused+torch-round: the round's work around each forward in torch;
          graph+fused+rope-apart: RoPE and the KV write in their own launch per layer, not
          inside the attention kernel's; graph+fused+norm-gemm: RMSNorm and SiLU*up inside the
          products, kernels/norm_gemm.py, OuroborosConfig.draft_norm_gemm; the last four at
          one request only).
  target step  our patches' work around each target forward, eagerly as vLLM runs it: the plan
          and token trees (target_step.py), the greedy walk (verify.py), the KV move of an
          accepted later suffix in every target layer (kv_relocate.py).
  kernel  the tree-attention kernel vs torch SDPA (scripts/bench_tree_attention.py's inputs);
          where it misses 1.25x, the tile entries of kernels/tree_attention.TILE_CANDIDATES
          timed at every configuration of the failing head dims (kernel tiles: the best entry
          per head dim is what to set in the kernel's table).
  profile where a round's time goes at one request (scripts/profile_round.py): the graph round
          as it serves on CUDA (graph+fused; W=G=4 and decode-only) by kernel name, its totals
          and the device's busy share; the eager W=G=4 device round by region of our code
          (device activities, device and host ms; through the fused kernels too on CUDA).
  prefill the draft's prefill of new prompts (1 x 300, 1 x 2000, 8 x 300 tokens), eager vs in
          64-token chunks replayed from CUDA graphs (draft/prefill_graph.py).
  inserts a step's pool insert (vllm_ouroboros/pool_writer.py) of 16, 64, 256 rows into a pool of
          the draft's vocabulary: eager vs replayed from a CUDA graph, in torch and (CUDA) through
          the pool's Triton kernels (kernels/pool_insert.py).
  modeled benchmark.py's modeled speedup over no speculation from these curves and the CPU
          runs' counters (results/phrases_40.json: phrase drafting over 40 prompts, first, so
          the acceptance line reads it; results/drafting_modes.json,
          results/device_round_counters.json, results/pool_mode.json: the pool mode, no draft
          forward; results/pool_branches.json: the pool mode as branches under the root and as
          a chain with the same K; results/mtbench_16_h200.json and mtbench_16.json: MT-Bench chat, ours as it
          decides under H200 curves and vLLM's draft_model k=3 / k=5 beside it).
What the issue's targets read comes first (curves, the rounds they name, the target step, the
kernel, the profile; then the other rounds, the inserts); --budget-s S skips what is left after S seconds,
with that reason. Then the issue's acceptance lines, PASS / FAIL only
where measured (a kernel table cut short can fail, not pass). Writes results/bench_gpu.json
(everything) and results/bench_gpu.md (--tiny: bench_gpu_tiny.*). No vLLM imports.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# vllm_ouroboros must be installed (`pip install --no-deps --no-build-isolation -e .`): its
# `kernels` subpackage is the repo's kernels/ folder only through setup.py's package_dir.
from vllm_ouroboros.draft.attention import ROPE_IN_MAX_HEAD_DIM
from vllm_ouroboros.draft.model import DraftConfig, DraftModel, rope_inv_freq
from vllm_ouroboros.cost_model import draft_row_tokens, round_forwards
from vllm_ouroboros.cuda_graph import capture_graph
from vllm_ouroboros.draft.device_round import DeviceRound, conditional_nodes_supported
from vllm_ouroboros.draft.fusion_choice import REPS as FUSION_REPS, choose_all
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
from vllm_ouroboros.host_copy import to_device
from vllm_ouroboros.pool import PhrasePool

REPO = Path(__file__).resolve().parents[1]

# HF config fields of the real pair (models/qwen2.5-coder-{0.5b,1.5b}-instruct/config.json, which
# do not travel to the GPU machine). rms_norm_eps is 1e-6 as float32 rounds it, as those files say.
_QWEN2 = dict(model_type="qwen2", hidden_act="silu", vocab_size=151936, rms_norm_eps=9.999999974752427e-07,
              rope_theta=1000000.0, use_sliding_window=False, tie_word_embeddings=False)
PAIR = {
    "draft": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, head_dim=64),
    "target": dict(_QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, head_dim=128),
}
# --tiny: the same code paths in seconds on a CPU.
_TINY = dict(model_type="qwen2", hidden_act="silu", vocab_size=512, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False)
TINY_PAIR = {
    "draft": dict(_TINY, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "target": dict(_TINY, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=16),
}


class Plan:
    """What one run measures: the full plan (GPU) or --tiny. Sizes in tokens, counts in calls."""

    def __init__(self, tiny: bool):
        self.tiny = tiny
        self.prefix = 64 if tiny else 300  # cached tokens before a timed forward / the contexts
        self.points = (1, 2, 4, 8, 16) if tiny else (1, 2, 4, 8, 16, 34, 64, 128)  # n at 1 request
        self.batch_points = ((2, 1), (2, 16)) if tiny else ((8, 1), (8, 34), (32, 1), (32, 34))  # (B, n)
        self.warmup, self.reps = (1, 5) if tiny else (10, 100)  # forward calls
        # A point's timed calls stop after this many seconds (at least MIN_REPS of them): an
        # eager forward of the real shapes costs ~25 ms on a GPU, a graph replay ~3 ms, and a
        # lent GPU's minutes are few (15 per task, the machine's start included).
        self.max_s = 10.0 if tiny else 0.4
        self.round_batches = (1, 2) if tiny else (1, 8, 32)
        self.warmup_rounds, self.timed_rounds = (1, 3) if tiny else (3, 10)
        self.profile_rounds = 2 if tiny else 3  # profiled after one more (within RoundRunner's sizing)

    def round_cases(self, modes: list[str]) -> list[tuple[str, int, str]]:
        """(setting, requests, mode) of the rounds section, most needed first (the issue's
        targets: the graph round at 1 and 32 requests, decode and W=G=4), so that a run cut
        short by its --budget-s still has those; then the wider windows at one request.
        ONE_REQUEST_MODES (what conditional nodes and the pool's kernels save) at one request only."""
        small = self.round_batches[0]
        order = self.target_groups() + [("phrases W=G=7", small), ("phrases W=G=15", small)]
        order += [(s, b) for b in self.round_batches for s in ROUND_SETTINGS if (s, b) not in order]
        return [(s, b, m) for s, b in order for m in modes
                if (m not in ONE_REQUEST_MODES or b == small) and (m != PADDED_STEPS or ROUND_SETTINGS[s][1] == 0)]

    def target_cases(self, cases: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
        """The rounds timed before the target step, the kernel table and the prefill: those of
        the target groups but the padded-steps comparison (two more graph-round captures ahead
        of the issue's other figures, at one request and at the most)."""
        return [c for c in cases if c[:2] in self.target_groups() and c[2] != PADDED_STEPS]

    def target_groups(self) -> list[tuple[str, int]]:
        """The (setting, requests) the issue's targets read: decode and W=G=4 at one request
        and at the most requests."""
        small, large = self.round_batches[0], self.round_batches[-1]
        return [("decode-only", small), ("phrases W=G=4", small), ("decode-only", large), ("phrases W=G=4", large)]


MIN_REPS = 5


# Budget seconds a head dim's split tuning needs left before the kernel table (kernel_section).
SPLIT_TUNING_MIN_S = 60


class Budget:
    """The run's time budget (--budget-s; None: unlimited): what is measured after it is spent
    is skipped with that reason, so a run on a lent GPU ends, with its files written, inside
    the device call's limit."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.t0 = time.perf_counter()

    def spent(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.t0 > self.seconds

    def left(self) -> float:
        """Seconds left (inf without a budget)."""
        return float("inf") if self.seconds is None else self.seconds - (time.perf_counter() - self.t0)

    def reason(self) -> str:
        return f"skipped: time budget spent (--budget-s {self.seconds:g})"


# Round modes timed at one request only: what the conditional nodes save (graph-fixed), what
# the pool's kernels save (TORCH_POOL: the fused graph round with the torch insert and lookup),
# and what the round's own kernels save (TORCH_ROUND: with its inputs and bookkeeping in torch,
# kernels/round_steps.py).
TORCH_POOL = "graph+fused+torch-pool"
TORCH_ROUND = "graph+fused+torch-round"
# ... and what RoPE inside the attention kernel saves (ROPE_APART: fused_ops.rope_qkv_write's own
# launch per layer, draft/attention.rope_masked_attention not used).
ROPE_APART = "graph+fused+rope-apart"
# ... and what RMSNorm and SiLU*up inside the products would save (NORM_GEMM: kernels/norm_gemm.py,
# OuroborosConfig.draft_norm_gemm, off by default until this says it pays).
NORM_GEMM = "graph+fused+norm-gemm"
# The graph round's replay emulated on a CPU, early exit included (DeviceRound(emulate_graphs=True)):
# what the cut-round section checks there of the rule a GPU's graph round is priced by.
GRAPH_EMULATED = "graph-emulated"
# ... and what one uncached column per forward after the first saves where there are no guesses
# (PADDED_STEPS: L + 1 of them, DeviceRound(padded_steps=True); decode-only rounds only, where it
# differs, at every batch: there the padding is 4 of every 5 tokens a later forward computes).
PADDED_STEPS = "graph+fused+padded-steps"
ONE_REQUEST_MODES = ("graph-fixed", TORCH_POOL, TORCH_ROUND, ROPE_APART, NORM_GEMM)

# Round settings: name -> (window W, guesses G); gamma 4, beta 5 (OuroborosConfig's defaults).
GAMMA, BETA = 4, 5
# W=G=7: on the CPU runs' counters with GPU-shaped curves it drafts 3% more per target forward
# than W=G=4 (results/gpu_curves_window.json); whether its longer rows cost less than that on a
# GPU is what its rounds here say.
ROUND_SETTINGS = {"decode-only": (0, 0), "phrases W=G=4": (4, 4), "phrases W=G=7": (7, 7),
                  "phrases W=G=15": (15, 15)}
POOL_BUDGET = 64 << 20  # OuroborosConfig.pool_budget_mb
POOL_FILL_ROWS = {False: 8, True: 4}  # pool-filled requests beside the model's one (by Plan.tiny)


def row_tokens(window: int, guesses: int) -> int:
    """Tokens per row of a lookahead forward (cost_model.draft_row_tokens) at this beta."""
    return draft_row_tokens(window, guesses, BETA - 1)


# ---- models ----------------------------------------------------------------------------------

def random_model(cfg: DraftConfig, dtype: torch.dtype, device: torch.device, seed: int,
                 std: float = 0.02) -> DraftModel:
    """A DraftModel built on the meta device and materialised on `device` in `dtype`: weights
    ~ N(0, std), RMSNorm gains 1 (so activations stay in range). No float32 copy ever exists."""
    with torch.device("meta"):
        model = DraftModel(cfg).to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1].endswith("norm") or name == "norm_weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    model.requires_grad_(False)
    model.inv_freq = rope_inv_freq(cfg, device)
    return model


def load_model(role: str, source: Path | None, tiny: bool, dtype: torch.dtype,
               device: torch.device) -> tuple[DraftModel, dict]:
    """The `role` ("draft" / "target") model and a description of where it came from."""
    if source is not None and any(source.glob("*.safetensors")):
        model = DraftModel.from_pretrained(str(source), dtype=dtype, device=device)
        return model, {"source": str(source), "weights": "checkpoint", **_shape(model.cfg)}
    if source is not None:
        hf = json.loads((source / "config.json").read_text())
        where = f"{source}/config.json"
    else:
        hf, where = (TINY_PAIR if tiny else PAIR)[role], "tiny table" if tiny else "table (real pair)"
    cfg = DraftConfig.from_hf(hf)
    model = random_model(cfg, dtype, device, seed=0 if role == "draft" else 1)
    return model, {"source": where, "weights": "random N(0, 0.02)", **_shape(cfg)}


def _shape(cfg: DraftConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("model_type", "hidden_size", "num_layers", "num_heads",
                                         "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                                         "tie_word_embeddings", "qkv_bias", "rope_theta", "rms_norm_eps")}


# ---- timing ----------------------------------------------------------------------------------

def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, reps: int,
               max_s: float | None = None) -> list[float]:
    """Milliseconds of each of up to `reps` calls of fn after `warmup` untimed ones; with max_s,
    the calls stop once they have taken that many seconds (MIN_REPS calls at least).

    CUDA: events around each call, started on an idle device (a synchronisation before each
    call), so a call's time is its latency, launch gaps included, not a queue's throughput; one
    more synchronisation at the end reads them all. CPU: perf_counter."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()

    def done(i: int) -> bool:
        return max_s is not None and i >= MIN_REPS and time.perf_counter() - t0 > max_s

    if device.type != "cuda":
        out = []
        for i in range(reps):
            if done(i):
                break
            t1 = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t1))
        return out
    events = []
    for i in range(reps):
        if done(i):
            break
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def cuda_graph(fn: Callable[[], object], pool) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph on its current (static) inputs; warmed up on a side stream
    first (cuBLAS handles, Triton compilation), as torch's capture rules require."""
    return capture_graph(lambda _: fn(), torch.device("cuda", torch.cuda.current_device()), pool, warmups=2)


def median(xs) -> float | None:
    return statistics.median(xs) if xs else None


# ---- a. forward curves -----------------------------------------------------------------------

def forward_fn(model: DraftModel, B: int, n: int, prefix: int, all_positions: bool,
               gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """One forward of n new tokens per row for B rows (slots 0..B-1, `prefix` cached tokens each,
    causal among the new ones) plus the LM head's argmax: of the last position (a draft forward)
    or of every position (a verifying target forward). Inputs are static tensors, so the
    returned call can be captured in a CUDA graph. Returns [B] or [B, n] int64."""
    dev = model.device
    ids = torch.randint(3, model.vocab_size, (B, n), generator=gen, device=dev)
    pos = (prefix + torch.arange(n, device=dev))[None].expand(B, n).contiguous()
    slots = torch.arange(B, device=dev)
    lens = torch.full((B,), prefix, dtype=torch.long, device=dev)
    mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None].expand(B, n, n).contiguous()

    def run() -> torch.Tensor:
        hidden = model.forward(ids, pos, slots, lens, mask, max_cache_len=prefix)  # [B, n, H]
        return model.greedy_tokens(hidden if all_positions else hidden[:, -1])
    return run


def kernel_check(model: DraftModel, plan: Plan, layout: str) -> dict:
    """The tree-attention kernel's check before serving, as the plugin runs it at load: on the
    draft's own cache (DraftModel.check_attention_kernel) or, for the target's shapes, on a cache
    laid out as vLLM's FlashAttention one (key | value per token, 16-token blocks; what
    patches/tree_attention.check_layer_kernel reads). Seconds: on a machine whose Triton cache is
    empty, the compilation of every launch configuration (a server's first start pays it once)."""
    from vllm_ouroboros.patches.tree_attention import check_layout_kernel

    t0 = time.perf_counter()
    if layout == "draft cache":
        model.allocate_cache(1, plan.prefix + 72)
        reason = model.check_attention_kernel()
        model.attention_backend = "auto"  # the sections below measure the kernel path regardless
    else:  # vLLM's FlashAttention blocks: [Hkv, 16, 2 D]
        D = model.head_dim
        reason = check_layout_kernel("FlashAttentionImpl", (model.num_kv_heads, 16, 2 * D),
                                     model.dtype, model.device, model.num_heads, D)
    out = {"layout": layout, "heads": f"{model.num_heads}/{model.num_kv_heads}",
           "head_dim": model.head_dim, "seconds": time.perf_counter() - t0, "passed": reason is None,
           "reason": reason}
    print(f"  {layout}: {'passed' if reason is None else 'FAILED: ' + reason} "
          f"({out['seconds']:.1f} s)", flush=True)
    return out


def forward_curve(model: DraftModel, plan: Plan, all_positions: bool, graphs: bool,
                  errors: dict, tag: str, budget: Budget, skipped: dict) -> list[dict]:
    """t(n) points [{batch, n, eager_ms, graph_ms}] (medians), 1 request over plan.points and the
    plan's (batch, n) points; graph_ms None where graphs are off or the capture failed; the
    points left when the budget is spent are skipped (recorded in `skipped`)."""
    dev = model.device
    shapes = [(1, n) for n in plan.points] + list(plan.batch_points)
    model.allocate_cache(max(b for b, _ in shapes), plan.prefix + max(n for _, n in shapes) + 8)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for B, n in shapes:
        if budget.spent():
            skipped[f"curves/{tag} B={B} n={n}"] = budget.reason()
            continue
        fn = forward_fn(model, B, n, plan.prefix, all_positions, gen)
        point = {"batch": B, "n": n}
        # The fused layer kernels (kernels/fused_ops.py) only where they compile: on CUDA.
        for fused in (False, True) if dev.type == "cuda" else (False,):
            key = "fused_" if fused else ""
            model.fused_ops = fused
            point[key + "eager_ms"] = median(time_calls(fn, dev, plan.warmup, plan.reps, plan.max_s))
            point[key + "graph_ms"] = None
            if graphs:
                try:
                    # Each capture in its own memory pool: a pool whose graphs were all freed
                    # (the `del` below) cannot take another capture (torch's allocator asserts).
                    graph = cuda_graph(fn, None)
                    point[key + "graph_ms"] = median(time_calls(graph.replay, dev, plan.warmup, plan.reps,
                                                                plan.max_s))
                    del graph
                except Exception:  # noqa: BLE001 - record it, time the rest (a GPU hour is scarce)
                    errors[f"curves/{tag}/{key}graph B={B} n={n}"] = traceback.format_exc()
        model.fused_ops = False
        out.append(point)
        fused = (f"  fused: eager {_ms(point.get('fused_eager_ms'))} graph {_ms(point.get('fused_graph_ms'))} ms"
                 if "fused_eager_ms" in point else "")
        print(f"  {tag:6} B={B:>2} n={n:>3}: eager {point['eager_ms']:8.3f} ms  graph "
              f"{_ms(point['graph_ms'])} ms{fused}", flush=True)
    return out


def _ms(v, p=3) -> str:
    return "-" if v is None else f"{v:.{p}f}"


# ---- a2. the fusions the engine would keep -----------------------------------------------------

def fusion_choice_section(model: DraftModel, plan: Plan, graphs: bool, reps: int = FUSION_REPS) -> dict:
    """What an engine's load keeps of the draft's optional fusions on this device
    (draft/fusion_choice.choose_all, as OuroborosProposer._choose_fusions calls it: the fused
    layers on, each fusion checked, then timed on and off at a decode forward and the W = G = 4
    lookahead width behind plan.prefix cached tokens; graph replays where graphs are timed)."""
    model.fused_ops = True
    model.rope_in_attention = model.head_dim <= ROPE_IN_MAX_HEAD_DIM
    norm_gemm_check = model.enable_norm_gemm()
    widths = [1, row_tokens(4, 4)]
    model.allocate_cache(2, plan.prefix + max(widths) + 16)
    attention_check = model.check_attention_kernel()
    timings = choose_all(model, widths, graphs, prefix=plan.prefix, reps=reps)
    out = {"graphs": graphs, "widths": widths, "prefix": plan.prefix, "norm_gemm_check": norm_gemm_check,
           "attention_check": attention_check,
           "timings": [{"name": t.name, "widths": list(t.widths), "on_ms": list(t.on_ms),
                        "off_ms": list(t.off_ms), "kept": t.kept} for t in timings]}
    print("[fusion_choice] " + ("; ".join(t.describe() for t in timings) or "nothing to time") + (
        f"; norm_gemm check: {norm_gemm_check}" if norm_gemm_check else "") + (
        f"; attention check: {attention_check}" if attention_check else ""), flush=True)
    return out


# ---- b. drafting rounds ----------------------------------------------------------------------

def token_table(contexts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token_ids [B, max len], rows [B], lens [B]) as run_round takes them (row b = request b)."""
    lens = np.array([len(c) for c in contexts], np.int64)
    tab = np.zeros((len(contexts), int(lens.max())), np.int64)
    for b, c in enumerate(contexts):
        tab[b, :len(c)] = c
    return tab, np.arange(len(contexts), dtype=np.int64), lens


class RoundRunner:
    """B requests of plan.prefix random tokens drafting with one (setting, mode), each round's
    whole draft accepted plus one random token (random weights accept nothing useful; the
    shapes are what is timed or profiled). `run()` drafts one round and advances the contexts."""

    def __init__(self, model: DraftModel, window: int, guesses: int, B: int, mode: str, plan: Plan,
                 seed: int):
        dev = model.device
        # graph-fixed: the graph round without its conditional nodes; X+fused: the X round
        # through the fused layer kernels (OuroborosConfig.draft_fused_ops); +torch-pool: the
        # pool inserts and looks up in torch where it would take its kernels (kernels/pool_*.py);
        # +torch-round: the work around each forward in torch (kernels/round_steps.py);
        # +rope-apart: RoPE and the KV write in their own launch (the kernel check's verdict
        # aside: like the kernel section, this times the paths regardless).
        emulated = mode == GRAPH_EMULATED
        draft_round = "device" if emulated else "graph" if mode.startswith("graph") else mode.split("+")[0]
        model.fused_ops = "+fused" in mode
        model.rope_in_attention = (not mode.endswith("+rope-apart")
                                   and model.head_dim <= ROPE_IN_MAX_HEAD_DIM)
        model.norm_gemm = mode.endswith("+norm-gemm")
        settings = DraftSettings(gamma=GAMMA, beta=BETA, window_size=max(window, 1), num_guesses=guesses,
                                 num_suffixes=1, use_lookahead=bool(window), use_guesses=bool(guesses),
                                 draft_round=draft_round, round_forwards=GAMMA,
                                 round_kernels="torch" if mode.endswith("+torch-round") else "auto")
        pool = PhrasePool(model.vocab_size, BETA - 1, max(window, 1), POOL_BUDGET, device=dev,
                          kernels="torch" if mode.endswith("+torch-pool") else "auto")
        rounds = plan.warmup_rounds + plan.timed_rounds
        growth = rounds * (GAMMA + BETA + 1)  # a round adds at most gamma - 1 + beta draft tokens + 1
        max_len = plan.prefix + growth + 64
        # A fresh paged cache, its pages shared by the B requests (as the proposer sizes it at load).
        model.allocate_cache(B + 1, max_len, num_tokens=B * max_len)
        self.rt = rt = DraftRuntime(model, pool, settings, B, max_len, dev)
        if mode == "graph-fixed":  # the graph round without conditional nodes: every F forward runs
            rt.device_round = DeviceRound(rt, graphs=True, early_exit=False)
        elif mode == PADDED_STEPS:
            rt.device_round = DeviceRound(rt, graphs=True, padded_steps=True)
        elif emulated:
            rt.device_round = DeviceRound(rt, graphs=True, emulate_graphs=True, early_exit=True)
        self.rng = rng = np.random.default_rng(seed)  # the same seed in every mode: the same contexts
        self.V = V = model.vocab_size
        self.contexts = [rng.integers(3, V, plan.prefix).tolist() for _ in range(B)]
        self.slots = np.arange(B, dtype=np.int64)
        # One round over the longest contexts the run reaches (these plus a random tail): the
        # runtime takes its cache pages now, not while timing (growing the page store reallocates
        # it and drops captured graphs). The next round rolls back to the contexts themselves.
        tail = rng.integers(3, V, (B, growth)).tolist()
        rt.run_round(self.slots, *token_table([c + t for c, t in zip(self.contexts, tail)]))
        self.captured = rt.device_round.capture([B]) if draft_round == "graph" or emulated else 0
        self.generation = rt.generation

    def run(self, max_tokens: int | None = None):
        """One round (the RoundOutput), its drafts cut to max_tokens (None: whole); the contexts
        then take its draft and one random token."""
        out = self.rt.run_round(self.slots, *token_table(self.contexts), max_tokens=max_tokens)
        for b in range(len(self.contexts)):
            self.contexts[b] += out.drafts[b, :out.draft_lens[b]].tolist() + [int(self.rng.integers(3, self.V))]
        return out


def time_rounds(model: DraftModel, window: int, guesses: int, B: int, mode: str, plan: Plan,
                seed: int) -> dict:
    """run_round timings of one (setting, batch, mode) (RoundRunner). Wall time per round: a
    round is host and device work ending in a device->host copy, so its latency is what the
    engine waits for."""
    runner = RoundRunner(model, window, guesses, B, mode, plan, seed)
    rt = runner.rt
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    res = {"window": window, "guesses": guesses,
           "row_tokens": row_tokens(window, guesses) if window or guesses else 2,
           "requests": B, "mode": mode, "captured_graphs": runner.captured, "round_ms": [], "forwards": [],
           "early_exit": rt.device_round is not None and rt.device_round.early_exit,
           # What the work around the forwards ran in: "auto" falls back to torch, with a
           # warning only, where the kernels' start-up check against torch fails; a round
           # timed under its mode's name must say so.
           "round_kernels": None if rt.device_round is None else rt.device_round.kernels,
           "round_kernel_reason": None if rt.device_round is None else rt.device_round.kernel_reason,
           "pool_inserts": rt.pool.insert_backend,
           "draft_tokens": [], "prefill_forwards": 0}
    for r in range(plan.warmup_rounds + plan.timed_rounds):
        sync()
        t0 = time.perf_counter()
        out = runner.run()
        sync()
        ms = 1000 * (time.perf_counter() - t0)
        if r >= plan.warmup_rounds:
            res["round_ms"].append(ms)
            res["forwards"].append(int(out.forwards))
            res["draft_tokens"].append(int(out.draft_lens.sum()))
            res["prefill_forwards"] += int(out.prefill_forwards)
    res["cache_regrown"] = rt.generation != runner.generation  # True: graphs were recaptured while timing
    res["draft_cache"] = rt.kv.stats()  # the paged store after the rounds: bytes, pages, in use
    res["ms_per_round"] = median(res["round_ms"])
    res["ms_per_forward"] = median([t / max(f, 1) for t, f in zip(res["round_ms"], res["forwards"])])
    return res


def round_section(model: DraftModel, plan: Plan, cases: list[tuple[str, int, str]], errors: dict,
                  budget: Budget, skipped: dict, out: list[dict]) -> list[dict]:
    """time_rounds of each (setting, requests, mode) case (Plan.round_cases), appended to `out`
    as they are measured (a checkpoint of a cut run keeps them); the cases left when the
    budget is spent are skipped."""
    seeds = {name: 100 * i for i, name in enumerate(ROUND_SETTINGS)}
    for name, B, mode in cases:
        if budget.spent():
            skipped[f"rounds/{name}/{B}/{mode}"] = budget.reason()
            continue
        window, guesses = ROUND_SETTINGS[name]
        try:
            res = time_rounds(model, window, guesses, B, mode, plan, seed=seeds[name] + B)
        except Exception:  # noqa: BLE001 - record it, time the rest
            errors[f"rounds/{name}/{B}/{mode}"] = traceback.format_exc()
            print(f"  {name:15} B={B:>2} {mode:11}: FAILED (see errors)", flush=True)
            continue
        finally:
            model.fused_ops = False
            gc.collect()
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
        res["setting"] = name
        out.append(res)
        fell = (f"  [round kernels fell back to torch: {res['round_kernel_reason']}]"
                if res["round_kernel_reason"] else "")
        print(f"  {name:15} B={B:>2} {mode:11}: {res['ms_per_round']:8.2f} ms/round "
              f"{res['ms_per_forward']:8.3f} ms/forward  forwards {res['forwards']}  "
              f"draft tokens {res['draft_tokens']}  (round {res['round_kernels']}, "
              f"pool inserts {res['pool_inserts']}){fell}", flush=True)
    return out


def prefill_cases(plan: Plan) -> list[tuple[int, int]]:
    """(requests, prompt tokens) of the prefill section: a new prompt, a long one, a batch."""
    return [(1, 100), (2, 150)] if plan.tiny else [(1, 300), (1, 2000), (8, 300)]


def prefill_section(model: DraftModel, plan: Plan, graphs: bool, budget: Budget, skipped: dict) -> list[dict]:
    """ms to prefill B new prompts of P tokens into the draft's cache (DraftRuntime.prefill, what
    a round runs before drafting for a new request), through the fused layers on CUDA: eagerly
    (forwards of up to prefill_chunk tokens) and, where `graphs`, in 64-token chunks replayed
    from CUDA graphs (draft/prefill_graph.py, the graph round's runtime)."""
    dev = model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model.fused_ops = dev.type == "cuda"
    model.rope_in_attention = model.head_dim <= ROPE_IN_MAX_HEAD_DIM
    model.norm_gemm = False
    out = []
    rng = np.random.default_rng(11)
    try:
        for B, P in prefill_cases(plan):
            point = {"requests": B, "prompt": P}
            for mode in ("eager", "graph") if graphs else ("eager",):
                if budget.spent():
                    skipped[f"prefill/{B}x{P}/{mode}"] = budget.reason()
                    continue
                settings = DraftSettings(gamma=GAMMA, beta=BETA, window_size=4, num_guesses=4, num_suffixes=1,
                                         draft_round="graph" if mode == "graph" else "device")
                pool = PhrasePool(model.vocab_size, BETA - 1, 4, POOL_BUDGET, device=dev)
                model.allocate_cache(B + 1, P + 256, num_tokens=B * (P + 256))
                rt = DraftRuntime(model, pool, settings, B, P + 128, dev)
                tab, rows, lens = token_table([rng.integers(3, model.vocab_size, P).tolist() for _ in range(B)])
                slots = np.arange(B, dtype=np.int64)

                def prefill():
                    rt.reset_slots(slots)
                    return rt.prefill(slots, tab, rows, lens)

                forwards, sizes = prefill()  # captures the graphs, takes the pages
                point[f"{mode}_forwards"] = forwards
                point[f"{mode}_ms"] = median(time_calls(prefill, dev, 1, max(plan.reps // 10, MIN_REPS), plan.max_s))
                sync()
                del rt, pool
                gc.collect()
            if graphs and point.get("graph_ms") and point.get("eager_ms"):
                point["graph_over_eager"] = point["graph_ms"] / point["eager_ms"]
            out.append(point)
            print(f"  prefill {B} x {P:>4} tokens: eager {_ms(point.get('eager_ms'))} ms "
                  f"({point.get('eager_forwards')} forwards)  graph {_ms(point.get('graph_ms'))} ms "
                  f"({point.get('graph_forwards', '-')} chunk forwards)", flush=True)
    finally:
        model.fused_ops = False
    return out


def insert_section(vocab: int, plan: Plan, device: torch.device, graphs: bool) -> list[dict]:
    """ms per PhrasePool.insert of n host rows (new phrases for random keys, as a step's context
    and inspiration inserts bring them), eager and through PoolWriter's graphs where `graphs`:
    on a GPU the eager torch insert is 159 small kernels launched from the host. In torch
    (eager_ms, graph_ms) and, on CUDA, through the pool's Triton kernels (kernels/pool_insert.py:
    kernel_eager_ms, kernel_graph_ms)."""
    from vllm_ouroboros.pool_writer import PoolWriter

    out = []
    rng = np.random.default_rng(0)
    forms = ("torch", "triton") if device.type == "cuda" else ("torch",)
    for n in (16, 64, 256):
        point = {"rows": n}
        for form in forms:
            for mode in ("eager", "graph") if graphs else ("eager",):
                pool = PhrasePool(vocab, BETA - 1, 4, POOL_BUDGET, device=device, kernels=form)
                writer = PoolWriter(pool, graphs=mode == "graph")
                writer.capture([n])
                batches = itertools.cycle([(rng.integers(0, vocab, n), rng.integers(0, vocab, (n, BETA - 1)),
                                            rng.integers(-1, 4, n)) for _ in range(8)])
                key = f"{mode}_ms" if form == "torch" else f"kernel_{mode}_ms"
                point[key] = median(time_calls(lambda: writer.insert(*next(batches)), device,
                                               plan.warmup, plan.reps, plan.max_s))
        out.append(point)
        kern = (f"; kernels eager {_ms(point.get('kernel_eager_ms'))} ms  graph {_ms(point.get('kernel_graph_ms'))} ms"
                if "triton" in forms else "")
        print(f"  insert {n:>4} rows: torch eager {point['eager_ms']:8.3f} ms  graph {_ms(point.get('graph_ms'))} ms"
              + kern, flush=True)
    return out


def pool_fill_section(model: DraftModel, plan: Plan, mode: str) -> dict:
    """ms per step of a pool-filled step: one request's W = G = 4 round (RoundRunner, `mode`)
    beside pool drafts for POOL_FILL_ROWS other requests (8 tokens, one suffix), the pool's
    lookups run after the round's read ("after": a second wait for the device, as the proposer
    ran them before) or queued ahead of the round ("queued": pool_draft.queue_pool_drafts, read
    after the round's own read). The two forms alternate round by round on one runner (double
    the rounds' count: its cache is sized for them)."""
    from vllm_ouroboros.pool_draft import draft_from_pool, queue_pool_drafts

    twice = copy.copy(plan)
    twice.timed_rounds = 2 * plan.timed_rounds
    runner = RoundRunner(model, 4, 4, 1, mode, twice, seed=31)
    pool, rng = runner.rt.pool, np.random.default_rng(31)
    rows = POOL_FILL_ROWS[plan.tiny]
    slots = np.arange(1, rows + 1, dtype=np.int64)  # pool owners beside the model's request (slot 0)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def after():
        runner.run()
        draft_from_pool(pool, rng.integers(3, runner.V, rows), slots, 8, 1)

    def queued():
        pending = queue_pool_drafts(pool, rng.integers(3, runner.V, rows), slots, 8, 1)
        runner.run()
        pending.output()

    times = {"after": [], "queued": []}
    for r in range(twice.warmup_rounds + twice.timed_rounds):
        name = ("after", "queued")[r % 2]
        sync()
        t0 = time.perf_counter()
        (after if name == "after" else queued)()
        ms = 1000 * (time.perf_counter() - t0)  # both forms end in host arrays: waited for
        if r >= twice.warmup_rounds:
            times[name].append(ms)
    res = {"mode": mode, "model_rows": 1, "pool_rows": rows, "after_ms": median(times["after"]),
           "queued_ms": median(times["queued"]), "rounds_each": {k: len(v) for k, v in times.items()}}
    res["queued_over_after"] = res["queued_ms"] / res["after_ms"]
    print(f"  pool fill ({mode}, 1 + {rows} rows): lookups after the round {res['after_ms']:.3f} ms/step, "
          f"queued ahead of it {res['queued_ms']:.3f} ms/step ({res['queued_over_after']:.2f}x)", flush=True)
    return res


def cut_round_section(model: DraftModel, plan: Plan, modes: list[str], budget: Budget, skipped: dict) -> list[dict]:
    """The back-off's shorter drafts timed against what its plans charge for them. A plan prices
    a round cut to s draft tokens as cost_model.round_forwards(F, s, chain_below, stop_below)
    forwards at a whole round's price per forward (speculation_plan; the pool fill's modeled
    load): a fixed-shape round min(F, s) (every forward gives a row a token at least), one that
    exits early (the graph round with conditional nodes) F s / gamma, the host loop a chain of
    s below gamma (narrower
    forwards: its measured share is below its forwards' share). Per mode, one request at
    W = G = 4: whole rounds and rounds cut to s = 1 .. gamma - 1 in turn; per s, ms per round
    and forwards (medians), the measured share of a whole round's ms and the modeled share
    f(s) / F. With random weights a phrase is never accepted, so a forward adds about one
    token: F is gamma, and an early-exit round cut to s should run s forwards; what a GPU
    answers is whether its time follows them (a conditional node not taken costs nothing)."""
    window, guesses = ROUND_SETTINGS["phrases W=G=4"]
    out = []
    for mode in modes:
        if budget.spent():
            skipped[f"cut_rounds/{mode}"] = budget.reason()
            continue
        cuts = copy.copy(plan)  # every s gets the plan's rounds: the runner's cache is sized for all
        cuts.timed_rounds = GAMMA * (plan.warmup_rounds + plan.timed_rounds) - plan.warmup_rounds
        runner = RoundRunner(model, window, guesses, 1, mode, cuts, seed=41)
        rt = runner.rt
        room = rt.s.draft_room
        order = [None] + list(range(1, room))  # None: whole
        sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        ms, fwd = {s: [] for s in order}, {s: [] for s in order}
        for r in range(len(order) * (plan.warmup_rounds + plan.timed_rounds)):
            s = order[r % len(order)]
            sync()
            t0 = time.perf_counter()
            o = runner.run(s)
            sync()
            if r >= len(order) * plan.warmup_rounds:
                ms[s].append(1000 * (time.perf_counter() - t0))
                fwd[s].append(int(o.forwards))
        whole_ms, F = median(ms[None]), median(fwd[None])
        res = {"mode": mode, "requests": 1, "window": window, "guesses": guesses, "whole_ms": whole_ms,
               "whole_forwards": F, "chain_below": rt.chain_below, "stop_below": rt.stop_below,
               "early_exit": rt.device_round is not None and rt.device_round.early_exit, "cuts": []}
        for s in order[1:]:
            f = float(round_forwards(F, s, rt.chain_below, rt.stop_below))
            res["cuts"].append({"s": s, "ms": median(ms[s]), "forwards": median(fwd[s]), "modeled_forwards": f,
                                "measured_share": median(ms[s]) / whole_ms, "modeled_share": f / F})
        out.append(res)
        print(f"  cut rounds ({mode}, 1 request, W=G=4): whole {whole_ms:.3f} ms, {F:g} forwards; " + "; ".join(
            f"s={c['s']} {c['ms']:.3f} ms, {c['forwards']:g} forwards (modeled {c['modeled_forwards']:g}), "
            f"share {c['measured_share']:.2f} (modeled {c['modeled_share']:.2f})" for c in res["cuts"]), flush=True)
        del runner, rt
        gc.collect()
    return out


def profile_section(model: DraftModel, plan: Plan, cases: list[tuple[str, str]], budget: Budget,
                    skipped: dict, out: dict) -> dict:
    """scripts/profile_round.py's view of rounds at one request, (setting, mode) each, into `out`
    by mode (W = G = 4) or "mode, setting": the eager device round by region ("device",
    "device+fused": through the fused kernels), the graph round's totals and its device time
    by kernel name ("graph+fused": what serves on CUDA)."""
    import profile_round

    for setting, mode in cases:
        key = mode if setting == "phrases W=G=4" else f"{mode}, {setting}"
        if budget.spent():
            skipped[f"profile/{key}"] = budget.reason()
            continue
        window, guesses = ROUND_SETTINGS[setting]
        try:
            runner = RoundRunner(model, window, guesses, 1, mode, plan, seed=0)
            p = profile_round.profile_rounds(runner.run, plan.profile_rounds, model.device,
                                             attribute=not mode.startswith("graph"))
        finally:
            model.fused_ops = False
        out[key] = p = {"setting": setting, "mode": mode, **p}
        for line in profile_round.report_lines(f"{mode} round, 1 request, {setting}", p):
            print(line, flush=True)
    return out


# ---- b3. the target side's step --------------------------------------------------------------

# (draft, suffixes, KV move): "serving" moves a winning suffix's KV as an engine would here (the
# kernel of kernels/kv_move.py where its start-up check passes, on CUDA), "torch" as before it;
# the last layout is the one the modeled speedups charge.
TARGET_STEP_LAYOUTS = {"chain: draft 8 + 1 suffix": (8, 1, "serving"),
                       "tree: draft 8 + 3 suffixes, KV moved in torch": (8, 3, "torch"),
                       "tree: draft 8 + 3 suffixes": (8, 3, "serving")}


def target_step_fn(B: int, n: int, K: int, L: int, vocab: int, layers: int, kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device: torch.device,
                   kv_move: str = "torch") -> Callable[[], object]:
    """One step of what our patches add to the target's step around its forward (eagerly, as
    vLLM runs them): plan the step and lay out the trees (target_step.plan_target_step), the
    argmax over the logits read back and walked greedily on the host (verify.py), and the move of an accepted suffix k >= 1's KV in
    every layer (kv_relocate.py). B requests of a draft of n tokens and K suffixes of L; the
    logits make every request accept its draft and its last suffix whole (with K >= 2 that
    suffix's KV moves, as when a later suffix wins)."""
    from vllm_ouroboros.kv_relocate import move_kv, relocation_slots
    from vllm_ouroboros.target_step import plan_target_step
    from vllm_ouroboros.verify import verify

    rng = np.random.default_rng(B * 100 + K)
    c = np.full(B, n + K * L, np.int64)
    rows = c + 1  # logit rows per request: the root and every node
    qs = np.concatenate([[0], np.cumsum(rows)])
    tokens = rng.integers(3, vocab, (B, n + K * L))
    # Row of the root, then of node i (draft 0..n-1, then suffix k's nodes): the target's
    # argmax there is the next token on the path draft -> suffix K-1.
    want = np.zeros((B, n + K * L + 1), np.int64)
    want[:, :n] = tokens[:, :n]  # after the root and after draft node i - 1
    last = n + (K - 1) * L
    want[:, n] = tokens[:, last]  # after the last draft node: suffix K-1's first token
    want[:, 1 + last:last + L] = tokens[:, last + 1:last + L]
    logits = torch.randn(int(rows.sum()), vocab, dtype=dtype, device=device)
    r, t, draft_ids = to_device(device, (qs[:-1, None] + np.arange(n + K * L + 1)[None, :]).ravel(),
                                want.ravel(), tokens.ravel())
    logits[r, t] = 30.0
    n_arr, sl = np.full(B, n, np.int64), np.full((B, K), L, np.int64)
    computed = np.full(B, 300, np.int64)
    blocks = B * 32 + 1
    caches = [tuple(torch.zeros(blocks, 16, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
              for _ in range(layers)]
    slot_mapping = torch.arange(int(rows.sum()), device=device) + 16

    def run():
        step = plan_target_step(c, n_arr, sl, qs, computed, draft_ids, L)
        v = verify(step.tree, logits, step.row_start)
        src, dst = relocation_slots(v.result, step.root_rows, slot_mapping)
        move_kv(caches, src, dst, backend=kv_move)
        return v, src

    v, src = run()
    accepted = v.result.num_accepted
    assert (accepted == n + L).all(), f"the walk accepted {accepted.tolist()}, not the planted path"
    assert (src.numel() > 0) == (K >= 2)
    return run


def target_step_section(plan: Plan, device: torch.device, dtype: torch.dtype, budget: Budget,
                        skipped: dict) -> list[dict]:
    """ms per step of target_step_fn (the target's shapes: vocabulary, layers, KV heads) by
    requests and layout: the host and device time our patches add to each target step."""
    from vllm_ouroboros.kernels.kv_move import check_kernel

    cfg = DraftConfig.from_hf((TINY_PAIR if plan.tiny else PAIR)["target"])
    why = check_kernel(device) if device.type == "cuda" else "no CUDA"
    serving = "triton" if why is None else "torch"
    out = []
    for name, (n, K, move) in TARGET_STEP_LAYOUTS.items():
        move = serving if move == "serving" else move
        if move == "torch" and serving == "torch" and "torch" in name:
            skipped[f"target_step/{name}"] = f"skipped: the KV move kernel does not serve here ({why})"
            continue
        for B in plan.round_batches:
            if budget.spent():
                skipped[f"target_step/{name}/{B}"] = budget.reason()
                continue
            fn = target_step_fn(B, n, K, BETA - 1, cfg.vocab_size, cfg.num_layers, cfg.num_kv_heads,
                                cfg.head_dim, dtype, device, kv_move=move)
            ms = median(time_calls(fn, device, plan.warmup, plan.reps, plan.max_s))
            out.append({"layout": name, "requests": B, "draft": n, "suffixes": K, "kv_move": move, "ms": ms})
            print(f"  {name:28} B={B:>2}: {ms:8.3f} ms/step", flush=True)
            del fn
            gc.collect()
    return out


# ---- c. tree-attention kernel ----------------------------------------------------------------

def kernel_skip_reason(device: torch.device) -> str | None:
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "skipped: no CUDA and TRITON_INTERPRET unset (TRITON_INTERPRET=1 runs one tiny case)"


def kernel_section(args, device: torch.device, budget: Budget, skipped: dict) -> dict:
    """Kernel vs SDPA over the requested configurations (CUDA), or one tiny case under Triton's
    interpreter (CPU; its times say nothing about a GPU). Worst kernel / SDPA ratio over those
    measured (`complete` False where the budget cut the table short)."""
    import bench_tree_attention as bta  # imported here: without CUDA it sets TRITON_INTERPRET

    from vllm_ouroboros.kernels.tree_attention import tree_attention

    rows, split_rules = [], {}
    if device.type == "cuda":
        dtype = torch.bfloat16
        configs = [(b, p, n, d, 32, 8, 16) for d in args.kernel_head_dim for b in args.kernel_batch
                   for p in args.kernel_prefix for n in args.kernel_tree]
        configs = configs[:1] if args.tiny else configs  # --tiny: the code path, not the table
        if not args.kernel_shipped_splits:
            for d in sorted({c[3] for c in configs}):
                # Tuning a head dim (about 30 timings and 8 compiles per mode) near the budget's
                # end would leave no time for the table it serves: the shipped thresholds hold.
                if budget.left() < SPLIT_TUNING_MIN_S:
                    skipped[f"split rules D={d}"] = (f"skipped: under {SPLIT_TUNING_MIN_S} s of the "
                                                     f"budget left (the shipped thresholds hold)")
                    continue
                split_rules[d] = tune_kernel_splits(d, dtype, tuple(args.kernel_tree), device)
    else:
        dtype = torch.float32
        configs = [(2, 21, 9, 32, 4, 2, 16)]  # bench_tree_attention.cpu_smoke's case
    for b, p, n, d, hq, hkv, block in configs:
        if budget.spent():
            skipped[f"kernel B={b} prefix={p} tree={n} D={d}"] = budget.reason()
            continue
        kargs, dq, dk, dv = bta.make_inputs(b, p, n, d, hq, hkv, block, dtype, device)
        out = torch.empty_like(kargs["q"])
        kernel = lambda: tree_attention(**kargs, out=out, max_query_len=n, backend="triton")  # noqa: E731
        sdpa, sdpa_mode = bta.sdpa_fn(dq, dk, dv, kargs["scale"])
        g_kernel = g_sdpa = None
        if device.type == "cuda":
            t_kernel, t_sdpa = bta.time_ms(kernel), bta.time_ms(sdpa)
            # Device time alone (replayed from a CUDA graph): at small shapes the eager times are
            # the host's (the wrapper, Triton's launcher), which a captured forward does not pay.
            g_kernel, g_sdpa = bta.time_graph_ms(kernel), bta.time_graph_ms(sdpa)
        else:
            t_kernel, t_sdpa = median(time_calls(kernel, device, 1, 3)), median(time_calls(sdpa, device, 1, 3))
        kernel()
        err = (out.float() - bta.tree_attention_reference(**kargs).float()).abs().max().item()
        g_ratio = g_kernel / g_sdpa if g_kernel and g_sdpa else None
        splits = {mode: _kernel_splits(kargs, n, hq, hkv, block, mode == "graph") for mode in ("eager", "graph")}
        rows.append({"batch": b, "prefix": p, "tree": n, "head_dim": d, "q_heads": hq, "kv_heads": hkv,
                     "block": block, "dtype": str(dtype).removeprefix("torch."), "splits": splits, "kernel_ms": t_kernel,
                     "sdpa_ms": t_sdpa, "ratio": t_kernel / t_sdpa, "kernel_graph_ms": g_kernel,
                     "sdpa_graph_ms": g_sdpa, "graph_ratio": g_ratio, "max_abs_err": err, "sdpa_mode": sdpa_mode})
        graph = (f"  graph: kernel {g_kernel:8.4f} SDPA {g_sdpa:8.4f} ratio {g_ratio:5.2f}" if g_ratio else "")
        print(f"  B={b:>2} prefix={p:>5} tree={n:>2} D={d:>3} S={splits['eager']}/{splits['graph']}: "
              f"kernel {t_kernel:8.4f} ms  SDPA "
              f"{t_sdpa:8.4f} ms  ratio {t_kernel / t_sdpa:5.2f}{graph}  err {err:.1e}", flush=True)
        del kargs, dq, dk, dv, out
    if not rows:  # the budget ran out before the first configuration (split tuning took it)
        skipped["kernel"] = budget.reason()
        return {"interpreted": device.type != "cuda", "rows": [], "split_rules": split_rules,
                "complete": False, "configs": len(configs)}
    worst = max(rows, key=lambda r: r["ratio"])
    graphed = [r["graph_ratio"] for r in rows if r["graph_ratio"] is not None]
    return {"interpreted": device.type != "cuda", "rows": rows, "split_rules": split_rules,
            "worst_ratio": worst["ratio"],
            "worst_graph_ratio": max(graphed) if len(graphed) == len(rows) else None,
            "complete": len(rows) == len(configs), "configs": len(configs),
            "worst": {k: worst[k] for k in ("batch", "prefix", "tree", "head_dim")}}


KERNEL_TARGET = 1.25  # issue 15: the kernel within 1.25x of SDPA at every configuration


def tune_kernel_splits(head_dim: int, dtype: torch.dtype, trees: tuple[int, ...], device: torch.device) -> dict:
    """The split rules of the kernel table's shapes (Hq 32, Hkv 8, 16-token pages) at this head
    dim, measured and registered as the plugin's kernel check does at load (kernels/
    split_tuning.py), eager and graph-replayed: {"eager" / "graph": {min_prefix, min_chunk} or
    None where the measurement failed (the shipped thresholds then hold)}."""
    import bench_tree_attention as bta

    t0 = time.perf_counter()
    rules = bta.measure_split_rules(head_dim, dtype, 32, 8, 16, trees, (True, False))
    out = {"graph" if g else "eager": ({"min_prefix": rules[g].min_prefix, "min_chunk": rules[g].min_chunk}
                                       if g in rules else None) for g in (True, False)}
    print(f"  split rules, D={head_dim}: {out} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def _kernel_splits(kargs: dict, n: int, hq: int, hkv: int, block: int, graphed: bool) -> int:
    """The S a kernel-table call picks, eager or under capture (the rule registered for that mode)."""
    from vllm_ouroboros.kernels import tree_attention as ta

    q, bt = kargs["q"], kargs["block_table"]
    return ta._launch_plan(q.dtype, hq, hkv, q.shape[2], bt.shape[0], n, bt.shape[1] * block, q.device,
                           block_size=block, graphed=graphed)[2]


def kernel_tiles_section(args, device: torch.device, kern: dict, budget: Budget, skipped: dict) -> dict:
    """Where the shipped tile table misses KERNEL_TARGET: each kernels.tree_attention.TILE_CANDIDATES
    entry timed at every measured configuration of the failing head dims (one table entry serves
    all of a head dim's configurations), the SDPA times taken from the kernel table; per head dim
    the entry with the best worst ratio, which is what to put in `_TILES`. Under the interpreter
    (CPU) the tiny case with two entries: the code path, not a timing."""
    import bench_tree_attention as bta

    from vllm_ouroboros.kernels.tree_attention import TILE_CANDIDATES, tree_attention

    rows = kern["rows"]
    interpreted = device.type != "cuda"
    failing = sorted({r["head_dim"] for r in rows if r["ratio"] > KERNEL_TARGET or interpreted})
    candidates = TILE_CANDIDATES[:2] if interpreted else TILE_CANDIDATES
    out = {"interpreted": interpreted, "head_dims": {}, "complete": True}
    for d in failing:
        cfgs = [r for r in rows if r["head_dim"] == d]
        ratios = {c: [] for c in candidates}
        errs = {c: 0.0 for c in candidates}
        measured = []
        # Configuration outside, candidates inside: the inputs and the reference once per
        # configuration; a budget cut leaves whole configurations measured for every candidate.
        for r in cfgs:
            if budget.spent():
                skipped[f"kernel_tiles/D={d}/B={r['batch']} prefix={r['prefix']} tree={r['tree']}"] = budget.reason()
                out["complete"] = False
                continue
            kargs, *_ = bta.make_inputs(r["batch"], r["prefix"], r["tree"], d, r["q_heads"], r["kv_heads"],
                                        r["block"], getattr(torch, r["dtype"]), device)
            ref = bta.tree_attention_reference(**kargs).float()
            o = torch.empty_like(kargs["q"])
            for tiles in candidates:
                fn = lambda: tree_attention(**kargs, out=o, max_query_len=r["tree"], backend="triton",  # noqa: E731
                                            tiles=tiles)
                # Tiles change device time: compared on it where the kernel table has it (the
                # eager times at small shapes are the host's, the same for every tile).
                on_graph = r.get("graph_ratio") is not None
                if interpreted:
                    t = median(time_calls(fn, device, 1, 2))
                else:
                    t = bta.time_graph_ms(fn, calls=10, rounds=3) if on_graph else None
                    on_graph = t is not None
                    t = t if on_graph else bta.time_ms(fn, warmup=2, reps=10, rounds=3)
                fn()
                errs[tiles] = max(errs[tiles], (o.float() - ref).abs().max().item())
                ratios[tiles].append(t / (r["sdpa_graph_ms"] if on_graph else r["sdpa_ms"]))
            measured.append({k: r[k] for k in ("batch", "prefix", "tree")})
            del kargs, ref, o
        per = [{"tiles": list(c), "worst_ratio": max(ratios[c]), "ratios": ratios[c], "max_abs_err": errs[c]}
               for c in candidates if ratios[c]]
        for c in per:
            print(f"  D={d:>3} tiles {tuple(c['tiles'])}: worst {c['worst_ratio']:5.2f}x SDPA over "
                  f"{len(measured)} of {len(cfgs)} configurations, err {c['max_abs_err']:.1e}", flush=True)
        shipped = max(r["graph_ratio"] if r.get("graph_ratio") is not None else r["ratio"] for r in cfgs)
        best = min(per, key=lambda c: c["worst_ratio"]) if per else None
        out["head_dims"][str(d)] = {"shipped_worst_ratio": shipped, "configs": measured, "of_configs": len(cfgs),
                                    "candidates": per, "best": best}
        if best:
            print(f"  D={d:>3}: shipped tiles worst {shipped:.2f}x, best swept {tuple(best['tiles'])} "
                  f"worst {best['worst_ratio']:.2f}x", flush=True)
    return out


# ---- d. modeled speedup ----------------------------------------------------------------------

def counter_rows(args) -> list[dict]:
    """The CPU runs' counters: a row from the flags, or the ouroboros rows of each --counters
    file: scripts/generate.py's JSON (and its vLLM draft_model-kN rows, priced beside ours;
    results/phrases_40.json: phrases through the host loop,
    40 prompts; results/drafting_modes.json: chain, guesses and phrases, 8 prompts;
    results/device_round_counters.json: phrases through the device round), or benchmark.py's
    (HumanEval, concurrency 1, greedy). A config name already taken by an earlier file's row
    gets the file's stem in brackets."""
    if args.tokens_per_target_forward is not None or args.draft_forwards_per_token is not None:
        if args.tokens_per_target_forward is None or args.draft_forwards_per_token is None:
            raise SystemExit("--tokens-per-target-forward and --draft-forwards-per-token go together")
        return [synthetic_row(args.tokens_per_target_forward, args.draft_forwards_per_token,
                              args.target_tokens_per_forward, args.draft_tokens_per_forward)]
    out, seen = [], set()
    for path in args.counters:
        for r in file_counter_rows(path):
            if r["method"] in seen:  # one config name in two runs: the later says whose it is
                r["method"] = f"{r['method']} ({Path(path).stem})"
            seen.add(r["method"])
            out.append(r)
    return out


def file_counter_rows(path: Path) -> list[dict]:
    """One counters file's rows (counter_rows)."""
    data = json.loads(path.read_text())
    if isinstance(data, list):  # scripts/generate.py --json: its ouroboros and vLLM draft_model rows
        rows = [generate_row(r) if r.get("counters") else builtin_row(r) for r in data
                if (r.get("counters") and r.get("settings"))
                or (r.get("spec") and (r.get("overrides") or {}).get("method") == "draft_model")]
        for r in rows:  # a workload other than the HumanEval of every other row says so
            if r["workload"] != "humaneval":
                r["method"] = f"{r['method']} [{r['workload']}]"
        return rows
    rows = data["rows"]
    keep = [r for r in rows if r["method"] in ("ouroboros", "ouroboros-phrases") and r["workload"] == "humaneval"
            and r["concurrency"] == 1 and r["temperature"] == 0 and "draft_forwards" in r]
    return [{k: v for k, v in r.items() if k in ("method", "workload", "concurrency", "temperature", "tokens",
                                                  "seconds", "spec", "draft_forwards", "settings")} for r in keep]


def generate_row(r: dict) -> dict:
    """A scripts/generate.py row (greedy, its workload; counters over the timed requests, settings as
    the proposer resolved them) as a benchmark.py row: target forwards are its drafts (each
    verified one draft), drafted tokens what the target verified beyond its own token."""
    c, st = r["counters"], r["settings"]
    conc = r.get("concurrency", 1)
    return {"method": r["config"], "workload": r.get("workload", "humaneval"), "concurrency": conc,
            "temperature": 0.0, "tokens": r["tokens"], "seconds": r["seconds"],
            # One request at a time, what a round costs is the forwards it ran: a device
            # round runs F of them even where its row needed fewer (round_length.py).
            "draft_forwards": c["draft_forward_calls"] if conc == 1 else c["draft_forwards"],
            "settings": {**{k: st[k] for k in ("window_size", "num_guesses", "phrase_len", "draft_round")},
                         "drafting_mode": st.get("drafting_mode")},
            "spec": {"num_drafts": c["target_forwards"], "num_accepted_tokens": c["accepted_tokens"],
                     "num_draft_tokens": c["drafted_tokens"], "per_pos": []}}


def builtin_row(r: dict) -> dict:
    """A scripts/generate.py row of vLLM's own draft-model speculation (its speculative_config
    in "overrides": k = num_speculative_tokens one-token draft forwards per verified step;
    vLLM's spec-decode counters) as a benchmark.py row, which benchmark.derive prices the way
    it prices that method: the same GPU curves, side by side."""
    return {"method": r["config"], "workload": r.get("workload", "humaneval"),
            "concurrency": r.get("concurrency", 1), "temperature": 0.0, "tokens": r["tokens"],
            "seconds": r["seconds"], "draft_row_tokens": 1, "spec": r["spec"],
            "settings": {"draft_round": "vllm"},  # vLLM's own loop: not one of our rounds
            "draft_forwards": r["overrides"]["num_speculative_tokens"] * r["spec"]["num_drafts"]}


def synthetic_row(tokens_per_forward: float, draft_forwards_per_token: float, target_tokens: float,
                  draft_tokens: int) -> dict:
    """A benchmark.py row whose counters give these rates (10,000 output tokens, no plain steps)."""
    N = 10000
    drafts = N / tokens_per_forward
    return {"method": "flags", "workload": "humaneval", "concurrency": 1, "temperature": 0.0, "tokens": N,
            "seconds": 1.0, "draft_forwards": draft_forwards_per_token * N, "draft_row_tokens": draft_tokens,
            "spec": {"num_drafts": drafts, "num_accepted_tokens": N - drafts,
                     "num_draft_tokens": drafts * (target_tokens - 1), "per_pos": []}}


def counter_row_tokens(row: dict) -> float:
    """Tokens per draft forward of a counters row (cost_model.draft_row_tokens of its settings)."""
    if "draft_row_tokens" in row:
        return row["draft_row_tokens"]
    st = row["settings"]
    return draft_row_tokens(st["window_size"], st["num_guesses"], st["phrase_len"])


def modeled(rows: list[dict], t_target: dict[int, float], t_draft: dict[int, float]) -> list[dict]:
    """benchmark.derive's "modeled" speedup (SpecDec++ eq. 2.3 as benchmark.py adapts it) of each
    row under these curves (ms by tokens per row); benchmark.py imports no vLLM at module level."""
    import benchmark

    rows = copy.deepcopy(rows)
    benchmark.derive(rows, [], counter_row_tokens, t_target, t_draft)
    keys = ("modeled", "tokens_per_target_forward", "draft_forwards_per_token")
    return [{"row": r["method"], **{k: r[k] for k in keys}, "draft_row_tokens": counter_row_tokens(r),
             "phrase_drafting": phrase_drafting(r),
             "draft_round": r.get("settings", {}).get("draft_round", "host")} for r in rows]


def with_step_cost(row: dict, t1_ms: float, step_ms: float) -> float:
    """A modeled row's speedup with step_ms more per target forward (the formula's per-token
    cost plus step_ms / tokens per target forward)."""
    per_tok = t1_ms / row["modeled"]
    return t1_ms / (per_tok + step_ms / row["tokens_per_target_forward"])


def phrase_drafting(row: dict) -> bool:
    """The row drafted with the Jacobi window and pool guesses (the flags' row stands for it);
    not a pool-mode row (no draft forward: its window and guesses settings are never used)."""
    st = row.get("settings", {})
    return row["method"] == "flags" or (st.get("window_size", 0) > 0 and st.get("num_guesses", 0) > 0
                                        and st.get("drafting_mode") != "pool")


def round_curve(rounds: list[dict], mode: str) -> dict[int, float] | None:
    """ms per draft forward inside a 1-request round of `mode`, by tokens per row (decode-only
    at 1 and 2, phrase drafting at 34 and 122): t_draft(n) as a round pays it."""
    pts = {r["row_tokens"]: r["ms_per_forward"] for r in rounds if r["mode"] == mode and r["requests"] == 1}
    if 2 not in pts:
        return None
    return dict(sorted({1: pts[2], **pts}.items()))


def modeled_section(args, curves: dict, rounds: list[dict], skipped: dict,
                    target_step: list[dict] | None = None) -> dict:
    """Modeled speedups per drafting variant: the host round (eager drafting, today), the device
    and graph rounds, and the graph forward alone (no round overhead: the floor). The target's
    t(n): the target-shaped curve at 1 request, from its CUDA graph where measured (vLLM runs its
    target from graphs on a GPU), else eager."""
    target = [p for p in curves.get("target", []) if p["batch"] == 1]
    if not target:
        skipped["modeled"] = "skipped: no target curve in this run"
        return None
    # vLLM's own target forward runs fused kernels (RMSNorm, RoPE, SiLU*up) from CUDA graphs:
    # the target-shaped curve through our fused kernels, graph-replayed, is its closest stand-in
    # (the fastest target: the least flattering baseline for speculation), then the plain graph.
    kind = next((k for k in ("fused_graph_ms", "graph_ms")
                 if all(p.get(k) is not None for p in target)), "eager_ms")
    t_target = {p["n"]: p[kind] for p in target}
    draft_graph = [p for p in curves.get("draft", []) if p["batch"] == 1 and p["graph_ms"] is not None]
    variants = {
        "eager drafting (host round, today)": round_curve(rounds, "host"),
        "device round": round_curve(rounds, "device"),
        "graph drafting (graph round)": round_curve(rounds, "graph"),
        # What serving runs on CUDA: draft_fused_ops is on there by default.
        "graph+fused drafting (graph round, fused layers)": round_curve(rounds, "graph+fused"),
        "graph forward alone (floor)": {p["n"]: p["graph_ms"] for p in draft_graph} or None,
    }
    rows = counter_rows(args)
    source = "flags" if rows and rows[0]["method"] == "flags" else ", ".join(map(str, args.counters))
    out = {"target_curve": kind.removesuffix("_ms"), "counters": source, "variants": {}}
    for name, t_draft in variants.items():
        if t_draft is None:
            out["variants"][name] = None
            skipped[f"modeled/{name}"] = "skipped: not measured in this run" + (
                " (no CUDA)" if "graph" in name and "graph" in skipped else "")
            continue
        out["variants"][name] = {"t_draft_ms": t_draft, "rows": modeled(rows, t_target, t_draft)}
    # What the model leaves out: our patches' work around each target forward (target_step),
    # at one request, the tree layout where measured (it moves KV), else the chain's.
    steps = {p["layout"]: p["ms"] for p in target_step or [] if p["requests"] == 1}
    step_ms = next((steps[k] for k in reversed(TARGET_STEP_LAYOUTS) if k in steps), None)
    if step_ms is not None:
        out["target_step_ms"] = step_ms
        for v in out["variants"].values():
            for r in v["rows"] if v else []:
                r["modeled_with_target_step"] = with_step_cost(r, t_target[1], step_ms)
    # Graph rounds that exit early run the forwards their rows need: the host loop's counters.
    for mode, name in (("graph", "graph drafting (graph round)"),
                       ("graph+fused", "graph+fused drafting (graph round, fused layers)")):
        graph = [r for r in rounds if r["mode"] == mode]
        if out["variants"].get(name):
            out["variants"][name]["early_exit"] = bool(graph) and all(r["early_exit"] for r in graph)
    return out


# ---- e. acceptance -----------------------------------------------------------------------------

FUSED = "graph+fused drafting (graph round, fused layers)"  # the modeled variant CUDA serving runs

def find_round(rounds: list[dict], setting: str, B: int, mode: str, key: str) -> float | None:
    """rounds' `key` for one (setting, requests, mode), None where not measured."""
    return next((r[key] for r in rounds if (r["setting"], r["requests"], r["mode"]) == (setting, B, mode)), None)


def phrase_modeled(mod: dict | None, variant: str) -> float | None:
    """Modeled speedup of the first phrase-drafting row of the counters (Jacobi window and pool
    guesses both on), for a device or graph round that runs a fixed F the first whose counters
    came from a device round (its forwards per round as it ran them) where there is one, for
    one that exits early (conditional nodes) the first from the host loop (the same drafts)."""
    v = (mod or {}).get("variants", {}).get(variant)
    if not v:
        return None
    rows = [r for r in v["rows"] if r["phrase_drafting"]]
    if v.get("early_exit"):
        rows = [r for r in rows if r["draft_round"] == "host"] or rows
    elif "graph" in variant or "device" in variant:
        rows = [r for r in rows if r["draft_round"] in ("device", "graph")] or rows
    return rows[0]["modeled"] if rows else None


def acceptance(result: dict, tiny: bool) -> list[dict]:
    """The issue's targets, each on one named measurement (the round targets on the graph round,
    the host and device rounds' figures beside them). PASS / FAIL only where measured on the
    real pair's shapes; NOT MEASURED (with the reason) where absent; n/a for --tiny shapes."""
    rounds, kern, mod, skipped = result["rounds"], result.get("kernel"), result.get("modeled"), result["skipped"]

    def graph_round(name, setting, B, key, limit):
        # The graph round as CUDA serving runs it (draft_fused_ops on by default there), the
        # unfused one where the fused was not measured; the other modes beside it.
        modes = ("host", "device", "graph-fixed", "graph", "graph+fused", TORCH_POOL, TORCH_ROUND, ROPE_APART,
                 NORM_GEMM, PADDED_STEPS)
        others = {m: find_round(rounds, setting, B, m, key) for m in modes}
        mode = "graph+fused" if others["graph+fused"] is not None else "graph"
        others.pop(mode)
        why = skipped.get("graph") or skipped.get("rounds") or skipped.get(f"rounds/{setting}/{B}/graph") or (
            f"no {B}-request round in this plan" if B not in {r["requests"] for r in rounds}
            else "the graph round failed (see errors)")
        return (f"{name} ({mode} round)", "ms", "<=", limit, find_round(rounds, setting, B, mode, key), why,
                others, None)

    kernel_why = skipped.get("kernel") or ("Triton interpreter: not a GPU timing" if kern else
                                           "the kernel section failed (see errors)")
    # A worst ratio over part of the table can fail the target but not pass it.
    kernel_partial = (f"INCOMPLETE ({len(kern['rows'])} of {kern['configs']} configurations measured)"
                      if kern and not kern.get("complete", True) else None)
    lines = [
        graph_round("draft forward in a round, 1 request, decode", "decode-only", 1,
                    "ms_per_forward", 1.2),
        graph_round("34-token lookahead forward in a round, 1 request (W=G=4)", "phrases W=G=4", 1,
                    "ms_per_forward", 1.5),
        graph_round("draft forward in a round, 32 requests, decode", "decode-only", 32,
                    "ms_per_forward", 2.0),
        graph_round("gamma = 4 round, 1 request, decode", "decode-only", 1, "ms_per_round", 6.0),
        ("tree-attention kernel / SDPA, worst configuration", "x", "<=", KERNEL_TARGET,
         None if not kern or kern["interpreted"] else kern.get("worst_ratio"), kernel_why,
         {"graph-replayed (device time)": kern.get("worst_graph_ratio")} if kern else {}, kernel_partial),
        ("modeled speedup with phrase drafting (graph drafting, fused layers where measured)", "x", ">=", 2.5,
         phrase_modeled(mod, FUSED) if phrase_modeled(mod, FUSED) is not None
         else phrase_modeled(mod, "graph drafting (graph round)"),
         skipped.get("modeled") or skipped.get("modeled/graph drafting (graph round)") or "see errors",
         {"graph drafting, unfused layers": phrase_modeled(mod, "graph drafting (graph round)")}, None),
    ]
    out = []
    for name, unit, op, limit, value, why, others, partial in lines:
        if value is None:
            status = f"NOT MEASURED ({why})"
        elif tiny:
            status = "n/a (--tiny shapes)"
        else:
            status = "PASS" if (value <= limit if op == "<=" else value >= limit) else "FAIL"
            if status == "PASS" and partial:
                status = partial
        out.append({"name": name, "value": value, "op": op, "target": limit, "unit": unit, "status": status,
                    "other_modes": others})
    return out


# ---- f. output -----------------------------------------------------------------------------------

def markdown(res: dict) -> str:
    """results/bench_gpu.md: the acceptance lines, then one table per section."""
    none = {"source": "not loaded yet", "weights": "-"}  # a checkpoint before the model's section
    m = {"draft": none, "target": none, **res["models"]}
    lines = [f"# Draft side on {res['device']} (scripts/bench_gpu.py)", "",
             f"Command: `{res['command']}` at {res['git']}; torch {res['torch']}, triton {res['triton']}, "
             f"{res['dtype']}{', --tiny shapes' if res['tiny'] else ''}. Draft: {m['draft']['source']}, "
             f"target: {m['target']['source']} ({m['draft']['weights']}).", "",
             "## Acceptance", "", "| target | measured | status |", "|---|---|---|"]
    for a in res["acceptance"]:
        lines.append(f"| {a['name']} {a['op']} {a['target']} {a['unit']} | {_ms(a['value'])}{_others(a)} | "
                     f"{a['status']} |")
    checks = [c for c in (res.get("kernel_check") or {}).values() if c]
    if checks:
        lines += ["", "## Kernel check before serving (first start: compiles every configuration)", "",
                  "| cache layout | heads | D | result | seconds |", "|---|---|---|---|---|"]
        lines += [f"| {c['layout']} | {c['heads']} | {c['head_dim']} | "
                  f"{'passed' if c['passed'] else 'FAILED: ' + c['reason']} | {c['seconds']:.1f} |"
                  for c in checks]
    lines += _md_curves(res) + _md_rounds(res) + _md_target_step(res.get("target_step"))
    lines += _md_inserts(res.get("inserts")) + _md_pool_fill(res.get("pool_fill")) + _md_cut_rounds(res.get("cut_rounds"))
    lines += _md_kernel(res.get("kernel")) + _md_kernel_tiles(res.get("kernel_tiles"))
    lines += _md_profile(res.get("profile")) + _md_modeled(res.get("modeled"))
    lines += _md_fusion_choice(res.get("fusion_choice")) + _md_prefill(res.get("prefill"))
    if res["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in res["skipped"].items()]
    if res["errors"]:
        lines += ["", "## Errors (tracebacks in the JSON)", ""] + [f"- {k}" for k in res["errors"]]
    return "\n".join(lines) + "\n"


def _md_prefill(pts: list | None) -> list[str]:
    if not pts:
        return []
    lines = ["", "## Draft prefill of new prompts (DraftRuntime.prefill; ms, median)", "",
             "| requests | prompt tokens | eager ms (forwards) | graph chunks ms (forwards) | graph / eager |",
             "|---|---|---|---|---|"]
    for p in pts:
        ratio = p.get("graph_over_eager")
        lines.append(f"| {p['requests']} | {p['prompt']} | {_ms(p.get('eager_ms'))} ({p.get('eager_forwards', '-')}) | "
                     f"{_ms(p.get('graph_ms'))} ({p.get('graph_forwards', '-')}) | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    return lines


def _md_fusion_choice(fc: dict | None) -> list[str]:
    if not fc:
        return []
    lines = ["", f"## Fusions kept at load (draft/fusion_choice.py; {'graph replays' if fc['graphs'] else 'eager'}, "
             f"{fc['prefix']}-token prefix; ms per forward, fastest of the replays)", "",
             "| fusion | tokens | on | off | kept |", "|---|---|---|---|---|"]
    for t in fc["timings"]:
        lines += [f"| {t['name']} | {n} | {_ms(a)} | {_ms(b)} | {'on' if t['kept'] else 'off'} |"
                  for n, a, b in zip(t["widths"], t["on_ms"], t["off_ms"])]
    lines += [f"- {k}: {fc[k]}" for k in ("norm_gemm_check", "attention_check") if fc[k]]
    return lines


def _md_curves(res: dict) -> list[str]:
    lines = []
    for tag, pts in res["curves"].items():
        fused = any("fused_eager_ms" in p for p in pts)
        lines += ["", f"## t(n), {tag} ({res['prefix']}-token cached prefix; ms, median)", "",
                  "| requests | n | eager | CUDA graph |" + (" fused eager | fused graph |" if fused else ""),
                  "|---|---|---|---|" + ("---|---|" if fused else "")]
        lines += [f"| {p['batch']} | {p['n']} | {_ms(p['eager_ms'])} | {_ms(p['graph_ms'])} |" + (
            f" {_ms(p.get('fused_eager_ms'))} | {_ms(p.get('fused_graph_ms'))} |" if fused else "") for p in pts]
    return lines


def _md_rounds(res: dict) -> list[str]:
    if not res["rounds"]:
        return []
    lines = ["", f"## Drafting rounds (gamma {GAMMA}, beta {BETA}, {res['prefix']}-token contexts; ms, "
             f"median of {len(res['rounds'][0]['round_ms'])} rounds)", "",
             "| setting | requests | mode | ms / round | ms / forward | forwards | draft tokens / round |",
             "|---|---|---|---|---|---|---|"]
    return lines + [f"| {r['setting']} | {r['requests']} | {r['mode']} | {_ms(r['ms_per_round'], 2)} | "
                    f"{_ms(r['ms_per_forward'])} | {median(r['forwards'])} | {median(r['draft_tokens'])} |"
                    for r in res["rounds"]]


def _md_inserts(pts: list | None) -> list[str]:
    if not pts:
        return []
    lines = ["", "## A step's pool insert (pool_writer.py; ms, median; torch, and the Triton kernels on CUDA)", "",
             "| rows | torch eager | torch CUDA graph | kernels eager | kernels CUDA graph |", "|---|---|---|---|---|"]
    return lines + [f"| {p['rows']} | {_ms(p['eager_ms'])} | {_ms(p.get('graph_ms'))} | {_ms(p.get('kernel_eager_ms'))} "
                    f"| {_ms(p.get('kernel_graph_ms'))} |" for p in pts]


def _md_pool_fill(p: dict | None) -> list[str]:
    if not p:
        return []
    return ["", f"## A pool-filled step ({p['mode']}; 1 drafted request + {p['pool_rows']} pool-filled; ms per "
            "step, median)", "", "| pool lookups | ms per step |", "|---|---|",
            f"| after the round's read (a second wait) | {_ms(p['after_ms'])} |",
            f"| queued ahead of the round (`queue_pool_drafts`) | {_ms(p['queued_ms'])} |",
            f"| queued / after | {p['queued_over_after']:.2f}x |"]


def _md_cut_rounds(rounds: list | None) -> list[str]:
    lines = []
    for r in rounds or []:
        lines += ["", f"## Rounds cut short ({r['mode']}, 1 request, W=G={r['window']}; whole: "
                      f"{_ms(r['whole_ms'])} ms, {r['whole_forwards']:g} forwards; the plan's price: "
                      "`cost_model.round_forwards`)", "",
                  "| draft tokens s | ms per round | forwards | modeled forwards | share of a whole round | "
                  "modeled share |", "|---|---|---|---|---|---|"]
        lines += [f"| {c['s']} | {_ms(c['ms'])} | {c['forwards']:g} | {c['modeled_forwards']:g} | "
                  f"{c['measured_share']:.2f} | {c['modeled_share']:.2f} |" for c in r["cuts"]]
    return lines


def _md_profile(prof: dict | None) -> list[str]:
    lines = []
    for key, p in (prof or {}).items():
        busy = "" if not p["device_activities"] else \
            f", device busy {p['device_ms']:.2f} ms ({100 * p['device_busy']:.0f}% of the wall)"
        lines += ["", f"## Profile: {p.get('mode', key)} round, 1 request, {p.get('setting', 'phrases W=G=4')} "
                  "(scripts/profile_round.py; per round)", "",
                  f"{p['wall_ms']:.2f} ms wall{busy}, {p['device_activities']:.0f} device activities.", "",
                  "| region | calls | device activities | device ms | host ms |", "|---|---|---|---|---|"]
        lines += [f"| {r['region']} | {r['calls']:.1f} | {r['device_activities']:.1f} | {r['device_ms']:.3f} | "
                  f"{r['host_ms']:.3f} |" for r in p["regions"]]
        if p.get("kernels"):
            lines += ["", "Device time by kernel name (the most first):", "", "| kernel | calls | device ms |",
                      "|---|---|---|"]
            lines += [f"| `{k['name'][:90]}` | {k['calls']:.1f} | {k['device_ms']:.3f} |" for k in p["kernels"]]
    return lines


def _md_kernel(k: dict | None) -> list[str]:
    if not k:
        return []
    note = " (Triton interpreter: its times say nothing)" if k["interpreted"] else ""
    lines = ["", f"## Tree-attention kernel vs SDPA{note}: worst ratio {k['worst_ratio']:.2f} at {k['worst']}", "",
             "Eager: back-to-back calls (host wrapper and launches included); graph: replayed from a CUDA graph "
             "(device time).", "",
             "S: prefix splits, eager / graph, by the split rules measured first (kernels/split_tuning.py): "
             + (", ".join(f"D {d}: {v}" for d, v in k.get("split_rules", {}).items()) or "not measured: shipped thresholds")
             + ".", "",
             "| batch | prefix | tree | D | S | kernel ms | SDPA ms | ratio | graph kernel ms | graph SDPA ms | "
             "graph ratio | max err |", "|---" * 12 + "|"]
    return lines + [f"| {r['batch']} | {r['prefix']} | {r['tree']} | {r['head_dim']} | "
                    f"{_splits_cell(r.get('splits'))} | {r['kernel_ms']:.4f} | "
                    f"{r['sdpa_ms']:.4f} | {r['ratio']:.2f} | {_ms(r.get('kernel_graph_ms'), 4)} | "
                    f"{_ms(r.get('sdpa_graph_ms'), 4)} | {_ms(r.get('graph_ratio'), 2)} | {r['max_abs_err']:.1e} |"
                    for r in k["rows"]]


def _splits_cell(splits: dict | None) -> str:
    return f"{splits['eager']} / {splits['graph']}" if splits else "-"


def _md_kernel_tiles(t: dict | None) -> list[str]:
    if not t:
        return []
    note = " (Triton interpreter: its times say nothing)" if t["interpreted"] else ""
    lines = ["", f"## Kernel tiles swept where the shipped table missed {KERNEL_TARGET}x{note}: worst ratio "
             "per head dim over its configurations (kernels/tree_attention.py `_TILES`: M, BLOCK_N, warps M < 64, "
             "warps M >= 64)", "", "| D | tiles | worst kernel / SDPA | max err |", "|---|---|---|---|"]
    for d, v in t["head_dims"].items():
        part = f" (swept: {len(v['configs'])} of {v['of_configs']} configurations)" if len(v["configs"]) < v["of_configs"] else ""
        lines.append(f"| {d} | shipped{part} | {v['shipped_worst_ratio']:.2f} | - |")
        lines += [f"| {d} | {tuple(c['tiles'])}{' (best)' if c is v['best'] or c == v['best'] else ''} | "
                  f"{c['worst_ratio']:.2f} | {c['max_abs_err']:.1e} |" for c in v["candidates"]]
    return lines


def _md_modeled(m: dict | None) -> list[str]:
    if not m:
        return []
    step = m.get("target_step_ms")
    extra = f" with our step's work ({step:.2f} ms) |" if step is not None else ""
    lines = ["", f"## Modeled speedup over no speculation (benchmark.py's formula; target t(n): "
             f"{m['target_curve']}; counters: {m['counters']})", "",
             "| drafting | row | tokens / target fwd | draft fwd / token | tokens / draft fwd | modeled |" + extra,
             "|---|---|---|---|---|---|" + ("---|" if extra else "")]
    for name, v in m["variants"].items():
        if not v:
            lines.append(f"| {name} | not measured | - | - | - | - |" + (" - |" if extra else ""))
            continue
        lines += [f"| {name} | {r['row']} | {r['tokens_per_target_forward']:.2f} | "
                  f"{r['draft_forwards_per_token']:.2f} | {r['draft_row_tokens']:g} | {r['modeled']:.2f} |"
                  + (f" {r['modeled_with_target_step']:.2f} |" if extra else "") for r in v["rows"]]
    return lines


def _md_target_step(pts: list | None) -> list[str]:
    if not pts:
        return []
    lines = ["", "## Our patches' work around a target forward (target_step.py, verify.py, kv_relocate.py; "
             "eager; ms, median)", "", "| layout | requests | KV move | ms / step |", "|---|---|---|---|"]
    return lines + [f"| {p['layout']} | {p['requests']} | {p.get('kv_move', 'torch')} | {_ms(p['ms'])} |"
                    for p in pts]


def environment(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    try:
        git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        git = "unknown"
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
    return {"command": " ".join(shlex.quote(x) for x in ["python"] + sys.argv), "git": git, "device": name,
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "dtype": str(dtype).removeprefix("torch."), "tiny": tiny}


# ---- main ----------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, any machine (the CPU-only CI's check)")
    ap.add_argument("--draft", type=Path, help="draft model dir (default: PAIR's random 0.5B)")
    ap.add_argument("--target", type=Path, help="target model dir (default: PAIR's random 1.5B)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 (--tiny: float32)")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["target", "rounds", "kernel", "tiles", "graph", "inserts", "fused", "profile",
                             "prefill", "pool_fill", "cut_rounds"],
                    help="sections to leave out (graph: no CUDA-graph timings; fused: no graph rounds "
                         "through the fused layer kernels, DraftModel.fused_ops, which run on CUDA; tiles: "
                         "no tile sweep where the kernel table misses 1.25x)")
    ap.add_argument("--budget-s", type=float,
                    help="stop measuring after this many seconds: what is left is skipped with that "
                         "reason (sections run most needed first: curves, the rounds the issue's "
                         "targets read, the kernel, the pool fill and cut rounds, the profile, the other rounds, the "
                         "prefill, the inserts); the files are written after every "
                         "section, so a run killed later still leaves what it measured")
    ap.add_argument("--kernel-batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--kernel-prefix", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--kernel-tree", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--kernel-head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--kernel-shipped-splits", action="store_true",
                    help="the kernel table with the shipped split thresholds, not measured first")
    ap.add_argument("--counters", type=Path, nargs="+",
                    default=[REPO / "results" / "phrases_40.json",
                             REPO / "results" / "drafting_modes.json",
                             REPO / "results" / "device_round_counters.json",
                             REPO / "results" / "pool_mode.json",
                             REPO / "results" / "pool_branches.json",
                             REPO / "results" / "mtbench_16_h200.json",
                             REPO / "results" / "mtbench_16.json"],
                    help="CPU runs whose ouroboros (and vLLM draft_model) rows give the counters: "
                         "scripts/generate.py --json files, or benchmark.py's results/benchmark.json")
    ap.add_argument("--tokens-per-target-forward", type=float, help="instead of --counters (with the next)")
    ap.add_argument("--draft-forwards-per-token", type=float)
    ap.add_argument("--target-tokens-per-forward", type=float, default=1 + GAMMA,
                    help="with the flags: tokens per target forward input (default 1 + gamma)")
    ap.add_argument("--draft-tokens-per-forward", type=int, default=row_tokens(4, 4),
                    help="with the flags: tokens per draft forward row (default 34: W = G = 4)")
    ap.add_argument("--modeled-only", nargs=2, metavar=("TARGET_MS", "DRAFT_MS"),
                    help="measure nothing: print the modeled speedups of the counters under these curves, "
                         "JSON objects {tokens per row: ms per forward}, e.g. the last GPU run's or the "
                         "issue's targets (any machine, no CUDA)")
    ap.add_argument("--json", type=Path, help="default results/bench_gpu.json (--tiny: bench_gpu_tiny.json)")
    ap.add_argument("--md", type=Path, help="default results/bench_gpu.md (--tiny: bench_gpu_tiny.md)")
    args = ap.parse_args()
    # A --tiny run (CI, a CPU) must never overwrite a GPU run's figures.
    stem = REPO / "results" / ("bench_gpu_tiny" if args.tiny else "bench_gpu")
    args.json = args.json or stem.with_suffix(".json")
    args.md = args.md or stem.with_suffix(".md")
    return args


def run_section(name: str, fn: Callable[[], object], errors: dict, quiet: bool = False):
    """fn(), or None with the traceback recorded: one failing section must not cost the others'
    figures on a lent machine whose time is counted."""
    if not quiet:
        print(f"[{name}]", flush=True)
    errors.pop(name, None)  # a section rerun at a checkpoint (modeled) reports its last outcome
    try:
        return fn()
    except Exception:  # noqa: BLE001
        errors[name] = traceback.format_exc()
        print(errors[name], file=sys.stderr, flush=True)
        return None


def modeled_only(args) -> int:
    """--modeled-only: the counters' modeled speedups under two given curves, as a table."""
    t_target, t_draft = ({int(n): float(ms) for n, ms in json.loads(c).items()} for c in args.modeled_only)
    print(f"target t(n) {t_target} ms, draft t(n) {t_draft} ms; counters: "
          f"{', '.join(map(str, args.counters))}")
    print(f"{'row':<26}{'drafting':>10}{'tok/target fwd':>16}{'draft fwd/tok':>15}{'tok/draft row':>15}{'modeled':>9}")
    for r in modeled(counter_rows(args), t_target, t_draft):
        print(f"{r['row']:<26}{r['draft_round']:>10}{r['tokens_per_target_forward']:>16.2f}"
              f"{r['draft_forwards_per_token']:>15.3f}{r['draft_row_tokens']:>15g}{r['modeled']:>9.2f}")
    return 0


def main() -> int:
    args = parse_args()
    if args.modeled_only:
        return modeled_only(args)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("no CUDA device: run with --tiny, or on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    if not cuda:
        torch.set_num_threads(1)  # tiny tensors: thread wake-ups cost more than the work (tests/conftest.py)
    res = {**environment(device, dtype, args.tiny), "models": {}, "curves": {}, "rounds": [], "target_step": None,
           "inserts": None, "pool_fill": None, "cut_rounds": None, "kernel": None, "kernel_tiles": None, "profile": None,
           "modeled": None, "skipped": {}, "errors": {}}
    print(f"# {res['device']}, torch {res['torch']}, triton {res['triton']}, {res['dtype']}"
          f"{', --tiny' if args.tiny else ''}", flush=True)
    budget = Budget(args.budget_s)
    measure(args, Plan(args.tiny), device, dtype, res, budget)
    res["complete"] = True
    save(args, res, budget)
    print_summary(res)
    print(f"wrote {args.json} and {args.md} ({res['wall_s']:.0f} s)")
    return 1 if res["errors"] else 0


def save(args, res: dict, budget: Budget) -> None:
    """The modeled speedups and the acceptance lines from what is measured so far, then both
    files: called after every section, so a run cut short leaves its figures (JSON `complete`
    false until the end)."""
    for key in [k for k in res["skipped"] if k.startswith("modeled")]:
        del res["skipped"][key]  # an earlier checkpoint's reasons (no target curve yet, ...)
    res["modeled"] = run_section("modeled", lambda: modeled_section(args, res["curves"], res["rounds"],
                                                                    res["skipped"], res.get("target_step")),
                                 res["errors"], quiet=True)
    res["acceptance"] = acceptance(res, args.tiny)
    res["wall_s"] = time.perf_counter() - budget.t0
    for path, text in ((args.json, json.dumps(res, indent=1)), (args.md, markdown(res))):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a kill mid-write leaves the last checkpoint whole


def measure(args, plan: Plan, device: torch.device, dtype: torch.dtype, res: dict, budget: Budget) -> None:
    """The sections into `res`, what the issue's targets read first (curves, the rounds the
    targets name, our step's work, the kernel, the pool fill and the cut rounds, then the
    profile, the other rounds, the prefill and the inserts), each
    one's failure recorded in res["errors"], its skip's reason in res["skipped"], its seconds
    in res["section_s"] (to plan a lent GPU's minutes), the files written after each (save)."""
    skipped, errors = res["skipped"], res["errors"]
    res["prefix"] = plan.prefix
    res["complete"] = False
    res["budget_s"] = budget.seconds
    res["section_s"] = {}
    checkpoint = lambda: save(args, res, budget)  # noqa: E731

    def section(name: str, fn: Callable[[], object]):
        t0 = time.perf_counter()
        out = run_section(name, fn, errors)
        res["section_s"][name] = res["section_s"].get(name, 0.0) + time.perf_counter() - t0
        return out

    def optional(name: str, fn: Callable[[], object]) -> None:
        """Section `name` into res[name] and a checkpoint, unless --skip names it or the budget
        is spent (the reason in `skipped`)."""
        if name in args.skip:
            skipped[name] = f"skipped: --skip {name}"
        elif budget.spent():
            skipped[name] = budget.reason()
        else:
            res[name] = section(name, fn)
            checkpoint()

    graphs = device.type == "cuda" and "graph" not in args.skip
    if not graphs:
        skipped["graph"] = "skipped: no CUDA" if device.type != "cuda" else "skipped: --skip graph"
    draft, res["models"]["draft"] = load_model("draft", args.draft, plan.tiny, dtype, device)
    res["kernel_check"] = {}
    if device.type != "cuda":
        skipped["kernel_check"] = "skipped: no CUDA (the check compiles the kernel for the GPU)"
    else:
        res["kernel_check"]["draft"] = section("kernel_check/draft", lambda: kernel_check(
            draft, plan, "draft cache"))
    with torch.inference_mode():
        res["curves"]["draft"] = section("curves/draft", lambda: forward_curve(
            draft, plan, False, graphs, errors, "draft", budget, skipped)) or []
        checkpoint()
        if device.type != "cuda" or "fused" in args.skip:
            skipped["fusion_choice"] = ("skipped: no CUDA (the fusions are Triton kernels)" if device.type != "cuda"
                                        else "skipped: --skip fused")
        else:
            res["fusion_choice"] = section("fusion_choice", lambda: fusion_choice_section(draft, plan, graphs))
            checkpoint()
        if "target" in args.skip:
            skipped["curves/target"] = "skipped: --skip target"
            res["models"]["target"] = {"source": "skipped", "weights": "-"}
        else:
            target, res["models"]["target"] = load_model("target", args.target, plan.tiny, dtype, device)
            if device.type == "cuda":
                res["kernel_check"]["target"] = section("kernel_check/target", lambda: kernel_check(
                    target, plan, "vLLM paged cache"))
            res["curves"]["target"] = section("curves/target", lambda: forward_curve(
                target, plan, True, graphs, errors, "target", budget, skipped)) or []
            del target  # the rounds and the kernel get its memory
            gc.collect()
            checkpoint()
    # graph-fixed: the graph round without its conditional nodes, to time what they cost;
    # graph+fused: through the fused layer kernels, to choose OuroborosConfig.draft_fused_ops.
    fused = graphs and "fused" not in args.skip
    modes = (["graph"] if graphs else []) + (["graph+fused"] if fused else []) + (
        ["graph-fixed"] if graphs and conditional_nodes_supported() else []) + (
        [TORCH_POOL, TORCH_ROUND, ROPE_APART, NORM_GEMM, PADDED_STEPS] if fused and device.type == "cuda" else []) + [
        "host", "device"]
    if graphs and "fused" in args.skip:
        skipped["rounds/graph+fused"] = "skipped: --skip fused"
    cases = [] if "rounds" in args.skip else plan.round_cases(modes)
    if "rounds" in args.skip:
        skipped["rounds"] = "skipped: --skip rounds"
    first = plan.target_cases(cases)

    def rounds(part: list) -> None:
        if part:
            section("rounds", lambda: round_section(draft, plan, part, errors, budget, skipped, res["rounds"]))
            checkpoint()

    rounds(first)
    if "target" in args.skip:
        skipped["target_step"] = "skipped: --skip target"
    else:
        res["target_step"] = section("target_step", lambda: target_step_section(plan, device, dtype, budget, skipped))
        checkpoint()
    reason = "skipped: --skip kernel" if "kernel" in args.skip else kernel_skip_reason(device)
    if reason:
        skipped["kernel"] = reason
        print(f"[kernel] {reason}", flush=True)
    elif budget.spent():
        skipped["kernel"] = budget.reason()
    else:
        res["kernel"] = section("kernel", lambda: kernel_section(args, device, budget, skipped))
        checkpoint()

    def tiles() -> None:
        kern = res["kernel"]
        if "tiles" in args.skip:
            skipped["kernel_tiles"] = "skipped: --skip tiles"
        elif kern and kern["rows"] and (kern["interpreted"] or kern["worst_ratio"] > KERNEL_TARGET):
            res["kernel_tiles"] = section("kernel_tiles", lambda: kernel_tiles_section(
                args, device, kern, budget, skipped))
            checkpoint()
        elif kern:
            skipped["kernel_tiles"] = f"skipped: the shipped tiles are within {KERNEL_TARGET}x of SDPA"

    # The graph round as it serves (fused on CUDA), profiled by kernel name: where its time
    # goes beyond the forward's (results/README.md, "Session of 2026-11-28 (fifth)": 1.31 ms per
    # decode forward in the round, 1.15 alone). After the figures the issue's targets read and
    # the kernel table, before the tile sweep (49 s on the H200, which cut the profile from the
    # last full run): CUPTI tracing graph replays is the least tried thing here, and what is
    # measured before it is written already.
    wgg = "phrases W=G=4"
    graph_mode = "graph+fused" if fused else "graph"
    profiles = [[(wgg, graph_mode), ("decode-only", graph_mode)] if graphs else [],
                [(wgg, "device")] + ([(wgg, "device+fused")] if graphs and "fused" not in args.skip else [])]

    def profile(cases: list[tuple[str, str]]) -> None:
        if "profile" in args.skip:
            skipped["profile"] = "skipped: --skip profile"
        elif cases:
            res["profile"] = res["profile"] or {}
            section("profile", lambda: profile_section(draft, plan, cases, budget, skipped, res["profile"]))
            checkpoint()

    # Cheap (seconds on the H200), and what the back-off's GPU pricing rests on: before the
    # profile, the tile sweep and the other rounds, which a budget cuts first.
    optional("pool_fill", lambda: pool_fill_section(draft, plan, graph_mode if graphs else "device"))
    # The round that serves; on a CPU every kind, the graph round's early exit emulated.
    cut_modes = [graph_mode] if graphs else ["host", "device"] + ([GRAPH_EMULATED] if device.type != "cuda" else [])
    optional("cut_rounds", lambda: cut_round_section(draft, plan, cut_modes, budget, skipped))
    # Then the prefill and the pool inserts (seconds each, never measured on a GPU in the code
    # as it is: on 2026-11-28 the budget ran out in the rounds before them), the eager profile,
    # the tile sweep, the other rounds, and last the graph round's profile: profiling CUDA graph
    # replays with CUPTI is where a run may hang (pytorch#135003), and a hang there loses only it.
    if "prefill" in args.skip:
        skipped["prefill"] = "skipped: --skip prefill"
    else:
        if not graphs:
            skipped["prefill/graph"] = "skipped: no CUDA (graph prefill needs CUDA graphs)" if device.type != "cuda" \
                else "skipped: --skip graph"
        res["prefill"] = section("prefill", lambda: prefill_section(draft, plan, graphs, budget, skipped))
        checkpoint()
    optional("inserts", lambda: insert_section(draft.vocab_size, plan, device, graphs))
    profile(profiles[1])
    tiles()
    rounds([c for c in cases if c not in first])
    profile(profiles[0])
    del draft
    gc.collect()


def print_summary(res: dict) -> None:
    m = res.get("modeled")
    if m:
        print(f"[modeled speedup over no speculation] target t(n) {m['target_curve']}, counters {m['counters']}")
        for name, v in m["variants"].items():
            vals = ", ".join(f"{r['row']} {r['modeled']:.2f}x" + (
                f" ({r['modeled_with_target_step']:.2f}x with our step's work)" if "modeled_with_target_step" in r
                else "") for r in v["rows"]) if v else res["skipped"].get(
                f"modeled/{name}", "-")
            print(f"  {name}: {vals}")
    for k, v in res["skipped"].items():
        if not k.startswith("modeled/"):
            print(f"[{k}] {v}")
    print("[acceptance]")
    for a in res["acceptance"]:
        print(f"  {a['name']}: {_ms(a['value'])} {a['unit']}{_others(a)}; target {a['op']} {a['target']}: "
              f"{a['status']}")
    kt = res.get("kernel_tiles") or {}
    for d, v in (kt.get("head_dims") or {}).items():
        b = v["best"]
        what = "interpreted: not a timing" if kt["interpreted"] else "the `_TILES` entry to set" + (
            f"; over {len(v['configs'])} of {v['of_configs']} configurations" if len(v["configs"]) < v["of_configs"] else "")
        print(f"[kernel tiles] D={d}: shipped tiles worst {v['shipped_worst_ratio']:.2f}x SDPA" + (
            f"; best swept {tuple(b['tiles'])} worst {b['worst_ratio']:.2f}x ({what})"
            if b else "; none swept (budget)"))
    if res["errors"]:
        print(f"[errors] {', '.join(res['errors'])} (tracebacks in the JSON)")


def _others(a: dict) -> str:
    """' (host 24.8, device 5.1)': the same measurement in the other drafting modes, if any."""
    vals = ", ".join(f"{m} {_ms(v)}" for m, v in a["other_modes"].items() if v is not None)
    return f" ({vals})" if vals else ""


if __name__ == "__main__":
    sys.exit(main())
