"""The draft side of one Ouroboros round, batched over requests: the sentence draft.

For every request the draft model keeps its own KV cache (one slot per request). A round:
  1. roll the slot back to the longest prefix of what it cached that the context still has;
  2. prefill long uncached stretches (new prompts) in chunks;
  3. draft phrase by phrase: one lookahead forward for all requests still short of gamma tokens,
     each advancing 1..beta tokens (draft/lookahead.py), until every request has >= gamma;
     with draft_length "adaptive" (SpecDec++), each row instead drafts until its acceptance
     head says the draft so far is more likely than h to hold a rejection, or max_draft_length
     (draft/acceptance_head.py); a forward's phrase is cut at the token where the rule fires;
  4. read K candidate suffixes for each draft's last token from the pool.

Step 3 runs one of two ways (DraftSettings.draft_round):
  "host":   this file's loop. The token tensors of each forward are built on the host and
            copied once per forward; reading back the new tokens (and the adaptive rule's
            verdicts) is one device->host sync per draft forward, which sizes the next forward
            exactly (no padding, finished rows left out), and where guesses are looked up one
            more sizes the guess columns (empty ones trimmed); the round's suffixes are one read.
            Cheapest where syncs are free: the CPU.
  "device" / "graph": draft/device_round.py, every shape fixed before the round, no sync
            inside it, replayed from CUDA graphs with "graph"; one device->host copy per round.
            For GPUs, where a host loop leaves the device waiting on kernel launches.
The contexts arrive as host arrays (vLLM keeps token ids on the host). No vLLM imports here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_ouroboros.cost_model import CostCurve, prefill_groups
from vllm_ouroboros.device_clock import DeviceClock
from vllm_ouroboros.draft.acceptance_head import stop_rule
from vllm_ouroboros.draft.device_round import DeviceRound
from vllm_ouroboros.draft.prefill_graph import CHUNK as PREFILL_CHUNK, PrefillGraphs, prefill_mask
from vllm_ouroboros.draft.kv_cache import DraftCacheFull  # noqa: F401 - callers catch it from here
from vllm_ouroboros.draft.lookahead import (
    build_layout,
    initial_window,
    output_rows,
    output_tokens,
    read_output,
    row_inputs,
)
from vllm_ouroboros.host_copy import to_device, to_host
from vllm_ouroboros.pool import PhrasePool


@dataclass
class DraftSettings:
    """The knobs the draft side needs (a view of OuroborosConfig)."""

    gamma: int
    beta: int
    window_size: int
    num_guesses: int
    num_suffixes: int
    use_lookahead: bool = True
    use_guesses: bool = True
    max_draft_forwards: int = 16
    prefill_chunk: int = 512
    # "fixed": draft >= gamma tokens; "adaptive": stop by the acceptance head (needs a head).
    draft_length: str = "fixed"
    acceptance_threshold: float = 0.7
    max_draft_length: int = 12
    # Where the drafting loop runs: "host" (sync per forward), "device" (fixed shapes, no sync
    # inside the round) or "graph" ("device" replayed from CUDA graphs; CUDA only).
    draft_round: str = "host"
    # "device"/"graph": forwards per round; None adapts to what recent rounds needed (a round
    # that runs out drafts less, still lossless); an int pins it (at most gamma in fixed mode).
    round_forwards: int | None = None
    # "device"/"graph": the work around each forward (inputs, masks, bookkeeping) in two Triton
    # kernels (kernels/round_steps.py): "auto" on CUDA after a check against torch, "torch",
    # or "triton" (wherever Triton runs, e.g. its CPU interpreter in tests).
    round_kernels: str = "auto"

    @property
    def draft_room(self) -> int:
        """Most sentence-draft tokens a round may need before its last forward's overshoot."""
        return self.max_draft_length if self.draft_length == "adaptive" else self.gamma


