"""Every hook into vLLM internals lives in this package, one file per vLLM area.

`apply_all()` runs at plugin registration in every process. Patches of the model runner are
applied lazily from the proposer's constructor (`model_runner.apply`): importing the runner in the
API-server process would cost seconds for nothing.
"""

from __future__ import annotations

from vllm_ouroboros.patches.engine_args import ADDITIONAL_CONFIG_KEY

__all__ = ["ADDITIONAL_CONFIG_KEY", "apply_all"]


def apply_all() -> None:
    """Apply the patches that every process needs, in order."""
    from vllm_ouroboros.patches import bias_min_p, engine_args, engine_shutdown

    engine_args.apply()
    bias_min_p.apply()
    engine_shutdown.apply_engine_core()
