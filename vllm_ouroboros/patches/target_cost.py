"""The target's cost curve t_target(n), measured on its own weights at load (vLLM internals:
the decoder layers and linear modules of vLLM's model classes).

A vLLM forward cannot be run outside the runner's forward context, but at these sizes its cost is
its matrix products: time the linear modules of one decoder layer on n tokens, times the number
of layers, plus the LM head over n rows. Attention over short contexts, norms and activations are
left out (small next to the products). Used by the back-off under load (cost_model.py).
"""

from __future__ import annotations

import logging
import time

import torch

from vllm_ouroboros.cost_model import STOP_RATIO, CostCurve

logger = logging.getLogger("vllm.ouroboros")


def measure_target_curve(target_model, max_tokens: int, reps: int = 3) -> CostCurve | None:
    """t_target(n) for n = 1, 2, 4, ... <= max_tokens in seconds (until t(n) > STOP_RATIO t(1);
    fastest of `reps` after one warm-up: one layer's time is multiplied by the layer count, so a
    single disturbed repetition would inflate the whole curve), or None (logged) where the
    model's layout is not the usual `model.layers[i]` with vLLM linear modules."""
    try:
        from vllm.model_executor.layers.linear import LinearBase

        layers = target_model.model.layers
        linears = [m for m in layers[0].modules() if isinstance(m, LinearBase)]
        head = getattr(target_model, "lm_head", None)
        head_w = getattr(head, "weight", None)
        if not linears:
            raise ValueError("decoder layer 0 has no vLLM linear modules")
        p = next(target_model.parameters())
        dev, dtype = p.device, p.dtype if p.dtype.is_floating_point else torch.float16
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        points, times, n = [], [], 1
        while n <= max_tokens and (not times or times[-1] <= STOP_RATIO * times[0]):
            xs = [torch.randn(n, getattr(m, "input_size_per_partition", m.input_size), device=dev,
                              dtype=dtype) for m in linears]
            hx = (torch.randn(n, head_w.shape[1], device=dev, dtype=head_w.dtype)
                  if head_w is not None and head_w.dim() == 2 else None)
            ts = []
            for _ in range(reps + 1):
                sync()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for m, x in zip(linears, xs):
                        m(x)
                layer = time.perf_counter() - t0
                t0 = time.perf_counter()
                if hx is not None:
                    with torch.inference_mode():
                        torch.nn.functional.linear(hx, head_w)
                sync()
                ts.append(layer * len(layers) + time.perf_counter() - t0)
            points.append(n)
            times.append(min(ts[1:]))
            n *= 2
        for i in range(1, len(times)):
            times[i] = max(times[i], times[i - 1])
        return CostCurve(tuple(points), tuple(times))
    except Exception as e:  # any unexpected layout: the back-off falls back to the draft's curve
        logger.info("ouroboros: target cost curve not measured (%s); back-off uses the draft's "
                    "curve scaled by the parameter ratio", e)
        return None
