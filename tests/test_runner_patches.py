"""The runner patches' bookkeeping around vLLM's request lifecycle, on stand-in runners (no
engine): what vLLM tells the runner reaches the proposer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the runner patches import vLLM's classes; vLLM is not installed here")

from vllm_ouroboros.patches import model_runner  # noqa: E402
from conftest import bare_proposer  # noqa: E402
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
        scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new], finished_req_ids=set(done),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_output_tokens=[]))
    assert update(runner, out(["b", "c"])) == "updated" and noted == [["b"]]
    update(runner, out(["c"], done={"a"}))
    assert noted == [["b"], ["a"]]
    update(runner, out(["c"]))  # nothing finished or resumed under a held id: no call
    assert len(noted) == 2


def test_the_step_that_removes_the_last_request_tells_the_proposer_the_engine_is_idle():
    """vLLM runs one more step, with no tokens, to remove finished requests from the runner:
    where it leaves the runner no request, the proposer hears the engine is idle (it writes
    the pool then, proposer.on_idle); not while requests remain, nor on steps that finish none."""
    idle = []
    drafter = SimpleNamespace(is_ouroboros=True, note_finished=lambda ids: None, on_idle=lambda: idle.append(1))
    runner = SimpleNamespace(drafter=drafter, requests={"a": 1, "b": 2})

    def original(self, out):  # vLLM's: finished requests leave the runner
        for r in out.finished_req_ids:
            self.requests.pop(r, None)
        return "updated"

    update = model_runner._update_states(original)
    out = lambda done=(): SimpleNamespace(  # noqa: E731
        scheduled_new_reqs=[], finished_req_ids=set(done),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_output_tokens=[]))
    assert update(runner, out({"a"})) == "updated" and idle == []  # "b" runs on
    update(runner, out())
    assert idle == []
    assert update(runner, out({"b"})) == "updated" and idle == [1]
    update(runner, out())  # idle still: no step finished anything
    assert idle == [1]
    update(SimpleNamespace(drafter=None, requests={"c": 1}), out({"c"}))  # vLLM's drafter, or none
    assert idle == [1]


def test_an_output_cut_back_by_vllm_rewinds_the_requests_draft_state():
    """vLLM's _update_states drops output tokens the scheduler no longer counts (a failed
    synchronous KV load): the request regrows other tokens, and the proposer must check its
    draft cache and context learning again from the cut, in the request's own slot."""
    from vllm_ouroboros.request_slots import RequestSlots

    p = bare_proposer()
    p._slot_of = RequestSlots(4)
    p._slot_of.sync(["a", "b", "c"])
    rewound = []
    p.runtime = SimpleNamespace(rewind=lambda slots, lens: rewound.append((slots.tolist(), lens.tolist())))
    p._ctx_seen = np.array([50, 60, 70, 0])
    p.is_ouroboros = True
    state = lambda prompt, out: SimpleNamespace(  # noqa: E731
        output_token_ids=list(range(out)), num_tokens=prompt + out)
    runner = SimpleNamespace(drafter=p, requests={"a": state(30, 20), "b": state(40, 20), "c": state(60, 10),
                                                 "z": state(5, 5)})
    update = model_runner._update_states(lambda self, out: "updated")
    out = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(), scheduled_cached_reqs=SimpleNamespace(
        req_ids=["a", "b", "c", "z", "gone"], num_output_tokens=[20, 14, 10, 2, 0]))
    assert update(runner, out) == "updated"
    slot_b = p._slot_of["b"]
    # "b" keeps 40 + 14 tokens; "z" holds no slot (not drafted for); "gone" is not the runner's
    assert rewound == [([slot_b], [54])]
    want = [50, 60, 70, 0]
    want[slot_b] = 54
    assert p._ctx_seen.tolist() == want
    out.scheduled_cached_reqs.num_output_tokens = [20, 20, 10, 5, 0]
    update(runner, out)  # nothing cut back: no call
    assert len(rewound) == 1


