"""draft/fusion_choice.py: which of the draft's optional fusions an engine keeps after timing
them at load. The decision with given timings (either side faster, per width, ties), the
switch left as the caller set it where there is nothing to choose or the timing fails, the
widths where a fusion does not change the forward left untimed, both switches judged together
(every combination timed, what fails left out); then the real timer on the
tiny draft (Triton under the interpreter on a CPU, compiled on CUDA): the forms' outputs are
the same and the choice is what its own timings say."""

import logging
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, bare_proposer, needs_triton, set_triton_interpret

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
set_triton_interpret(True)
try:
    import bench_gpu
    from vllm_ouroboros import LOGGER_NAME
    from vllm_ouroboros.draft import fusion_choice as fc
    from vllm_ouroboros.draft.model import NORM_GEMM_MAX_ROWS, DraftModel
    from vllm_ouroboros.kernels import norm_gemm as ng
finally:
    set_triton_interpret(False)


@pytest.fixture
def draft(tiny_models):
    m = DraftModel.from_pretrained(tiny_models["draft"], dtype=torch.float32, device=DEVICE)
    m.fused_ops = True
    m.norm_gemm = True
    m.allocate_cache(2, 128)
    return m


def fake_timer(ms: dict, seen: list):
    """timer(model, n): a call returning the seconds ms[(switch at the timer's making, n)]
    (a graph captures the switch as set then); each call records the switch as it runs."""
    def make(model, n):
        captured = model.norm_gemm
        return lambda: seen.append(model.norm_gemm == captured) or ms[(captured, n)] / 1e3
    return make


@pytest.mark.parametrize("on_ms,off_ms,kept", [
    ((1.0, 2.0), (1.5, 2.5), True),   # faster at both widths
    ((1.0, 2.0), (0.9, 1.9), False),  # slower at both
    ((0.5, 3.0), (1.0, 2.0), False),  # faster at decode, slower in all
    ((1.0, 2.0), (1.0, 2.0), False),  # a tie keeps what needs no Triton products
])
def test_keeps_the_form_that_takes_less_time_in_all(draft, on_ms, off_ms, kept):
    widths = (1, 34)
    ms = {(True, n): t for n, t in zip(widths, on_ms)} | {(False, n): t for n, t in zip(widths, off_ms)}
    seen = []
    t = fc.choose(draft, "norm_gemm", widths, graphs=False, reps=3, timer=fake_timer(ms, seen))
    assert t.kept is kept and draft.norm_gemm is kept
    assert t.widths == widths and t.on_ms == pytest.approx(on_ms) and t.off_ms == pytest.approx(off_ms)
    # each call ran under the switch its timer was made with (an eager timer needs that)
    assert seen and all(seen) and len(seen) == 2 * len(widths) * (1 + 3)
    assert ("on" if kept else "off") in t.describe()


def test_the_fastest_repetition_counts(draft):
    """A disturbed repetition does not decide: each form's fastest does."""
    times = {True: iter([9.0, 1.0, 1.0, 1.0]), False: iter([9.0, 8.0, 1.2, 1.1])}

    def make(model, n):
        form = model.norm_gemm
        return lambda: next(times[form]) / 1e3
    t = fc.choose(draft, "norm_gemm", [1], graphs=False, reps=3, timer=make)
    assert t.kept and t.on_ms == pytest.approx((1.0,)) and t.off_ms == pytest.approx((1.1,))


def test_nothing_to_choose_leaves_the_switch(draft):
    calls = []
    timer = lambda model, n: calls.append(n) or (lambda: 0.001)  # noqa: E731
    draft.norm_gemm = False  # not wanted, or its check failed: stays off, untimed
    assert fc.choose(draft, "norm_gemm", [1, 34], False, timer=timer) is None and not draft.norm_gemm
    draft.norm_gemm = True  # no width where it changes the forward: left on (inert), untimed
    assert fc.choose(draft, "norm_gemm", [NORM_GEMM_MAX_ROWS + 1], False, timer=timer) is None
    assert draft.norm_gemm
    draft.fused_ops = False  # without the fused layers neither fusion changes anything
    assert fc.choose(draft, "norm_gemm", [1], False, timer=timer) is None
    # RoPE inside the attention changes a forward only where the attention kernel runs it
    draft.fused_ops, draft.attention_backend = True, "torch"
    assert not fc.applies(draft, "rope_in_attention", 1)
    assert fc.choose(draft, "rope_in_attention", [1], False, timer=timer) is None
    assert calls == []


