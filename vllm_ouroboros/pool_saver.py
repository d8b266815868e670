"""The phrase pool's file (`pool_save_path`): written every POOL_SAVE_INTERVAL seconds from the
step (the write on a thread), when the engine goes idle (its last request removed; once per
interval, a later idle spell's save deferred to the interval's end), now when the
engine stops (every wait under one deadline), and on request. A save that fails is logged once
per kind and tried again: serving never stops for it.
No vLLM imports (the engine's shutdown hooks that call in: patches/engine_shutdown.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Callable

import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.pool import PhrasePool

logger = logging.getLogger(LOGGER_NAME)

POOL_SAVE_INTERVAL = 10.0  # seconds
# Seconds a save made now (the engine core's RPC at shutdown, the worker's, exit) may take in all: the
# wait for a step under way to leave the pool (a save from another thread), for a periodic write
# still under way, then for its own. One deadline, below the engine process's grace and the RPC's
# time-out (patches/engine_shutdown.PROCESS_GRACE_S, SAVE_RPC_TIMEOUT_S): a step or storage that
# hangs costs the save, not the exit (an in-process engine has no SIGKILL to end it). Separate
# bounds per wait summed past both (20 + 20 + 20 s against 15 and 30).
SAVE_NOW_TIMEOUT_S = 12.0
# Seconds before a deferred idle save tries the pool's lock again (held by a save on request).
IDLE_RETRY_S = 1.0


class PoolSaver:
    """Writes one drafter's pool to `path`.

    lock: the drafter's pool lock (a step holds it while it changes the pool; a save from
          another thread, the engine core's save RPC under Ray, waits for it: shutdown()).
    flush: inserts the rows staged for the next round (pool_writer.py) before the pool is read.
    version: the pool's version (moves on with every change; the caller's lock held): a save at
          shutdown skips the pool its file holds already. None: every save writes.
    """

    def __init__(self, pool: PhrasePool, path: str, lock: threading.RLock, flush: Callable[[], None],
                 version: Callable[[], int] | None = None):
        self.pool, self.path, self.lock, self._flush, self._version = pool, path, lock, flush, version
        self._written: int | None = None  # the version the file holds (a write that worked)
        self._writes = 0  # writes that worked
        self.last_save = -float("inf")  # time.monotonic() of the last save begun
        self._thread: threading.Thread | None = None  # the periodic save's write under way
        self._error: str | None = None  # the last failed save's kind, logged once
        self._queued: tuple[dict, int | None] | None = None  # an idle copy behind a write under way
        self._queue_lock = threading.Lock()
        self._last_idle_save = -float("inf")  # time.monotonic() of the last idle save begun
        self._idle_timer: threading.Timer | None = None  # a deferred idle save (_idle_save_due)
        self._closed = False  # shut down or replaced: a deferred idle save writes nothing

    def register_exit(self) -> None:
        """A backstop at interpreter exit: the save at shutdown (patches/engine_shutdown.py)
        comes first and removes it (it holds the pool, and would write the same pool again)."""
        atexit.register(self.save_now)

    def close(self) -> None:
        """This saver is replaced (a second load_model): its exit handler would write its own,
        older pool over the new one's file (exit handlers run newest first), and so would a
        periodic write of its still under way, renamed after the new saver's first save: waited
        for (SAVE_NOW_TIMEOUT_S at most)."""
        atexit.unregister(self.save_now)
        self._closed = True
        self._cancel_idle_timer()
        if self._thread is not None:
            self._thread.join(SAVE_NOW_TIMEOUT_S)

    def save(self, path: str | None = None) -> None:
        """Write the pool now, in the caller (atomically: a reader never sees half a file). The
        caller holds the lock. A periodic write to the same file still under way is waited for
        first (up to SAVE_NOW_TIMEOUT_S): it holds an older copy of the pool, and its rename,
        landing after this one, would put that copy back."""
        path = path or self.path
        pending = self._thread
        if os.path.abspath(path) == os.path.abspath(self.path) and pending is not None and pending.is_alive():
            pending.join(SAVE_NOW_TIMEOUT_S)
            if pending.is_alive():
                logger.warning("ouroboros: a periodic phrase pool save to %s is still writing after "
                               "%.0f s; this save may be replaced by its older copy when it ends",
                               path, SAVE_NOW_TIMEOUT_S)
        self._flush()
        version = self._current()
        self.pool.save(path)
        self.last_save = time.monotonic()
        if os.path.abspath(path) == os.path.abspath(self.path):
            self._written = version

    def shutdown(self) -> None:
        """The engine is stopping (the engine core's save RPC, then the worker's shutdown:
        patches/engine_shutdown.py): write the pool now, unless the file holds this version of
        it already (the RPC's save, or a periodic one since the last step). vLLM gives its
        engine process 5 s after SIGTERM before SIGKILL (PROCESS_GRACE_S where a pool is
        saved), and tears the process down first (distributed state, memory), so an exit
        handler alone was lost on a busy machine, leaving the last periodic save (up to
        POOL_SAVE_INTERVAL s old)."""
        atexit.unregister(self.save_now)
        self._closed = True  # this save writes what a deferred idle save would
        self._cancel_idle_timer()
        deadline = time.monotonic() + SAVE_NOW_TIMEOUT_S
        if not self.lock.acquire(timeout=SAVE_NOW_TIMEOUT_S):
            logger.warning("ouroboros: a step held the phrase pool for %.0f s at shutdown; not saved "
                           "now, the last save (idle or periodic) stands", SAVE_NOW_TIMEOUT_S)
            return
        start = time.monotonic()
        try:
            written = self.save_now(deadline, unless_saved=True)
        finally:
            self.lock.release()
        if written:  # where and when: a save that did not come shows in its absence
            logger.info("ouroboros: the phrase pool is written to %s at shutdown (%.2f s)",
                        self.path, time.monotonic() - start)

    def maybe_save(self) -> None:
        """The step's periodic save, every POOL_SAVE_INTERVAL seconds: the step copies the pool to
        the host and a thread writes it (torch.save and fsync of a 35-64 MB file took 0.08-0.46 s
        on this CPU, a stall of every request in the step every 10 s; seconds on network
        storage). One write at a time: while one is under way the next interval's is skipped.
        atexit alone is not enough: vLLM may kill the engine process before exit handlers run."""
        if time.monotonic() - self.last_save < POOL_SAVE_INTERVAL:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._start_write()

    def save_when_idle(self) -> None:
        """The engine has no request left: write the pool now (copied here, written on a
        thread), unless the file holds it already. A process killed while idle (SIGKILL, Ray's
        kill of its actors, a container stopped with no grace) then loses nothing, and the save
        at shutdown finds the file current. One idle write per POOL_SAVE_INTERVAL at most: an
        engine that goes idle between requests arriving every few seconds wrote the whole pool
        (up to 64 MB) per request; a later one is deferred to the interval's end
        (`_idle_save_due`). A write under way holds an older copy: this copy is queued behind
        it (`_write_after`), not waited for: a request that arrives meanwhile would wait on the
        idle step, seconds on network storage. One copy is queued at most (the newest):
        storage that hangs through many idle spells holds two copies, not one per spell."""
        if self._holds_current():
            return
        self._cancel_idle_timer()
        due = self._last_idle_save + POOL_SAVE_INTERVAL - time.monotonic()
        if due > 0:
            self._arm_idle_timer(due, self._current())
        else:
            self._idle_write()

    def _idle_write(self) -> None:
        self._last_idle_save = time.monotonic()
        if not self.writing:
            self._start_write()
            return
        copy = self._copy()
        if copy is None:
            return
        with self._queue_lock:
            waiting = self._queued is not None  # a queued write not yet begun takes this copy
            self._queued = copy
        if not waiting:
            thread = self._start_thread(self._write_after, (self._thread,))
            self._thread = thread or self._thread

    def _idle_save_due(self, version: int | None) -> None:
        """The deferred idle save (a timer's thread): written where the engine is still idle
        with the pool it left (`version`; every step moves it on). A pool changed since means
        the engine served again: its next idle spell saves (or the periodic save). Never waits
        for the lock: a save at shutdown holds it while it waits for writes; where another
        holder has it (a save on request), tried again in IDLE_RETRY_S."""
        if self._closed:
            return
        if self.pool.device.type == "cuda":
            # A new thread's CUDA device is the first GPU: the copy would open a context
            # there (hundreds of MB) in a worker of another GPU.
            torch.cuda.set_device(self.pool.device)
        if not self.lock.acquire(blocking=False):
            self._arm_idle_timer(IDLE_RETRY_S, version)
            return
        try:
            if not self._closed and self._current() == version and not self._holds_current():
                self._idle_write()
        finally:
            self.lock.release()

    def _arm_idle_timer(self, delay: float, version: int | None) -> None:
        timer = threading.Timer(delay, self._idle_save_due, args=(version,))
        timer.name, timer.daemon = "ouroboros-pool-idle-save", True
        self._idle_timer = timer
        timer.start()

    def _cancel_idle_timer(self) -> None:
        timer, self._idle_timer = self._idle_timer, None
        if timer is not None:
            timer.cancel()

    def _write_after(self, pending: threading.Thread) -> None:
        """Wait for `pending` (the write of an older copy), then write the queued copy: its
        rename lands last, so the file ends with the newest pool."""
        pending.join()
        with self._queue_lock:
            copy, self._queued = self._queued, None
        if copy is not None:
            self._write(*copy)

    def save_now(self, deadline: float | None = None, unless_saved: bool = False) -> bool:
        """Wait for a write under way, then write and wait for that write, both until `deadline`
        (time.monotonic(); default SAVE_NOW_TIMEOUT_S from now): at shutdown SIGTERM and SIGINT
        are held while the pool is written, and an in-process engine has no SIGKILL to end a
        write that hangs (network storage); the file is replaced atomically, so a write cut off
        leaves the last. unless_saved: no write where the file holds the pool's version (a
        second write at shutdown is one vLLM's SIGKILL may cut off, leaving a pool-sized
        temporary file). Returns whether the pool was written now."""
        if deadline is None:
            deadline = time.monotonic() + SAVE_NOW_TIMEOUT_S
        pending = self._thread
        if pending is not None and pending.is_alive():
            pending.join(max(deadline - time.monotonic(), 0.0))
            if pending.is_alive():
                logger.warning("ouroboros: the last phrase pool save is still writing at the end of "
                               "the %.0f s a save now may take; not saved again now", SAVE_NOW_TIMEOUT_S)
                return False
        if unless_saved and self._holds_current():
            logger.debug("ouroboros: %s holds the phrase pool already; not written again", self.path)
            return False
        writes = self._writes
        thread = self._start_write()
        if thread is not None:
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                logger.warning("ouroboros: the phrase pool save to %s did not finish in the %.0f s a "
                               "save now may take; the file keeps the last save", self.path, SAVE_NOW_TIMEOUT_S)
                return False
        return self._writes > writes

    def _holds_current(self) -> bool:
        """Whether the file holds the pool's version (a write of it worked, the file is there)."""
        return self._written is not None and self._written == self._current() and os.path.exists(self.path)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the write under way, if any."""
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def writing(self) -> bool:
        """Whether a write is under way."""
        return self._thread is not None and self._thread.is_alive()

    def _start_write(self) -> threading.Thread | None:
        """Copy the pool to the host here and write it on a thread; None where the copy failed
        (logged) or no thread could start (written here then)."""
        copy = self._copy()
        if copy is None:
            return None
        thread = self._start_thread(self._write, copy)
        if thread is not None:
            self._thread = thread
        return thread

    def _copy(self) -> tuple[dict, int | None] | None:
        """The pool's host copy and its version; None where the copy failed (logged)."""
        self.last_save = time.monotonic()
        try:
            self._flush()
            return self.pool.state_dict(), self._current()
        except Exception as e:  # noqa: BLE001 - the step goes on; logged once
            self._saved(e)
            return None

    def _start_thread(self, target: Callable, args: tuple) -> threading.Thread | None:
        """`target(*args)` on a started save thread; run here (None) where no thread starts."""
        thread = threading.Thread(target=target, args=args, name="ouroboros-pool-save", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # at interpreter exit (the exit handler) Python >= 3.12 starts no thread
            target(*args)
            return None
        return thread

    def _current(self) -> int | None:
        return None if self._version is None else self._version()

    def _write(self, state: dict, version: int | None) -> None:
        try:
            PhrasePool.write_state(state, self.path)
        except Exception as e:  # noqa: BLE001 - a full disk mid-write raises RuntimeError from torch.save
            self._saved(e)
        else:
            self._written = version
            self._writes += 1
            self._saved(None)

    def _saved(self, error: Exception | None) -> None:
        """Log a failed save once per kind of failure, and the first save that works after."""
        if error is None:
            if self._error is not None:
                logger.info("ouroboros: the phrase pool is saved to %s again", self.path)
            self._error = None
            return
        # A full or read-only disk must not fail the step (every request in it): the pool is
        # kept in memory and saved again at the next interval. The key leaves out the message,
        # which names a fresh temporary file each time.
        why = f"{type(error).__name__} {getattr(error, 'errno', None)}"
        if why != self._error:
            logger.warning("ouroboros: the phrase pool could not be saved to %s (%s: %s); serving "
                           "goes on, the save is tried again every %d s",
                           self.path, type(error).__name__, error, POOL_SAVE_INTERVAL)
        self._error = why
