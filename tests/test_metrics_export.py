"""The /metrics collector sums the drafting workers' snapshot files."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

# prometheus_client comes with vLLM; the lent GPU machine has neither.
pytest.importorskip("prometheus_client", reason="prometheus_client (a vLLM dependency) is not installed")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from vllm_ouroboros.metrics_export import OuroborosCollector, SnapshotWriter, new_writer_id, read_totals  # noqa: E402


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_snapshots_are_summed_and_exposed(tmp_path):
    """Live writers' snapshots summed; a dead writer's and a truncated one left out."""
    a = {"draft_forwards": 10, "accepted_tokens": 7, "pool": {"phrases": 5, "keys": 2, "memory_bytes": 100}}
    b = {"draft_forwards": 3, "accepted_tokens": 1, "pool": {"phrases": 1, "keys": 1, "memory_bytes": 50}}
    (tmp_path / f"snapshot-{os.getpid()}.json").write_text(json.dumps(a))
    (tmp_path / f"snapshot-{os.getppid()}.json").write_text(json.dumps(b))
    (tmp_path / f"snapshot-{dead_pid()}.json").write_text(json.dumps(a))
    with subprocess.Popen(["sleep", "30"]) as live:
        (tmp_path / f"snapshot-{live.pid}.json").write_text("{truncated")  # mid-write: ignored
        totals = read_totals(str(tmp_path))
        live.kill()
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

    w = SnapshotWriter(str(tmp_path), interval=3600, writer=f"{os.getpid()}-a")
    w.maybe_write(snap)
    w.maybe_write(snap)  # within the interval: skipped
    assert len(calls) == 1
    w.maybe_write(snap, force=True)
    assert read_totals(str(tmp_path))["draft_forwards"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [f"snapshot-{os.getpid()}-a.json"]
    # A write cut off before its rename (a full disk, the process killed) leaves the last
    # snapshot whole: the file is replaced, never written in place.
    from unittest import mock

    from vllm_ouroboros import metrics_export

    with mock.patch.object(metrics_export.os, "replace", side_effect=OSError(28, "No space left")):
        w.maybe_write(snap, force=True)
    assert len(calls) == 3 and w.failed_writes == 1
    assert read_totals(str(tmp_path))["draft_forwards"] == 2
    SnapshotWriter(None, writer="unused").maybe_write(snap)  # no directory: a no-op
    assert len(calls) == 3


def test_a_failed_write_is_logged_once_and_serving_goes_on(tmp_path, caplog):
    """The offline LLM's process removes the directory at exit while its engine may still run a
    step (seen: the worker died with FileNotFoundError); a full disk fails the same way."""
    import shutil

    d = tmp_path / "metrics"
    d.mkdir()
    w = SnapshotWriter(str(d), interval=0, writer=new_writer_id())
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


def test_counter_files_are_current_and_win_over_their_snapshot(tmp_path):
    """A worker's counter file (stored into every step) gives its counters, its rate-limited
    snapshot its gauges; a worker with a snapshot only (none mapped) gives both from it; a
    counter file of the wrong size (being created, another version's) is left out, as is a dead
    writer's (a server started by a process whose offline engines drafted: test_server.py)."""
    from vllm_ouroboros.metrics_export import COUNTERS, CounterFile, new_writer_id

    writer = new_writer_id()
    c = CounterFile(str(tmp_path), writer=writer)
    assert c.active
    stale = {"draft_forwards": 1, "accepted_tokens": 1, "pool": {"phrases": 4, "keys": 1, "memory_bytes": 9}}
    (tmp_path / f"snapshot-{writer}.json").write_text(json.dumps(stale))
    (tmp_path / f"snapshot-{os.getppid()}.json").write_text(json.dumps({"draft_forwards": 100, "pool": {"phrases": 1}}))
    # Of another size (being created, or another version's counters): left out, whatever it holds.
    (tmp_path / "counters-1.bin").write_bytes(np.full(len(COUNTERS) + 1, 7, np.int64).tobytes())
    gone = dead_pid()
    (tmp_path / f"counters-{gone}.bin").write_bytes(np.full(len(COUNTERS), 5, np.int64).tobytes())
    (tmp_path / f"snapshot-{gone}.json").write_text(json.dumps({"pool": {"phrases": 70}}))
    values = [0] * len(COUNTERS)
    values[list(COUNTERS).index("draft_forwards")] = 12
    values[list(COUNTERS).index("accepted_tokens")] = 30
    c.publish(values)
    totals = read_totals(str(tmp_path))
    assert totals["draft_forwards"] == 112 and totals["accepted_tokens"] == 30
    assert totals["pool_phrases"] == 5
    values[list(COUNTERS).index("accepted_tokens")] = 31  # the next step: seen at once
    c.publish(values)
    assert read_totals(str(tmp_path))["accepted_tokens"] == 31
    assert not CounterFile(None, writer="unused").active
    with pytest.raises(TypeError):  # a worker's two files are paired by the id: no default draws one per file
        CounterFile(str(tmp_path))
    CounterFile(None, writer="unused").publish(values)  # no directory: a no-op


def test_exported_totals_are_the_snapshots_counters():
    """OuroborosStats.exported_totals (what a step stores in the counter file) gives, for every
    exported counter, the aggregate snapshot's value: finished and live requests, the
    aggregate counters and the proposer's own."""
    from vllm_ouroboros.metrics import PER_REQUEST, OuroborosStats
    from vllm_ouroboros.metrics_export import COUNTERS

    stats = OuroborosStats(4)
    rng = np.random.default_rng(0)
    for slot, req in enumerate("abc"):
        stats.start(slot, req)
    for _ in range(3):
        stats.add(np.array([0, 1, 2, 1]), **{k: rng.integers(0, 5, 4) for k in PER_REQUEST})
        stats.round_done(3, 1, 3)
    stats.finish(1)
    elsewhere = {"requests_returned": 2, "slots_evicted": 1, "absent_caches_dropped": 5, "mode_switches": 3,
                 "chain_fallback_steps": 4}
    snap = {**stats.snapshot(per_request=False), **elsewhere}
    got = stats.exported_totals(**elsewhere)
    assert dict(zip(COUNTERS, got.tolist())) == {k: snap[k] for k in COUNTERS}
    assert got[list(COUNTERS).index("draft_forwards")] > 0


def test_a_request_brought_back_keeps_both_stretches():
    """vLLM may evict a request and bring it back in another slot: its per-request counters are
    the sum of both stretches, while live and once finished; the totals count each once."""
    from vllm_ouroboros.metrics import OuroborosStats

    stats = OuroborosStats(2)
    stats.start(0, "a")
    stats.add(np.array([0]), accepted_tokens=np.array([3]), target_forwards=np.array([1]))
    stats.finish(0)
    stats.start(1, "a")
    stats.add(np.array([1]), accepted_tokens=np.array([4]), target_forwards=np.array([2]))
    live = stats.snapshot()["per_request"]["a"]
    assert (live["accepted_tokens"], live["target_forwards"]) == (7, 3)
    stats.finish(1)
    snap = stats.snapshot()
    assert snap["per_request"]["a"] == live and snap["accepted_tokens"] == 7


@pytest.mark.parametrize("servers", ["one", "several"])
def test_metrics_served_by_vllms_routes_have_the_ouroboros_series(tmp_path, monkeypatch, servers):
    """GET /metrics and /metrics/ on vLLM's own routes (attach_router). With several API servers
    (data parallelism's default) vLLM serves registries built for multiprocess mode, not the
    default one: `/metrics/` a registry built once, `/metrics` (the Instrumentator's route)
    one built at every scrape; the series were in neither."""
    pytest.importorskip("vllm", reason="serves vLLM's /metrics routes; vLLM is not installed here")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    from vllm_ouroboros.metrics_export import process_collector

    monkeypatch.setattr(process_collector(), "path", str(tmp_path))
    (tmp_path / f"snapshot-{os.getpid()}-a.json").write_text(json.dumps({"draft_forwards": 4}))
    if servers == "several":
        procs = tmp_path / "prom"
        procs.mkdir()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(procs))
    app = FastAPI()
    attach_router(app)
    client = TestClient(app)
    for path in ("/metrics", "/metrics/"):
        text = client.get(path).text
        assert "vllm:ouroboros_draft_forwards_total 4.0" in text, (servers, path)
        assert text.count("# TYPE vllm:ouroboros_draft_forwards_total counter") == 1, (servers, path)


