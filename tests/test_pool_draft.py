"""pool_draft.draft_from_pool: the pool mode's drafts, against the lookups done one row at a time;
the back-off's measure of the pool's branches (branch_gains, branch_prior, branches_under_cut)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_ouroboros.pool import PhrasePool
from vllm_ouroboros.pool_draft import (branch_gains, branch_prior, branches_under_cut, draft_from_pool,
                                       unsent_branch_gain,
                                       queue_pool_drafts)

L = 4


def _pool(device="cpu", W=4) -> PhrasePool:
    return PhrasePool(64, L, W, PhrasePool.budget_for(64, L, W, 32), device=device, shared=True)


def _insert(pool, rows):
    """rows: (key, phrase, owner)."""
    keys, phrases, owners = zip(*rows)
    pool.insert(torch.tensor(keys), torch.tensor(phrases), torch.tensor(owners))


def _reference(pool, last, slots, draft_len, K):
    """One row at a time with the pool's own lookup: chain whole phrases from the last token
    while the key has one, cut to draft_len; then K phrases after the draft's last token."""
    drafts, lens, sfx, sval = [], [], [], []
    for key, slot in zip(last.tolist(), slots.tolist()):
        chain = []
        while len(chain) < draft_len:
            ph, ok = pool.lookup(torch.tensor([key]), torch.tensor([slot]), 1)
            if not ok[0, 0]:
                break
            chain += ph[0, 0].tolist()
            key = chain[-1]
        chain = chain[:draft_len]
        key = chain[-1] if chain else key
        drafts.append(chain)
        lens.append(len(chain))
        if K:
            ph, ok = pool.lookup(torch.tensor([key]), torch.tensor([slot]), K)
            sfx.append(ph[0].numpy())
            sval.append(ok[0].numpy())
    return drafts, np.array(lens), sfx, sval


@pytest.mark.parametrize("draft_len,K", [(8, 2), (6, 1), (4, 3), (3, 0), (12, 1), (7, 2), (2, 3)])
def test_chained_phrases_match_row_by_row_lookups(draft_len, K):
    pool = _pool()
    rng = np.random.default_rng(draft_len * 10 + K)
    # Chains that continue (5 -> ...9 -> ...13 -> ...), branch by owner, and dead ends.
    _insert(pool, [(5, [6, 7, 8, 9], 0), (9, [10, 11, 12, 13], 0), (9, [20, 21, 22, 23], 1),
                   (13, [14, 15, 16, 5], 0), (23, [24, 25, 26, 27], 1), (27, [30, 31, 32, 33], 2),
                   (27, [40, 41, 42, 43], 1)])
    _insert(pool, [(int(k), rng.integers(1, 64, L).tolist(), int(o))
                   for k, o in zip(rng.integers(34, 64, 20), rng.integers(0, 3, 20))])
    last = np.array([5, 9, 9, 50, 63, 27, 1])
    slots = np.array([0, 0, 1, 2, 1, 1, 0])
    want_d, want_n, want_s, want_v = _reference(_pool_copy(pool), last, slots, draft_len, K)
    out = draft_from_pool(pool, last, slots, draft_len, K)
    assert out.draft_lens.tolist() == want_n.tolist()
    for b, d in enumerate(want_d):
        assert out.drafts[b, :len(d)].tolist() == d
    assert (out.draft_lens > 0).sum() >= 4  # the chains above were found
    assert out.draft_lens[0] == min(draft_len, 12)  # 5 -> 9 -> 13 -> 5 ...: through three phrases
    assert out.suffixes.shape == (len(last), K, L) and out.suffix_valid.shape == (len(last), K)
    if K:
        np.testing.assert_array_equal(out.suffix_valid, np.stack(want_v))
        np.testing.assert_array_equal(out.suffixes, np.stack(want_s))
    assert out.forwards == 0 and out.prefill_forwards == 0
    assert not out.row_forwards.any() and not out.row_prefills.any() and not out.guess_tokens.any()


