"""The per-request counters a real proposer (the tiny draft, on the CPU, no engine) keeps for a
step's rows: what a round the back-off cut did and did not do, and which rows are rounds of the
draft model. /metrics' pool hit rate (guess_hits / guess_lookups) and mean draft length
(sentence_draft_tokens / draft_rounds) are their ratios."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the proposer's config reads vLLM's platform; vLLM is not installed here")

from test_proposal_room import make_proposer, proposer  # noqa: E402,F401 - the module's proposer fixture

from vllm_ouroboros import cost_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _step(proposer, reqs, table, lens):
    before = proposer.stats.snapshot(per_request=False)
    proposer.set_batch(reqs, length_limit=lambda r: 250, prompt_readable=lambda r: True)
    out = proposer.propose([[5]] * len(reqs), lens, table)
    after = proposer.stats.snapshot(per_request=False)
    return out, {k: after[k] - before[k] for k in
                 ("draft_forwards", "guess_lookups", "draft_rounds", "pool_draft_steps", "sentence_draft_tokens")}


def test_a_round_cut_to_a_chain_looks_up_no_guesses(proposer, monkeypatch):
    """The back-off's cut below chain_below drafts a chain (no window, no guesses): its forwards
    count as draft forwards but not as guess lookups, which would lower the pool's hit rate
    under load for lookups never made."""
    rt = proposer.runtime
    assert rt.G > 0 and rt.chain_below is not None and rt.chain_below > 2
    table = np.random.default_rng(1).integers(2, 300, (2, 260))
    lens = np.array([60, 70])
    cut = {"to": proposer.num_spec_tokens}
    monkeypatch.setattr(proposer, "_model_rows",
                        lambda req_ids, slots, lens, readable: (np.ones(len(slots), bool), cut["to"]))
    _, whole = _step(proposer, ["c1", "c2"], table, lens)
    assert whole["draft_forwards"] > 0 and whole["guess_lookups"] == whole["draft_forwards"], whole
    assert whole["draft_rounds"] == 2
    cut["to"] = 2
    out, chain = _step(proposer, ["c1", "c2"], table, lens + 1)
    assert chain["draft_forwards"] >= 2 and chain["guess_lookups"] == 0, chain
    assert chain["draft_rounds"] == 2 and all(0 < len(o) for o in out)


@pytest.mark.parametrize("branches", [False, True], ids=["chain", "branches"])
def test_the_pools_branches_are_no_sentence_draft(proposer, monkeypatch, branches):
    """A step where the model drafts one row and the pool fills the other: the pool's chain of
    phrases is a sentence draft (a round), its branches are none (counted as one, a pool of
    branches read a mean draft length of 0)."""
    table = np.random.default_rng(2).integers(2, 300, (2, 260))
    S = proposer.num_spec_tokens
    monkeypatch.setattr(proposer, "_model_rows",
                        lambda req_ids, slots, lens, readable: (np.arange(len(slots)) == 0, S))
    monkeypatch.setattr(type(proposer), "_fills_from_pool", property(lambda self: True))
    monkeypatch.setattr(type(proposer), "_pool_branches", property(lambda self: branches))
    monkeypatch.setattr(proposer, "_pool_plan",
                        lambda slots, load=None: cost_model.SpeculationPlan(np.ones(len(slots), bool), S))
    # A phrase after the pool-filled row's last token (not the earlier tests' phrases, which
    # may not be there: pytest -k, another order).
    L = proposer.pool.L
    proposer.pool.insert(torch.tensor([int(table[1, 54])]), torch.arange(7, 7 + L)[None],
                         torch.full((1,), -1, dtype=torch.long))
    _, step = _step(proposer, ["p1", "p2"], table, np.array([50, 55]))
    assert step["pool_draft_steps"] == 1 and step["draft_rounds"] == (1 if branches else 2), step
    assert step["sentence_draft_tokens"] > 0


def test_the_cache_full_warning_is_rate_limited(proposer, caplog):
    """Under load that fluctuates the draft cache fills again every few steps: one warning per
    CACHE_FULL_LOG_INTERVAL_S, saying how many times it was left unsaid (a serving test logged
    86 of them in 40 s)."""
    import logging

    from vllm_ouroboros import LOGGER_NAME, proposer as module

    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(caplog.handler)
    try:
        proposer._cache_full_logged_at, proposer._cache_full_unlogged = -float("inf"), 0
        for _ in range(3):
            proposer._log_cache_full("64 pages", 1, 4)
        proposer._cache_full_logged_at -= module.CACHE_FULL_LOG_INTERVAL_S + 1
        proposer._log_cache_full("64 pages", 2, 4)
    finally:
        log.removeHandler(caplog.handler)
    warnings = sorted({r.getMessage() for r in caplog.records if "could not grow" in r.getMessage()})
    assert len(warnings) == 2, warnings
    assert "(2 more times since the last warning)" in warnings[0] + warnings[1]


def test_metrics_show_a_loaded_pool_before_any_step(proposer, tiny_models, tmp_path, monkeypatch):
    """A warm start's gauges (the loaded pool's phrases) are in the metrics snapshot from load
    on: they read 0 until the first step wrote one."""
    import json

    from vllm_ouroboros.metrics_export import ENV_DIR

    pool = tmp_path / "pool.pt"
    # Phrases of its own, not the earlier tests' (which may not have run: pytest -k).
    L = proposer.pool.L
    proposer.pool.insert(torch.tensor([3]), torch.arange(4, 4 + L)[None], torch.zeros(1, dtype=torch.long))
    proposer.save_pool(str(pool))
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    monkeypatch.setenv(ENV_DIR, str(metrics))
    make_proposer(tiny_models, pool_load_path=str(pool))
    (snapshot,) = metrics.glob("snapshot-*.json")
    assert json.loads(snapshot.read_text())["pool"]["phrases"] > 0
