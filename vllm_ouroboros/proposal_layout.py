"""What each request sends the target in a step: its sentence draft, then its candidate suffixes,
in flat order (tree.py builds the token tree from it). Host numpy over the step's drafting rows.

Two caps apply. The back-off's cut (cost_model.speculation_plan) bounds the sentence draft: it
weighs how far a request's draft is accepted position by position. The suffixes then fill the
room up to num_speculative_tokens, and whether a row sends them is decided apart, from their
own yield (cost_model.rows_sending_suffixes). A cut that also bounded the suffixes would let a
short draft crowd them out, where they are nearly free to the target (a flat curve) and feed
the pool's candidate refinement. Both caps stop at max_model_len. A row's suffixes were looked
up after its draft's last token, so they follow only a draft sent whole: where a cap cut the
draft (max_model_len's room), the row sends its draft alone. Drafts end at the back-off's cut
(the pool's, the host round's and the device round's alike), so under a cut the suffixes
follow. The pool's branches are a row's whole draft, not suffixes after one: the proposer cuts
them in whole branches before they are placed (pool_draft.branches_under_cut). No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SuffixPlacement:
    """Where each row's suffixes go: n_main [R] draft tokens sent, order [R, K] the pool's
    suffix indices in sent order (valid ones first), lens [R, K] tokens sent of each (in
    sent order; 0 past the room), before [R, K] flat offsets of each after the draft."""

    n_main: np.ndarray
    order: np.ndarray
    lens: np.ndarray
    before: np.ndarray

    def ordered(self, suffixes: np.ndarray) -> np.ndarray:
        """suffixes [R, K, L] in pool order -> in sent order."""
        return suffixes[np.arange(len(suffixes))[:, None], self.order]


def place_suffixes(draft_lens: np.ndarray, suffix_valid: np.ndarray, phrase_len: int,
                   draft_cap: np.ndarray, total_cap: np.ndarray) -> SuffixPlacement:
    """Fit each row's draft and suffixes into its caps.

    draft_lens [R]: sentence draft tokens; suffix_valid [R, K]: which suffixes the pool
    found (each phrase_len tokens); draft_cap [R]: most draft tokens sent (the back-off's cut,
    max_model_len's room); total_cap [R]: most tokens sent in all (num_speculative_tokens,
    max_model_len's room). A suffix that does not fit whole is trimmed; later ones get none;
    a row whose draft the caps cut sends none (they hang off the uncut draft's end).
    """
    R, K = suffix_valid.shape
    n_main = np.minimum(draft_lens, np.minimum(draft_cap, total_cap))
    order = np.argsort(~suffix_valid, axis=1, kind="stable")  # valid first, in pool order
    lens = np.where(suffix_valid[np.arange(R)[:, None], order], phrase_len, 0)
    before = np.cumsum(lens, axis=1) - lens
    lens = np.minimum(np.maximum(total_cap[:, None] - n_main[:, None] - before, 0), lens)
    lens[n_main < draft_lens] = 0
    return SuffixPlacement(n_main, order, lens, before)


def proposal_tokens(drafts: np.ndarray, suffixes: np.ndarray,
                    place: SuffixPlacement) -> tuple[np.ndarray, np.ndarray]:
    """The flat proposal per row: its first n_main draft tokens, then the suffixes in sent
    order, each cut to its len. drafts [R, Dd], suffixes [R, K, L] in sent order
    (SuffixPlacement.ordered) -> (tokens [R, T] (T >= 1; past a row's total, padding),
    total [R])."""
    R, K, L = suffixes.shape
    n_main, lens, before = place.n_main, place.lens, place.before
    r = np.arange(R)[:, None]
    total = n_main + lens.sum(1)
    src_mat = np.concatenate([drafts, suffixes.reshape(R, K * L)], axis=1)
    t = np.arange(max(int(total.max(initial=0)), 1))[None, :]
    u = t - n_main[:, None]  # position within the suffixes; < 0 in the draft
    k = np.minimum((u[:, :, None] >= (before + lens)[:, None, :]).sum(2), max(K - 1, 0))
    j = u - before[r, k] if K else u
    src = np.where(u < 0, t, drafts.shape[1] + k * L + j)
    return src_mat[r, np.clip(src, 0, src_mat.shape[1] - 1)], total
