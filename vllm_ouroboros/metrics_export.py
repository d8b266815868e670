"""Ouroboros counters in the server's /metrics, next to vLLM's `vllm:spec_decode_*`.

The counters live in the worker process that drafts; /metrics is served by the API-server
process. The plugin (in the API server, before any engine process is spawned) picks a directory
and exports it in the environment, so every engine/worker process inherits it. There the
drafting worker keeps its counters in a memory-mapped file, stored into at the end of every step
(CounterFile: current at any scrape, the last step of a burst included), and writes its
aggregate snapshot as JSON at most every `interval` seconds (atomic replace; the gauges, whose
reading costs device work). A Prometheus collector in the API server reads the files at scrape
time.
Only the first tensor-parallel rank of each engine writes (all ranks draft the same tokens);
snapshots of several engines (data parallel) are summed. Same host only: a Ray worker on
another node writes to its own disk.
"""

from __future__ import annotations

import atexit
import glob
import json
import logging
import os
import secrets
import shutil
import tempfile
import time

import numpy as np

from vllm_ouroboros import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

ENV_DIR = "OUROBOROS_METRICS_DIR"
PREFIX = "vllm:ouroboros_"

COUNTERS = {
    "draft_forwards": "Draft forwards summed over requests (a batched forward counts per request)",
    "draft_forward_calls": "Batched draft forward calls",
    "prefill_forwards": "Draft prefill forwards summed over requests",
    "rounds": "Drafting rounds (propose calls that drafted)",
    "backoff_steps": "Request-steps without a draft from the draft model: speculation would not pay (load or "
                     "low acceptance); the pool may have drafted instead (pool_draft_steps)",
    "shortened_steps": "Request-steps whose draft the back-off cut short: load made the target's tokens dear",
    "branches_cut": "The pool's branches found but left out by the back-off's cut (whole branches, best sent first)",
    "cache_full_steps": "Request-steps without a draft from the draft model: the draft KV cache could not grow "
                        "(device memory); the pool may have drafted instead",
    "suffix_skipped": "Request-steps whose draft went without its candidate suffixes: they would not pay",
    "unreadable_prompt_steps": "Request-steps without a draft from the draft model: the prompt came as embeddings "
                               "it cannot read; the pool may have drafted instead",
    "sampling_pause_steps": "Request-steps without any draft: a request in the batch sampled with settings "
                            "no verifier of drafts applies exactly (e.g. logprob_token_ids beside bad words); "
                            "drafting resumes when it leaves",
    "scheduler_cut_steps": "Request-steps whose draft vLLM's scheduler cut short (max_num_batched_tokens taken)",
    "target_forwards": "Target verification steps that carried an ouroboros draft, per request",
    "drafted_tokens": "Tokens sent to the target for verification (draft + suffix)",
    "accepted_tokens": "Drafted tokens the target accepted",
    "suffix_accepted": "Accepted tokens that came from a candidate suffix",
    "tree_suffix_accepted": "Accepted tokens from a candidate suffix other than the first (tree)",
    "tree_gain": "Tokens the token tree matched beyond suffix 0 alone in the same steps (argmax)",
    "generated_tokens": "Tokens produced by requests while drafting",
    "guess_tokens": "Draft tokens taken from pool phrases (phrase drafting)",
    "guess_lookups": "Draft forwards that verified pool phrases",
    "guess_hits": "Draft forwards in which a pool phrase gave at least one token",
    "inspiration_inserts": "Phrases inserted by candidate inspiration",
    "refinement_inserts": "Phrases rewritten by candidate refinement",
    "draft_rounds": "Request-steps that drafted a sentence draft (the draft model's or the pool's chain; "
                    "the pool's branches are none)",
    "sentence_draft_tokens": "Sentence-draft tokens drafted (mean draft length = this / draft_rounds)",
    "stops_rule": "Adaptive draft length: drafts stopped by the acceptance head's rule",
    "stops_cap": "Adaptive draft length: drafts stopped by max_draft_length (or max_draft_forwards)",
    "pool_draft_steps": "Request-steps drafted by the pool alone, with no draft forward (the pool mode, or a "
                        "request the draft model did not draft for)",
    "requests_returned": "Requests back in a step after steps out of the batch (preempted or left out by "
                         "the token budget), to the draft slot and cache they kept",
    "slots_evicted": "Requests out of the batch whose draft slot went to a new request (all slots taken)",
    "absent_caches_dropped": "Requests out of the batch whose draft KV pages were released for "
                             "requests in it (the draft KV cache was full)",
    "chain_fallback_steps": "Drafting steps that sent chains instead of the token tree: a request in the batch "
                            "used structured output or a sampling setting the tree walk does not apply",
    "mode_switches": "Drafting mode switches while serving, between the draft model and the pool alone "
                     "(mode_review.py)",
}
# Gauges by snapshot section: (section, key) -> help; exported as <section>_<key>.
GAUGES = {
    ("pool", "phrases"): "Phrases in the pool",
    ("pool", "keys"): "Key tokens holding at least one phrase",
    ("pool", "memory_bytes"): "Device bytes owned by the pool",
    ("draft_cache", "memory_bytes"): "Device bytes of the draft's KV cache pages",
    ("draft_cache", "pages"): "Pages of the draft's KV cache (free or held)",
    ("draft_cache", "pages_used"): "Pages of the draft's KV cache held by requests",
}


