"""Shutdown area: the phrase pool is written when the engine stops, before vLLM's teardown.

`EngineCore.shutdown` (patched, engine-core process): before vLLM's teardown the engine core asks
    its workers to save through a collective RPC (`SAVE_METHOD`), bounded by SAVE_RPC_TIMEOUT_S:
    a worker that hangs or died must not hold the engine's exit (the last periodic save, at
    most 10 s old, then stands). vLLM's Ray executors (`RayDistributedExecutor`, `RayExecutorV2`)
    `ray.kill` their workers without calling any worker code; the multiprocess executor gives
    a worker 5 s from the stop it signals (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS), SIGTERM,
    then SIGKILL 4 s later, which a worker still on its way to its save on a loaded machine
    ran past (the file kept the first step's save). In its busy loop, before that stop, the
    worker saves within the engine process's own grace.
`Worker.shutdown` (patched, worker processes): multiprocess and in-process executors call it on
    every worker as the engine stops; the proposer saves its pool first (`save_pool`), which
    writes only what the RPC did not (pool_saver.PoolSaver.shutdown): where the RPC could not
    run, or failed.
`CoreEngineProcManager.shutdown` (patched in the process that starts the engine: the API server,
    an offline LLM's): with vLLM's default `shutdown_timeout` 0 (requests aborted at once) the
    manager SIGTERMs the engine-core process and SIGKILLs it in the same millisecond, before
    its shutdown can write the pool (a `vllm serve` stopped by SIGTERM left the last periodic
    save, or a pool-sized temporary file); an offline LLM's finalizer gives it 5 s
    (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS), which a loaded machine ran past. Where a pool is
    saved and requests are aborted at once, the process gets at least PROCESS_GRACE_S to exit,
    as vLLM gives ROCm engines for their teardown (`get_engine_process_shutdown_timeout`); an
    engine that exits sooner (a save takes well under a second) is waited for no longer.
Not covered: data parallelism on Ray, whose engine-core actors vLLM `ray.kill`s too (no
shutdown of theirs runs; the last save stands: the idle engine's, pool_saver.save_when_idle,
or a periodic one).
"""

from __future__ import annotations

import contextlib
import logging
import weakref

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.patches._util import patch_method, require

logger = logging.getLogger(LOGGER_NAME)

SAVE_METHOD = "ouroboros_save_pool"
# A 35-64 MB pool file took 0.08-0.46 s to write here; the process manager SIGKILLs an engine-core
# process PROCESS_GRACE_S after its SIGTERM anyway. The bound matters for an in-process engine,
# which nobody kills.
SAVE_RPC_TIMEOUT_S = 30.0
# Seconds an engine-core process that writes a pool gets to exit after its SIGTERM where vLLM
# would SIGKILL it at once (shutdown_timeout 0): the save's bound, not its usual time.
PROCESS_GRACE_S = 15.0


def save_pool(worker) -> bool:
    """Write this worker's pool now (installed as the worker method `SAVE_METHOD`; also run by
    the worker's shutdown). Returns whether this worker drafts with Ouroboros (a TP follower
    holds no pool: its proposer's shutdown writes nothing). Raises what the save raised."""
    from vllm_ouroboros.patches.model_runner import _drafter

    drafter = _drafter(getattr(worker, "model_runner", None))
    if drafter is None:
        return False
    with _signals_held():
        drafter.shutdown()
    return True


@contextlib.contextmanager
def _signals_held():
    """SIGTERM and SIGINT ignored while the pool is written at shutdown (main thread only). vLLM
    restores their default handlers before its engine's shutdown, so a second signal (Ctrl-C
    or a service manager reaching every process, then the API server's own SIGTERM) killed the
    process mid-write; vLLM's SIGKILL, 5 s after its SIGTERM, still bounds the wait."""
    import signal
    import threading

    held = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in held}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _worker_shutdown(original):
    def shutdown(self):
        try:
            save_pool(self)
        except Exception:  # noqa: BLE001 - the worker's own teardown must still run
            logger.exception("ouroboros: saving the pool at shutdown failed")
        finally:  # also after an interrupt: vLLM's teardown frees the device memory
            result = original(self)
        return result

    return shutdown


