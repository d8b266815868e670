"""SpecDec++ acceptance head: P(the target accepts this draft token) from the draft's hidden state.

The head reads the draft's final-normed last hidden state at the position whose output is the
draft token (DraftModel.forward returns exactly these), so predicting costs no extra draft forward.
Architecture as in SpecDec++: a linear input layer, `depth` residual SiLU blocks, a linear output
to one logit. The head runs in float32 whatever the draft's dtype (it is tiny).

A head is only meaningful for the draft it was trained on; its file records the draft's identity
(a hash of the draft's config.json) and, from heads trained since 2026-12-03, a fingerprint of
its weights (a fine-tuned draft keeps its config); loading it for another draft raises
AcceptanceHeadError, which names the setting `acceptance_head` and both identities.

No vLLM imports.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT = "ouroboros-acceptance-head-v1"


class AcceptanceHeadError(ValueError):
    """A head file that is missing, malformed or trained for another draft."""


def draft_identity(draft_dir: str) -> str:
    """Identity of a draft model: sha256 (first 16 hex digits) of its config.json, canonicalised
    (sorted keys), so that reformatting the file does not change it but any setting does."""
    path = os.path.join(draft_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def draft_weights_fingerprint(draft_dir: str, samples: int = 32, chunk: int = 1 << 16) -> str:
    """A fingerprint of the draft's weights: sha256 (first 16 hex digits) over each
    *.safetensors file's name, size and `samples` chunks of `chunk` bytes spread evenly over it
    (the first holds the header). A few MiB read whatever the draft's size, and a fine-tune or
    another perturbation changes every weight, so every chunk. Head files kept beside the
    weights are not the draft's: counted, a head saved there could never match its draft."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(draft_dir)
                   if n.endswith(".safetensors") and not _is_head_file(os.path.join(draft_dir, n)))
    for name in names:
        path = os.path.join(draft_dir, name)
        size = os.path.getsize(path)
        h.update(f"{name}:{size};".encode())
        with open(path, "rb") as f:
            for i in range(samples):
                f.seek(max(0, size - chunk) * i // max(samples - 1, 1))
                h.update(f.read(chunk))
    return h.hexdigest()[:16]


def _is_head_file(path: str) -> bool:
    """Whether a .safetensors file is an acceptance head (its header's format; a header read)."""
    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # noqa: BLE001 - unreadable: fingerprinted as the draft's, as before
        return False


@dataclass(frozen=True)
class HeadParams:
    """Hyperparameters of a head (recorded in its file)."""

    hidden_size: int  # the draft's hidden size H
    width: int = 256  # the residual blocks' width
    depth: int = 1  # residual SiLU blocks (SpecDec++: D + 1 layers in all)


class AcceptanceHead(nn.Module):
    """[..., H] hidden states -> [...] P(accept) in float32."""

    def __init__(self, params: HeadParams):
        super().__init__()
        self.params = params
        self.inp = nn.Linear(params.hidden_size, params.width)
        self.blocks = nn.ModuleList(nn.Linear(params.width, params.width) for _ in range(params.depth))
        self.out = nn.Linear(params.width, 1)

    def logit(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shape: hidden [..., H] (any float dtype) -> [...] float32 logits of P(accept)."""
        x = self.inp(hidden.float())
        for block in self.blocks:
            x = x + F.silu(block(x))
        return self.out(F.silu(x)).squeeze(-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shape: hidden [..., H] -> [...] float32 probabilities in (0, 1)."""
        return torch.sigmoid(self.logit(hidden))

    def save(self, path: str, draft_id: str, threshold: float, extra: dict | None = None,
             draft_weights: str | None = None) -> None:
        """Write weights + metadata (draft identity and weights fingerprint, hyperparameters,
        the tuned threshold h)."""
        meta = {"format": FORMAT, "draft_identity": draft_id, "params": json.dumps(asdict(self.params)),
                "threshold": repr(float(threshold)), "extra": json.dumps(extra or {})}
        if draft_weights is not None:
            meta["draft_weights"] = draft_weights
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)


@dataclass
class LoadedHead:
    head: AcceptanceHead
    draft_identity: str
    threshold: float  # the h picked on held-out data at training
    extra: dict
    draft_weights: str | None = None  # draft_weights_fingerprint at training (None: an older head)


def read_head(path: str) -> LoadedHead:
    """Read a head file without checking whom it was trained for."""
    if not os.path.isfile(path):
        raise AcceptanceHeadError(f"ouroboros: 'acceptance_head' {path!r} does not exist")
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
    except Exception as e:  # a truncated or foreign file
        raise AcceptanceHeadError(f"ouroboros: 'acceptance_head' {path!r} is not a readable head file: {e}") from e
    if meta.get("format") != FORMAT:
        raise AcceptanceHeadError(
            f"ouroboros: 'acceptance_head' {path!r} is not an acceptance head file (format "
            f"{meta.get('format')!r}, expected {FORMAT!r}); train one with scripts/train_acceptance_head.py")
    try:
        params = HeadParams(**json.loads(meta["params"]))
        head = AcceptanceHead(params)
        head.load_state_dict(tensors, strict=True)
        loaded = LoadedHead(head, meta["draft_identity"], float(meta["threshold"]),
                            json.loads(meta.get("extra", "{}")), meta.get("draft_weights"))
        if not (math.isfinite(loaded.threshold) and 0 < loaded.threshold < 1):
            # The rule would never (>= 1, nan) or always (<= 0) stop: the head ignored unseen.
            raise ValueError(f"threshold {loaded.threshold} is not in (0, 1)")
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # another version's, or damaged
        raise AcceptanceHeadError(
            f"ouroboros: 'acceptance_head' {path!r} is a head file this version cannot read "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}); train one with "
            "scripts/train_acceptance_head.py") from e
    head.requires_grad_(False)
    return loaded


