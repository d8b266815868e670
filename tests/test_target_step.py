"""The target side of a step without vLLM (target_step.py -> verify.py -> kv_relocate.py): the
plan and trees from host lengths and vLLM's flat drafts, the walk read back once, the KV move of
an accepted later suffix; and on CUDA, that the whole of it waits for the GPU once."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from vllm_ouroboros.kv_relocate import move_kv, relocation_slots
from vllm_ouroboros.target_step import plan_target_step
from vllm_ouroboros.tree import build_tree
from vllm_ouroboros.verify import verify

V = 64


def planted_step(device, B=4, n=3, K=3, L=2, seed=0):
    """B requests of a draft of n tokens and K suffixes of L, scheduled whole; request b's
    logits follow its draft, then suffix b % K to its end, then a bonus 60 + b. Returns the
    plan's inputs, the logits and what each request must emit."""
    rng = np.random.default_rng(seed)
    c = np.full(B, n + K * L, np.int64)
    qs = np.concatenate([[0], np.cumsum(c + 1)])
    tokens = rng.integers(3, 50, (B, n + K * L))
    want_next = np.zeros((B, n + K * L + 1), np.int64)  # argmax per row (root, then node i)
    emitted = []
    for b in range(B):
        k = b % K
        s0 = n + k * L
        path = list(tokens[b, :n]) + list(tokens[b, s0:s0 + L])
        want_next[b, :n] = tokens[b, :n]  # after the root and after draft node i - 1
        want_next[b, n] = tokens[b, s0]  # after the last draft node: the head of suffix k
        want_next[b, 1 + s0:s0 + L] = tokens[b, s0 + 1:s0 + L]
        want_next[b, s0 + L] = 60 + b  # after suffix k's last node
        emitted.append(path + [60 + b])
    logits = torch.nn.functional.one_hot(torch.from_numpy(want_next.ravel()), V).float().to(device)
    ids = torch.from_numpy(tokens.ravel()).to(device=device, dtype=torch.int32)  # vLLM's dtype
    inputs = (c, np.full(B, n), np.full((B, K), L), qs, np.full(B, 100), ids, L)
    return inputs, logits, emitted


def run_step(inputs, logits, caches, slot_mapping):
    step = plan_target_step(*inputs)
    v = verify(step.tree, logits, step.row_start)
    src, dst = relocation_slots(v.result, step.root_rows, slot_mapping)
    move_kv(caches, src, dst)
    return step, v, src, dst


def test_planted_paths_are_accepted_and_later_suffixes_moved(device):
    inputs, logits, emitted = planted_step(device)
    B, n, L = 4, 3, 2
    caches = [tuple(torch.randn(16, 8, 1, 2, device=device) for _ in range(2))]
    before = [c.clone() for c in caches[0]]
    slot_mapping = torch.arange(int(logits.shape[0]), device=device) + 5
    step, v, src, dst = run_step(inputs, logits, caches, slot_mapping)
    assert [v.token_ids[b, :v.result.num_emitted[b]].tolist() for b in range(B)] == emitted
    assert v.result.suffix_index.tolist() == [0, 1, 2, 0]
    # The tree is what build_tree lays out from the same drafts and suffixes.
    tok = inputs[5].long().view(B, -1)
    ref = build_tree(tok[:, :n], torch.full((B,), n, device=device), tok[:, n:].reshape(B, 3, L),
                     torch.full((B, 3), L, device=device))
    assert torch.equal(step.tree.tokens, ref.tokens) and torch.equal(step.tree.parents, ref.parents)
    # Requests 1 and 2 won suffix 1 / 2: their nodes move behind the draft, row for row.
    rows = 1 + n + np.arange(L)
    want_src = [int(step.root_rows[b]) + 1 + n + k * L + j for b, k in ((1, 1), (2, 2)) for j in range(L)]
    want_dst = [int(step.root_rows[b]) + r for b in (1, 2) for r in rows]
    assert (src - 5).tolist() == want_src and (dst - 5).tolist() == want_dst
    k_cache = caches[0][0].flatten(0, 1)
    assert torch.equal(k_cache[dst], before[0].flatten(0, 1)[src])


