"""Tiny random Llama/Qwen2 models and a BPE tokenizer, built when the tests start.

No model hub is reachable, so tests make their own models. head_dim is 32 because vLLM's CPU
attention accepts head_dim >= 32 only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

_CORPUS_LINES = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "Once upon a time there was a small model that wanted to speak quickly.",
    "if x > 0 and y < 0:\n    return None\nelse:\n    return x - y\n",
    "Speculative decoding drafts tokens with a small model and verifies them.",
]


def build_tokenizer(out_dir: Path, vocab_size: int = 384) -> None:
    """Train a byte-level BPE tokenizer and save it as a HF fast tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS_LINES * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
    )
    fast.save_pretrained(out_dir)


def build_model(
    out_dir: Path,
    arch: str = "qwen2",
    seed: int = 0,
    vocab_size: int = 384,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    init_std: float = 0.08,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 2048,
) -> Path:
    """Save a random decoder model plus the shared tokenizer to `out_dir` and return it.

    A larger `init_std` than HF's default makes greedy outputs depend on the context (the
    default 0.02 gives near-uniform logits, so every prompt decodes the same loop).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = cfg_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        initializer_range=init_std,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir, vocab_size=vocab_size)
    # Older readers look for these keys.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out_dir


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """Copy a model with Gaussian noise (relative to each weight's std) on every weight.

    A perturbed copy of the target is a draft that agrees with it often but not always, which
    is what exercises rejections, corrections and inspiration.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    dst = Path(dst)
    model.save_pretrained(dst, safe_serialization=True)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            (dst / name).write_bytes((Path(src) / name).read_bytes())
    return dst


def padded_vocab_copy(src: Path, dst: Path, vocab_size: int, scale: float = 1.0, seed: int = 0) -> Path:
    """Copy a model with its embedding (and LM head) grown to `vocab_size` rows, the tokenizer
    kept: one tokenizer with embeddings padded to other sizes, as Qwen2.5-0.5B (151,936 rows) and
    Qwen2.5-7B (152,064). The new rows are Gaussian with `scale` times the old rows' std, so the
    model emits ids past the tokenizer's now and then (scale ~1) or often (scale ~2+), which is
    what exercises the clamps of DraftModel.fit_vocab."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    old = model.get_input_embeddings().weight.shape[0]
    if vocab_size <= old:
        raise ValueError(f"padded_vocab_copy grows the vocabulary: {vocab_size} <= {old}")
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads = {id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
        for w in heads.values():
            w[old:] = torch.randn(w[old:].shape, generator=gen) * w[:old].std() * scale
    dst = Path(dst)
    model.save_pretrained(dst, safe_serialization=True)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            (dst / name).write_bytes((Path(src) / name).read_bytes())
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["vocab_size"] == vocab_size, cfg["vocab_size"]
    return dst


def model_pair(root: Path) -> dict[str, Path]:
    """Tiny models under `root`: the target, a perturbed-copy draft, a closer copy
    ("close_draft", for tests that need full drafts accepted often) and a Llama model.

    The draft (noise 0.15) has ~4% of its drafted tokens accepted in tests/test_e2e_tiny.py's
    batch, so few drafts are accepted in full and reach their suffixes; how many suffix tokens
    from the second suffix on were accepted there swung from 1 to 20 with the noise seed (and a
    CI machine's rounding gave 0 where this one gave 7). The close draft (noise 0.02) has 30-40%
    accepted, still with rejections: 23 to 44 such suffix tokens over seeds 2, 3, 4.
    Returns {"target", "draft", "close_draft", "llama"} paths; built once, reused when present.
    """
    root = Path(root)
    paths = {"target": root / "target", "draft": root / "draft",
             "close_draft": root / "close_draft", "llama": root / "llama"}
    if not (root / "llama" / "config.json").exists():
        build_model(paths["target"], seed=1)
        perturbed_copy(paths["target"], paths["draft"], noise=0.15, seed=2)
        build_model(paths["llama"], arch="llama", seed=3)
    if not (paths["close_draft"] / "config.json").exists():
        perturbed_copy(paths["target"], paths["close_draft"], noise=0.02, seed=2)
    return paths


def acceptance_head(hidden_size: int, seed: int = 0, bias: float = 1.6, scale: float = 3.0):
    """A SpecDec++ acceptance head with fixed random weights (no training): on the tiny draft its
    P(accept) spreads over ~0.5..0.97, so the adaptive rule fires after a few tokens."""
    from vllm_ouroboros.draft.acceptance_head import AcceptanceHead, HeadParams

    torch.manual_seed(seed)
    head = AcceptanceHead(HeadParams(hidden_size=hidden_size, width=16, depth=1))
    with torch.no_grad():
        head.out.weight.mul_(scale)
        head.out.bias.fill_(bias)
    return head.requires_grad_(False)


def acceptance_head_file(draft: Path, path: Path, threshold: float, **kw) -> Path:
    """`acceptance_head(...)` saved for the draft at `draft` (its identity, threshold h)."""
    from vllm_ouroboros.draft.acceptance_head import draft_identity

    hidden = json.loads((Path(draft) / "config.json").read_text())["hidden_size"]
    acceptance_head(hidden, **kw).save(str(path), draft_identity(str(draft)), threshold)
    return Path(path)


if __name__ == "__main__":
    import sys

    print(model_pair(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd())))


def prefill_then_masked_forward(m, device, prefill: int = 20, lens=(20, 17), new: int = 12):
    """Two draft forwards (draft/model.DraftModel m, cache allocated) on slots 2 and 0: a causal
    prefill of `prefill` tokens per row, then `new` tokens under a random mask behind prefixes
    of `lens` tokens (each <= prefill). Returns both forwards' hidden states on the host."""
    g = torch.Generator().manual_seed(0)
    B, P, Q = 2, prefill, new
    ids = torch.randint(0, m.vocab_size, (B, P), generator=g)
    causal = torch.ones(P, P, dtype=torch.bool).tril().expand(B, P, P)
    mask = (torch.rand(B, Q, Q, generator=g) < 0.4) | torch.eye(Q, dtype=torch.bool)
    toks = torch.randint(0, m.vocab_size, (B, Q), generator=g)
    slots, zero, at = (torch.tensor(x, device=device) for x in ([2, 0], [0, 0], list(lens)))
    pre = m.forward(ids.to(device), torch.arange(P, device=device).expand(B, P), slots, zero,
                    causal.to(device), max_cache_len=0)
    h = m.forward(toks.to(device), at[:, None] + torch.arange(Q, device=device), slots, at,
                  mask.to(device), max_cache_len=P)
    return pre.cpu(), h.cpu()
