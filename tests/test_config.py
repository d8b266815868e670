"""Bad Ouroboros settings fail once, at engine configuration, with a message naming the fix.

These build vLLM's config objects only (no engine start): fast.
"""

from __future__ import annotations

import json

import pytest

from tiny_models import build_model, padded_vocab_copy

from vllm_ouroboros.config import OuroborosConfig, OuroborosConfigError, validate


NO_VLLM = "builds vLLM's engine config; vLLM is not installed here (e.g. the lent GPU machine)"


def engine_config(target, spec: dict, **engine_kw):
    pytest.importorskip("vllm", reason=NO_VLLM)
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(target), dtype="float32", max_model_len=256,
                      speculative_config=spec, **engine_kw)
    return args.create_engine_config()


def test_valid_config_becomes_custom_class_with_settings(tiny_models):
    cfg = engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(tiny_models["draft"]),
                                                "gamma": 5, "num_suffixes": 1})
    assert cfg.speculative_config.method == "custom_class"
    assert cfg.speculative_config.model == "vllm_ouroboros.proposer.OuroborosProposer"
    ours = OuroborosConfig.from_dict(cfg.additional_config["ouroboros"])
    assert ours.gamma == 5 and ours.draft_model == str(tiny_models["draft"])
    # Derived cap: longest draft (gamma - 1 + beta) plus one suffix (beta - 1).
    assert cfg.speculative_config.num_speculative_tokens == ours.spec_tokens() == (5 - 1 + ours.beta) + (ours.beta - 1)


