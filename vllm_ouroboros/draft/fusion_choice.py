"""Which of the draft's optional fusions stay on, chosen by timing them on this device at load.

Two of the draft's fusions trade one cost for another, and which side wins depends on the GPU,
the dtype and the model's shapes, so neither can be a fixed default:

- `rope_in_attention`: RoPE and the KV write inside the tree-attention launch. One launch fewer
  per layer, for a heavier attention program (more registers, the rotation done per tree tile).
- `norm_gemm`: add+RMSNorm inside the qkv and gate_up products and SiLU*up as gate_up's
  epilogue (kernels/norm_gemm.py). Three launches fewer per layer, for Triton weight-streaming
  products in place of cuBLAS's.

`choose` times the draft's forward with a switch on and off, at the widths a drafting round
runs (a decode forward and a lookahead forward), the way the round runs them (replayed from
CUDA graphs where the round is graph-captured), and keeps the switch only where the forwards
take less time in all. The two forms' timings alternate, so a clock that drifts (boost, another
process) charges both alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_ouroboros import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

# The switches `choose` may time, in the order `choose_all` times them: the attention's first,
# as the products' timing then runs with the attention that was kept.
FUSIONS = ("rope_in_attention", "norm_gemm")

# Timed replays per form and width (the fastest counts, after one warm-up). A graph-replayed
# draft forward is 1-3 ms on a GPU: a choice costs well under a second at load.
REPS = 10


@dataclass(frozen=True)
class FusionTiming:
    """One switch's timing: ms per forward at each width with it on and off, and whether it
    was kept on (on_ms summed below off_ms summed)."""

    name: str
    widths: tuple[int, ...]
    on_ms: tuple[float, ...]
    off_ms: tuple[float, ...]
    kept: bool

    def describe(self) -> str:
        pts = ", ".join(f"{n} tokens {a:.3f} vs {b:.3f} ms" for n, a, b in zip(self.widths, self.on_ms, self.off_ms))
        return f"{self.name} {'on' if self.kept else 'off'} (on vs off: {pts})"


def _timer_factory(graphs: bool, prefix: int):
    from vllm_ouroboros.cost_model import draft_forward_timer

    return lambda model, n: draft_forward_timer(model, n, graphs=graphs, prefix=prefix)


def applies(model, name: str, n: int) -> bool:
    """Whether the switch `name` changes a forward of n tokens in one row: both need the fused
    layers; RoPE inside the attention needs the tree-attention kernel to run that forward's
    attention, the products their Triton form (at most NORM_GEMM_MAX_ROWS tokens, no installed
    product such as the CPU's oneDNN GEMM)."""
    from vllm_ouroboros.draft.model import NORM_GEMM_MAX_ROWS

    if not model.fused_ops:
        return False
    if name == "rope_in_attention":
        return model.uses_attention_kernel(n)
    return n <= NORM_GEMM_MAX_ROWS and not any(layer.gemms for layer in model.layers)


def choose(model, name: str, widths: Sequence[int], graphs: bool, prefix: int = 0, reps: int = REPS,
           timer: Callable | None = None) -> FusionTiming | None:
    """Time model's forward with the switch `name` (one of FUSIONS) on and off and leave it
    on only where the forwards over `widths` (tokens in one row) take less time in all.

    Only the widths where the switch changes the forward (`applies`) are timed. A switch that
    is off already (not wanted, or its check failed), or changes none of the widths, is left
    as it is and None is returned: there is nothing to choose. graphs: time CUDA-graph replays
    (the graph round); eager forwards otherwise. prefix: cached tokens behind each forward (slot 0's pages; what
    they hold does not matter for a timing). timer(model, n) -> a callable returning one
    forward's seconds (cost_model.draft_forward_timer by default); a timer built while the
    switch is set captures that form where it captures a graph, and runs under the switch as
    set where it runs eagerly, so each call sets it first."""
    if name not in FUSIONS:
        raise ValueError(f"unknown fusion {name!r}: one of {FUSIONS}")
    if not getattr(model, name):
        return None
    if any(int(n) < 1 for n in widths):
        raise ValueError(f"widths must be positive token counts, got {tuple(widths)}")
    widths = tuple(n for n in sorted(set(int(n) for n in widths)) if applies(model, name, n))
    if not widths:
        return None
    make = timer or _timer_factory(graphs, prefix)
    best: dict[bool, list[float]] = {True: [], False: []}
    try:
        for n in widths:
            runs = {}
            for on in (True, False):
                setattr(model, name, on)
                run = make(model, n)
                runs[on] = (lambda run=run, on=on: (setattr(model, name, on), run())[1])
                runs[on]()  # warm-up: compiles, allocates, loads the weights into caches
            times = {True: [], False: []}
            for _ in range(reps):
                for on in (True, False):
                    times[on].append(runs[on]())
            for on in (True, False):
                best[on].append(min(times[on]) * 1e3)
    except BaseException:
        setattr(model, name, True)  # as the caller set it; the failure is theirs to report
        raise
    kept = sum(best[True]) < sum(best[False])
    setattr(model, name, kept)
    return FusionTiming(name, widths, tuple(best[True]), tuple(best[False]), kept)


def choose_all(model, widths: Sequence[int], graphs: bool, prefix: int = 0,
               names: Sequence[str] = FUSIONS, reps: int = REPS) -> list[FusionTiming]:
    """`choose` each switch of `names` that is on, in FUSIONS order, each logged; returns the
    timings of those timed. A switch whose forward fails while it is timed goes off, with a
    warning: what cannot be timed is not served either."""
    out = []
    for name in (n for n in FUSIONS if n in names):
        try:
            t = choose(model, name, widths, graphs, prefix, reps)
        except Exception as e:  # noqa: BLE001 - the engine starts without the fusion
            setattr(model, name, False)
            logger.warning("ouroboros: the draft's %s is off: its forward failed while timed (%s: %s)",
                           name, type(e).__name__, e)
            continue
        if t is not None:
            logger.info("ouroboros: the draft's %s", t.describe())
            out.append(t)
    return out
