"""Ouroboros speculative decoding for vLLM: phrase-by-phrase drafting from a phrase pool."""

# Our logger sits under "vllm": vLLM configures that logger's handler and level
# (VLLM_LOGGING_LEVEL) in every process; a top-level name would have no handler and drop every
# INFO line (the cost curves, the fallbacks' reasons) in servers and workers. kernels/ spells it
# out itself (it imports without this package).
LOGGER_NAME = "vllm.ouroboros"

from vllm_ouroboros.config import METHOD, OuroborosConfig  # noqa: E402

__all__ = ["LOGGER_NAME", "METHOD", "OuroborosConfig"]
__version__ = "0.1.0"