def ensure_dir() -> str:
    """The metrics directory, created and exported on first use in this process tree."""
    path = os.environ.get(ENV_DIR)
    if not path:
        path = tempfile.mkdtemp(prefix="vllm-ouroboros-metrics-")
        os.environ[ENV_DIR] = path
        # The creating process (API server or offline LLM's process) outlives its engines.
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def new_writer_id() -> str:
    """A drafting worker's name in its files, `<pid>-<random>`: a second drafter in one process
    (an offline engine rebuilt) or a later process given a dead writer's pid starts new files
    instead of truncating one the collector remembers larger (it would hide the new counts)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


class SnapshotWriter:
    """Writes a worker's aggregate counters for the collector, rate-limited. A write that fails
    (the directory removed: the offline LLM's process removes it at exit while its engine may
    still run a step; a full disk) is logged once and skipped: metrics never stop a step."""

    def __init__(self, path: str | None, *, writer: str, interval: float = 0.5):
        """writer: the id shared with the worker's CounterFile (new_writer_id()); required, as
        the collector pairs a worker's two files by it (a default drawn per file split them)."""
        self.file = os.path.join(path, f"snapshot-{writer}.json") if path else None
        self.interval = interval
        self._last = -float("inf")
        self.failed_writes = 0

    def maybe_write(self, snapshot_fn, force: bool = False) -> None:
        if self.file is None:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        snapshot = json.dumps(snapshot_fn())  # outside the try: a bad snapshot is our bug
        tmp = self.file + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.write(snapshot)
            os.replace(tmp, self.file)
        except OSError as e:
            if not self.failed_writes:
                logger.warning("vllm-ouroboros: cannot write the metrics snapshot %s (%s); /metrics "
                               "shows the last one written, serving goes on", self.file, e)
            self.failed_writes += 1


class CounterFile:
    """A worker's counters for the collector, as an int64 array in COUNTERS order memory-mapped
    from `counters-<writer id>.bin`: a step stores its totals into the mapping (the page cache, which
    the collector's next read sees; no system call, nothing to fail once mapped). Written only
    from the rate-limited snapshot, which only a step writes, /metrics lagged by up to its
    interval and kept missing the last steps of a burst until the next request came."""

    def __init__(self, path: str | None, *, writer: str):
        """writer: the id shared with the worker's SnapshotWriter (new_writer_id())."""
        self.values: np.ndarray | None = None
        if path:
            name = os.path.join(path, f"counters-{writer}.bin")
            try:
                self.values = np.memmap(name, np.int64, "w+", shape=(len(COUNTERS),))
            except OSError as e:
                logger.warning("vllm-ouroboros: cannot map the metrics counters %s (%s); /metrics "
                               "shows the rate-limited snapshot's, serving goes on", name, e)

    @property
    def active(self) -> bool:
        return self.values is not None

    def publish(self, values: np.ndarray) -> None:
        """Store the totals [len(COUNTERS)] (int64, COUNTERS order)."""
        if self.values is not None:
            self.values[:] = values


