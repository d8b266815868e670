"""The target side of one step, as far as it needs no vLLM: the plan read from the scheduled
layout (step_plan.py) and the token trees on the device (tree.py) that the walk (verify.py)
reads after the forward. patches/tree_verify.py calls it with what vLLM prepared; the GPU
benchmark (scripts/bench_gpu.py, "target step") times it where there is no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ouroboros.step_plan import StepPlan, build_plan
from vllm_ouroboros.tree import TokenTree


@dataclass
class TargetStep:
    """What one step's verification needs after the forward."""

    plan: StepPlan
    tree: TokenTree
    row_start: np.ndarray  # [B] first logit row (the root's) of each request
    root_rows: np.ndarray  # [B] query row of each request's root


@dataclass
class StepOutcome:
    """For the pool feedback, on the host: the tree (its layout), its tokens, the target's
    argmax per tree row and what each request accepted."""

    tree: TokenTree
    tokens: np.ndarray        # [B, N]
    target_next: np.ndarray   # [B, N + 1]
    num_accepted: np.ndarray  # [B] draft + suffix tokens accepted
    suffix_index: np.ndarray  # [B] suffix on the accepted path, -1 none
    # False where the step rejected every draft without judging it (tree_verify.root_sample):
    # the pool and the counters learn from what the target said, the acceptance estimates do
    # not (they would read rejections the drafts never earned).
    drafts_judged: bool = True


def plan_target_step(num_drafts: np.ndarray, draft_len: np.ndarray, suffix_len: np.ndarray,
                     query_start: np.ndarray, num_computed: np.ndarray, draft_token_ids: torch.Tensor,
                     phrase_len: int) -> TargetStep:
    """Plan the step (build_plan) and lay out every request's tree (chains included).

    Shape: num_drafts [B] (draft tokens vLLM scheduled per request), draft_len [B] and
    suffix_len [B, K] (the layout the proposer sent), query_start [B + 1] (first query row of
    each request: its root), num_computed [B] (the root's position), all host arrays;
    draft_token_ids [sum num_drafts] on the device (SpecDecodeMetadata's flat drafted tokens).
    Everything but the tokens is host arithmetic (the plan's TreeLayout, which the tree's
    tokens are gathered for): one upload and one gather on the device.
    Logit rows are vLLM's: 1 + num_drafts per request, in batch order.
    """
    c = np.asarray(num_drafts, np.int64)
    B = len(c)
    qs = np.asarray(query_start[:B + 1], np.int64)
    # The root is taken as a request's first scheduled row: vLLM 0.32 schedules a request with
    # drafts its drafts plus one token, no more (prefill chunks get no drafts). A vLLM that
    # scheduled more would put the tree's masks, positions and KV moves on the wrong rows.
    odd = np.nonzero((c > 0) & (qs[1:] - qs[:-1] != c + 1))[0]
    if len(odd):
        from vllm_ouroboros.plugin import supported_vllm_range

        i = int(odd[0])
        raise RuntimeError(
            f"ouroboros: request {i} of the batch was scheduled {int(qs[i + 1] - qs[i])} tokens with "
            f"{int(c[i])} draft tokens; the token tree needs drafts plus one. Supported vLLM "
            f"versions: {supported_vllm_range()}.")
    plan = build_plan(c, draft_len, suffix_len, qs, num_computed, L=phrase_len)
    tree = plan.layout.tree(draft_token_ids.device, flat=draft_token_ids)
    return TargetStep(plan=plan, tree=tree, row_start=np.cumsum(c + 1) - (c + 1), root_rows=qs[:B])