@pytest.mark.parametrize("spec_extra, message", [
    ({"gamma_typo": 3}, "unknown speculative_config key 'gamma_typo'"),
    # vLLM fields that would do something else, or nothing, under ouroboros are refused by name
    ({"rejection_sample_method": "synthetic"}, "key 'rejection_sample_method' is not used by the ouroboros method"),
    ({"parallel_drafting": True}, "key 'parallel_drafting' is not used by the ouroboros method"),
    ({"enforce_eager": True}, "key 'enforce_eager' is not used by the ouroboros method .the draft's CUDA graphs"),
    ({"quantization": "fp8"}, "key 'quantization' is not used by the ouroboros method"),
    ({"gamma": 0}, "'gamma'=0 is out of range"),
    ({"beta": 1}, "'beta'=1 is out of range"),
    ({"num_guesses": 9, "window_size": 4}, "num_guesses=9 exceeds window_size=4"),
    ({"num_suffixes": -1}, "'num_suffixes'=-1 is out of range"),
    ({"correction_phrases": -1}, "'correction_phrases'=-1 is out of range"),
    ({"correction_phrases": 4}, "correction_phrases=4 exceeds beta - 2 = 3"),
    ({"correction_phrases": True}, "'correction_phrases' must be an integer"),
    ({"pool_budget_mb": 0}, "'pool_budget_mb' must be a positive number"),
    ({"pool_budget_mb": True}, "'pool_budget_mb' must be a positive number"),  # not 1 MiB
    ({"pool_budget_mb": float("nan")}, "'pool_budget_mb' must be a positive number"),  # JSON's NaN
    ({"draft_cache_max_mb": float("inf")}, "'draft_cache_max_mb' must be a positive number"),
    # The key table of the target's vocabulary (384 tokens: 1,536 bytes) plus one page: not at load
    ({"pool_budget_mb": 0.001}, "'pool_budget_mb'=0.001 cannot hold the pool's key table for the "
                                "target's 384 tokens plus one page .* give at least 0.01 MiB"),
    ({"pool_save_path": ""}, "'pool_save_path' must be a path .a non-empty string. or null, got ''"),
    ({"pool_load_path": 5}, "'pool_load_path' must be a path"),
    ({"use_guesses": True, "num_guesses": 0}, "use_guesses=true with num_guesses=0 guesses nothing"),
    ({"draft_cost_ms": {"1": float("inf")}}, "'draft_cost_ms' must map tokens per row"),
    ({"draft_cost_ms": {"1": 2.0, "\u00b2": 3.0}}, "'draft_cost_ms' must map tokens per row"),
    ({"draft_cache_max_mb": -1}, "'draft_cache_max_mb' must be a positive number .or null: no bound."),
    ({"draft_cache_max_mb": "1G"}, "'draft_cache_max_mb' must be a positive number"),
    ({"num_speculative_tokens": 500}, "'num_speculative_tokens'=500 is out of range"),
    ({"use_lookahead": "yes"}, "'use_lookahead' must be true or false"),
    ({"use_suffixes": 1}, "'use_suffixes' must be true or false .or null: auto."),
    ({"use_draft": "no"}, "'use_draft' must be true or false .or null: auto."),
    ({"use_draft": False, "use_lookahead": False}, "use_draft=false drafts from the pool alone, with no "
                                                   "draft forward, so 'use_lookahead' .* would be ignored"),
    ({"use_draft": False, "use_lookahead": True, "use_guesses": True}, "'use_lookahead' and 'use_guesses'"),
    ({"mode_review_steps": -1}, "'mode_review_steps'=-1 is out of range >= 0"),
    ({"draft_fused_ops": "on"}, "'draft_fused_ops' must be true or false .or null: auto."),
    ({"draft_norm_gemm": "on"}, "'draft_norm_gemm' must be true or false .or null: auto."),
    ({"pool_branches": "on"}, "'pool_branches' must be true or false .or null: auto."),
    ({"pool_branches": True}, "pool_branches=true sends the pool's phrases as branches of a token tree, "
                              "which needs num_suffixes >= 2 .* .got num_suffixes=1, tree_verification=True"),
    ({"pool_branches": True, "num_suffixes": 3, "tree_verification": False},
     "pool_branches=true .* .got num_suffixes=3, tree_verification=False, use_suffixes=None."),
    ({"gamma": 2.5}, "'gamma' must be an integer"),
    ({"draft_dtype": "int8"}, "'draft_dtype'='int8'"),
    ({"draft_attention": "flash"}, "'draft_attention'='flash'"),
    ({"draft_cpu_gemm": "mkl"}, "'draft_cpu_gemm'='mkl'"),
    ({"draft_round": "cuda"}, "'draft_round'='cuda'; use auto, host, device or graph"),
    ({"pool_load_path": "/nonexistent/pool.pt"}, "'pool_load_path' '/nonexistent/pool.pt' does not exist"),
    ({"pool_save_path": "/nonexistent/dir/pool.pt"},
     "'pool_save_path' '/nonexistent/dir/pool.pt': its directory '/nonexistent/dir' does not exist"),
    ({"pool_save_path": "/"}, "'pool_save_path' '/' is a directory"),
    ({"pool_load_path": "/nonexistent/pool.pt", "warm_start": False},
     "'pool_load_path' '/nonexistent/pool.pt' with 'warm_start': false: a private pool shows each request "
     "its own phrases only"),
    ({"pool_save_path": "/tmp/pool.pt", "warm_start": False},
     "'pool_save_path' '/tmp/pool.pt' with 'warm_start': false: a private pool keeps each request's "
     "phrases to that request"),
    ({"draft_cost_ms": {"2": 3.0}}, "'draft_cost_ms' must map tokens per row .integers >= 1, 1 among them."),
    ({"target_cost_ms": {"1": 0}}, "'target_cost_ms' must map tokens per row"),
    ({"target_cost_ms": {"one": 4.0}}, "'target_cost_ms' must map tokens per row"),
    ({"draft_cost_ms": [1, 2]}, "'draft_cost_ms' must map tokens per row"),
    ({"draft_cost_ms": {"1": 2.0, "01": 2.1}}, "'draft_cost_ms' gives a token count twice"),
    ({"num_suffixes": 4, "gamma": 30, "beta": 8, "window_size": 8},
     "a tree of 66 tokens .root \\+ num_speculative_tokens=65. exceeds 64"),
])
def test_bad_values_name_the_key(tiny_models, spec_extra, message):
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), **spec_extra}
    with pytest.raises(OuroborosConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        engine_config(tiny_models["target"], spec)


def test_missing_draft_path(tiny_models, tmp_path):
    with pytest.raises(OuroborosConfigError, match="is not a local model directory"):
        engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(tmp_path / "nope")})
    with pytest.raises(OuroborosConfigError, match="the draft model is missing"):
        engine_config(tiny_models["target"], {"method": "ouroboros"})


