"""The drafting loop of one round on the device: fixed shapes, no host synchronisation, CUDA graphs.

`DraftRuntime.run_round`'s host loop sizes every forward from what the last one drafted (the host
reads the new tokens back: one sync per forward, and a GPU then waits on the host's kernel
launches). This module runs the same loop with every shape fixed before the round starts, so the
whole round is queued at once and can be replayed from CUDA graphs:

  * a batch of A requests is padded to a batch bucket (padding rows draft for a spare cache slot
    and change nothing: their pool reads and writes are masked);
  * the first forward's uncached width is padded to a width bucket; every later forward carries
    the tokens the previous one drafted: L + 1 columns (beta) with guesses, one without (a
    forward then drafts exactly one token: `DeviceRound.step_width`);
  * every forward carries all G guess columns (the host loop trims empty ones, which needs a sync);
  * a row may be cut (the back-off's shorter draft): it stops at its cut, and its last forward
    takes no token past it, as the host loop's (its suffixes then follow the draft it sends);
  * the host picks the number of forwards F before the round; rows that reach their length go
    inactive and ride along without changing anything, so with F at its bound (gamma forwards in
    fixed mode: each forward drafts >= 1 token) the drafts equal the host loop's token for token.
    With a smaller F a row may stop short of gamma: a shorter draft, still lossless.
  * early exit (graphs with CUDA conditional nodes, CUDA >= 12.4): every forward after the first
    sits in a conditional node whose predicate, "some row is still drafting and fewer than F
    forwards ran", the device evaluates, so a round stops where its rows are done as the host
    loop does, without the host reading anything: F is then the bound and the round runs the
    forwards its rows need. Without conditional nodes every one of the F forwards runs (rows
    done ride along), which is why round_length.py chooses F for those rounds.

State lives in static device tensors per batch bucket (`RoundState`), written in place; three
functions run on it: `_start` (load the inbox, the first forward), `_step` (one more forward) and
`_finish` (suffix lookup, pack the outputs). With graphs each is captured once per bucket and
replayed (F - 1 replays of `_step`), or with early exit `_rest` (the max_forwards - 1 conditional
steps, then `_finish`) is; without graphs the same functions run eagerly, which is how the CPU
tests check them (`RecordedGraph` stands in for a graph, the host evaluating the conditions).
The round's one device->host copy is the packed output.

No vLLM imports here.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.cuda_graph import capture_graph
from vllm_ouroboros.draft.acceptance_head import stop_rule
from vllm_ouroboros.draft.attention import DraftAttentionMetadata, build_attention_metadata
from vllm_ouroboros.draft.lookahead import output_index, output_rows, output_tokens, read_output, row_inputs

logger = logging.getLogger(LOGGER_NAME)

# Inbox columns before the first forward's tokens: slot, kv, u0, real, F, cap.
INBOX = 6

# Padded batch sizes (as vLLM pads its decode batches for its own graphs).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(n: int, buckets) -> int:
    """The smallest bucket >= n; past the largest, n rounded up to the last buckets' step (a
    graph set per batch size past 512, kept until the cache moves, would capture and hold
    one for every size a drifting batch takes)."""
    for b in buckets:
        if b >= n:
            return b
    step = buckets[-1] - buckets[-2] if len(buckets) > 1 else buckets[-1]
    return -(-n // step) * step


@dataclass
class RoundState:
    """Static device tensors of one batch bucket (A rows), reused by every round of that size.

    Fields (int64 unless said):
      slots [A], kv [A] (committed draft-cache length), real [A] bool (not padding),
      cap [A] (the most draft tokens the row takes: its cut, else the round's bound),
      active [A] bool (still drafting), drafts [A, Dw] (column Dw - 1 is a write sink),
      dlen [A], row_forwards [A], guess_tokens [A], guess_hits [A], last_take [A] (tokens the
      row's last forward drafted: not committed to its cache), prod [A] float32 and by_rule [A]
      bool (adaptive length), next_unc [A, L + 1] / next_u [A] (the next forward's uncached
      tokens), outbox [A, X] (the packed result), limit [] (the round's F).
      inbox: per width bucket U, [A, INBOX + U]: slot, kv, u0, real, F, cap, then the first
      forward's uncached tokens.
      per_round: one buffer that dlen, row_forwards, guess_tokens, guess_hits, last_take
      ([A] each) and drafts are views of, so that a round's start zeroes them in one launch;
      each view 16-byte aligned.
      no_guesses [A, 0, L] / no_gvalid [A, 0] bool: the empty guesses of forwards without
      guesses (G = 0), made once rather than per forward.
    """

    A: int
    slots: torch.Tensor
    kv: torch.Tensor
    real: torch.Tensor
    cap: torch.Tensor
    active: torch.Tensor
    drafts: torch.Tensor
    dlen: torch.Tensor
    row_forwards: torch.Tensor
    guess_tokens: torch.Tensor
    guess_hits: torch.Tensor
    last_take: torch.Tensor
    prod: torch.Tensor
    by_rule: torch.Tensor
    next_unc: torch.Tensor
    next_u: torch.Tensor
    outbox: torch.Tensor
    limit: torch.Tensor
    per_round: torch.Tensor
    no_guesses: torch.Tensor
    no_gvalid: torch.Tensor
    inbox: dict[int, torch.Tensor] = field(default_factory=dict)
    staging: dict[int, torch.Tensor] = field(default_factory=dict)  # host side of each inbox
    graphs: dict[str, object] = field(default_factory=dict)

    @classmethod
    def empty(cls, A: int, L: int, Dw: int, width: int, device) -> RoundState:
        """Zeroed state of A rows: Dw draft columns (the last a write sink), outbox columns
        `width`, phrases of L tokens."""
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        # Each view starts 16 bytes into the buffer times a whole number (an even element
        # offset): Triton specialises a kernel on its pointers' 16-byte alignment, so with odd A
        # unpadded views would compile the round's kernels once more per parity of A.
        Ap = A + A % 2
        per_round = z(5 * Ap + A * Dw)
        dlen, row_forwards, guess_tokens, guess_hits, last_take = per_round[:5 * Ap].view(5, Ap)[:, :A]
        return cls(A=A, slots=z(A), kv=z(A), real=z(A, dtype=torch.bool), cap=z(A),
                   active=z(A, dtype=torch.bool),
                   drafts=per_round[5 * Ap:].view(A, Dw), dlen=dlen, row_forwards=row_forwards,
                   guess_tokens=guess_tokens, guess_hits=guess_hits, last_take=last_take,
                   prod=z(A, dtype=torch.float32), by_rule=z(A, dtype=torch.bool),
                   next_unc=z(A, L + 1), next_u=torch.ones(A, dtype=torch.long, device=device),
                   outbox=z(A, width), limit=z(()), per_round=per_round,
                   no_guesses=z(A, 0, L), no_gvalid=z(A, 0, dtype=torch.bool))

    def same(self, other: RoundState) -> bool:
        """Whether every state tensor of the two equals (inboxes, staging and graphs aside)."""
        return all(torch.equal(getattr(self, f), getattr(other, f)) for f in self.tensor_fields())

    @classmethod
    def tensor_fields(cls) -> list[str]:
        """The state's tensor fields (not A, the inboxes, staging or graphs)."""
        return [f.name for f in fields(cls) if f.type in ("torch.Tensor", torch.Tensor)]


@dataclass
class DeviceRoundOutput:
    """Host arrays of one device round (shapes as RoundOutput's, B real rows)."""

    drafts: np.ndarray  # [B, D]
    draft_lens: np.ndarray  # [B]
    row_forwards: np.ndarray  # [B]
    guess_tokens: np.ndarray  # [B]
    guess_hits: np.ndarray  # [B]
    stopped_by_rule: np.ndarray  # [B] bool
    committed: np.ndarray  # [B] draft tokens whose KV the round committed (all but the last take)
    unfinished: np.ndarray  # [B] bool: still drafting when the F forwards ran out
    suffixes: np.ndarray  # [B, K, L]
    suffix_valid: np.ndarray  # [B, K] bool
    forwards: int  # batched forwards run (F, or with early exit the most any row ran)


class DeviceRound:
    """Runs a round's drafting loop for a DraftRuntime on the device (see the module docstring).

    graphs: capture each bucket's functions in CUDA graphs (CUDA only) and replay them.
    emulate_graphs: with graphs, stand-ins that record at capture and run at replay
    (`RecordedGraph`), so the capture/replay bookkeeping is tested on a CPU.
    early_exit: with graphs, the forwards after the first in conditional nodes (module
    docstring); None: wherever this torch and CUDA have them (`conditional_nodes_supported`),
    and under emulation.
    padded_steps: every forward after the first carries L + 1 uncached columns even without
    guesses (the shape before `step_width`; scripts/bench_gpu.py times it beside).
    """

    def __init__(self, runtime, graphs: bool = False, emulate_graphs: bool = False,
                 early_exit: bool | None = None, padded_steps: bool = False):
        self.rt = runtime
        self.padded_steps = padded_steps
        self.graphs = graphs
        self.emulate = emulate_graphs
        if graphs and runtime.device.type != "cuda" and not emulate_graphs:
            raise ValueError("CUDA graphs need a CUDA device; the draft runs on "
                             f"{runtime.device.type}")
        if early_exit is None:
            early_exit = graphs and (emulate_graphs or conditional_nodes_supported())
        elif early_exit and not graphs:
            raise ValueError("early_exit needs graphs (a host loop exits early by reading the device)")
        elif early_exit and not emulate_graphs and not conditional_nodes_supported():
            raise ValueError("early_exit needs CUDA graph conditional nodes (CUDA >= 12.4 and a "
                             f"torch with CUDAGraph.begin_capture_to_if_node); torch {torch.__version__}, "
                             f"CUDA {torch.version.cuda}")
        self.early_exit = bool(early_exit)
        s = runtime.s
        self.adaptive = runtime.head is not None
        # Draft columns a row may fill; the host loop's bound (fixed: gamma + beta).
        self.max_draft = s.max_draft_length if self.adaptive else s.gamma + s.beta
        self.K = s.num_suffixes
        # The work around each forward: kernels/round_steps.py's host functions, or None (torch);
        # kernel_reason: why "auto" kept torch on a CUDA device (the kernels' check failed).
        self.kernel_reason: str | None = None
        self._prepare, self._commit = self._pick_kernels(s.round_kernels)
        self._states: dict[int, RoundState] = {}
        # The cache generation the states (and graphs) were built for, the cache tokens a
        # captured forward reads per row and the captures' memory pool (never run concurrently).
        self.bounds = GraphBounds(runtime)
        self._recent: list[int] = []  # forwards the last rounds needed

    def drop_graphs(self) -> None:
        """Forget every batch bucket's state and graphs (built and captured again on use)."""
        self._states.clear()
        self.bounds.forget_pool()

    @property
    def kernels(self) -> str:
        """How the work around each forward runs: "triton" (kernels/round_steps.py) or "torch"."""
        return "torch" if self._prepare is None else "triton"

    def _pick_kernels(self, kernels: str):
        """(prepare, commit) of kernels/round_steps.py where they are to run, else (None, None).
        The adaptive rule stays in torch (commit None)."""
        if kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"round_kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        from vllm_ouroboros.kernels.triton_runtime import choose_kernels

        dev = self.rt.device
        why = choose_kernels(kernels, dev, "round_steps", "commit_kernel", "the drafting round's round_kernels")
        if why:
            logger.warning("ouroboros: the drafting round's bookkeeping runs in torch on %s: %s", dev, why)
            self.kernel_reason = why
        if why is not None:
            return None, None
        from vllm_ouroboros.kernels import round_steps

        return round_steps.prepare, None if self.adaptive else round_steps.commit

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def step_width(self) -> int:
        """Uncached columns of every forward after the first: the most tokens one forward
        drafts. That is t1 and a guess's right tokens (L + 1) with guesses; without them every
        forward drafts t1 alone, and the L columns more would be padding the draft computes
        (on an H200 the real draft's forward costs 1.152 ms at 1 token, 1.203 ms at 4)."""
        return self.rt.L + 1 if self.rt.G or self.padded_steps else 1

    @property
    def max_forwards(self) -> int:
        """Forwards that always suffice: each forward drafts >= 1 token per active row."""
        s = self.rt.s
        return min(s.max_draft_forwards, s.max_draft_length if self.adaptive else s.gamma)

    def width_bucket(self, u: int) -> int:
        """Padded width of a first forward with u uncached tokens (u <= the prefill threshold + 1)."""
        top = self.rt.prefill_threshold + 1
        return min(max(1 << max(u - 1, 0).bit_length(), 2), top) if u <= top else u

    def forwards_for_next_round(self) -> int:
        """F for the next round: with early exit the bound (the round stops where its rows are
        done); else what the last 8 rounds needed (a round cut short by F counts F + 1, so F
        grows back), at most `max_forwards`."""
        if self.early_exit or not self._recent:
            return self.max_forwards
        return max(1, min(self.max_forwards, max(self._recent)))

    # ---- state -------------------------------------------------------------------------------
    def _state(self, A: int) -> RoundState:
        rt = self.rt
        if self.bounds.stale():  # the cache or the window was reallocated: states hold addresses
            self.drop_graphs()
        st = self._states.get(A)
        if st is None:
            L, K = rt.L, self.K
            st = self._states[A] = RoundState.empty(A, L, self.max_draft + L + 2,
                                                    self.max_draft + 7 + K * L + K, rt.device)
        return st

    def _inbox(self, st: RoundState, U: int) -> torch.Tensor:
        box = st.inbox.get(U)
        if box is None:
            box = st.inbox[U] = torch.zeros(st.A, INBOX + U, dtype=torch.long, device=self.rt.device)
            box[:, 0] = self.rt.pad_slot  # a neutral round: padding rows only
            box[:, 2] = 1
            box[:, 5] = self.max_draft
        return box

    # ---- the round ---------------------------------------------------------------------------
    def run(self, slots: np.ndarray, unc0: np.ndarray, u0: np.ndarray, kv0: np.ndarray,
            forwards: int | None = None, max_tokens: int | np.ndarray | None = None) -> DeviceRoundOutput:
        """Draft for B requests whose slots were rolled back and prefilled.

        Shape: slots [B] int64 (distinct); unc0 [B, U] int64, the uncached context tokens
        (first u0[b] real); u0 [B] int64 >= 1; kv0 [B] int64, committed cache lengths.
        forwards: F (default `forwards_for_next_round()`), at most `max_forwards`.
        max_tokens: the most draft tokens each row takes (an int, or [B] int64; None: no cut):
        a cut row stops there, its last forward taking no token past it, as the host loop's;
        the round runs at most max(max_tokens) forwards.
        """
        rt = self.rt
        B = len(slots)
        F = self.forwards_for_next_round() if forwards is None else max(1, min(forwards, self.max_forwards))
        cut_bound = False
        if max_tokens is not None:
            # Every forward gives each drafting row a token at least: rows cut to c tokens are
            # done after c forwards, and the rest of a fixed-F round would run with none active.
            cut = int(np.max(np.clip(max_tokens, 1, self.max_draft)))
            cut_bound, F = cut < F, min(F, cut)
        A = bucket(B, BATCH_BUCKETS)
        U = self.width_bucket(int(u0.max()))
        st = self._state(A)
        self._layouts(U)
        if self.graphs:  # before the inputs go in: a capture runs on a neutral inbox
            need = int(kv0.max()) + U + (self.max_forwards - 1) * self.step_width
            if self.bounds.stale(need):  # longer contexts than the graphs read: capture again
                self.drop_graphs()
                st = self._state(A)
            self._ensure_captured(st, U)
        # One host->device copy, from a pinned buffer on CUDA (asynchronous: no wait on queued
        # work). Reusing the buffer is safe: the last round's output read waited for its copy.
        host = st.staging.get(U)
        if host is None:
            host = st.staging[U] = torch.zeros(A, INBOX + U, dtype=torch.long,
                                               pin_memory=rt.device.type == "cuda")
        box = host.numpy()
        box[:] = 0
        box[:, 0], box[:, 2], box[:, 4], box[:, 5] = rt.pad_slot, 1, F, self.max_draft
        box[:B, 0], box[:B, 1], box[:B, 2], box[:B, 3] = slots, kv0, u0, 1
        if max_tokens is not None:
            box[:B, 5] = np.clip(max_tokens, 1, self.max_draft)
        box[:B, INBOX:INBOX + min(unc0.shape[1], U)] = unc0[:, :U]
        self._inbox(st, U).copy_(host, non_blocking=True)
        # Cache columns a forward may read, for the dense-mask path (a bound: any is correct).
        bound = int(kv0.max()) + U + (F - 1) * self.step_width
        if self.graphs:
            self._replay(st, U, F)
        else:
            self._start(st, U, bound)
            for _ in range(F - 1):
                self._step(st, bound)
            self._finish(st)
        out = st.outbox[:B].cpu().numpy()  # the round's one device->host copy
        D, L, K = self.max_draft, rt.L, self.K
        c = D
        dlen, rf, gt, gh, rule, last, act = (out[:, c + i] for i in range(7))
        c += 7
        sfx = out[:, c:c + K * L].reshape(B, K, L)
        valid = out[:, c + K * L:c + K * L + K].astype(bool)
        if not self.early_exit and not cut_bound:
            # What whole rounds need (forwards_for_next_round reads it only without early exit);
            # a round the cut shortened says what the cut needed, not what the rows would.
            needed = F + 1 if act.any() else int(rf.max(initial=1))
            self._recent = (self._recent + [needed])[-8:]
        # A forward ran iff some row was drafting, and every such row counts it.
        ran = int(rf.max(initial=1)) if self.graphs and self.early_exit else F
        return DeviceRoundOutput(out[:, :D], dlen, rf, gt, gh, rule.astype(bool), dlen - last,
                                 act.astype(bool), sfx, valid, ran)

    def _layouts(self, U: int) -> None:
        """Build (once) the masks the round's forwards use, outside the functions a graph
        captures: a layout is made on the host and copied in, which a capture cannot hold."""
        self.rt.layout(U, self.rt.G)
        self.rt.layout(self.step_width, self.rt.G)

    # ---- the three functions (run eagerly or captured) -----------------------------------------
    def _start(self, st: RoundState, U: int, bound: int) -> None:
        box = self._inbox(st, U)
        st.slots.copy_(box[:, 0])
        st.kv.copy_(box[:, 1])
        st.real.copy_(box[:, 3] > 0)
        st.limit.copy_(box[0, 4])
        st.cap.copy_(box[:, 5])
        st.active.copy_(st.real)
        st.per_round.zero_()  # drafts, dlen, row_forwards, guess_tokens, guess_hits, last_take
        st.prod.fill_(1.0)
        st.by_rule.zero_()
        self._forward(st, box[:, INBOX:], box[:, 2], U, bound)

    def _step(self, st: RoundState, bound: int) -> None:
        self._forward(st, st.next_unc, st.next_u, self.step_width, bound)

    def _rest(self, st: RoundState, bound: int, when) -> None:
        """The round after its first forward, with early exit: forward k + 1 runs when some row
        is drafting and k < F; then `_finish`. when(pred, fn): run fn where the 0-dim bool
        tensor pred holds (a conditional node when captured, the host's `if` when emulated)."""
        for k in range(1, self.max_forwards):
            when(st.active.any() & (st.limit > k), lambda: self._step(st, bound))
        self._finish(st)

    def _finish(self, st: RoundState) -> None:
        rt, A, L, K = self.rt, st.A, self.rt.L, self.K
        rows = torch.arange(A, device=rt.device)
        parts = [st.drafts[:, :self.max_draft], st.dlen[:, None], st.row_forwards[:, None],
                 st.guess_tokens[:, None], st.guess_hits[:, None], st.by_rule.long()[:, None],
                 st.last_take[:, None], st.active.long()[:, None]]
        if K:
            # The suffixes hang off the draft's last token (every row drafts >= 1 token).
            last = st.drafts[rows, (st.dlen - 1).clamp(min=0)]
            phr, valid = rt.pool.lookup(last, st.slots, K, rows=st.real)
            parts += [phr.reshape(A, K * L), valid.long()]
        torch.cat(parts, dim=1, out=st.outbox)

    def _forward(self, st: RoundState, unc: torch.Tensor, u: torch.Tensor, U: int, bound: int) -> None:
        """One lookahead forward for every row of the bucket; inactive rows change nothing.
        Same arithmetic as DraftRuntime._lookahead_forward, on device tensors. The work around
        the model runs in torch (`fed_tokens_torch`, `row_inputs`, `commit_torch`) or, where the
        round took them, in two kernels (kernels/round_steps.py).

        Shape: unc [A, U] int64 (first u[b] real), u [A] int64 >= 1."""
        rt, A, L, G = self.rt, st.A, self.rt.L, self.rt.G
        dev = rt.device
        act, slots, kv = st.active, st.slots, st.kv
        if G:
            key = unc.gather(1, (u - 1)[:, None])[:, 0]
            guesses, gvalid = rt.pool.lookup(key, slots, G, rows=act)
        else:
            guesses, gvalid = st.no_guesses, st.no_gvalid
        layout = rt.layout(U, G)
        model = rt.model
        max_cache_len = min(bound, model.max_len - layout.Q)
        if self._prepare is not None and layout.static_bits is not None:
            ids, positions, write_index, tree_mask, lens, query_start, block_rows, out_rows = self._prepare(
                layout, unc, u, kv, slots, rt.window, guesses, model.kv.block_table, model.kv.page_size)
            meta = DraftAttentionMetadata.prepared(kv, write_index, model.kv.page_size,
                                                   max_cache_len + layout.Q,
                                                   (block_rows, lens, query_start, tree_mask),
                                                   model.uses_attention_kernel(layout.Q))
            hidden = model.forward(ids, positions, slots, kv, None, max_cache_len=max_cache_len, meta=meta)
            head_in = hidden.reshape(A * layout.Q, -1).index_select(0, out_rows.view(-1))
            tokens = model.greedy_tokens(head_in).view(out_rows.shape)
        else:
            ids = fed_tokens_torch(layout, unc, slots, rt.window, guesses)
            mask, positions = row_inputs(layout, u, kv)
            hidden = model.forward(ids, positions, slots, kv, mask, max_cache_len=max_cache_len)
            tokens = model.greedy_tokens(output_rows(hidden, u, U))
        if self.adaptive:
            def adapt(res):
                p = rt.head(rt._token_hidden(hidden, res, u, layout, guesses, gvalid))
                valid = torch.arange(L + 1, device=dev)[None, :] < res.num_new[:, None]
                return stop_rule(p, valid, st.prod, rt.s.acceptance_threshold)

            rows = commit_torch(st, layout, ids, tokens, guesses, gvalid, u, rt.window, self.max_draft,
                                self.max_draft, adapt)
        elif self._commit is not None:
            rows = self._commit(st, layout, ids, tokens, gvalid, u, rt.window, self.max_draft, rt.s.gamma)
        else:
            rows = commit_torch(st, layout, ids, tokens, guesses, gvalid, u, rt.window, self.max_draft,
                                rt.s.gamma)
        if rows is not None:  # the window's fresh phrases
            keys, phrases, owners, valid = rows
            rt.pool.insert(keys, phrases, owners, valid=valid)

    # ---- CUDA graphs -------------------------------------------------------------------------
    def _graph_names(self, widths) -> list[str]:
        """The graphs of one batch bucket: a first forward per width, then the rest of the round
        in one graph (early exit) or a step replayed F - 1 times and the finish."""
        return [f"start{U}" for U in widths] + (["rest"] if self.early_exit else ["step", "finish"])

    def _ensure_captured(self, st: RoundState, U: int) -> int:
        """Capture what one bucket's rounds of first width U replay; returns how many."""
        n = 0
        for name in self._graph_names([U]):
            if name not in st.graphs:
                n += self._capture_or_fall_back(st, name, U)
        return n

    def _capture_or_fall_back(self, st: RoundState, name: str, U: int) -> int:
        """One capture; where a conditional node's capture fails (a driver without them, a
        torch that refuses them), the rounds go on without early exit."""
        if name != "rest":
            self._capture(st, name, U)
            return 1
        try:
            self._capture(st, name, U)
            return 1
        except Exception as e:  # noqa: BLE001 - any failure leaves the fixed-F graphs, which work
            if self.rt.device.type == "cuda":
                with contextlib.suppress(Exception):  # what the failed capture queued, if anything
                    torch.cuda.synchronize(self.rt.device)
            self.early_exit = False
            logger.warning("ouroboros: capturing the drafting round's conditional nodes failed "
                           "(%s: %s); its rounds run a fixed number of forwards instead",
                           type(e).__name__, e)
            return sum(self._capture_or_fall_back(st, n, 0) for n in ("step", "finish"))

    def _replay(self, st: RoundState, U: int, F: int) -> None:
        st.graphs[f"start{U}"].replay()
        if self.early_exit:  # F went in with the inbox
            st.graphs["rest"].replay()
            return
        for _ in range(F - 1):
            st.graphs["step"].replay()
        st.graphs["finish"].replay()

    def capture(self, batch_sizes, widths=None) -> int:
        """Capture the graphs of these batch buckets (and first-forward widths, default all)
        ahead of time, e.g. while the engine loads; returns how many were captured."""
        top = self.rt.prefill_threshold + 1
        widths = widths or sorted({self.width_bucket(u) for u in range(1, top + 1)})
        n = 0
        for A in sorted({bucket(b, BATCH_BUCKETS) for b in batch_sizes}):
            st = self._state(A)
            for U in widths:
                n += self._ensure_captured(st, U)
        return n

    def _capture(self, st: RoundState, name: str, U: int) -> None:
        """Capture one function on the bucket's state. The warm-up run (cuBLAS handles, Triton
        compilation) and the capture both see a neutral state: padding rows, none active, so
        the real pool, windows and caches are untouched."""
        rt = self.rt
        self._layouts(U if name.startswith("start") else self.step_width)
        # A neutral state: every row padding, inactive.
        st.slots.fill_(rt.pad_slot)
        st.kv.zero_()
        st.real.zero_()
        st.active.zero_()
        st.next_u.fill_(1)
        bound = self.bounds.graph_len  # graphs cannot depend on the round: a bound for every round
        if name.startswith("start"):
            box = self._inbox(st, U)
            box[:, 0], box[:, 2], box[:, 3] = rt.pad_slot, 1, 0

        def fn(when=_always):
            if name == "step":
                self._step(st, bound)
            elif name == "finish":
                self._finish(st)
            elif name == "rest":
                self._rest(st, bound, when)
            else:
                self._start(st, U, bound)

        if self.emulate:
            fn()  # the warm-up (every conditional step runs); the "capture" only records
            st.graphs[name] = RecordedGraph(lambda: fn(_host_if))
            return

        def run(graph):  # the warm-up (graph None) runs every step: nothing is first used in a capture
            if graph is None:
                return fn()

            def if_node(pred, body):
                graph.begin_capture_to_if_node(pred)
                try:
                    body()
                finally:
                    graph.end_capture_to_conditional_node()

            fn(if_node)

        st.graphs[name] = capture_graph(run, rt.device, self.bounds.pool(), inference=True)


def fed_tokens_torch(layout, unc: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                     guesses: torch.Tensor) -> torch.Tensor:
    """A forward's token ids [A, Q]: [uncached | window (levels x columns) | guesses].

    Shape: unc [A, >= U] int64 (first U columns fed); slots [A] int64; window [S, L, WA] int64
    (the runtime's windows: columns [0, W) fed); guesses [A, G, L] int64."""
    A, U, W = unc.shape[0], layout.U, layout.W
    parts = [unc[:, :U]]
    if W:
        parts.append(window[slots][:, :, :W].reshape(A, -1))
    if layout.G:
        parts.append(guesses.reshape(A, -1))
    return torch.cat(parts, dim=1)


def forward_inputs_torch(layout, unc: torch.Tensor, u: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                         window: torch.Tensor, guesses: torch.Tensor, block_table: torch.Tensor,
                         page_size: int) -> tuple[torch.Tensor, ...]:
    """The torch reference of kernels/round_steps.prepare (same arguments, same outputs): the
    token ids, positions and write indices [A, Q] int64, the tree-attention kernel's bitmasks
    [A * Q] int64, prefix lengths [A] int32, query starts [A + 1] int32 and block rows [A, MP]
    int32, as the round's torch path and build_attention_metadata make them (Q <= 64), and
    the LM head's rows [A, 1 + Q - U] int64 (lookahead.output_index)."""
    ids = fed_tokens_torch(layout, unc, slots, window, guesses)
    mask, positions = row_inputs(layout, u, kv)
    meta = build_attention_metadata(slots, kv, mask, block_table, page_size, max_cache_len=0, backend="torch")
    block_rows, lens, query_start, tree_mask = meta.kernel_inputs
    return (ids, positions, meta.write_index, tree_mask, lens, query_start, block_rows,
            output_index(u, layout.Q, layout.U))


def commit_torch(st: RoundState, layout, ids: torch.Tensor, tokens: torch.Tensor,
                 guesses: torch.Tensor, gvalid: torch.Tensor, u: torch.Tensor, window: torch.Tensor,
                 max_draft: int, goal: int, adapt=None):
    """Read one forward's greedy tokens into the round: each active row takes its new tokens
    (at most max_draft in all) into its draft columns, slides its window, advances its cache
    length by the u tokens the forward committed and its counters, and sets the next forward's
    inputs; a row stops once it holds min(goal, its st.cap) tokens (or its adaptive rule fired)
    and takes none past min(max_draft, st.cap). Inactive rows change nothing. The reference of
    kernels/round_steps.commit.

    Shape: ids [A, Q] int64 (the fed tokens); tokens [A, 1 + Q - U] int64 (the draft's tokens
    after column u - 1, then after each window and guess column: lookahead.output_rows);
    guesses [A, G, L] int64, gvalid [A, G] bool; u [A] int64; window [S, L, WA] int64 (updated
    in place).
    adapt: None, or res (lookahead.LookaheadResult) -> (take cap [A], fired [A] bool, product
    after [A] float32), the acceptance head's rule (acceptance_head.stop_rule).
    Returns the pool insert's rows (keys [A * W], phrases [A * W, L], owners [A * W], which
    count [A * W] bool), or None without a window.
    """
    A, U, W, L = ids.shape[0], layout.U, layout.W, layout.L
    dev = ids.device
    act, slots, kv = st.active, st.slots, st.kv
    fed_window = ids[:, U:U + W * L].reshape(A, L, W)
    res = read_output(layout, output_tokens(tokens, u, layout.Q, U), u, fed_window, guesses, gvalid)
    num = res.num_new
    cap = st.cap.clamp(max=max_draft)
    room = (cap - st.dlen).clamp(min=0)  # a row set at or past its cut (tests) takes none
    if adapt is not None:
        rule_take, fired, after = adapt(res)
        num = torch.minimum(num, rule_take)
        st.by_rule.logical_or_(act & fired & (rule_take <= room))
        st.prod.copy_(torch.where(act, after, st.prod))
    take = torch.where(act, torch.minimum(num, room), 0)
    cols = st.dlen[:, None] + torch.arange(L + 1, device=dev)[None, :]
    ok = torch.arange(L + 1, device=dev)[None, :] < take[:, None]
    sink = st.drafts.shape[1] - 1
    st.drafts.scatter_(1, torch.where(ok, cols, sink), torch.where(ok, res.new_tokens, 0))
    rows = None
    if W:
        window[slots, :, :W] = torch.where(act[:, None, None], res.next_window, fed_window)
        rows = (res.phrase_keys.reshape(-1), res.phrases.reshape(-1, L), slots.repeat_interleave(W),
                act.repeat_interleave(W))
    st.kv.copy_(torch.where(act, kv + u, kv))
    st.dlen.add_(take)
    st.row_forwards.add_(act.long())
    st.guess_tokens.add_(torch.where(act, take - 1, 0))
    st.guess_hits.add_((act & (take > 1)).long())
    st.last_take.copy_(torch.where(act, take, st.last_take))
    st.next_unc.copy_(res.new_tokens)
    st.next_u.copy_(torch.where(act, take, 1))
    going = st.dlen < cap.clamp(max=goal)
    if adapt is not None:
        going &= ~st.by_rule
    st.active.logical_and_(going)
    return rows


def initial_graph_len(runtime) -> int:
    """Cache tokens per row a graph-captured draft forward reads at first (a bound fixed at
    capture: the split-KV grid's size, and every gathered column on the torch path): the pages
    of a slot at load, doubled (and the graphs captured again) where a forward needs more, as
    the dense cache's length once was: far below max_model_len, where most forwards are."""
    kv = runtime.kv
    per_slot = (kv.num_pages - 1) * kv.page_size // max(kv.num_seqs - 1, 1)
    return min(runtime.model.max_len, max(per_slot, 256))


class GraphBounds:
    """What a set of the draft's captured graphs was captured for, kept alike by the drafting
    round's (DeviceRound) and the prefill's (prefill_graph.PrefillGraphs): the runtime's cache
    generation (a reallocated cache or window moves the addresses a graph holds), the cache
    tokens per row a captured forward reads (graph_len: initial_graph_len, doubled where a
    forward needs more) and the memory pool of the captures."""

    def __init__(self, runtime):
        self.rt = runtime
        self.graph_len = initial_graph_len(runtime)
        self.generation: int | None = None  # runtime.generation of the graphs; None: none yet
        self._pool = None

    def stale(self, need: int = 0) -> bool:
        """Whether the owner must drop every graph (and the state they hold): the cache moved,
        or a forward reads `need` cache tokens per row, past graph_len (which is then doubled,
        at most the cache's length). The pool goes with them: torch's allocator refuses a
        capture into a pool whose graphs were all freed (an internal assert in capture_begin,
        seen on an H200 with torch 2.11), so the next captures take a new one."""
        rt = self.rt
        grow = need > self.graph_len
        if grow:
            self.graph_len = min(max(2 * self.graph_len, need), rt.model.max_len)
        if not grow and self.generation == rt.generation:
            return False
        self.generation = rt.generation
        self.forget_pool()
        return True

    def forget_pool(self) -> None:
        """The owner dropped all its graphs: the next captures take a new pool (see stale)."""
        self._pool = None

    def pool(self):
        """The CUDA graph memory pool of the current captures (taken at the first)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool


def conditional_nodes_supported() -> bool:
    """Whether this process can capture CUDA graph conditional nodes: a CUDA device, a CUDA
    >= 12.4 build of torch and its CUDAGraph.begin_capture_to_if_node."""
    if not torch.cuda.is_available() or not torch.version.cuda:
        return False
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    return (major, minor) >= (12, 4) and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def _always(pred, fn) -> None:
    """`when` of a warm-up: every step runs (on a neutral state each changes nothing)."""
    fn()


def _host_if(pred, fn) -> None:
    """`when` of an emulated graph: the host reads the condition a conditional node would."""
    if bool(pred):
        fn()


class RecordedGraph:
    """A CUDA graph's stand-in where there is no CUDA (tests): the capture records the function
    without running it, as a capture does; replay runs it on whatever the static tensors hold."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()
