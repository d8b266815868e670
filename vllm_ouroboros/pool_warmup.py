"""The phrase pool's Triton kernels compiled for the launches serving makes eagerly, at load.

Triton compiles a kernel once per specialisation: each constexpr (the pool's phrase length L and
window W, a lookup's n, whether rows are masked, the block size a row count picks), each int
argument's `== 1` and `% 16 == 0`, each pointer's 16-byte alignment. The pools' own checks
(kernels/pool_lookup.py, kernels/pool_insert.py) compile L = 3, W = 4 on fresh tensors, and the
drafting round and the pool writer launch from CUDA graphs captured at load. What is left runs
eagerly in a serving step:

- the pool's drafts (pool mode, pool fill; pool_draft.queue_pool_drafts): n = 1 with masked rows
  (the chain), n = K without (the suffixes);
- candidate refinement's `PhrasePool.replace` (proposer.on_verified) and the writer's inserts
  past its largest graph (pool_writer.py): inserts without a valid mask;

each from one packed upload (host_copy.to_device: the arrays of one dtype in one buffer), so the
second and later arrays sit at offsets of 8 x N bytes, and the insert's own int32 scratch at 4 x N:
aligned or not by N mod 4. Compiled in a step, each variant costs up to a second (vLLM's JIT
monitor flags it) and the step's timings take it in: the pool's lookup time, a running mean
that takes its first sample whole, would price every later pool plan out, and a pool that
drafts nowhere is never timed again. `warm_pool_kernels` makes these calls at load on a scratch
pool of the pool's shape. No vLLM imports.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ouroboros.host_copy import to_device
from vllm_ouroboros.pool import PhrasePool
from vllm_ouroboros.pool_draft import queue_pool_drafts

# Row counts of the warm-up inserts: one of each residue mod 4 that aligns differently (odd, 2, 0)
# at each block size the insert kernels pick (16 rows up to 16, 32 above).
INSERT_ROWS = (1, 2, 4, 17, 18, 20)
SCRATCH_PAGES = 32


@torch.no_grad()
def warm_pool_kernels(pool: PhrasePool, draft_len: int, num_suffixes: int) -> None:
    """Make, on a scratch pool like `pool` (PhrasePool.empty_like: its shape and kernels), the
    eager calls a serving step makes through the Triton kernels (module docstring):
    queue_pool_drafts at one and two rows with this draft length and num_suffixes (K), as a
    chain and (K >= 2) as branches (pool_branches), and the
    refinement's replace and the writer's insert at INSERT_ROWS rows, each from a packed upload.
    Only the ops that run through Triton on `pool` are made; `pool` is not touched."""
    if pool.lookup_backend != "triton" and pool.insert_backend != "triton":
        return
    dev = pool.device
    scratch = pool.empty_like(SCRATCH_PAGES)
    if pool.lookup_backend == "triton":
        for rows in (1, 2):
            zeros = np.zeros(rows, np.int64)
            for branches in (False, True) if num_suffixes >= 2 else (False,):
                queue_pool_drafts(scratch, zeros, zeros, draft_len, num_suffixes, branches).output()
    if pool.insert_backend == "triton":
        for n in INSERT_ROWS:
            keys, phrases = np.arange(n, dtype=np.int64), np.zeros((n, pool.L), np.int64)
            scratch.insert(*to_device(dev, keys, phrases, keys))
            scratch.replace(*to_device(dev, keys, phrases, phrases + 1, keys))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
