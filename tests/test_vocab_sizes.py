"""A draft whose embedding has another number of rows than the target's, one tokenizer: as
Qwen2.5-0.5B (151,936 rows) drafting for Qwen2.5-7B and larger (152,064). In the real vLLM
engine on tiny models, greedy output stays token-identical to vLLM without speculation either
way round:

- the target has more ids (512 rows) than the draft (384): the target emits ids past the
  draft's rows (its padding rows are as likely as the others here), which the draft reads
  clamped and the pool keys by (DraftModel.fit_vocab, the pool sized to the target's ids);
- the draft has more (640) than the target (512), its extra rows likelier than the others:
  unfitted it would draft ids the target cannot embed (an IndexError in the target's forward).

Three engines (no speculation, and one per draft), ~20-40 s each.
"""

from __future__ import annotations

import pytest

from test_e2e_tiny import make_prompts, run_engine
from tiny_models import padded_vocab_copy, perturbed_copy

pytestmark = pytest.mark.engine

TOKENIZER_IDS = 384  # the tiny tokenizer's, and the tiny models' rows


@pytest.fixture(scope="module")
def padded(tiny_models, tmp_path_factory):
    """{"target": 512 rows, "narrow": the close draft (384), "wide": 640 rows}."""
    root = tmp_path_factory.mktemp("vocab_sizes")
    target = padded_vocab_copy(tiny_models["target"], root / "target", 512, scale=1.0, seed=4)
    close = perturbed_copy(target, root / "close", noise=0.02, seed=2)
    wide = padded_vocab_copy(close, root / "wide", 640, scale=3.0, seed=5)
    return {"target": target, "narrow": tiny_models["close_draft"], "wide": wide}


def _params(n: int) -> list[dict]:
    # Ids past the tokenizer have no text: detokenize=False (vLLM's no-speculation run too).
    ps = [{"temperature": 0.0, "max_tokens": 24 + (i * 11) % 41, "detokenize": False} for i in range(n)]
    ps[3] = {"temperature": 0.8, "seed": 7, "max_tokens": 32, "detokenize": False}  # the sampled walk
    return ps


@pytest.fixture(scope="module")
def runs(padded, tmp_path_factory):
    prompts = make_prompts()[:14]
    params = _params(len(prompts))
    base, _ = run_engine(padded["target"], prompts, params)
    out = {"base": base["main"], "params": params}
    for name in ("narrow", "wide"):
        pool = tmp_path_factory.mktemp(f"pool_{name}") / "pool.pt"
        spec = {"method": "ouroboros", "model": str(padded[name]), "num_suffixes": 3,
                "use_lookahead": True, "use_guesses": True, "use_suffixes": True,
                "max_speculative_batch": 64, "pool_save_path": str(pool)}
        ours, snaps = run_engine(padded["target"], prompts, params, spec, save_pool=True)
        out[name] = (ours["main"], snaps["main"], pool)
    return out


def _greedy_identical(runs, name):
    ours, snap, _ = runs[name]
    for i, (b, o) in enumerate(zip(runs["base"], ours)):
        if runs["params"][i]["temperature"] == 0:
            assert o[0] == b[0], f"{name} draft, request {i}: tokens differ"
            assert o[2] == b[2], f"{name} draft, request {i}: finish reason differs"
        else:
            # its own draws: complete (the end-of-sequence id or max_tokens), every id the target's
            assert o[2] in ("stop", "length") and o[0] and max(o[0]) < 512, o
    assert 0 < snap["accepted_tokens"] <= snap["drafted_tokens"], snap
    assert snap["draft_failures"] == 0 and not snap["drafting_off"], snap


def test_target_with_more_ids_than_the_draft_greedy_identical(runs):
    emitted = [t for b in runs["base"] for t in b[0]]
    assert sum(t >= TOKENIZER_IDS for t in emitted) >= 10, "the target never left the draft's rows"
    _greedy_identical(runs, "narrow")
    # The target's ids past the draft's rows reached the pool as keys (it is keyed by the target's).
    from vllm_ouroboros.pool import PhrasePool

    sd = PhrasePool.read_state(str(runs["narrow"][2]))
    assert sd["vocab_size"] == 512
    assert (sd["page_key"] >= TOKENIZER_IDS).any(), "no phrase keyed by an id past the draft's rows"


def test_draft_with_more_ids_than_the_target_greedy_identical(runs):
    _greedy_identical(runs, "wide")
