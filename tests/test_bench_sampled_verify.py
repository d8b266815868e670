"""scripts/bench_sampled_verify.py runs on small shapes and prints its table (the figures are
the script's to measure, in results/README.md; the equivalence of its two forms is
tests/test_accept.py::test_verify_processes_one_row_per_request_at_a_time)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_sampled_verify_runs_and_checks_the_forms_agree():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sampled_verify.py"), "--requests", "3",
                           "--vocab", "300", "--repeats", "1"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same tokens emitted by every unseeded form" in proc.stdout and "3 requests: rows / table memory" in proc.stdout
    assert "| 3 | rows the walk reads, as it reads them |" in proc.stdout
    assert "| 3 | every request seeded: each row sampled with its generator's draw |" in proc.stdout
    assert "seeded / table time" in proc.stdout
    calls = proc.stdout.split("torch walk ")[-1]
    assert int(calls.split(",")[0]) > 10 * int(calls.split("Triton walk ")[1].split()[0])
