"""Shared fixtures: tiny random models built once per test session (no model hub here), and
the device the draft side and the algorithm modules are tested on.

Device: "cuda" when there is one, else "cpu"; OUROBOROS_TEST_DEVICE=cpu|cuda overrides. Tests
take the `device` fixture; module-level helpers (hand-made tensors) read DEVICE.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import model_pair  # noqa: E402

# vLLM on this CPU machine: bind to loopback, never reach a hub, keep the KV cache small.
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _test_device() -> str:
    want = os.environ.get("OUROBOROS_TEST_DEVICE")
    if want is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want not in ("cpu", "cuda"):
        raise pytest.UsageError(f"OUROBOROS_TEST_DEVICE={want!r}: use cpu or cuda")
    if want == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("OUROBOROS_TEST_DEVICE=cuda, but torch sees no CUDA device")
    return want


DEVICE = _test_device()
# A CPU device with a GPU's copies (vllm_ouroboros/host_copy.py, COPY_ON_CPU): scripts/test.sh
# runs the draft side's tests so too, after the suite.
CPU_COPIES = os.environ.get("OUROBOROS_TEST_CPU_COPIES") == "1"
# The lent GPU machine has no vLLM: tests that start an engine skip there (the algorithm,
# draft and kernel tests still run).
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_report_header(config):
    name = f" ({torch.cuda.get_device_name()})" if DEVICE == "cuda" else ""
    copies = "; host copies as on a GPU (OUROBOROS_TEST_CPU_COPIES)" if CPU_COPIES else ""
    order = "; in reverse order (OUROBOROS_TEST_REVERSE)" if REVERSE else ""
    return [f"ouroboros test device: {DEVICE}{name}; vLLM {'installed' if HAVE_VLLM else 'absent'}{copies}{order}"]


@pytest.fixture(autouse=True)
def _cpu_copies(monkeypatch):
    if CPU_COPIES:
        from vllm_ouroboros import host_copy

        monkeypatch.setattr(host_copy, "COPY_ON_CPU", True)
    yield


# The tests in reverse order (OUROBOROS_TEST_REVERSE=1): a test that passes only after another
# has run (a module's shared proposer or pool filled by earlier tests) fails there.
REVERSE = os.environ.get("OUROBOROS_TEST_REVERSE") == "1"


def pytest_collection_modifyitems(config, items):
    if REVERSE:
        items.reverse()
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="starts a vLLM engine; vLLM is not installed here "
                                   "(e.g. the lent GPU machine)")
    for item in items:
        if item.get_closest_marker("engine"):
            item.add_marker(skip)


_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")


def set_triton_interpret(on: bool) -> None:
    """Triton's CPU interpreter for the kernel tests where there is no CUDA device: on, or back
    to what the environment had. @triton.jit reads TRITON_INTERPRET when a function is decorated
    (Triton's library when triton is first imported, a kernel when its module is) and the
    interpreter reads it again while running, so a kernel test module turns it on around its
    imports and during its tests (`triton_interpreter`)."""
    if DEVICE == "cuda":
        return
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    elif _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


def import_kernel_module(name: str):
    """A kernels/ module imported with the interpreter on where there is no CUDA device (its
    @triton.jit functions are decorated at import)."""
    import importlib

    set_triton_interpret(True)
    try:
        return importlib.import_module(name)
    finally:
        set_triton_interpret(False)


def needs_triton(module, kernel):
    """The mark a kernel test module carries: skip, saying why, where Triton cannot run `kernel`
    (from kernels/`module`, which has pick_kernel and _TRITON_IMPORT_ERROR) in this process."""
    reason = module.pick_kernel(kernel, torch.device(DEVICE), module._TRITON_IMPORT_ERROR)[1]
    return pytest.mark.skipif(
        reason is not None,
        reason=f"Triton cannot run the kernel in this process: {reason}. Usually an earlier test "
               "module imported triton with TRITON_INTERPRET unset; run this file in its own pytest process")


def pool_lookups_when_idle(path: str, want: int, wait_s: float = 60.0) -> int:
    """The lookups counter of the pool file at `path` once it reads `want` (the idle engine's
    save: vLLM removes the finished requests in a step of its own, which may come after the
    snapshot's RPC, and an idle save within POOL_SAVE_INTERVAL of the last is deferred to the
    interval's end), or as it reads after wait_s."""
    from vllm_ouroboros.pool import PhrasePool

    deadline, got = time.monotonic() + wait_s, None
    while got != want and time.monotonic() < deadline:
        if os.path.exists(path):
            got = int(PhrasePool.read_state(path)["counters"][0])
        time.sleep(0.1)
    return got


def bare_proposer(**attrs):
    """An OuroborosProposer without its __init__ (no draft model, no vLLM config), holding only
    the state its method decorators read (the pool's lock and version) and `attrs`: for tests
    of one method. A new attribute such a decorator reads goes into proposer._pool_guard, and
    every bare proposer has it."""
    from vllm_ouroboros import proposer

    p = object.__new__(proposer.OuroborosProposer)
    proposer._pool_guard(p)
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


@pytest.fixture(scope="module")
def triton_interpreter():
    set_triton_interpret(True)
    yield
    set_triton_interpret(False)


@pytest.fixture(scope="session")
def device() -> str:
    """Where the draft side and the algorithm's tensors live in these tests: "cuda" or "cpu"."""
    return DEVICE


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{"target", "draft", "llama"}: tiny Qwen2 target, a perturbed-copy draft, a Llama model."""
    root = Path(os.environ.get("OUROBOROS_TINY_MODELS") or tmp_path_factory.mktemp("tiny"))
    return model_pair(root)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-tensor tests: on this busy 2-core machine the
    intra-op pool's wake-ups cost more than the work (up to 10x slower otherwise)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