def test_vocabulary_mismatch(tiny_models, tmp_path):
    """Another vocabulary size is refused where the tokenizers differ (this one trained to 320
    tokens) or cannot be compared (no tokenizer in the draft's directory)."""
    other = build_model(tmp_path / "other_vocab", vocab_size=320, seed=5)
    with pytest.raises(OuroborosConfigError, match=r"draft's vocabulary \(320 ids.*the target's \(384\), "
                                                   r"and the tokenizers differ \(\d+ ids name other tokens, "
                                                   r"\d+ tokens are in one only; 320 tokens in the draft's, "
                                                   r"384 in the target's\)"):
        engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(other)})
    bare = padded_vocab_copy(tiny_models["close_draft"], tmp_path / "bare", 400)
    for f in bare.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            f.unlink()
    with pytest.raises(OuroborosConfigError, match="the draft directory has no tokenizer to compare"):
        engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(bare)})
    with pytest.raises(OuroborosConfigError, match="the target's tokenizer was not given"):
        validate(OuroborosConfig(draft_model=str(bare)), target_vocab_size=384)
    wide = padded_vocab_copy(tiny_models["close_draft"], tmp_path / "wide", 400)
    with pytest.raises(OuroborosConfigError, match=r"the target's tokenizer is not loaded \(skip_tokenizer_init\)"):
        engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(wide)}, skip_tokenizer_init=True)


def test_vocabularies_compared_id_by_id():
    """vocab_mismatch: GGUF-converted tokenizers carry [PADn] placeholders up to their model's
    rows (scripts/fetch_models.py's Qwen2.5-Coder-0.5B: 151,665 tokens and 271 of them); those
    alone differing is one tokenizer. A token in one only, an id naming another token, or a draft
    whose rows stop before the tokenizer's last real token is not."""
    from vllm_ouroboros.config import vocab_mismatch

    real = {f"t{i}": i for i in range(300)}
    pads = lambda lo, hi: {f"[PAD{i}]": i for i in range(lo, hi)}  # noqa: E731
    assert vocab_mismatch({**real, **pads(300, 320)}, {**real, **pads(300, 384)}, 320) is None
    assert vocab_mismatch({**real, **pads(300, 384)}, {**real, **pads(300, 320)}, 384) is None
    assert vocab_mismatch(real, {**real, "extra": 300}, 320) == (
        "the tokenizers differ (0 ids name other tokens, 1 tokens are in one only; 300 tokens in "
        "the draft's, 301 in the target's)")
    swapped = {**real, "t1": 2, "t2": 1}
    assert "2 ids name other tokens, 0 tokens are in one only" in vocab_mismatch(swapped, real, 320)
    assert vocab_mismatch(real, {**real, **pads(300, 384)}, 250) == (
        "the draft's 250 embedding rows do not reach the tokenizer's token id 299 (the draft would "
        "read every token past its rows as one)")


def test_one_tokenizer_with_embeddings_padded_to_other_sizes(tiny_models, tmp_path):
    """Qwen2.5-0.5B (151,936 rows) drafting for Qwen2.5-7B (152,064): one tokenizer, so either
    way round is accepted (DraftModel.fit_vocab and the pool's keys serve it)."""
    wide = padded_vocab_copy(tiny_models["close_draft"], tmp_path / "wide", 512)
    cfg = engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(wide)})
    assert cfg.speculative_config.method == "custom_class"
    cfg = engine_config(wide, {"method": "ouroboros", "model": str(tiny_models["close_draft"])})
    assert cfg.speculative_config.method == "custom_class"


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "gpt2"}, "draft model_type 'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "only 'silu' is supported"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "draft rope type 'yarn' is not supported"),
    ({"num_hidden_layers": None}, "cannot be run"),
])
def test_a_draft_the_worker_cannot_run_is_refused_at_configuration(tiny_models, tmp_path, edit, message):
    """The architecture checks the worker makes when it loads the draft run at configuration,
    before the engine starts (they failed only in the worker's start-up traceback)."""
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny_models["draft"], draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg.update(edit)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OuroborosConfigError, match=message):
        engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(draft)})


