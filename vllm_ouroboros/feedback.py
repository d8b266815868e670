"""Phrases for the pool from the target's verification output: candidate inspiration and
refinement (README, "How a step runs").

The target predicts a token at every verified position, also after the first rejection. Two
uses, batched over requests (padded host arrays, no Python loop over rows):

* candidate inspiration: after the first mismatch, wherever draft and target agree on a run of
  L = beta-1 consecutive tokens, the target's tokens over that run plus its next prediction form a
  phrase keyed by the run's first token;
* candidate refinement: a suffix that was verified is replaced in the pool by what the target
  predicted along it (the old phrase came from an older context);
* context phrases: the n-grams of the confirmed text itself (prompt, accepted tokens and the
  target's correction), as Lookahead Decoding does with the prompt. Code and chat repeat their
  own identifiers and phrases, and these are exactly right wherever the text repeats.

Index convention (0-based): draft d[0..n-1] was verified; target t[j] is the target's token for
position j, i.e. its prediction after context + d[:j]; t has n+1 entries (t[n] is the bonus).
No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Phrases:
    """Phrases to write: keys [N] int64, tokens [N, L] int64, owners [N] int64 (request slots)."""

    keys: np.ndarray
    tokens: np.ndarray
    owners: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def empty(cls, L: int) -> "Phrases":
        return cls(np.zeros(0, np.int64), np.zeros((0, L), np.int64), np.zeros(0, np.int64))


def _agreement(draft: np.ndarray, target: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[B, D] bool: draft token j was verified and equals the target's token there."""
    D = draft.shape[1]
    return (draft == target[:, :D]) & (np.arange(D)[None, :] < lens[:, None])


