"""Drafting from the phrase pool alone: the "pool" drafting mode (cost_model.MODES).

Where a draft forward costs nearly as much as the target's (a small pair on a GPU whose draft
round is launch-bound: 1.3-2.4 ms per draft forward beside a 2.0 ms target forward on the H200,
results/README.md), the draft model's forwards can cost more than the tokens they win. The
pool still knows phrases: the prompt's and the output's own (context phrases) and the target's
tokens on earlier trees (refinement, inspiration). This mode sends them without a draft forward:

    sentence draft = the pool's best phrase after the last confirmed token, then the best phrase
                     after that one's last token, ... (up to `draft_len` tokens)
    suffixes       = the pool's K best phrases after the draft's last token

the same tree as a drafted step (a chain, then K suffixes), verified by the same target forward,
so greedy output stays the target's and sampling its distribution. With `branches` (K >= 2 on
the tree path) the draft is empty and the K suffixes are the K best phrases after the last
confirmed token: K branches under the root, as Lookahead Decoding verifies its n-grams. Where
the best phrase is wrong, a chain of best phrases wins nothing, while one of the other K often
does: replayed on the greedy text of 40 HumanEval prompts, 2.08 tokens per target forward
against the chain's 1.84 at K = 4 (`python scripts/pool_key_sim.py results/phrases_40.json
--pool-trees`; results/README.md). The pool keeps learning from
every verification as in the other modes (proposer._learn). The draft model's mode uses it too,
for the requests its round left this step (pool fill: the back-off's, an unreadable prompt, a
full draft cache; proposer._propose). No vLLM imports.

The back-off (cost_model.speculation_plan) cuts branches in whole branches: a cut of s tokens
sends the best max(1, s // L) (branches_under_cut). It weighs them by what each branch added
over the better-ranked ones, measured per request (branch_gains): the chain's measure, how far
the draft was accepted, says nothing of K alternatives, and while the branches went uncut a
step priced at a chain's few tokens per row sent K L of them.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ouroboros.draft.runtime import RoundOutput
from vllm_ouroboros.host_copy import PendingRead, to_device
from vllm_ouroboros.pool import PhrasePool


def draft_from_pool(pool: PhrasePool, last_tokens: np.ndarray, slots: np.ndarray, draft_len: int,
                    num_suffixes: int, branches: bool = False) -> RoundOutput:
    """One step's drafts for R requests from the pool, with no draft forward.

    last_tokens [R] (int): each request's last confirmed token; slots [R] (int): their pool
    owners (a request's own phrases rank first, PhrasePool.lookup); draft_len: the most
    sentence-draft tokens per row (>= 1; the config's max_draft_len, or the back-off's cut),
    chained from whole phrases of pool.L tokens, the last one cut; num_suffixes: K, phrases
    looked up after the draft's last token (0: none).
    Returns a RoundOutput with drafts [R, draft_len] and draft_lens [R] (a row whose key has no
    phrase stops there: 0 tokens if the first lookup found none), suffixes [R, K, L] and
    suffix_valid [R, K], and zero draft and prefill forwards. The lookups stay on the device;
    one read back at the end (queue_pool_drafts, then its output). branches: K branches under
    the root instead (queue_pool_drafts).
    """
    return queue_pool_drafts(pool, last_tokens, slots, draft_len, num_suffixes, branches).output()


class PendingPoolDrafts:
    """Pool drafts whose lookups are queued on the device and whose read back to the host is
    queued behind them (host_copy.PendingRead): `output()` waits for it. draft_len: branches
    only (the read holds just the suffixes and their validity): every row's draft is empty, which
    the host writes itself ([rows, draft_len] zeros) rather than reading back."""

    def __init__(self, read: PendingRead, rows: int, draft_len: int | None = None):
        self._read, self._rows, self._draft_len = read, rows, draft_len

    def output(self) -> RoundOutput:
        """The drafts as draft_from_pool returns them."""
        arrays = [a.copy() for a in self._read.arrays()]
        zeros = np.zeros(self._rows, np.int64)
        if self._draft_len is not None:
            arrays = [np.zeros((self._rows, self._draft_len), np.int64), zeros.copy(), *arrays]
        drafts, draft_lens, suffixes, suffix_valid = arrays
        return RoundOutput(drafts, draft_lens, suffixes, suffix_valid, forwards=0, prefill_forwards=0,
                           row_forwards=zeros, guess_tokens=zeros.copy(), guess_hit_forwards=zeros.copy(),
                           row_prefills=zeros.copy())


@torch.no_grad()
def queue_pool_drafts(pool: PhrasePool, last_tokens: np.ndarray, slots: np.ndarray, draft_len: int,
                      num_suffixes: int, branches: bool = False) -> PendingPoolDrafts:
    """draft_from_pool's lookups and read back, queued without waiting for the device (same
    arguments). Queued ahead of a drafting round that ends in its own read, the pool's drafts
    cost the step no wait of their own (proposer._propose, pool fill). branches: no sentence
    draft (draft_lens 0); the suffixes are the K best phrases after each last token (the
    module docstring)."""
    if draft_len < 1:
        raise ValueError(f"draft_len={draft_len} must be >= 1")
    R, L = len(slots), pool.L
    dev = pool.device
    key, owner = to_device(dev, np.asarray(last_tokens, np.int64), np.asarray(slots, np.int64))
    if branches:
        if num_suffixes < 1:
            raise ValueError("branches needs num_suffixes >= 1")
        suffixes, suffix_valid = pool.lookup(key, owner, num_suffixes)
        return PendingPoolDrafts(PendingRead(suffixes, suffix_valid), R, draft_len)
    pieces, took = [], []
    alive = torch.ones(R, dtype=torch.bool, device=dev)
    for _ in range(-(-draft_len // L)):
        phrase, valid = pool.lookup(key, owner, 1, rows=alive)
        alive = alive & valid[:, 0]
        pieces.append(torch.where(alive[:, None], phrase[:, 0], 0))
        took.append(alive)
        key = torch.where(alive, phrase[:, 0, -1], key)
    drafts = torch.cat(pieces, 1)[:, :draft_len]
    draft_lens = torch.clamp(torch.stack(took, 1).long().sum(1) * L, max=draft_len)
    # The suffixes hang off the draft's last token: inside the last phrase where draft_len cut it.
    end = drafts.gather(1, (draft_lens - 1).clamp(min=0)[:, None])[:, 0]
    key = torch.where(draft_lens > 0, end, key)
    if num_suffixes:
        suffixes, suffix_valid = pool.lookup(key, owner, num_suffixes)
    else:
        suffixes = torch.zeros((R, 0, L), dtype=torch.long, device=dev)
        suffix_valid = torch.zeros((R, 0), dtype=torch.bool, device=dev)
    return PendingPoolDrafts(PendingRead(drafts, draft_lens, suffixes, suffix_valid), R)


def branches_under_cut(cut: np.ndarray, phrase_len: int, num_branches: int) -> np.ndarray:
    """Branches a row sends under the back-off's cut of `cut` [R] tokens: the whole branches
    that fit, at least one (a row the plan drafts for sends its best), at most num_branches.
    -> [R] int64."""
    return np.clip(np.asarray(cut, np.int64) // phrase_len, 1, num_branches)


def branch_gains(along: np.ndarray, num_sent: np.ndarray, phrase_len: int, positions: int) -> np.ndarray:
    """What each branch added to a step's accepted tokens, as the back-off's estimates take it
    (backoff_estimates.BackoffEstimates.observe's gains).

    along [R, K]: tokens the target accepted along each branch, in sent (rank) order (greedy,
    feedback.accepted_lengths); num_sent [R]: branches sent (the rest are not counted);
    positions: S, the estimates' width. -> [R, S] float: at position b L (1-based) the
    accepted tokens the best of branches 1..b gives over the best of 1..b-1, 0 elsewhere, so
    the sum up to b L is what sending b branches accepted. Branches past S // L are dropped."""
    R, K = along.shape
    k = np.arange(K)
    got = np.where(k[None, :] < np.asarray(num_sent)[:, None], along, 0)
    best = np.maximum.accumulate(got, axis=1) if K else got
    added = np.diff(best, axis=1, prepend=0)
    out = np.zeros((R, positions))
    pos = (k + 1) * phrase_len - 1
    fits = pos < positions
    out[:, pos[fits]] = added[:, fits]
    return out


def unsent_branch_gain(accepted: np.ndarray, sent: np.ndarray, phrase_len: int) -> np.ndarray:
    """What the branches a row did not send (the back-off's cut) are expected to add to its
    tokens per target forward: the sum of its estimates (branch_gains' layout) at the ranks
    past `sent`. Its accepted tokens plus this is, in the mean over rows, what the pool mode
    gives a row sent whole, since each branch's gain over the better-ranked ones is estimated
    apart: so rows cut under load still measure the mode (mode_review.py). Whatever the row
    found: an estimate counts a branch the pool did not find as a gain of 0 (branch_gains), so
    it holds the chance of finding one already; leaving out the ranks a row did not find would
    count that chance twice (0.87 against the whole rows' 1.24 tokens, K = 4, every row cut to
    one branch, estimates learnt by BackoffEstimates.observe).

    accepted [R, S]: the rows' estimates (BackoffEstimates.accepted); sent [R]: branches sent.
    -> [R] float tokens (0 where every rank was sent)."""
    accepted = np.asarray(accepted, float)
    ranks = np.arange(1, accepted.shape[1] // phrase_len + 1)
    at = accepted[:, ranks * phrase_len - 1]
    return np.where(ranks[None, :] > np.asarray(sent)[:, None], at, 0.0).sum(1)


def branch_prior(prior_accepted: np.ndarray, phrase_len: int, num_branches: int) -> np.ndarray:
    """The branches' prior ([S]) from a chain's (P(accepted >= k), [S]): one branch accepts
    what the chain's first L positions would, a fraction f of its L tokens, and each further
    one is taken as another such try at what the ones before left: the best of b accepts
    L (1 - (1 - f)^b). Optimistic as the chain's is, so a new request sends branches and
    measures; never more than the L tokens a branch holds, which a chain's prior over K L
    positions would promise. Nothing past branch num_branches."""
    prior = np.asarray(prior_accepted, float)
    S, L = len(prior), phrase_len
    f = min(prior[:L].sum() / L, 1.0)
    b = np.arange(1, min(num_branches, S // L) + 1)
    best = L * (1 - (1 - f) ** b)
    out = np.zeros(S)
    out[b * L - 1] = np.diff(best, prepend=0.0)
    return out
