"""The target side of one step, as far as it needs no vLLM: the plan read from the scheduled
layout (step_plan.py) and the token trees on the device (tree.py) that the walk (verify.py)
reads after the forward. patches/tree_verify.py calls it with what vLLM prepared; the GPU
benchmark (scripts/bench_gpu.py, "target step") times it where there is no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ouroboros.host_copy import to_device
from vllm_ouroboros.step_plan import StepPlan, build_plan, ragged_arange
from vllm_ouroboros.tree import TokenTree, tree_from_flat


@dataclass
class TargetStep:
    """What one step's verification needs after the forward."""

    plan: StepPlan
    tree: TokenTree
    row_start: torch.Tensor  # [B] first logit row (the root's) of each request
    root_rows: torch.Tensor  # [B] query row of each request's root


@dataclass
class StepOutcome:
    """For the pool feedback: target argmax per tree row and what each request accepted."""

    tree: TokenTree
    target_next: torch.Tensor   # [B, N + 1]
    num_accepted: torch.Tensor  # [B] draft + suffix tokens accepted
    suffix_index: torch.Tensor  # [B] suffix on the accepted path, -1 none


def plan_target_step(num_drafts: np.ndarray, draft_len: np.ndarray, suffix_len: np.ndarray,
                     query_start: np.ndarray, num_computed: np.ndarray, draft_token_ids: torch.Tensor,
                     cu_num_sampled: torch.Tensor, phrase_len: int) -> TargetStep:
    """Plan the step (build_plan) and lay out every request's tree (chains included).

    Shape: num_drafts [B] (draft tokens vLLM scheduled per request), draft_len [B] and
    suffix_len [B, K] (the layout the proposer sent), query_start [B + 1] (first query row of
    each request: its root), num_computed [B] (the root's position), all host arrays;
    draft_token_ids [sum num_drafts] and cu_num_sampled [B] (vLLM's SpecDecodeMetadata: the
    flat drafted tokens, the end of each request's logit rows) on the device."""
    c = np.asarray(num_drafts, np.int64)
    B = len(c)
    qs = np.asarray(query_start[:B + 1], np.int64)
    plan = build_plan(c, draft_len, suffix_len, qs, num_computed)
    dev = draft_token_ids.device
    F = max(int(c.max(initial=0)), 1)
    row, col, dlen, slen, c1, roots = to_device(dev, np.repeat(np.arange(B), c), ragged_arange(c),
                                                plan.draft_len, plan.suffix_len, c + 1, qs[:B])
    flat = torch.zeros(B, F, dtype=torch.long, device=dev)
    flat[row, col] = draft_token_ids.long()
    tree = tree_from_flat(flat, dlen, slen, D=max(int(plan.draft_len.max(initial=0)), 0), L=phrase_len)
    return TargetStep(plan=plan, tree=tree, row_start=cu_num_sampled.long() - c1, root_rows=roots)
