"""Draft model runtime: a self-contained Llama / Qwen2 decoder with its own paged KV cache.

One forward runs B rows (distinct cache slots) of Q new tokens each, with arbitrary positions and an
arbitrary mask among the new tokens (token trees, lookahead windows, guess phrases), on top of each
slot's committed prefix. The model never commits anything: new K/V land in a scratch area after the
prefix, and the caller commits a prefix of them by advancing its own cache_lens. The cache
(draft/kv_cache.py) hands each slot pages as its length needs them.

No vLLM imports: weights are read from a Hugging Face checkpoint directory (config.json + safetensors).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from vllm_ouroboros.draft.attention import (
    MAX_KERNEL_QUERIES,
    ROPE_IN_MAX_HEAD_DIM,
    DraftAttentionMetadata,
    build_attention_metadata,
    kernel_chosen,
    kernel_importable,
    masked_attention,
    rope_masked_attention,
    write_kv,
)
from vllm_ouroboros.draft.kv_cache import PAGE_SIZE, PagedKVCache, pages_for

# Most tokens of a forward that kernels/norm_gemm.py takes (its MAX_ROWS; kept here so that
# importing the model does not import Triton, whose interpreter is chosen at its first import).
NORM_GEMM_MAX_ROWS = 64

logger = logging.getLogger("vllm.ouroboros")

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# A matrix product y = x W^T + b with a given weight: (x [..., in], bias [out] | None) -> [..., out].
Gemm = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
# Builds the product for one weight [out, in] (may prepack it); DraftModel.use_gemm installs one.
GemmFactory = Callable[[torch.Tensor], Gemm]
LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class DraftConfig:
    """The architecture knobs this runtime understands, read once from an HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_params: tuple[tuple[str, float], ...]  # extra rope parameters (factor, ...) as sorted pairs
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_positions: int = 0  # max_position_embeddings (0: not given)

    @classmethod
    def from_hf(cls, cfg: dict) -> "DraftConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"draft model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"draft hidden_act {cfg['hidden_act']!r}: only 'silu' is supported")
        if model_type == "qwen2" and cfg.get("use_sliding_window", False):
            raise NotImplementedError("draft qwen2 with use_sliding_window=True is not supported")
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs write
        # top-level `rope_theta` and an optional `rope_scaling` dict ("type" or "rope_type").
        # Read as transformers reads them (PretrainedConfig.convert_rope_params_to_dict), since
        # the target's are read so: `rope_scaling` wins over `rope_parameters` (a model card's
        # scaling added to a config transformers 5 saved), and a top-level
        # original_max_position_embeddings over the dict's.
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(
                f"draft rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if rope_type == "llama3":
            if cfg.get("original_max_position_embeddings") is not None:
                rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
            elif cfg.get("max_position_embeddings") is not None:
                rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise NotImplementedError("draft partial_rotary_factor != 1 is not supported")
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} not a multiple of kv heads {num_kv_heads}")
        is_qwen2 = model_type == "qwen2"
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=tuple(sorted((k, v) for k, v in rope.items() if isinstance(v, (int, float)))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
            o_bias=False if is_qwen2 else bool(cfg.get("attention_bias", False)),
            mlp_bias=False if is_qwen2 else bool(cfg.get("mlp_bias", False)),
            max_positions=int(cfg.get("max_position_embeddings") or 0),
        )


