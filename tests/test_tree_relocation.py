"""The KV relocation after a suffix other than the first is accepted (issue: tree verification).

Built so that suffix 0 is wrong and a later suffix right: the draft model is the target itself
(its sentence draft is always accepted, so the suffixes hanging off it are always tried) and the
pool is loaded from a file in which, for every key of the expected text, the right continuation
was inserted first and a wrong one (first token changed) after it, so the wrong one is newest
and comes out as suffix 0. Feedback that would repair the pool is switched off. The accepted
suffix's KV sits behind the wrong one's; only the relocation puts it where the next step reads
it. The negative control runs the same engine with the relocation skipped and must diverge.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytestmark = pytest.mark.engine

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + "
MAX_TOKENS = 48


def _generate(target, spec, env=None):
    from vllm import LLM, SamplingParams

    from vllm_ouroboros.metrics import engine_snapshot

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        llm = LLM(model=str(target), dtype="float32", max_model_len=512, enforce_eager=True,
                  seed=0, max_num_seqs=4, speculative_config=spec)
        out = llm.generate([PROMPT] * 2, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
        snap = engine_snapshot(llm) if spec else None
        return [list(o.outputs[0].token_ids) for o in out], list(out[0].prompt_token_ids), snap
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        llm = None
        gc.collect()


@pytest.fixture(scope="module")
def setting(tiny_models, tmp_path_factory):
    from vllm_ouroboros.pool import PhrasePool

    target = tiny_models["target"]
    base, prompt_ids, _ = _generate(target, None)
    L, W, K = 4, 4, 3
    seq = torch.tensor(prompt_ids + base[0])
    vocab = 384
    j = torch.arange(len(seq) - L)
    keys = seq[j]
    right = torch.stack([seq[j + 1 + i] for i in range(L)], 1)
    wrong = right.clone()
    wrong[:, 0] = (wrong[:, 0] + 1) % vocab
    # Saved 6 phrases wide, served with window_size 4: the engine loads it re-cut (each key
    # keeps its newest 4 of its 2 phrases, so the same phrases rank the same).
    pool = PhrasePool(vocab, L, W + 2, 2**20, shared=True)
    owners = torch.zeros(len(keys), dtype=torch.long)
    pool.insert(keys, right, owners)
    pool.insert(keys, wrong, owners)  # newest: the first suffix looked up
    path = tmp_path_factory.mktemp("pool") / "crafted.pt"
    pool.save(str(path))
    spec = {"method": "ouroboros", "model": str(target), "num_suffixes": K, "window_size": W,
            "pool_load_path": str(path), "use_inspiration": False, "use_refinement": False,
            "use_context_phrases": False, "use_lookahead": True, "use_guesses": True,
            "max_speculative_batch": 1024, "use_suffixes": True}
    return target, base, spec


def test_later_suffix_accepted_and_outputs_identical(setting):
    target, base, spec = setting
    ours, _, snap = _generate(target, spec)
    assert snap["tree_suffix_accepted"] > 0, "no suffix other than the first was accepted"
    assert ours == base


def test_without_relocation_outputs_diverge(setting):
    """Negative control: the same run with the KV left in place is wrong (so the test above
    really depends on the relocation)."""
    target, base, spec = setting
    ours, _, snap = _generate(target, spec, {"OUROBOROS_DEBUG_SKIP_KV_RELOCATION": "1"})
    assert snap["tree_suffix_accepted"] > 0
    assert ours != base
