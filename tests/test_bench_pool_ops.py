"""scripts/bench_pool_ops.py: every form of the pool's insert and lookup times (or, for the
kernels on a CPU, runs under the interpreter) and leaves equal pools; the kernels compile for an
NVIDIA target without spills."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "scripts" / "bench_pool_ops.py")


def run(*args, interpret: bool):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_torch_forms_time_and_agree():
    out = run("--rows", "8", "40", "--vocab", "300", "--pages", "64", "--calls", "3", "--device", "cpu",
              interpret=False)
    lines = out.splitlines()
    assert "the Triton kernels are skipped" in out
    assert sum("equal: True (index_put, scatter_add)" in ln for ln in lines) == 2
    assert sum("equal: True (torch)" in ln for ln in lines) == 2
    assert sum(ln.startswith(("| insert | 8 |", "| insert | 40 |")) for ln in lines) == 4


def test_kernel_forms_are_checked_under_the_interpreter():
    if CUDA:
        pytest.skip("this machine has CUDA: there the kernel forms run compiled (tests/test_pool_kernels.py, "
                    "gpu_check's pool_ops), and Triton 3.6's interpreter under numpy 2.5, the lent GPU "
                    "machines' pair, cannot take the kernels' loaded loop bounds ('only 0-dimensional "
                    "arrays can be converted')")
    out = run("--rows", "8", "40", "--vocab", "300", "--pages", "16", "--calls", "2", "--device", "cpu",
              interpret=True)
    lines = out.splitlines()
    assert "checked for the same results, not timed" in out
    assert sum("equal: True (index_put, scatter_add, triton)" in ln for ln in lines) == 2
    assert sum("equal: True (torch, triton)" in ln for ln in lines) == 2
    assert sum(ln.startswith(("| insert | 40 | triton | - |", "| lookup | 40 | triton | - |")) for ln in lines) == 2


def test_kernels_compile_for_nvidia_without_spills():
    # Triton's bundled ptxas compiles for sm_90 here, no GPU needed; a spill (STACK > 0) means a
    # block size too large for the registers (kernels/pool_insert._ROWS)
    import importlib.util

    spec = importlib.util.find_spec("triton")
    tools = Path(spec.origin).parent / "backends" / "nvidia" / "bin" if spec else None
    if tools is None or not all((tools / t).exists() for t in ("ptxas", "cuobjdump")):
        pytest.skip(f"this Triton has no bundled ptxas and cuobjdump (looked in {tools})")
    out = run("--compile-only", "90", interpret=False)
    usage = [ln for ln in out.splitlines() if ln.startswith("sm_90 ")]
    assert len(usage) == 5 and all("STACK:0" in ln for ln in usage), out


def test_launch_counts():
    # Compiled where there is CUDA (see the skip above), the same launches
    out = run("--launches", "--rows", "16", "--vocab", "300", "--pages", "64", interpret=not CUDA)
    rows = {tuple(c.strip() for c in ln.split("|")[1:4]): tuple(int(c) for c in ln.split("|")[4:6])
            for ln in out.splitlines() if ln.startswith(("| insert", "| lookup"))}
    assert rows[("insert", "16", "triton")] == (3, 4) and rows[("lookup", "16", "triton")] == (1, 1), out
    assert rows[("insert", "16", "torch")][0] > 100 and rows[("lookup", "16", "torch")][0] > 30, out
