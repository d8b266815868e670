"""Ouroboros speculative decoding for vLLM: phrase-by-phrase drafting from a phrase pool."""

from vllm_ouroboros.config import METHOD, OuroborosConfig

__all__ = ["METHOD", "OuroborosConfig"]
__version__ = "0.1.0"
