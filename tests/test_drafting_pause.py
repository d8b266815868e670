"""Drafting pauses while a request in the batch samples with settings that neither the tree walk
applies nor vLLM's rejection sampler gets right (logprob_token_ids beside bad words or another
feature the walk leaves to that sampler): the step it joins rejects the drafts already made, unjudged, and samples its roots
plainly (tree_verify.root_sample); nobody drafts until it leaves. A real proposer (the tiny
draft, no engine) and the runner patch on a stand-in runner; the engine run is
tests/test_e2e_tiny.py::test_logprobs_of_chosen_token_ids_as_without_speculation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the proposer's config reads vLLM's platform; vLLM is not installed here")

from test_proposal_room import make_proposer  # noqa: E402

from vllm_ouroboros.patches import model_runner, tree_verify  # noqa: E402
from vllm_ouroboros.target_step import StepOutcome  # noqa: E402
from vllm_ouroboros.tree import TreeLayout  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = ["a", "b"]


def _propose(p):
    table = np.random.default_rng(0).integers(2, 300, (2, 80))
    return p.propose([[5], [6]], np.array([40, 40]), table)


def test_a_paused_proposer_drafts_nothing_and_resumes(tiny_models):
    p = make_proposer(tiny_models)
    p.set_batch(BATCH, length_limit=lambda r: 200, prompt_readable=lambda r: True)
    assert all(_propose(p)), "the control: these requests draft"
    p.set_drafting_allowed_for_sampling("logprobs of the whole vocabulary")
    assert p.drafting_paused
    rounds = p.stats.snapshot(per_request=False)["draft_rounds"]
    assert _propose(p) == [[], []]
    snap = p.stats.snapshot(per_request=False)
    assert snap["sampling_pause_steps"] == 2 and snap["draft_rounds"] == rounds
    assert p.layouts(BATCH)[0].tolist() == [0, 0], "a paused step's layout still says drafts"
    p.set_drafting_allowed_for_sampling(None)
    assert not p.drafting_paused and all(_propose(p))


def _outcome(p, judged: bool) -> StepOutcome:
    """Every draft of the last proposals rejected at its first token (the target said 1)."""
    n, sl = p.layouts(BATCH)
    lay = TreeLayout(n, sl, D=int(n.max()), L=p.cfg.phrase_len)
    tokens = np.full((2, lay.D + sl.shape[1] * p.cfg.phrase_len), 9, np.int64)
    tn = np.ones((2, tokens.shape[1] + 1), np.int64)
    return StepOutcome(tree=lay.tree("cpu", tokens), tokens=tokens, target_next=tn,
                       num_accepted=np.zeros(2, np.int64), suffix_index=np.full(2, -1),
                       drafts_judged=judged)


@pytest.mark.parametrize("judged", [True, False], ids=["judged", "unjudged"])
def test_unjudged_rejections_leave_the_estimates_and_count_the_tokens(tiny_models, judged):
    """A step whose drafts were rejected unjudged counts what was sent and feeds the pool, but
    the back-off's acceptance estimates learn nothing from it (judged: the control, where the
    same rejections lower them)."""
    p = make_proposer(tiny_models)
    p.set_batch(BATCH, length_limit=lambda r: 200, prompt_readable=lambda r: True)
    assert all(_propose(p))
    slots = p._slot_of.slots(BATCH)
    before = p._model_est.accepted[slots].copy()
    outcome = _outcome(p, judged)
    p.on_verified(BATCH, outcome)
    snap = p.stats.snapshot(per_request=False)
    assert snap["drafted_tokens"] == int(outcome.tree.layout.num_nodes.sum()) > 0
    assert snap["accepted_tokens"] == 0 and snap["target_forwards"] == 2
    moved = not np.allclose(p._model_est.accepted[slots], before)
    assert moved == judged


def _sampling_metadata(**over):
    sm = dict(max_num_logprobs=None, logprob_token_ids={}, no_penalties=True, bad_words_token_ids={},
              allowed_token_ids_mask=None, thinking_budget_state_holder=None,
              logitsprocs=SimpleNamespace(all=[]))
    sm.update(over)
    return SimpleNamespace(**sm)


def test_the_pause_follows_the_batchs_sampling():
    """drafting_pause: only where the walk does not take the batch and vLLM's rejection sampler
    would get it wrong."""
    for sm, want in ((_sampling_metadata(), None),
                     (_sampling_metadata(logprob_token_ids={0: [5]}), None),  # the walk takes it
                     (_sampling_metadata(no_penalties=False), None),  # the walk (tree_penalties.py)
                     (_sampling_metadata(no_penalties=False, logprob_token_ids={0: [5]}), None),
                     (_sampling_metadata(bad_words_token_ids={0: [[7]]}), None),  # vLLM's rejection sampler
                     (_sampling_metadata(bad_words_token_ids={0: [[7]]}, logprob_token_ids={0: [5]}),
                      "logprobs of chosen token ids beside bad_words"),
                     (_sampling_metadata(max_num_logprobs=-1), "logprobs of the whole vocabulary")):
        assert tree_verify.drafting_pause(sm, tree_verify.unsupported_sampling(sm)) == want, sm


def test_a_step_without_speculative_metadata_ends_a_pause_whose_cause_left():
    """vLLM 0.32 builds speculative metadata on every step of a speculative engine, so sample()
    decides the pause; a step without it must not leave drafting paused for good."""
    calls = []
    drafter = SimpleNamespace(is_ouroboros=True, drafting_paused=True, set_batch=lambda *a: None)

    def allow(reason):
        drafter.drafting_paused = reason is not None

    drafter.set_drafting_allowed_for_sampling = allow
    runner = SimpleNamespace(drafter=drafter, requests={}, _ouroboros_step=None,
                             sampler=SimpleNamespace(logprobs_mode="raw_logprobs"),
                             input_batch=SimpleNamespace(req_ids=["a"], sampling_metadata=_sampling_metadata()))
    sample = model_runner._sample(lambda self, logits, meta: calls.append(meta) or "sampled")
    assert sample(runner, logits=object(), spec_decode_metadata=None) == "sampled"
    assert calls == [None] and not drafter.drafting_paused
    runner.input_batch.sampling_metadata = _sampling_metadata(max_num_logprobs=-1)
    drafter.drafting_paused = True
    sample(runner, logits=object(), spec_decode_metadata=None)
    assert drafter.drafting_paused, "the cause is still in the batch"
