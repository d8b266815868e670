"""Model-runner area: verify draft + K suffixes as one token tree (read with model_runner.py).

Per step, for the ouroboros proposer:
  begin_step()  after vLLM prepared the inputs: read the scheduled layout (step_plan.py), give
                suffix k >= 1 nodes their depth positions, hand the tree rows to the attention
                (tree_attention.py) and build the TokenTree for the acceptance walk.
  sample()      instead of vLLM's rejection sampler: the tree walk (verify.py; chains too), then the
                KV of an accepted suffix k >= 1 is moved behind the draft (kv_relocate.py). Where the walk
                cannot honour the batch's sampling features (bad words, min_tokens, allowed
                tokens, custom logits processors), the tree is read as the chain draft +
                suffix 0 by vLLM's own rejection sampler: still one forward, still lossless, and
                the other suffixes still feed the pool. logit_bias and min_p go to every verified
                row, on either path (bias_min_p.py); penalties to every row in the walk
                (tree_penalties.py), by vLLM's sampler on its path. Where that sampler would get the batch
                wrong too (logprobs of chosen token ids beside such a feature: it drops them,
                and beside `logprobs` failed), the step such a request joins rejects its drafts
                unjudged and samples the roots as without speculation (root_sample), and the
                proposer drafts nothing until it leaves (drafting_pause).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import numpy as np
import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.host_copy import to_device, to_host
from vllm_ouroboros.patches import bias_min_p, tree_attention, tree_penalties
from vllm_ouroboros.patches._util import require
from vllm_ouroboros.step_plan import ragged_arange
from vllm_ouroboros.target_step import StepOutcome, TargetStep, plan_target_step

logger = logging.getLogger(LOGGER_NAME)

# Debugging aid (tests/test_tree_relocation.py): leave the accepted branch's KV where it is, to
# show that outputs go wrong without the move. Never set it in production.
_SKIP_RELOCATION = os.environ.get("OUROBOROS_DEBUG_SKIP_KV_RELOCATION", "0") == "1"


class TreeState:
    """Per-runner: whether the tree path is available (decided once: `prepare`)."""

    def __init__(self):
        self.checked = False
        self.reason: str | None = None
        self.walk = "torch"  # how sampled steps walk their trees (verify.verify's `walk`)
        self.kv_move = "torch"  # how a winning suffix's KV is moved (kv_relocate.move_kv's `backend`)

    def check(self, runner, drafter) -> None:
        self.checked = True
        if not drafter.cfg.tree_verification:
            self.reason = "tree_verification is off"
        elif drafter.cfg.tree_suffixes < 2:
            self.reason = "fewer than 2 suffixes: the chain is the tree"
        else:
            # A request's tree rows: its root and every drafted node.
            self.reason = _verdict(tree_attention.install, runner,
                                   max_nodes=min(tree_attention.MAX_TREE_NODES, drafter.num_spec_tokens + 1))
            # Under tensor parallelism the first rank sends trees to all: one rank whose kernel
            # failed its check must turn the tree off on every rank, not fail its first tree.
            if not drafter.all_ranks_ok(self.reason is None) and self.reason is None:
                self.reason = "the tree kernel cannot run on another tensor-parallel rank"
            if self.reason is not None:
                logger.warning("ouroboros: tree verification unavailable, verifying the chain "
                               "draft + best suffix instead: %s", self.reason)
        drafter.set_tree_available(self.reason)
        if runner.device.type == "cuda":
            # The sampled walk in one launch instead of ~140 per depth step, once it has been
            # compiled and compared with the torch walk at the engine's shapes.
            from vllm_ouroboros.kernels.sampled_walk import check_kernel

            why = _verdict(check_kernel, runner.device, drafter.cfg.num_suffixes,
                           runner.model_config.get_vocab_size())
            # Every rank walks its sampled trees and must accept the same tokens: one walk for all.
            if not drafter.all_ranks_ok(why is None) and why is None:
                why = "the kernel cannot run on another tensor-parallel rank"
            if why is None:
                self.walk = "triton"
            else:
                logger.warning("ouroboros: sampled steps walk their trees in torch: %s", why)
            # A winning suffix's KV moved in two launches for all layers instead of four indexing
            # calls per layer (kernels/kv_move.py), once compared with the torch copy here.
            from vllm_ouroboros.kernels.kv_move import check_kernel as check_kv_move
            from vllm_ouroboros.kv_relocate import warm_move

            why = _verdict(check_kv_move, runner.device)
            if why is None and self.reason is None:
                # The engine's own caches' variant, compiled now (a move runs only with the tree).
                why = _verdict(lambda: warm_move(_kv_caches(runner)))
            if why is None:
                self.kv_move = "triton"
            else:
                logger.warning("ouroboros: a winning suffix's KV is moved in torch: %s", why)


def _verdict(check, *args, **kwargs) -> str | None:
    """A start-up check's reason (None: it passed), an exception read as a reason: under tensor
    parallelism every rank must reach the collective that shares the verdicts (all_ranks_ok),
    and one rank raising left the others waiting there; alone, the path serves without it."""
    try:
        return check(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure means: serve without this kernel
        return f"its check raised {type(e).__name__}: {e}"


def _kv_caches(runner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's (key, value) cache views, but for layers that share another's
    KV (it moves with that layer's)."""
    return [tree_attention.kv_views(layer) for layer in tree_attention.attention_layers(runner).values()
            if getattr(layer.impl, "kv_sharing_target_layer_name", None) is None]


