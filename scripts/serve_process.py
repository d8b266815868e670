"""A `vllm serve` in a session of its own, for the serving benchmarks (bench_serve.py, soak.py)
and the server tests (tests/test_server.py): started, waited for until /health answers, and
stopped with whatever is left of its process group.

The server gets its own session so that a signal to the caller's process group (Ctrl-C, a
test's time-out) does not reach it half-way: the caller stops it, and must (stop_on_sigterm).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STOP_GRACE_S = 60.0  # SIGTERM to SIGKILL: vLLM's own shutdown plus the pool's save fit well inside
REAP_S = 30.0  # after SIGKILL: a leader stuck in the kernel is left, not waited for forever


class ServerFailed(RuntimeError):
    """The server exited, or did not answer /health in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> list[str]:
    exe = Path(sys.executable).parent / "vllm"
    # Without the dist-info shim the `vllm` script cannot read its own version.
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@dataclass
class Server:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(log unreadable: {e})"

    def stop(self, group: bool = True) -> int | None:
        """SIGTERM to the whole process group, or (group=False) to the API server alone, as a
        container runtime stops it; after STOP_GRACE_S, or once the server exited, SIGKILL to
        what is left of the group. Returns the server's exit status (None: not reaped)."""
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=REAP_S)
        return self.proc.returncode


def start(target: Path, args: list[str], log_path: Path | None = None, timeout: float = 600.0) -> Server:
    """`vllm serve TARGET --host 127.0.0.1 --port P ARGS`, its output in log_path (default
    vllm-serve-P.log in the temporary directory); returns once /health answers. Raises
    ServerFailed where it exits or stays unhealthy for `timeout` seconds, and stops it on any
    exception (SIGTERM through stop_on_sigterm included): no server is left behind."""
    port = free_port()
    log_path = Path(log_path or Path(tempfile.gettempdir()) / f"vllm-serve-{port}.log")
    cmd = [*vllm_cli(), "serve", str(target), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:  # the child holds its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise ServerFailed(f"vllm serve exited early ({proc.returncode}); log {log_path}:\n"
                                   f"{server.log_tail()}")
            try:
                urllib.request.urlopen(server.base + "/health", timeout=2)
                return server
            except OSError:
                if time.monotonic() > deadline:
                    raise ServerFailed(f"vllm serve not healthy after {timeout:.0f} s; log {log_path}:\n"
                                       f"{server.log_tail()}") from None
                time.sleep(1)
    except BaseException:
        server.stop()
        raise


def stop_on_sigterm() -> None:
    """SIGTERM ends this script through its `finally` blocks, which stop the servers it
    started: they run in sessions of their own, so a signal to this script's process group
    (a test's time-out) never reaches them, and SIGTERM's default action skips the blocks."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