def _writer(name: str) -> tuple[str, int | None]:
    """(writer id, its pid) of a file `<kind>-<pid>[-<random>].<ext>` (new_writer_id); pid None
    if the name has none."""
    stem = os.path.splitext(os.path.basename(name))[0]
    writer = stem.split("-", 1)[1] if "-" in stem else ""
    try:
        return writer, int(writer.split("-", 1)[0])
    except ValueError:
        return writer, None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def _read_counters(name: str) -> np.ndarray | None:
    try:
        values = np.fromfile(name, np.int64)
    except (OSError, ValueError):
        return None
    return values if len(values) == len(COUNTERS) else None  # being created, or another version's


def read_totals(path: str, seen: dict[str, np.ndarray] | None = None) -> dict[str, float] | None:
    """Sum over the workers with files in `path` of their counters (their counter file, else
    their snapshot's) and gauges (snapshot), None if there are none.

    A dead writer's files are left out unless `seen` (the caller's memory, updated here: writer
    id -> the counters last read from it) holds it: the directory is inherited by whatever a process
    that set it starts, so a server started from a process whose offline engines had drafted
    would otherwise sum their counts with its own. A writer read before keeps its last counts
    in the sum once it exits (one engine of several under data parallelism: the exported
    counters would otherwise step back, which Prometheus reads as a reset and counts every
    other engine's whole total again), and a read that finds less than the last (an older
    snapshot read where the counter file was being replaced) gives the last. A restarted engine
    is a new writer: its counters start from 0 beside the old one's."""
    totals = {key: 0 for key in COUNTERS}
    totals.update({f"{section}_{key}": 0 for section, key in GAUGES})
    found = False
    counts: dict[str, np.ndarray] = {}
    for name in glob.glob(os.path.join(path, "counters-*.bin")):
        writer, pid = _writer(name)
        values = _read_counters(name) if _alive(pid) else None
        if values is not None:
            counts[writer] = values
    for name in glob.glob(os.path.join(path, "snapshot-*.json")):
        writer, pid = _writer(name)
        if not _alive(pid):
            continue
        try:
            with open(name) as f:
                snap = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced or from a crashed writer
        found = True
        if writer not in counts:
            counts[writer] = np.array([snap.get(key, 0) for key in COUNTERS], np.int64)
        for section, key in GAUGES:
            totals[f"{section}_{key}"] += (snap.get(section) or {}).get(key, 0)
    if seen is not None:
        for writer, values in counts.items():
            if writer in seen:
                counts[writer] = np.maximum(values, seen[writer])
        seen.update(counts)
        counts = seen  # the live writers as read now, and the exited ones as last read
    for values in counts.values():
        found = True
        for key, v in zip(COUNTERS, values.tolist()):
            totals[key] += v
    return totals if found else None


class OuroborosCollector:
    """Prometheus collector exposing the summed snapshots as `vllm:ouroboros_*`."""

    def __init__(self, path: str):
        self.path = path
        self._seen: dict[str, np.ndarray] = {}  # read_totals' memory of the writers read

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        totals = read_totals(self.path, self._seen)
        if totals is None:
            return
        for key, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + key, doc, value=totals[key])
        for (section, key), doc in GAUGES.items():
            name = f"{section}_{key}"
            yield GaugeMetricFamily(PREFIX + name, doc, value=totals[name])


_collector: OuroborosCollector | None = None
_registered = False


def process_collector() -> OuroborosCollector:
    """This process's collector, one for every registry that serves it (its memory of exited
    writers is kept across scrapes: patches/metrics_registry.py)."""
    global _collector
    if _collector is None:
        _collector = OuroborosCollector(ensure_dir())
    return _collector


def register_collector() -> None:
    """Add the collector to prometheus_client's default registry (what /metrics serves with a
    single API server); idempotent."""
    global _registered
    if _registered:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(process_collector())
    _registered = True