def _state(runner) -> TreeState:
    st = getattr(runner, "_ouroboros_tree", None)
    if st is None:
        st = runner._ouroboros_tree = TreeState()
    return st


def prepare(runner, drafter) -> TreeState:
    """Decide whether the tree can run, once the target's KV cache is allocated (the
    model-runner patch calls it then): on a GPU this compiles and checks the tree kernel during
    the engine's start, before vLLM's warm-up ends and its JIT monitor starts flagging compiles,
    instead of in the first request's step."""
    st = _state(runner)
    if not st.checked:
        st.check(runner, drafter)
    return st


def begin_step(runner, drafter, scheduler_output, spec_meta) -> TargetStep | None:
    """Plan the step vLLM just prepared (called right after `_prepare_inputs`)."""
    st = prepare(runner, drafter)  # decided at load already, unless the KV cache came another way
    tree_attention.set_active(None)
    drafter.set_tree_allowed(not scheduler_output.has_structured_output_requests)
    if spec_meta is None:
        return None
    B = len(spec_meta.num_draft_tokens)
    req_ids = runner.input_batch.req_ids[:B]
    n, sl = drafter.layouts(req_ids)
    step = plan_target_step(np.asarray(spec_meta.num_draft_tokens, np.int64), n, sl,
                            runner.query_start_loc.np[:B + 1], runner.input_batch.num_computed_tokens_cpu[:B],
                            spec_meta.draft_token_ids, drafter.cfg.phrase_len)
    plan = step.plan
    if plan.has_tree:
        if st.reason is not None:  # cannot happen: the drafter sent no tree; stay lossless
            raise RuntimeError(f"ouroboros: a tree was scheduled but the tree path is off ({st.reason})")
        dev = runner.device
        write = np.nonzero(plan.write)[0]
        pos_rows, pos_delta, q_rows, q_start, prefix_lens, bits, tree_reqs, write_t, write_rows = to_device(
            dev, plan.pos_rows, plan.pos_delta, plan.q_rows, plan.q_start, plan.prefix_lens, plan.bits,
            plan.tree_reqs, write, plan.q_rows[write])
        runner.positions[pos_rows] -= pos_delta
        bt = runner.input_batch.block_table[0].block_table.gpu
        tree_attention.set_active(tree_attention.TreeAttentionStep(
            q_rows=q_rows, q_start=q_start, prefix_lens=prefix_lens, bits=bits,
            block_table=bt[tree_reqs], write_local=write_t, write_rows=write_rows,
            max_rows=plan.max_rows, max_prefix=int(plan.prefix_lens.max(initial=0))))
    return step