@pytest.mark.parametrize("K", [2, 3, 4])
def test_branches_are_the_roots_best_phrases(K):
    """pool_branches: no sentence draft; the K suffixes are the lookup of the last token itself,
    so each hangs off the root (tree.py: under the root where the draft is empty)."""
    pool = _pool()
    _insert(pool, [(5, [6, 7, 8, 9], 0), (5, [1, 2, 3, 4], 1), (5, [11, 12, 13, 14], 0),
                   (9, [10, 11, 12, 13], 0), (13, [14, 15, 16, 5], 1)])
    last, slots = np.array([5, 9, 13, 50]), np.array([0, 1, 1, 0])
    ref = _pool_copy(pool)
    want_s, want_v = ref.lookup(torch.tensor(last), torch.tensor(slots), K)
    out = draft_from_pool(pool, last, slots, 8, K, branches=True)
    assert out.draft_lens.tolist() == [0, 0, 0, 0] and out.drafts.shape == (4, 8)
    np.testing.assert_array_equal(out.suffixes, want_s.numpy())
    np.testing.assert_array_equal(out.suffix_valid, want_v.numpy())
    assert out.suffix_valid.sum(1).tolist() == [min(K, 3), 1, 1, 0]
    # key 5's own phrases first (slot 0 owns two of its three), newest first
    assert out.suffixes[0, 0].tolist() == [11, 12, 13, 14] and out.suffixes[0, 1].tolist() == [6, 7, 8, 9]
    chain = draft_from_pool(_pool_copy(pool), last, slots, 8, K)
    # The chain form's draft is the first branch (nothing follows key 14), its suffixes none.
    assert chain.draft_lens[0] == 4 and chain.drafts[0, :4].tolist() == [11, 12, 13, 14]
    assert not chain.suffix_valid[0].any()
    with pytest.raises(ValueError, match="branches needs num_suffixes >= 1"):
        draft_from_pool(pool, last, slots, 8, 0, branches=True)


def _pool_copy(pool: PhrasePool) -> PhrasePool:
    """The same phrases in a fresh pool: the reference's lookups then move their own copy's
    recency and counters, not those of the pool under test."""
    other = _pool(W=pool.W)
    other.load_state_dict(pool.state_dict())
    return other