def _engine_core_shutdown(original):
    def shutdown(self):
        executor = getattr(self, "model_executor", None)
        try:
            if _saves_by_rpc(self, executor):
                # vLLM's engine-core process restores the default signal handlers before this
                # shutdown: a second SIGTERM would kill it mid-RPC, and the kill of the process
                # tree that follows (or Ray's) its workers mid-write.
                with _signals_held():
                    executor.collective_rpc(SAVE_METHOD, timeout=SAVE_RPC_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the engine's own teardown must still run
            logger.warning("ouroboros: the workers could not save the pool at shutdown (%s: %s); "
                           "the last save (idle or periodic) stands", type(e).__name__, e)
        finally:
            result = original(self)
        return result

    return shutdown


def _saves_by_rpc(engine_core, executor) -> bool:
    """Whether this engine drafts with Ouroboros with a pool file to write and its workers can
    answer the save RPC now. Not where the RPC could only wait out its time-out, or past it
    (the worker's own shutdown saves then, where it runs): the executor failed (a worker gone)
    or is shut down already, its message queue is closed (or this node only follows another's),
    Ray is down (at interpreter exit), or a step's future is still held (the RPC's result waits
    for that one first: RayExecutorV2's with no time-out). RayDistributedExecutor's steps run
    on the compiled graph's thread of each worker, beside this RPC: the proposer's save waits
    for a step under way to leave the pool (proposer._holds_pool), within
    pool_saver.SAVE_NOW_TIMEOUT_S."""
    if (executor is None or getattr(executor, "is_failed", False)
            or getattr(executor, "shutting_down", False) or getattr(executor, "futures_queue", None)
            or (hasattr(executor, "rpc_broadcast_mq") and executor.rpc_broadcast_mq is None)
            or (getattr(executor, "uses_ray", False) and not _ray_running())):
        return False
    return _saves_pool(getattr(engine_core, "vllm_config", None))


def _saves_pool(vllm_config) -> bool:
    """Whether this engine drafts with Ouroboros and writes a pool file at shutdown."""
    from vllm_ouroboros.patches.engine_args import ADDITIONAL_CONFIG_KEY, is_ouroboros

    if not is_ouroboros(getattr(vllm_config, "speculative_config", None)):
        return False
    cfg = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY) or {}
    return bool(cfg.get("pool_save_path"))


def _proc_manager_init(original):
    import inspect

    signature = inspect.signature(original)

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # What shutdown's rule reads, and the finalizer replaced below (an instance's).
        require(self, "_request_shutdown_timeout", "_finalizer", "processes")
        vllm_config = signature.bind(self, *args, **kwargs).arguments["vllm_config"]
        self._ouroboros_saves_pool = _saves_pool(vllm_config)
        if self._ouroboros_saves_pool and self._request_shutdown_timeout == 0 and self._finalizer.detach():
            # vLLM's finalizer calls its module's shutdown(processes) directly: 5 s, past this
            # class's shutdown. It is what runs at interpreter exit (an offline script that
            # ends with its LLM alive): made after the client's, it runs before it.
            from vllm.v1.engine import utils as engine_utils

            self._finalizer = weakref.finalize(self, engine_utils.shutdown, self.processes, PROCESS_GRACE_S)

    return init


def _proc_manager_shutdown(original):
    def shutdown(self, timeout=None):
        # Only where requests are aborted at once (shutdown_timeout 0): there the process's
        # time is teardown alone, which the save is part of. vLLM's 0 (`vllm serve`), 5 s where
        # none is given and an offline LLM's finalizer (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS):
        # on a loaded 2-core machine the engine core and its worker were SIGKILLed 5 s after
        # the SIGTERM, and a worker that had not reached its save by then lost the pool. A
        # positive shutdown_timeout is a draining deadline vLLM enforces with this timeout: kept.
        if (getattr(self, "_request_shutdown_timeout", None) == 0 and getattr(self, "_ouroboros_saves_pool", False)
                and (timeout is None or timeout < PROCESS_GRACE_S)):
            if self._finalizer.alive:  # else stopped already (vLLM's client calls this twice)
                logger.info("ouroboros: the engine process gets up to %.0f s to write its phrase "
                            "pool before it is killed (requests are aborted at once)", PROCESS_GRACE_S)
            timeout = PROCESS_GRACE_S
        return original(self, timeout)

    return shutdown


def apply_process_manager() -> None:
    """Patch the engine-core process manager (idempotent; called where an engine that saves a
    pool is configured, engine_args.py: the process that goes on to start it)."""
    from vllm.v1.engine.utils import CoreEngineProcManager

    from vllm_ouroboros.patches._util import require_params

    require_params(CoreEngineProcManager.__init__, "vllm_config")
    require_params(CoreEngineProcManager.shutdown, "timeout")
    patch_method(CoreEngineProcManager, "__init__", _proc_manager_init)
    patch_method(CoreEngineProcManager, "shutdown", _proc_manager_shutdown)


def _ray_running() -> bool:
    try:
        import ray
    except ImportError:  # a Ray executor without Ray: nothing to ask
        return False
    return bool(ray.is_initialized())


def apply_worker() -> None:
    """Patch the worker (worker processes: called from model_runner.apply)."""
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    patch_method(Worker, "shutdown", _worker_shutdown)
    # A named method: `collective_rpc(SAVE_METHOD)` needs no pickled callable (Ray ships names).
    if not hasattr(WorkerBase, SAVE_METHOD):
        setattr(WorkerBase, SAVE_METHOD, save_pool)


def apply_engine_core() -> None:
    """Patch the engine core, in a process that imported it already (plugins load at run time:
    an engine-core process, spawned or a Ray actor, runs from that module, and an in-process
    engine's client imports it): importing it elsewhere took 1.3 s (a worker, a model-registry
    subprocess) for nothing."""
    import sys

    if "vllm.v1.engine.core" not in sys.modules:
        return
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor

    require(Executor, "uses_ray", "collective_rpc")
    patch_method(EngineCore, "shutdown", _engine_core_shutdown)
