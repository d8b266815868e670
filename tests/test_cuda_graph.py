"""vllm_ouroboros/cuda_graph.capture_graph, the one capture routine of the project, checked on any
machine with a stand-in for torch.cuda that records the calls: warm-ups on a side stream that
waits for the current one, then the capture into the given pool (inference mode if asked),
the graph handed to the function being captured; on CUDA, a real capture replays."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from vllm_ouroboros import cuda_graph


class FakeCuda:
    def __init__(self, log):
        self.log = log
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

            def wait_stream(self, other):
                fake.log.append(f"{self.name} waits for {other.name}")

        class CUDAGraph:
            pass

        self.Stream, self.CUDAGraph = Stream, CUDAGraph
        self._current = SimpleNamespace(name="main", wait_stream=lambda o: log.append(f"main waits for {o.name}"))

    def current_stream(self, device=None):
        return self._current

    @contextlib.contextmanager
    def stream(self, s):
        self.log.append(f"on {s.name}")
        yield
        self.log.append(f"off {s.name}")

    @contextlib.contextmanager
    def graph(self, g, pool=None):
        self.log.append(f"capture (pool {pool})")
        yield
        self.log.append("end capture")


@pytest.mark.parametrize("inference", [False, True])
def test_warmups_on_a_side_stream_then_the_capture(monkeypatch, inference):
    log = []
    monkeypatch.setattr(torch, "cuda", FakeCuda(log))
    seen = []

    def run(graph):
        seen.append((graph, torch.is_inference_mode_enabled()))
        log.append("run")

    g = cuda_graph.capture_graph(run, "cuda:0", pool="P", warmups=2, inference=inference)
    assert log == ["side waits for main", "on side", "run", "run", "off side", "main waits for side",
                   "capture (pool P)", "run", "end capture"]
    assert [x[0] for x in seen] == [None, None, g]
    assert [x[1] for x in seen] == [False, False, inference]


def test_real_capture_replays(device):
    if device != "cuda":
        pytest.skip("a real capture needs the CUDA test device (OUROBOROS_TEST_DEVICE)")
    x = torch.ones(4, device="cuda")
    out = torch.zeros(4, device="cuda")
    g = cuda_graph.capture_graph(lambda _: out.copy_(x * 2), torch.device("cuda"))
    x.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [6.0] * 4