def test_other_methods_untouched(tiny_models):
    cfg = engine_config(tiny_models["target"], {"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative_config.method == "ngram"
    assert "ouroboros" not in (cfg.additional_config or {})


def test_spec_method_shorthand(tiny_models):
    """`vllm serve T --spec-method ouroboros --spec-model D` parses and configures ouroboros."""
    pytest.importorskip("vllm", reason=NO_VLLM)
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", str(tiny_models["target"]), "--dtype", "float32",
                            "--max-model-len", "256", "--spec-method", "ouroboros",
                            "--spec-model", str(tiny_models["draft"]), "--spec-tokens", "6"])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config()
    assert cfg.speculative_config.method == "custom_class"
    assert cfg.speculative_config.num_speculative_tokens == 6
    assert cfg.additional_config["ouroboros"]["draft_model"] == str(tiny_models["draft"])


def test_one_setting_given_twice_is_refused_whatever_its_spelling(tiny_models):
    """A shorthand and the JSON's hyphenated key, or both spellings in the JSON: refused (the
    later one silently won before keys were normalised). And --async-scheduling, which the
    method cannot run with, by a message that says so."""
    pytest.importorskip("vllm", reason=NO_VLLM)
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    base = ["--model", str(tiny_models["target"]), "--dtype", "float32", "--max-model-len", "256"]
    draft = str(tiny_models["draft"])
    cases = {
        r"--spec-tokens and --speculative-config\['num_speculative_tokens'\] are mutually exclusive":
            ["--spec-tokens", "4", "-sc", json.dumps({"method": "ouroboros", "model": draft,
                                                     "num-speculative-tokens": 9})],
        "--speculative-config gives 'num_suffixes' twice":
            ["-sc", json.dumps({"method": "ouroboros", "model": draft, "num-suffixes": 3, "num_suffixes": 2})],
        # Not a setting given twice, but refused here too: vLLM's own message named other methods.
        "--async-scheduling is not supported with the ouroboros method":
            ["--async-scheduling", "--spec-method", "ouroboros", "--spec-model", draft],
    }
    for message, argv in cases.items():
        ns = parser.parse_args(base + argv)
        with pytest.raises(ValueError, match=message):
            EngineArgs.from_cli_args(ns).create_engine_config()


def test_tree_sizes_the_token_cap(tiny_models):
    # K suffixes verified as a tree: the scheduler must allocate a slot for every node.
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "num_suffixes": 3}
    cfg = engine_config(tiny_models["target"], spec)
    ours = OuroborosConfig.from_dict(cfg.additional_config["ouroboros"])
    assert cfg.speculative_config.num_speculative_tokens == ours.max_draft_len + 3 * ours.phrase_len
    # The chain switch sends one suffix whatever K is.
    cfg = engine_config(tiny_models["target"], {**spec, "tree_verification": False})
    ours = OuroborosConfig.from_dict(cfg.additional_config["ouroboros"])
    assert ours.tree_suffixes == 1
    assert cfg.speculative_config.num_speculative_tokens == ours.max_draft_len + ours.phrase_len


def test_validate_directly(tiny_models):
    cfg = OuroborosConfig(draft_model=str(tiny_models["draft"]))
    assert validate(cfg, target_vocab_size=384) is cfg


@pytest.fixture(scope="module")
def head_files(tiny_models, tmp_path_factory):
    """An acceptance head for the tiny draft, and one trained for another draft (the Llama)."""
    from vllm_ouroboros.draft.acceptance_head import AcceptanceHead, HeadParams, draft_identity

    root = tmp_path_factory.mktemp("heads")
    head = AcceptanceHead(HeadParams(hidden_size=128, width=8))
    mine, other = str(root / "mine.safetensors"), str(root / "other.safetensors")
    head.save(mine, draft_identity(str(tiny_models["draft"])), 0.6)
    head.save(other, draft_identity(str(tiny_models["llama"])), 0.6)
    return {"mine": mine, "other": other}


