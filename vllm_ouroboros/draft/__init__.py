"""Draft model runtime (no vLLM imports)."""

from vllm_ouroboros.draft.model import DraftConfig, DraftModel

__all__ = ["DraftConfig", "DraftModel"]
