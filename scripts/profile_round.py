"""Where a drafting round's time goes, by region of our code: device activities (kernels,
copies) launched, device time and host time per round, from torch.profiler. Issue 15 asks to
fuse what the profile says costs; this is that profile, taken on the lent GPU in the same call
as the timings (scripts/bench_gpu.py, section "profile").

Two views of one setting (scripts/bench_gpu.py's RoundRunner):
  device  the device round run eagerly: every kernel is launched by the code that asks for it,
          so each one is charged to the innermost region below that was running (the regions
          are torch.profiler.record_function ranges wrapped around our functions for the
          profile only, then restored);
  graph   the graph round (CUDA): the same kernels replayed from CUDA graphs, where no Python
          runs to attribute them: totals, the device's busy share of the wall time (near 1:
          the GPU's own work bounds the round; far below: gaps between replays), and the
          device time by kernel name (which of the round's kernels cost what).
On a CPU there are no device activities: host time per region only (what --tiny tests).
No vLLM imports.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from collections.abc import Callable, Iterator

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

# (label, owner, attribute): owner a module path (a module-level function, patched where the
# caller looks it up at call time) or "module:Class" (a method). Innermost wins: the "rest"
# regions get what their nested regions do not take.
REGIONS = (
    ("round, rest", "vllm_ouroboros.draft.device_round:DeviceRound", "run"),
    ("round: row inputs (masks, positions)", "vllm_ouroboros.draft.device_round", "row_inputs"),
    ("round: read output (window, guesses)", "vllm_ouroboros.draft.device_round", "read_output"),
    ("round: bookkeeping (torch)", "vllm_ouroboros.draft.device_round", "commit_torch"),
    ("pool: lookup", "vllm_ouroboros.pool:PhrasePool", "lookup"),
    ("pool: insert", "vllm_ouroboros.pool:PhrasePool", "insert"),
    ("draft forward, rest (embedding, RoPE rows)", "vllm_ouroboros.draft.model:DraftModel", "forward"),
    ("draft: attention metadata", "vllm_ouroboros.draft.model", "build_attention_metadata"),
    ("draft layer, rest (residuals, SiLU*up)", "vllm_ouroboros.draft.model:DraftLayer", "forward"),
    ("draft layer, rest (fused)", "vllm_ouroboros.draft.model:DraftLayer", "forward_fused"),
    ("draft: matrix products", "vllm_ouroboros.draft.model:DraftLayer", "project"),
    ("draft: RMSNorm", "vllm_ouroboros.draft.model", "rms_norm"),
    ("draft: RoPE", "vllm_ouroboros.draft.model", "apply_rope"),
    ("draft: KV write", "vllm_ouroboros.draft.model", "write_kv"),
    ("draft: attention", "vllm_ouroboros.draft.model", "masked_attention"),
    ("draft: attention with RoPE + KV write", "vllm_ouroboros.draft.model", "rope_masked_attention"),
    ("draft: fused add+RMSNorm", "vllm_ouroboros.kernels.fused_ops", "add_rms_norm"),
    ("draft: fused RoPE + KV write", "vllm_ouroboros.kernels.fused_ops", "rope_qkv_write"),
    ("draft: fused SiLU*up", "vllm_ouroboros.kernels.fused_ops", "silu_mul"),
    ("draft: LM head + argmax", "vllm_ouroboros.draft.model:DraftModel", "greedy_tokens"),
)
OUTSIDE = "(outside every region)"


def _owner(spec: str):
    module, _, cls = spec.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, cls) if cls else mod


@contextlib.contextmanager
def annotated(regions=REGIONS) -> Iterator[None]:
    """Each region's function wrapped in a record_function range of its label, restored after."""
    saved = []
    try:
        for label, spec, attr in regions:
            owner = _owner(spec)
            fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

            def wrapped(*a, __fn=fn, __label=label, **k):
                with record_function(__label):
                    return __fn(*a, **k)

            saved.append((owner, attr, fn))
            setattr(owner, attr, functools.wraps(fn)(wrapped))
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def profile_rounds(run_round: Callable[[], object], rounds: int, device: torch.device,
                   attribute: bool) -> dict:
    """Profile `rounds` calls of run_round (after one more unprofiled, to warm up); returns
    summarize()'s figures per round. attribute: wrap the regions (an eager round)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with annotated() if attribute else contextlib.nullcontext():
        run_round()
        sync()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(rounds):
                run_round()
            sync()
            wall_ms = 1000 * (time.perf_counter() - t0)
    return {**summarize(prof.events(), rounds, wall_ms), "attributed": attribute}


# The most device time by kernel name a profile keeps (`kernels`): in a graph-replayed round,
# where no region can be charged, the names are what says where the time goes.
KERNELS_KEPT = 25


def summarize(events, rounds: int, wall_ms: float) -> dict:
    """Per round: wall ms, device activities and their ms (all of them), and per region its
    calls, the device activities charged to it and their ms, its host ms (exclusive of nested
    regions), largest device time first (host time where there is none); and `kernels`: the
    device activities by name (calls and ms per round, the KERNELS_KEPT largest), which a
    graph-replayed round, whose replays no region can be charged with, is read by.

    Device activities are charged through the CPU event the profiler links them to (the op, or
    the range, that launched them), to that event's innermost region."""
    labels = {label for label, _, _ in REGIONS}
    device_events = [e for e in events if e.device_type != DeviceType.CPU]
    rows: dict[str, dict] = {}

    def row(label: str) -> dict:
        return rows.setdefault(label, {"region": label, "calls": 0, "device_activities": 0,
                                       "device_ms": 0.0, "host_ms": 0.0})

    def region_of(e) -> str:
        while e is not None and e.name not in labels:
            e = e.cpu_parent
        return OUTSIDE if e is None else e.name

    charged = 0
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if e.name in labels:
            r = row(e.name)
            r["calls"] += 1
            nested = _nested_regions(e, labels)
            r["host_ms"] += (e.cpu_time_total - sum(c.cpu_time_total for c in nested)) / 1000
        if e.kernels:
            r = row(region_of(e))
            r["device_activities"] += len(e.kernels)
            r["device_ms"] += sum(k.duration for k in e.kernels) / 1000
            charged += len(e.kernels)
    device_ms = sum(e.time_range.elapsed_us() for e in device_events) / 1000
    if len(device_events) > charged:  # launched where the profiler linked them to no CPU event
        r = row("(not linked to a CPU event)")
        r["device_activities"] += len(device_events) - charged
        r["device_ms"] += max(device_ms - sum(x["device_ms"] for x in rows.values()), 0.0)
    per = lambda v: v / rounds  # noqa: E731
    by_name: dict[str, list] = {}
    for e in device_events:
        k = by_name.setdefault(e.name, [0, 0.0])
        k[0] += 1
        k[1] += e.time_range.elapsed_us() / 1000
    kernels = sorted(({"name": name, "calls": per(n), "device_ms": per(ms)} for name, (n, ms) in by_name.items()),
                     key=lambda k: -k["device_ms"])
    out_rows = [{"region": r["region"], "calls": per(r["calls"]),
                 "device_activities": per(r["device_activities"]), "device_ms": per(r["device_ms"]),
                 "host_ms": per(r["host_ms"])} for r in rows.values()]
    out_rows.sort(key=lambda r: (-r["device_ms"], -r["host_ms"]))
    return {"rounds": rounds, "wall_ms": per(wall_ms), "device_ms": per(device_ms),
            "device_activities": per(len(device_events)),
            "device_busy": device_ms / wall_ms if wall_ms else None, "regions": out_rows,
            "kernels": kernels[:KERNELS_KEPT]}


