"""Which of the draft's optional fusions stay on, chosen by timing them on this device at load.

Two of the draft's fusions trade one cost for another, and which side wins depends on the GPU,
the dtype and the model's shapes, so neither can be a fixed default:

- `rope_in_attention`: RoPE and the KV write inside the tree-attention launch. One launch fewer
  per layer, for a heavier attention program (more registers, the rotation done per tree tile).
- `norm_gemm`: add+RMSNorm inside the qkv and gate_up products and SiLU*up as gate_up's
  epilogue (kernels/norm_gemm.py). Three launches fewer per layer, for Triton weight-streaming
  products in place of cuBLAS's.

`choose_all` times the draft's forward in every combination of the switches, at the widths a
drafting round runs (a decode forward and a lookahead forward), the way the round runs them
(replayed from CUDA graphs where the round is graph-captured), and keeps the combination whose
forwards take the least time in all: each switch is judged beside the other as it will serve.
(Timed one after the other they were not: on an H200 RoPE's comparison ran with the slow
products still on, 2.197 vs 2.196 ms at 34 tokens, and the products then went off; results/
README.md, "Session of 2026-11-28 (fifth)".) `choose` does the same for one switch. The forms'
timings alternate, so a clock that drifts (boost, another process) charges all alike.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_ouroboros import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

# The switches `choose` and `choose_all` may time (the order of choose_all's results).
FUSIONS = ("rope_in_attention", "norm_gemm")

# Timed replays per form and width (the fastest counts, after one warm-up). A graph-replayed
# draft forward is 1-3 ms on a GPU: a choice costs well under a second at load.
REPS = 10


@dataclass(frozen=True)
class FusionTiming:
    """One switch's timing: ms per forward at each width with it on and off (with several
    switches: the fastest combination with it on / off), and whether it was kept on (on_ms
    summed below off_ms summed)."""

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


def _time_forms(model, switches: Sequence[str], widths: tuple[int, ...], make: Callable,
                reps: int) -> tuple[dict, dict]:
    """Each combination ("form") of `switches` on / off, every switch on first: ({form: [ms at
    each width]} of those whose forwards ran, the fastest of `reps` timed calls after a warm-up,
    calls alternating across forms; {form: the exception} of those whose timer or a call
    raised). The switches are left as the last call set them."""

    def set_form(form) -> None:
        for s, on in zip(switches, form):
            setattr(model, s, on)

    runs, failed = {}, {}
    for form in itertools.product((True, False), repeat=len(switches)):
        try:
            for n in widths:
                set_form(form)  # a timer captures the form as set where it captures a graph
                run = make(model, n)
                runs[form, n] = lambda run=run, form=form: (set_form(form), run())[1]
                runs[form, n]()  # warm-up: compiles, allocates, loads the weights into caches
        except Exception as e:  # noqa: BLE001 - the caller decides what a failure means
            failed[form] = e
    ok = [f for f in dict.fromkeys(f for f, _ in runs) if f not in failed]
    times = {(f, n): [] for f in ok for n in widths}
    for _ in range(reps):
        for n in widths:
            for f in ok:
                if f not in failed:
                    try:
                        times[f, n].append(runs[f, n]())
                    except Exception as e:  # noqa: BLE001
                        failed[f] = e
    return {f: [min(times[f, n]) * 1e3 for n in widths] for f in ok if f not in failed}, failed


def _fastest(forms: dict):
    """The form of least total time; a tie: the one with fewer switches on (the plainer one)."""
    return min(forms, key=lambda f: (sum(forms[f]), sum(f)), default=None)


def choose(model, name: str, widths: Sequence[int], graphs: bool, prefix: int = 0, reps: int = REPS,
           timer: Callable | None = None) -> FusionTiming | None:
    """Time model's forward with the switch `name` (one of FUSIONS) on and off and leave it
    on only where the forwards over `widths` (tokens in one row) take less time in all.

    Only the widths where the switch changes the forward (`applies`) are timed. A switch that
    is off already (not wanted, or its check failed), or changes none of the widths, is left
    as it is and None is returned: there is nothing to choose. A timing that fails leaves the
    switch on (as the caller set it) and raises. graphs: time CUDA-graph replays (the graph
    round); eager forwards otherwise. prefix: cached tokens behind each forward (slot 0's pages;
    what they hold does not matter for a timing). timer(model, n) -> a callable returning one
    forward's seconds (cost_model.draft_forward_timer by default); a timer built while the
    switch is set captures that form where it captures a graph, and runs under the switch as
    set where it runs eagerly, so each call sets it first."""
    if name not in FUSIONS:
        raise ValueError(f"unknown fusion {name!r}: one of {FUSIONS}")
    if not getattr(model, name):
        return None
    widths = _checked_widths(widths)
    widths = tuple(n for n in widths if applies(model, name, n))
    if not widths:
        return None
    try:
        forms, failed = _time_forms(model, [name], widths, timer or _timer_factory(graphs, prefix), reps)
        if failed:
            raise next(iter(failed.values()))
    except BaseException:
        setattr(model, name, True)  # as the caller set it; the failure is theirs to report
        raise
    kept = _fastest(forms) == (True,)
    setattr(model, name, kept)
    return FusionTiming(name, widths, tuple(forms[True,]), tuple(forms[False,]), kept)


def _checked_widths(widths: Sequence[int]) -> tuple[int, ...]:
    if any(int(n) < 1 for n in widths):
        raise ValueError(f"widths must be positive token counts, got {tuple(widths)}")
    return tuple(sorted(set(int(n) for n in widths)))


def choose_all(model, widths: Sequence[int], graphs: bool, prefix: int = 0,
               names: Sequence[str] = FUSIONS, reps: int = REPS,
               timer: Callable | None = None) -> list[FusionTiming]:
    """Time the draft's forward in every combination of the switches of `names` that are on
    and change a forward of `widths` (`applies`), and keep the combination whose forwards take
    the least time in all (a tie: the one with fewer switches on); each switch's timing is
    logged and returned, in FUSIONS order (on_ms / off_ms: the fastest combination with it on /
    off, nan where none ran). The widths timed are those where some switch changes the forward.

    A combination whose forward fails while timed is left out, with a warning; a switch whose
    every combination with it on failed goes off, with a warning: what cannot be timed is not
    served either (where every combination fails, every switch goes off). graphs, prefix, reps
    and timer as `choose`'s."""
    widths = _checked_widths(widths)
    switches = [s for s in FUSIONS if s in names and getattr(model, s) and any(applies(model, s, n) for n in widths)]
    if not switches:
        return []
    widths = tuple(n for n in widths if any(applies(model, s, n) for s in switches))
    forms, failed = _time_forms(model, switches, widths, timer or _timer_factory(graphs, prefix), reps)
    for form, e in failed.items():
        on = " and ".join(s for s, x in zip(switches, form) if x) or "neither optional fusion"
        logger.warning("ouroboros: the draft's forward with %s failed while timed (%s: %s)",
                       on, type(e).__name__, e)
    chosen = _fastest(forms) or (False,) * len(switches)
    for s, on in zip(switches, chosen):
        setattr(model, s, on)
    out = []
    for i, s in enumerate(switches):
        side = {on: _fastest({f: t for f, t in forms.items() if f[i] is on}) for on in (True, False)}
        if side[True] is None:
            logger.warning("ouroboros: the draft's %s is off: its forward failed while timed", s)
            continue
        ms = {on: tuple(forms[f]) if f is not None else (float("nan"),) * len(widths) for on, f in side.items()}
        t = FusionTiming(s, widths, ms[True], ms[False], chosen[i])
        logger.info("ouroboros: the draft's %s", t.describe())
        out.append(t)
    return out
