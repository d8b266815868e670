"""How many draft forwards a fixed-shape drafting round runs (draft_round "device" / "graph").

A device round fixes its number of forwards F before it starts, since nothing inside it may read
the device (draft/device_round.py). Every forward costs the same whether a row still needs it or
not: rows that reached gamma tokens early ride along, rows that needed more than F forwards draft
less (lossless: the target verifies what there is). So F trades draft time for draft length. The
host loop stops when every row is done; a device round that always ran as many forwards as the
recent rounds needed at most ran 3.78 forwards per round where the rows needed 2.72 (real pair,
phrase drafting, results/README.md "Forwards per device round"), 39% more draft forwards.

F is chosen to maximise the modeled rate of the step,

    rate(F) = E_F / cost(F),   cost(F) = t_target(step tokens) + c + F t_draft(row tokens)

where E_F (tokens per target forward, per row: accepted + 1) is measured online for each F in
rounds that ran F forwards, and cost comes from the device's cost curves (cost_model.py). Every
F is tried FIRST_TRIES times first (in turns, from the largest down), then the best one runs,
with every EXPLORE-th round given to one of the others in turn, so that an estimate gone stale
(the text got easier or harder, or it came from a request's first rounds over a cold pool) is
corrected. Estimates are shared by all requests, as F is shared by the rows of a round.
No vLLM imports; nothing here touches the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Another F than the best every this many rounds.
EXPLORE = 8
# Rounds of each F before choosing: one round's tokens range over 1..gamma + beta, and an F
# far from the best is seldom tried again.
FIRST_TRIES = 3
# Rounds an F is handed out in its first tries before it is passed over: a round is observed
# only where no row of it was cut (the back-off, the scheduler, max_model_len), and under a
# load that cuts some row every step the first tries' F was handed out round after round.
MAX_OFFERS = 4 * FIRST_TRIES
# Weight of a new round in E_F once it has this many: a running mean before, an average over
# about the last 1 / RATE rounds after.
RATE = 0.05


class RoundLength:
    """Online choice of F in [1, max_forwards] (module docstring)."""

    def __init__(self, max_forwards: int):
        if max_forwards < 1:
            raise ValueError(f"max_forwards must be >= 1, got {max_forwards}")
        self.max_forwards = max_forwards
        self.tokens = np.zeros(max_forwards + 1)  # E_F, index F (0 unused)
        self.rounds = np.zeros(max_forwards + 1, np.int64)  # rounds observed per F
        self.offered = np.zeros(max_forwards + 1, np.int64)  # rounds handed out per F, first tries
        # Sentence-draft tokens per drafting row, by F (the target's part of cost(F)): a round
        # of fewer forwards drafts less where rows needed more than F.
        self.drafted = np.zeros(max_forwards + 1)
        self.drafted_rounds = np.zeros(max_forwards + 1, np.int64)
        self._chosen = 0
        self._explored = 0

    def choose(self, cost: Callable[[int], float]) -> int:
        """F for the next round. cost(F): modeled seconds of a step whose round runs F forwards."""
        untried = np.nonzero((self.rounds[1:] < FIRST_TRIES) & (self.offered[1:] < MAX_OFFERS))[0]
        if len(untried):  # the longest first (what the round did before), in turns
            fewest = untried[self.rounds[1:][untried] == self.rounds[1:][untried].min()]
            F = int(fewest[-1]) + 1
            self.offered[F] += 1
            return F
        best = self.best(cost)
        self._chosen += 1
        if self._chosen % EXPLORE or self.max_forwards == 1:
            return best
        # Every other F in turn: the first rounds of a request (a cold pool) say little about an
        # F, and one never run again would keep what they said.
        others = [F for F in range(1, self.max_forwards + 1) if F != best]
        self._explored += 1
        return others[self._explored % len(others)]

    def best(self, cost: Callable[[int], float]) -> int:
        """argmax_F E_F / cost(F) over the F observed (the largest observed F if none is)."""
        seen = np.nonzero(self.rounds[1:] > 0)[0] + 1
        if len(seen) == 0:
            return self.max_forwards
        rate = [self.tokens[F] / max(cost(int(F)), 1e-12) for F in seen]
        return int(seen[int(np.argmax(rate))])

    def observe(self, forwards: int, tokens_per_row: float) -> None:
        """A round of `forwards` forwards was verified: its rows gave tokens_per_row tokens each
        (accepted + 1, mean over the rows that drafted)."""
        _average_in(self.tokens, self.rounds, forwards, tokens_per_row)

    def observe_draft(self, forwards: int, tokens_per_row: float) -> None:
        """A whole round of `forwards` forwards drafted tokens_per_row sentence-draft tokens per
        drafting row (mean; before the suffixes and the back-off's cut)."""
        _average_in(self.drafted, self.drafted_rounds, forwards, tokens_per_row)

    def draft_tokens(self, forwards: int, default: float) -> float:
        """Mean sentence-draft tokens per row of rounds of `forwards` forwards, or `default`
        where none was observed."""
        if 1 <= forwards <= self.max_forwards and self.drafted_rounds[forwards]:
            return float(self.drafted[forwards])
        return default

    def stats(self) -> dict:
        """E_F, rounds and mean sentence-draft tokens (None: none measured) per F observed, for
        the snapshot."""
        return {int(F): {"tokens_per_target_forward": float(self.tokens[F]), "rounds": int(self.rounds[F]),
                         "draft_tokens": float(self.drafted[F]) if self.drafted_rounds[F] else None}
                for F in range(1, self.max_forwards + 1) if self.rounds[F]}


def _average_in(means: np.ndarray, counts: np.ndarray, F: int, value: float) -> None:
    """means[F] takes `value`: a running mean over its first 1 / RATE rounds, then an average
    over about the last 1 / RATE; an F out of range (index 0 unused) is ignored."""
    if not 1 <= F < len(means):
        return
    counts[F] += 1
    means[F] += max(1.0 / counts[F], RATE) * (value - means[F])
