"""The runner patches' bookkeeping around vLLM's request lifecycle, on stand-in runners (no
engine): what vLLM tells the runner reaches the proposer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the runner patches import vLLM's classes; vLLM is not installed here")

from vllm_ouroboros.patches import model_runner  # noqa: E402
from vllm_ouroboros.proposer import OuroborosProposer  # noqa: E402


def test_a_max_model_len_fitted_after_load_reaches_the_proposer():
    """vLLM fits max_model_len to KV memory after the workers loaded and tells the runner
    (update_max_model_len): the proposer's room and length limits follow it."""
    calls = []
    drafter = SimpleNamespace(is_ouroboros=True, max_model_len=4096, _len_limit=np.array([4096, 900]))
    drafter.update_max_model_len = lambda n: OuroborosProposer.update_max_model_len(drafter, n)
    runner = SimpleNamespace(drafter=drafter)
    update = model_runner._update_max_model_len(lambda self, n: calls.append(n))
    update(runner, 1000)
    assert calls == [1000] and drafter.max_model_len == 1000 and drafter._len_limit.tolist() == [1000, 900]
    update(SimpleNamespace(drafter=None), 500)  # another drafter, or none: vLLM's alone
    assert calls == [1000, 500]


def test_a_streaming_sessions_next_segment_starts_its_slot_afresh():
    """vLLM sends a streaming-input session's next segment as a new request under the id the
    runner holds (its prompt, sampling params and max_tokens replaced, no finished notice): the
    proposer releases its slot, to be given afresh at the next sync, as for a finished one."""
    noted = []
    drafter = SimpleNamespace(is_ouroboros=True, note_finished=lambda ids: noted.append(sorted(ids)))
    runner = SimpleNamespace(drafter=drafter, requests={"a": 1, "b": 2})
    update = model_runner._update_states(lambda self, out: "updated")
    out = lambda new, done=(): SimpleNamespace(  # noqa: E731
        scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new], finished_req_ids=set(done))
    assert update(runner, out(["b", "c"])) == "updated" and noted == [["b"]]
    update(runner, out(["c"], done={"a"}))
    assert noted == [["b"], ["a"]]
    update(runner, out(["c"]))  # nothing finished or resumed under a held id: no call
    assert len(noted) == 2