def test_a_step_whose_drafting_raises_decodes_plainly(caplog):
    """Drafting that raises (device memory for a graph capture, a driver error) made propose
    raise, and vLLM's engine died with every request in it. The step decodes plainly instead:
    no drafts, the slots' layouts empty (the next step's verification reads them), their draft
    caches reset, logged once per kind with its traceback; three failing steps in a row turn
    drafting off for the engine, which serves on without it."""
    import logging

    import torch

    from vllm_ouroboros import LOGGER_NAME
    from vllm_ouroboros.cost_model import StepOverhead
    from vllm_ouroboros.proposer import MAX_FAILURES_IN_A_ROW, NO_DRAFT
    from vllm_ouroboros.request_slots import RequestSlots

    p = bare_proposer()
    p._req_ids = ["a", "b"]
    p._tp = SimpleNamespace(leads=True, size=1)
    p._overhead = StepOverhead(None)
    p.target_clock, p._counters = None, SimpleNamespace(active=False)
    p.draft_failures, p._failures_in_a_row, p._failure_kinds, p._drafting_off = 0, 0, set(), None
    p._slot_of = RequestSlots(4)
    p._last_main, p._last_suffix_len = np.full(4, 5), np.full((4, 2), 3)
    p._source = np.ones(4, np.int8)
    reset = []
    dropped = []
    p.runtime = SimpleNamespace(reset_slots=lambda slots: reset.extend(np.asarray(slots).tolist()), drop_graphs=lambda: dropped.append(1))
    p.device = torch.device("cpu")
    calls = []

    def failing(req_ids, *a):
        calls.append(req_ids)
        p._sync_requests = OuroborosProposer._sync_requests.__get__(p)
        p._slot_of.sync(req_ids)
        if len(calls) == 2:
            return [[7], [8, 9]]
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    p._propose = failing
    args = ([[1], [2]], np.array([3, 3]), np.zeros((2, 4), np.int64))
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(caplog.handler)
    try:
        assert p.propose(*args) == [[], []]
        assert p.layouts(["a", "b"])[0].tolist() == [0, 0] and (p._source[:2] == NO_DRAFT).all()
        assert sorted(reset) == [0, 1] and p.draft_failures == 1 and dropped == [1]
        assert p.propose(*args) == [[7], [8, 9]] and p._failures_in_a_row == 0  # a step that works
        for _ in range(MAX_FAILURES_IN_A_ROW):
            assert p.propose(*args) == [[], []]
        assert p._drafting_off.startswith("OutOfMemoryError")
        before = len(calls)
        assert p.propose(*args) == [[], []] and len(calls) == before  # off: not tried again
    finally:
        log.removeHandler(caplog.handler)
    logged = {id(r) for r in caplog.records if "drafting failed (OutOfMemoryError" in r.getMessage()}
    assert len(logged) == 1 and "speculation is off for this engine" in caplog.text


def test_a_tp_follower_whose_request_table_fails_still_joins_the_first_ranks_share(caplog):
    """A TP rank other than the first updates its request table, then joins the first rank's
    broadcast of the step's drafts. Its update raised out of propose() before the broadcast
    (the first rank's own update is inside its drafting guard): the worker died and the first
    rank waited in the collective. It logs once, joins, and takes the drafts; the rows it has
    no slot for record no layout."""
    import logging

    from vllm_ouroboros import LOGGER_NAME
    from vllm_ouroboros.request_slots import RequestSlots

    shared = ([[7], [8, 9]], np.array([1, 2]), np.array([[0, 0], [1, 0]]))
    joined = []
    p = bare_proposer()
    p._req_ids = ["a", "b"]
    p._tp = SimpleNamespace(leads=False, size=2, rank=1,
                            share=lambda v: joined.append(v) or shared)
    p.draft_failures, p._failure_kinds = 0, set()
    p._slot_of = RequestSlots(4)
    p._last_main, p._last_suffix_len = np.zeros(4, np.int64), np.zeros((4, 2), np.int64)

    def broken(req_ids):
        raise KeyError("slot table (test)")

    p._sync_requests = broken
    args = ([[1], [2]], np.array([3, 3]), np.zeros((2, 4), np.int64))
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(caplog.handler)
    try:
        for _ in range(2):
            assert p.propose(*args) == [[7], [8, 9]]
    finally:
        log.removeHandler(caplog.handler)
    assert joined == [None, None] and p.draft_failures == 2
    assert (p._last_main == 0).all()  # no slot for either id: nothing recorded
    logged = {id(r) for r in caplog.records if "updating the request table failed (KeyError" in r.getMessage()}
    assert len(logged) == 1
    # With the table working the rows' layouts are recorded.
    p._sync_requests = OuroborosProposer._sync_requests.__get__(p)
    p._slot_of.sync(("a", "b"))
    p._sync_requests = lambda req_ids: None
    p.propose(*args)
    assert p._last_main[[p._slot_of.get("a"), p._slot_of.get("b")]].tolist() == [1, 2]


