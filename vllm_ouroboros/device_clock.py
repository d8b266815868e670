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
    """One interval at a time: start(), stop(), then seconds() after the work is known to be
    done; start() again begins the next (on CUDA the same two events are recorded again, so a
    clock timing every step allocates nothing per step)."""

    def __init__(self, device: torch.device | str):
        self._cuda = torch.device(device).type == "cuda"
        self._events = None  # (start, end) CUDA events, made at the first start
        self._start = self._end = None  # perf_counter readings on the CPU
        self._started = self._stopped = False

    def start(self) -> bool:
        """Mark the start; False (nothing marked) while the stream captures a CUDA graph,
        where an event recorded would become part of the graph."""
        self._started = self._stopped = False
        if self._cuda:
            if torch.cuda.is_current_stream_capturing():
                return False
            if self._events is None:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._start = time.perf_counter()
        self._started = True
        return True

    def stop(self) -> None:
        if not self._started:
            return
        if self._cuda:
            self._events[1].record()
        else:
            self._end = time.perf_counter()
        self._stopped = True

    @property
    def stopped(self) -> bool:
        """An interval was started and stopped (its reading may still be in flight on CUDA)."""
        return self._stopped

    def seconds(self, wait: bool = True) -> float | None:
        """The interval in seconds; 0.0 where nothing was started, None where it was not
        stopped. wait=False: None where the device has not finished it yet (a reading is
        dropped rather than waited for)."""
        if not self._started:
            return 0.0
        if not self._stopped:
            return None
        if not self._cuda:
            return self._end - self._start
        start, end = self._events
        if wait:
            end.synchronize()  # done already where the caller has synchronised since
        elif not end.query():
            return None
        return start.elapsed_time(end) / 1000


class ForwardClock:
    """The target's latest forward: how many tokens it ran and its seconds, taken once.

    The model runner brackets each forward (start with its token count, stop); the proposer
    takes the reading at its next call, when the step's outputs have reached the host. A forward
    started while a CUDA graph is being captured gives no reading, nor does one the device has
    not finished when it is taken."""

    def __init__(self, device: torch.device | str):
        self._clock = DeviceClock(device)
        self._tokens: int | None = None  # the forward's, until its reading is taken

    def start(self, tokens: int) -> None:
        self._tokens = tokens if self._clock.start() else None

    def stop(self) -> None:
        self._clock.stop()

    def take(self) -> tuple[int, float] | None:
        """(tokens, seconds) of the forward since the last take, or None."""
        if self._tokens is None or not self._clock.stopped:
            return None
        tokens, self._tokens = self._tokens, None
        seconds = self._clock.seconds(wait=False)
        return None if seconds is None else (tokens, seconds)
