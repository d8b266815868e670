"""A real proposer (the tiny draft, on the CPU, no engine) near its requests' length limits:
what a request can still emit bounds its proposal, and one token from its limit it gets no
draft round at all."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the proposer's config reads vLLM's platform; vLLM is not installed here")

from vllm_ouroboros.patches import ADDITIONAL_CONFIG_KEY  # noqa: E402
from vllm_ouroboros.proposer import OuroborosProposer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def make_proposer(tiny_models, **more) -> OuroborosProposer:
    """A loaded proposer on the tiny draft, its costs as configured (no measuring) and a fixed
    batch cap: every request drafts. more: other settings."""
    settings = {"draft_model": str(tiny_models["draft"]), "max_speculative_batch": 8,
                "draft_cost_ms": {"1": 1, "64": 2}, "target_cost_ms": {"1": 10, "64": 12}, **more}
    vllm_config = SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: settings}, device_config=SimpleNamespace(device="cpu"),
        speculative_config=SimpleNamespace(num_speculative_tokens=8),
        model_config=SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 384, enforce_eager=True,
                                     dtype=torch.float32),
        scheduler_config=SimpleNamespace(max_num_seqs=4))
    p = OuroborosProposer(vllm_config)
    p.load_model(None)
    return p


@pytest.fixture(scope="module")
def proposer(tiny_models):
    return make_proposer(tiny_models)


def test_the_proposal_ends_where_the_request_can_emit_no_more(proposer):
    """max_tokens bounds a request as max_model_len does: with r tokens left, a proposal of
    more than r - 1 is verified for nothing (the accepted draft and one token more are all it
    can emit), and with one left (or none) the draft round would be paid for nothing."""
    limits = {"last": 41, "far": 200, "near": 43, "unknown": None}
    proposer.set_batch(list(limits), length_limit=limits.get, prompt_readable=lambda r: True)
    table = np.random.default_rng(0).integers(2, 300, (4, 260))
    lens = np.array([40, 40, 40, 254])  # "unknown": max_model_len (256) bounds it
    out = proposer.propose([[5]] * 4, lens, table)
    slot = {r: proposer._slot_of[r] for r in limits}
    assert out[0] == [] and proposer.runtime.kv_len[slot["last"]] == 0, "drafted for a request at its end"
    assert 0 < len(out[2]) <= 43 - 1 - 40
    assert len(out[1]) > 2
    assert len(out[3]) <= 256 - 1 - 254


def test_a_release_that_raises_still_resets_the_new_requests_slot(proposer, monkeypatch):
    """The slot table changes before the finished requests' slots are cleaned: where that
    cleaning raises, the new request given a freed slot must still start from its own state
    (length limit, estimates), not the previous occupant's, and the previous occupant's
    counts are not lost."""
    proposer.set_batch(["old"], length_limit=lambda r: 60, prompt_readable=lambda r: True)
    proposer._sync_requests(("old",))
    slot = proposer._slot_of["old"]
    proposer._model_est.accepted[slot] = 0.0
    proposer._last_main[slot], proposer._ctx_seen[slot] = 5, 40
    proposer.stats.add(np.array([slot]), accepted_tokens=np.array([7]))
    accepted = proposer.stats.snapshot(per_request=False)["accepted_tokens"]
    proposer.note_finished(["old", *[r for r in list(proposer._slot_of.slot_of) if r != "old"]])

    def fails(slots):
        raise RuntimeError("release failed (test)")

    monkeypatch.setattr(proposer.pool, "release", fails)
    proposer.set_batch(["new"], length_limit=lambda r: 90, prompt_readable=lambda r: True)
    with pytest.raises(RuntimeError, match="release failed"):
        proposer._sync_requests(("new",))
    assert proposer._slot_of["new"] == slot
    assert proposer._len_limit[slot] == 90
    assert np.array_equal(proposer._model_est.accepted[slot], proposer._model_est.prior)
    # Nor the old one's proposal or context seen (the next verification would read them).
    assert proposer._last_main[slot] == 0 and proposer._ctx_seen[slot] == 0
    # The old request's counts stay in the totals (metrics.OuroborosStats.start finishes it).
    assert proposer.stats.snapshot(per_request=False)["accepted_tokens"] == accepted
    assert proposer.stats.finished["old"]["accepted_tokens"] == 7