@dataclass
class RoundOutput:
    """Drafts of one round.

    Fields:
      drafts:       [B, D] int64 host array; row b's sentence draft is drafts[b, :draft_lens[b]].
      draft_lens:   [B] int64.
      suffixes:     [B, K, L] int64 host array, candidate suffixes hanging off the draft's end.
      suffix_valid: [B, K] bool.
      forwards:     draft forwards run in this round (prefill excluded), batched calls.
      row_forwards: [B] int64, draft forwards each row took part in.
    """

    drafts: np.ndarray
    draft_lens: np.ndarray
    suffixes: np.ndarray
    suffix_valid: np.ndarray
    forwards: int
    prefill_forwards: int
    row_forwards: np.ndarray
    guess_tokens: np.ndarray  # [B] draft tokens taken from pool guesses
    guess_hit_forwards: np.ndarray  # [B] forwards where a guess gave >= 1 token
    row_prefills: np.ndarray  # [B] prefill forwards each row took part in
    # Adaptive length: [B] bool, the row's draft was stopped by the acceptance rule (else by
    # max_draft_length or max_draft_forwards); None in fixed mode.
    stopped_by_rule: np.ndarray | None = None
    # The prefill forwards' padded sizes (rows x longest, tokens) and their seconds in all
    # (0.0 where none ran): what the back-off calibrates its catch-up cost with. Sizes are
    # left out (no sample) where a prefill graph was captured inside the timed prefill.
    prefill_sizes: tuple[int, ...] = ()
    prefill_seconds: float = 0.0

    def followed_by(self, other: "RoundOutput") -> "RoundOutput":
        """This round's rows, then `other`'s (a round of no forward: the pool's drafts,
        pool_draft.py), as one output: drafts padded to the wider one (their lengths say where
        each ends), suffix slots to the larger K (padding invalid); forwards and prefills are
        this round's."""
        if other.forwards or other.prefill_forwards:
            raise ValueError("followed_by appends a round of no forward (the pool's drafts)")
        D = max(self.drafts.shape[1], other.drafts.shape[1])
        K = max(self.suffixes.shape[1], other.suffixes.shape[1])

        def pad(x: np.ndarray, width: int, axis: int = 1) -> np.ndarray:
            shape = list(x.shape)
            shape[axis] = width - x.shape[axis]
            return np.concatenate([x, np.zeros(shape, x.dtype)], axis=axis)

        both = lambda f: np.concatenate([getattr(self, f), getattr(other, f)])  # noqa: E731
        rule = None if self.stopped_by_rule is None else np.concatenate(
            [self.stopped_by_rule, np.zeros(len(other.draft_lens), bool)])
        return RoundOutput(
            np.concatenate([pad(self.drafts, D), pad(other.drafts, D)]), both("draft_lens"),
            np.concatenate([pad(self.suffixes, K), pad(other.suffixes, K)]),
            np.concatenate([pad(self.suffix_valid, K), pad(other.suffix_valid, K)]),
            self.forwards, self.prefill_forwards, both("row_forwards"), both("guess_tokens"),
            both("guess_hit_forwards"), both("row_prefills"), rule, self.prefill_sizes, self.prefill_seconds)