# A batch's max_num_logprobs of -1 (vLLM's sampler returns the whole vocabulary, unsorted): a
# reason both the walk and vLLM's rejection sampler give (drafting_pause compares the two).
WHOLE_VOCABULARY_LOGPROBS = "logprobs of the whole vocabulary"


def unsupported_sampling(sm, logprobs_mode: str = "raw_logprobs") -> str | None:
    """Why the tree walk cannot sample this batch exactly as vLLM would, or None."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                        MinPLogitsProcessor,
                                                        MinTokensLogitsProcessor)

    if sm.max_num_logprobs == -1:
        return WHOLE_VOCABULARY_LOGPROBS
    if sm.max_num_logprobs is not None and logprobs_mode not in ("raw_logprobs", "raw_logits"):
        return f"logprobs_mode {logprobs_mode}"
    if sm.bad_words_token_ids:
        return "bad_words"
    if sm.allowed_token_ids_mask is not None:
        return "allowed_token_ids"
    holder = sm.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return "thinking token budget"
    for p in sm.logitsprocs.all:
        if isinstance(p, (MinPLogitsProcessor, LogitBiasLogitsProcessor)):
            continue  # applied to every verified row: bias_min_p.py
        if isinstance(p, MinTokensLogitsProcessor):
            require(p, "min_toks")
            if p.min_toks:
                return "min_tokens"
        else:
            return f"logits processor {type(p).__name__}"
    return None


def drafting_pause(sm, reason: str | None) -> str | None:
    """Why no request of the batch should draft now, or None: the tree walk does not take the
    batch (`reason`, unsupported_sampling) and vLLM's rejection sampler would get it wrong."""
    why = None if reason is None else rejection_sampler_fails(sm)
    return why if why is None or why == reason else f"{why} beside {reason}"


def review_drafting_pause(runner) -> None:
    """The pause decided again on a step sample() does not see (no speculative metadata: vLLM
    0.32 builds it on every step of a speculative engine, this is for one that would not),
    so that a pause cannot outlive the request that caused it."""
    sm = runner.input_batch.sampling_metadata
    reason = unsupported_sampling(sm, runner.sampler.logprobs_mode)
    runner.drafter.set_drafting_allowed_for_sampling(drafting_pause(sm, reason))


def rejection_sampler_fails(sm) -> str | None:
    """What vLLM 0.32's rejection sampler gets wrong in this batch, or None: it ignores
    logprob_token_ids (the requests' logprobs went missing, and beside `logprobs` its bonus
    rows came in the ids' shape and killed the engine). A max_num_logprobs of -1 (vLLM's
    sampler returns the whole vocabulary, unsorted, for it) would reach a top-k: 0.32's input
    batch asks for the vocabulary's size instead for `logprobs` -1, which both the walk and
    the rejection sampler serve (tests/test_e2e_tiny.py), so this is for a vLLM that passes
    -1 on. Its plain sampler, without speculation, serves both."""
    if sm.logprob_token_ids:
        return "logprobs of chosen token ids"
    if sm.max_num_logprobs == -1:
        return WHOLE_VOCABULARY_LOGPROBS
    return None


