"""Config area: accept method "ouroboros" in `speculative_config`, `-sc` JSON and --spec-method.

vLLM has no proposer registry; its supported plug-in point is method "custom_class". We
translate {"method": "ouroboros", "model": DRAFT, <our keys>} into custom_class pointing at our
proposer, and carry the validated OuroborosConfig in `additional_config["ouroboros"]`, which
vLLM ships to every engine and worker process (Ray actors included).
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.config import (METHOD, OuroborosConfig, TokenizerSource, resolved_draft_round,
                                   split_speculative_config, validate)
from vllm_ouroboros.patches._util import patch_method, require

logger = logging.getLogger(LOGGER_NAME)

PROPOSER_PATH = "vllm_ouroboros.proposer.OuroborosProposer"
ADDITIONAL_CONFIG_KEY = "ouroboros"


def is_ouroboros(speculative_config) -> bool:
    """Whether an engine's SpeculativeConfig is ours (translated by this module)."""
    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_PATH)


_SHORTHANDS = (("--spec-method", "method", "spec_method"), ("--spec-model", "model", "spec_model"),
               ("--spec-tokens", "num_speculative_tokens", "spec_tokens"))


def _shorthand_merged(args) -> dict | None:
    """The speculative config as vLLM will see it after merging the --spec-* shorthands. Keys
    are normalised (`num-suffixes` is `num_suffixes`) before the shorthands are checked against
    them: a key given in both spellings, or by a shorthand and the JSON in the other spelling,
    is refused instead of the later one winning unseen."""
    spec = {}
    for k, v in (args.speculative_config or {}).items():
        key = k.replace("-", "_") if isinstance(k, str) else k
        if key in spec:
            raise ValueError(f"--speculative-config gives '{key}' twice (as '{k}' too)")
        spec[key] = v
    for flag, key, attr in _SHORTHANDS:
        value = getattr(args, attr)
        if value is not None:
            if key in spec:
                raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
            spec[key] = value
    return spec or None


def _create_speculative_config(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = _shorthand_merged(self)
        if not spec or spec.get("method") != METHOD:
            return original(self, target_model_config, target_parallel_config)
        if getattr(self, "async_scheduling", None):
            # vLLM's own refusal names the methods that support it, not why this one does not.
            raise ValueError(
                "--async-scheduling is not supported with the ouroboros method: its proposer (vLLM's "
                "custom_class) drafts on the host from the tokens each step sampled, which async "
                "scheduling does not wait for; leave the flag out (vLLM then schedules synchronously "
                "for this method)")
        from vllm.config import SpeculativeConfig

        vllm_keys = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        cfg, vllm_spec = split_speculative_config(spec, vllm_keys)
        validate(cfg, target_vocab_size=target_model_config.get_vocab_size(),
                 target_tokenizer=_target_tokenizer(target_model_config))
        from vllm.platforms import current_platform

        # The draft runs on the platform's device: `draft_round` graph off CUDA is refused here,
        # at configuration, rather than when the worker loads.
        resolved_draft_round(cfg, current_platform.device_type)
        self.speculative_config = {
            **vllm_spec,
            "method": "custom_class",
            "model": PROPOSER_PATH,
            "num_speculative_tokens": cfg.spec_tokens(),
        }
        self.spec_method = self.spec_model = self.spec_tokens = None
        _piecewise_graphs_for_the_tree(self, cfg)
        if cfg.pool_save_path:
            # This process goes on to start the engine: its process manager must let the
            # engine core write the pool before killing it (engine_shutdown.py).
            from vllm_ouroboros.patches import engine_shutdown

            engine_shutdown.apply_process_manager()
        self.additional_config = {**(self.additional_config or {}),
                                  ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config


def _target_tokenizer(model_config) -> TokenizerSource:
    """Both vocabularies through vLLM's tokenizer loading: the target's as vLLM serves it (cached:
    the front end reuses it), the draft directory's with the target's trust_remote_code."""

    def target():
        from vllm.tokenizers import cached_tokenizer_from_config

        tok = cached_tokenizer_from_config(model_config)
        return None if tok is None else tok.get_vocab()

    def draft(path: str):
        from vllm.tokenizers import get_tokenizer

        return get_tokenizer(path, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
                             ).get_vocab()

    return TokenizerSource(target=target, draft=draft)


def _piecewise_graphs_for_the_tree(args, cfg: OuroborosConfig) -> None:
    """K >= 2 suffixes verified as a tree need the attention outside CUDA graphs (a full graph
    would replay the backend's attention without the tree rows: patches/tree_attention.install
    then falls back to the chain), so where the user left `cudagraph_mode` to vLLM, choose
    PIECEWISE, as vLLM itself does for dynamic speculative decoding. Full graphs would buy
    little here anyway: vLLM captures them for batches of exactly 1 + num_speculative_tokens
    tokens per request, which the tree's own size and the back-off's cuts rarely give. A mode
    the user set is kept (and the tree falls back under it, saying why)."""
    from vllm.platforms import current_platform

    if cfg.tree_suffixes < 2 or args.enforce_eager or not current_platform.is_cuda_alike():
        return
    from vllm.config import CompilationConfig, CUDAGraphMode

    cc = args.compilation_config
    if isinstance(cc, dict):  # EngineArgs(compilation_config={...}) before its __post_init__
        cc = args.compilation_config = CompilationConfig(**cc)
    if cc.cudagraph_mode is not None:
        return
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    logger.info("ouroboros: num_suffixes=%d verifies a token tree, whose attention must run "
                "outside CUDA graphs: cudagraph_mode set to PIECEWISE (set -cc.cudagraph_mode to "
                "choose otherwise)", cfg.num_suffixes)


def _add_cli_args(original):
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        # --spec-method takes its choices from vLLM's SpeculativeMethod Literal.
        for action in parser._actions:
            if "--spec-method" in action.option_strings and action.choices is not None:
                if METHOD not in action.choices:
                    action.choices = [*action.choices, METHOD]
        return parser

    return add_cli_args


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    import vllm.tokenizers

    require(EngineArgs, "create_speculative_config", "add_cli_args")
    require(vllm.tokenizers, "cached_tokenizer_from_config", "get_tokenizer")  # _target_tokenizer
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    missing = {"spec_method", "spec_model", "spec_tokens", "additional_config",
               "speculative_config"} - fields
    if missing:
        require(EngineArgs, *sorted(missing))  # raises with the supported-versions message
    patch_method(EngineArgs, "create_speculative_config", _create_speculative_config)
    patch_method(EngineArgs, "add_cli_args", _add_cli_args)
