"""Model-runner area: the target side of an Ouroboros step.

`_prepare_inputs` (patched): after vLLM laid out the step, the scheduled draft + suffixes become
    a token tree (tree_verify.begin_step: depth positions, tree rows for the attention).
`_sample` (patched): the tree walk replaces vLLM's rejection sampler for ouroboros steps, the
    accepted branch's KV is moved into place, and the target's tokens at every node go to the
    proposer's pool feedback, all before `propose()` runs in the same step.
`_update_states` (patched): the requests vLLM finished or aborted go to the proposer, which
    releases their draft slots; one that is only absent from a step (preempted, or left out by
    the token budget) keeps its slot and draft cache (request_slots.py). A request whose output
    vLLM cuts back (a failed KV load) has its draft cache checked again from the cut.
`_sample` also hands the proposer each request's length limit (prompt + max_tokens, from the
    runner's request state): the back-off weighs a draft cache that must catch up on a long
    stretch against the tokens the request has left.
`_input_fits_in_drafter` (patched): vLLM skips the drafter for the WHOLE batch once any request
    is within num_speculative_tokens of max_model_len, and then schedules that many placeholder
    drafts (not real tokens) for every request, which the proposer never made. Ours drafts per
    request up to what fits (proposer caps each row; the scheduler cuts at max_model_len too).
`_model_forward` (patched): the target's forward is timed (device_clock.ForwardClock: no sync
    of its own) with its token count; the proposer reports it against the target's cost curve
    measured at load (cost_model.CurveCalibration; the mode review reads it, mode_review.py,
    the back-off does not).
`Worker.shutdown` (patched in engine_shutdown.py): the proposer writes its pool first.
`initialize_kv_cache` (patched): once the target's KV cache is allocated, whether the tree can
    run is decided (tree_verify.prepare; on a GPU the tree kernel is compiled and checked then,
    during the engine's start, not in the first request's step).
CPUModelRunner inherits from GPUModelRunner, so one patch serves both. Runners whose drafter is
not Ouroboros take vLLM's own path untouched.
"""

from __future__ import annotations

import functools

from vllm_ouroboros.patches._util import patch_method, require, require_params

# tree_verify is imported where it is used, not here: it imports the Triton kernels, whose
# @triton.jit reads TRITON_INTERPRET at import, and modules that import this one at a test's
# collection (tests/test_device_clock.py) came before the kernel tests turn the interpreter on
# (tests/conftest.py set_triton_interpret): 135 kernel tests failed with it imported here.


def _drafter(runner):
    d = getattr(runner, "drafter", None)
    return d if getattr(d, "is_ouroboros", False) else None


def _update_states(original):
    def update_states(self, scheduler_output):
        drafter = _drafter(self)
        if drafter is not None:
            # A new request under the id of one the runner holds is a streaming-input session's
            # next segment (GPUModelRunner._update_streaming_request): its prompt, sampling
            # params and max_tokens replaced, no finished notice. Its slot starts afresh, as a
            # new request's: the draft cache and per-request limits were the old segment's.
            held = getattr(self, "requests", {})
            again = [r.req_id for r in scheduler_output.scheduled_new_reqs if r.req_id in held]
            if scheduler_output.finished_req_ids or again:
                drafter.note_finished([*scheduler_output.finished_req_ids, *again])
            rewound = _rewound_requests(held, scheduler_output.scheduled_cached_reqs)
            if rewound:
                drafter.note_rewound(*zip(*rewound))
        out = original(self, scheduler_output)
        if drafter is not None and scheduler_output.finished_req_ids and not getattr(self, "requests", True):
            # The step that removed the engine's last requests (vLLM runs one, with no tokens,
            # to tell the workers what finished): the engine is idle now.
            drafter.on_idle()
        return out

    return update_states


def _rewound_requests(held: dict, cached) -> list[tuple[str, int]]:
    """(request id, context length kept) of each request whose output vLLM cuts back in this
    `_update_states` (output tokens discarded after a failed synchronous KV load, with a KV
    connector): the tokens it regrows may differ from the draft cache's. One comparison per
    scheduled request, as vLLM's own loop over them makes."""
    rewound = []
    for req_id, kept in zip(cached.req_ids, cached.num_output_tokens):
        state = held.get(req_id)
        if state is not None and kept < len(state.output_token_ids):
            rewound.append((req_id, state.num_tokens - len(state.output_token_ids) + kept))
    return rewound


def _prepare_inputs(original):
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        drafter = _drafter(self)
        if drafter is not None:
            from vllm_ouroboros.patches import tree_verify

            self._ouroboros_step = tree_verify.begin_step(self, drafter, scheduler_output, out[1])
        return out

    return prepare_inputs


