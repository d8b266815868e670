"""Tree-attention kernel vs its plain-torch reference: compiled on a CUDA device when there is
one, else run by Triton's CPU interpreter.

@triton.jit reads TRITON_INTERPRET when a function is decorated (Triton's own library functions
when triton is first imported, the kernel when its module is imported), and the interpreter reads
it again while running. So on CPU it is set before both imports and during this module's tests,
and put back otherwise: pytest imports every test module before running any, and vLLM engine
processes of other tests inherit the environment. If something imported triton before this module,
the wrapper refuses to interpret and backend="triton" turns that into failures, not passes.
"""

import functools
import itertools
import logging
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import DEVICE, set_triton_interpret  # noqa: E402  (cuda when present; OUROBOROS_TEST_DEVICE overrides)
from tiny_models import prefill_then_masked_forward  # noqa: E402
from triton_keys import Recorder, compile_key  # noqa: E402
_TRITON_WAS_IMPORTED = "triton" in sys.modules
set_triton_interpret(True)
try:
    import triton

    from vllm_ouroboros.kernels import tree_attention as ta
    from vllm_ouroboros.kernels.reference import gather_pages, tree_attention_reference
    from vllm_ouroboros.kernels.fused_ops import rope_qkv_write_reference
    from vllm_ouroboros.kernels.tree_attention import ancestor_bitmask, tree_attention
finally:
    set_triton_interpret(False)


# Tiny tensors: thread wake-ups cost more than the work (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread", "triton_interpreter")


@pytest.fixture(autouse=True)
def no_measured_split_rules():
    """The kernel checks (check_attention_kernel) register measured split rules for the whole
    process on CUDA: a later test on the same worker would plan its graph and eager forwards by
    two different rules, whose prefix splits round differently (token-for-token tests then
    fail on CUDA only)."""
    yield
    ta.clear_split_rules()


# ---------------------------------------------------------------------------------------------
# Random trees and paged batches
# ---------------------------------------------------------------------------------------------
TREE_KINDS = ("chain", "bushy", "forest", "ouroboros", "star")