def sample(runner, original_sample, logits, spec_meta, step: TargetStep):
    """Verify the step's trees; returns (SamplerOutput, StepOutcome)."""
    from vllm.v1.outputs import SamplerOutput

    from vllm_ouroboros.kv_relocate import move_kv, relocation_slots
    from vllm_ouroboros.verify import node_rows, verify

    tree_attention.set_active(None)
    sm = runner.input_batch.sampling_metadata
    require(runner.sampler, "logprobs_mode")  # a default would report raw ones for processed
    mode = runner.sampler.logprobs_mode
    reason = unsupported_sampling(sm, mode)
    runner.drafter.set_tree_allowed_for_sampling(reason is None, reason)
    stop = drafting_pause(sm, reason)
    runner.drafter.set_drafting_allowed_for_sampling(stop)
    bias, min_p = bias_min_p.active_processors(sm)
    raw = logits  # logprobs are the raw logits', as vLLM reports them by default
    # The walk also verifies plain chains: one lossless sampler for every ouroboros step. (vLLM
    # 0.32's rejection sampler on CPU drew from a sharper distribution than the target's at
    # temperature > 0: its expand fallback left the temperatures uninitialised, which
    # patches/cpu_sampler.py mends for the steps handed to it below; tests/test_sampling_tree.py
    # compares both paths against no speculation.)
    if reason is None:
        penalized = () if sm.no_penalties else tree_penalties.penalized_requests(runner.input_batch,
                                                                                 step.tree.B)
        if bias is not None or len(penalized):  # float32, as vLLM's Sampler processes them, in
            # place as it does: a copy of the step's [rows, vocab] only where the raw rows must
            # give logprobs
            logits = logits.to(torch.float32, copy=sm.max_num_logprobs is not None or bool(sm.logprob_token_ids))
        if bias is not None:
            bias_min_p.add_bias(logits, bias, step.row_start, step.plan.num_drafts + 1)
        if len(penalized):  # after the bias, before the argmax and temperature, as vLLM's Sampler
            tree_penalties.penalize_tree_rows(logits, sm, penalized, step.tree.tokens, step.tree.layout,
                                              step.row_start, runner.max_num_reqs)
        greedy = process = seeded = None
        if not sm.all_greedy:
            greedy = sm.temperature[:step.tree.B] < bias_min_p.SAMPLING_EPS
            process, scale = row_processing(sm, step.tree.B, min_p)
            if sm.generators:
                seeded = seeded_draws(runner, sm, step.tree.B, scale)
        # All of the step's rows at once where they fit in what vLLM's profiling run sized
        # sampling for (one row per request of the largest batch): fewer launches.
        v = verify(step.tree, logits, step.row_start, greedy, process,
                   max_table_rows=runner.max_num_reqs, walk=_state(runner).walk, seeded=seeded)
        slots = runner.input_batch.block_table[0].slot_mapping.gpu
        src, dst = relocation_slots(v.result, step.root_rows, slots)
        if src.numel() and not _SKIP_RELOCATION:
            move_kv(_kv_caches(runner), src, dst, backend=_state(runner).kv_move)
        logprobs = None
        if sm.max_num_logprobs is not None or sm.logprob_token_ids:
            logprobs = _path_logprobs(runner.sampler, mode, raw, step, v, sm)
        (token_ids,) = to_device(logits.device, v.token_ids)
        out = SamplerOutput(sampled_token_ids=token_ids, logprobs_tensors=logprobs)
        return out, StepOutcome(step.tree, v.tokens, v.target_next, v.result.num_accepted,
                                v.result.suffix_index)

    judged = True
    if np.any(spec_meta.num_draft_tokens) and stop is not None:
        # Drafts made before such a request joined (drafting pauses from the next step on).
        out, judged = root_sample(runner, original_sample, logits, step), False
    elif step.plan.has_tree:
        out = _chain_view_sample(runner, logits, spec_meta, step, sm)
    elif not np.any(spec_meta.num_draft_tokens):
        # No request drafted (all backed off, or fresh from prefill): a plain decoding step,
        # sampled as without speculation. vLLM 0.32 builds its rejection sampler's metadata
        # whenever speculation is configured, and its CPU top-k (apply_top_k_only) fails on the
        # empty draft rows of such a step where a sampled request sets top_k.
        out = original_sample(runner, logits, None)
    else:
        out = original_sample(runner, logits, spec_meta)
    (rows,) = to_device(logits.device, node_rows(step.tree, step.row_start))
    B = step.tree.B
    reads = [logits.argmax(dim=-1)[rows], step.tree.tokens, out.sampled_token_ids.long()]
    if not sm.all_greedy:  # in the same read (all greedy: known on the host)
        reads.append(sm.temperature[:B] < bias_min_p.SAMPLING_EPS)
    target_next, tokens, sampled, *temp = to_host(*reads)
    target_next = emitted_choices(target_next, sampled, temp[0] if temp else np.ones(B, bool))
    num_acc = (sampled != -1).sum(1) - 1
    sfx = np.where(num_acc > step.tree.layout.n, 0, -1)
    return out, StepOutcome(step.tree, tokens, target_next, num_acc, sfx, drafts_judged=judged)