def _sample(original):
    def sample(self, logits, spec_decode_metadata):
        drafter = _drafter(self)
        if drafter is None:
            return original(self, logits, spec_decode_metadata)
        facts = self.__dict__.get("_ouroboros_request_facts")
        if facts is None:  # bound callables once per runner, not closures per step
            require(self, "requests")  # an instance attribute: checked on the first step
            facts = self._ouroboros_request_facts = (functools.partial(_length_limit, self),
                                                     functools.partial(_prompt_readable, self))
        drafter.set_batch(self.input_batch.req_ids, *facts)
        step, self._ouroboros_step = getattr(self, "_ouroboros_step", None), None
        if step is None or spec_decode_metadata is None or logits is None:
            if drafter.drafting_paused and logits is not None:
                from vllm_ouroboros.patches import tree_verify

                tree_verify.review_drafting_pause(self)
            return original(self, logits, spec_decode_metadata)
        from vllm_ouroboros.patches import tree_verify

        out, outcome = tree_verify.sample(self, original, logits, spec_decode_metadata, step)
        drafter.on_verified(self.input_batch.req_ids, outcome)
        return out

    return sample


def _model_forward(original):
    def model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        drafter = _drafter(self)
        clock = None if drafter is None else drafter.target_clock
        if clock is None:
            return original(self, input_ids, positions, *args, **kwargs)
        # Tokens in this forward (padded to a captured size on a GPU: what it costs); M-RoPE
        # positions are [3, n].
        tokens = positions.shape[-1] if positions is not None else (
            input_ids.shape[0] if input_ids is not None else kwargs["inputs_embeds"].shape[0])
        clock.start(int(tokens))
        out = original(self, input_ids, positions, *args, **kwargs)
        clock.stop()
        return out

    return model_forward


def _length_limit(runner, req_id: str) -> int | None:
    """The most tokens this request's context can reach (prompt + max_tokens); None where
    unknown. The back-off reads it once per request, when it first drafts for it. The prompt's
    length comes from CachedRequestState's fields (token ids, else embeddings), which apply()
    checks, not from an attribute its __post_init__ sets, which no check could see renamed."""
    state = runner.requests.get(req_id)
    params = None if state is None else state.sampling_params
    if params is None or params.max_tokens is None:
        return None
    if state.prompt_token_ids is not None:
        return len(state.prompt_token_ids) + params.max_tokens
    if state.prompt_embeds is not None:
        return int(state.prompt_embeds.shape[0]) + params.max_tokens
    return None


def _prompt_readable(runner, req_id: str) -> bool:
    """Whether every prompt position of the request is a token id: not where the prompt came
    as embeddings, in whole (prompt_embeds) or in part (prompt_is_token_ids false somewhere)."""
    state = runner.requests.get(req_id)
    if state is None:
        return True
    if state.prompt_token_ids is None:
        return state.prompt_embeds is None
    return state.prompt_is_token_ids is None or all(state.prompt_is_token_ids)


def _initialize_kv_cache(original):
    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, **kwargs):
        result = original(self, kv_cache_config, is_profiling, **kwargs)
        drafter = _drafter(self)
        if drafter is not None and not is_profiling:
            from vllm_ouroboros.patches import tree_verify

            tree_verify.prepare(self, drafter)
        return result

    return initialize_kv_cache


def _input_fits_in_drafter(original):
    def input_fits_in_drafter(self, common_attn_metadata):
        if _drafter(self) is not None and common_attn_metadata is not None:
            return True
        return original(self, common_attn_metadata)

    return input_fits_in_drafter


def _update_max_model_len(original):
    # vLLM fits max_model_len to the KV memory after the workers loaded (--max-model-len -1,
    # or auto): the proposer's room and length limits follow, or its proposals near the end
    # would read as the scheduler's cuts.
    def update_max_model_len(self, max_model_len: int) -> None:
        original(self, max_model_len)
        drafter = _drafter(self)
        if drafter is not None:
            drafter.update_max_model_len(max_model_len)

    return update_max_model_len


