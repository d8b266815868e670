"""The target's cost curve at load (patches/target_cost.py) on stand-in vLLM models: a pipeline
stage whose first layers are placeholders is timed from a layer it holds, and the fallback's
parameter count reads the linear modules' shapes (vLLM's CPU linear methods drop the weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm", reason="stands in vLLM's linear modules; vLLM is not installed here")

from vllm.model_executor.layers.linear import LinearBase  # noqa: E402
from vllm.model_executor.models.utils import PPMissingLayer  # noqa: E402

from vllm_ouroboros.patches.target_cost import measure_target_curve, target_parameter_count  # noqa: E402


class Linear(LinearBase):
    """A LinearBase without vLLM's parallel state; `dropped`: the weight emptied after packing,
    as vLLM's CPU UnquantizedLinearMethod leaves it."""

    def __init__(self, k: int, n: int, dropped: bool = False):
        nn.Module.__init__(self)
        self.input_size, self.output_size = k, n
        self.input_size_per_partition, self.output_size_per_partition = k, n
        self.packed = torch.randn(n, k) * 0.01
        self.weight = nn.Parameter(torch.empty(0) if dropped else self.packed.clone(), requires_grad=False)

    def forward(self, x):
        return x @ self.packed.T


class Layer(nn.Module):
    def __init__(self, dropped=False):
        super().__init__()
        self.qkv, self.o = Linear(64, 192, dropped), Linear(64, 64, dropped)
        self.norm = nn.Parameter(torch.ones(64), requires_grad=False)


class Target(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(layers)
        self.model.embed = nn.Parameter(torch.zeros(100, 64), requires_grad=False)


def test_a_pipeline_stage_is_timed_from_a_layer_it_holds():
    stage = Target([PPMissingLayer(), PPMissingLayer(), Layer(), Layer()])
    curve = measure_target_curve(stage, 8, reps=1)
    assert curve is not None and all(t > 0 for t in curve.seconds)
    assert measure_target_curve(Target([PPMissingLayer()]), 8, reps=1) is None  # nothing to time


def test_the_fallbacks_parameter_count_reads_the_shapes():
    per_layer = 64 * 192 + 64 * 64 + 64
    embed = 100 * 64
    whole = Target([Layer(dropped=True), Layer(dropped=True)])
    assert target_parameter_count(whole) == 2 * per_layer + embed
    assert sum(p.numel() for p in whole.parameters()) == 2 * 64 + embed  # what numel() saw
    # The last of two pipeline stages holds half the layers: the step runs all of them.
    stage = Target([PPMissingLayer(), Layer(dropped=True)])
    assert target_parameter_count(stage) == pytest.approx(2 * (per_layer + embed))


class _RowParallel(Linear):
    """A row-parallel stand-in: its product all-reduces across the ranks, as vLLM's does; on
    `fail_rank` its inputs cannot be made from `fail_at` tokens on (input_size_per_partition
    raising, as a layer of another layout or an allocation would)."""

    def __init__(self, k, n, rank, fail_rank, fail_at):
        nn.Module.__init__(self)
        self.input_size, self.output_size, self.output_size_per_partition = k, n, n
        self.packed = torch.randn(n, k) * 0.01
        self._k, self.rank, self.fail_rank, self.fail_at, self.seen = k, rank, fail_rank, fail_at, 0

    @property
    def input_size_per_partition(self):
        self.seen += 1  # one read per point
        if self.rank == self.fail_rank and self.seen >= self.fail_at:
            raise MemoryError("inputs for this point (test)")
        return self._k

    def forward(self, x):
        import torch.distributed as dist

        y = x @ self.packed.T
        dist.all_reduce(y)
        return y


def _tp_rank(rank: int, port: int, fail_rank: int, out) -> None:
    import torch.distributed as dist

    from vllm_ouroboros.patches.distributed import TensorParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = type("Group", (), {"world_size": 2, "rank_in_group": rank, "cpu_group": dist.group.WORLD,
                                   "broadcast_object": lambda self, v, src=0: _broadcast(v, src)})()
        tp = TensorParallel(group)
        layer = nn.Module()
        # The second point (n = 2): always measured (the stop rule reads two points at least).
        layer.o = _RowParallel(64, 64, rank, fail_rank, fail_at=2)
        curve = measure_target_curve(Target([layer]), 64, reps=1, agree=tp.agree, all_ok=tp.all_ok)
        out.put((rank, curve))
    finally:
        dist.destroy_process_group()


def _broadcast(value, src):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_rank_that_cannot_prepare_a_point_falls_back_with_the_others(fail_rank):
    """Under tensor parallelism the ranks time the row-parallel products together. One rank
    failing to make a point's inputs left the loop alone while the others waited in the
    products' all-reduce (or, before that fix, raised: a failed engine start where a lone rank
    falls back). Every rank now learns it before the products and all fall back (None)."""
    import multiprocessing
    import queue
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, fail_rank, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        # Each rank imports vLLM first (~9 s alone here): 600 s, not a tight bound, to tell a
        # rank left waiting in an all-reduce from a slow start on a loaded machine.
        deadline = time.monotonic() + 600
        while len(got) < len(procs):
            try:
                rank, curve = out.get(timeout=5)
                got[rank] = curve
            except queue.Empty:
                died = {p.name: p.exitcode for p in procs if p.exitcode not in (None, 0)}
                assert not died, f"a rank died: {died}"
                assert time.monotonic() < deadline, f"ranks still timing after 600 s; reported: {got}"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == {0: None, 1: None}
