"""Model-runner area: hand the target's verification output to the Ouroboros proposer.

vLLM's rejection sampler computes the target's token at every drafted position but returns
only the accepted prefix. `_sample` sees the raw target logits and the SpecDecodeMetadata, and
runs before `propose()` in the same step, so the pool learns from step t before drafting t+1.
CPUModelRunner inherits from GPUModelRunner, so one patch serves both.
"""

from __future__ import annotations

from vllm_ouroboros.patches._util import patch_method, require


def _sample(original):
    def sample(self, logits, spec_decode_metadata):
        out = original(self, logits, spec_decode_metadata)
        drafter = getattr(self, "drafter", None)
        if drafter is not None and hasattr(drafter, "on_sample"):
            drafter.on_sample(self.input_batch.req_ids, logits, spec_decode_metadata)
        return out

    return sample


def apply() -> None:
    """Patch the V1 GPU model runner (imported already: called from the proposer's __init__)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    require(SpecDecodeMetadata, "__dataclass_fields__")
    fields = set(SpecDecodeMetadata.__dataclass_fields__)
    need = {"draft_token_ids", "num_draft_tokens", "target_logits_indices", "bonus_logits_indices"}
    if not need <= fields:
        require(SpecDecodeMetadata, *sorted(need - fields))
    patch_method(GPUModelRunner, "_sample", _sample)
    # A named worker method: `collective_rpc("ouroboros_snapshot")` needs no pickled callable.
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, SNAPSHOT_METHOD):
        setattr(WorkerBase, SNAPSHOT_METHOD, worker_snapshot)


SNAPSHOT_METHOD = "ouroboros_snapshot"


def worker_snapshot(worker) -> dict | None:
    """Ouroboros counters of one worker (installed as the worker method `ouroboros_snapshot`)."""
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "snapshot"):
        return None
    return drafter.snapshot()