def test_an_empty_pool_proposes_nothing():
    out = draft_from_pool(_pool(), np.array([3, 4]), np.array([0, 1]), 8, 2)
    assert out.draft_lens.tolist() == [0, 0] and not out.suffix_valid.any()
    assert out.drafts.shape[0] == 2 and out.drafts.shape[1] >= 1
    with pytest.raises(ValueError, match="draft_len=0 must be >= 1"):
        draft_from_pool(_pool(), np.array([3]), np.array([0]), 0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the lookups on the GPU's pool")
def test_on_cuda_same_as_on_cpu():
    rows = [(5, [6, 7, 8, 9], 0), (9, [10, 11, 12, 13], 0), (13, [1, 2, 3, 4], 1)]
    cpu, gpu = _pool(), _pool("cuda")
    _insert(cpu, rows)
    _insert(gpu, rows)
    a = draft_from_pool(cpu, np.array([5, 9, 13]), np.array([0, 1, 1]), 8, 2)
    b = draft_from_pool(gpu, np.array([5, 9, 13]), np.array([0, 1, 1]), 8, 2)
    np.testing.assert_array_equal(a.drafts, b.drafts)
    np.testing.assert_array_equal(a.draft_lens, b.draft_lens)
    np.testing.assert_array_equal(a.suffixes, b.suffixes)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_queued_drafts_read_the_pool_as_it_was_when_queued(device):
    """Pool fill queues its lookups ahead of the draft model's round, whose window inserts then
    change the pool: the queued drafts are the pool's before those inserts (stream order on a
    GPU, eager on a CPU), read back whenever asked."""
    rows = [(5, [6, 7, 8, 9], 0), (9, [10, 11, 12, 13], 0)]
    pool, before = _pool(device), _pool(device)
    _insert(pool, rows)
    _insert(before, rows)
    want = draft_from_pool(before, np.array([5, 9]), np.array([0, 0]), 8, 1)
    pending = queue_pool_drafts(pool, np.array([5, 9]), np.array([0, 0]), 8, 1)
    # What a round's window would insert next: phrases for the same keys, the same owner, newer.
    _insert(pool, [(5, [1, 2, 3, 4], 0), (9, [2, 2, 2, 2], 0), (4, [3, 3, 3, 3], 0)])
    got = pending.output()
    for name in ("drafts", "draft_lens", "suffixes", "suffix_valid"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.draft_lens.tolist() == [8, 4]
    after = draft_from_pool(pool, np.array([5]), np.array([0]), 4, 1)
    assert after.drafts[0].tolist() == [1, 2, 3, 4], "the later inserts did not land: nothing was tested"


def test_model_and_pool_drafts_as_one_output():
    """RoundOutput.followed_by: a model round's rows, then the pool's (pool fill), as one
    output: each part's drafts, lengths and suffixes as they were (padding invalid and past
    each draft's length), the forwards and prefills the model round's alone."""
    pool = _pool()
    _insert(pool, [(1, [2, 3, 4, 5], 0), (5, [6, 7, 8, 9], 0), (9, [1, 2, 3, 4], 1)])
    model = draft_from_pool(pool, np.array([1]), np.array([0]), 6, 1)  # stands in for a round
    model.forwards, model.prefill_forwards, model.prefill_seconds = 3, 1, 0.5
    model.row_forwards[:] = 3
    model.stopped_by_rule = np.array([True])
    filled = draft_from_pool(pool, np.array([9, 5]), np.array([1, 0]), 9, 2)
    both = model.followed_by(filled)
    assert both.drafts.shape == (3, 9) and both.suffixes.shape == (3, 2, L)
    assert both.draft_lens.tolist() == [6, 4, 8]
    assert (both.drafts[0, :6] == model.drafts[0]).all() and (both.drafts[1:] == filled.drafts).all()
    assert (both.suffix_valid[0, 1:] == False).all()  # noqa: E712 (the model part had K = 1)
    assert (both.suffixes[1:] == filled.suffixes).all()
    assert (both.forwards, both.prefill_forwards, both.prefill_seconds) == (3, 1, 0.5)
    assert both.row_forwards.tolist() == [3, 0, 0] and both.stopped_by_rule.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="no forward"):
        filled.followed_by(model)



def test_branch_gains_add_up_to_what_the_best_of_b_branches_accepted():
    """Summed to position b L, the gains are the most any of the first b branches sent accepted;
    a branch that was not sent adds nothing, nor one past the estimates' width."""
    rng = np.random.default_rng(0)
    R, K, S = 64, 4, 14  # S // L = 3: the fourth branch's position does not fit
    along = rng.integers(0, L + 1, (R, K))
    sent = rng.integers(0, K + 1, R)
    g = branch_gains(along, sent, L, S)
    assert g.shape == (R, S) and (g >= 0).all()
    total = np.cumsum(g, 1)
    for b in range(1, S // L + 1):
        best = np.where(np.arange(b)[None, :] < sent[:, None], along[:, :b], 0).max(1)
        assert (total[:, b * L - 1] == best).all(), b
    off = np.ones(S, bool)
    off[L - 1::L] = False
    assert (g[:, off] == 0).all()


def test_unsent_branches_gains_give_the_whole_rows_mean():
    """A row cut to its first b branches plus the estimated gains of the ranks past b has, in
    the mean over rows, what the rows sent whole accepted, with the estimates learnt as the
    back-off learns them (BackoffEstimates.observe of branch_gains over whole rows: a rank the
    pool did not find gains 0). Masking the ranks a row did not find counts that twice."""
    from vllm_ouroboros.backoff_estimates import BackoffEstimates

    rng = np.random.default_rng(1)
    R, K, S = 20000, 4, 16
    along = np.minimum(rng.geometric([0.6, 0.5, 0.5, 0.4], (R, K)) - 1, L)  # ranks differ
    found = rng.integers(0, K + 1, R)
    gains = branch_gains(along, found, L, S)
    whole = gains.sum(1)
    # The learnt prior after the rows' whole steps (one observe: PRIOR_RATE compounds over them)
    est = BackoffEstimates(1, np.zeros(S), learn_prior=True)
    est.observe(np.zeros(R, np.int64), np.full(R, S), np.zeros(R), np.full(R, K * L), gains)
    assert est.prior == pytest.approx(gains.mean(0))
    sent = rng.integers(1, K + 1, R)
    cut = branch_gains(along, np.minimum(sent, found), L, S).sum(1)
    filled = cut + unsent_branch_gain(np.tile(est.prior, (R, 1)), sent, L)
    assert (cut < whole).mean() > 0.1  # the cut loses tokens in many rows
    assert abs(cut.mean() - whole.mean()) > 0.1 * whole.mean()
    assert filled.mean() == pytest.approx(whole.mean(), rel=0.03)
    at = np.arange(1, K + 1) * L - 1
    masked = cut + np.where((np.arange(1, K + 1) > sent[:, None]) & (np.arange(1, K + 1) <= found[:, None]),
                            est.prior[at], 0).sum(1)
    assert masked.mean() < 0.9 * whole.mean()
    assert unsent_branch_gain(np.tile(est.prior, (3, 1)), np.array([1, 3, 4]), L) == \
        pytest.approx([est.prior[at[1:]].sum(), est.prior[at[3]], 0.0])


def test_a_cut_sends_whole_branches_at_least_one():
    assert branches_under_cut(np.array([1, 3, 4, 7, 8, 12, 16, 24]), L, 3).tolist() == [1, 1, 1, 1, 2, 3, 3, 3]


def test_the_branches_prior_is_the_best_of_b_tries_within_one_branch():
    """From a chain's optimistic prior: one branch accepts what the chain's first L positions
    would; b of them L (1 - (1 - f)^b), never more than a branch holds, each adding less than
    the one before; nothing past the K branches."""
    from vllm_ouroboros import cost_model

    S, K = 24, 4
    chain = cost_model.geometric_survival(13.0, S)[0]
    prior = branch_prior(chain, L, K)
    at = np.arange(1, K + 1) * L - 1
    assert prior[at[0]] == pytest.approx(chain[:L].sum())
    f = chain[:L].sum() / L
    assert np.cumsum(prior)[at] == pytest.approx(L * (1 - (1 - f) ** np.arange(1, K + 1)))
    assert np.cumsum(prior)[-1] < L and (np.diff(prior[at]) < 0).all()
    rest = np.ones(S, bool)
    rest[at] = False
    assert (prior[rest] == 0).all()
