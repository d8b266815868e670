"""Phrases for the pool from the target's verification output (algorithm.md steps 5 and 6).

The target predicts a token at every verified position, also after the first rejection. Two
uses, batched over requests (padded host arrays, no Python loop over rows):

* candidate inspiration: after the first mismatch, wherever draft and target agree on a run of
  L = beta-1 consecutive tokens, the target's tokens over that run plus its next prediction form a
  phrase keyed by the run's first token;
* candidate refinement: a suffix that was verified is replaced in the pool by what the target
  predicted along it (the old phrase came from an older context).

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


def accepted_lengths(draft: np.ndarray, target: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Greedy accepted prefix length per row.

    Shape: draft [B, D], target [B, D+1], lens [B] (verified draft tokens per row) -> [B].
    """
    D = draft.shape[1]
    agree = (draft == target[:, :D]) & (np.arange(D)[None, :] < lens[:, None])
    return np.cumprod(agree, axis=1).sum(axis=1)


def inspiration(draft: np.ndarray, target: np.ndarray, lens: np.ndarray, owners: np.ndarray,
                L: int) -> Phrases:
    """Phrases from agreement runs after the first rejection.

    Shape: draft [B, D], target [B, D+1], lens [B], owners [B].
    A run starts at j with l_d + 1 <= j and j + L <= lens[b] (so t[j + L] exists); it needs
    d[j .. j+L-1] == t[j .. j+L-1]; the phrase is key t[j], tokens t[j+1 .. j+L]. Position l_d
    itself (the rejected token) never starts a run: there the target disagreed.
    """
    B, D = draft.shape
    if D < L or L < 1:
        return _empty(L)
    l_d = accepted_lengths(draft, target, lens)
    agree = (draft == target[:, :D]) & (np.arange(D)[None, :] < lens[:, None])
    # run[b, j] = agree[b, j .. j+L-1] all true, for j in 0 .. D-L.
    runs = np.lib.stride_tricks.sliding_window_view(agree, L, axis=1).all(axis=2)
    j = np.arange(D - L + 1)[None, :]
    ok = runs & (j >= l_d[:, None] + 1) & (j + L <= lens[:, None])
    b_idx, j_idx = np.nonzero(ok)
    if len(b_idx) == 0:
        return _empty(L)
    keys = target[b_idx, j_idx]
    cols = j_idx[:, None] + 1 + np.arange(L)[None, :]
    return Phrases(keys.astype(np.int64), target[b_idx[:, None], cols].astype(np.int64),
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
        return _empty(L)
    cols = suffix_start[b_idx, None] + np.arange(L)[None, :]
    return Phrases(suffix_key[b_idx].astype(np.int64), target[b_idx[:, None], cols].astype(np.int64),
                   owners[b_idx].astype(np.int64))


def _empty(L: int) -> Phrases:
    return Phrases(np.zeros(0, np.int64), np.zeros((0, L), np.int64), np.zeros(0, np.int64))
