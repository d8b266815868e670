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
