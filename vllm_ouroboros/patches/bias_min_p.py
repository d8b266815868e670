"""Sampling area: logit_bias and min_p on every row a speculative step verifies.

vLLM 0.32 refuses both with any speculative method (`SamplingParams._validate_spec_decode`):
its rejection sampler applies them to the bonus row of each request only, not to the rows of the
drafted tokens. Both are the same function of a row whatever the position (a fixed bias per
token; a mask of the tokens whose probability after temperature is below min_p times the
row's top one), so ouroboros applies them to all of a request's rows before verification,
exactly as vLLM's Sampler applies them to its one row without speculation:
  - the tree walk (tree_verify.sample): bias on every row of the request, in float32 as vLLM's
    Sampler adds it; min_p after temperature, before top-k / top-p (`processed_logits`);
  - vLLM's rejection sampler (the fallback for the features the walk cannot apply), inside it:
    the bias on the drafted tokens' rows before its penalties (a wrapper of its
    apply_logits_processors: its Sampler adds the bias first too), min_p between its
    temperature and its top-k / top-p (a wrapper of apply_sampling_constraints); its own Sampler
    applies both to the bonus rows. It keeps the raw rows for logprobs, as without the two.
Logprobs stay those of the raw logits, as vLLM's default logprobs mode reports them.

`apply()` (every process, at plugin registration) lets requests with logit_bias or min_p into
an engine whose speculative method is ouroboros; other methods keep vLLM's refusal.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ouroboros.host_copy import to_device
from vllm_ouroboros.patches._util import patch_method, require, require_params
from vllm_ouroboros.patches.engine_args import is_ouroboros

SAMPLING_EPS = 1e-5  # vLLM's Sampler (vllm/v1/sample/sampler.py): temperature below this is greedy


def _validate_spec_decode(original):
    def validate_spec_decode(self, speculative_config):
        if is_ouroboros(speculative_config):
            return None
        return original(self, speculative_config)

    return validate_spec_decode


def apply() -> None:
    from vllm.sampling_params import SamplingParams

    require_params(SamplingParams._validate_spec_decode, "speculative_config")
    require(SamplingParams, "min_p", "logit_bias")
    patch_method(SamplingParams, "_validate_spec_decode", _validate_spec_decode)


def _build_logitsprocs(original):
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if is_pooling_model or custom_logitsprocs or not is_ouroboros(vllm_config.speculative_config):
            return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        # vLLM keeps only min_tokens once speculation is configured: these rows get all three.
        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    return build_logitsprocs


def _apply_logits_processors(original):
    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        bias, _ = active_processors(sampling_metadata)
        if bias is not None:  # the drafted tokens' rows (float32), grouped by request
            d = np.asarray(metadata.num_draft_tokens, np.int64)
            add_bias(logits, bias, np.cumsum(d) - d, d)
        return original(self, logits, sampling_metadata, metadata)

    return apply_logits_processors


def _apply_sampling_constraints(original):
    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        _, min_p = active_processors(sampling_metadata)
        if min_p is not None and not sampling_metadata.all_greedy:
            # Here vLLM's rejection sampler has applied the processors and penalties to the
            # drafted tokens' rows; next it divides by temperature and applies top-k / top-p.
            # vLLM's Sampler applies min_p between the two: mask what it would mask there.
            B = cu_num_draft_tokens.shape[0]
            counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
            temp = sampling_metadata.temperature[:B].to(torch.float32)
            temp = torch.where(temp < SAMPLING_EPS, torch.ones_like(temp), temp)
            n = logits.shape[0]
            row_temp = temp.repeat_interleave(counts, output_size=n)
            row_min_p = min_p_per_request(min_p, B).to(logits.device).repeat_interleave(counts, output_size=n)
            logits.masked_fill_(min_p_mask(logits / row_temp[:, None], row_min_p), float("-inf"))
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    return apply_sampling_constraints


def apply_worker() -> None:
    """In the worker, before the model runner builds its input batch (the proposer's
    constructor runs first): give ouroboros engines vLLM's logit_bias and min_p processors,
    which vLLM leaves out of speculative engines, and both in its rejection sampler (where
    neither processor exists, i.e. in other engines, the wrappers do nothing)."""
    from vllm.v1.sample import logits_processor, rejection_sampler
    from vllm.v1.sample.logits_processor import builtin
    from vllm.v1.worker import gpu_model_runner

    require(logits_processor, "BUILTIN_LOGITS_PROCESSORS", "LogitsProcessors")
    require(builtin, "LogitBiasLogitsProcessor", "MinPLogitsProcessor")
    # add_bias reads the processor's device tables, which its constructor makes.
    require(builtin.LogitBiasLogitsProcessor(None, torch.device("cpu"), False),
            "biases", "logits_slice", "bias_tensor")
    require(gpu_model_runner, "build_logitsprocs")
    require(rejection_sampler, "apply_sampling_constraints", "RejectionSampler")
    require_params(rejection_sampler.RejectionSampler.apply_logits_processors, "logits",
                   "sampling_metadata", "metadata")
    original = gpu_model_runner.build_logitsprocs
    if getattr(original, "__ouroboros_original__", None) is None:
        require_params(original, "vllm_config", "device", "is_pin_memory", "is_pooling_model",
                       "custom_logitsprocs")
        override = _build_logitsprocs(original)
        override.__ouroboros_original__ = original
        gpu_model_runner.build_logitsprocs = override
    patch_method(rejection_sampler.RejectionSampler, "apply_logits_processors", _apply_logits_processors)
    original = rejection_sampler.apply_sampling_constraints
    if getattr(original, "__ouroboros_original__", None) is None:
        require_params(original, "logits", "cu_num_draft_tokens", "sampling_metadata")
        override = _apply_sampling_constraints(original)
        override.__ouroboros_original__ = original
        rejection_sampler.apply_sampling_constraints = override


def active_processors(sm):
    """(vLLM's LogitBiasLogitsProcessor, MinPLogitsProcessor) of the batch, each None unless a
    request in the batch uses it."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    bias = min_p = None
    for p in sm.logitsprocs.all:
        if isinstance(p, LogitBiasLogitsProcessor) and p.biases:
            bias = p
        elif isinstance(p, MinPLogitsProcessor) and (require(p, "min_p_count", "min_p") or p.min_p_count):
            min_p = p
    return bias, min_p


def add_bias(logits: torch.Tensor, proc, row_start: np.ndarray, num_rows: np.ndarray) -> None:
    """Add each request's logit_bias to its rows, in place.

    logits: [rows, vocab] float32; proc: vLLM's LogitBiasLogitsProcessor, whose device
    tensors list the batch's (request index, token, bias) entries (`logits_slice`,
    `bias_tensor`: [E] each, rebuilt by its update_state at each batch change, as its own
    apply reads them); row_start [B] and num_rows [B]: the rows of each request to bias
    (host). On the device, without a Python loop over requests: each entry is spread over
    max(num_rows) rows, those past its request's rows (or of a request index past the batch,
    which vLLM's table may hold while the batch shrinks) adding 0 to row 0. A (row, token) gets
    exactly its one bias (a request's tokens are distinct) plus zeros, so the sum is exact
    whatever order the device accumulates in, and equals vLLM's `logits[slice] += bias`.
    """
    req, tok = proc.logits_slice
    B, M = len(row_start), int(np.max(num_rows, initial=0))
    if req.numel() == 0 or B == 0 or M == 0:
        return
    start_t, n_t = to_device(logits.device, np.asarray(row_start, np.int64), np.asarray(num_rows, np.int64))
    req = req.to(torch.int64)
    in_batch = req < B
    r = req.clamp(max=B - 1)
    j = torch.arange(M, device=logits.device)
    valid = in_batch[:, None] & (j[None, :] < n_t[r][:, None])  # [E, M]
    rows = torch.where(valid, start_t[r][:, None] + j[None, :], 0)
    vals = torch.where(valid, proc.bias_tensor.to(logits.dtype)[:, None], 0.0)
    toks = tok.to(torch.int64)[:, None].expand(-1, M)
    logits.index_put_((rows.reshape(-1), toks.reshape(-1)), vals.reshape(-1), accumulate=True)


def min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's MinPLogitsProcessor test on temperature-scaled float32 logits x [rows, vocab] with
    min_p [rows]: True where a token's probability is below min_p times the row's top one."""
    probs = torch.softmax(x, dim=-1)
    return probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None]


def min_p_per_request(proc, B: int) -> torch.Tensor:
    """[B] float32 min_p of the batch's requests (0 where unset), on the processor's device."""
    return proc.min_p.reshape(-1)[:B]