def emitted_choices(target_next: np.ndarray, sampled: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """The target's choices the pool learns from on a step vLLM's sampler verified: the raw
    argmax after the root and after each node (target_next [B, N + 1]), but for greedy rows
    (greedy [B] bool) the tokens the sampler emitted where it emitted one (sampled [B, C], -1
    past them; C <= N + 1, column c after the root (c = 0) or after chain node c - 1). Such a
    step is the fallback's for bad words, allowed ids, min_tokens, ...: the raw argmax is not
    what the output holds there, and a phrase at odds with accepted text would be inserted (and
    the phrase the output confirms refined away). Sampled rows keep the argmax, as the walk's
    steps give it. Returns a new [B, N + 1] array."""
    out = np.array(target_next, copy=True)
    C = min(sampled.shape[1], out.shape[1])
    s = sampled[:, :C]
    take = np.asarray(greedy, bool)[:, None] & (s >= 0)
    out[:, :C] = np.where(take, s, out[:, :C])
    return out


def root_sample(runner, original_sample, logits, step: TargetStep):
    """Every draft of the step rejected: each request's root row sampled by vLLM's plain
    sampler, as without speculation (one token per request, SamplerOutput [B, 1]). Lossless
    at any temperature (the token comes from the target's distribution after the context);
    the drafted rows' forward is spent for nothing, so only for a batch that needs it, on
    the step a request that needs it joins: drafting pauses after it (drafting_pause)."""
    (roots,) = to_device(logits.device, np.asarray(step.row_start, np.int64))
    return original_sample(runner, logits[roots], None)


def _path_logprobs(sampler, mode, logits, step: TargetStep, v, sm):
    """vLLM's LogprobsTensors for the emitted tokens, one row per emitted slot [B * (N + 1)]:
    the top `sm.max_num_logprobs`, or where a request asks for chosen token ids
    (`sm.logprob_token_ids`, {request index: ids}) those, for the whole batch as vLLM's
    sampler gives them.

    Emitted token j of a request was predicted after the root (j = 0) or after accepted node
    j - 1: those logit rows, not consecutive ones as on a chain. Padding slots read row 0 and
    are filtered by vLLM with the -1 tokens.
    """
    res = v.result
    B, N1 = v.token_ids.shape
    prev = np.concatenate([np.full((B, 1), -1, np.int64), res.accepted_nodes[:, :N1 - 1]], 1)
    rows = np.asarray(step.row_start, np.int64)[:, None] + 1 + prev
    rows = np.where(v.token_ids >= 0, rows, 0).reshape(-1)
    rows_t, tok = to_device(logits.device, rows, np.maximum(v.token_ids.reshape(-1), 0).astype(np.int64))
    x = logits[rows_t].float()
    lp = x if mode == "raw_logits" else sampler.compute_logprobs(x)
    if sm.logprob_token_ids:  # vLLM's Sampler prefers them to the top-k where both are asked
        require(sampler, "gather_specific_token_logprobs")
        ids = {i * N1 + j: t for i, t in sm.logprob_token_ids.items() for j in range(N1)}
        return sampler.gather_specific_token_logprobs(lp, ids, tok)
    return sampler.gather_logprobs(lp, sm.max_num_logprobs, tok)


def row_processing(sm, B: int, min_p=None):
    """What vLLM's sampler does to a random request's logits when no other processor is active
    (unsupported_sampling): temperature, min_p (vLLM's MinPLogitsProcessor, where a request
    sets it), then top-k / top-p.

    Returns (process, scale), each f(x, req) for verify: x [n, V] float32 logit rows of the
    batch's requests (overwritten), req [n] int64 the request of each row (None: row b is
    request b's) -> the processed rows [n, V]. process does all of it; scale stops before top-k
    / top-p (vLLM's top-k / top-p sampler does that step: seeded_draws). Built once for both:
    they share the step's temperatures and min_p. Every operation is per row, so a row comes
    out the same whichever rows are processed with it.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    temp = sm.temperature[:B]
    temp = torch.where(temp < bias_min_p.SAMPLING_EPS, torch.ones_like(temp), temp)  # greedy rows: unused
    mp = None if min_p is None else bias_min_p.min_p_per_request(min_p, B).to(temp.device)
    top_k = None if sm.top_k is None else sm.top_k[:B]
    top_p = None if sm.top_p is None else sm.top_p[:B]

    def of(t: torch.Tensor | None, req: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or req is None else t[req]

    def scale(x: torch.Tensor, req: torch.Tensor | None) -> torch.Tensor:
        x.div_(of(temp, req)[:, None])
        if mp is not None:
            x.masked_fill_(bias_min_p.min_p_mask(x, of(mp, req)), float("-inf"))
        return x

    def process(x: torch.Tensor, req: torch.Tensor | None) -> torch.Tensor:
        return apply_top_k_top_p(scale(x, req), of(top_k, req), of(top_p, req))

    return process, scale


def seeded_draws(runner, sm, B: int, scale):
    """The batch's seeded requests sampled as vLLM's Sampler samples them without speculation
    (seeded_sampling.py): `scale` (row_processing's: temperature and min_p), then vLLM's own
    top-k / top-p sampler (`Sampler.topk_topp_sampler`, the platform's: on CPU a fused Gumbel
    argmax seeded by one draw, on CUDA an exponential row) with each row's copy of its
    generator."""
    from vllm_ouroboros.seeded_sampling import SeededDraws

    require(runner.sampler, "topk_topp_sampler")
    sampler = runner.sampler.topk_topp_sampler
    top_k = None if sm.top_k is None else sm.top_k[:B]
    top_p = None if sm.top_p is None else sm.top_p[:B]

    def sample(x: torch.Tensor, generators: dict[int, torch.Generator], req: torch.Tensor) -> torch.Tensor:
        return sampler(x, generators, None if top_k is None else top_k[req],
                       None if top_p is None else top_p[req])[0]

    return SeededDraws(sm.generators, scale, sample, runner.max_num_reqs)


def _chain_view_sample(runner, logits, spec_meta, step: TargetStep, sm):
    """vLLM's rejection sampler on draft + suffix 0 of every tree (the rows exist in logits)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    plan = step.plan
    c = plan.num_drafts
    c2 = plan.draft_len + plan.suffix_len[:, 0]
    dev = logits.device
    start = np.cumsum(c + 1) - (c + 1)  # vLLM's cu_num_sampled_tokens, exclusive, on the host
    j = ragged_arange(c2)
    tgt = np.repeat(start, c2) + j
    keep = np.repeat(np.cumsum(c) - c, c2) + j
    keep_t, cu_t, tgt_t, bonus_t = to_device(dev, keep, np.cumsum(c2).astype(np.int32), tgt.astype(np.int32),
                                             (start + c2).astype(np.int32))
    meta = SpecDecodeMetadata(
        draft_token_ids=spec_meta.draft_token_ids[keep_t],
        num_draft_tokens=c2.tolist(),
        cu_num_draft_tokens=cu_t,
        # Unchanged: each request's logit rows still start where the full tree's do.
        cu_num_sampled_tokens=spec_meta.cu_num_sampled_tokens,
        target_logits_indices=tgt_t,
        bonus_logits_indices=bonus_t,
        logits_indices=spec_meta.logits_indices,
    )
    if sm.spec_token_ids is not None:
        sm = replace(sm, spec_token_ids=[s[:k] for s, k in zip(sm.spec_token_ids, c2.tolist())])
    return runner.rejection_sampler(meta, None, logits, sm)
