"""vLLM's oneDNN GEMM for the draft model on CPU (vLLM internals: `vllm._custom_ops`).

vLLM runs the target's linear layers on x86 CPUs through oneDNN with prepacked weights
(`dispatch_cpu_unquantized_gemm`). Our draft runtime used torch's `F.linear`, whose cost jumps once
a product has 4 or more rows: on the 2-core AVX2 machine, one Qwen2.5-0.5B decoder layer's four
products take 3.2 / 4.8 / 8.5 ms for 1 / 4 / 16 rows with `F.linear` against 4.2 / 3.6 / 5.0 ms
with oneDNN, and its LM head 37 / 67 / 90 ms against 34 / 35 / 55 ms (`scripts/draft_gemm_cost.py`).
A flatter draft cost curve is what makes phrase drafting (many tokens per draft forward) pay on
CPU, so the draft uses oneDNN from MIN_ROWS rows on and `F.linear` below, where it is faster.
The price is a prepacked copy of the draft's weights (about 1.2x their size) beside the originals.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from vllm_ouroboros.draft.model import Gemm, GemmFactory

logger = logging.getLogger("vllm_ouroboros")

# Rows (tokens in the product) from which oneDNN beats F.linear on the machines we measured.
MIN_ROWS = 4
# oneDNN primitive cache entries per weight (vLLM's own choice in dispatch_cpu_unquantized_gemm).
_PRIMITIVE_CACHE = 32


def onednn_gemm_factory(min_rows: int = MIN_ROWS) -> GemmFactory | None:
    """A GemmFactory using vLLM's oneDNN product for inputs of >= min_rows rows, or None (logged)
    where this vLLM build has no oneDNN GEMM (non-x86 builds, other vLLM versions)."""
    try:
        from vllm import _custom_ops as ops

        if not getattr(ops, "_supports_onednn", False):
            logger.info("ouroboros: vLLM build has no oneDNN GEMM; the draft uses torch F.linear")
            return None
        create, run = ops.create_onednn_mm, ops.onednn_mm
    except (ImportError, AttributeError) as e:
        logger.info("ouroboros: no oneDNN GEMM in this vLLM (%s); the draft uses torch F.linear", e)
        return None

    def make(weight: torch.Tensor) -> Gemm:
        handle = create(weight.t(), _PRIMITIVE_CACHE)

        def gemm(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if x.numel() < min_rows * x.shape[-1]:
                return F.linear(x, weight, bias)
            return run(handle, x.contiguous(), bias)
        return gemm
    return make
