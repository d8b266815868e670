"""A seeded request's tokens as vLLM samples them without speculation (README, "Seeded requests").

Without speculation vLLM samples a seeded request's tokens one a step, each with the next draw of
the request's own generator. In a verified tree the token at emitted position j of a step (j = 0
after the root, j = depth(i) after node i) is the one the plain sampler would give with the
step's draw j from the target's distribution after that node's path. So every tree row of such
a request at position j is sampled through vLLM's own sampler with a copy of the generator as it
stands before draw j, and the walk follows these choices as the greedy walk follows the argmax:
it accepts a child whose token is its parent row's choice and emits the choice where no child
has it. The generator is then set where the emitted tokens' draws leave it.

The request's text is then the one vLLM writes without speculation for the same seed, whatever
was drafted, and any other request beside it (up to float rounding between the two forwards,
as for greedy requests). Lossless as the rejection walk is: each emitted token is the target's
sample after the accepted path, and a child is accepted with its token's probability, the
chance the rejection walk gives a one-hot draft (accept.py). Only for the walk's steps: a step
verified by vLLM's rejection sampler (bad words, min_tokens, ... beside it) draws as that sampler
does, and the request's later tokens no longer follow the plain sampler's.

What a draw is (one `randint` on vLLM's CPU sampler, one exponential row of the vocabulary's
size on its native one) is left to vLLM's sampler: the copies it draws with are read back, so
nothing here depends on it. No vLLM imports: the caller passes the sampler in.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .host_copy import to_device
from .tree import TokenTree

# prepare(x, req): what the sampler does to a request's rows before its top-k / top-p step
# (temperature, min_p), x [n, V] float32 (overwritten), req [n] int64 the request of each row.
Prepare = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# sample(x, generators, req): vLLM's top-k / top-p sampler on prepared rows x [n, V] with the
# generator of each row ({row: generator}, every row has one) -> [n] token ids.
Sample = Callable[[torch.Tensor, dict[int, torch.Generator], torch.Tensor], torch.Tensor]


class SeededDraws:
    """One step's choices for the batch's seeded requests and where their generators go next.

    choices(tree, logits, rows, target_next) samples the rows; advance(num_emitted) moves each
    seeded request's generator on by its emitted tokens' draws, once the walk is done.
    """

    def __init__(self, generators: dict[int, torch.Generator], prepare: Prepare, sample: Sample,
                 max_rows: int):
        self.generators = generators
        self.prepare, self.sample = prepare, sample
        self.max_rows = max(1, max_rows)
        self._after: dict[int, list[torch.Tensor]] = {}

    def _requests(self, B: int) -> list[int]:
        """The batch's seeded requests (indices below B), in order."""
        return sorted(i for i in self.generators if i < B)

    def choices(self, tree: TokenTree, logits: torch.Tensor, rows: np.ndarray,
                target_next: torch.Tensor) -> tuple[torch.Tensor, np.ndarray] | None:
        """The rows' choices: target_next [B, N + 1] (device, int64) with the seeded requests'
        real rows replaced by their samples, and the seeded requests as a [B] host bool mask;
        None where no request of the batch is seeded.

        Shape: logits [R, V] (the step's rows, logit bias applied), rows [B, N + 1] host int64
        (node_rows: the logit row of the root and of each node). One sampler call per position
        (at most max_rows rows each): a position's draw is known once the one before is done.
        """
        lay = tree.layout
        B, N1 = rows.shape
        seeded = self._requests(B)
        self._after = {}
        if not seeded:
            return None
        position = np.zeros((B, N1), np.int64)
        position[:, 1:] = lay.depth
        real = np.ones((B, N1), bool)
        real[:, 1:] = lay.valid
        mask = np.zeros(B, bool)
        mask[seeded] = True
        real &= mask[:, None]
        before = {b: self.generators[b].get_state() for b in seeded}
        out = target_next.clone()
        for j in range(int(position[real].max()) + 1):
            req, col = np.nonzero(real & (position == j))
            after: dict[int, torch.Tensor] = {}
            for lo in range(0, len(req), self.max_rows):
                r, c = req[lo:lo + self.max_rows], col[lo:lo + self.max_rows]
                copies = {i: _copy(self.generators[b], before[b]) for i, b in enumerate(r.tolist())}
                row_t, r_t, c_t = to_device(logits.device, rows[r, c], r, c)
                x = self.prepare(logits[row_t].float(), r_t)
                out[r_t, c_t] = self.sample(x, copies, r_t).to(out.dtype)
                for i, b in enumerate(r.tolist()):
                    # Each copy drew once from its request's state before draw j: any of them
                    # holds the state before draw j + 1.
                    if b not in after:
                        after[b] = copies[i].get_state()
            for b, state in after.items():
                self._after.setdefault(b, []).append(state)
            before.update(after)
        return out, mask

    def advance(self, num_emitted: np.ndarray) -> None:
        """Set each seeded request's generator where its num_emitted[b] (>= 1) tokens' draws
        leave it, as the plain sampler's steps would (num_emitted [B] host ints)."""
        for b, states in self._after.items():
            self.generators[b].set_state(states[int(num_emitted[b]) - 1])
        self._after = {}


def _copy(generator: torch.Generator, state: torch.Tensor) -> torch.Generator:
    """A new generator on `generator`'s device in `state` (get_state is a host tensor on CUDA
    too: no device sync)."""
    g = torch.Generator(device=generator.device)
    g.set_state(state)
    return g
