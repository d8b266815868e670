"""Attention area: give the speculative rows of tree requests their tree mask.

vLLM's attention backends know causal masks only. After a backend has attended a step (it wrote
the step's KV first), the rows of suffix k >= 1 nodes are recomputed with the tree mask and
overwritten: on CUDA by the Triton kernel (kernels/tree_attention.py), elsewhere by its torch
path. Only rows whose result differs from causal are written, so the draft and suffix 0 keep the
backend's own numbers. Wrapping is per layer instance (`impl.forward`), after the model is
loaded; the backend's attention op is opaque to torch.compile and runs eagerly, so the wrapper
runs too. A layer we cannot serve (an unknown backend or KV layout, fp8 KV, sliding window,
ALiBi, soft-capping, sinks, MLA, recurrent layers) makes the tree unavailable, with the reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.kernels.tree_attention import MAX_TREE_NODES, TreeAttentionPlan, check_kernel
from vllm_ouroboros.kernels.split_tuning import tune_splits
from vllm_ouroboros.patches._util import require

logger = logging.getLogger(LOGGER_NAME)


@dataclass
class TreeAttentionStep:
    """Device tensors of one step (step_plan.StepPlan's tree part, plus the block table rows)."""

    q_rows: torch.Tensor       # [Tt] int64
    q_start: torch.Tensor      # [Bt + 1] int32
    prefix_lens: torch.Tensor  # [Bt] int32
    bits: torch.Tensor         # [Tt] int64
    block_table: torch.Tensor  # [Bt, max_blocks] int32
    write_local: torch.Tensor  # [W] int64, rows of q_rows to write back
    write_rows: torch.Tensor   # [W] int64, their query rows
    max_rows: int
    # max(prefix_lens), known on the host: sizes the split-KV grid, and bounds the torch path's
    # prefix (required: a default of 0 would drop every prefix there).
    max_prefix: int
    # The kernel's checks and launch plan, made at the first layer of the forward and reused by
    # the others (kernels.tree_attention.TreeAttentionPlan), by the layer's shapes and backend.
    plans: dict = field(default_factory=dict)


_active: TreeAttentionStep | None = None


def set_active(step: TreeAttentionStep | None) -> None:
    """The tree rows of the forward about to run (None: plain causal step)."""
    global _active
    _active = step


# ---- KV layouts ------------------------------------------------------------------------------
def _cpu_views(kv_cache: torch.Tensor, head_size: int):
    # CPU_ATTN (vec ISA): a block is [Hkv, 2 * bs * D]; per head the first bs * D values are
    # the keys stored d-major ([D, bs], as its dot-product kernel reads them), the next bs * D
    # the values token-major ([bs, D]). install() checks this against the backend's own
    # cache writer before trusting it.
    nb, h, bs, _ = kv_cache.shape
    kv = kv_cache.view(nb, h, 2 * bs * head_size)
    k = kv[:, :, :bs * head_size].view(nb, h, head_size, bs).permute(0, 3, 1, 2)
    v = kv[:, :, bs * head_size:].view(nb, h, bs, head_size).permute(0, 2, 1, 3)
    return k, v


def _probe_cpu_layout(layer) -> str | None:
    """Write a few tokens with CPU_ATTN's own cache op and read them back through our views."""
    from vllm import _custom_ops as ops

    impl, cache = layer.impl, layer.kv_cache
    _, h, bs, _ = cache.shape
    d = impl.head_size
    scratch = torch.zeros(2, h, bs, 2 * d, dtype=cache.dtype)
    kv = scratch.view(2, h, 2 * bs, d)
    key_cache, value_cache = kv.chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(3, h, d, generator=gen).to(cache.dtype)
    value = torch.randn(3, h, d, generator=gen).to(cache.dtype)
    slots = torch.tensor([0, bs - 1, bs + 1], dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, layer.isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    k, v = _cpu_views(scratch, d)
    if not (torch.equal(k[slots // bs, slots % bs], key)
            and torch.equal(v[slots // bs, slots % bs], value)):
        return f"unknown CPU_ATTN KV layout (isa {layer.isa}, {cache.dtype})"
    return None


def _split_last_views(kv_cache: torch.Tensor, head_size: int):
    # FlashAttention / Triton: [num_blocks, Hkv, block_size, 2 * D], key | value per token.
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_size], kv[..., head_size:]


_LAYOUTS: dict[str, Callable] = {
    "CPUAttentionBackendImpl": _cpu_views,
    "FlashAttentionImpl": _split_last_views,
    "TritonAttentionImpl": _split_last_views,
}


def kv_views(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches of an attention layer as [num_blocks, block_size, Hkv, D] views."""
    impl = layer.impl
    return _LAYOUTS[type(impl).__name__](layer.kv_cache, impl.head_size)


def _unsupported(name: str, layer) -> str | None:
    impl = getattr(layer, "impl", None)
    if impl is None or not hasattr(layer, "kv_cache"):
        return f"layer {name} ({type(layer).__name__}) is not a paged attention layer"
    kind = type(impl).__name__
    if kind not in _LAYOUTS:
        return f"attention backend {kind} (supported: {', '.join(_LAYOUTS)})"
    if getattr(impl, "kv_cache_dtype", "auto") != "auto":
        return f"kv_cache_dtype {impl.kv_cache_dtype} (the tree path reads the cache as is)"
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return f"sliding window attention in {name}"
    if getattr(impl, "alibi_slopes", None) is not None:
        return f"ALiBi in {name}"
    if getattr(impl, "logits_soft_cap", None):
        return f"logit soft-capping in {name}"
    if getattr(impl, "sinks", None) is not None:
        return f"attention sinks in {name}"
    if getattr(impl, "attn_type", "decoder") != "decoder":
        return f"{impl.attn_type} attention in {name}"
    if getattr(impl, "head_size", 0) > 256:  # TreeAttentionPlan's bound, on either path
        return f"head size {impl.head_size} > 256 in {name}"
    if getattr(impl, "dcp_world_size", 1) > 1:
        # The cache is split across ranks; the tree rows would read only this rank's part.
        return f"decode context parallelism ({impl.dcp_world_size} ranks) in {name}"
    return None


def attention_layers(runner) -> dict[str, object]:
    """The layers of the target that own a KV cache (vLLM's static forward context)."""
    ctx = runner.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items() if hasattr(layer, "kv_cache")}


def check_layout_kernel(backend: str, block_shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device, num_heads: int, head_size: int,
                        max_nodes: int = MAX_TREE_NODES) -> str | None:
    """The kernel's check before serving (kernels/tree_attention.check_kernel) for a cache of
    attention backend `backend` (a key of _LAYOUTS) whose blocks have shape `block_shape` (the
    cache's shape without its first axis): on random scratch blocks laid out so, trees of up to
    `max_nodes` nodes. None where the kernel can serve it, else why not."""
    block_size = _LAYOUTS[backend](torch.empty((1, *block_shape), device="meta"), head_size)[0].shape[1]
    blocks = -(-max(256, max_nodes) // block_size)  # a prefix of a few key tiles behind the tree
    gen = torch.Generator(device=device).manual_seed(0)  # leaves vLLM's RNG alone
    scratch = torch.randn((blocks, *block_shape), generator=gen, device=device,
                          dtype=torch.float32).to(dtype)
    k, v = _LAYOUTS[backend](scratch, head_size)
    reason = check_kernel(k, v, num_heads, max_query_len=max_nodes)
    if reason is None and torch.device(device).type == "cuda":
        # Where a prefix is worth splitting, timed on this GPU for these shapes. Only eager
        # launches: full CUDA graphs turn the tree off (install), so the target's attention runs
        # between vLLM's piecewise graphs.
        tune_splits(k, v, num_heads, nodes=(16, 32), modes=(False,))
    return reason


def check_layer_kernel(layer, max_nodes: int = MAX_TREE_NODES) -> str | None:
    """`check_layout_kernel` for this layer's cache (which is not touched)."""
    cache, impl = layer.kv_cache, layer.impl
    return check_layout_kernel(type(impl).__name__, tuple(cache.shape[1:]), cache.dtype,
                               cache.device, impl.num_heads, impl.head_size, max_nodes)


def install(runner, max_nodes: int = MAX_TREE_NODES) -> str | None:
    """Wrap every attention layer of the target; return why the tree cannot run, or None.
    On CUDA the Triton kernel is checked first for each distinct layer shape (`check_layer_kernel`,
    trees of up to `max_nodes` nodes, which also compiles it); where it fails, the tree rows are
    computed by the batched torch path instead, slower but exact, with a warning."""
    require(runner, "parallel_config", "uses_mrope", "compilation_config")
    stages = runner.parallel_config.pipeline_parallel_size
    if stages > 1:
        # vLLM gives the drafter, hence this step, to the last stage only: the other stages
        # would attend the tree rows causally at chain positions and keep their KV where the
        # chain left it.
        return f"pipeline parallelism ({stages} stages): the tree runs on a single stage"
    if getattr(runner.parallel_config, "use_ubatching", False):
        # Each micro-batch's attention sees a slice of the batch; the tree rows index all of it.
        return "micro-batching (enable_dbo / ubatch_size > 1)"
    if runner.uses_mrope:
        # The model reads runner.mrope_positions, not the positions the tree rows are moved in.
        return "M-RoPE positions (multimodal rotary embedding)"
    if getattr(getattr(runner.compilation_config, "pass_config", None), "fuse_attn_quant", False):
        # Attention then writes quantized output with a scale (output_scale); the tree rows
        # would be written unscaled.
        return "fuse_attn_quant (attention fused with output quantization)"
    mode = getattr(runner.compilation_config, "cudagraph_mode", None)
    if mode is not None and getattr(runner.device, "type", "cpu") == "cuda" \
            and mode.has_full_cudagraphs():
        # A captured graph replays the backend's attention without our tree rows.
        return (f"cudagraph_mode {mode.name} captures attention in full CUDA graphs; use "
                "-cc.cudagraph_mode=PIECEWISE or --enforce-eager for tree verification")
    layers = attention_layers(runner)
    if not layers:
        return "no attention layers found in the model runner"
    for name, layer in layers.items():
        reason = _unsupported(name, layer)
        if reason is not None:
            return reason
    groups = getattr(runner.kv_cache_config, "kv_cache_groups", [None])
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (hybrid models are not supported by the tree path)"
    bt_size = runner.input_batch.block_table[0].block_size
    for name, layer in layers.items():
        k, _ = kv_views(layer)
        if k.shape[1] != bt_size:
            return f"KV block size {k.shape[1]} differs from the block table's {bt_size}"
    first = next(iter(layers.values()))
    if type(first.impl).__name__ == "CPUAttentionBackendImpl":
        reason = _probe_cpu_layout(first)
        if reason is not None:
            return reason
    # Off CUDA the batched torch path: Triton there is only its interpreter (TRITON_INTERPRET=1,
    # set for the kernel tests), far slower, and vLLM's CPU cache views are not laid out for it.
    backend = "torch"
    if getattr(runner.device, "type", "cpu") == "cuda":
        backend = "auto"
        t0 = time.perf_counter()
        shapes = {}
        for layer in layers.values():
            key = (type(layer.impl).__name__, tuple(layer.kv_cache.shape[1:]), layer.kv_cache.dtype,
                   layer.impl.num_heads, layer.impl.head_size)
            shapes.setdefault(key, layer)
        reason = next((r for r in (check_layer_kernel(l, max_nodes) for l in shapes.values())
                       if r is not None), None)
        if reason is None:
            logger.info("ouroboros: tree-attention kernel checked and compiled for %d layer "
                        "shape(s) in %.1f s", len(shapes), time.perf_counter() - t0)
        else:
            backend = "torch"
            logger.warning("ouroboros: the tree-attention kernel failed its check on this GPU, so "
                           "tree rows use the batched torch path (exact, slower): %s", reason)
    for layer in layers.values():
        _wrap(layer.impl, backend)
    return None


def _wrap(impl, backend: str = "auto") -> None:
    impl._ouroboros_backend = backend  # what _tree_rows passes to tree_attention
    if getattr(impl, "_ouroboros_wrapped", False):
        return
    original = impl.forward

    def forward(layer, query, key, value, kv_cache, attn_metadata, output=None, **kw):
        result = original(layer, query, key, value, kv_cache, attn_metadata, output=output, **kw)
        step = _active
        if step is not None and attn_metadata is not None and step.write_rows.numel():
            _tree_rows(impl, query, kv_cache, output, step)
        return result

    impl.forward = forward
    impl._ouroboros_wrapped = True


def _tree_rows(impl, query, kv_cache, output, step: TreeAttentionStep) -> None:
    k_cache, v_cache = _LAYOUTS[type(impl).__name__](kv_cache, impl.head_size)
    q = query.view(query.shape[0], impl.num_heads, impl.head_size)[step.q_rows]
    key = (q.dtype, tuple(q.shape), tuple(k_cache.shape), impl.scale, impl._ouroboros_backend)
    plan = step.plans.get(key)
    if plan is None:
        plan = step.plans[key] = TreeAttentionPlan(
            q, k_cache, v_cache, step.block_table, step.prefix_lens, step.q_start, step.bits,
            impl.scale, max_query_len=step.max_rows, max_prefix_len=step.max_prefix,
            backend=impl._ouroboros_backend)
    o = plan(q, k_cache, v_cache)
    out = output.view(output.shape[0], impl.num_heads, -1)
    out[step.write_rows] = o[step.write_local].to(out.dtype)
