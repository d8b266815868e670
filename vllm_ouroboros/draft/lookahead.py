"""Layout of one lookahead draft forward, and how to read its output.

One forward carries, per request row, three groups of tokens (Q = U + W*L + G*L columns):

    [ uncached (U) | Jacobi window (L levels x W columns) | guesses (G phrases x L) ]

* uncached: context tokens whose KV the draft cache does not hold yet (1..U real, rest padding),
  causal. The last real one is the current token x_p at position p; its output is the draft's
  next token t1.
* window: token (l, c) sits at position p + 1 + c + l and sees the prefix, level-0 tokens of
  columns < c and its own column's levels <= l, so column c is a contiguous trajectory
  w[0][c], w[1][c], ... (Lookahead Decoding's layout). Its outputs o[l][c] become the next
  window (each column slides one token), and [w[0][c] -> o[0][c], ..., o[L-1][c]] is a fresh
  phrase for the pool.
* guesses: pool phrase g (L tokens that once followed x_p) sits at p + 1 .. p + L, causal within
  itself. Token k of g is right iff it equals the draft's own prediction at its place, so the
  longest right prefix plus the draft's token after it is exactly the draft's greedy
  continuation, up to L + 1 = beta tokens for one forward.

L = beta - 1. Everything here is shape arithmetic on tensors; no vLLM, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ouroboros.draft.attention import MAX_KERNEL_QUERIES, ancestor_bits


@dataclass
class LookaheadLayout:
    """Static part of the layout for given (U, W, L, G). Built once per distinct U.

    Fields (Q = U + W*L + G*L):
      static_mask:  [Q, Q] bool, the mask assuming all U uncached tokens are real.
      pos_offset:   [Q] int64, position relative to the last real uncached token for the window
                    and guess columns (>= 1); for uncached columns the offset from the first one.
      static_bits:  [Q] int64, row j of static_mask as bits (bit j' = static_mask[j, j']), the
                    tree-attention kernel's form (kernels/round_steps.py); None past 64 columns.
    """

    U: int
    W: int
    L: int
    G: int
    static_mask: torch.Tensor
    pos_offset: torch.Tensor
    static_bits: torch.Tensor | None = None

    @property
    def Q(self) -> int:
        return self.U + self.W * self.L + self.G * self.L

    @property
    def win_start(self) -> int:
        return self.U

    @property
    def guess_start(self) -> int:
        return self.U + self.W * self.L


def build_layout(U: int, W: int, L: int, G: int, device: torch.device | str = "cpu") -> LookaheadLayout:
    """Mask and position offsets for a forward with U uncached, a W x L window and G guesses."""
    WL, GL = W * L, G * L
    Q = U + WL + GL
    mask = torch.zeros(Q, Q, dtype=torch.bool)
    mask[:U, :U] = torch.ones(U, U, dtype=torch.bool).tril()
    # Window and guesses see every uncached token (padding is removed per row later).
    mask[U:, :U] = True
    offset = torch.zeros(Q, dtype=torch.long)
    offset[:U] = torch.arange(U)
    if WL:
        lvl = torch.arange(L).repeat_interleave(W)  # window index i = l * W + c
        col = torch.arange(W).repeat(L)
        same_col_below = (col[:, None] == col[None, :]) & (lvl[None, :] <= lvl[:, None])
        level0_left = (lvl[None, :] == 0) & (col[None, :] < col[:, None])
        mask[U:U + WL, U:U + WL] = same_col_below | level0_left
        offset[U:U + WL] = 1 + col + lvl
    if GL:
        gid = torch.arange(G).repeat_interleave(L)
        gpos = torch.arange(L).repeat(G)
        mask[U + WL:, U + WL:] = (gid[:, None] == gid[None, :]) & (gpos[None, :] <= gpos[:, None])
        offset[U + WL:] = 1 + gpos
    bits = ancestor_bits(mask).to(device) if Q <= MAX_KERNEL_QUERIES else None
    return LookaheadLayout(U, W, L, G, mask.to(device), offset.to(device), bits)


def row_inputs(layout: LookaheadLayout, num_uncached: torch.Tensor, cache_lens: torch.Tensor):
    """Per-row mask and positions.

    Shape:
      num_uncached: [B] int64, real uncached tokens per row (1..U); the rest of U is padding.
      cache_lens:   [B] int64, committed draft-cache length per row (position of uncached[0]).
    Returns (mask [B, Q, Q] bool, positions [B, Q] int64).
    Padding uncached columns are hidden from everyone and see only themselves.
    """
    U, Q = layout.U, layout.Q
    dev = layout.static_mask.device
    col = torch.arange(Q, device=dev)
    is_pad = (col[None, :] < U) & (col[None, :] >= num_uncached[:, None])  # [B, Q]
    real = ~is_pad[:, None, :] & ~is_pad[:, :, None]
    mask = layout.static_mask[None].expand(num_uncached.shape[0], Q, Q) & real
    eye = torch.eye(Q, dtype=torch.bool, device=dev)[None]
    mask = mask | (eye & is_pad[:, :, None])
    last = cache_lens + num_uncached - 1  # position p of the current token
    positions = torch.where(col[None, :] < U, cache_lens[:, None] + layout.pos_offset[None, :],
                            last[:, None] + layout.pos_offset[None, :])
    return mask, positions


def output_rows(hidden: torch.Tensor, num_uncached: torch.Tensor, U: int) -> torch.Tensor:
    """The hidden states whose next token a forward reads, for one LM-head product: the last
    real uncached column's, then every window and guess column's. Uncached tokens whose next
    token is already known skip the LM head, a large part of a small model's forward; one
    product instead of two reads its weight once.

    Shape: hidden [A, Q, H]; num_uncached [A] int64 -> [A, 1 + Q - U, H]."""
    A, Q, H = hidden.shape
    index = output_index(num_uncached, Q, U)
    return hidden.reshape(A * Q, H).index_select(0, index.view(-1)).view(A, 1 + Q - U, H)


def output_index(num_uncached: torch.Tensor, Q: int, U: int) -> torch.Tensor:
    """The rows `output_rows` reads, as flat row indices of hidden.reshape(A * Q, H): column
    u - 1 of each row, then its columns U..Q-1 (kernels/round_steps.prepare writes the same
    for the prepared forward, which gathers them itself).

    Shape: num_uncached [A] int64 -> [A, 1 + Q - U] int64."""
    A, dev = num_uncached.shape[0], num_uncached.device
    cols = torch.arange(U - 1, Q, device=dev).expand(A, 1 + Q - U)
    cols = torch.cat([(num_uncached - 1)[:, None], cols[:, 1:]], dim=1)
    return cols + Q * torch.arange(A, device=dev)[:, None]


def output_tokens(tokens: torch.Tensor, num_uncached: torch.Tensor, Q: int, U: int) -> torch.Tensor:
    """`read_output`'s out [A, Q] int64 from the tokens of `output_rows` ([A, 1 + Q - U]):
    token 0 at column u - 1, the rest at columns U.., 0 at the other uncached columns."""
    A = tokens.shape[0]
    out = torch.zeros(A, Q, dtype=torch.long, device=tokens.device)
    out[torch.arange(A, device=tokens.device), num_uncached - 1] = tokens[:, 0]
    out[:, U:] = tokens[:, 1:]
    return out


@dataclass
class LookaheadResult:
    """What one lookahead forward yields per row.

    Fields:
      new_tokens:  [B, L + 1] int64, the draft's greedy continuation; the first num_new are real.
      num_new:     [B] int64 in 1..L+1.
      guess_hit:   [B] int64, tokens taken from the best guess (num_new - 1).
      next_window: [B, L, W] int64, the window for the next forward.
      phrase_keys: [B, W] int64 and phrases [B, W, L] int64: Jacobi phrases for the pool.
    """

    new_tokens: torch.Tensor
    num_new: torch.Tensor
    guess_hit: torch.Tensor
    next_window: torch.Tensor
    phrase_keys: torch.Tensor
    phrases: torch.Tensor


def read_output(layout: LookaheadLayout, out: torch.Tensor, num_uncached: torch.Tensor,
                window: torch.Tensor, guesses: torch.Tensor, guess_valid: torch.Tensor) -> LookaheadResult:
    """Turn the draft's greedy tokens of one forward into tokens, next window and phrases.

    Shape:
      out:          [B, Q] int64, argmax at every input column.
      num_uncached: [B] int64.
      window:       [B, L, W] int64, the window that was fed.
      guesses:      [B, G, L] int64, the guesses that were fed; guess_valid [B, G] bool.
    """
    B = out.shape[0]
    L, W, G = layout.L, layout.W, layout.G
    t1 = out.gather(1, (num_uncached - 1)[:, None])  # [B, 1]
    if G:
        gout = out[:, layout.guess_start:].reshape(B, G, L)
        # Guess token k is right iff it equals the draft's prediction at its place:
        # t1 for k = 0, the output after guess token k-1 otherwise.
        pred = torch.cat([t1[:, None, :].expand(B, G, 1), gout[:, :, :-1]], dim=2)
        right = (guesses == pred) & guess_valid[:, :, None]
        hits = right.long().cumprod(dim=2).sum(dim=2)  # [B, G]
        best_hits, best = hits.max(dim=1)  # first best on ties: the pool's best-ranked phrase
        best_out = gout.gather(1, best[:, None, None].expand(B, 1, L))[:, 0]  # [B, L]
        chain = torch.cat([t1, best_out], dim=1)  # [B, L + 1]
    else:
        best_hits = torch.zeros(B, dtype=torch.long, device=out.device)
        chain = torch.cat([t1, t1.new_zeros(B, L)], dim=1)
    num_new = best_hits + 1
    keep = torch.arange(L + 1, device=out.device)[None, :] < num_new[:, None]
    new_tokens = torch.where(keep, chain, torch.zeros_like(chain))
    if W:
        wout = out[:, layout.win_start:layout.guess_start].reshape(B, L, W)
        phrase_keys = window[:, 0, :]
        phrases = wout.permute(0, 2, 1)  # [B, W, L]
        next_window = wout
    else:
        phrase_keys = out.new_zeros(B, 0)
        phrases = out.new_zeros(B, 0, L)
        next_window = window
    return LookaheadResult(new_tokens, num_new, best_hits, next_window, phrase_keys, phrases)


def initial_window(context_tail: torch.Tensor, L: int, W: int) -> torch.Tensor:
    """A first window from the request's own recent tokens (no warm-up forwards needed).

    Shape: context_tail [B, T] int64 (T >= 1) -> [B, L, W]; tokens are taken cyclically.
    """
    B, T = context_tail.shape
    idx = torch.arange(L * W, device=context_tail.device) % T
    return context_tail[:, idx].reshape(B, L, W)
