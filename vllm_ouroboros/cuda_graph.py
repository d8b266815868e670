"""Capturing a function in a CUDA graph, the one way this project does it: warm-up runs on a side
stream first (cuBLAS handles, Triton compilation, the caching allocator's first blocks happen
outside the capture, as torch's capture rules require), then the capture, into a shared memory
pool where one is given. Used by the drafting round (draft/device_round.py), the pool writer
(pool_writer.py), the draft's and the target's cost curves (cost_model.call_timer) and
scripts/bench_gpu.py. Also the two ways this project times a short device call: launched back
to back (`time_calls_ms`) and replayed from a graph (`time_graph_ms`). No vLLM imports.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch


def capture_graph(run: Callable[[object], object], device, pool=None, warmups: int = 1,
                  inference: bool = False) -> torch.cuda.CUDAGraph:
    """run(None) `warmups` times on a side stream, then run(graph) captured into `graph`, which
    is returned (replay it). run receives the graph being captured so that it can open
    conditional nodes in it (CUDAGraph.begin_capture_to_if_node); a warm-up gets None.

    device: the CUDA device; pool: a graph memory pool handle (torch.cuda.graph_pool_handle) the
    graph shares, None for its own; inference: capture under torch.inference_mode."""
    from vllm_ouroboros.kernels.tree_attention import graph_plans

    # graph_plans: the warm-ups make the tree-attention plans the capture will (the graph rule's
    # split count), so they compile and run what is captured.
    with graph_plans():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmups):
                run(None)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        mode = (torch.inference_mode() if inference and not torch.is_inference_mode_enabled()
                else contextlib.nullcontext())
        with torch.cuda.graph(graph, pool=pool), mode:
            run(graph)
    return graph


def time_calls_ms(fn: Callable[[], object], warmup: int = 10, reps: int = 50, rounds: int = 5) -> float:
    """ms per call of fn launched back to back on the current CUDA stream: CUDA events around
    each round of `reps` calls, the best of `rounds` rounds, after `warmup` calls. The events
    bracket the device's timeline, its idle gaps included, so where the host cannot keep up (a
    Python wrapper, Triton's launcher) its time shows here."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def time_graph_ms(fn: Callable[[], object], calls: int = 20, rounds: int = 5) -> float:
    """Device time per call in ms: `calls` calls captured in one CUDA graph on the current
    device, replayed (best of `rounds` replays). The host's part of a call drops out: what a call
    costs inside a captured forward. Raises what the capture raises."""
    graph = capture_graph(lambda _: [fn() for _ in range(calls)],
                          torch.device("cuda", torch.cuda.current_device()))
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best