def test_with_drafting_off_a_failing_request_table_still_reaches_the_tp_share(caplog):
    """Once drafting is off, the first rank updates its request table outside the drafting
    guard: an error there raised out of propose() before the broadcast the followers wait in."""
    from vllm_ouroboros.cost_model import StepOverhead

    joined = []
    p = bare_proposer()
    p._req_ids = ["a", "b"]
    p._tp = SimpleNamespace(leads=True, size=2, rank=0, share=lambda v: joined.append(v) or v)
    p._overhead = StepOverhead(None)
    p.target_clock, p._counters = None, SimpleNamespace(active=False)
    p.draft_failures, p._failure_kinds, p._drafting_off = 0, set(), "OutOfMemoryError: (test)"
    p.layouts = lambda req_ids: (np.zeros(2, np.int64), np.zeros((2, 1), np.int64))

    def broken(req_ids):
        raise ValueError("batch larger than the slots (test)")

    p._sync_requests = broken
    assert p.propose([[1], [2]], np.array([3, 3]), np.zeros((2, 4), np.int64)) == [[], []]
    assert len(joined) == 1 and joined[0][0] == [[], []] and p.draft_failures == 1


def test_the_fallbacks_greedy_rows_feed_the_pool_what_was_emitted():
    """A step vLLM's sampler verified (penalties, bad words, ...): for greedy rows the pool
    learns the tokens emitted along the accepted chain, the correction included, not the raw
    argmax the penalty overrode; past the emitted ones, and on sampled rows, the argmax stays."""
    from vllm_ouroboros.patches.tree_verify import emitted_choices

    raw = np.array([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34]])
    sampled = np.array([[10, 99, 7, -1], [5, 6, -1, -1], [40, 41, 42, 43]])
    got = emitted_choices(raw, sampled, np.array([True, True, False]))
    assert got.tolist() == [[10, 99, 7, 13, 14], [5, 6, 22, 23, 24], [30, 31, 32, 33, 34]]
    assert raw[0, 1] == 11  # a new array
    wide = emitted_choices(raw[:, :3], sampled, np.array([True, True, True]))  # C > N + 1: cut
    assert wide.tolist() == [[10, 99, 7], [5, 6, 22], [40, 41, 42]]


def test_the_round_costs_target_part_counts_the_adaptive_drafts_measured_length():
    """The round length's cost(F) priced the target's part of the step as a gamma-token draft;
    with an adaptive length the acceptance head stops drafts anywhere up to max_draft_length, so
    the mean of whole rounds' drafts stands there instead (gamma before any round)."""
    from vllm_ouroboros import cost_model

    p = bare_proposer()
    p.cfg = SimpleNamespace(gamma=4)
    p._draft_tokens = 4.0
    p.runtime = SimpleNamespace(L=2, W=3, G=2)
    p.target_cost = cost_model.CostCurve((1, 64), (1.0, 64.0))  # a second a token
    p._overhead = SimpleNamespace(value=0.5)
    p._draft_scale = np.ones(2)
    p.cost = cost_model.CostCurve((1, 64), (0.0, 0.0))
    p._round_length = None
    assert p._round_cost(2)(3) == 2 * (1 + 4 + 2) + 0.5
    p._draft_tokens = 9.5
    assert p._round_cost(2)(3) == 2 * (1 + 9.5 + 2) + 0.5


def test_the_round_costs_target_part_counts_each_round_lengths_own_drafts():
    """A round of fewer forwards drafts less where its rows needed more forwards than it ran
    (also with a fixed gamma), so the target's part of cost(F) is priced with the drafts
    measured in whole rounds of that F; an F not measured yet keeps the overall figure."""
    from vllm_ouroboros import cost_model
    from vllm_ouroboros.round_length import RoundLength

    p = bare_proposer()
    p._draft_tokens = 4.0
    p.runtime = SimpleNamespace(L=2, W=3, G=2)
    p.target_cost = cost_model.CostCurve((1, 64), (1.0, 64.0))  # a second a token
    p._overhead = SimpleNamespace(value=0.5)
    p._draft_scale = np.ones(2)
    p.cost = cost_model.CostCurve((1, 64), (1.0, 1.0))  # a second a draft forward
    p._round_length = RoundLength(4)
    for drafted in (1.0, 2.0, 1.5):
        p._round_length.observe_draft(1, drafted)
    p._round_length.observe_draft(3, 3.0)
    cost = p._round_cost(2)
    assert cost(1) == 2 * (1 + 1.5 + 2) + 0.5 + 1
    assert cost(3) == 2 * (1 + 3.0 + 2) + 0.5 + 3
    assert cost(2) == 2 * (1 + 4.0 + 2) + 0.5 + 2  # not measured: the overall figure
    assert p._round_length.stats() == {}  # draft lengths alone are not rounds observed
