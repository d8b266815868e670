"""The /metrics collector sums the drafting workers' snapshot files."""

from __future__ import annotations

import json

import pytest

# prometheus_client comes with vLLM; the lent GPU machine has neither.
pytest.importorskip("prometheus_client", reason="prometheus_client (a vLLM dependency) is not installed")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from vllm_ouroboros.metrics_export import OuroborosCollector, SnapshotWriter, read_totals  # noqa: E402


def test_snapshots_are_summed_and_exposed(tmp_path):
    a = {"draft_forwards": 10, "accepted_tokens": 7, "pool": {"phrases": 5, "keys": 2, "memory_bytes": 100}}
    b = {"draft_forwards": 3, "accepted_tokens": 1, "pool": {"phrases": 1, "keys": 1, "memory_bytes": 50}}
    (tmp_path / "snapshot-1.json").write_text(json.dumps(a))
    (tmp_path / "snapshot-2.json").write_text(json.dumps(b))
    (tmp_path / "snapshot-3.json").write_text("{truncated")  # a writer died mid-write: ignored
    totals = read_totals(str(tmp_path))
    assert totals["draft_forwards"] == 13 and totals["accepted_tokens"] == 8
    assert totals["pool_phrases"] == 6 and totals["inspiration_inserts"] == 0

    registry = CollectorRegistry()
    registry.register(OuroborosCollector(str(tmp_path)))
    text = generate_latest(registry).decode()
    assert "vllm:ouroboros_draft_forwards_total 13.0" in text
    assert "vllm:ouroboros_pool_memory_bytes 150.0" in text


def test_no_snapshot_no_metrics(tmp_path):
    registry = CollectorRegistry()
    registry.register(OuroborosCollector(str(tmp_path)))
    assert "ouroboros" not in generate_latest(registry).decode()


def test_writer_is_rate_limited_and_atomic(tmp_path):
    calls = []

    def snap():
        calls.append(1)
        return {"draft_forwards": len(calls)}

    w = SnapshotWriter(str(tmp_path), interval=3600)
    w.maybe_write(snap)
    w.maybe_write(snap)  # within the interval: skipped
    assert len(calls) == 1
    w.maybe_write(snap, force=True)
    assert read_totals(str(tmp_path))["draft_forwards"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [f"snapshot-{__import__('os').getpid()}.json"]
    SnapshotWriter(None).maybe_write(snap)  # no directory: a no-op
    assert len(calls) == 2


def test_a_failed_write_is_logged_once_and_serving_goes_on(tmp_path, caplog):
    """The offline LLM's process removes the directory at exit while its engine may still run a
    step (seen: the worker died with FileNotFoundError); a full disk fails the same way."""
    import shutil

    d = tmp_path / "metrics"
    d.mkdir()
    w = SnapshotWriter(str(d), interval=0)
    w.maybe_write(lambda: {"draft_forwards": 1})
    shutil.rmtree(d)
    with caplog.at_level("WARNING", logger="vllm.ouroboros"):
        w.maybe_write(lambda: {"draft_forwards": 2})
        w.maybe_write(lambda: {"draft_forwards": 3})
    assert w.failed_writes == 2
    assert sum("cannot write the metrics snapshot" in r.getMessage() for r in caplog.records) == 1
    d.mkdir()  # back: the next write lands
    w.maybe_write(lambda: {"draft_forwards": 4})
    assert read_totals(str(d))["draft_forwards"] == 4