def test_only_the_widths_it_changes_are_timed(draft):
    calls = []

    def make(model, n):
        calls.append(n)
        return lambda: 0.001 * (1 if model.norm_gemm else 2)
    t = fc.choose(draft, "norm_gemm", [34, 1, 1, 200], False, reps=1, timer=make)
    assert t.widths == (1, 34) and sorted(set(calls)) == [1, 34] and t.kept


def test_bad_arguments_are_refused(draft):
    with pytest.raises(ValueError, match="unknown fusion"):
        fc.choose(draft, "fused_ops", [1], False)
    with pytest.raises(ValueError, match="positive token counts"):
        fc.choose(draft, "norm_gemm", [0, 4], False)


def test_a_failed_timing_leaves_the_switch_on_and_raises(draft):
    def make(model, n):
        if not model.norm_gemm:
            raise RuntimeError("capture failed")
        return lambda: 0.001
    with pytest.raises(RuntimeError, match="capture failed"):
        fc.choose(draft, "norm_gemm", [1], False, timer=make)
    assert draft.norm_gemm


def both_timer(ms: dict, seen: list):
    """timer(model, n) for both switches: seconds ms[(rope, norm_gemm, n)] as set at the
    timer's making; each call records whether it ran under that form."""
    def make(model, n):
        form = (model.rope_in_attention, model.norm_gemm)
        return lambda: seen.append((model.rope_in_attention, model.norm_gemm) == form) or ms[(*form, n)] / 1e3
    return make


def test_choose_all_judges_the_switches_together(draft, caplog):
    """Every combination is timed and the fastest kept. Timed one after the other (RoPE first,
    beside the products still on, as before) these timings would keep neither: RoPE loses
    beside the slow products (3.50 vs 3.48 ms), then the products go off (2.58 ms), where RoPE
    without the products is the fastest form (2.507 ms)."""
    draft.rope_in_attention = True
    draft.attention_backend = "triton"  # so that RoPE inside the attention applies here
    ms = {(True, True, 1): 1.30, (True, True, 34): 2.20, (False, True, 1): 1.28, (False, True, 34): 2.20,
          (True, False, 1): 1.168, (True, False, 34): 1.339, (False, False, 1): 1.20, (False, False, 34): 1.38}
    seen = []
    log = logging.getLogger(LOGGER_NAME)  # vLLM's logging config may stop it propagating
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
            out = fc.choose_all(draft, [34, 1], False, reps=2, timer=both_timer(ms, seen))
    finally:
        log.removeHandler(caplog.handler)
    assert draft.rope_in_attention and not draft.norm_gemm
    assert len(seen) == 4 * 2 * (1 + 2) and all(seen)  # 4 forms x 2 widths, warm-up and 2 reps
    rope, prod = out
    assert (rope.name, rope.widths, rope.kept, prod.name, prod.kept) == (
        "rope_in_attention", (1, 34), True, "norm_gemm", False)
    # each side: the fastest combination with the switch on / off
    assert rope.on_ms == pytest.approx((1.168, 1.339)) and rope.off_ms == pytest.approx((1.20, 1.38))
    assert prod.on_ms == pytest.approx((1.28, 2.20)) and prod.off_ms == pytest.approx((1.168, 1.339))
    assert "rope_in_attention on (on vs off: 1 tokens 1.168 vs 1.200 ms, 34 tokens 1.339 vs 1.380 ms)" \
        in caplog.text and "norm_gemm off (on vs off:" in caplog.text
    # only the named switches: RoPE is left as it is, the products timed beside it
    draft.norm_gemm, seen[:] = True, []
    (only,) = fc.choose_all(draft, [1, 34], False, names=["norm_gemm"], reps=1, timer=both_timer(ms, seen))
    assert only.name == "norm_gemm" and not only.kept and draft.rope_in_attention and len(seen) == 2 * 2 * 2


def test_choose_all_turns_off_what_fails_while_timed(draft, caplog):
    """In the engine (choose_all) a fusion whose forwards all fail while timed goes off with a
    warning; the combinations without it are still timed and chosen among."""
    draft.rope_in_attention = True
    draft.attention_backend = "triton"

    def make(model, n):
        if model.norm_gemm:
            raise RuntimeError("out of resources: shared memory (test)")
        return lambda: 0.001 if model.rope_in_attention else 0.002

    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(caplog.handler)
    try:
        out = fc.choose_all(draft, [1], False, reps=1, timer=make)
    finally:
        log.removeHandler(caplog.handler)
    assert [t.name for t in out] == ["rope_in_attention"] and out[0].kept
    assert draft.rope_in_attention and not draft.norm_gemm
    assert "norm_gemm is off: its forward failed while timed" in caplog.text
    assert ("forward with rope_in_attention and norm_gemm failed while timed (RuntimeError: out of resources"
            in caplog.text)
    # every form failing: every switch off
    draft.rope_in_attention = draft.norm_gemm = True

    def broken(model, n):
        raise RuntimeError("no device (test)")
    assert fc.choose_all(draft, [1], False, reps=1, timer=broken) == []
    assert not draft.rope_in_attention and not draft.norm_gemm


