"""scripts/benchmark.py's identity column (`derive`): greedy cells, and ouroboros's sampled cells
(seeded requests sample as without speculation), are compared with no speculation; vLLM's own
methods' sampled cells are not ("n/a")."""
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # benchmark.py imports generate.py
    had = "generate" in sys.modules
    spec = importlib.util.spec_from_file_location("benchmark_script", REPO / "scripts" / "benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    if not had:
        sys.modules.pop("generate", None)


def row(method, temperature, outputs):
    return {"method": method, "workload": "humaneval", "concurrency": 4, "temperature": temperature,
            "outputs": outputs, "tokens": 8, "seconds": 1.0, "spec": {}}


def test_sampled_ouroboros_cells_are_compared_with_no_speculation(bench):
    base = [row("no-spec", 0.0, [[1, 2]]), row("no-spec", 0.7, [[3, 4]])]
    rows = [row("ouroboros", 0.7, [[3, 4]]), row("ouroboros-k3", 0.7, [[3, 5]]),
            row("draft_model-k3", 0.7, [[3, 5]]), row("ouroboros", 0.0, [[1, 2]]),
            row("ngram", 0.0, [[1, 9]]), row("ouroboros", 0.7, [[3, 4]]) | {"concurrency": 16}]
    curves = (lambda r: 1), {1: 1.0, 128: 1.0}, {1: 0.1, 128: 0.1}  # ocfg_tokens, t(n), t_draft(n)
    bench.derive(base, base, *curves)  # as the script does: no speculation's rows first
    bench.derive(rows, base, *curves)
    assert [r["identical"] for r in rows] == [True, False, None, True, False, None]
    table = bench.markdown(rows, {1: 1.0, 128: 1.0}, {1: 0.1, 128: 0.1}, "# t")
    assert "| ouroboros-k3 | humaneval | 4 | 0.7 | NO | differs |" in table
