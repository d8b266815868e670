"""Tensor parallelism (vLLM internals: the TP group coordinator of vllm.distributed).

Under tensor parallelism every rank has its own model runner and its own proposer, and the runner
patch on each rank builds the target's token tree from what its proposer says it proposed. The
ranks must agree on every draft to the token, and much of what decides a draft is measured, not
computed: the cost curves behind the phrase-drafting switch and the back-off, the engine's step
overhead. So the first rank of each TP group drafts and hands its proposals and their layouts to
the others (`TensorParallel.share`), which load no draft model at all. Collectives that both
sides run (the target's cost curve: vLLM's row-parallel layers all-reduce) take their stopping
decision from the first rank too (`TensorParallel.agree`).
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class TensorParallel:
    """This process's place in its TP group (a single rank when vLLM set up no model parallelism,
    e.g. a proposer built in a unit test)."""

    def __init__(self, group=None):
        self._group = group
        self.size = 1 if group is None else int(group.world_size)
        self.rank = 0 if group is None else int(group.rank_in_group)

    @classmethod
    def current(cls) -> "TensorParallel":
        """The TP group vLLM initialised in this worker, if any."""
        from vllm.distributed import parallel_state

        from vllm_ouroboros.patches._util import require

        require(parallel_state, "model_parallel_is_initialized", "get_tp_group")
        if not parallel_state.model_parallel_is_initialized():
            return cls(None)
        group = parallel_state.get_tp_group()
        require(group, "broadcast_object", "world_size", "rank_in_group", "cpu_group")
        return cls(group if group.world_size > 1 else None)

    @property
    def leads(self) -> bool:
        """Whether this rank drafts (the first rank of the group; a lone rank always)."""
        return self.rank == 0

    def share(self, value: T | None) -> T:
        """The first rank's `value` on every rank (a collective: all ranks call it in the same
        order; the others pass None). Objects are pickled: keep them small (host arrays)."""
        if self.size == 1:
            return value
        return self._group.broadcast_object(value if self.leads else None, src=0)

    def agree(self, decision: bool) -> bool:
        """The first rank's boolean decision on every rank (each passes its own)."""
        return bool(self.share(bool(decision)))

    def all_ok(self, ok: bool) -> bool:
        """True on every rank where every rank passes True (a collective on the group's host
        side: a rank whose device work failed can still take part)."""
        if self.size == 1:
            return bool(ok)
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group.cpu_group)
        return bool(flag.item())
