"""The cost rules that pick phrase drafting and back off speculation under load."""

import torch

from vllm_ouroboros import cost_model
from vllm_ouroboros.cost_model import CostCurve
from vllm_ouroboros.draft.model import DraftModel

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0,) * 8)
# This repository's CPU machine, measured for the 0.5B draft (scripts/benchmark.py prints it).
CPU = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (0.127, 0.138, 0.271, 0.315, 0.367, 0.484, 0.662, 1.098))


def test_curve_interpolates_and_extrapolates_linearly():
    c = CostCurve((1, 2, 4), (1.0, 2.0, 2.0))
    assert c(0) == 1.0 and c(1.5) == 1.5 and c(3) == 2.0
    c = CostCurve((1, 2, 4), (1.0, 2.0, 4.0))
    assert c(8) == 8.0  # slope of the last segment
    assert c.ratio(4) == 4.0


def test_phrase_drafting_on_when_flat_off_when_compute_bound():
    n = 2 + (4 + 4) * 4
    assert cost_model.phrase_drafting_pays(FLAT, n)
    assert not cost_model.phrase_drafting_pays(CPU, n)


def test_flat_curve_always_speculates():
    for batch in (1, 16, 256):
        assert cost_model.speculation_pays(FLAT, batch, 12, 1.0, 8, 34, 1.0)


def test_compute_bound_backs_off_with_load():
    # Real-pair numbers with phrase drafting off: E = 4.7 tokens per target forward, 4.3 draft
    # forwards per step of ~2 tokens, r = 0.32.
    args = dict(spec_tokens=12, tokens_per_forward=4.7, draft_forwards=4.3, draft_row_tokens=2,
                param_ratio=0.32)
    assert cost_model.speculation_pays(CPU, 1, **args)
    assert not cost_model.speculation_pays(CPU, 16, **args)
    # Poor acceptance: not worth it even alone.
    assert not cost_model.speculation_pays(CPU, 1, **{**args, "tokens_per_forward": 1.5})


def test_measured_curve_is_monotone_and_bounded(tiny_models, one_thread):
    model = DraftModel.from_pretrained(str(tiny_models["draft"]), dtype=torch.float32, device="cpu")
    model.allocate_cache(1, 40)
    c = cost_model.measure_draft_curve(model, 40)
    assert c.n == (1, 2, 4, 8, 16, 32)
    assert all(b >= a > 0 for a, b in zip(c.seconds, c.seconds[1:]))
