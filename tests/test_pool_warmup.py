"""pool_warmup.warm_pool_kernels: every launch of the pool's Triton kernels that a serving step
makes eagerly finds a binary the warm-up compiled at load (the compile keys as Triton computes
them: constexprs, ints' == 1 and % 16 == 0, pointers' alignment; tests/triton_keys.py). Run by
Triton's CPU interpreter where there is no CUDA device (as tests/test_pool_kernels.py)."""

import numpy as np
import pytest
import torch

from conftest import DEVICE, import_kernel_module, needs_triton
from triton_keys import Recorder, compile_key

pi = import_kernel_module("vllm_ouroboros.kernels.pool_insert")
pl = import_kernel_module("vllm_ouroboros.kernels.pool_lookup")

from vllm_ouroboros import pool_draft, pool_warmup, pool_writer  # noqa: E402
from vllm_ouroboros.host_copy import packed_copy  # noqa: E402
from vllm_ouroboros.pool import _BUFFERS, PhrasePool  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread", "triton_interpreter"), needs_triton(pi, pi.place_kernel),
              needs_triton(pl, pl.lookup_kernel)]

INSERT_KERNELS = ("rows_kernel", "groups_kernel", "page_scores_kernel", "place_kernel")


def packed_upload(device, *arrays):
    """host_copy.to_device as on CUDA, on any device: the arrays of one dtype in one buffer, the
    later ones at offsets of their predecessors' sizes."""
    return packed_copy([torch.from_numpy(np.ascontiguousarray(a)) for a in arrays], device, pin=False)


@pytest.fixture
def launches(monkeypatch):
    """The pool kernels' launches, recorded (and run), once `record` is called: after the pools
    are made, whose kernel choice reads the kernels themselves; uploads packed as on CUDA."""
    out = []

    def record() -> list:
        for module, names in ((pi, INSERT_KERNELS), (pl, ("lookup_kernel",))):
            monkeypatch.setattr(module, "pick_kernel", lambda kernel, device, error: (kernel, None))
            for name in names:
                monkeypatch.setattr(module, name, Recorder(getattr(module, name), out))
        return out

    for module in (pool_warmup, pool_draft, pool_writer):
        monkeypatch.setattr(module, "to_device", packed_upload)
    return record


@pytest.mark.parametrize("L,K", [(4, 1), (5, 3)])
def test_serving_launches_reuse_the_warm_ups_binaries(launches, L, K):
    V, W, max_draft = 300, 4, 9
    pool = PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, 64), device=DEVICE, kernels="triton")
    before = {name: getattr(pool, name).clone() for name in _BUFFERS + ("clock",)}
    launches = launches()
    pool_warmup.warm_pool_kernels(pool, max_draft, K)
    warmed = {compile_key(*launch) for launch in launches}
    assert all(torch.equal(getattr(pool, name), t) for name, t in before.items()), "the warm-up touched the pool"
    assert {key[0] for key in warmed} == {"lookup_kernel", *INSERT_KERNELS}
    del launches[:]
    rng = np.random.default_rng(L)
    # No graphs: every insert eager, as past the writer's largest bucket (1,024 rows; those take
    # the kernels' 32-row blocks, as every insert above 16 rows here, and align by n mod 4).
    writer = pool_writer.PoolWriter(pool)
    for n in range(1, 24):
        keys, owners = rng.integers(0, V, n), rng.integers(0, 4, n)
        phrases = rng.integers(0, 50, (n, L))
        writer.insert(keys, phrases, owners)
        # candidate refinement (proposer.on_verified): old and new phrases in one upload
        pool.replace(*packed_upload(DEVICE, keys, phrases, (phrases + 1) % 50, owners))
    for rows in range(1, 7):
        for cut in (1, L, max_draft):
            pool_draft.queue_pool_drafts(pool, rng.integers(0, V, rows), np.arange(rows) % 3, cut, K).output()
        if K >= 2:  # the pool's drafts as branches under the root (pool_branches)
            pool_draft.queue_pool_drafts(pool, rng.integers(0, V, rows), np.arange(rows) % 3, max_draft, K,
                                         branches=True).output()
    served = {compile_key(*launch) for launch in launches}
    # the uploads' offsets gave the inserts more than one alignment: the test can fail
    assert len({key for key in served if key[0] == "place_kernel"}) > 1
    missing = served - warmed
    assert not missing, f"{len(missing)} of {len(served)} serving launches would compile: {sorted(missing, key=str)[0]}"


def test_nothing_is_warmed_where_the_pool_runs_in_torch(launches):
    pool = PhrasePool(300, 4, 4, PhrasePool.budget_for(300, 4, 4, 8), device=DEVICE, kernels="torch")
    launches = launches()
    pool_warmup.warm_pool_kernels(pool, 9, 2)
    assert launches == []


def test_a_scratch_pool_launches_what_its_pool_would():
    pool = PhrasePool(300, 4, 4, PhrasePool.budget_for(300, 4, 4, 8), device=DEVICE, kernels="triton")
    scratch = pool.empty_like(2)
    assert (scratch.vocab_size, scratch.L, scratch.W, scratch.shared, scratch.num_pages) == (300, 4, 4, True, 2)
    assert (scratch.insert_backend, scratch.lookup_backend) == ("triton", "triton")
    assert scratch._insert_kernels is pool._insert_kernels and scratch._lookup_kernel is pool._lookup_kernel
