"""Seconds of device work measured without a host synchronisation of their own.

On the CPU a forward returns when it is done, so perf_counter brackets it. On a GPU the host only
queues kernels: CUDA events bracket the work instead and are read once something else has
synchronised (the drafting round's one device->host copy, the step's sampled tokens), so the
measurement adds no wait to the step it measures. Used for the draft's prefill inside a round
(draft/runtime.py) and the target's forward per step (patches/model_runner.py), which the
back-off's cost model calibrates itself with (proposer.py).
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """One interval: start(), stop(), then seconds() after the work is known to be done."""

    def __init__(self, device: torch.device | str):
        self._cuda = torch.device(device).type == "cuda"
        self._start = self._end = None

    def start(self) -> bool:
        """Mark the start; False (nothing marked) while the stream captures a CUDA graph,
        where an event recorded would become part of the graph."""
        if self._cuda:
            if torch.cuda.is_current_stream_capturing():
                self._start = self._end = None
                return False
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        self._end = None
        return True

    def stop(self) -> None:
        if self._start is None:
            return
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._end = time.perf_counter()

    def seconds(self, wait: bool = True) -> float | None:
        """The interval in seconds; 0.0 where nothing was started, None where it was not
        stopped. wait=False: None where the device has not finished it yet (a reading is
        dropped rather than waited for)."""
        if self._start is None:
            return 0.0
        if self._end is None:
            return None
        if not self._cuda:
            return self._end - self._start
        if wait:
            self._end.synchronize()  # done already where the caller has synchronised since
        elif not self._end.query():
            return None
        return self._start.elapsed_time(self._end) / 1000


class ForwardClock:
    """The target's latest forward: how many tokens it ran and its seconds, taken once.

    The model runner brackets each forward (start with its token count, stop); the proposer
    takes the reading at its next call, when the step's outputs have reached the host. A forward
    started while a CUDA graph is being captured gives no reading, nor does one the device has
    not finished when it is taken."""

    def __init__(self, device: torch.device | str):
        self._clock = DeviceClock(device)
        self._tokens: int | None = None
        self._stopped = False

    def start(self, tokens: int) -> None:
        self._tokens = tokens if self._clock.start() else None
        self._stopped = False

    def stop(self) -> None:
        if self._tokens is not None:
            self._clock.stop()
            self._stopped = True

    def take(self) -> tuple[int, float] | None:
        """(tokens, seconds) of the forward since the last take, or None."""
        if not self._stopped:
            return None
        self._stopped = False
        seconds = self._clock.seconds(wait=False)
        return None if seconds is None else (self._tokens, seconds)
