"""Capturing a function in a CUDA graph, the one way this project does it: warm-up runs on a side
stream first (cuBLAS handles, Triton compilation, the caching allocator's first blocks happen
outside the capture, as torch's capture rules require), then the capture, into a shared memory
pool where one is given. Used by the drafting round (draft/device_round.py), the pool writer
(pool_writer.py), the draft's and the target's cost curves (cost_model.call_timer) and
scripts/bench_gpu.py. No vLLM imports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def capture_graph(run: Callable[[object], object], device, pool=None, warmups: int = 1,
                  inference: bool = False) -> torch.cuda.CUDAGraph:
    """run(None) `warmups` times on a side stream, then run(graph) captured into `graph`, which
    is returned (replay it). run receives the graph being captured so that it can open
    conditional nodes in it (CUDAGraph.begin_capture_to_if_node); a warm-up gets None.

    device: the CUDA device; pool: a graph memory pool handle (torch.cuda.graph_pool_handle) the
    graph shares, None for its own; inference: capture under torch.inference_mode."""
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