def rope_inv_freq(cfg: DraftConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, as HF computes them for cfg.rope_type."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    p = dict(cfg.rope_params)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / p["factor"]
    elif cfg.rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_table(inv_freq: torch.Tensor, num_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of positions 0 .. num_positions - 1: [num_positions, 2, D] in dtype, row p
    [cos(p f) | sin(p f)] with f = [inv_freq, inv_freq] (HF's rotate-half layout).

    The same float32 products as computing them per forward (elementwise, so bit-identical to
    `positions.float() * inv_freq` for the same positions on the same device): a forward then
    gathers its rows in one launch instead of the 6-7 that compute them."""
    freqs = torch.arange(num_positions, device=inv_freq.device)[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()), dim=1).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, scale in the input dtype. Shape: x [..., H]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. Shape: x [B, Q, H, D]; cos, sin [B, Q, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DraftLayer(nn.Module):
    """One pre-norm decoder layer; q/k/v and gate/up projections are fused."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.eps = cfg.rms_norm_eps
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * D
        self.input_norm = nn.Parameter(torch.empty(H))
        self.qkv_weight = nn.Parameter(torch.empty(qkv, H))  # rows: q heads | k heads | v heads
        self.qkv_bias = nn.Parameter(torch.empty(qkv)) if cfg.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(H, cfg.num_heads * D))
        self.o_bias = nn.Parameter(torch.empty(H)) if cfg.o_bias else None
        self.post_norm = nn.Parameter(torch.empty(H))
        self.gate_up_weight = nn.Parameter(torch.empty(2 * I, H))  # rows: gate | up
        self.gate_up_bias = nn.Parameter(torch.empty(2 * I)) if cfg.mlp_bias else None
        self.down_weight = nn.Parameter(torch.empty(H, I))
        self.down_bias = nn.Parameter(torch.empty(H)) if cfg.mlp_bias else None
        self.gemms: dict[str, Gemm] = {}  # projection name -> product; F.linear where absent

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x @ {name}_weight^T + {name}_bias through the installed product (F.linear by default)."""
        bias = getattr(self, name + "_bias")
        gemm = self.gemms.get(name)
        return F.linear(x, getattr(self, name + "_weight"), bias) if gemm is None else gemm(x, bias)

    def forward_fused(self, h, residual, cos, sin, k_cache, v_cache, meta, scale, rope_in_attention=False,
                      norm_gemm=False):
        """The layer through the fused kernels (kernels/fused_ops.py): add+RMSNorm, RoPE with
        the KV write, SiLU*up; the closing residual add is left to the next layer's norm.
        rope_in_attention (with meta.use_kernel): RoPE and the KV write inside the attention
        kernel's launch (attention.rope_masked_attention), one launch fewer per layer.
        norm_gemm: each add+RMSNorm inside the product that reads it, and SiLU*up inside the
        gate_up product (kernels/norm_gemm.norm_linear), three launches fewer per layer, for
        forwards of at most norm_gemm.MAX_ROWS tokens and layers without an installed product.

        Shape: h [B, Q, H] and residual [B, Q, H] | None (the stream is h + residual); returns
        (h, residual) in the same convention. Same arithmetic as `forward` (RMSNorm's sum may
        differ in order: a few float32 ulps)."""
        from vllm_ouroboros.kernels.fused_ops import add_rms_norm, rope_qkv_write, silu_mul

        B, Q, _ = h.shape
        in_product = norm_gemm and B * Q <= NORM_GEMM_MAX_ROWS and not self.gemms
        if in_product:
            from vllm_ouroboros.kernels.norm_gemm import norm_linear

            qkv, residual = norm_linear(h, residual, self.input_norm, self.eps, self.qkv_weight, self.qkv_bias)
        else:
            x, residual = add_rms_norm(h, residual, self.input_norm, self.eps)
            qkv = self.project("qkv", x)
        if rope_in_attention and meta.use_kernel:
            o = rope_masked_attention(qkv, cos, sin, k_cache, v_cache, meta, scale, self.num_heads,
                                      self.num_kv_heads)
        else:
            q = rope_qkv_write(qkv, cos, sin, k_cache, v_cache, meta.write_index,
                               self.num_heads, self.num_kv_heads, self.head_dim)
            o = masked_attention(q, k_cache, v_cache, meta, scale)  # [B, Q, Hq, D]
        attended = self.project("o", o.reshape(B, Q, -1))
        if in_product:
            act, residual = norm_linear(attended, residual, self.post_norm, self.eps, self.gate_up_weight,
                                        self.gate_up_bias, glu=True)
        else:
            x, residual = add_rms_norm(attended, residual, self.post_norm, self.eps)
            act = silu_mul(self.project("gate_up", x))
        return self.project("down", act), residual

    def forward(self, h, cos, sin, k_cache, v_cache, meta, scale):
        # h: [B, Q, H]; cos, sin: [B, Q, 1, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D]
        B, Q, _ = h.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = self.project("qkv", x)  # [B, Q, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.view(B, Q, Hq, D), cos, sin)
        k = apply_rope(k.view(B, Q, Hkv, D), cos, sin)
        write_kv(k_cache, v_cache, k, v.view(B, Q, Hkv, D), meta)
        o = masked_attention(q, k_cache, v_cache, meta, scale)  # [B, Q, Hq, D]
        h = h + self.project("o", o.reshape(B, Q, Hq * D))
        x = rms_norm(h, self.post_norm, self.eps)
        gate, up = self.project("gate_up", x).chunk(2, dim=-1)
        return h + self.project("down", F.silu(gate) * up)


class DraftModel(nn.Module):
    """Decoder-only draft model with a paged KV cache (draft/kv_cache.py) and masked attention
    over [a slot's prefix | new tokens]."""

    # Largest logits chunk (elements) `greedy_tokens` materialises at once.
    logits_chunk_elems: int = 1 << 24

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        # The ids the LM head chooses from: the checkpoint's, or fewer where the target's
        # vocabulary is smaller (fit_vocab). Input ids past the embedding's rows are clamped
        # where the target's vocabulary is larger (`_embed_clamp`).
        self.vocab_size = cfg.vocab_size
        self._embed_clamp: int | None = None
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.scale = cfg.head_dim ** -0.5
        self.embed_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm_weight = nn.Parameter(torch.empty(cfg.hidden_size))
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size)))
        self.inv_freq: torch.Tensor | None = None  # [D/2] float32, set by from_pretrained
        self._rope: torch.Tensor | None = None  # rope_table for every position the cache holds
        self.kv: PagedKVCache | None = None  # set by allocate_cache
        self.head_gemm: Gemm | None = None  # LM head product; F.linear where None
        # Attention path (draft/attention.build_attention_metadata): "auto" runs the Triton
        # tree-attention kernel on CUDA for forwards of <= 64 new tokens per row.
        self.attention_backend = "auto"
        # Layers through the fused Triton kernels of kernels/fused_ops.py (add+RMSNorm, RoPE +
        # KV write, SiLU*up): fewer launches per layer where launches dominate (a GPU); where
        # Triton cannot run they fall back to the same math in torch.
        self.fused_ops = False
        # With fused_ops and the tree-attention kernel: RoPE and the KV write inside the kernel's
        # launch instead of rope_qkv_write's, up to the head dim where that compiles without
        # large spills (check_attention_kernel turns it off where the kernel's check fails; the
        # engine keeps it only where it times faster: draft/fusion_choice.py).
        self.rope_in_attention = cfg.head_dim <= ROPE_IN_MAX_HEAD_DIM
        # With fused_ops: RMSNorm inside the qkv and gate_up products and SiLU*up inside the
        # latter (kernels/norm_gemm.py) for forwards of <= NORM_GEMM_MAX_ROWS tokens. Turned on by
        # enable_norm_gemm; the engine keeps it where it times faster than cuBLAS's products
        # (OuroborosConfig.draft_norm_gemm, draft/fusion_choice.py).
        self.norm_gemm = False

    # ---- weights -------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: torch.device | str) -> "DraftModel":
        """Load an HF Llama / Qwen2 checkpoint (config.json + *.safetensors, sharded or not)."""
        root = Path(path)
        cfg = DraftConfig.from_hf(json.loads((root / "config.json").read_text()))
        device = torch.device(device)
        hf = _read_safetensors(root, dtype, device)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(_fuse_hf_weights(cfg, hf), strict=True, assign=True)
        model.requires_grad_(False)
        model.inv_freq = rope_inv_freq(cfg, device)
        return model

    def fit_vocab(self, target_vocab: int) -> None:
        """Draft for a target with `target_vocab` ids that shares this draft's tokenizer but pads
        its embedding to another size (Qwen2.5-0.5B: 151,936 rows; Qwen2.5-7B and larger:
        152,064; config._validate_draft checks the tokenizers). Ids the target can emit past this
        draft's embedding are clamped to its last row before the embedding (they name no token
        of the shared tokenizer, so the draft reads them as one unknown token), and the LM head
        chooses among the first min(rows, target_vocab) ids only, so a drafted id is always one
        the target can embed. Call before use_gemm (its head product takes the head's rows)."""
        if target_vocab < 1:
            raise ValueError(f"target_vocab must be >= 1, got {target_vocab}")
        if self.head_gemm is not None:
            raise RuntimeError("fit_vocab after use_gemm: the head's product holds the old rows")
        rows = self.cfg.vocab_size
        self.vocab_size = min(rows, target_vocab)
        self._embed_clamp = rows - 1 if target_vocab > rows else None

    def use_gemm(self, factory: GemmFactory) -> None:
        """Route every projection and the LM head through `factory(weight)` (e.g. a prepacked CPU
        GEMM from the patches). The weights stay: factories may fall back to them for small inputs."""
        for layer in self.layers:
            layer.gemms = {n: factory(getattr(layer, n + "_weight")) for n in LAYER_PROJECTIONS}
        self.head_gemm = factory(self.lm_head_weight)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_gemm is None:
            return F.linear(hidden, self.lm_head_weight)
        return self.head_gemm(hidden, None)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_size, H]: the head's rows (a leading view where fit_vocab dropped some)."""
        w = self.embed_weight if self.lm_head is None else self.lm_head
        return w if w.shape[0] == self.vocab_size else w[:self.vocab_size]

    # ---- KV cache ----------------------------------------------------------------------------

    @property
    def k_cache(self) -> torch.Tensor | None:
        """[num_layers, num_pages, page_size, Hkv, D]"""
        return None if self.kv is None else self.kv.k

    @property
    def v_cache(self) -> torch.Tensor | None:
        """[num_layers, num_pages, page_size, Hkv, D]"""
        return None if self.kv is None else self.kv.v

    @property
    def num_slots(self) -> int:
        return 0 if self.kv is None else self.kv.num_seqs

    @property
    def max_len(self) -> int:
        """Most tokens one slot can address."""
        return 0 if self.kv is None else self.kv.max_seq_len

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V per cached token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def cache_bytes(self, num_tokens: int, page_size: int = PAGE_SIZE) -> int:
        """Bytes of the k and v pages that hold num_tokens tokens."""
        return pages_for(num_tokens, page_size) * page_size * self.token_bytes

    @torch.inference_mode()
    def allocate_cache(self, num_slots: int, max_len: int, num_tokens: int | None = None,
                       limit_bytes: int | None = None, page_size: int = PAGE_SIZE) -> None:
        """A new (zeroed) paged cache for num_slots slots of up to max_len tokens; old content
        is dropped. num_tokens None: every slot holds pages for max_len tokens from the start
        (for callers that run the model alone); else a store of pages for num_tokens tokens
        (plus the null page) that slots take as `self.kv.reserve` assigns them, growing up to
        limit_bytes (draft/kv_cache.py)."""
        full = num_tokens is None
        pages = num_slots * pages_for(max_len, page_size) if full else pages_for(num_tokens, page_size)
        self.kv = PagedKVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                               self.device, num_slots, max_len, 1 + max(pages, 1), page_size,
                               limit_bytes)
        if full:
            self.kv.reserve(range(num_slots), [max_len] * num_slots)
        if self.inv_freq is not None:
            self._rope_table()  # at load, where a memory profiler sees it

    def uses_attention_kernel(self, Q: int) -> bool:
        """Whether a forward of Q new tokens per row runs its attention through the Triton
        tree-attention kernel (after `check_attention_kernel`, which may turn it off)."""
        return self.kv is not None and kernel_chosen(self.attention_backend, self.kv.device, Q)

    @torch.inference_mode()
    def enable_norm_gemm(self) -> str | None:
        """Turn `norm_gemm` on where it may serve: with `fused_ops`, and where
        kernels/norm_gemm.check_kernel matched torch on this device in this dtype. Returns
        None (on), or why it stays off."""
        if not self.fused_ops:
            return "it needs the fused layers (draft_fused_ops)"
        from vllm_ouroboros.kernels.norm_gemm import check_kernel

        why = check_kernel(self.device, self.dtype)
        self.norm_gemm = why is None
        return why

    @torch.inference_mode()
    def check_attention_kernel(self) -> str | None:
        """Before the draft serves: run the Triton tree-attention kernel where this model would
        use it (backend "auto" on CUDA, "triton" anywhere) on its heads, dtype and page size,
        against the torch path (kernels/tree_attention.check_kernel, which also compiles it).
        Where it fails, "auto" falls back to torch SDPA and the reason is returned; "triton"
        raises. Where the kernel would not be used (CPU with "auto", "torch"): None, nothing runs.
        Then the kernel with RoPE and the KV write inside (check_rope_kernel): where that
        fails, `rope_in_attention` goes off (logged), the layers keep rope_qkv_write.
        Call after allocate_cache (the kernel is compiled per page size)."""
        if self.kv is None:
            raise RuntimeError("allocate_cache before check_attention_kernel")
        if not (self.attention_backend == "triton"
                or (self.attention_backend == "auto" and self.kv.device.type == "cuda")):
            return None
        if not kernel_importable():
            reason = "Triton is not importable"
        else:
            from vllm_ouroboros.kernels.tree_attention import check_kernel

            gen = torch.Generator(device=self.device).manual_seed(0)
            # Pages of random K/V in the cache's layout, enough for the largest tree behind a prefix.
            pages = 2 * pages_for(MAX_KERNEL_QUERIES, self.kv.page_size)
            kv = torch.randn((2, pages, self.kv.page_size, self.num_kv_heads, self.head_dim),
                             generator=gen, device=self.device, dtype=torch.float32).to(self.dtype)
            reason = check_kernel(kv[0], kv[1], self.num_heads, max_query_len=MAX_KERNEL_QUERIES)
            if reason is None and self.rope_in_attention:
                from vllm_ouroboros.kernels.tree_attention import check_rope_kernel

                why = check_rope_kernel(kv[0], kv[1], self.num_heads, max_query_len=MAX_KERNEL_QUERIES)
                if why is not None:
                    logger.warning("ouroboros: the draft's RoPE and KV write stay outside the attention "
                                   "kernel on %s: %s", self.device, why)
                    self.rope_in_attention = False
            if reason is None and self.device.type == "cuda":
                from vllm_ouroboros.kernels.split_tuning import tune_splits

                # Where a prefix is worth splitting, timed on this GPU: replayed from graphs (the
                # round's forwards) and launched eagerly (prefill, rounds without graphs), at the
                # decode and lookahead widths.
                tune_splits(kv[0], kv[1], self.num_heads, nodes=(1, 32))
        if reason is not None:
            if self.attention_backend == "triton":
                raise RuntimeError(f"draft attention 'triton': the kernel failed its check on "
                                   f"{self.device}: {reason}")
            self.attention_backend = "torch"
        return reason

    # ---- forward -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache_lens: torch.Tensor,
        new_mask: torch.Tensor | None,
        max_cache_len: int | None = None,
        meta: DraftAttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Run Q new tokens per row on top of each row's committed prefix; returns final-normed hidden.

        Shape: input_ids [B, Q] int64; positions [B, Q] int64 (RoPE positions, not cache indices);
               slots [B] int64 (distinct, but for padding rows whose outputs are dropped: the
               prefill graph's share its spare slot); cache_lens [B] int64; new_mask [B, Q, Q] bool with
               new_mask[b, j, j] True; returns [B, Q, hidden_size] in the model dtype.
        Row b writes its new K/V as tokens cache_lens[b] .. cache_lens[b]+Q-1 of slot slots[b]
        (caller guarantees that slot's pages hold cache_lens[b] + Q tokens: self.kv.reserve); query
        j sees tokens [0, cache_lens[b]) and new token j' iff new_mask[b, j, j']. max_cache_len:
        max(cache_lens) if known on the host (saves a device synchronisation); any upper bound
        is correct. meta: attention metadata made by the caller (DraftAttentionMetadata.prepared,
        for the tree-attention kernel: see `uses_attention_kernel`); new_mask is then unused.
        """
        if self.kv is None:
            raise RuntimeError("DraftModel.forward before allocate_cache")
        if meta is None:
            meta = build_attention_metadata(slots, cache_lens, new_mask, self.kv.block_table,
                                            self.kv.page_size, max_cache_len, self.attention_backend)
        cos, sin = self.rope_rows(positions)
        if self._embed_clamp is not None:
            input_ids = input_ids.clamp(max=self._embed_clamp)
        h = F.embedding(input_ids, self.embed_weight)  # [B, Q, H]
        if self.fused_ops:
            from vllm_ouroboros.kernels.fused_ops import add_rms_norm

            residual = None
            for i, layer in enumerate(self.layers):
                h, residual = layer.forward_fused(h, residual, cos, sin, self.k_cache[i],
                                                  self.v_cache[i], meta, self.scale,
                                                  self.rope_in_attention, self.norm_gemm)
            return add_rms_norm(h, residual, self.norm_weight, self.cfg.rms_norm_eps)[0]
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, self.k_cache[i], self.v_cache[i], meta, self.scale)
        return rms_norm(h, self.norm_weight, self.cfg.rms_norm_eps)

    def _rope_table(self) -> torch.Tensor:
        num = max(self.kv.max_seq_len, self.cfg.max_positions)
        table = self._rope
        if table is None or table.shape[0] < num or table.dtype != self.dtype or table.device != self.device:
            if self.inv_freq is None:
                raise RuntimeError("DraftModel.inv_freq is unset (from_pretrained sets it)")
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the RoPE table must be built before a CUDA graph capture "
                                   "(a warm-up forward builds it)")
            table = self._rope = rope_table(self.inv_freq, num, self.dtype)
        return table

    @torch.inference_mode()
    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, Q, 1, D] in the model dtype (strided views) of positions [B, Q] int64,
        gathered from a table of every position the model was trained for and the cache can
        hold (`rope_table` of max(max_position_embeddings, kv.max_seq_len) positions, as vLLM's
        cos_sin_cache; built again when the cache's block table grows past it, which also bumps
        the cache's generation, so graphs captured before are captured again after warm-ups
        that rebuild it). A position past the table reads its last row (a gather out of bounds
        would fault a GPU): only rows whose output is dropped go there, a live row's positions
        being within its slot's cache_lens + Q tokens."""
        table = self._rope_table()
        B, Q = positions.shape
        rows = F.embedding(positions.clamp(max=table.shape[0] - 1), table.view(table.shape[0], -1))
        rows = rows.view(B, Q, 2, self.head_dim)
        return rows[:, :, :1], rows[:, :, 1:]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shape: hidden [..., H] -> [..., vocab] float32 (LM head in the model dtype, then upcast)."""
        return self._head(hidden).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of the LM head without materialising all logits. Shape: hidden [..., H] -> [...] int64.

        Ties resolve to the lowest token id (torch.argmax), as HF greedy on the same logits.
        """
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, self.hidden_size)
        rows = max(1, self.logits_chunk_elems // self.vocab_size)
        if flat.shape[0] <= rows:
            return self._head(flat).argmax(-1).view(lead)
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for s in range(0, flat.shape[0], rows):
            out[s:s + rows] = self._head(flat[s:s + rows]).argmax(-1)
        return out.view(lead)


def _read_safetensors(root: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, cast to dtype on device. Reads the shard index when present."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                out[name] = st.get_tensor(name).to(device=device, dtype=dtype)
    return out


def _fuse_hf_weights(cfg: DraftConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF parameter names -> DraftModel state dict (q/k/v and gate/up concatenated). Consumes `hf`."""

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"draft checkpoint ({cfg.model_type}) lacks tensor {name!r}")
        return hf.pop(name)

    sd = {"embed_weight": take("model.embed_tokens.weight"), "norm_weight": take("model.norm.weight")}
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    else:
        sd["lm_head"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        d = f"layers.{i}."
        sd[d + "input_norm"] = take(p + "input_layernorm.weight")
        sd[d + "post_norm"] = take(p + "post_attention_layernorm.weight")
        sd[d + "qkv_weight"] = torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"])
        if cfg.qkv_bias:
            sd[d + "qkv_bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
        sd[d + "o_weight"] = take(a + "o_proj.weight")
        if cfg.o_bias:
            sd[d + "o_bias"] = take(a + "o_proj.bias")
        sd[d + "gate_up_weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        sd[d + "down_weight"] = take(m + "down_proj.weight")
        if cfg.mlp_bias:
            sd[d + "gate_up_bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")])
            sd[d + "down_bias"] = take(m + "down_proj.bias")
    leftover = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"draft checkpoint ({cfg.model_type}) has unexpected tensors: {leftover[:8]}")
    return sd