@pytest.mark.usefixtures("one_thread", "triton_interpreter")
@needs_triton(ng, ng.norm_gemm_kernel)
def test_real_timer_on_the_tiny_draft(draft):
    """The real timer (eager here; CUDA graphs on a GPU with graphs=True): the two forms draft
    the same tokens, both forms were timed, and the switch is left as the timings say."""
    from vllm_ouroboros.cost_model import draft_forward_timer

    tokens = {}
    for on in (True, False):  # the forward the timer runs, by hand: its greedy tokens
        draft.norm_gemm = on
        ids = torch.arange(3, 9, device=DEVICE)[None]
        draft.kv.reserve([0], [16 + 6])
        h = draft.forward(ids, torch.arange(16, 22, device=DEVICE)[None], torch.zeros(1, dtype=torch.long,
                          device=DEVICE), torch.full((1,), 16, device=DEVICE),
                          torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril()[None], max_cache_len=16)
        tokens[on] = draft.greedy_tokens(h)
    assert torch.equal(tokens[True], tokens[False])
    draft.norm_gemm = True
    assert draft_forward_timer(draft, 6, prefix=16)() > 0
    t = fc.choose(draft, "norm_gemm", [1, 6], graphs=torch.cuda.is_available(), prefix=16, reps=2)
    assert t.widths == (1, 6) and all(x > 0 for x in t.on_ms + t.off_ms)
    assert t.kept is (sum(t.on_ms) < sum(t.off_ms)) and draft.norm_gemm is t.kept


@pytest.mark.parametrize("norm_gemm", [None, True])
def test_the_engine_times_rope_always_and_the_products_when_auto(draft, monkeypatch, norm_gemm):
    """OuroborosProposer._choose_fusions (called at load on CUDA): RoPE inside the attention is
    always timed, the norm-in-product kernels only where draft_norm_gemm is auto; at a decode
    forward and the configured lookahead width, graph replays in the graph round, behind a
    prefix the initial cache length leaves room for."""
    from vllm_ouroboros.config import OuroborosConfig

    calls = []
    monkeypatch.setattr(fc, "choose_all", lambda *a, **k: calls.append((a, k)) or [])
    p = bare_proposer()
    p.cfg = OuroborosConfig(draft_model="unused", draft_norm_gemm=norm_gemm, window_size=4, num_guesses=4)
    assert p._choose_fusions(draft, "graph", 2048) == []
    p._choose_fusions(draft, "device", 40)
    (a1, k1), (a2, k2) = calls
    assert a1 == (draft, [1, 2 + 8 * p.cfg.phrase_len])
    assert k1["names"] == (["rope_in_attention", "norm_gemm"] if norm_gemm is None else ["rope_in_attention"])
    assert k1["graphs"] and not k2["graphs"]
    assert k1["prefix"] == 256 and k2["prefix"] == 40 - (2 + 8 * p.cfg.phrase_len)


@pytest.mark.usefixtures("one_thread", "triton_interpreter")
@needs_triton(ng, ng.norm_gemm_kernel)
def test_bench_gpu_section_on_the_tiny_draft():
    """scripts/bench_gpu.py's fusion_choice section on a CPU (the interpreter, eager timings;
    the benchmark itself runs it on CUDA only): both fusions checked, the products timed where
    they change the forward, the table rendered."""
    model, _ = bench_gpu.load_model("draft", None, True, torch.float32, torch.device(DEVICE))
    model.attention_backend = "triton"  # the kernel (interpreted here), as CUDA's auto runs it
    out = bench_gpu.fusion_choice_section(model, bench_gpu.Plan(tiny=True), graphs=False, reps=1)
    assert out["norm_gemm_check"] is None and out["attention_check"] is None
    assert [t["name"] for t in out["timings"]] == ["rope_in_attention", "norm_gemm"]
    for t in out["timings"]:
        assert t["widths"] == out["widths"] and t["kept"] is (sum(t["on_ms"]) < sum(t["off_ms"]))
    lines = bench_gpu._md_fusion_choice(out)
    assert sum(line.startswith("| norm_gemm |") for line in lines) == len(out["widths"])