class DraftRuntime:
    """Draft model + per-slot KV bookkeeping + the phrase-by-phrase drafting loop."""

    def __init__(self, model, pool: PhrasePool, settings: DraftSettings, num_slots: int,
                 max_len: int, device: torch.device | str, head=None, max_slots: int | None = None):
        """head: an AcceptanceHead (draft/acceptance_head.py), required when
        settings.draft_length == "adaptive". A model without a KV cache gets one here, with
        pages for num_slots requests of min(max_len, 256) tokens and no byte limit; a model
        that has one (the proposer sizes it at load, with draft_cache_max_mb) keeps it.
        max_slots: the most slots requests will use (max_num_seqs; None: unbounded), which
        the geometric growth of the slots' rows stops at."""
        self.max_slots = max_slots
        if settings.draft_length == "adaptive" and head is None:
            raise ValueError("adaptive draft length needs an acceptance head")
        if settings.draft_round not in ("host", "device", "graph"):
            raise ValueError(f"draft_round must be 'host', 'device' or 'graph', got {settings.draft_round!r}")
        self.model = model
        self.head = head if settings.draft_length == "adaptive" else None
        self.pool = pool
        self.s = settings
        self.device = torch.device(device)
        self.max_len = max_len
        self.L = settings.beta - 1
        self.W = settings.window_size if settings.use_lookahead else 0
        self.G = settings.num_guesses if settings.use_guesses else 0
        self._layouts: dict[tuple[int, int], object] = {}
        # The draft's prefill forward t(n) (the proposer's, measured at load): prefill passes
        # group rows to pay least for padding; None: one forward per pass.
        self.prefill_cost: CostCurve | None = None
        # Bumped whenever the window is reallocated (graphs hold pointers; see `generation`).
        self._window_generation = 0
        # Cache columns a round needs past a row's context: its largest uncached stretch, the
        # draft and one forward's scratch. The longest a slot can get: max_len plus that.
        self._round_room = 2 * (settings.draft_room + 2 * settings.beta + 2) + (self.W + self.G) * self.L + 8
        self._max_cap = max_len + self._round_room
        # Block-table columns: the longest slot, and at least a graph prefill chunk past max_len,
        # whose padding tokens write and read CHUNK columns from a row's committed length. Past a
        # row's reserved pages the table points at the null page; past the table the attention
        # kernel would read the next row's entries for a padding token's own key.
        self._table_len = max(self._max_cap, max_len + PREFILL_CHUNK)
        self._slots = 0
        self._cap = 0
        self.cached = np.zeros((0, 0), np.int64)  # tokens whose KV the slot holds
        self.kv_len = np.zeros(0, np.int64)
        self.confirmed = np.zeros(0, np.int64)  # context length at the slot's last round
        self.window = torch.zeros(0, self.L, max(self.W, 1), dtype=torch.long, device=self.device)
        self.window_ready = np.zeros(0, bool)
        if model.kv is None:
            model.allocate_cache(num_slots + 1, self._table_len,
                                 num_tokens=(num_slots + 1) * min(max_len, 256))
        self._grow(num_slots)
        self.device_round = (DeviceRound(self, graphs=settings.draft_round == "graph")
                             if settings.draft_round != "host" else None)
        # With graphs the prefill replays fixed-width chunks too (draft/prefill_graph.py).
        self.prefill_graphs = PrefillGraphs(self) if settings.draft_round == "graph" else None

    @property
    def max_slot_len(self) -> int:
        """The longest one slot's cache can get (tokens): context, a round's draft and one
        forward's scratch."""
        return self._max_cap

    @property
    def kv(self):
        """The model's paged KV cache (draft/kv_cache.PagedKVCache)."""
        return self.model.kv

    @property
    def generation(self):
        """Changes whenever the model's cache pages, its block table or the window are
        reallocated: CUDA graphs captured before hold their old addresses."""
        return self._window_generation, self.kv.generation

    # ---- slots -------------------------------------------------------------------------------
    @property
    def pad_slot(self) -> int:
        """A spare cache slot (and window row) past the requests' ones: fixed-shape rounds
        (draft/device_round.py) point their padding rows at it."""
        return self._slots

    @property
    def prefill_threshold(self) -> int:
        """Uncached stretches longer than this are prefilled before drafting; the drafting
        loop's first forward carries at most this + 1 uncached tokens."""
        return self.s.draft_room + 2 * self.s.beta + 2

    @property
    def chain_below(self) -> int | None:
        """Drafts cut below this many tokens (the back-off's shorter draft) run as a chain,
        one token per forward without window or guesses; None where no cut changes the round's
        shape (fixed-shape device and graph rounds draft as usual). At most max_draft_forwards
        + 1: a chain of s tokens takes s forwards, so a longer cut drafts as the round does
        (a chain stopped at the forward bound, short of the cut the plan priced)."""
        if self.device_round is not None:
            return None
        return min(self.s.draft_room, self.s.max_draft_forwards + 1)

    @property
    def stop_below(self) -> int | None:
        """Drafts cut below this many tokens end the round early: a device round with early
        exit (its rows stop at the cut, and the round once they have); None elsewhere (the
        host loop drafts a cut as a chain, a fixed-F device round runs min(F, the cut))."""
        dr = self.device_round
        return self.s.draft_room if dr is not None and dr.early_exit else None

    def drafts_chain(self, max_tokens: int | None) -> bool:
        """Whether a round cut to `max_tokens` draft tokens (None: not cut) drafts a chain."""
        below = self.chain_below
        return below is not None and max_tokens is not None and max(max_tokens, 1) < below

    def layout(self, U: int, G: int, W: int | None = None):
        """The lookahead layout for U uncached columns, G guesses and W window columns (the
        round's, by default; built once per triple)."""
        W = self.W if W is None else W
        layout = self._layouts.get((U, G, W))
        if layout is None:
            layout = self._layouts[(U, G, W)] = build_layout(U, W, self.L, G, self.device)
        return layout

    def _room(self, lens) -> np.ndarray:
        """Tokens a round may write to the slot of a context of `lens` tokens: [B] int64."""
        return np.minimum(np.asarray(lens, np.int64) + self._round_room, self._max_cap)

    def fits(self, slots: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Which rows a round can draft with the cache pages free now (no growing): bool [B],
        for slots [B] and context lengths lens [B] (tokens)."""
        return self.kv.fits(slots, self._room(lens))

    def _grow(self, num_slots: int) -> None:
        """Room for `num_slots` request slots (host arrays, the window, block-table rows) plus
        the spare `pad_slot`. Holds no pages: padding rows write to the null page
        (draft/kv_cache.py)."""
        if num_slots <= self._slots:
            return
        window = torch.zeros(num_slots + 1, self.L, max(self.W, 1), dtype=torch.long, device=self.device)
        window[: self._slots] = self.window[: self._slots]
        self.kv.resize(num_slots + 1, self._table_len)
        self.window = window
        self._window_generation += 1
        grow = num_slots - self._slots
        self.cached = np.concatenate([self.cached, np.zeros((grow, self._cap), np.int64)])
        self.kv_len = np.concatenate([self.kv_len, np.zeros(grow, np.int64)])
        self.confirmed = np.concatenate([self.confirmed, np.zeros(grow, np.int64)])
        self.window_ready = np.concatenate([self.window_ready, np.zeros(grow, bool)])
        self._slots = num_slots

    def _reserve(self, slots: np.ndarray, lens: np.ndarray) -> None:
        """Cache pages for what a round may write to these slots (raises DraftCacheFull with
        nothing changed), and room in the host record of cached tokens."""
        room = self._room(lens)
        self.kv.reserve(slots, room)
        need = int(room.max())
        if need > self._cap:  # geometrically: the host record is copied to grow
            cap = min(max(need, 2 * self._cap), self._max_cap)
            cached = np.zeros((self._slots, cap), np.int64)
            cached[:, : self._cap] = self.cached
            self.cached, self._cap = cached, cap

    def drop_graphs(self) -> None:
        """Forget the captured graphs of the drafting round and the prefill (captured again on
        use): after a failed step, whose captures may be half made."""
        if self.device_round is not None:
            self.device_round.drop_graphs()
        if self.prefill_graphs is not None:
            self.prefill_graphs.drop_graphs()

    def reset_slots(self, slots) -> None:
        """Forget finished requests' slots [n] (ints); their cache pages go back to the free
        pages, the block table's rows in one upload (a step's finished requests together)."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        slots = slots[slots < self._slots]
        if len(slots) == 0:
            return
        self.kv_len[slots] = 0
        self.confirmed[slots] = 0
        self.window_ready[slots] = False
        self.kv.release(slots)

    def rewind(self, slots: np.ndarray, lens: np.ndarray) -> None:
        """The context of `slots` [n] was cut back to `lens` [n] tokens, and what follows may
        differ from what was cached: the next round checks the cache against the context from
        there on (`_rollback` trusts what was confirmed below)."""
        mine = slots < self._slots
        slots = slots[mine]
        self.confirmed[slots] = np.minimum(self.confirmed[slots], lens[mine])

    # ---- round -------------------------------------------------------------------------------
    def run_round(self, slots: np.ndarray, token_ids: np.ndarray, rows: np.ndarray,
                  lens: np.ndarray, forwards: int | None = None,
                  max_tokens: int | None = None) -> RoundOutput:
        """Draft for B requests.

        Shape:
          slots:     [B] int64, draft-cache slot of each request.
          token_ids: [R, >= max(lens)] host token table (vLLM's token_ids_cpu); row rows[b] holds
                     request b's context (prompt + output so far), lens[b] tokens long.
        forwards: device / graph rounds only: the round's number of forwards F (None:
                  settings.round_forwards; round_length.py chooses it in the proposer).
        max_tokens: the most draft tokens the caller will send (the back-off's shorter draft
                  under load, cost_model.speculation_plan). Below gamma (max_draft_length in
                  adaptive mode) the host loop drafts that many tokens as a chain: no window,
                  no guesses (the same greedy tokens through a narrower forward); at or above
                  it, as usual up to max_tokens (no overshoot past it), so the suffixes follow
                  the draft. Fixed-shape rounds keep their shapes (window and guesses) and end
                  each row's draft at the cut alike.
        """
        clock, sizes = DeviceClock(self.device), []
        graphs = self.prefill_graphs
        captures = graphs.captures if graphs is not None else 0
        out = self._round(slots, token_ids, rows, lens, forwards, max_tokens, clock, sizes)
        if not sizes:
            return out
        # A graph captured (re-captured: the cache grew) inside the timed prefill: its seconds
        # still come off the round's, but they are no sample of what the prefill costs.
        if graphs is not None and graphs.captures != captures:
            sizes = []
        # The round's outputs came back to the host: the prefill's CUDA events are done.
        return replace(out, prefill_sizes=tuple(sizes), prefill_seconds=clock.seconds())

    def _round(self, slots, token_ids, rows, lens, forwards, max_tokens, clock, sizes) -> RoundOutput:
        B = len(slots)
        L, K = self.L, self.s.num_suffixes
        self._prepare(slots, token_ids, rows, lens)
        row_prefills = np.zeros(B, np.int64)
        prefill_forwards = self._prefill(slots, token_ids, rows, lens, row_prefills, clock, sizes)
        self._init_windows(slots, token_ids, rows, lens)
        if self.device_round is not None:
            return self._draft_on_device(slots, token_ids, rows, lens, prefill_forwards, row_prefills,
                                         self.s.round_forwards if forwards is None else forwards, max_tokens)

        adaptive = self.head is not None
        max_draft = self.s.max_draft_length if adaptive else self.s.gamma + self.s.beta
        # A cut draft is a prefix of the whole round's: the same greedy tokens, fewer forwards.
        room = self.s.draft_room if max_tokens is None else max(min(self.s.draft_room, max_tokens), 1)
        # Its last forward takes no token past the cut either: the draft then ends where it is
        # sent, and its suffixes (looked up after its last token) can follow it.
        limit = max_draft if max_tokens is None else max(min(max_draft, max_tokens), 1)
        chain = self.drafts_chain(max_tokens)
        W, G = (0, 0) if chain else (self.W, self.G)
        drafts = np.zeros((B, max_draft), np.int64)
        dlen = np.zeros(B, np.int64)
        row_forwards = np.zeros(B, np.int64)
        guess_tokens = np.zeros(B, np.int64)
        guess_hit_forwards = np.zeros(B, np.int64)
        # Adaptive: prod(P(accept)) of each row's draft so far, and whether the rule stopped it.
        prod = np.ones(B, np.float32)
        by_rule = np.zeros(B, bool)
        forwards = 0
        while forwards < self.s.max_draft_forwards:
            act = np.nonzero(~by_rule & (dlen < room))[0]  # by_rule stays False in fixed mode
            if len(act) == 0:
                break
            new, num, rule = self._lookahead_forward(slots[act], token_ids, rows[act], lens[act],
                                                     drafts[act], dlen[act],
                                                     prod[act] if adaptive else None, W, G)
            if adaptive:
                # Cut the phrase where the rule fires; the cap cuts it too (then the cap stopped it).
                rule_take, fired, prod[act] = rule
                num = np.minimum(num, rule_take)
                by_rule[act] = fired & (rule_take <= limit - dlen[act])
            take = np.minimum(num, limit - dlen[act])
            cols = dlen[act, None] + np.arange(L + 1)[None, :]
            ok = np.arange(L + 1)[None, :] < take[:, None]
            drafts[np.repeat(act, L + 1)[ok.ravel()], cols[ok]] = new[ok]
            guess_tokens[act] += take - 1
            guess_hit_forwards[act] += take > 1
            dlen[act] += take
            row_forwards[act] += 1
            forwards += 1

        suffixes = np.zeros((B, K, L), np.int64)
        suffix_valid = np.zeros((B, K), bool)
        if K:
            last = self._last_tokens(token_ids, rows, lens, drafts, dlen)
            phr, valid = self.pool.lookup(*to_device(self.device, last, slots), K)
            suffixes, suffix_valid = to_host(phr, valid)
        self.confirmed[slots] = lens
        return RoundOutput(drafts, dlen, suffixes, suffix_valid, forwards, prefill_forwards,
                           row_forwards, guess_tokens, guess_hit_forwards, row_prefills,
                           by_rule if adaptive else None)

    def _draft_on_device(self, slots, token_ids, rows, lens, prefill_forwards, row_prefills,
                         forwards, max_tokens) -> RoundOutput:
        """Step 3 and 4 on the device (draft/device_round.py), then the host's bookkeeping of
        what the round committed to each slot (the uncached context, then the draft but for
        its last forward's tokens), from the round's one device->host copy."""
        kv = self.kv_len[slots]
        u0 = lens - kv
        idx = kv[:, None] + np.arange(int(u0.max()))[None, :]
        unc0 = token_ids[rows[:, None], np.minimum(idx, lens[:, None] - 1)].astype(np.int64)
        unc0 = np.where(idx < lens[:, None], unc0, 0)
        out = self.device_round.run(slots, unc0, u0, kv, forwards, max_tokens)
        self._commit(slots, unc0, u0)
        self._commit(slots, out.drafts, out.committed)
        self.confirmed[slots] = lens
        return RoundOutput(out.drafts, out.draft_lens, out.suffixes, out.suffix_valid, out.forwards,
                           prefill_forwards, out.row_forwards, out.guess_tokens, out.guess_hits,
                           row_prefills, out.stopped_by_rule if self.head is not None else None)

    def prefill(self, slots: np.ndarray, token_ids: np.ndarray, rows: np.ndarray,
                lens: np.ndarray) -> tuple[int, tuple[int, ...]]:
        """A round's prefill alone: the caches of slots [B] catch up on their contexts (rows
        `rows` of the host table token_ids, lens [B] tokens) but for the last stretch a round's
        first forward carries, as run_round would before drafting; nothing is drafted. Returns
        the forwards run and each one's padded size (rows x longest, tokens). For measuring the
        prefill apart (scripts/draft_prefill_cost.py): it does not synchronise the device."""
        self._prepare(slots, token_ids, rows, lens)
        sizes: list[int] = []
        forwards = self._prefill(slots, token_ids, rows, lens, np.zeros(len(slots), np.int64),
                                 DeviceClock(self.device), sizes)
        return forwards, tuple(sizes)

    # ---- steps of a round --------------------------------------------------------------------
    def _prepare(self, slots, token_ids, rows, lens) -> None:
        """Cache pages and slot room for the round (may raise DraftCacheFull: first, so that
        nothing changed), then each slot's cache cut back to what still matches its context."""
        self._reserve(slots, lens)
        # Geometrically: a growth reallocates the window and the block table, which drops every
        # captured graph (their addresses), so one per new concurrency peak would recapture them
        # all each time a request above the peak arrived.
        need = int(slots.max()) + 1
        if need > self._slots:
            need = max(need, min(2 * self._slots, self.max_slots or 2 * self._slots))
        self._grow(need)
        self._rollback(slots, token_ids, rows, lens)

    def _rollback(self, slots, token_ids, rows, lens) -> None:
        """Keep the longest cached prefix that still matches the context (and leave the last
        context token uncached: its output is the next draft token)."""
        lim = np.minimum(self.kv_len[slots], lens - 1)
        start = np.minimum(self.confirmed[slots], lim)
        width = int((lim - start).max(initial=0))
        if width == 0:
            self.kv_len[slots] = lim
            return
        idx = start[:, None] + np.arange(width)[None, :]
        valid = idx < lim[:, None]
        idx = np.minimum(idx, lim[:, None].clip(min=1) - 1)
        differ = (self.cached[slots[:, None], idx] != token_ids[rows[:, None], idx]) & valid
        first = np.where(differ.any(1), start + differ.argmax(1), lim)
        self.kv_len[slots] = np.minimum(lim, first)

    def _commit(self, slots, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Record that tokens[b, :counts[b]] now have KV at kv_len[b].. of their slots."""
        cols = self.kv_len[slots, None] + np.arange(tokens.shape[1])[None, :]
        ok = np.arange(tokens.shape[1])[None, :] < counts[:, None]
        self.cached[np.repeat(slots, tokens.shape[1])[ok.ravel()], cols[ok]] = tokens[ok]
        self.kv_len[slots] += counts

    def _prefill(self, slots, token_ids, rows, lens, row_prefills, clock, sizes) -> int:
        """Causal forwards over long uncached stretches, so the drafting loop stays narrow;
        each pass's rows grouped into forwards by cost_model.prefill_groups (prefill_cost).
        Timed by `clock` where any runs; `sizes` gets each forward's padded tokens."""
        threshold = self.prefill_threshold
        forwards = 0
        while True:
            todo = np.nonzero(lens - 1 - self.kv_len[slots] > threshold)[0]
            if len(todo) == 0:
                if forwards:
                    clock.stop()
                return forwards
            if not forwards:
                clock.start()
            graphs = self.prefill_graphs if self.prefill_graphs is not None and self.prefill_graphs.enabled else None
            chunk = self.s.prefill_chunk if graphs is None else graphs.chunk
            count = np.minimum(lens[todo] - 1 - self.kv_len[slots[todo]], chunk)
            for group in self._prefill_passes(count, graphs, self.kv_len[slots[todo]]):
                if graphs is None or not self._graph_prefill(graphs, slots[todo[group]], token_ids,
                                                             rows[todo[group]], lens[todo[group]], count[group]):
                    self._prefill_forward(slots[todo[group]], token_ids, rows[todo[group]],
                                          lens[todo[group]], count[group])
                sizes.append(len(group) * int(count[group].max()) if graphs is None
                             else graphs.padded_rows(len(group)) * graphs.chunk)
                row_prefills[todo[group]] += 1
                forwards += 1

    def _prefill_passes(self, count: np.ndarray, graphs, kv: np.ndarray) -> list[np.ndarray]:
        """The forwards of one prefill pass (row indices into count; kv: the rows' cached
        tokens): eagerly, grouped by cost (cost_model.prefill_groups); from graphs, as many
        rows per forward as a graph takes.

        An eager forward pads every row to its group's longest count, and a row's padding
        must stay inside its block table (kv.max_seq_len tokens): near max_model_len a row
        padded to another's 512-token chunk would read a mask wider than its pages (the
        forward failed) and write past its last page. Such rows go in forwards of their own
        (a row's own count always fits: its context does)."""
        if graphs is None:
            groups = []
            for g in prefill_groups(count, self.prefill_cost):
                over = kv[g] + int(count[g].max()) > self.kv.max_seq_len
                groups += [g[~over]] * bool((~over).any()) + [g[i:i + 1] for i in np.nonzero(over)[0]]
            return groups
        starts = np.cumsum([0] + graphs.rows_per_forward(len(count)))
        return [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]

    def _graph_prefill(self, graphs, s, token_ids, r, lens, count) -> bool:
        """One chunk replayed from the prefill graphs (draft/prefill_graph.py), committed on the
        host; False where its capture failed (graphs.enabled is then off: the caller runs
        this chunk, and the prefill from then on, eagerly)."""
        if not graphs.enabled:
            return False
        toks = self._prefill_tokens(s, token_ids, r, lens, count)
        try:
            graphs.forward(s, toks, count)
        except Exception:  # noqa: BLE001 - logged by PrefillGraphs; eager forwards still prefill
            if graphs.enabled:
                raise
            return False
        self._commit(s, toks, count)
        return True

    def _prefill_tokens(self, s, token_ids, r, lens, count) -> np.ndarray:
        """[R, max(count)] int64: the next uncached tokens of slots s (rows r of token_ids,
        context lengths lens), each row's past its count[r] repeating its last context token."""
        idx = self.kv_len[s, None] + np.arange(int(count.max()))[None, :]
        return token_ids[r[:, None], np.minimum(idx, lens[:, None] - 1)].astype(np.int64)

    def _prefill_forward(self, s, token_ids, r, lens, count) -> None:
        """One causal forward over the next `count` [R] uncached tokens of slots s [R] (rows r
        of token_ids, context lengths lens), padded to the longest."""
        toks = self._prefill_tokens(s, token_ids, r, lens, count)
        Q = toks.shape[1]
        cnt, kv, toks_t, s_t = to_device(self.device, count, self.kv_len[s], toks, s)
        col = torch.arange(Q, device=self.device)
        self.model.forward(toks_t, kv[:, None] + col[None, :], s_t, kv, prefill_mask(cnt, Q, col),
                           max_cache_len=int(self.kv_len[s].max()))
        self._commit(s, toks, count)

    def _init_windows(self, slots, token_ids, rows, lens) -> None:
        if self.W == 0:
            return
        fresh = np.nonzero(~self.window_ready[slots])[0]
        if len(fresh) == 0:
            return
        T = self.L * self.W
        idx = lens[fresh, None] - T + np.arange(T)[None, :]
        idx = np.where(idx < 0, idx % lens[fresh, None], idx)
        tail = token_ids[rows[fresh, None], idx].astype(np.int64)
        where, tail_t = to_device(self.device, slots[fresh], tail)  # a numpy index would sync
        self.window[where] = initial_window(tail_t, self.L, self.W)
        self.window_ready[slots[fresh]] = True

    def _last_tokens(self, token_ids, rows, lens, drafts, dlen) -> np.ndarray:
        ctx_last = token_ids[rows, lens - 1].astype(np.int64)
        d_last = drafts[np.arange(len(dlen)), np.maximum(dlen - 1, 0)]
        return np.where(dlen > 0, d_last, ctx_last)

    def _lookahead_forward(self, slots, token_ids, rows, lens, drafts, dlen, prod=None, W=None,
                           max_guesses=None):
        """One draft forward for A rows; returns (new tokens [A, L+1], counts [A], rule) on the host.

        W, max_guesses: window columns and guesses of this forward (None: the round's; 0, 0: a
        chain step).

        prod: [A] float32 prod(P(accept)) of each row's draft so far, adaptive mode only; then
        rule = (take [A], fired [A], prod after [A]) from stop_rule over this forward's tokens,
        else None."""
        A, L = len(slots), self.L
        kv = self.kv_len[slots]
        u = lens + dlen - kv  # uncached: context tail plus the draft so far
        U = int(u.max())
        # Uncached tokens come from the context, then from this round's draft.
        idx = kv[:, None] + np.arange(U)[None, :]
        from_ctx = idx < lens[:, None]
        ctx_tok = token_ids[rows[:, None], np.minimum(idx, lens[:, None] - 1)].astype(np.int64)
        d_idx = np.clip(idx - lens[:, None], 0, drafts.shape[1] - 1)
        unc = np.where(from_ctx, ctx_tok, drafts[np.arange(A)[:, None], d_idx])
        unc = np.where(np.arange(U)[None, :] < u[:, None], unc, 0)

        dev = self.device
        slots_t, u_t, kv_t, unc_t = to_device(dev, slots, u, kv, unc)
        W = self.W if W is None else W
        max_guesses = self.G if max_guesses is None else max_guesses
        parts = [unc_t]
        window = self.window[slots_t][:, :, :W] if W else None
        if W:
            parts.append(window.reshape(A, -1))
        G = 0
        if max_guesses:
            key = unc[np.arange(A), u - 1]
            guesses, gvalid = self.pool.lookup(*to_device(dev, key), slots_t, max_guesses)
            # Lookup ranks valid phrases first: feed only as many guess columns as some row
            # can fill. A sync, but a compute-bound device pays for every empty column.
            G = int(gvalid.sum(dim=1).max())
            guesses, gvalid = guesses[:, :G], gvalid[:, :G]
            parts.append(guesses.reshape(A, -1))
        if G == 0:
            guesses = torch.zeros(A, 0, L, dtype=torch.long, device=dev)
            gvalid = torch.zeros(A, 0, dtype=torch.bool, device=dev)
        layout = self.layout(U, G, W)
        input_ids = torch.cat(parts, dim=1)
        mask, positions = row_inputs(layout, u_t, kv_t)
        hidden = self.model.forward(input_ids, positions, slots_t, kv_t, mask, max_cache_len=int(kv.max()))
        tokens = self.model.greedy_tokens(output_rows(hidden, u_t, U))
        res = read_output(layout, output_tokens(tokens, u_t, layout.Q, U), u_t, window if W else torch.zeros(A, L, 0, dtype=torch.long, device=dev),
                          guesses, gvalid)
        self._commit(slots, unc, u)
        if W:
            self.window[slots_t, :, :W] = res.next_window
            self.pool.insert(res.phrase_keys.reshape(-1), res.phrases.reshape(-1, L),
                             slots_t.repeat_interleave(W))
        rule = None
        if prod is not None:
            p = self.head(self._token_hidden(hidden, res, u_t, layout, guesses, gvalid))
            valid = torch.arange(L + 1, device=dev)[None, :] < res.num_new[:, None]
            take, fired, after = stop_rule(p, valid, *to_device(dev, prod),
                                           self.s.acceptance_threshold)
            # The forward's one read (a GPU waits once for all five, not once each).
            new, num, *rule = to_host(res.new_tokens, res.num_new, take, fired, after)
            return new, num, tuple(rule)
        new, num = to_host(res.new_tokens, res.num_new)
        return new, num, rule

    def _token_hidden(self, hidden, res, u_t, layout, guesses, gvalid) -> torch.Tensor:
        """[A, L+1, H]: the hidden state whose output is each of the forward's new tokens.

        Token 0 comes from the last real uncached column; token j >= 1 from the output after
        guess token j-1 of a guess whose first num_new - 1 tokens are right. Every such guess
        has the same tokens at the same positions over the same prefix there, so which one is
        read does not matter (up to float summation order). Columns past num_new are filler."""
        A, L = hidden.shape[0], self.L
        dev = hidden.device
        cols = (u_t - 1)[:, None].expand(A, L + 1)
        G = guesses.shape[1]
        if G and L:
            need = torch.arange(L, device=dev)[None, :] < (res.num_new - 1)[:, None]  # [A, L]
            # A right guess's token k is the draft's prediction at its place, new token k (t1
            # for k = 0): lookahead.read_output.
            same = ((guesses == res.new_tokens[:, None, :L]) | ~need[:, None, :]).all(2) & gvalid
            g = same.long().argmax(1)  # [A]
            gcols = layout.guess_start + g[:, None] * L + torch.arange(L, device=dev)[None, :]
            cols = torch.cat([cols[:, :1], gcols], dim=1)
        return hidden.gather(1, cols[:, :, None].expand(A, L + 1, hidden.shape[2]))


def cache_growth_warning(worst_bytes: int, allocated_bytes: int, headroom_bytes: float,
                         num_slots: int, max_len: int) -> str | None:
    """A warning when the draft's KV cache, which grows on demand after vLLM measured its memory,
    could outgrow what vLLM leaves free on the device (`headroom_bytes`: (1 -
    gpu_memory_utilization) of it). Growing copies the cache, so old and new coexist for a moment.

    worst_bytes: the cache at num_slots slots of max_len tokens; allocated_bytes: at load."""
    peak = worst_bytes + max(worst_bytes // 2, allocated_bytes)  # the last doubling's copy
    if peak <= 0.5 * headroom_bytes:
        return None
    gib = 2**30
    return (f"the draft's KV cache is {allocated_bytes / gib:.2f} GiB now and grows on demand, outside "
            f"vLLM's memory profile: with {num_slots} requests of {max_len} tokens it would reach "
            f"{worst_bytes / gib:.1f} GiB (about {peak / gib:.1f} GiB while it is copied), against "
            f"{headroom_bytes / gib:.1f} GiB that vLLM leaves free (gpu_memory_utilization). "
            "Where it cannot grow, requests decode without a draft; to keep it within that, set "
            "draft_cache_max_mb, or lower max_num_seqs or max_model_len, or gpu_memory_utilization.")
