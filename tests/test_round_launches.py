"""scripts/round_launches.py: the round's kernels (kernels/round_steps.py) take the work around
each draft forward from tens of launches to a few, and compile for an NVIDIA target without
spills."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "scripts" / "round_launches.py")


def run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_launches_per_forward():
    out = run("--tiny", "--rounds", "1")
    rows = {}
    for ln in out.splitlines():
        cells = [c.strip() for c in ln.split("|")[1:-1]]
        if len(cells) == 7 and cells[1] in ("torch", "triton", "triton+norm-gemm"):
            rows[cells[0], cells[1]] = [float(c.split()[0]) for c in cells[2:]]
    assert set(rows) == {(s, f) for s in ("decode", "W=4 G=4") for f in ("torch", "triton", "triton+norm-gemm")}, out
    for setting in ("decode", "W=4 G=4"):
        torch_form, kernel_form = rows[setting, "torch"], rows[setting, "triton"]
        # round work: tens of launches per forward in torch, the two kernels and a few ATen calls
        assert torch_form[0] > 60 and kernel_form[0] < 20, out
        # the attention metadata made by the prepare kernel leaves the model's own part
        assert kernel_form[1] <= torch_form[1] - 15, out
        assert kernel_form[2:4] == torch_form[2:4], out  # LM head and pool: unchanged
        # RMSNorm and SiLU*up inside the products: 3 launches fewer in each of the 2 layers
        in_products = rows[setting, "triton+norm-gemm"]
        assert in_products[1] == kernel_form[1] - 6 and in_products[0] == kernel_form[0], out


def test_kernels_compile_for_nvidia_without_spills():
    # Triton's bundled ptxas compiles for sm_90 here, no GPU needed
    spec = importlib.util.find_spec("triton")
    tools = Path(spec.origin).parent / "backends" / "nvidia" / "bin" if spec else None
    if tools is None or not all((tools / t).exists() for t in ("ptxas", "cuobjdump")):
        pytest.skip(f"this Triton has no bundled ptxas and cuobjdump (looked in {tools})")
    out = run("--compile-only", "90")
    usage = [ln for ln in out.splitlines() if ln.startswith("sm_90 ")]
    assert len(usage) == 8 and all("STACK:0" in ln for ln in usage), out
