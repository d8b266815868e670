"""The drafting mode re-chosen while serving: between the draft model's mode and the pool mode.

The load-time choice (cost_model.choose_drafting_mode) weighs the draft's whole forward, timed,
against a target curve that times only the target's linear layers and LM head
(patches/target_cost.py), at one request, with E (tokens per target forward) as the real pair
gave it on HumanEval. Each of these can be wrong for the engine at hand:

- the target's true step is dearer than its curve (attention, sampling, the scheduler: on this
  CPU 26-40 ms a step beside the curve). Every mode pays it once per target forward, so the
  mode that gives more tokens per forward gains from it; the load-time rule leaves it out. Near
  the boundary (the issue's H200 draft targets with a 1.45 ms curve against a 1.96 ms forward)
  the rule picks the pool where the draft model is ~12% faster;
- E depends on the text: the pool finds more on repetitive output, the draft less on text it
  predicts badly;
- under load the batch's rows share one target forward and widen each draft forward.

So, while serving, every `mode_review_steps` decoding steps (config; 64; those in which the
back-off left every row out count too), each of the two candidate modes is priced
per output token at the batch the engine runs:

    c_m = (T(B) + D_m(B)) / (B E_m)

    T(B)   = t_target(B n_t) + c        the step without drafting, as measured: the load-time
                                        curve plus the engine's measured overhead beyond it
                                        (cost_model.StepOverhead, which absorbs the curve's
                                        error at this batch), or the curve corrected by the
                                        forwards the engine timed (CurveCalibration) where no
                                        overhead sample was taken yet
    D_m(B) = F_m r t_draft(B n_m)       the draft model's round: F_m forwards per step (measured
                                        mean, else d_m E_m of MODES), r the measured / modeled
                                        ratio of whole rounds (the back-off's own, else 1)
    D_pool = the pool lookups' measured seconds per step (the proposer's running mean over
             every step the pool drafted in, pool mode or pool fill)
    E_m    = tokens per target forward of rows drafted whole in mode m (decayed mean over its
             recent rows), MODES' prior until MIN_ROWS rows were measured. A pool row whose
             branches the back-off cut counts with what its unsent branches are estimated to
             add (pool_draft.unsent_branch_gain): under load the back-off may cut every row
             (rows_estimated counts them)

The overhead is measured beside the load-time curve at the tokens the mode in force sends, so
on a compute-bound curve it carries the curve's error there: on this CPU, MT-Bench read 42 ms in
the guess mode and 3.4 ms in the pool mode, whose longer drafts the curve overprices. A lower T
favours the mode with fewer tokens per forward, so each mode's reading leans the review toward
itself, by less than MARGIN in those runs (results/README.md, "Session of 2026-12-02
(sixteenth)"); on a GPU's flat curve the overhead does not depend on the mode.

The engine moves to the cheaper one where it saves more than MARGIN of the current one's
cost; each switch doubles the steps to the next review (up to MAX_GAP x). The draft model's
mode is fixed at load (its window and guesses shape the runtime and its CUDA graphs, all built
in load_model); only switching the draft model off and on is reviewed, and only where the user
pinned none of use_draft, use_lookahead, use_guesses. No vLLM imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vllm_ouroboros.cost_model import CostCurve, DraftingMode, running_mean


@dataclass
class ModePrice:
    """What a review priced for one mode (seconds per output token and its terms)."""

    seconds_per_token: float
    tokens_per_forward: float  # E used
    draft_seconds: float  # D_m(B) used
    measured: bool  # E from this engine's rows, not MODES' prior


class ModeReview:
    """Chooses, every `every` decoding steps, between `drafted` (the draft model's mode
    built at load) and `pool` (no draft forward), from what the engine measured."""

    MIN_ROWS = 48  # row-steps of a mode measured before its E replaces the prior
    MARGIN = 0.1  # the other mode must cost this fraction less per token
    DECAY = 0.995  # per measured row: E is a mean over the mode's last few hundred row-steps
    BATCH_RATE = 0.1  # running mean of the drafting rows per step
    MAX_GAP = 16  # reviews at least every MAX_GAP x `every` steps however often it switched

    def __init__(self, drafted: DraftingMode, pool: DraftingMode, row_tokens: int,
                 target_tokens: int, every: int = 64):
        """row_tokens: tokens per row of one of the drafted mode's forwards (draft_row_tokens);
        target_tokens: n_t, the target's tokens per drafting row (1 + gamma + L, as at load);
        every: decoding steps between reviews (and the least a mode runs after a switch). The
        mode in force is the caller's (the proposer's drafting mode), passed to step and
        review: one place holds it."""
        if drafted.uses_draft == pool.uses_draft:
            raise ValueError(f"{drafted.name!r} and {pool.name!r} are not a draft model's mode and the pool's")
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        self.every = every
        # Steps until the next review: `every`, doubled by each switch up to MAX_GAP x every (a
        # switch to the draft model costs the requests' catch-up prefills, which the prices
        # leave out, so two modes priced near each other do not trade places every review).
        self.gap = every
        self.modes = {drafted.name: drafted, pool.name: pool}
        self.drafted, self.pool = drafted.name, pool.name
        self.row_tokens, self.target_tokens = row_tokens, target_tokens
        self._tokens_w = dict.fromkeys(self.modes, 0.0)  # decayed sums: tokens, row-steps
        self._rows_w = dict.fromkeys(self.modes, 0.0)
        self.rows_measured = dict.fromkeys(self.modes, 0)
        self.rows_estimated = dict.fromkeys(self.modes, 0)  # of those, rows with an estimated part
        self._forwards: float | None = None  # drafted mode's forwards per round, running mean
        self.batch = 1.0  # drafting rows per step, running mean (each step drafts >= 1)
        self.steps = 0  # decoding steps since the last review (or switch)
        self.switches = 0
        self.last: dict[str, ModePrice] = {}

    # ---- measurements ------------------------------------------------------------------------
    def step(self, mode: str, rows: int, forwards: float | None) -> None:
        """A drafting step of `mode` (the mode in force): `rows` requests drafted, its round ran
        `forwards` forwards per row (None in the pool mode, or where the round was cut: not a
        whole round's F)."""
        self.steps += 1
        self.batch += self.BATCH_RATE * (rows - self.batch)
        if mode != self.pool and forwards is not None:
            self._forwards = running_mean(self._forwards, float(forwards), self.BATCH_RATE)

    def idle_step(self) -> None:
        """A decoding step in which the mode in force drafted for no request (the back-off left
        every row out): it counts toward the next review, which otherwise never came where the
        mode's drafts had all stopped (a pool that landed nothing for a while kept the engine
        in the pool mode, decoding plainly, for good)."""
        self.steps += 1

    def observe(self, mode: str, tokens: np.ndarray, estimated: int = 0) -> None:
        """Tokens per target forward ([R], accepted + 1) of R rows that mode `mode` drafted
        whole (the back-off's cut drafts say less, and rows it left out drafted nothing), or
        what a cut row would have given whole where that can be estimated in the mean (the
        pool's branches); `estimated` of the R rows are such."""
        tokens = np.asarray(tokens, float)
        if mode not in self.modes or tokens.size == 0:
            return
        self.rows_estimated[mode] += estimated
        keep = self.DECAY ** tokens.size
        self._tokens_w[mode] = self._tokens_w[mode] * keep + float(tokens.sum())
        self._rows_w[mode] = self._rows_w[mode] * keep + tokens.size
        self.rows_measured[mode] += tokens.size

    def tokens_per_forward(self, mode: str) -> tuple[float, bool]:
        """E of `mode` and whether it was measured here (else MODES' prior)."""
        if self.rows_measured[mode] >= self.MIN_ROWS:
            return self._tokens_w[mode] / self._rows_w[mode], True
        return self.modes[mode].tokens_per_target_forward, False

    # ---- the decision ------------------------------------------------------------------------
    def due(self) -> bool:
        return self.steps >= self.gap

    def price(self, step_seconds: float, draft: CostCurve, draft_scale: float,
              pool_seconds: float) -> dict[str, ModePrice]:
        """Each mode's seconds per output token at the current batch (rows per step, mean).
        step_seconds: T(B), the step without drafting; draft: the draft's forward curve;
        draft_scale: measured / modeled seconds of whole rounds; pool_seconds: D_pool."""
        B = self.batch
        out = {}
        for name, m in self.modes.items():
            E, measured = self.tokens_per_forward(name)
            if m.uses_draft:
                F = self._forwards if self._forwards is not None else \
                    m.draft_forwards_per_token * m.tokens_per_target_forward
                D = F * draft_scale * draft(B * self.row_tokens)
            else:
                D = pool_seconds
            out[name] = ModePrice((step_seconds + D) / (B * max(E, 1.0)), E, D, measured)
        return out

    def review(self, current: str, target: CostCurve, overhead: float | None, draft: CostCurve,
               draft_scale: float, pool_seconds: float) -> str | None:
        """Called once due(): the mode to switch to from `current` (the mode in force), or None
        to stay. target: the target's curve (load-time, or corrected by the timed forwards where
        overhead is None); overhead: the engine's measured seconds per step beyond `target`
        (None: not measured); pool_seconds: the pool lookups' seconds per step (0 unmeasured)."""
        if current not in self.modes:
            raise ValueError(f"current mode {current!r} is neither {self.drafted!r} nor {self.pool!r}")
        self.steps = 0
        step = target(self.batch * self.target_tokens) + (overhead or 0.0)
        self.last = self.price(step, draft, draft_scale, pool_seconds)
        other = self.pool if current == self.drafted else self.drafted
        here, there = self.last[current].seconds_per_token, self.last[other].seconds_per_token
        if not math.isfinite(there) or there >= (1 - self.MARGIN) * here:
            return None
        self.switches += 1
        self.gap = min(2 * self.gap, self.MAX_GAP * self.every)
        return other

    def stats(self) -> dict:
        """For the snapshot: the measured E by mode, and the last review's prices (ms per token)."""
        return {"switches": self.switches, "steps_between_reviews": self.gap,
                "tokens_per_target_forward": {m: round(self.tokens_per_forward(m)[0], 3) for m in self.modes},
                "rows_measured": dict(self.rows_measured),
                "rows_estimated": dict(self.rows_estimated),
                "batch": round(self.batch, 2),
                "last_ms_per_token": {m: round(1000 * p.seconds_per_token, 3) for m, p in self.last.items()}}

