"""RoundTrace (metrics.py): one JSON line per request-round, written only when enabled."""

import json

import numpy as np

from vllm_ouroboros.metrics import RoundTrace


def test_round_trace_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    t = RoundTrace(str(path))
    t.drafted(np.array([3, 5]), ["a", "b"], np.array([6, 4]), np.array([5, 4]), np.array([6, 4]),
              np.array([True, False]), 12)
    t.verified(np.array([5, 3, 9]), np.array([7, 2, 1]))  # slot 9 drafted nothing: no line
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {"req": "b", "draft": 4, "sent": 4, "cut": 12, "forwards": 4, "stop": "cap", "source": "model",
         "accepted": 7, "accepted_draft": 4},
        {"req": "a", "draft": 6, "sent": 5, "cut": 12, "forwards": 6, "stop": "rule", "source": "model",
         "accepted": 2, "accepted_draft": 2}]
    t.drafted(np.array([1]), ["c"], np.array([4]), np.array([4]), np.array([4]), None, 3)
    t.verified(np.array([1]), np.array([0]))
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["stop"] == "gamma" and last["cut"] == 3
    # A step of the model's rows and pool-filled ones: a cut per row, and which drafted it.
    t.drafted(np.array([1, 2]), ["c", "d"], np.array([4, 8]), np.array([4, 2]), np.array([4, 0]), None,
              np.array([12, 2]), np.array([False, True]))
    t.verified(np.array([1, 2]), np.array([1, 2]))
    c, d = (json.loads(x) for x in path.read_text().splitlines()[-2:])
    assert (c["cut"], c["source"], d["cut"], d["source"], d["forwards"]) == (12, "model", 2, "pool", 0)


def test_round_trace_off_writes_nothing(tmp_path):
    t = RoundTrace(None)
    assert not t.on
    t.drafted(np.array([0]), ["a"], np.array([4]), np.array([4]), np.array([4]), None, 12)
    t.verified(np.array([0]), np.array([4]))
    assert list(tmp_path.iterdir()) == []