def random_parents(kind: str, n: int, rng: random.Random) -> list[int]:
    """Parent of each node (-1 = root); parents always precede their children."""
    if kind == "chain" or n == 1:
        return [-1] + list(range(n - 1))
    if kind == "bushy":
        return [-1] + [rng.randrange(i) for i in range(1, n)]
    if kind == "forest":  # several roots: each hangs off the prefix directly
        return [rng.randrange(-1, i) for i in range(n)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    # ouroboros: a draft chain of c nodes, then suffix chains hanging off its last node
    c = rng.randint(1, n)
    parents = [-1] + list(range(c - 1))
    while len(parents) < n:
        length = rng.randint(1, n - len(parents))
        parents += [c - 1] + [len(parents) + t for t in range(length - 1)]
    return parents


def make_batch(prefixes, trees, hkv, group, head_dim, block_size, dtype=torch.float32, seed=0,
               extra_table_cols=1):
    """A paged batch: the cache is NaN everywhere except the positions requests own, so any read
    past a request's prefix + tree (or through a wrong page) poisons the output."""
    g = torch.Generator().manual_seed(seed)
    lengths = [p + len(t) for p, t in zip(prefixes, trees)]
    pages_needed = [-(-length // block_size) for length in lengths]
    num_blocks = sum(pages_needed) + 3  # a few spare NaN pages
    max_blocks = max(max(pages_needed), 1) + extra_table_cols
    perm = torch.randperm(num_blocks, generator=g).tolist()
    spare = perm[sum(pages_needed):]
    k_cache = torch.full((num_blocks, block_size, hkv, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_table = torch.tensor([[spare[0]] * max_blocks for _ in prefixes], dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for b, length in enumerate(lengths):
        pages = perm[used:used + pages_needed[b]]
        used += pages_needed[b]
        block_table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(length, hkv, head_dim, generator=g).to(dtype)
        v = torch.randn(length, hkv, head_dim, generator=g).to(dtype)
        pos = torch.arange(length)
        page = block_table[b].long()[pos // block_size]
        k_cache[page, pos % block_size] = k
        v_cache[page, pos % block_size] = v
        dense_k.append(k)
        dense_v.append(v)
    n = torch.tensor([len(t) for t in trees])
    n_max = max(1, int(n.max()))
    parents = torch.full((len(trees), n_max), -1, dtype=torch.long)
    for b, t in enumerate(trees):
        parents[b, :len(t)] = torch.tensor(t, dtype=torch.long)
    query_start = torch.zeros(len(trees) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(n, 0)
    num_tokens = int(n.sum())
    return dict(
        q=torch.randn(num_tokens, hkv * group, head_dim, generator=g).to(dtype),
        k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        prefix_lens=torch.tensor(prefixes, dtype=torch.int32), query_start=query_start,
        tree_mask=ancestor_bitmask(parents, n), scale=head_dim ** -0.5,
    ), dense_k, dense_v


def on_device(batch):
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def check_parity(batch, tol, max_query_len=None):
    out = tree_attention(**on_device(batch), backend="triton", max_query_len=max_query_len).cpu()
    ref = tree_attention_reference(**batch)
    assert torch.isfinite(out).all(), "kernel read a NaN slot (outside the request's prefix + tree)"
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert err <= tol, f"max abs error {err:.3g} > {tol}"
    return err


# ---------------------------------------------------------------------------------------------
# Parity: 48 cases over GQA ratio x head dim x block size (2 seeds each) + 4 with padded head dims
# ---------------------------------------------------------------------------------------------
GRID = [(g, d, bs, s) for (g, d, bs), s in itertools.product(
    itertools.product((1, 2, 4, 7), (32, 64, 128), (16, 32)), (0, 1))]
GRID += [(2, 80, 16, 2), (4, 96, 32, 2), (1, 80, 32, 3), (7, 96, 16, 3)]


def random_case(group, head_dim, block_size, seed, dtype=torch.float32):
    rng = random.Random(f"{group}-{head_dim}-{block_size}-{seed}")
    batch = rng.randint(1, 4)
    prefixes = [rng.randint(0, 100) for _ in range(batch)]
    trees = [random_parents(rng.choice(TREE_KINDS), rng.randint(1, 20), rng) for _ in range(batch)]
    return make_batch(prefixes, trees, hkv=rng.randint(1, 2), group=group, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, seed=seed)[0]


@pytest.mark.parametrize("group,head_dim,block_size,seed", GRID)
def test_parity_fp32(group, head_dim, block_size, seed):
    check_parity(random_case(group, head_dim, block_size, seed), tol=1e-3)


@pytest.mark.parametrize("dtype,tol,group,head_dim", [
    (torch.float16, 1e-2, 1, 64), (torch.float16, 1e-2, 4, 128), (torch.float16, 1e-2, 7, 32),
    (torch.bfloat16, 4e-2, 2, 64)])
def test_parity_half(dtype, tol, group, head_dim):
    # reference: same half inputs, fp32 math; the kernel rounds p to half before p @ v
    check_parity(random_case(group, head_dim, 16, 7, dtype=dtype), tol=tol)


def test_prefix_ends_mid_block_tree_crosses_boundary():
    # page 16: prefix 13 ends mid-page, the 10-node tree spans positions 13..22 across pages 0 and 1;
    # the second request's prefix 32 ends exactly on a page boundary, its tree starts a new page.
    rng = random.Random(5)
    trees = [random_parents("ouroboros", 10, rng), random_parents("bushy", 7, rng)]
    batch, _, _ = make_batch([13, 32], trees, hkv=2, group=2, head_dim=64, block_size=16, seed=5)
    check_parity(batch, tol=1e-3)


@pytest.mark.parametrize("block_size", [64, 128])
def test_large_pages(block_size):
    rng = random.Random(block_size)
    trees = [random_parents("bushy", 20, rng), random_parents("chain", 3, rng)]
    batch, _, _ = make_batch([block_size - 5, 150], trees, hkv=1, group=4, head_dim=32,
                             block_size=block_size, seed=1)
    check_parity(batch, tol=1e-3)


def test_edge_cases():
    # a request with no tree nodes, a 64-node chain (bit 63 = int64 sign bit), an empty prefix,
    # a wider tree than one BLOCK_Q, and an over-estimated max_query_len (extra programs exit)
    rng = random.Random(3)
    trees = [[], random_parents("chain", 64, rng), random_parents("forest", 33, rng)]
    batch, _, _ = make_batch([7, 0, 70], trees, hkv=1, group=2, head_dim=32, block_size=16, seed=3)
    check_parity(batch, tol=1e-3, max_query_len=64)


def test_strided_cache_and_out():
    # vLLM keeps K and V of a layer in one tensor; a [num_blocks, 2, ...] layout makes both views
    # non-contiguous. `out` given: written in place and returned.
    rng = random.Random(4)
    trees = [random_parents("bushy", 9, rng), random_parents("star", 6, rng)]
    batch, _, _ = make_batch([21, 50], trees, hkv=2, group=2, head_dim=32, block_size=16, seed=4)
    ref = tree_attention_reference(**batch)
    batch = on_device(batch)
    kv = torch.stack([batch["k_cache"], batch["v_cache"]], dim=1)
    batch["k_cache"], batch["v_cache"] = kv[:, 0], kv[:, 1]
    assert not batch["k_cache"].is_contiguous()
    out = torch.full_like(batch["q"], 7.0)
    res = tree_attention(**batch, out=out, backend="triton")
    assert res is out
    assert (out.cpu() - ref).abs().max().item() <= 1e-3


def test_random_cases_cover_page_boundaries():
    # the random grid must exercise prefixes ending mid-page and trees crossing a page boundary
    mid = cross = 0
    for group, head_dim, block_size, seed in GRID:
        b = random_case(group, head_dim, block_size, seed)
        n = (b["query_start"][1:] - b["query_start"][:-1]).tolist()
        for p, k in zip(b["prefix_lens"].tolist(), n):
            mid += p % block_size != 0
            cross += p // block_size != (p + k - 1) // block_size
    assert mid >= 20 and cross >= 10


# ---------------------------------------------------------------------------------------------
# Split-KV: the prefix cut into S chunks, partial states merged by a second kernel
# ---------------------------------------------------------------------------------------------
# A Latin square over GQA group x head dim x forced S (every pair once), block size and dtype
# alternating: 9 cases instead of 27 keep the interpreter's run short.
SPLIT_GRID = [
    (1, 64, 2, 16, torch.float32), (1, 80, 3, 32, torch.bfloat16), (1, 128, 8, 16, torch.float32),
    (2, 64, 3, 32, torch.float32), (2, 80, 8, 16, torch.float32), (2, 128, 2, 32, torch.bfloat16),
    (7, 64, 8, 32, torch.bfloat16), (7, 80, 2, 16, torch.float32), (7, 128, 3, 32, torch.float32),
]


def split_case(group, head_dim, block_size, dtype, seed=0):
    """A ragged batch for the split path: an empty prefix, one shorter than a single key tile (so
    all but the first split are empty, the last one holding only the tree), one of several
    chunks; trees of 1 node, of many, and in between. The interpreter's time grows with the q
    blocks x kv heads: group 7 (2 nodes per fp32 q block) gets smaller trees and one kv head."""
    rng = random.Random(f"split-{group}-{head_dim}-{block_size}-{seed}")
    prefixes = [0, rng.randint(1, 20), rng.randint(100, 300)] + [rng.randint(21, 99)] * rng.randint(0, 1)
    small = group <= 2
    sizes = [1, 64 if small else 16, rng.randint(2, 20 if small else 8), rng.randint(2, 20 if small else 8)]
    sizes = sizes[:len(prefixes)]
    rng.shuffle(sizes)
    trees = [random_parents(rng.choice(TREE_KINDS), n, rng) for n in sizes]
    return make_batch(prefixes, trees, hkv=2 if small else 1, group=group, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, seed=seed)[0]


@pytest.mark.parametrize("group,head_dim,splits,block_size,dtype", SPLIT_GRID)
def test_split_kv_parity(group, head_dim, splits, block_size, dtype):
    batch = split_case(group, head_dim, block_size, dtype)
    assert 0 in batch["prefix_lens"].tolist()
    out = tree_attention(**on_device(batch), backend="triton", num_splits=splits).cpu()
    ref = tree_attention_reference(**batch)
    assert torch.isfinite(out).all(), "a split read a NaN slot, or the merge divided 0 by 0"
    # fp32: as tight as the single pass (test_parity_fp32); bf16 as test_parity_half
    tol = 1e-3 if dtype == torch.float32 else 4e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


@pytest.mark.parametrize("tiles", ta.TILE_CANDIDATES)
def test_tile_candidates_parity(tiles):
    """Every tile entry the GPU benchmark may time (and a next table may hold) computes the same
    attention, single pass and split-KV, bf16 with GQA and ragged trees across page boundaries."""
    rng = random.Random(str(tiles))
    trees = [random_parents("ouroboros", 37, rng), random_parents("bushy", 9, rng), random_parents("chain", 1, rng)]
    for head_dim, splits in ((64, 1), (128, 3)):
        batch, _, _ = make_batch([150, 0, 33], trees, hkv=2, group=4, head_dim=head_dim, block_size=16,
                                 dtype=torch.bfloat16, seed=3)
        out = tree_attention(**on_device(batch), backend="triton", num_splits=splits, tiles=tiles).cpu()
        err = (out.float() - tree_attention_reference(**batch).float()).abs().max().item()
        assert torch.isfinite(out).all() and err <= 4e-2, (head_dim, splits, err)


@pytest.mark.parametrize("splits", [1, 2])
def test_head_dim_256(splits):
    # D = 256 has its own row in the tile table (M = 32, 32-wide key tiles)
    rng = random.Random(256)
    trees = [random_parents("bushy", 40, rng), random_parents("chain", 3, rng)]
    batch, _, _ = make_batch([70, 0], trees, hkv=1, group=2, head_dim=256, block_size=16,
                             dtype=torch.bfloat16, seed=2)
    out = tree_attention(**on_device(batch), backend="triton", num_splits=splits).cpu()
    assert torch.isfinite(out).all()
    assert (out.float() - tree_attention_reference(**batch).float()).abs().max().item() <= 4e-2


def test_split_heuristic():
    # Issue 15's H100 shapes: 132 SMs, Hkv 8, bf16 key tiles of 64.
    pick = functools.partial(ta.choose_num_splits, num_kv_heads=8, num_sms=132, block_n=64)
    # 32 requests x 8 kv heads already fill the SMs: the single pass, no merge launch
    assert pick(batch=32, num_q_blocks=1, max_prefix_len=8192) == 1
    assert pick(batch=8, num_q_blocks=4, max_prefix_len=8192) == 1
    # 1 request: 8 programs on 132 SMs; a long prefix is worth cutting
    s = pick(batch=1, num_q_blocks=1, max_prefix_len=8192)
    assert 1 < s <= ta.MAX_SPLITS
    # ... a short one is not (the merge's launch would cost more than a few key tiles)
    assert pick(batch=1, num_q_blocks=1, max_prefix_len=512) == 1
    # tempting wrong answer: S = SMs / programs (16 here) whatever the prefix; chunks of fewer than
    # MIN_SPLIT_TOKENS tokens are not worth their partial-state store
    assert pick(batch=1, num_q_blocks=1, max_prefix_len=1024) <= 1024 // ta.MIN_SPLIT_TOKENS
    # every S it returns shortens the longest chunk (S - 1 splits would do the same work otherwise)
    for b, nq, p in itertools.product((1, 2, 4, 8), (1, 4), (1024, 2048, 5000, 8192, 32768)):
        s = pick(batch=b, num_q_blocks=nq, max_prefix_len=p)
        tiles = -(-p // 64)
        assert s == 1 or -(-tiles // s) < -(-tiles // (s - 1)), (b, nq, p, s)
    assert ta.choose_num_splits(1, 8, 1, num_sms=1, max_prefix_len=8192, block_n=64) == 1


def test_split_heuristic_in_the_wrapper(monkeypatch):
    # As on a 132-SM GPU: the wrapper splits on the host-side bound alone (a loose hint leaves most
    # splits empty, a too-small one only stops the split) and launches the merge only when S > 1.
    rng = random.Random(13)
    batch, _, _ = make_batch([100], [random_parents("ouroboros", 5, rng)], hkv=1, group=2,
                             head_dim=32, block_size=16, seed=13)
    ref = tree_attention_reference(**batch)
    chosen, merges = [], []
    real_choose, real_merge = ta.choose_num_splits, ta.tree_attention_merge_kernel

    class MergeSpy:
        def __getitem__(self, grid):
            merges.append(grid)
            return real_merge[grid]

    def choose_spy(*a, **k):
        chosen.append(real_choose(*a, **k))
        return chosen[-1]

    monkeypatch.setattr(ta, "_num_sms", lambda device: 132)
    monkeypatch.setattr(ta, "choose_num_splits", choose_spy)
    monkeypatch.setattr(ta, "tree_attention_merge_kernel", MergeSpy())
    args = on_device(batch)
    assert args["block_table"].shape[1] * 16 < ta.MIN_PREFIX_TO_SPLIT
    for hint in (4096, 0, None):  # None: the block table's width (8 pages, 128 tokens) bounds it
        out = tree_attention(**args, backend="triton", max_query_len=5, max_prefix_len=hint).cpu()
        assert (out - ref).abs().max().item() <= 1e-3, hint
    assert chosen[0] > 1 and chosen[1:] == [1, 1], chosen
    assert len(merges) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graph capture needs a CUDA device")
def test_split_path_captures_in_a_cuda_graph():
    # No host-device synchronisation on the split path (capture raises on one); the scratch comes
    # from the graph's pool.
    rng = random.Random(12)
    batch, _, _ = make_batch([3000], [random_parents("ouroboros", 16, rng)], hkv=2, group=4,
                             head_dim=64, block_size=16, dtype=torch.bfloat16, seed=12)
    ref = tree_attention_reference(**batch)
    args = on_device(batch)
    _, _, splits = ta._launch_plan(torch.bfloat16, 8, 2, 64, 1, 16, 3000, args["q"].device)
    assert splits > 1, "the heuristic no longer splits this shape: the test checks nothing new"
    out = torch.empty_like(args["q"])

    def call():
        tree_attention(**args, out=out, max_query_len=16, max_prefix_len=3000)

    call()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float().cpu() - ref.float()).abs().max().item() <= 4e-2


# ---------------------------------------------------------------------------------------------
# The reference itself, the wrapper's fallback and checks, the bitmask helper
# ---------------------------------------------------------------------------------------------
def test_reference_chain_equals_causal_attention():
    # a chain tree is ordinary causal decoding of prefix + n tokens; compared against SDPA on the
    # dense K/V (never paged), so the page gathering is checked too
    prefixes, sizes, group = [0, 17, 40], [5, 12, 1], 3
    trees = [list(range(-1, s - 1)) for s in sizes]
    batch, dense_k, dense_v = make_batch(prefixes, trees, hkv=2, group=group, head_dim=32,
                                         block_size=16, seed=11)
    ref = tree_attention_reference(**batch)
    qs = batch["query_start"].tolist()
    for b, (p, s) in enumerate(zip(prefixes, sizes)):
        q = batch["q"][qs[b]:qs[b + 1]].transpose(0, 1)  # [Hq, s, D]
        k = dense_k[b].transpose(0, 1).repeat_interleave(group, 0)
        v = dense_v[b].transpose(0, 1).repeat_interleave(group, 0)
        causal = torch.ones(s, p + s, dtype=torch.bool).tril(diagonal=p)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal,
                                                                scale=batch["scale"])
        torch.testing.assert_close(ref[qs[b]:qs[b + 1]], want.transpose(0, 1), atol=1e-5, rtol=1e-5)
        # the tempting wrong mask: the tree part attended in full (no causality inside the tree)
        if s > 1:
            full = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=batch["scale"])
            assert not torch.allclose(ref[qs[b]:qs[b + 1]], full.transpose(0, 1), atol=1e-3)
    assert torch.equal(gather_pages(batch["k_cache"], batch["block_table"][1], 29), dense_k[1])


@pytest.mark.parametrize("group,head_dim,block_size,seed", GRID)
def test_torch_path_parity(group, head_dim, block_size, seed):
    # The batched torch path (what CPU runs inside vLLM) against the per-request reference.
    batch = random_case(group, head_dim, block_size, seed)
    ref = tree_attention_reference(**batch)
    out = tree_attention(**batch, backend="torch")
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= 1e-4
    # The step's host bounds (what the engine passes: no read-back of the lengths on a GPU);
    # looser ones only pad.
    n = int((batch["query_start"][1:] - batch["query_start"][:-1]).max())
    p = int(batch["prefix_lens"].max())
    for bounds in ((n, p), (n + 3, p + 17)):
        got = tree_attention(**batch, backend="torch", max_query_len=bounds[0], max_prefix_len=bounds[1])
        assert (got - ref).abs().max().item() <= 1e-4, bounds


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
def test_rows_past_every_request_are_left_alone(backend):
    """q may have rows past the last request's (a buffer sized for more): every backend writes
    only the requests' rows of `out`; the torch paths copied uninitialised rows over the rest."""
    rng = random.Random(11)
    trees = [random_parents("bushy", 7, rng), random_parents("chain", 3, rng)]
    batch, _, _ = make_batch([12, 30], trees, hkv=2, group=2, head_dim=32, block_size=16, seed=11)
    ref = tree_attention_reference(**batch)
    rows = ref.shape[0]
    batch = on_device(batch)
    batch["q"] = torch.cat([batch["q"], torch.randn(4, *batch["q"].shape[1:], device=DEVICE)])
    batch["tree_mask"] = torch.cat([batch["tree_mask"], batch["tree_mask"].new_ones(4)])
    out = torch.full_like(batch["q"], 7.0)
    bounds = {} if backend == "reference" else dict(max_query_len=7, max_prefix_len=30)
    assert tree_attention(**batch, out=out, backend=backend, **bounds) is out
    assert (out[:rows].cpu() - ref).abs().max().item() <= 1e-3
    assert out[rows:].eq(7.0).all(), "rows past every request's were written"


def test_torch_path_reads_d_major_keys():
    # vLLM's CPU cache keeps each block's keys d-major: the views handed over are non-unit
    # strided in the head dim. The torch paths take them as they are.
    rng = random.Random(9)
    trees = [random_parents("ouroboros", 12, rng), random_parents("chain", 4, rng)]
    batch, _, _ = make_batch([33, 70], trees, hkv=2, group=2, head_dim=32, block_size=32, seed=9)
    ref = tree_attention_reference(**batch)
    k = batch["k_cache"]
    d_major = k.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # same values, [nb, bs, H, D]
    assert d_major.stride(-1) != 1 and torch.allclose(d_major, k, equal_nan=True)
    out = tree_attention(**{**batch, "k_cache": d_major}, backend="torch")
    assert (out - ref).abs().max().item() <= 1e-4
    # the kernel refuses them, on the device it runs on (CPU tensors never reach a compiled kernel)
    dev = on_device(batch)
    dev["k_cache"] = dev["k_cache"].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    with pytest.raises(ValueError, match="last"):
        tree_attention(**dev, backend="triton")


def test_fallback_to_reference(monkeypatch):
    # as if the module had been imported without TRITON_INTERPRET: a compiled JITFunction that
    # cannot take CPU tensors
    import triton

    rng = random.Random(6)
    batch, _, _ = make_batch([9], [random_parents("bushy", 6, rng)], hkv=1, group=2, head_dim=32,
                             block_size=16, seed=6)
    ref = tree_attention_reference(**batch)
    monkeypatch.setattr(ta, "tree_attention_kernel", triton.JITFunction(ta.tree_attention_kernel.fn))
    monkeypatch.setattr(ta, "_logged", set())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # "vllm" does not propagate to the root logger once vLLM has configured it (pytest's caplog
    # listens there): listen on our logger itself.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    lg = logging.getLogger("vllm.ouroboros")
    lg.addHandler(handler)
    level = lg.level
    lg.setLevel(logging.INFO)
    try:
        out1 = tree_attention(**batch)
        out2 = tree_attention(**batch)
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # too late: read at import
        out3 = tree_attention(**batch)
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
    for out in (out1, out2, out3):  # the batched torch path
        assert (out - ref).abs().max().item() <= 1e-5
    warnings = [r.getMessage() for r in records if "torch path" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once per distinct reason
    assert "TRITON_INTERPRET was not set" in warnings[0] and "no effect" in warnings[1]
    with pytest.raises(RuntimeError, match="Triton cannot run"):
        tree_attention(**batch, backend="triton")
    assert torch.equal(tree_attention(**batch, backend="reference"), ref)


def test_wrapper_rejects_bad_inputs():
    rng = random.Random(8)
    batch, _, _ = make_batch([5], [random_parents("chain", 3, rng)], hkv=2, group=2, head_dim=32,
                             block_size=16, seed=8)
    # on the kernel's device: the stride and node-count checks only apply where Triton can run
    batch = on_device(batch)
    bad = [
        (dict(block_table=batch["block_table"].long()), TypeError, "block_table"),
        (dict(k_cache=batch["k_cache"].half()), TypeError, "k_cache"),
        (dict(q=batch["q"][:, :3]), ValueError, "multiple of kv heads"),
        (dict(q=batch["q"][..., ::2]), ValueError, "head dim"),
        (dict(tree_mask=batch["tree_mask"][:2]), ValueError, "tree_mask"),
        (dict(prefix_lens=batch["prefix_lens"].repeat(2)), ValueError, "prefix_lens"),
        (dict(k_cache=batch["k_cache"].transpose(1, 3).contiguous().transpose(1, 3)), ValueError,
         "last"),
    ]
    bad += [(dict(num_splits=s), ValueError, "num_splits") for s in (0, ta.MAX_SPLITS + 1, 2.0, True)]
    bad += [(dict(max_prefix_len=-1), ValueError, "max_prefix_len")]
    bad += [(dict(tiles=t), ValueError, "tiles") for t in ((64, 64, 4), (48, 64, 4, 4), (8, 64, 4, 4),
                                                             (64, 512, 4, 4), [64, 64, 4, 4], (64, 64, 32, 4))]
    for override, exc, match in bad:
        with pytest.raises(exc, match=match):
            tree_attention(**{**batch, **override}, backend="triton")
    too_big = dict(q=torch.zeros(65, 4, 32, device=DEVICE),
                   tree_mask=torch.zeros(65, dtype=torch.long, device=DEVICE),
                   query_start=torch.tensor([0, 65], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="at most 64"):
        tree_attention(**{**batch, **too_big}, backend="triton")


def test_one_request_metadata_may_be_a_column_of_a_wider_table():
    """One request's prefix_lens is one entry: a column of an [A, n] inbox at A = 1 keeps the row
    stride through `.to(int32)` (the graph prefill's), and the kernel never steps along it. It
    was refused as non-contiguous on a GPU, so the prefill's graphs were never captured there."""
    rng = random.Random(9)
    batch, _, _ = make_batch([37], [random_parents("chain", 5, rng)], hkv=2, group=2, head_dim=32,
                             block_size=16, seed=9)
    batch = on_device(batch)
    inbox = torch.zeros(1, 67, dtype=torch.long, device=DEVICE)
    inbox[0, 1] = batch["prefix_lens"][0]
    column = inbox[:, 1].to(torch.int32)
    assert column.stride() == (67,)  # what `.to` keeps for a one-entry tensor
    want = tree_attention(**batch, backend="triton")
    got = tree_attention(**{**batch, "prefix_lens": column}, backend="triton")
    assert torch.equal(got, want)


def test_ancestor_bitmask_hand_made():
    #   request 0:  0 ── 1 ── 2          request 1 (2 nodes + padding):  0 ── 1
    #               │    └─── 3 ── 4
    #               └─── 5
    parents = torch.tensor([[-1, 0, 1, 1, 3, 0], [-1, 0, 4, 2, -1, 0]])  # request 1: cols 2.. are padding
    got = ancestor_bitmask(parents, torch.tensor([6, 2])).tolist()
    want = [0b1, 0b11, 0b111, 0b1011, 0b11011, 0b100001, 0b1, 0b11]
    # tempting wrong answer: parent bits only (not transitive), e.g. node 4 -> 0b11000
    assert got == want
    assert ancestor_bitmask(parents, torch.tensor([6, 2]), total=8).tolist() == want
    # several roots (a forest hanging off the prefix): no bits shared across roots
    assert ancestor_bitmask(torch.tensor([[-1, -1, 1]]), torch.tensor([3])).tolist() == [0b1, 0b10, 0b110]
    # a 64-node chain: the last node sets every bit, int64 sign bit included
    chain = ancestor_bitmask(torch.arange(-1, 63)[None], torch.tensor([64]))
    assert chain[63].item() == -1 and chain[62].item() == (1 << 63) - 1


def test_ancestor_bitmask_matches_python_walk():
    rng = random.Random(9)
    trees = [random_parents(k, rng.randint(1, 40), rng) for k in TREE_KINDS * 2]
    n_max = max(len(t) for t in trees)
    parents = torch.tensor([t + [-1] * (n_max - len(t)) for t in trees])
    got = ancestor_bitmask(parents, torch.tensor([len(t) for t in trees])).tolist()
    want = []
    for t in trees:
        for i in range(len(t)):
            bits, j = 0, i
            while j >= 0:
                bits, j = bits | (1 << j), t[j]
            want.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    assert got == want


# ---------------------------------------------------------------------------------------------
# The draft runtime's attention through the same kernel (draft/attention.masked_attention): its
# paged cache [num_pages, page_size, Hkv, D] and block table, the new-token mask as the bitmask.
# ---------------------------------------------------------------------------------------------
def _draft_case(seed):
    from vllm_ouroboros.draft.attention import build_attention_metadata, write_kv

    rng = random.Random(f"draft-{seed}")
    g = torch.Generator().manual_seed(seed)
    hkv, group = rng.randint(1, 2), rng.choice((1, 2, 4, 7))
    head_dim = rng.choice((16, 32, 64, 80, 128))
    Q = (1, 2, 7, 17, 34, 64)[seed % 6]
    B = rng.randint(1, 3) if Q < 34 else 1  # the interpreter's time grows with B * Q
    num_slots, max_len, page = B + 2, 100, rng.choice((4, 16))
    per_slot = -(-max_len // page)
    # Each slot's pages scattered over the store (and one page nobody holds).
    table = torch.randperm(num_slots * per_slot + 1, generator=g)[:num_slots * per_slot]
    table = table.view(num_slots, per_slot).int()
    slots = torch.randperm(num_slots, generator=g)[:B]
    cache_lens = torch.tensor([rng.randint(0, max_len - Q) for _ in range(B)])
    # Random visibility among the new tokens (not only trees: the lookahead window's mask is
    # not an ancestor relation), diagonal always on; a density near 0 is padding (self only).
    new_mask = torch.rand(B, Q, Q, generator=g) < rng.random()
    new_mask |= torch.eye(Q, dtype=torch.bool)
    # Finite garbage everywhere: a column read that the mask hides changes the output.
    k_cache = torch.randn(num_slots * per_slot + 1, page, hkv, head_dim, generator=g)
    v_cache = torch.randn(num_slots * per_slot + 1, page, hkv, head_dim, generator=g)
    k, v = (torch.randn(B, Q, hkv, head_dim, generator=g) for _ in range(2))
    q = torch.randn(B, Q, hkv * group, head_dim, generator=g)
    # any upper bound is correct (within the cache)
    max_cache_len = min(int(cache_lens.max()) + rng.randint(0, 5), max_len - Q)
    metas = {b: build_attention_metadata(slots, cache_lens, new_mask, table, page, max_cache_len,
                                         backend=b)
             for b in ("torch", "triton")}
    write_kv(k_cache, v_cache, k, v, metas["torch"])
    return q, k_cache, v_cache, metas, head_dim ** -0.5


@pytest.mark.parametrize("seed", range(12))
def test_draft_attention_kernel_matches_torch_path(seed):
    from vllm_ouroboros.draft.attention import masked_attention

    q, k_cache, v_cache, metas, scale = _draft_case(seed)
    assert metas["triton"].use_kernel and not metas["torch"].use_kernel
    ref = masked_attention(q, k_cache, v_cache, metas["torch"], scale)
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache)]
    meta = metas["triton"]
    for name in ("cache_lens", "new_mask", "block_rows", "write_index"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    out = masked_attention(*args, meta, scale).cpu()
    err = (out - ref).abs().max().item()
    assert err <= 1e-3, f"max abs error {err:.3g}"


def test_draft_model_forward_through_kernel(tiny_models):
    """A whole draft forward (prefill, then a lookahead-shaped masked forward) gives the same
    hidden states through the kernel as through the torch path."""
    from vllm_ouroboros.draft.model import DraftModel

    outs = {}
    for backend in ("torch", "triton"):
        m = DraftModel.from_pretrained(tiny_models["draft"], dtype=torch.float32, device=DEVICE)
        m.allocate_cache(3, 96)
        m.attention_backend = backend
        outs[backend] = prefill_then_masked_forward(m, DEVICE)
    for a, b in zip(outs["torch"], outs["triton"]):
        assert (a - b).abs().max().item() <= 1e-3


def test_draft_attention_backend_choice():
    from vllm_ouroboros.draft.attention import build_attention_metadata

    one = torch.zeros(1, dtype=torch.long)
    table = torch.arange(1, 6, dtype=torch.int32)[None]
    mask = lambda Q: torch.eye(Q, dtype=torch.bool)[None]  # noqa: E731

    def meta(slots, Q, **kw):
        return build_attention_metadata(slots, slots, mask(Q).to(slots.device),
                                        table.to(slots.device), 16, 0, **kw)

    # auto: the torch path for CPU tensors; on CUDA the kernel up to 64 new tokens per row
    assert not meta(one, 8).use_kernel
    if DEVICE == "cuda":
        c = one.cuda()
        assert meta(c, 8).use_kernel
        assert not meta(c, 65).use_kernel
    assert not meta(one, 65).use_kernel
    with pytest.raises(ValueError, match="at most 64"):
        meta(one, 65, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        meta(one, 8, backend="cuda")


# ---------------------------------------------------------------------------------------------
# The check before serving (check_kernel): passes on a working build, names what failed otherwise
# ---------------------------------------------------------------------------------------------
# A few launch configurations (each compiles, or runs in the interpreter); all of them, as at
# load, only in test_check_kernel_passes_for_the_real_pair.
CHECK_SIZES = dict(max_query_len=4, max_splits=4)


def check_caches(layout, dtype=torch.float32, blocks=6, block_size=16, hkv=2, head_dim=32):
    """Random K/V caches [blocks, block_size, hkv, head_dim]: contiguous, or as
    patches/tree_attention's views read vLLM's FlashAttention cache (key | value per token)."""
    g = torch.Generator().manual_seed(5)
    if layout == "contiguous":
        kv = torch.randn(2, blocks, block_size, hkv, head_dim, generator=g).to(DEVICE, dtype)
        return kv[0], kv[1]
    raw = torch.randn(blocks, hkv, block_size, 2 * head_dim, generator=g).to(DEVICE, dtype)
    kv = raw.transpose(1, 2)
    return kv[..., :head_dim], kv[..., head_dim:]


@pytest.mark.parametrize("layout", ["contiguous", "key_value_per_token"])
def test_check_kernel_passes_on_a_working_build(layout):
    k, v = check_caches(layout)
    assert ta.check_kernel(k, v, num_heads=4, **CHECK_SIZES) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="the real pair's shapes in bf16 need a GPU (the "
                                                 "interpreter would take minutes)")
@pytest.mark.parametrize("heads,hkv,head_dim", [(14, 2, 64), (12, 2, 128)])
def test_check_kernel_passes_for_the_real_pair(heads, hkv, head_dim):
    k, v = check_caches("key_value_per_token", torch.bfloat16, blocks=24, hkv=hkv, head_dim=head_dim)
    assert ta.check_kernel(k, v, num_heads=heads) is None


class _Launch:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args)` calls `fn(*args)`."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def test_check_kernel_names_a_failing_launch(monkeypatch):
    def launch(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 101376")

    monkeypatch.setattr(ta, "_pick_kernel", lambda device: (_Launch(launch), None))
    reason = ta.check_kernel(*check_caches("contiguous"), num_heads=4, **CHECK_SIZES)
    assert reason.startswith("1 tree nodes, S = 1, torch.float32, 4/2 heads, D = 32: RuntimeError: "
                             "out of resource: shared memory"), reason


def test_check_kernel_names_wrong_numbers(monkeypatch):
    def launch(q, k_cache, v_cache, out, *args, **kwargs):
        out.zero_()

    monkeypatch.setattr(ta, "_pick_kernel", lambda device: (_Launch(launch), None))
    reason = ta.check_kernel(*check_caches("contiguous"), num_heads=4, **CHECK_SIZES)
    assert "differs from the torch path by" in reason, reason


def test_check_kernel_needs_room_for_the_tree():
    k, v = check_caches("contiguous", blocks=2, block_size=16)
    with pytest.raises(ValueError, match="cannot hold 64 tree nodes"):
        ta.check_kernel(k, v, num_heads=4, max_query_len=40)


def test_serving_launches_reuse_the_checked_binaries(monkeypatch):
    """Every launch a server makes must find a binary that check_kernel compiled before serving:
    one that does not compiles on the clock in a request's step (~1 s each on a GPU, and vLLM's
    JIT monitor flags it). Serving passes the step's index arrays as views at any offset of one
    packed upload (host_copy.packed_copy), batches of any size, and the engine's block table;
    the check passes fresh tensors and one request. The launches' compile keys (Triton's
    specialisation of each argument) must all be among the check's."""
    launches = []
    kernel, reason = ta._pick_kernel(torch.device(DEVICE))
    assert kernel is not None, reason
    monkeypatch.setattr(ta, "_pick_kernel", lambda device: (Recorder(kernel, launches), None))
    monkeypatch.setattr(ta, "tree_attention_merge_kernel",
                        Recorder(ta.tree_attention_merge_kernel, launches))
    assert ta.check_kernel(*check_caches("contiguous"), num_heads=4, **CHECK_SIZES) is None
    checked = {compile_key(*launch) for launch in launches}
    assert any(key[0] == "tree_attention_merge_kernel" for key in checked)

    def packed(t, offset):  # t's values in a view `offset` elements into a larger buffer
        buf = torch.zeros(offset + t.numel(), dtype=t.dtype, device=t.device)
        buf[offset:] = t.reshape(-1)
        return buf[offset:].view(t.shape)

    rng = random.Random(7)
    served = []
    for case in range(8):
        n_req = rng.choice([1, 2, 3, 5])
        trees = [random_parents(rng.choice(TREE_KINDS), rng.randint(1, CHECK_SIZES["max_query_len"]), rng)
                 for _ in range(n_req)]
        batch, _, _ = make_batch([rng.randint(0, 40) for _ in trees], trees, hkv=2, group=2,
                                 head_dim=32, block_size=16, seed=case,
                                 extra_table_cols=rng.randint(1, 20))
        batch = on_device(batch)
        for name in ("prefix_lens", "query_start", "tree_mask"):
            batch[name] = packed(batch[name], rng.randint(1, 7))
        del launches[:]
        num_splits = rng.choice([None, 1, 2, 3, 4])
        tree_attention(**batch, backend="triton", num_splits=num_splits,
                       max_query_len=max(len(t) for t in trees))
        served += [(compile_key(*launch), n_req, num_splits) for launch in launches]
    missing = [(n_req, s, key) for key, n_req, s in served if key not in checked]
    assert not missing, f"{len(missing)} serving launches would compile: {missing[0]}"


def test_target_layer_check_and_fallback(monkeypatch):
    """patches/tree_attention: the check runs on scratch caches laid out as the layer's (its own
    cache untouched); a failure makes the layer's tree rows use the torch path."""
    from vllm_ouroboros.patches import tree_attention as pta

    class FlashAttentionImpl:  # the name selects the layout, as for vLLM's class
        num_heads, head_size, scale = 4, 32, 32 ** -0.5

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
            return output  # the causal result (not needed here)

    class Layer:
        impl = FlashAttentionImpl()
        kv_cache = torch.zeros(3, 2, 16, 64, device=DEVICE)  # [blocks, Hkv, block_size, 2 D]

    layer = Layer()
    assert pta.check_layer_kernel(layer, max_nodes=4) is None
    assert not layer.kv_cache.any()

    monkeypatch.setattr(ta, "_pick_kernel", lambda device: (_Launch(lambda *a, **k: 1 / 0), None))
    reason = pta.check_layer_kernel(layer, max_nodes=4)
    assert "ZeroDivisionError" in reason
    # install() on a CUDA runner (a stand-in): the check's verdict picks the layers' path.
    runner = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1), uses_mrope=False,
        compilation_config=SimpleNamespace(static_forward_context={"layers.0.attn": layer}),
        device=SimpleNamespace(type="cuda"), kv_cache_config=SimpleNamespace(kv_cache_groups=[None]),
        input_batch=SimpleNamespace(block_table=[SimpleNamespace(block_size=16)]))
    for verdict, backend in ((None, "auto"), (reason, "torch")):
        monkeypatch.setattr(pta, "check_layer_kernel", lambda layer, max_nodes, verdict=verdict: verdict)
        assert pta.install(runner) is None and layer.impl._ouroboros_backend == backend
    backends, calls = [], []

    class Spy:  # a plan per step and layer shape, called by every layer
        def __init__(self, q, *args, backend, **kwargs):
            backends.append(backend)

        def __call__(self, q, k_cache, v_cache):
            calls.append(q.shape)
            return torch.ones_like(q)

    monkeypatch.setattr(pta, "TreeAttentionPlan", Spy)
    rows = torch.tensor([1, 2], device=DEVICE)
    step = pta.TreeAttentionStep(
        q_rows=rows, q_start=torch.tensor([0, 2], dtype=torch.int32, device=DEVICE),
        prefix_lens=torch.tensor([5], dtype=torch.int32, device=DEVICE),
        bits=torch.tensor([1, 3], device=DEVICE), block_table=torch.zeros(1, 3, dtype=torch.int32,
                                                                          device=DEVICE),
        write_local=torch.tensor([1], device=DEVICE), write_rows=torch.tensor([2], device=DEVICE),
        max_rows=2, max_prefix=5)
    out = torch.zeros(3, 4 * 32, device=DEVICE)
    pta.set_active(step)
    try:
        for _ in range(2):  # two layers of one forward: one plan
            layer.impl.forward(layer, torch.randn(3, 4 * 32, device=DEVICE), None, None, layer.kv_cache,
                               object(), output=out)
    finally:
        pta.set_active(None)
    assert backends == ["torch"] and len(calls) == 2
    assert out[2].eq(1).all() and not out[:2].any()


def test_tree_refused_where_only_the_last_stage_or_other_positions_would_see_it():
    """install() returns why the tree cannot run (the step then verifies the chain) before it
    wraps anything: under pipeline parallelism vLLM gives the drafter, hence our step, to the
    last stage only; with M-RoPE the model reads positions our tree rows do not move; under
    full CUDA graphs on a GPU the captured attention would replay without the tree rows."""
    from types import SimpleNamespace

    from vllm_ouroboros.patches import tree_attention as pta

    class Mode:
        name = "FULL_AND_PIECEWISE"

        def has_full_cudagraphs(self):
            return True

    def runner(stages=1, mrope=False, device="cpu", mode=None, ubatching=False):
        ctx = {}  # no layers: a runner the refusals do not stop says so
        return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=stages,
                                                               use_ubatching=ubatching),
                               uses_mrope=mrope, device=torch.device(device),
                               compilation_config=SimpleNamespace(cudagraph_mode=mode,
                                                                  static_forward_context=ctx))

    assert "pipeline parallelism (2 stages)" in pta.install(runner(stages=2))
    assert "M-RoPE" in pta.install(runner(mrope=True))
    assert "micro-batching" in pta.install(runner(ubatching=True))
    assert "PIECEWISE" in pta.install(SimpleNamespace(**{**vars(runner(mode=Mode())),
                                                         "device": SimpleNamespace(type="cuda")}))
    assert pta.install(runner(mode=Mode())) == "no attention layers found in the model runner"
    fused = runner()
    fused.compilation_config.pass_config = SimpleNamespace(fuse_attn_quant=True)
    assert "fuse_attn_quant" in pta.install(fused)  # quantized output: the tree rows would be unscaled
    with pytest.raises(RuntimeError, match="uses_mrope"):
        pta.install(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                                    compilation_config=None))


def test_off_cuda_the_tree_rows_take_the_torch_path():
    """On a CPU engine the tree rows use the batched torch path, also where TRITON_INTERPRET=1 is
    set (it is for the kernel tests; a CPU server with it crashed on vLLM's d-major key views,
    and the interpreter is far slower)."""
    from types import SimpleNamespace

    from vllm_ouroboros.patches import tree_attention as pta

    class FlashAttentionImpl:  # the name selects the layout, as for vLLM's class
        num_heads, head_size, scale = 4, 32, 32 ** -0.5

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
            return output

    layer = SimpleNamespace(impl=FlashAttentionImpl(), kv_cache=torch.zeros(3, 2, 16, 2, 32))
    assert pta.kv_views(layer)[0].shape[1] == 16
    runner = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1), uses_mrope=False,
        device=torch.device("cpu"),
        compilation_config=SimpleNamespace(cudagraph_mode=None, static_forward_context={"l0": layer}),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[None]),
        input_batch=SimpleNamespace(block_table=[SimpleNamespace(block_size=16)]))
    assert pta.install(runner) is None
    assert layer.impl._ouroboros_backend == "torch"


def test_layers_the_tree_cannot_serve_are_refused():
    """A layer whose head size passes the kernel's bound (256: the tree's plan refuses it on the
    torch path too), or whose cache decode context parallelism splits across ranks (the tree
    rows would read this rank's part): the tree is refused with the reason; a plain layer is not."""
    from types import SimpleNamespace

    from vllm_ouroboros.patches import tree_attention as pta

    def layer(**impl):
        kind = type("FlashAttentionImpl", (), {})
        obj = kind()
        vars(obj).update({"head_size": 128, **impl})
        return SimpleNamespace(impl=obj, kv_cache=None)

    assert pta._unsupported("l0", layer()) is None
    assert pta._unsupported("l0", layer(head_size=512)) == "head size 512 > 256 in l0"
    assert "decode context parallelism (2 ranks)" in pta._unsupported("l0", layer(dcp_world_size=2))


def test_draft_model_checks_the_kernel_it_will_use(tiny_models, monkeypatch):
    """DraftModel.check_attention_kernel: "triton" is checked wherever it is asked for (here the
    interpreter) and raises on a failing kernel; "torch", and "auto" off CUDA, run nothing."""
    from vllm_ouroboros.draft.model import DraftModel

    m = DraftModel.from_pretrained(tiny_models["draft"], dtype=torch.float32, device=DEVICE)
    m.allocate_cache(2, 64)
    m.attention_backend = "triton"
    monkeypatch.setattr("vllm_ouroboros.draft.model.MAX_KERNEL_QUERIES", 4)  # a few configurations
    assert m.check_attention_kernel() is None
    monkeypatch.setattr(ta, "_pick_kernel", lambda device: (_Launch(lambda *a, **k: 1 / 0), None))
    with pytest.raises(RuntimeError, match="failed its check.*ZeroDivisionError"):
        m.check_attention_kernel()
    m.attention_backend = "auto"
    if DEVICE == "cuda":  # falls back to SDPA, with the reason
        assert "ZeroDivisionError" in m.check_attention_kernel()
        assert m.attention_backend == "torch"
    else:
        assert m.check_attention_kernel() is None and m.attention_backend == "auto"
    m.attention_backend = "torch"
    assert m.check_attention_kernel() is None


def test_triton_path_is_active():
    # guards every parity test above: they must have run the kernel, not a fallback
    if DEVICE == "cpu":
        assert not _TRITON_WAS_IMPORTED or ta._is_interpreted(triton.language.zeros), \
            "triton was imported before this module without TRITON_INTERPRET=1"
    assert ta._pick_kernel(torch.device(DEVICE)) == (ta.tree_attention_kernel, None)


def test_plan_serves_every_layer_of_a_step():
    """TreeAttentionPlan: the checks and launch plan made once (at the first layer, as the
    attention patch and the draft make it) give each layer what tree_attention gives it, split
    and not; a layer whose tensors differ from the plan's is refused, not run."""
    rng = random.Random(11)
    trees = [random_parents("ouroboros", 10, rng), random_parents("chain", 3, rng)]
    batch, _, _ = make_batch([40, 9], trees, hkv=2, group=2, head_dim=32, block_size=16, seed=11)
    batch = on_device(batch)
    meta = [batch[k] for k in ("block_table", "prefix_lens", "query_start", "tree_mask")]
    layers = [(batch["q"], batch["k_cache"], batch["v_cache"])]
    layers += [(torch.randn_like(batch["q"]), torch.randn_like(batch["k_cache"]), torch.randn_like(batch["v_cache"]))
               for _ in range(2)]
    for splits in (1, 3):
        plan = ta.TreeAttentionPlan(*layers[0], *meta, batch["scale"], max_query_len=10, num_splits=splits)
        for q, k, v in layers:
            want = tree_attention(q, k, v, *meta, batch["scale"], max_query_len=10, num_splits=splits)
            assert torch.equal(plan(q, k, v), want)
    q, k, v = layers[0]
    with pytest.raises(ValueError, match="must match the plan's"):
        plan(q[:-1], k, v)
    with pytest.raises(ValueError, match="must match the plan's"):
        plan(q, k[:-1], v[:-1])
    with pytest.raises(ValueError, match="must match the plan's"):
        plan(q.double(), k.double(), v.double())


# ---------------------------------------------------------------------------------------------
# RoPE and the tree's K/V write inside the kernel (TreeAttentionPlan.run's `rope`: the draft's)
# ---------------------------------------------------------------------------------------------
ROPE_GRID = [(g, hkv, d, bs, s, dt) for (g, hkv, d, bs), s, dt in itertools.product(
    [(1, 2, 32, 16), (2, 1, 64, 4), (7, 2, 64, 16), (4, 1, 80, 16), (3, 2, 128, 4)],
    (1, 2), (torch.float32, torch.bfloat16))]


@pytest.mark.parametrize("group,hkv,head_dim,block_size,splits,dtype", ROPE_GRID)
def test_rope_in_the_kernel_is_rope_write_then_attention(group, hkv, head_dim, block_size, splits, dtype):
    """The kernel with `rope` gives, bit for bit, what RoPE in torch (the draft's apply_rope
    roundings), the K/V written into the cache and the kernel without rope give: the output and
    every cache entry, on ragged batches of trees (also masks that are not trees), GQA, padded
    head dims, pages cut mid-tree, single pass and split-KV."""
    rng = random.Random(f"rope-{group}-{hkv}-{head_dim}-{block_size}-{splits}-{dtype}")
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    prefixes = [rng.randint(0, 40) for _ in range(rng.randint(1, 3))]
    trees = [random_parents(rng.choice(TREE_KINDS), rng.randint(1, 20), rng) for _ in prefixes]
    batch, _, _ = make_batch(prefixes, trees, hkv=hkv, group=group, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, seed=rng.randrange(100))
    T, hq = batch["q"].shape[0], hkv * group
    # The tree's own slots hold NaN until written: a read of one before its write poisons the output.
    qkv = torch.randn(T, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    cos, sin = (torch.rand(T, head_dim, generator=g).mul(2).sub(1).to(dtype) for _ in range(2))
    q = qkv.view(T, -1, head_dim)[:, :hq]
    n = batch["query_start"][1:] - batch["query_start"][:-1]
    b_of = torch.repeat_interleave(torch.arange(len(prefixes)), n)
    pos = batch["prefix_lens"][b_of] + torch.arange(T) - batch["query_start"][b_of]
    rows = batch["block_table"][b_of, pos // block_size].long() * block_size + pos % block_size
    for name in ("k_cache", "v_cache"):
        batch[name].view(-1, hkv, head_dim)[rows] = float("nan")

    want_k, want_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    want_q = rope_qkv_write_reference(qkv[None], cos[None, :, None], sin[None, :, None], want_k, want_v,
                                      rows[None], hq, hkv, head_dim)[0]
    ref = dict(batch, q=want_q, k_cache=want_k, v_cache=want_v)
    want = tree_attention(**on_device(ref), backend="triton", num_splits=splits).cpu()

    dev = on_device(dict(batch, q=q.contiguous()))
    meta = [dev[n] for n in ("block_table", "prefix_lens", "query_start", "tree_mask")]
    plan = ta.TreeAttentionPlan(dev["q"], dev["k_cache"], dev["v_cache"], *meta, dev["scale"],
                                backend="triton", num_splits=splits)
    rope = tuple(t.to(DEVICE) for t in (qkv, cos, sin, rows))
    got = plan.run(dev["q"], dev["k_cache"], dev["v_cache"], rope=rope).cpu()
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)
    for have, expect in ((dev["k_cache"].cpu(), want_k), (dev["v_cache"].cpu(), want_v)):
        same = (have == expect) | (have.isnan() & expect.isnan())
        assert same.all()


def test_rope_inputs_are_checked():
    batch, _, _ = make_batch([3], [[-1, 0]], hkv=1, group=2, head_dim=16, block_size=16)
    dev = on_device(batch)
    meta = [dev[n] for n in ("block_table", "prefix_lens", "query_start", "tree_mask")]
    plan = ta.TreeAttentionPlan(dev["q"], dev["k_cache"], dev["v_cache"], *meta, dev["scale"],
                                backend="triton")
    qkv = torch.zeros(2, 4 * 16, device=DEVICE)
    cs = torch.zeros(2, 16, device=DEVICE)
    rows = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="qkv must be"):
        plan(dev["q"], dev["k_cache"], dev["v_cache"], rope=(qkv[:, :48], cs, cs, rows))
    with pytest.raises(ValueError, match="write_index must be"):
        plan(dev["q"], dev["k_cache"], dev["v_cache"], rope=(qkv, cs, cs, rows.int()))
    # The caches are checked with rope too, at every layer's call (a plan serves all layers).
    with pytest.raises(ValueError, match="must match the plan"):
        plan(dev["q"], dev["k_cache"][:1], dev["v_cache"][:1], rope=(qkv, cs, cs, rows))
    torch_plan = ta.TreeAttentionPlan(dev["q"], dev["k_cache"], dev["v_cache"], *meta, dev["scale"],
                                      backend="torch")
    for call in (torch_plan, torch_plan.run):
        with pytest.raises(ValueError, match="needs the Triton kernel"):
            call(dev["q"], dev["k_cache"], dev["v_cache"], rope=(qkv, cs, cs, rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_rope_kernel_passes_and_names_wrong_numbers(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 8, 16, 2, 32, generator=g).to(DEVICE, dtype)
    assert ta.check_rope_kernel(kv[0], kv[1], 4, max_query_len=16) is None
    real = ta.TreeAttentionPlan.run

    def off_by_one_row(self, q, k_cache, v_cache, out=None, rope=None):
        if rope is not None:
            rope = (rope[0], rope[1], rope[2], rope[3] - 1)  # writes one cache row too early
        return real(self, q, k_cache, v_cache, out, rope)

    monkeypatch.setattr(ta.TreeAttentionPlan, "run", off_by_one_row)
    why = ta.check_rope_kernel(kv[0], kv[1], 4, max_query_len=16)
    assert why is not None and "differs" in why, why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_forward_with_rope_in_the_kernel_is_bit_identical(tiny_models, dtype):
    """The draft's fused layers with RoPE and the KV write inside the attention kernel give the
    hidden states and caches of the layers with rope_qkv_write apart, bit for bit (a prefill
    through the torch path, then a masked lookahead-shaped forward through the kernel)."""
    from vllm_ouroboros.draft.model import DraftModel

    outs = {}
    for inside in (False, True):
        m = DraftModel.from_pretrained(tiny_models["draft"], dtype=dtype, device=DEVICE)
        m.allocate_cache(3, 96)
        m.fused_ops, m.attention_backend, m.rope_in_attention = True, "triton", inside
        outs[inside] = (*prefill_then_masked_forward(m, DEVICE), m.k_cache.cpu(), m.v_cache.cpu())
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


def test_draft_model_turns_rope_in_the_kernel_off_where_its_check_fails(tiny_models, monkeypatch):
    from vllm_ouroboros.draft.model import DraftModel

    m = DraftModel.from_pretrained(tiny_models["draft"], dtype=torch.float32, device=DEVICE)
    m.allocate_cache(2, 64)
    m.attention_backend = "triton"
    assert m.rope_in_attention  # head dim 32
    monkeypatch.setattr("vllm_ouroboros.draft.model.MAX_KERNEL_QUERIES", 4)
    assert m.check_attention_kernel() is None and m.rope_in_attention
    monkeypatch.setattr(ta, "check_rope_kernel", lambda *a, **k: "rope: wrong")
    assert m.check_attention_kernel() is None  # the attention kernel itself stays
    assert not m.rope_in_attention and m.attention_backend == "triton"