def test_adaptive_draft_length_config(tiny_models, head_files):
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "draft_length": "adaptive",
            "acceptance_head": head_files["mine"], "max_draft_length": 10}
    cfg = engine_config(tiny_models["target"], spec)
    ours = OuroborosConfig.from_dict(cfg.additional_config["ouroboros"])
    assert ours.draft_length == "adaptive" and ours.acceptance_threshold is None
    # The cap replaces gamma - 1 + beta in the token budget; one suffix follows the draft.
    assert cfg.speculative_config.num_speculative_tokens == 10 + ours.phrase_len


@pytest.mark.parametrize("extra, message", [
    ({"draft_length": "dynamic"}, "'draft_length'='dynamic'; use fixed or adaptive"),
    ({"draft_length": "adaptive"}, "draft_length='adaptive' needs 'acceptance_head'"),
    ({"draft_length": "adaptive", "use_draft": False}, "use_draft=false .drafts from the pool alone. has none to stop"),
    ({"draft_length": "adaptive", "acceptance_head": "/nonexistent/head.safetensors"},
     "'acceptance_head' '/nonexistent/head.safetensors' does not exist"),
    ({"draft_length": "adaptive", "acceptance_head": "OTHER"},
     "'acceptance_head' .* was trained for the draft with identity [0-9a-f]{16}, but this draft .* has identity [0-9a-f]{16}"),
    ({"draft_length": "adaptive", "acceptance_head": "MINE", "acceptance_threshold": 1.0},
     "'acceptance_threshold'=1.0 must be a number in .0, 1."),
    ({"acceptance_threshold": 0}, "'acceptance_threshold'=0 must be a number in .0, 1."),
    ({"acceptance_head": "MINE"}, "'acceptance_head' stop drafts only with draft_length='adaptive' .it is 'fixed'."),
    ({"acceptance_head": "MINE", "acceptance_threshold": 0.5},
     "'acceptance_head' and 'acceptance_threshold' stop drafts only with draft_length='adaptive'"),
    ({"draft_length": "adaptive", "acceptance_head": "MINE", "max_draft_length": 0},
     "'max_draft_length'=0 is out of range"),
])
def test_adaptive_draft_length_errors_name_the_key(tiny_models, head_files, extra, message):
    extra = {k: {"OTHER": head_files["other"], "MINE": head_files["mine"]}.get(v, v)
             if isinstance(v, str) else v for k, v in extra.items()}
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), **extra}
    with pytest.raises(OuroborosConfigError, match=message):
        engine_config(tiny_models["target"], spec)


def test_draft_round_resolves_per_device(tiny_models):
    """auto: CUDA graphs on a GPU, the host loop on a CPU; graph mode on a CPU is refused naming
    the key, at the engine's configuration (the platform's device) and again at load."""
    from vllm_ouroboros.config import resolved_draft_round

    cfg = OuroborosConfig(draft_model=str(tiny_models["draft"]))
    assert resolved_draft_round(cfg, "cuda") == "graph"
    assert resolved_draft_round(cfg, "cuda", enforce_eager=True) == "device"  # no CUDA graphs
    assert resolved_draft_round(cfg, "cpu", enforce_eager=True) == "host"
    assert resolved_draft_round(cfg, "cpu") == "host"
    for mode in ("host", "device"):
        assert resolved_draft_round(OuroborosConfig(draft_model="d", draft_round=mode), "cpu") == mode
    assert resolved_draft_round(OuroborosConfig(draft_model="d", draft_round="graph"), "cuda") == "graph"
    with pytest.raises(OuroborosConfigError, match="'draft_round'='graph' replays CUDA graphs"):
        resolved_draft_round(OuroborosConfig(draft_model="d", draft_round="graph"), "cpu")
    # At the engine's configuration, on this platform's device (not first when the worker loads).
    from vllm.platforms import current_platform

    if current_platform.device_type != "cuda":
        with pytest.raises(OuroborosConfigError, match="'draft_round'='graph' replays CUDA graphs; the "
                                                       f"draft runs on {current_platform.device_type}"):
            engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(tiny_models["draft"]),
                                                  "draft_round": "graph"})


