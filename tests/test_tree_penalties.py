"""patches/tree_penalties.py against vLLM's own penalties (float32, random trees): every row of a
penalized request equals vLLM's `apply_all_penalties` on that row alone with the output so far
plus the row's path (what the sampler without speculation would see there); other requests'
rows stay as they were; the same at every chunk size. The engine runs (greedy and seeded
requests with penalties through the walk, K = 1, 2, 3) are in tests/test_e2e_tiny.py ("bias")."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ouroboros.tree import TreeLayout

# vLLM is imported inside the tests: importing it at collection would import Triton before
# conftest.py sets TRITON_INTERPRET for the kernel tests.


def random_layout(rng, B):
    D, K, L = int(rng.integers(0, 5)), int(rng.integers(0, 4)), int(rng.integers(1, 5))
    return TreeLayout(rng.integers(0, D + 1, B), rng.integers(0, L + 1, (B, K)), D, L)


def reference_paths(lay: TreeLayout) -> list[list[list[int]]]:
    """Each valid node's path from the root (ancestors, then itself), walked up its parents."""
    out = []
    for b in range(lay.valid.shape[0]):
        rows = []
        for i in range(int(lay.num_nodes[b])):
            path, cur = [], i
            while cur >= 0:
                path.append(cur)
                cur = int(lay.parents[b, cur])
            rows.append(path[::-1])
        out.append(rows)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_path_nodes_walk_up_the_parents(seed):
    from vllm_ouroboros.patches.tree_penalties import path_nodes

    rng = np.random.default_rng(seed)
    lay = random_layout(rng, int(rng.integers(1, 6)))
    got = path_nodes(lay)
    for b, rows in enumerate(reference_paths(lay)):
        for i, path in enumerate(rows):
            assert got[b, i, :len(path)].tolist() == path and (got[b, i, len(path):] == -1).all()
        assert (got[b, int(lay.num_nodes[b]):] == -1).all()


@pytest.mark.parametrize("seed", range(12))
def test_every_tree_row_penalized_as_vllms_sampler_would_alone(seed):
    pytest.importorskip("vllm", reason="the penalties compared against are vLLM's")
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    from vllm_ouroboros.patches.tree_penalties import penalize_tree_rows, penalized_requests

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    B, V = int(rng.integers(1, 6)), int(rng.choice([17, 64, 384]))
    lay = random_layout(rng, B)
    N = lay.valid.shape[1]
    tokens = torch.randint(0, V, (B, max(N, 1)), generator=g)[:, :N]
    count = lay.num_nodes + 1
    row_start = np.concatenate([[0], np.cumsum(count)[:-1]]) + int(rng.integers(0, 3))  # rows before: others'
    R = int(row_start[-1] + count[-1]) + 1
    logits = torch.randn(R, V, generator=g) * 3
    # Penalties as vLLM's input batch holds them: host copies, device tensors; some neutral.
    freq = np.where(rng.random(B) < 0.5, rng.uniform(-2, 2, B), 0).astype(np.float32)
    pres = np.where(rng.random(B) < 0.5, rng.uniform(-2, 2, B), 0).astype(np.float32)
    rep = np.where(rng.random(B) < 0.5, rng.uniform(0.5, 2, B), 1).astype(np.float32)
    batch = SimpleNamespace(frequency_penalties_cpu=freq, presence_penalties_cpu=pres, repetition_penalties_cpu=rep)
    prompt_len = rng.integers(1, 12, B)
    prompts = torch.full((B, int(prompt_len.max())), V, dtype=torch.int64)
    for b in range(B):
        prompts[b, :prompt_len[b]] = torch.randint(0, V, (int(prompt_len[b]),), generator=g)
    outputs = [rng.integers(0, V, int(rng.integers(0, 9))).tolist() for _ in range(B)]
    sm = SimpleNamespace(prompt_token_ids=prompts, output_token_ids=outputs,
                         frequency_penalties=torch.from_numpy(freq), presence_penalties=torch.from_numpy(pres),
                         repetition_penalties=torch.from_numpy(rep))
    which = penalized_requests(batch, B)
    assert which.tolist() == [b for b in range(B) if freq[b] != 0 or pres[b] != 0 or rep[b] != 1]

    expect = logits.clone()
    paths = reference_paths(lay)
    for b in which.tolist():
        for j in range(int(count[b])):
            path = [] if j == 0 else paths[b][j - 1]
            row = int(row_start[b]) + j
            expect[row:row + 1] = apply_all_penalties(
                logits[row:row + 1].clone(), prompts[b:b + 1], sm.presence_penalties[b:b + 1],
                sm.frequency_penalties[b:b + 1], sm.repetition_penalties[b:b + 1],
                [outputs[b] + tokens[b, path].tolist()])
    for max_rows in (1, 3, 1000):
        got = logits.clone()
        penalize_tree_rows(got, sm, which, tokens, lay, row_start, max_rows)
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
    if len(which):
        assert not torch.equal(expect, logits), "the penalties changed nothing: a test that cannot fail"
