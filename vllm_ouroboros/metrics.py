"""Counters of the method, per request and in aggregate (host-side Python numbers).

Definitions (per request, summed for the aggregate):
  draft_forwards       lookahead forwards the request took part in (prefill excluded)
  prefill_forwards     draft prefill forwards over the request's uncached context
  target_forwards      verification steps that carried a draft for the request
  drafted_tokens       tokens sent to the target for verification (draft + suffix)
  accepted_tokens      of those, accepted by the target
  suffix_accepted      accepted tokens that came from a candidate suffix
  tree_suffix_accepted of those, tokens from a suffix other than the first
  tree_gain            tokens the tree's best suffix matched of the target's argmax beyond what
                       suffix 0 alone (chain verification, K = 1) would have matched in the same
                       step: the tree's own gain, paired (greedy: exactly the extra accepted
                       tokens)
  generated_tokens     tokens the request produced while it had a draft slot
  guess_tokens         draft tokens taken from pool guesses (phrase drafting at work)
  guess_lookups/hits   draft forwards that looked up guesses / took >= 1 token from one (a
                       round the back-off cut to a chain looks up none)
  inspiration_inserts, refinement_inserts: phrases written from verification output
  backoff_steps        steps in which the draft model did not draft for the request because
                       speculation would not pay for it on this device at that batch size
                       (cost_model.py); the pool may have drafted instead (pool_draft_steps)
  shortened_steps      steps in which the request's draft was cut short by the back-off: at that
                       batch size a shorter draft per request paid better than whole ones
                       (cost_model.speculation_plan)
  branches_cut         the pool's branches (pool_branches) found for the request that the back-off's
                       cut left out: its cut counts whole branches, the best ranked sent first
  cache_full_steps     steps in which the draft model did not draft for the request because the
                       draft's KV cache could not grow to hold it (device memory;
                       runtime.DraftCacheFull); the pool may have drafted instead
  suffix_skipped       steps in which the request's draft went to the target without its
                       candidate suffixes: their measured acceptance would not pay for their
                       target tokens on this device (cost_model.rows_sending_suffixes)
  unreadable_prompt_steps steps in which the draft model did not draft for the request because
                       its prompt came as embeddings (prompt_embeds), which it cannot read; the
                       pool may have drafted instead
  sampling_pause_steps steps in which nothing was drafted for the request because a request in
                       the batch sampled with settings neither the tree walk nor vLLM's
                       rejection sampler verifies drafts for (tree_verify.drafting_pause)
  scheduler_cut_steps  steps in which vLLM's scheduler verified fewer of the request's proposed
                       tokens than it was sent (max_num_batched_tokens taken by other requests'
                       prefill or drafts): a tree cut to its first tokens
  pool_draft_steps     steps in which the request's draft came from the pool alone, with no draft
                       forward: every drafted step of the pool mode, and in the draft model's
                       mode a step the model did not draft for it (back-off, unreadable prompt,
                       full draft cache) whose pool draft paid by the pool's own estimates
  draft_rounds         steps that drafted a sentence draft for the request: the draft model's, or
                       the pool's chain of phrases where it found one; the pool's branches
                       (pool_branches) are none
  sentence_draft_tokens tokens of those sentence drafts (before the suffixes and the token cap)
  stops_rule, stops_cap adaptive draft length only: rounds whose draft the acceptance rule
                       stopped (1 - prod P(accept) > h) / that max_draft_length (or
                       max_draft_forwards) stopped
Aggregate only:
  draft_forward_calls  batched draft forward calls (one call serves every drafting request)
  rounds               propose() calls that drafted for at least one request
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from vllm_ouroboros.metrics_export import COUNTERS

PER_REQUEST = (
    "draft_forwards", "prefill_forwards", "target_forwards", "drafted_tokens", "accepted_tokens",
    "suffix_accepted", "tree_suffix_accepted", "tree_gain", "generated_tokens", "guess_tokens", "guess_lookups", "guess_hits",
    "inspiration_inserts", "refinement_inserts", "backoff_steps", "shortened_steps", "branches_cut", "cache_full_steps", "suffix_skipped",
    "scheduler_cut_steps", "unreadable_prompt_steps", "draft_rounds", "sentence_draft_tokens", "stops_rule", "stops_cap",
    "pool_draft_steps", "sampling_pause_steps",
)
_COL = {name: i for i, name in enumerate(PER_REQUEST)}
# /metrics' counters (metrics_export.COUNTERS order): those summed over requests, by position.
_EXPORT_POS = np.array([i for i, k in enumerate(COUNTERS) if k in _COL], np.int64)
_EXPORT_COL = np.array([_COL[k] for k in COUNTERS if k in _COL], np.int64)
_EXPORT_OTHER = tuple((i, k) for i, k in enumerate(COUNTERS) if k not in _COL)


class OuroborosStats:
    """Running counters, one row per draft slot (request), kept as a host array so that a step
    updates all requests with one vectorised add. `snapshot()` is what tests, scripts and
    /metrics read."""

    def __init__(self, num_slots: int, keep_finished: int = 1024):
        self.live = np.zeros((num_slots, len(PER_REQUEST)), np.int64)
        self.done_total = np.zeros(len(PER_REQUEST), np.int64)
        self.req_of_slot: dict[int, str] = {}
        self.finished: OrderedDict[str, dict] = OrderedDict()
        self.keep_finished = keep_finished
        self.draft_forward_calls = 0
        self.prefill_forward_calls = 0
        self.rounds = 0
        self.max_forward_calls_per_round = 0
        self.max_batch_per_round = 0

    def start(self, slot: int, req_id: str) -> None:
        # An occupant not finished first (its release raised before `finish`): its counts go
        # to the totals, not lost under the new request.
        self.finish(slot)
        self.req_of_slot[slot] = req_id
        self.live[slot] = 0

    def add(self, slots: np.ndarray, **counts: np.ndarray) -> None:
        """Add per-row counts (arrays aligned with `slots`) to those requests."""
        if len(slots) == 0:
            return
        # One np.add.at for all the columns (a step makes a dozen such calls): slots repeat
        # where a request has several rows (its inserts), so a plain += would drop some.
        values = np.empty((len(slots), len(counts)), np.int64)
        for i, value in enumerate(counts.values()):
            values[:, i] = value
        cols = np.fromiter((_COL[key] for key in counts), np.int64, len(counts))
        np.add.at(self.live, (np.asarray(slots)[:, None], cols[None, :]), values)

    def finish(self, slot: int) -> None:
        req_id = self.req_of_slot.pop(slot, None)
        if req_id is None:
            return
        self.done_total += self.live[slot]
        # A request evicted and brought back by vLLM finishes a slot twice: both stretches count.
        self.finished[req_id] = self._with_earlier(req_id, self.live[slot], self.finished.pop(req_id, None))
        self.live[slot] = 0
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)

    @staticmethod
    def _with_earlier(req_id: str, live: np.ndarray, earlier: dict | None) -> dict:
        """A request's per-request counters: its slot's (live [len(PER_REQUEST)]) plus those
        of an earlier stretch in another slot (a request evicted and brought back)."""
        now = live.tolist()
        if earlier is not None:
            now = [a + b for a, b in zip(earlier.values(), now)]
        return dict(zip(PER_REQUEST, now))

    def round_done(self, forward_calls: int, prefill_calls: int, batch: int) -> None:
        self.rounds += 1
        self.draft_forward_calls += forward_calls
        self.prefill_forward_calls += prefill_calls
        self.max_forward_calls_per_round = max(self.max_forward_calls_per_round, forward_calls)
        self.max_batch_per_round = max(self.max_batch_per_round, batch)

    def exported_totals(self, **elsewhere: int) -> np.ndarray:
        """The totals /metrics exports, [len(COUNTERS)] int64 in metrics_export.COUNTERS order:
        per-request counters summed over live and finished requests, this object's aggregate
        counters, and `elsewhere` (counters the proposer keeps, by name). One vectorised sum
        over the slots, for every step (metrics_export.CounterFile): with the store, 9 us at 256
        slots, 30 us at 1024 on this CPU (results/README.md, "Session of 2026-11-27")."""
        out = np.empty(len(COUNTERS), np.int64)
        out[_EXPORT_POS] = (self.done_total + self.live.sum(axis=0))[_EXPORT_COL]
        for i, key in _EXPORT_OTHER:
            out[i] = elsewhere[key] if key in elsewhere else getattr(self, key)
        return out

    def snapshot(self, pool_stats: dict | None = None, per_request: bool = True) -> dict:
        """All counters plus derived ratios, as plain Python values."""
        t = dict(zip(PER_REQUEST, (self.done_total + self.live.sum(axis=0)).tolist()))
        out = {
            **t,
            "draft_forward_calls": self.draft_forward_calls,
            "prefill_forward_calls": self.prefill_forward_calls,
            "rounds": self.rounds,
            "max_forward_calls_per_round": self.max_forward_calls_per_round,
            "max_batch_per_round": self.max_batch_per_round,
            "draft_forwards_per_token": t["draft_forwards"] / max(t["generated_tokens"], 1),
            "accepted_per_target_forward": (t["accepted_tokens"] + t["target_forwards"])
            / max(t["target_forwards"], 1),
            "acceptance_rate": t["accepted_tokens"] / max(t["drafted_tokens"], 1),
            "draft_forward_calls_per_round": self.draft_forward_calls / max(self.rounds, 1),
            "pool_hit_rate": t["guess_hits"] / max(t["guess_lookups"], 1),
            "mean_draft_length": t["sentence_draft_tokens"] / max(t["draft_rounds"], 1),
        }
        if per_request:
            live = {r: self._with_earlier(r, self.live[s], self.finished.get(r))
                    for s, r in self.req_of_slot.items()}
            out["per_request"] = {**self.finished, **live}
        if pool_stats:
            out["pool"] = pool_stats
        return out


def engine_snapshot(llm) -> dict:
    """Counters of a running `vllm.LLM` using ouroboros: the first worker that drafts (TP ranks
    draft alike; under pipeline parallelism only the last stage's workers have a drafter)."""
    snaps = [s for s in llm.collective_rpc("ouroboros_snapshot") or () if s is not None]
    if not snaps:
        raise RuntimeError("this engine does not run the ouroboros method")
    return snaps[0]


TRACE_ENV = "OUROBOROS_TRACE"


class RoundTrace:
    """One JSON line per request and round, for studying draft lengths: what the round drafted
    and what the target accepted of it. Off, at no cost, unless the environment variable
    OUROBOROS_TRACE names a file (appended to; one writer process: the drafting rank).

    Fields: req (vLLM's request id), draft (sentence-draft tokens drafted), sent (of those, sent
    after the token cap), cut (the most tokens the back-off let the row send: its shorter draft
    under load), forwards (draft forwards the row took part in), stop ("rule" / "cap" with
    adaptive length, else "gamma"), accepted (tokens the target accepted, suffix included),
    accepted_draft (of the sent draft)."""

    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - lives with the proposer
        self._pending: dict[int, dict] = {}

    @property
    def on(self) -> bool:
        return self._file is not None

    def drafted(self, slots, req_ids, draft_lens, sent, forwards, stopped_by_rule, cut,
                from_pool=None) -> None:
        """Per drafting row (host arrays [R]); stopped_by_rule None in fixed mode; cut: the
        most tokens per row (the back-off's plan; an int or [R]); from_pool [R] bool: drafted
        by the pool alone (None: none were)."""
        if self._file is None:
            return
        cut = np.broadcast_to(np.asarray(cut), (len(slots),))
        for i, s in enumerate(slots.tolist()):
            stop = "gamma" if stopped_by_rule is None else ("rule" if stopped_by_rule[i] else "cap")
            self._pending[s] = {"req": req_ids[i], "draft": int(draft_lens[i]), "sent": int(sent[i]),
                                "cut": int(cut[i]), "forwards": int(forwards[i]), "stop": stop,
                                "source": "pool" if from_pool is not None and from_pool[i] else "model"}

    def verified(self, slots, accepted) -> None:
        """What the target accepted for each slot's last round (host arrays [B])."""
        if self._file is None:
            return
        import json

        for s, a in zip(slots.tolist(), accepted.tolist()):
            rec = self._pending.pop(s, None)
            if rec is not None:
                rec.update(accepted=int(a), accepted_draft=min(int(a), rec["sent"]))
                self._file.write(json.dumps(rec) + "\n")
