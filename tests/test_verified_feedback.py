"""What a verification writes to the pool, read back from it (proposer.on_verified -> _learn):
the target's tokens along each tree path, the phrase each row gets, the suffix whose phrase a
refinement replaces. A wrong phrase changes speed, never output, so the greedy-identity tests
cannot see these; feedback.py's functions are tested alone, this is the proposer's indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the proposer's config reads vLLM's platform; vLLM is not installed here")

from test_proposal_room import make_proposer  # noqa: E402

from vllm_ouroboros.target_step import StepOutcome  # noqa: E402
from vllm_ouroboros.tree import TreeLayout  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def phrases_of(p, key: int, slot: int) -> set[tuple[int, ...]]:
    """The pool's phrases under `key` as `slot` sees them."""
    got, valid = p.pool.lookup(torch.tensor([key]), torch.tensor([slot]), p.pool.W)
    return {tuple(row) for row, ok in zip(got[0].tolist(), valid[0].tolist()) if ok}


def test_a_verification_writes_the_targets_tokens_along_each_path(tiny_models):
    """Row a: draft accepted, suffix 2's head accepted and its last token corrected (suffixes 0
    and 1 rejected at their heads): suffix 2's phrase is replaced by the target's, the others
    stay. Row b: draft rejected at its second token, the target agreeing again after: the
    inspiration phrases after the rejection and the correction phrase at it, exactly. Row c
    (sampled): suffix 1 accepted where the target's argmax took no head: the correction phrase
    follows suffix 1's path, the one accepted, not suffix 0's."""
    p = make_proposer(tiny_models, num_suffixes=3, correction_phrases=0)
    L, K, V = p.cfg.phrase_len, 3, 384
    batch = ["a", "b", "c"]
    p.set_batch(batch, prompt_readable=lambda r: True)
    p.propose([[7]] * 3, np.array([20] * 3), np.full((3, 40), 7))  # the requests get their slots
    slot_a, slot_b, slot_c = (int(s) for s in p._slot_of.slots(batch))
    draft_a = [10, 11, 12]
    sfx = [[100 * (k + 1) + j for j in range(L)] for k in range(K)]  # 100.., 200.., 300..
    draft_b = [50 + i for i in range(8)]
    draft_c, sfx_c = [60, 61], [[100 * (k + 1) + 20 + j for j in range(L)] for k in range(K)]
    n = np.array([len(draft_a), len(draft_b), len(draft_c)])
    slen = np.array([[L] * K, [0] * K, [L] * K])
    lay = TreeLayout(n, slen, D=int(n.max()), L=L)
    tokens = np.zeros((3, lay.D + K * L), np.int64)
    tokens[0, :3], tokens[1, :8], tokens[2, :2] = draft_a, draft_b, draft_c
    for k in range(K):
        tokens[0, lay.sstart[0, k]:lay.sstart[0, k] + L] = sfx[k]
        tokens[2, lay.sstart[2, k]:lay.sstart[2, k] + L] = sfx_c[k]
    # The target's argmax after the root (column 0) and after each node i (column i + 1).
    tn = np.full((3, tokens.shape[1] + 1), 5, np.int64)
    tn[0, :3] = draft_a  # after the root, d0, d1
    tn[0, 3] = sfx[2][0]  # after d2: suffix 2's head, not 0's or 1's
    for k, other in ((0, 150), (1, 250)):  # the rejected branches: the target goes elsewhere
        tn[0, lay.sstart[0, k] + 1:lay.sstart[0, k] + L + 1] = other + np.arange(L)
    s2 = lay.sstart[0, 2]
    refined = sfx[2][:L - 1] + [99]  # the target takes suffix 2 up to its last token
    tn[0, s2 + 1:s2 + L] = refined[1:]
    tn[0, s2 + L] = 77
    tn[1, 0], tn[1, 1] = 50, 91  # d0 accepted, d1 rejected (the target says 91)
    tn[1, 2:9] = draft_b[2:] + [58]  # and agrees again from d2 on
    tn[2, :3] = draft_c + [33]  # no suffix head is the argmax after d1
    for k in range(K):  # after each suffix's nodes, a path of its own
        tn[2, lay.sstart[2, k] + 1:lay.sstart[2, k] + L + 1] = 100 * (k + 1) + 30 + np.arange(L)
    # What the proposer sent, as its propose() would have kept it.
    p._last_main[[slot_a, slot_b, slot_c]] = n
    p._last_suffix_len[[slot_a, slot_b, slot_c]] = slen
    p._last_suffix[slot_a] = sfx
    p._last_suffix_key[slot_a] = draft_a[-1]
    p.pool.insert(torch.tensor([12] * K), torch.tensor(sfx), torch.full((K,), slot_a))
    assert phrases_of(p, 12, slot_a) == {tuple(s) for s in sfx}

    assert max(tn.max(), tokens.max()) < V
    outcome = StepOutcome(tree=lay.tree("cpu", tokens), tokens=tokens, target_next=tn,
                          num_accepted=np.array([3 + L - 1, 1, 2 + 1]), suffix_index=np.array([2, -1, 1]))
    p.on_verified(batch, outcome)
    p._flush_staged()

    assert phrases_of(p, 12, slot_a) == {tuple(sfx[0]), tuple(sfx[1]), tuple(refined)}
    # Inspiration: runs of L agreements from d2 on, keyed by the target's token before them
    # (feedback.inspiration): starts 2..8-L.
    want = {draft_b[j]: tuple((draft_b + [58])[j + 1:j + 1 + L]) for j in range(2, 8 - L + 1)}
    for key, phrase in want.items():
        assert phrase in phrases_of(p, key, slot_b), (key, phrase, phrases_of(p, key, slot_b))
    # The correction: keyed by the target's 91 at the rejection, the target's tokens after it.
    assert phrases_of(p, 91, slot_b) == {tuple(draft_b[2:2 + L])}
    # Keyed by the target's 33 after d1, its tokens along suffix 1 (the path sampling took).
    assert phrases_of(p, 33, slot_c) == {tuple(230 + np.arange(L))}