def test_a_writer_that_exits_keeps_its_counts_in_the_exported_counters(tmp_path):
    """Two engines (data parallelism), one exits: the exported counters keep its last counts
    (a drop would read as a counter reset to Prometheus, which would count the other engine's
    whole total again); a count read lower than before (an older snapshot) gives the last; a
    writer dead before it was ever read stays out (an inherited directory's)."""
    from vllm_ouroboros.metrics_export import COUNTERS

    def counts(n):
        v = np.zeros(len(COUNTERS), np.int64)
        v[list(COUNTERS).index("draft_forwards")] = n
        return v.tobytes()

    (tmp_path / f"counters-{dead_pid()}.bin").write_bytes(counts(1000))  # dead before any read
    mine = tmp_path / f"counters-{os.getpid()}.bin"
    mine.write_bytes(counts(10))
    seen = {}
    with subprocess.Popen(["sleep", "30"]) as other:
        theirs = tmp_path / f"counters-{other.pid}.bin"
        theirs.write_bytes(counts(50))
        assert read_totals(str(tmp_path), seen)["draft_forwards"] == 60
        theirs.write_bytes(counts(40))  # lower than read before: the last stands
        assert read_totals(str(tmp_path), seen)["draft_forwards"] == 60
        other.kill()
        other.wait()
    mine.write_bytes(counts(12))
    assert read_totals(str(tmp_path), seen)["draft_forwards"] == 62
    assert read_totals(str(tmp_path))["draft_forwards"] == 12  # without the memory: the live only

    registry = CollectorRegistry()
    collector = OuroborosCollector(str(tmp_path))
    registry.register(collector)
    assert "vllm:ouroboros_draft_forwards_total 12.0" in generate_latest(registry).decode()


