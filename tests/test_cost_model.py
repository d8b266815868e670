"""The cost rules that pick phrase drafting and back off speculation under load."""

import torch

from vllm_ouroboros import cost_model
from vllm_ouroboros.cost_model import CostCurve
from vllm_ouroboros.draft.model import DraftModel

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0,) * 8)
# This repository's CPU machine, the real pair (results/benchmark.md: 0.5B draft, 1.5B target).
CPU = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (0.116, 0.118, 0.232, 0.305, 0.324, 0.468, 0.649, 1.239))
CPU_TARGET = CostCurve((1, 2, 4, 8, 16, 32, 64, 128),
                       (0.403, 0.434, 0.424, 0.479, 0.573, 0.829, 1.271, 2.257))


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
        assert cost_model.speculation_pays(FLAT, FLAT, batch, 12, 1.0, 8, 34)


def test_compute_bound_backs_off_with_load():
    # Real-pair numbers with phrase drafting off: E = 3.75 tokens per target forward, 4.3 draft
    # forwards per step of ~2 tokens (results/benchmark.md). Measured there: draft_model k = 3
    # gains 1.37x at concurrency 1 and loses at 4 and 16.
    args = dict(spec_tokens=12, tokens_per_forward=3.75, draft_forwards=4.3, draft_row_tokens=2)
    assert cost_model.speculation_pays(CPU_TARGET, CPU, 1, **args)
    assert not cost_model.speculation_pays(CPU_TARGET, CPU, 4, **args)
    assert not cost_model.speculation_pays(CPU_TARGET, CPU, 16, **args)
    # Poor acceptance: not worth it even alone.
    assert not cost_model.speculation_pays(CPU_TARGET, CPU, 1, **{**args, "tokens_per_forward": 1.5})


def test_measured_curve_is_monotone_and_bounded(tiny_models, one_thread):
    model = DraftModel.from_pretrained(str(tiny_models["draft"]), dtype=torch.float32, device="cpu")
    model.allocate_cache(1, 40)
    c = cost_model.measure_draft_curve(model, 40)
    assert c.n[0] == 1 and c.n[-1] <= 32 and all(b == 2 * a for a, b in zip(c.n, c.n[1:]))
    assert len(c.n) == 6 or c.seconds[-1] > cost_model.STOP_RATIO * c.seconds[0]
    assert all(b >= a > 0 for a, b in zip(c.seconds, c.seconds[1:]))


def _proposer(cap=None, tokens_per_fwd=3.75):
    """An OuroborosProposer reduced to what its per-step decision reads."""
    from types import SimpleNamespace

    from vllm_ouroboros.config import OuroborosConfig
    from vllm_ouroboros.proposer import OuroborosProposer

    p = object.__new__(OuroborosProposer)
    p.cfg = OuroborosConfig(draft_model="unused", max_speculative_batch=cap)
    p.cost, p.target_cost, p.runtime = CPU, CPU_TARGET, SimpleNamespace(W=0, G=0, L=4)
    p.num_spec_tokens, p._steps_off = 12, 0
    p._mean_tokens_per_fwd, p._mean_draft_forwards = tokens_per_fwd, 4.3
    return p


def test_fixed_cap_and_auto_backoff_decisions():
    from vllm_ouroboros.proposer import PROBE_EVERY

    p = _proposer(cap=4)
    assert [p._speculate(b) for b in (1, 4, 5, 16)] == [True, True, False, False]
    p = _proposer()
    assert p._speculate(1)
    # Load alone: no probe steps however long the batch stays large.
    assert not any(p._speculate(16) for _ in range(3 * PROBE_EVERY))
    # Acceptance too low even for one request: one probe every PROBE_EVERY steps.
    p = _proposer(tokens_per_fwd=1.2)
    decisions = [p._speculate(1) for _ in range(2 * PROBE_EVERY)]
    assert sum(decisions) == 2 and decisions[PROBE_EVERY - 1]
