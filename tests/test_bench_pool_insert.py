"""scripts/bench_pool_insert.py: both forms of the pool's adds time and leave equal pools."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_both_forms_run_and_agree():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_pool_insert.py"), "--rows", "8", "40",
                           "--vocab", "300", "--pages", "64", "--calls", "3", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum("pools equal: True" in ln for ln in lines) == 2
    assert sum(ln.startswith("| 8 |") or ln.startswith("| 40 |") for ln in lines) == 4
