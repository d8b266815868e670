"""vLLM's oneDNN GEMM for the draft model on CPU (vLLM internals: `vllm._custom_ops`).

vLLM runs the target's linear layers on x86 CPUs through oneDNN with prepacked weights
(`dispatch_cpu_unquantized_gemm`). Our draft runtime used torch's `F.linear`, whose cost for a few
rows depends on the machine's BLAS path: on one 2-core AVX2 machine a Qwen2.5-0.5B draft forward
of 1 / 2 tokens took 123 / 134 ms either way while 4+ rows doubled with F.linear only; on another
(same image, a different host) F.linear took 193 / 391 / 540 ms for 1 / 2 / 3 tokens, its LM head
47 / 104 / 167 ms against 26 / 32 / 35 ms with oneDNN (`scripts/draft_gemm_cost.py`). oneDNN was
never measurably slower, so the draft uses it for every product (MIN_ROWS = 1). A flat draft cost
curve is also what makes phrase drafting (many tokens per draft forward) pay on CPU.
The price is a prepacked copy of the draft's weights (about 1.2x their size) beside the originals.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.draft.model import Gemm, GemmFactory

logger = logging.getLogger(LOGGER_NAME)

# Rows (tokens in the product) from which the draft uses oneDNN; F.linear below (see above).
MIN_ROWS = 1
# oneDNN primitive cache entries per weight (vLLM's own choice in dispatch_cpu_unquantized_gemm).
_PRIMITIVE_CACHE = 32


def onednn_gemm_factory(min_rows: int = MIN_ROWS,
                        dtype: torch.dtype = torch.float32) -> GemmFactory | None:
    """A GemmFactory using vLLM's oneDNN product for `dtype` weights and inputs of >= min_rows
    rows, or None (logged) where this vLLM build has no oneDNN GEMM (non-x86 builds, other vLLM
    versions) or this CPU has none for `dtype` (bfloat16 without AVX-512: oneDNN cannot create
    the primitive, seen on this repository's AVX2 machines)."""
    try:
        from vllm import _custom_ops as ops

        if not getattr(ops, "_supports_onednn", False):
            logger.info("ouroboros: vLLM build has no oneDNN GEMM; the draft uses torch F.linear")
            return None
        create, run = ops.create_onednn_mm, ops.onednn_mm
    except (ImportError, AttributeError) as e:
        logger.info("ouroboros: no oneDNN GEMM in this vLLM (%s); the draft uses torch F.linear", e)
        return None
    try:
        create(torch.zeros(16, 16, dtype=dtype).t(), 1)
    except RuntimeError as e:
        logger.info("ouroboros: oneDNN has no %s GEMM on this CPU (%s); the draft uses torch "
                    "F.linear", dtype, str(e).splitlines()[0])
        return None

    def make(weight: torch.Tensor) -> Gemm:
        handle = create(weight.t(), _PRIMITIVE_CACHE)

        def gemm(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            # The primitive reads x as the weight's dtype: another gives garbage, not an error.
            if x.numel() < min_rows * x.shape[-1] or x.dtype != weight.dtype:
                return F.linear(x, weight, bias)
            return run(handle, x.contiguous(), bias)
        return gemm
    return make