def _nested_regions(e, labels: set[str]) -> list:
    """The region events nearest below e (not below another region)."""
    out, todo = [], list(e.cpu_children)
    while todo:
        c = todo.pop()
        if c.name in labels:
            out.append(c)
        else:
            todo.extend(c.cpu_children)
    return out


def report_lines(name: str, p: dict, top: int = 8) -> list[str]:
    """`[profile]` lines: the totals, then the `top` regions, and for a round whose kernels
    no region could be charged with (a graph-replayed round: p["attributed"] False) the `top`
    kernels by name."""
    busy = "" if p["device_busy"] is None or not p["device_activities"] else \
        f", device busy {p['device_ms']:.2f} ms ({100 * p['device_busy']:.0f}% of the wall)"
    lines = [f"[profile] {name}: {p['wall_ms']:.2f} ms/round wall{busy}, "
             f"{p['device_activities']:.0f} device activities/round"]
    for r in p["regions"][:top] if p["regions"] else []:
        lines.append(f"[profile]   {r['region']:<46} {r['calls']:6.1f} calls {r['device_activities']:7.1f} act "
                     f"{r['device_ms']:8.3f} device ms {r['host_ms']:8.3f} host ms  (per round)")
    if not p.get("attributed", True):
        for k in p.get("kernels", [])[:top]:
            lines.append(f"[profile]   kernel {k['name'][:70]:<70} {k['calls']:6.1f} calls "
                         f"{k['device_ms']:8.3f} device ms  (per round)")
    return lines