def test_a_prefill_chunk_in_the_batch_keeps_logit_rows_and_query_rows_apart(device):
    """A request prefilling a chunk (no drafts) takes its chunk's query rows but one logit row:
    the drafting requests' logits start at 1 + drafts per request before them (row_start), their
    roots at their first query row (root_rows). Without a chunk the two are equal, so the walk
    read the wrong rows or the KV moved the wrong slots, unseen by the planted step alone."""
    (c, n, sl, qs, comp, ids, L), logits, emitted = planted_step(device, B=3)
    chunk, K = 5, sl.shape[1]
    inputs = (np.concatenate([[0], c]), np.concatenate([[0], n]), np.concatenate([np.zeros((1, K), np.int64), sl]),
              np.concatenate([[0], qs + chunk]), np.concatenate([[0], comp]), ids, L)
    logits = torch.cat([torch.nn.functional.one_hot(torch.tensor([7]), V).float().to(device), logits])
    caches = [tuple(torch.randn(16, 8, 1, 2, device=device) for _ in range(2))]
    before = caches[0][0].clone()
    slot_mapping = torch.arange(int(qs[-1]) + chunk, device=device) + 5
    step, v, src, dst = run_step(inputs, logits, caches, slot_mapping)
    assert step.row_start.tolist() == [0, 1, 1 + c[0] + 1, 1 + 2 * (c[0] + 1)]
    assert step.root_rows.tolist() == [0, chunk, chunk + c[0] + 1, chunk + 2 * (c[0] + 1)]
    assert [v.token_ids[b, :v.result.num_emitted[b]].tolist() for b in range(4)] == [[7]] + emitted
    d = int(n[0])
    want_src = [int(step.root_rows[b]) + 1 + d + k * L + j for b, k in ((2, 1), (3, 2)) for j in range(L)]
    want_dst = [int(step.root_rows[b]) + 1 + d + j for b in (2, 3) for j in range(L)]
    assert (src - 5).tolist() == want_src and (dst - 5).tolist() == want_dst
    assert torch.equal(caches[0][0].flatten(0, 1)[dst], before.flatten(0, 1)[src])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations: needs a CUDA device")
def test_target_step_synchronises_once():
    """Plan, trees, walk, relocation and KV move of a step wait for the GPU once: the walk's
    read-back (tempting: a .cpu() per result, or boolean indexing for the moves)."""
    inputs, logits, _ = planted_step("cuda")
    caches = [tuple(torch.randn(16, 8, 1, 2, device="cuda") for _ in range(2)) for _ in range(4)]
    slot_mapping = torch.arange(int(logits.shape[0]), device="cuda") + 5
    run_step(inputs, logits, caches, slot_mapping)  # warm-up: allocations, pinned blocks
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _, v, src, _ = run_step(inputs, logits, caches, slot_mapping)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert src.numel() == 2 * 2 and len(syncs) <= 1, syncs


def test_a_request_scheduled_more_than_its_drafts_plus_one_is_refused(device):
    """The tree's root is a request's first scheduled row, which holds while vLLM schedules a
    request with drafts its drafts plus one token (0.32): a vLLM that scheduled more (prompt
    tokens beside drafts) would put masks, positions and KV moves on the wrong rows, silently.
    It is refused naming the supported versions; a request without drafts may take any number."""
    inputs, _, _ = planted_step(device)
    c, qs = inputs[0].copy(), inputs[3].copy()
    plan_target_step(*inputs)
    qs[2:] += 1  # request 1: one token more than its drafts plus one
    with pytest.raises(RuntimeError, match=r"request 1 of the batch was scheduled 11 tokens with 9 draft "
                                           r"tokens.*Supported vLLM versions"):
        plan_target_step(c, *inputs[1:3], qs, *inputs[4:])
    c[1] = 0  # no drafts: a prefill chunk of any length
    plan_target_step(c, *inputs[1:3], qs, *inputs[4:])