def apply() -> None:
    """Patch the V1 GPU model runner (imported already: called from the proposer's __init__)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    require(SpecDecodeMetadata, "__dataclass_fields__")
    fields = set(SpecDecodeMetadata.__dataclass_fields__)
    need = {"draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens",
            "target_logits_indices", "bonus_logits_indices", "logits_indices"}
    if not need <= fields:
        require(SpecDecodeMetadata, *sorted(need - fields))
    if "finished_req_ids" not in getattr(SchedulerOutput, "__dataclass_fields__", {}):
        require(SchedulerOutput, "finished_req_ids")
    if "has_structured_output_requests" not in getattr(SchedulerOutput, "__dataclass_fields__", {}):
        require(SchedulerOutput, "has_structured_output_requests")
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.logits_processor import builtin

    require(rejection_sampler, "apply_sampling_constraints")
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    fields = set(getattr(CachedRequestState, "__dataclass_fields__", ()))
    state_fields = ("sampling_params", "prompt_token_ids", "prompt_embeds", "prompt_is_token_ids",
                    "output_token_ids")
    if not set(state_fields) <= fields:
        require(CachedRequestState, *state_fields)
    require(CachedRequestState, "num_tokens")
    from vllm.v1.core.sched.output import CachedRequestData

    cached_fields = ("req_ids", "num_output_tokens")
    if not set(cached_fields) <= set(getattr(CachedRequestData, "__dataclass_fields__", ())):
        require(CachedRequestData, *cached_fields)
    require(builtin, "MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")
    _check_sampling_metadata()
    from vllm.v1.sample.ops import topk_topp_sampler

    require(topk_topp_sampler, "apply_top_k_top_p")
    from vllm.model_executor.layers import utils as layer_utils

    require(layer_utils, "apply_penalties")  # tree_penalties.py: every tree row, as vLLM's Sampler
    require_params(layer_utils.apply_penalties, "logits", "prompt_tokens_tensor", "output_tokens_tensor",
                   "presence_penalties", "frequency_penalties", "repetition_penalties")
    patch_method(GPUModelRunner, "_update_states", _update_states)
    patch_method(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    patch_method(GPUModelRunner, "_sample", _sample)
    patch_method(GPUModelRunner, "_input_fits_in_drafter", _input_fits_in_drafter)
    require_params(GPUModelRunner.update_max_model_len, "max_model_len")
    patch_method(GPUModelRunner, "update_max_model_len", _update_max_model_len)
    require_params(GPUModelRunner.initialize_kv_cache, "kv_cache_config", "is_profiling")
    patch_method(GPUModelRunner, "initialize_kv_cache", _initialize_kv_cache)
    require_params(GPUModelRunner._model_forward, "input_ids", "positions", "inputs_embeds")
    patch_method(GPUModelRunner, "_model_forward", _model_forward)
    from vllm_ouroboros.patches import bias_min_p, cpu_sampler, engine_shutdown

    engine_shutdown.apply_worker()  # the pool's save before vLLM tears the worker down

    cpu_sampler.apply()
    bias_min_p.apply_worker()
    # A named worker method: `collective_rpc("ouroboros_snapshot")` needs no pickled callable.
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, SNAPSHOT_METHOD):
        setattr(WorkerBase, SNAPSHOT_METHOD, worker_snapshot)


SNAPSHOT_METHOD = "ouroboros_snapshot"

# SamplingMetadata's fields in the vLLM versions supported, each read by the tree walk or
# refused by tree_verify.unsupported_sampling (which then leaves the batch to vLLM's sampler).
SAMPLING_FIELDS = frozenset({
    "temperature", "all_greedy", "all_random", "top_p", "top_k", "generators", "max_num_logprobs",
    "no_penalties", "prompt_token_ids", "frequency_penalties", "presence_penalties",
    "repetition_penalties", "output_token_ids", "allowed_token_ids_mask", "bad_words_token_ids",
    "logitsprocs", "logprob_token_ids", "spec_token_ids", "thinking_budget_state_holder"})


def _check_sampling_metadata() -> None:
    """Refuse a vLLM whose SamplingMetadata has fields other than the known ones: the walk
    samples the tree itself, so a sampling setting it does not know (a new field) would be
    dropped without a word and the output would no longer be vLLM's; a missing one would fail
    the first sampled step."""
    from vllm.v1.sample.metadata import SamplingMetadata

    fields = set(getattr(SamplingMetadata, "__dataclass_fields__", ()))
    if missing := SAMPLING_FIELDS - fields:
        require(SamplingMetadata, *sorted(missing))
    if unknown := fields - SAMPLING_FIELDS:
        from vllm import __version__ as version

        from vllm_ouroboros.plugin import supported_vllm_range

        raise RuntimeError(
            f"vllm-ouroboros does not know SamplingMetadata.{', '.join(sorted(unknown))} of vLLM "
            f"{version}: the tree walk would not apply those settings. Supported vLLM versions: "
            f"{supported_vllm_range()}.")


def worker_snapshot(worker) -> dict | None:
    """Ouroboros counters of one worker (installed as the worker method `ouroboros_snapshot`)."""
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "snapshot"):
        return None
    return drafter.snapshot()
