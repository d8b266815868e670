"""The target's cost curve t_target(n), measured on its own weights at load (vLLM internals:
the decoder layers and linear modules of vLLM's model classes).

A vLLM forward cannot be run outside the runner's forward context, but at these sizes its cost is
its matrix products: time the linear modules of one decoder layer on n tokens, times the number
of layers, plus the LM head over n rows. Attention over short contexts, norms and activations are
left out (small next to the products). The LM head runs over all n rows, as in a verification
step (not once, as in a prefill). On a GPU without tensor parallelism both are replayed from CUDA
graphs, as vLLM runs its target (timed eagerly they would cost their kernel launches). Used by
the back-off and the drafting decisions (cost_model.py).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.cost_model import CostCurve, call_timer, measure_curve

logger = logging.getLogger(LOGGER_NAME)


def _single_rank() -> bool:
    """No tensor parallelism: the row-parallel products all-reduce across ranks otherwise,
    which a CUDA graph of our own must not capture (vLLM captures its collectives itself)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size() == 1
    except Exception:  # noqa: BLE001 - not knowing is not single
        return False


class _NotPrepared(Exception):
    """Some rank could not prepare a point's inputs: every rank leaves before its products."""


def measure_target_curve(target_model, max_tokens: int, reps: int = 3,
                         agree: Callable[[bool], bool] = bool,
                         all_ok: Callable[[bool], bool] = bool) -> CostCurve | None:
    """t_target(n) in seconds (cost_model.measure_curve; fastest of `reps` matters most here:
    one layer's time is multiplied by the layer count), or None (logged) where the model's
    layout is not the usual `model.layers[i]` with vLLM linear modules or a point's inputs
    cannot be made. Under tensor parallelism every rank must call this (the row-parallel layers
    all-reduce) with `agree` taking the first rank's decision to go on and `all_ok` every
    rank's readiness for a point (patches/distributed.TensorParallel.agree, all_ok)."""
    measuring = False
    try:
        from vllm.model_executor.layers.linear import LinearBase

        layers = target_model.model.layers
        # The first layer this rank holds: under pipeline parallelism the drafter sits on the
        # last stage, whose earlier layers are placeholders without products.
        linears = next((found for layer in layers
                        if (found := [m for m in layer.modules() if isinstance(m, LinearBase)])), [])
        head = getattr(target_model, "lm_head", None)
        head_w = getattr(head, "weight", None)
        if not linears:
            raise ValueError("no decoder layer has vLLM linear modules")
        p = next(target_model.parameters())
        dev, dtype = p.device, p.dtype if p.dtype.is_floating_point else torch.float16
        graphs = dev.type == "cuda" and _single_rank()
        # The LM head as vLLM's LogitsProcessor runs it (its quant method: on CPU the prepacked
        # GEMM). F.linear stood in before and, on a host where it costs 2-3x per extra row,
        # made the curve 1.4x steeper than the real verification step's from 4 tokens on.
        apply = getattr(getattr(head, "quant_method", None), "apply", None)
        head_product = ((lambda x: apply(head, x, bias=None)) if apply is not None
                        else (lambda x: torch.nn.functional.linear(x, head_w)))

        def timer_at(n: int):
            xs = [torch.randn(n, getattr(m, "input_size_per_partition", m.input_size), device=dev,
                              dtype=dtype) for m in linears]
            hx = (torch.randn(n, head_w.shape[1], device=dev, dtype=head_w.dtype)
                  if head_w is not None and head_w.dim() == 2 else None)

            def products():
                for m, x in zip(linears, xs):
                    m(x)

            with torch.inference_mode():
                layer = call_timer(products, dev, graphs, f"the target layer's products on {n} tokens")
                head_t = (call_timer(lambda: head_product(hx), dev, graphs, f"the LM head on {n} rows")
                          if hx is not None else (lambda: 0.0))

            @torch.inference_mode()
            def run() -> float:
                return layer() * len(layers) + head_t()
            return run

        def prepared(n: int):
            # Where one rank cannot make a point's inputs (device memory, a linear module
            # without the input sizes read here), all ranks learn it before any of them enters
            # the products' all-reduce, and all fall back together, as a lone rank does. A
            # product that raises (inside the collective) still stops the start.
            try:
                run, error = timer_at(n), None
            except Exception as e:  # noqa: BLE001 - shared with the other ranks first
                run, error = None, e
            if not all_ok(error is None):
                raise _NotPrepared(f"{type(error).__name__}: {error}" if error is not None
                                   else "another tensor-parallel rank could not prepare its inputs")
            return run

        measuring = True
        return measure_curve(prepared, max_tokens, reps, agree)
    except Exception as e:  # any unexpected layout: the back-off falls back to the draft's curve
        if measuring and not isinstance(e, _NotPrepared) and not _single_rank():
            # Under tensor parallelism the ranks time collectives together (the row-parallel
            # all-reduce, `agree`): one rank leaving the loop alone (an out-of-memory error on
            # the first rank, which alone holds the draft) would leave the others waiting in
            # it for good. A loud start-up failure instead (a point's inputs: _NotPrepared).
            raise
        logger.info("ouroboros: target cost curve not measured (%s); back-off uses the draft's "
                    "curve scaled by the parameter ratio", e)
        return None


def target_parameter_count(target_model) -> float:
    """The parameters of the target's whole forward on this rank, for the fallback curve (the
    draft's scaled by the size ratio): the linear modules counted from their shapes (vLLM's CPU
    linear methods drop the weight tensors after packing them: numel() would count the
    embeddings and norms alone, a 7B target as ~1.1B), the other parameters by numel(), and
    under pipeline parallelism the stages this rank does not hold counted as the ones it does
    (the step runs them all)."""
    from vllm.model_executor.layers.linear import LinearBase

    total, counted = 0, set()
    for m in target_model.modules():
        if isinstance(m, LinearBase):
            total += (getattr(m, "input_size_per_partition", m.input_size)
                      * getattr(m, "output_size_per_partition", m.output_size))
            counted.update(id(p) for p in m.parameters(recurse=False))
    total += sum(p.numel() for p in target_model.parameters() if id(p) not in counted)
    layers = getattr(getattr(target_model, "model", None), "layers", None)
    if layers is not None and len(layers):
        held = sum(any(isinstance(m, LinearBase) for m in layer.modules()) for layer in layers)
        if 0 < held < len(layers):
            total *= len(layers) / held
    return float(total)