def load_head(path: str, draft_dir: str, device: torch.device | str = "cpu") -> LoadedHead:
    """Read a head and check that it was trained for the draft at `draft_dir`."""
    loaded = read_head(path)
    mine = draft_identity(draft_dir)
    if loaded.draft_identity != mine:
        raise AcceptanceHeadError(
            f"ouroboros: 'acceptance_head' {path!r} was trained for the draft with identity "
            f"{loaded.draft_identity}, but this draft ({draft_dir}) has identity {mine}; "
            "train a head for this draft with scripts/train_acceptance_head.py")
    if loaded.draft_weights is not None and loaded.draft_weights != (w := draft_weights_fingerprint(draft_dir)):
        raise AcceptanceHeadError(
            f"ouroboros: 'acceptance_head' {path!r} was trained for a draft with this config but "
            f"other weights (fingerprint {loaded.draft_weights}; this draft's, {draft_dir}: {w}); "
            "train a head for this draft with scripts/train_acceptance_head.py")
    with open(os.path.join(draft_dir, "config.json")) as f:
        hs = json.load(f).get("hidden_size")
    if hs is not None and hs != loaded.head.params.hidden_size:  # same hash, other size: corrupt
        raise AcceptanceHeadError(
                f"ouroboros: 'acceptance_head' {path!r} reads hidden size "
                f"{loaded.head.params.hidden_size}, the draft has {hs}")
    loaded.head.to(device)
    return loaded


def stop_rule(p_accept: torch.Tensor, valid: torch.Tensor, prod_before: torch.Tensor,
              threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SpecDec++'s threshold policy over one forward's new tokens, per row.

    The draft so far is accepted whole with predicted probability prod(P(accept)); drafting stops
    right after the first token at which 1 - prod > threshold (that token stays in the draft).

    Shape:
      p_accept:    [A, N] float32, predicted acceptance of the forward's tokens, in order.
      valid:       [A, N] bool, the forward's real tokens (a prefix of each row).
      prod_before: [A] float32, prod(P(accept)) over the row's draft before this forward.
    Returns (take [A] int64: real tokens to keep, 1..; fired [A] bool: the rule stopped the row;
             prod_after [A] float32 over the kept tokens).
    """
    prods = prod_before[:, None] * torch.cumprod(torch.where(valid, p_accept, torch.ones_like(p_accept)), dim=1)
    fire = (1.0 - prods > threshold) & valid
    fired = fire.any(dim=1)
    n_valid = valid.long().sum(dim=1)
    take = torch.where(fired, fire.long().argmax(dim=1) + 1, n_valid)
    prod_after = prods.gather(1, (take - 1).clamp(min=0)[:, None])[:, 0]
    return take, fired, prod_after
