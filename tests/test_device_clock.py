"""Device clocks (no sync of their own) and the runner patch that times the target's forward."""

import time
from types import SimpleNamespace

import pytest
import torch

from vllm_ouroboros.device_clock import DeviceClock, ForwardClock
from vllm_ouroboros.patches import model_runner


def _work(device):
    x = torch.randn(256, 256, device=device)
    for _ in range(20):
        x = x @ x / 256
    return x


def test_device_clock_measures_the_work_between_start_and_stop(device):
    clock = DeviceClock(device)
    assert clock.seconds() == 0.0  # never started
    assert clock.start()
    _work(device)
    clock.stop()
    if device == "cuda":
        torch.cuda.synchronize()
    assert clock.seconds() > 0 and clock.seconds(wait=False) > 0


def test_forward_clock_gives_each_forward_once(device):
    clock = ForwardClock(device)
    assert clock.take() is None
    clock.start(7)
    _work(device)
    assert clock.take() is None  # not stopped: no reading
    clock.stop()
    if device == "cuda":
        torch.cuda.synchronize()
    tokens, seconds = clock.take()
    assert tokens == 7 and seconds > 0
    assert clock.take() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_no_reading_from_a_forward_captured_in_a_graph(device):
    """vLLM captures its forwards at load through the same runner method: an event recorded
    while capturing would become part of the graph, so such a forward gives no reading."""
    if device != "cuda":
        pytest.skip("the test device is not CUDA (OUROBOROS_TEST_DEVICE)")
    from vllm_ouroboros.cuda_graph import capture_graph

    clock = ForwardClock(device)
    x = torch.zeros(64, device=device)

    def run(_):
        clock.start(64)
        x.add_(1)
        clock.stop()

    graph = capture_graph(run, device)  # its warm-up ran eagerly, then the capture
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 2
    assert clock.take() is None  # the capture's start dropped the warm-up's reading, gave none


class _Runner:
    """What the patched _model_forward reads of a model runner."""

    def __init__(self, drafter, busy=None):
        self.drafter, self.busy = drafter, busy
        self.calls = []

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **kwargs):
        self.calls.append((input_ids, positions, inputs_embeds, kwargs))
        if self.busy is not None:
            self.busy()
        return "hidden"


def _busy(device):
    """About 20 ms of the device's time, or more (a stand-in forward's work)."""
    if device == "cuda":
        return lambda: torch.cuda._sleep(int(1e8))  # 10^8 cycles: 50 ms at 2 GHz
    return lambda: time.sleep(0.02)


def _taken(clock, device):
    """The clock's reading once the device is done (in the engine the step's sampled tokens
    have reached the host by the time the proposer takes it)."""
    if device == "cuda":
        torch.cuda.synchronize()
    return clock.take()


def test_patched_forward_times_the_target_with_its_token_count(device):
    forward = model_runner._model_forward(_Runner._model_forward)
    drafter = SimpleNamespace(is_ouroboros=True, target_clock=ForwardClock(device))
    runner = _Runner(drafter, busy=_busy(device))
    ids, pos = torch.zeros(5, dtype=torch.long), torch.arange(5)
    assert forward(runner, input_ids=ids, positions=pos, intermediate_tensors=None,
                   inputs_embeds=None, extra=1) == "hidden"
    assert runner.calls[-1][0] is ids and runner.calls[-1][1] is pos and runner.calls[-1][3] == {"extra": 1}
    tokens, seconds = _taken(drafter.target_clock, device)
    assert tokens == 5 and seconds >= 0.015, seconds  # the forward's own time, no less
    # M-RoPE positions are [3, n]; embeddings instead of ids.
    forward(runner, input_ids=None, positions=torch.zeros(3, 9, dtype=torch.long),
            inputs_embeds=torch.zeros(9, 4))
    assert _taken(drafter.target_clock, device)[0] == 9
    forward(runner, input_ids=None, positions=None, inputs_embeds=torch.zeros(4, 4))
    assert _taken(drafter.target_clock, device)[0] == 4
    # Another drafter (or none, or a TP rank that does not draft): vLLM's forward untouched.
    for other in (None, SimpleNamespace(is_ouroboros=False), SimpleNamespace(is_ouroboros=True, target_clock=None)):
        r = _Runner(other)
        assert forward(r, input_ids=ids, positions=pos) == "hidden" and len(r.calls) == 1


def test_a_renamed_forward_parameter_is_refused_naming_the_supported_versions():
    """The patch reads _model_forward's parameters by name: a vLLM that renamed one is refused
    at apply() with the supported versions, not timed wrong; an override is checked through
    the original it wraps."""
    pytest.importorskip("vllm", reason="the error names the installed vLLM's version")
    from vllm_ouroboros.patches._util import require_params

    def model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                      inputs_embeds=None, **kwargs):
        return None

    require_params(model_forward, "input_ids", "positions", "inputs_embeds")
    override = model_runner._model_forward(model_forward)
    override.__ouroboros_original__ = model_forward
    require_params(override, "input_ids", "positions", "inputs_embeds")

    def renamed(self, input_ids=None, pos=None, **kwargs):
        return None

    with pytest.raises(RuntimeError, match=r"positions.*Supported vLLM versions"):
        require_params(renamed, "input_ids", "positions", "inputs_embeds")


def test_an_interval_not_stopped_has_no_reading(device):
    clock = DeviceClock(device)
    clock.start()
    assert clock.seconds(wait=False) is None and clock.seconds() is None