def accepted_lengths(draft: np.ndarray, target: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Greedy accepted prefix length per row.

    Shape: draft [B, D], target [B, D+1], lens [B] (verified draft tokens per row) -> [B].
    """
    return np.cumprod(_agreement(draft, target, lens), axis=1).sum(axis=1)


def inspiration(draft: np.ndarray, target: np.ndarray, lens: np.ndarray, owners: np.ndarray,
                L: int, l_d: np.ndarray | None = None) -> Phrases:
    """Phrases from agreement runs after the first rejection.

    Shape: draft [B, D], target [B, D+1], lens [B], owners [B]; l_d [B] (accepted lengths, if
    the caller has them already).
    A run starts at j with l_d + 1 <= j and j + L <= lens[b] (so t[j + L] exists); it needs
    d[j .. j+L-1] == t[j .. j+L-1]; the phrase is key t[j], tokens t[j+1 .. j+L]. Position l_d
    itself (the rejected token) never starts a run: there the target disagreed.
    """
    B, D = draft.shape
    if D < L or L < 1:
        return Phrases.empty(L)
    agree = _agreement(draft, target, lens)
    if l_d is None:
        l_d = np.cumprod(agree, axis=1).sum(axis=1)
    # run[b, j] = agree[b, j .. j+L-1] all true, for j in 0 .. D-L: L agreements in the
    # window (a count difference: a fifth of sliding_window_view's overhead at these sizes).
    count = np.zeros((B, D + 1), np.int64)
    np.cumsum(agree, axis=1, out=count[:, 1:])
    runs = count[:, L:] - count[:, :D - L + 1] == L
    j = np.arange(D - L + 1)[None, :]
    ok = runs & (j >= l_d[:, None] + 1) & (j + L <= lens[:, None])
    b_idx, j_idx = np.nonzero(ok)
    if len(b_idx) == 0:
        return Phrases.empty(L)
    keys = target[b_idx, j_idx]
    cols = j_idx[:, None] + 1 + np.arange(L)[None, :]
    return Phrases(keys.astype(np.int64), target[b_idx[:, None], cols].astype(np.int64),
                   owners[b_idx].astype(np.int64))


def correction_phrases(draft: np.ndarray, target: np.ndarray, lens: np.ndarray, owners: np.ndarray,
                       L: int, l_d: np.ndarray, agree: int) -> Phrases:
    """The target's tokens after a rejection, keyed by its correction.

    Shape: draft [B, D], target [B, D+1], lens [B], owners [B], l_d [B] (accepted lengths).
    Where row b rejected d[l_d] (l_d < lens) and l_d + L <= lens: key t[l_d] (the correction, the
    next round's first token), tokens t[l_d+1 .. l_d+L], if d[l_d+1 .. l_d+agree] == t[l_d+1 ..
    l_d+agree]. The tokens were predicted after the rejected d[l_d], not after the correction: a
    guess that the text goes on the same way (a substituted word); the draft verifies it like any
    pool phrase, so it can only make the next round's first forward bring more tokens.
    """
    B, D = draft.shape
    if L < 1 or B == 0:
        return Phrases.empty(L)
    ok = (l_d < lens) & (l_d + L <= lens)
    agreement = _agreement(draft, target, lens) if agree else None
    for i in range(1, agree + 1):
        col = np.minimum(l_d + i, D - 1)
        ok &= agreement[np.arange(B), col] & (l_d + i < lens)
    b_idx = np.nonzero(ok)[0]
    if len(b_idx) == 0:
        return Phrases.empty(L)
    cols = l_d[b_idx, None] + 1 + np.arange(L)[None, :]
    return Phrases(target[b_idx, l_d[b_idx]].astype(np.int64), target[b_idx[:, None], cols].astype(np.int64),
                   owners[b_idx].astype(np.int64))


def refinement(target: np.ndarray, suffix_start: np.ndarray, suffix_len: np.ndarray,
               suffix_key: np.ndarray, lens: np.ndarray, owners: np.ndarray,
               L: int) -> Phrases:
    """The target's own continuation along each verified suffix.

    Shape: target [B, D+1]; suffix_start [B] (draft index of the suffix's first token),
    suffix_len [B] (suffix tokens sent; 0 = none), suffix_key [B] (the token it hangs off),
    lens [B] (verified draft tokens), owners [B].
    A suffix counts as verified only if all L of its tokens were verified; the new phrase is
    key suffix_key, tokens t[start .. start+L-1] (the target's token at each suffix position).
    """
    ok = (suffix_len == L) & (suffix_start + L <= lens)
    b_idx = np.nonzero(ok)[0]
    if len(b_idx) == 0:
        return Phrases.empty(L)
    cols = suffix_start[b_idx, None] + np.arange(L)[None, :]
    return Phrases(suffix_key[b_idx].astype(np.int64), target[b_idx[:, None], cols].astype(np.int64),
                   owners[b_idx].astype(np.int64))


def refinable(num_acc: np.ndarray, draft_lens: np.ndarray, suffix_len: np.ndarray,
              along: np.ndarray) -> np.ndarray:
    """Suffix tokens to refine ([B, K], 0 = none; `refinement` takes a row of it): the suffixes
    whose first token the target accepted after a sentence draft accepted in full. Where the
    draft was rejected first, the target's tokens on a suffix continue a context it did not
    accept, and writing them would replace phrases with noise; the same where the target
    rejected the suffix's own first token. Measured on the real pair's
    draft mode (8 HumanEval prompts, every mechanism pinned): the same tokens per target forward
    and draft forwards per token as refining every suffix after a whole draft (5.78 against
    5.79 at K = 4, 5.51 both at K = 1) for 27% (K = 4) and 44% (K = 1) of the pool replaces.
    Nor the pool's branches under the root (no draft, pool_draft.py): a branch's target tokens
    are right only as far as it matched, plus one, which the accepted text's context phrases
    already give, and past that they would replace the key's other alternatives. Measured on
    the pool mode (8 prompts, K = 4): 1.62 tokens per target forward without, 1.58 refining the
    branches whose first token was right, 1.52 refining all (results/README.md, "Branches
    under the root", "Refinement after a rejected first suffix token").

    Shape: num_acc [B] accepted tokens, draft_lens [B] draft tokens sent, suffix_len [B, K],
    along [B, K] the greedy accepted length along the draft followed by suffix k."""
    tried = (num_acc >= draft_lens) & (draft_lens > 0)
    first_right = along > draft_lens[:, None]
    return np.where(tried[:, None] & first_right, suffix_len, 0)


def context_phrases(token_ids: np.ndarray, rows: np.ndarray, lens: np.ndarray, start: np.ndarray,
                    owners: np.ndarray, L: int) -> Phrases:
    """Every phrase of the confirmed context that starts at or after `start`.

    Shape: token_ids [R, >= max(lens)] host token table; rows, lens, start, owners [B].
    Phrase at j: key ctx[j], tokens ctx[j+1 .. j+L], for start[b] <= j <= lens[b] - 1 - L.
    Rows are emitted oldest first, so the newest text ends up newest in the pool.
    """
    count = np.maximum(lens - L - start, 0)
    total = int(count.sum())
    if total == 0:
        return Phrases.empty(L)
    b_idx = np.repeat(np.arange(len(rows)), count)
    j = start[b_idx] + np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    r = rows[b_idx]
    keys = token_ids[r, j]
    tokens = token_ids[r[:, None], j[:, None] + 1 + np.arange(L)[None, :]]
    return Phrases(keys.astype(np.int64), tokens.astype(np.int64), owners[b_idx].astype(np.int64))