def test_engine_snapshot_takes_the_first_worker_that_drafts():
    """Under pipeline parallelism the first stage's workers have no drafter (their snapshot is
    None): engine_snapshot said the engine did not run ouroboros. It takes the first drafting
    worker's; an engine with none is still refused."""
    import pytest

    from vllm_ouroboros.metrics import engine_snapshot

    class Engine:
        def __init__(self, snaps):
            self.snaps = snaps

        def collective_rpc(self, method):
            assert method == "ouroboros_snapshot"
            return self.snaps

    assert engine_snapshot(Engine([None, None, {"rounds": 3}, {"rounds": 3}])) == {"rounds": 3}
    assert engine_snapshot(Engine([{"rounds": 1}])) == {"rounds": 1}
    for snaps in ([None, None], [], None):
        with pytest.raises(RuntimeError, match="does not run the ouroboros method"):
            engine_snapshot(Engine(snaps))


def test_a_second_drafter_in_one_process_adds_to_the_exported_counters(tmp_path):
    """An offline engine rebuilt in one process (or a new process given a dead writer's pid):
    the second drafter writes files of its own, so its counts add to the first one's, which
    the collector remembers (one file per pid was truncated, and the memory of its larger
    count hid the new counts until they passed it)."""
    from vllm_ouroboros.metrics_export import COUNTERS, CounterFile, new_writer_id

    seen = {}
    first_id, second_id = new_writer_id(), new_writer_id()
    assert first_id != second_id and first_id.split("-")[0] == str(os.getpid())
    first = CounterFile(str(tmp_path), writer=first_id)
    SnapshotWriter(str(tmp_path), writer=first_id).maybe_write(lambda: {"draft_forwards": 100})
    totals = np.zeros(len(COUNTERS), np.int64)
    totals[list(COUNTERS).index("draft_forwards")] = 100
    first.publish(totals)
    assert read_totals(str(tmp_path), seen)["draft_forwards"] == 100  # counter file and snapshot: once
    del first
    second = CounterFile(str(tmp_path), writer=second_id)
    totals[list(COUNTERS).index("draft_forwards")] = 30
    second.publish(totals)
    assert read_totals(str(tmp_path), seen)["draft_forwards"] == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"counters-{first_id}.bin", f"counters-{second_id}.bin", f"snapshot-{first_id}.json"])


def test_the_plugins_variables_pass_vllms_strict_environment_check(monkeypatch):
    """vLLM warns about every VLLM_ variable it does not know and, under
    `--fail-on-environ-validation`, refuses to start: the metrics directory's variable, which
    the plugin sets itself in every process it loads in (with or without speculation), did
    that to every vLLM where the package was installed. (vLLM sets one it does not know
    itself, VLLM_DIST_IDENT, in a process that ran an engine: not ours, left out here.)"""
    pytest.importorskip("vllm", reason="the check is vLLM's")
    from vllm import envs
    from vllm.platforms import current_platform

    from vllm_ouroboros import metrics, metrics_export

    for name in (metrics_export.ENV_DIR, metrics.TRACE_ENV):
        assert not name.startswith("VLLM_"), name
    for name in [k for k in os.environ if k.startswith("VLLM_") and k not in envs.environment_variables]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(metrics_export.ENV_DIR, "")  # restored (or removed) after the test
    metrics_export.ensure_dir()  # what the plugin does at registration
    assert os.environ.get(metrics_export.ENV_DIR)
    current_platform.validate_environ(hard_fail=True)