def test_cost_curves_as_configured(tiny_models):
    """Curves given in the config reach the proposer's settings as (n, ms) points, JSON's string
    keys read as token counts, and become CostCurves in seconds (non-decreasing, as measured
    ones are)."""
    from vllm_ouroboros import cost_model
    from vllm_ouroboros.config import cost_points

    cfg = engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(tiny_models["draft"]),
                                                "draft_cost_ms": {"1": 1.2, "34": 1.5, "64": 1.4},
                                                "target_cost_ms": {1: 3.66, 64: 4.66}})
    ours = OuroborosConfig.from_dict(cfg.additional_config["ouroboros"])
    draft = cost_model.curve_from_ms(cost_points(ours.draft_cost_ms))
    assert draft.n == (1, 34, 64) and draft.seconds == pytest.approx((0.0012, 0.0015, 0.0015))
    assert cost_model.curve_from_ms(cost_points(ours.target_cost_ms)).n == (1, 64)


def test_the_tree_asks_for_piecewise_cuda_graphs_on_a_gpu(monkeypatch, tiny_models):
    """K >= 2 suffixes verified as a tree need the attention outside CUDA graphs: on a GPU,
    where the user left cudagraph_mode to vLLM, the config patch sets PIECEWISE (as vLLM does
    for dynamic speculative decoding); a mode the user set, the chain (K = 1 or the tree off),
    --enforce-eager and a CPU are left alone."""
    pytest.importorskip("vllm", reason=NO_VLLM)
    from types import SimpleNamespace

    import vllm.platforms
    from vllm.config import CompilationConfig, CUDAGraphMode

    from vllm_ouroboros.patches.engine_args import _piecewise_graphs_for_the_tree

    class Platform:
        cuda = True

        def is_cuda_alike(self):
            return self.cuda

    platform = Platform()
    monkeypatch.setattr(vllm.platforms, "current_platform", platform)

    def mode_after(enforce_eager=False, cc=None, **ours):
        args = SimpleNamespace(enforce_eager=enforce_eager,
                               compilation_config=CompilationConfig() if cc is None else cc)
        _piecewise_graphs_for_the_tree(args, OuroborosConfig(draft_model="d", window_size=4, **ours))
        return args.compilation_config.cudagraph_mode

    assert mode_after(num_suffixes=3) == CUDAGraphMode.PIECEWISE
    assert mode_after(num_suffixes=2, cc={}) == CUDAGraphMode.PIECEWISE  # a dict, as EngineArgs takes
    assert mode_after(num_suffixes=3, cc=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")) \
        == CUDAGraphMode.FULL_AND_PIECEWISE
    assert mode_after(num_suffixes=1) is None
    assert mode_after(num_suffixes=3, tree_verification=False) is None
    assert mode_after(num_suffixes=3, use_suffixes=False) is None
    assert mode_after(num_suffixes=3, enforce_eager=True) is None
    platform.cuda = False
    assert mode_after(num_suffixes=3) is None
    # The tree's settings pass through vLLM's own config path (here, a CPU).
    monkeypatch.undo()
    cfg = engine_config(tiny_models["target"], {"method": "ouroboros", "model": str(tiny_models["draft"]),
                                                "num_suffixes": 3})
    assert OuroborosConfig.from_dict(cfg.additional_config["ouroboros"]).num_suffixes == 3


def test_pool_drafts_branches_where_the_tree_is_sent():
    def branches(**kw):
        return OuroborosConfig(draft_model="unused", **kw).pool_drafts_branches

    assert branches(num_suffixes=3) and branches(num_suffixes=2, pool_branches=True)
    assert not branches(num_suffixes=3, pool_branches=False)
    assert not branches()  # K = 1: the chain is the tree
    assert not branches(num_suffixes=3, tree_verification=False)
    assert not branches(num_suffixes=3, use_suffixes=False)
