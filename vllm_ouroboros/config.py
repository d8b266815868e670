"""OuroborosConfig: every knob of the method, validated once, with errors that name the fix.

Users write the knobs into vLLM's speculative config next to vLLM's own keys:
    {"method": "ouroboros", "model": "/path/to/draft", "gamma": 4, "num_suffixes": 1}
`split_speculative_config` separates ours from vLLM's; nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

METHOD = "ouroboros"


class OuroborosConfigError(ValueError):
    """A bad Ouroboros setting; the message says which key and what is allowed."""


@dataclass(frozen=True)
class OuroborosConfig:
    """Settings of one Ouroboros deployment (names follow the Ouroboros paper: gamma, beta, W, G, K).

    Settings that depend on the device default to None ("auto"): phrase drafting is switched on
    or off at load from the draft's measured cost curve, and speculation backs off per step
    and request (load, poor acceptance) (cost_model.py; README "Choosing settings per hardware").
    """

    draft_model: str
    # Minimum sentence-draft length per round (tokens); the draft may overshoot by < beta.
    gamma: int = 4
    # Phrase length in tokens including its key token (a stored phrase has beta-1 tokens).
    beta: int = 5
    # Lookahead (Jacobi) window columns, and phrases kept per key in the pool.
    window_size: int = 4
    # Pool phrases the draft verifies per draft forward (guess branch).
    num_guesses: int = 4
    # Candidate suffixes appended to the sentence draft (K). K >= 2 are verified as a token tree
    # in the same target forward; K = 1 is a plain chain.
    num_suffixes: int = 1
    # Verify K >= 2 suffixes as a tree; false falls back to the chain draft + best suffix.
    tree_verification: bool = True
    # Cap on tokens sent to the target per round (draft + suffix); None: derived.
    num_speculative_tokens: int | None = None
    # Device memory for the phrase pool, MiB.
    pool_budget_mb: float = 64.0
    # Share one pool across requests (warm start) instead of one private view per request.
    warm_start: bool = True
    pool_load_path: str | None = None
    pool_save_path: str | None = None
    # Also write it each time the engine goes idle (its last request removed), unless the file
    # holds it already: a process killed while idle loses nothing. false: periodic saves and
    # the save at shutdown only (storage where a write per idle spell costs too much).
    pool_save_on_idle: bool = True
    # Mechanism switches, for ablations. Phrase drafting (Jacobi window, pool guesses): None =
    # decided at load from the draft's cost curve on this device (cost_model.py).
    use_lookahead: bool | None = None
    use_guesses: bool | None = None
    # The draft model drafts; false: the pool alone does, with no draft forward (the "pool"
    # mode, pool_draft.py); None = decided at load with the two switches above (cost_model.py),
    # the draft model where draft_length is adaptive (its head stops the model's drafts).
    use_draft: bool | None = None
    # With all three switches above on auto: every this-many decoding steps, the draft model's
    # mode and the pool mode are priced again from what the engine measured (its step time,
    # tokens per target forward of each mode) and the cheaper one drafts (mode_review.py);
    # 0 = the mode chosen at load stays.
    mode_review_steps: int = 64
    # In the draft model's mode, a request it does not draft for this step (the back-off's
    # choice, a prompt given as embeddings, a full draft cache) drafts from the pool alone where
    # the pool's own estimates for it say that pays beside the model's rows (proposer.py,
    # cost_model.speculation_plan with no draft forward); None = on where the target's curve is
    # flat (cost_model.is_flat: a GPU's, not this CPU's) and max_speculative_batch is unset;
    # true = wherever the back-off plans; false = such a request decodes without a draft.
    pool_fill: bool | None = None
    # The pool's drafts (the pool mode, pool fill) as K branches under the last confirmed token
    # (its K best phrases, as Lookahead Decoding verifies n-grams) instead of a chain of best
    # phrases with K suffixes at its end (pool_draft.py). Needs the tree (tree_suffixes >= 2).
    # None = on wherever the tree is sent; a step without the tree sends the chain.
    pool_branches: bool | None = None
    # Back-off: a step with more decoding requests than this speculates for none of them.
    # None = decided per step and request from the device's cost curves and each request's
    # acceptance, with drafts cut short where load makes the target's tokens dear
    # (cost_model.speculation_plan).
    max_speculative_batch: int | None = None
    # Candidate suffixes sent to the target: None = per step and request, where their measured
    # acceptance pays for their target tokens on this device (cost_model.rows_sending_suffixes);
    # true = always (K of them, as num_suffixes says); false = never (the draft alone).
    use_suffixes: bool | None = None
    use_inspiration: bool = True
    # Inspiration at the rejection itself: the target's tokens after the rejected position,
    # keyed by its correction, where the draft's next this-many tokens agreed with the target's
    # (feedback.correction_phrases); None = off. Off: 1.5-2% fewer draft forwards at one request
    # (HumanEval, 8 and 20 prompts), none at five concurrent requests, where tokens per target
    # forward fell (results/README.md, "Candidate inspiration at the rejection").
    correction_phrases: int | None = None
    use_refinement: bool = True
    # Phrases from the confirmed text itself (prompt + accepted tokens), see feedback.py.
    use_context_phrases: bool = True
    # Only the last this-many prompt tokens seed the pool when a request starts.
    context_phrase_window: int = 2048
    # Draft weights dtype; "auto" follows the target's dtype.
    draft_dtype: str = "auto"
    # The draft's matrix products on CPU: "auto" uses vLLM's prepacked oneDNN GEMM where the build
    # has it (a flatter, lower cost curve, for a prepacked copy of the weights);
    # "torch" keeps F.linear throughout. GPUs always use torch.
    draft_cpu_gemm: str = "auto"
    # The draft's attention: "auto" runs the Triton tree-attention kernel on CUDA for forwards of
    # at most 64 new tokens per row (torch SDPA with a dense mask elsewhere); "torch" keeps SDPA.
    draft_attention: str = "auto"
    # The draft's layers through fused Triton kernels (add+RMSNorm, RoPE + KV write, SiLU*up;
    # kernels/fused_ops.py): fewer kernel launches per layer. None (auto): on CUDA, where
    # scripts/bench_gpu.py measured a graph-replayed draft forward at half the time (H200, bf16,
    # 1 request: 1.48 vs 2.91 ms); off on CPU, where they would run as the torch fallback.
    # False also keeps the device round's work around each forward (inputs, masks, bookkeeping)
    # in torch instead of its two kernels (kernels/round_steps.py, on CUDA after a check).
    draft_fused_ops: bool | None = None
    # With the fused layers: each add+RMSNorm inside the product that reads it, and SiLU*up inside
    # the gate_up product (kernels/norm_gemm.py; forwards of <= 64 tokens), three launches fewer
    # per layer, in Triton weight-streaming products instead of cuBLAS's. Whether that pays
    # depends on the GPU, so None (auto) times the draft's forward both ways at load and keeps the
    # faster (draft/fusion_choice.py; CUDA with the fused layers only). True: on, untimed.
    # Checked against torch at load either way; off where the check fails.
    draft_norm_gemm: bool | None = None
    # Upper bound on draft forwards in one round, whatever the draft's progress.
    max_draft_forwards: int = 16
    # Where a round's drafting loop runs (draft/runtime.py): "host" sizes each forward from the
    # last one's output (a device->host read per forward: free on a CPU, a stall on a GPU);
    # "device" fixes every shape before the round (no read inside it); "graph" replays the
    # device round from CUDA graphs (CUDA only). "auto": graph on CUDA, host elsewhere.
    draft_round: str = "auto"
    # Draft KV pages allocated at load, in tokens per request of the first batch (16 requests,
    # 64 with graphs): the pages are shared, so one long request takes more of them. The page
    # store grows on demand.
    draft_initial_len: int = 2048
    # Most device memory the draft's KV cache pages may take, MiB (None: grown on demand without
    # a bound). A request that would need more decodes without a draft (lossless) until it fits.
    draft_cache_max_mb: float | None = None
    # Sentence-draft length: "fixed" drafts >= gamma tokens per round; "adaptive" (SpecDec++)
    # stops each row's draft once its acceptance head predicts that the draft so far holds a
    # rejection with probability > acceptance_threshold, or at max_draft_length tokens.
    draft_length: str = "fixed"
    # Head file from scripts/train_acceptance_head.py, trained for this draft (adaptive only).
    acceptance_head: str | None = None
    # h in (0, 1); None: the threshold picked on held-out data when the head was trained.
    acceptance_threshold: float | None = None
    # Hard cap on an adaptive sentence draft (tokens); gamma does not apply in adaptive mode.
    max_draft_length: int = 12
    # Cost curves t(n), {tokens per row: ms per forward} (n = 1 required), for the draft and the
    # target, used instead of timing them at load (cost_model.py): the same decisions at every
    # start, no timing on a busy host, or another device's decisions reproduced here (with
    # calibrate_costs off).
    draft_cost_ms: dict[str, float] | None = None
    target_cost_ms: dict[str, float] | None = None
    # Scale the draft's curves online by what its rounds and prefills measured (the back-off's
    # calibration: a round costs more than its forwards, the host's and the pool's work). Off:
    # the curves as given, e.g. another device's, whose decisions this host's timing would
    # otherwise pull back to its own (a CPU reproducing a GPU's cut its drafts to chains).
    calibrate_costs: bool = True

    @property
    def phrase_len(self) -> int:
        """Tokens stored per phrase (beta - 1)."""
        return self.beta - 1

    @property
    def max_draft_len(self) -> int:
        """Longest sentence draft a round can produce: gamma - 1 + one last forward of beta
        (fixed), max_draft_length (adaptive: the cap cuts the last forward's phrase)."""
        if self.draft_length == "adaptive":
            return self.max_draft_length
        return self.gamma - 1 + self.beta

    @property
    def tree_suffixes(self) -> int:
        """Suffixes sent per round: K with the tree path, else at most the best one."""
        if self.use_suffixes is False:
            return 0
        return self.num_suffixes if self.tree_verification else min(self.num_suffixes, 1)

    @property
    def pool_drafts_branches(self) -> bool:
        """Whether the pool drafts branches under the root (pool_branches on or auto, K >= 2 on
        the tree path) in a step that sends the tree; other steps send its chain."""
        return self.pool_branches is not False and self.tree_suffixes >= 2

    def spec_tokens(self) -> int:
        """Tokens per round sent to the target: draft plus the appended suffixes, capped."""
        derived = self.max_draft_len + self.tree_suffixes * self.phrase_len
        if self.num_speculative_tokens is None:
            return derived
        return self.num_speculative_tokens

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OuroborosConfig":
        return cls(**d)


# Allowed ranges: (min, max) inclusive; None = unbounded.
_INT_RANGES = {
    "gamma": (1, 64),
    "beta": (2, 16),
    "window_size": (1, 64),
    "num_guesses": (0, 64),
    "num_suffixes": (0, 8),
    "num_speculative_tokens": (1, 128),  # vLLM's rejection sampler allows 128
    "max_draft_forwards": (1, 128),
    "draft_initial_len": (16, None),
    "max_draft_length": (1, 64),
    "context_phrase_window": (0, None),
    "max_speculative_batch": (1, None),
    "correction_phrases": (0, 15),
    "mode_review_steps": (0, None),
}
_OPTIONAL_INTS = {"num_speculative_tokens", "max_speculative_batch", "correction_phrases"}  # None = derived / auto / off
_AUTO_BOOL_KEYS = {"use_lookahead", "use_guesses", "use_draft", "use_suffixes", "pool_fill", "pool_branches",
                   "draft_fused_ops", "draft_norm_gemm"}  # None = decided on the device
_BOOL_KEYS = {f.name for f in dataclasses.fields(OuroborosConfig)
              if f.type in ("bool", bool)} | _AUTO_BOOL_KEYS
OUROBOROS_KEYS = {f.name for f in dataclasses.fields(OuroborosConfig)} - {"draft_model"}


def validate(cfg: OuroborosConfig, target_vocab_size: int | None = None,
             target_tokenizer: TokenizerSource | None = None) -> OuroborosConfig:
    """Check every field; raise OuroborosConfigError naming the key and the allowed values.

    target_vocab_size: the target's embedding rows. A draft with another number of rows is
    accepted only where its tokenizer is the target's (`target_tokenizer`), as Qwen2.5-0.5B
    (151,936 rows) with Qwen2.5-7B+ (152,064): one tokenizer, embeddings padded differently.
    """
    for key, (lo, hi) in _INT_RANGES.items():
        value = getattr(cfg, key)
        if value is None and key in _OPTIONAL_INTS:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise OuroborosConfigError(f"ouroboros: '{key}' must be an integer, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise OuroborosConfigError(f"ouroboros: '{key}'={value} is out of range {bound}")
    for key in _BOOL_KEYS:
        if key in _AUTO_BOOL_KEYS and getattr(cfg, key) is None:
            continue
        if not isinstance(getattr(cfg, key), bool):
            raise OuroborosConfigError(f"ouroboros: '{key}' must be true or false"
                                       + (" (or null: auto)" if key in _AUTO_BOOL_KEYS else ""))
    if cfg.pool_fill and cfg.max_speculative_batch is not None:
        raise OuroborosConfigError(
            "ouroboros: pool_fill=true needs the back-off's per-request plan; max_speculative_batch="
            f"{cfg.max_speculative_batch} fixes which requests speculate (unset it, or leave pool_fill on auto)")
    if cfg.pool_branches and cfg.tree_suffixes < 2:
        raise OuroborosConfigError(
            "ouroboros: pool_branches=true sends the pool's phrases as branches of a token tree, "
            f"which needs num_suffixes >= 2 with tree_verification and use_suffixes not false (got "
            f"num_suffixes={cfg.num_suffixes}, tree_verification={cfg.tree_verification}, "
            f"use_suffixes={cfg.use_suffixes}); leave pool_branches on auto or false")
    pinned = [k for k in ("use_lookahead", "use_guesses") if getattr(cfg, k) is not None]
    if cfg.use_draft is False and pinned:
        raise OuroborosConfigError(
            f"ouroboros: use_draft=false drafts from the pool alone, with no draft forward, so "
            f"{' and '.join(repr(k) for k in pinned)} (the draft model's phrase drafting) would be "
            "ignored; drop them, or drop use_draft (a pin of them keeps the draft model)")
    if cfg.num_guesses > cfg.window_size:
        raise OuroborosConfigError(
            f"ouroboros: num_guesses={cfg.num_guesses} exceeds window_size={cfg.window_size}; "
            "the pool keeps window_size phrases per key, so at most that many can be guessed"
        )
    if cfg.correction_phrases is not None and cfg.correction_phrases > cfg.beta - 2:
        raise OuroborosConfigError(
            f"ouroboros: correction_phrases={cfg.correction_phrases} exceeds beta - 2 = {cfg.beta - 2} "
            "(agreements among the phrase's tokens before its last)")
    if cfg.num_suffixes > cfg.window_size:
        raise OuroborosConfigError(
            f"ouroboros: num_suffixes={cfg.num_suffixes} exceeds window_size={cfg.window_size}"
        )
    if cfg.tree_suffixes >= 2 and cfg.spec_tokens() + 1 > 64:
        raise OuroborosConfigError(
            f"ouroboros: a tree of {cfg.spec_tokens() + 1} tokens (root + "
            f"num_speculative_tokens={cfg.spec_tokens()}) exceeds 64, the tree attention's "
            "limit; lower num_suffixes, gamma or beta, or set num_speculative_tokens"
        )
    if not _positive_number(cfg.pool_budget_mb):
        raise OuroborosConfigError(
            f"ouroboros: 'pool_budget_mb' must be a positive number, got {cfg.pool_budget_mb!r}"
        )
    if target_vocab_size is not None:
        from vllm_ouroboros.pool import PhrasePool

        need = PhrasePool.budget_for(target_vocab_size, cfg.beta - 1, cfg.window_size, 1)
        if int(cfg.pool_budget_mb * 2**20) < need:
            raise OuroborosConfigError(
                f"ouroboros: 'pool_budget_mb'={cfg.pool_budget_mb} cannot hold the pool's key table "
                f"for the target's {target_vocab_size} tokens plus one page (window_size="
                f"{cfg.window_size}, beta={cfg.beta}): give at least "
                f"{math.ceil(need / 2**20 * 100) / 100} MiB")
    if cfg.draft_cache_max_mb is not None and not _positive_number(cfg.draft_cache_max_mb):
        raise OuroborosConfigError(
            "ouroboros: 'draft_cache_max_mb' must be a positive number (or null: no bound), got "
            f"{cfg.draft_cache_max_mb!r}")
    for key in ("draft_model", "pool_load_path", "pool_save_path", "acceptance_head"):
        value = getattr(cfg, key)  # a missing draft is _validate_draft's to name
        if value is not None and not (isinstance(value, str) and (value or key == "draft_model")):
            name = "'model' (the draft model's directory)" if key == "draft_model" else f"'{key}'"
            raise OuroborosConfigError(f"ouroboros: {name} must be a path (a non-empty string)"
                                       + ("" if key == "draft_model" else " or null") + f", got {value!r}")
    if cfg.use_guesses is True and cfg.num_guesses == 0:
        raise OuroborosConfigError(
            "ouroboros: use_guesses=true with num_guesses=0 guesses nothing; set num_guesses >= 1 "
            "or leave use_guesses on auto")
    if cfg.draft_dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise OuroborosConfigError(
            f"ouroboros: 'draft_dtype'={cfg.draft_dtype!r}; use auto, float32, float16 or bfloat16"
        )
    if cfg.draft_cpu_gemm not in ("auto", "torch"):
        raise OuroborosConfigError(
            f"ouroboros: 'draft_cpu_gemm'={cfg.draft_cpu_gemm!r}; use auto or torch"
        )
    if cfg.draft_attention not in ("auto", "torch"):
        raise OuroborosConfigError(
            f"ouroboros: 'draft_attention'={cfg.draft_attention!r}; use auto or torch"
        )
    if cfg.draft_round not in ("auto", "host", "device", "graph"):
        raise OuroborosConfigError(
            f"ouroboros: 'draft_round'={cfg.draft_round!r}; use auto, host, device or graph"
        )
    for key in ("draft_cost_ms", "target_cost_ms"):
        _validate_cost_ms(key, getattr(cfg, key))
    if cfg.pool_load_path is not None:
        _validate_pool_file(cfg, target_vocab_size)
    if cfg.pool_save_path is not None:
        if not cfg.warm_start:
            raise OuroborosConfigError(
                f"ouroboros: 'pool_save_path' {cfg.pool_save_path!r} with 'warm_start': false: a "
                "private pool keeps each request's phrases to that request, and a saved pool can "
                "only be loaded as a shared one (its phrases then shown to every request); drop "
                "one of the two")
        _validate_pool_save_path(cfg.pool_save_path)
    _validate_draft(cfg.draft_model, target_vocab_size, target_tokenizer)
    _validate_draft_length(cfg)
    return cfg


def _validate_draft_length(cfg: OuroborosConfig) -> None:
    """Adaptive length: a readable head trained for this very draft, and h in (0, 1)."""
    if cfg.draft_length not in ("fixed", "adaptive"):
        raise OuroborosConfigError(
            f"ouroboros: 'draft_length'={cfg.draft_length!r}; use fixed or adaptive")
    h = cfg.acceptance_threshold
    if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h < 1):
        raise OuroborosConfigError(
            f"ouroboros: 'acceptance_threshold'={h!r} must be a number in (0, 1) (the predicted "
            "probability of a rejection at which a draft stops), or null for the head's own")
    if cfg.draft_length != "adaptive":
        pinned = [k for k in ("acceptance_head", "acceptance_threshold") if getattr(cfg, k) is not None]
        if pinned:
            raise OuroborosConfigError(
                f"ouroboros: {' and '.join(repr(k) for k in pinned)} stop drafts only with "
                f"draft_length='adaptive' (it is {cfg.draft_length!r}); set draft_length to "
                "adaptive or drop them")
        return
    if cfg.use_draft is False:
        raise OuroborosConfigError(
            "ouroboros: draft_length='adaptive' stops the draft model's drafts by its acceptance "
            "head; use_draft=false (drafts from the pool alone) has none to stop")
    if not cfg.acceptance_head:
        raise OuroborosConfigError(
            "ouroboros: draft_length='adaptive' needs 'acceptance_head', a head file trained for "
            "this draft by scripts/train_acceptance_head.py")
    from vllm_ouroboros.draft.acceptance_head import AcceptanceHeadError, load_head

    try:
        load_head(cfg.acceptance_head, cfg.draft_model)
    except AcceptanceHeadError as e:
        raise OuroborosConfigError(str(e)) from e


def _positive_number(value) -> bool:
    """A finite number > 0, not a bool (JSON's NaN and Infinity parse to floats)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def cost_points(value: dict) -> list[tuple[int, float]]:
    """A *_cost_ms setting as (n, ms) points sorted by n (JSON gives the keys as strings)."""
    return sorted((int(n), float(ms)) for n, ms in value.items())


def _validate_cost_ms(key: str, value) -> None:
    if value is None:
        return
    how = (f"ouroboros: '{key}' must map tokens per row (integers >= 1, 1 among them) to "
           f"milliseconds per forward (> 0), e.g. {{\"1\": 2.4, \"64\": 3.1}}; got {value!r}")
    if not isinstance(value, dict) or not value:
        raise OuroborosConfigError(how)
    for n, ms in value.items():
        ok_n = (isinstance(n, int) and not isinstance(n, bool)) or (
            isinstance(n, str) and n.isascii() and n.isdigit())  # "²" is a digit int() refuses
        if not ok_n or int(n) < 1 or not _positive_number(ms):
            raise OuroborosConfigError(how)
    if 1 not in {int(n) for n in value}:
        raise OuroborosConfigError(how)
    if len({int(n) for n in value}) < len(value):  # "1" and "01": one point twice
        raise OuroborosConfigError(f"ouroboros: '{key}' gives a token count twice ({sorted(value)}); "
                                   "give each once")


def resolved_draft_round(cfg: OuroborosConfig, device_type: str, enforce_eager: bool = False) -> str:
    """The drafting loop for this device: "auto" is "graph" on CUDA ("device", the same round
    without CUDA graphs, where the engine runs with enforce_eager), "host" elsewhere; "graph"
    anywhere but CUDA is refused naming the key."""
    if cfg.draft_round == "auto":
        return ("device" if enforce_eager else "graph") if device_type == "cuda" else "host"
    if cfg.draft_round == "graph" and device_type != "cuda":
        raise OuroborosConfigError(
            f"ouroboros: 'draft_round'='graph' replays CUDA graphs; the draft runs on {device_type}: "
            "use auto, host or device")
    return cfg.draft_round


def resolved_threshold(cfg: OuroborosConfig, head_threshold: float) -> float:
    """h for the stopping rule: the configured one, else the one saved with the head."""
    return float(cfg.acceptance_threshold if cfg.acceptance_threshold is not None else head_threshold)


def _validate_pool_save_path(path: str) -> None:
    """Refuse a pool_save_path the engine could not write, at start-up rather than at the first
    drafting step's save."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OuroborosConfigError(f"ouroboros: 'pool_save_path' {path!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise OuroborosConfigError(f"ouroboros: 'pool_save_path' {path!r}: its directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OuroborosConfigError(f"ouroboros: 'pool_save_path' {path!r}: its directory {folder!r} is not writable")


def _validate_pool_file(cfg: OuroborosConfig, target_vocab_size: int | None) -> None:
    """Refuse a pool file that is missing, unreadable, truncated or saved for other settings,
    at start-up rather than when the first worker loads it."""
    from vllm_ouroboros.pool import PhrasePool, PoolFileError

    path = cfg.pool_load_path
    if not cfg.warm_start:
        raise OuroborosConfigError(
            f"ouroboros: 'pool_load_path' {path!r} with 'warm_start': false: a private pool shows "
            "each request its own phrases only, and a loaded pool's phrases belong to no request "
            "(none would ever be drafted from); drop one of the two")
    if not os.path.isfile(path):
        raise OuroborosConfigError(f"ouroboros: 'pool_load_path' {path!r} does not exist")
    try:
        sd = PhrasePool.read_state(path, mmap=True)
    except PoolFileError as e:
        raise OuroborosConfigError(f"ouroboros: 'pool_load_path' {path!r} {e}") from e
    # Another window_size loads (each key keeps its newest phrases, PhrasePool.load_state_dict);
    # another beta cannot: its phrases have another length.
    if sd["phrase_len"] + 1 != cfg.beta:
        raise OuroborosConfigError(
            f"ouroboros: 'pool_load_path' {path!r} holds a pool saved with beta={sd['phrase_len'] + 1}, "
            f"but this deployment has beta={cfg.beta}; use the same beta or another pool file")
    if target_vocab_size is not None and sd["vocab_size"] != target_vocab_size:
        raise OuroborosConfigError(
            f"ouroboros: 'pool_load_path' {path!r} holds a pool for a vocabulary of "
            f"{sd['vocab_size']} tokens; the target has {target_vocab_size}")


@dataclasses.dataclass(frozen=True)
class TokenizerSource:
    """How the two vocabularies ({token: id}) are read for the comparison; the patches pass
    vLLM's own tokenizer loading (patches/engine_args.py), so the target's is the tokenizer
    vLLM serves with (its mode, revision, remote code, token), read once for both."""

    target: Callable[[], "dict[str, int] | None"]  # None: the target has none (skip_tokenizer_init)
    draft: Callable[[str], "dict[str, int]"]  # the draft directory's


# The GGUF converters (and scripts/fetch_models.py's rebuild) fill a tokenizer up to its
# embedding's rows with tokens of this name: no text maps to them.
_PLACEHOLDER = re.compile(r"\[PAD\d+\]")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json")


def vocab_mismatch(draft_vocab: dict[str, int], target_vocab: dict[str, int], draft_rows: int) -> str | None:
    """None where the two tokenizers map every id they both hold to one token, each id only
    one holds is a placeholder ([PADn]), and the draft's embedding rows cover every real token;
    else why not, as a clause."""
    d = {i: t for t, i in draft_vocab.items()}
    g = {i: t for t, i in target_vocab.items()}
    other = sum(d[i] != g[i] for i in d.keys() & g.keys())
    alone = [t for i, t in {**d, **g}.items() if (i in d) != (i in g) and not _PLACEHOLDER.fullmatch(t)]
    if other or alone:
        return (f"the tokenizers differ ({other} ids name other tokens, {len(alone)} tokens are in "
                f"one only; {len(d)} tokens in the draft's, {len(g)} in the target's)")
    real = max((i for i, t in g.items() if not _PLACEHOLDER.fullmatch(t)), default=-1)
    if draft_rows <= real:
        return (f"the draft's {draft_rows} embedding rows do not reach the tokenizer's token id "
                f"{real} (the draft would read every token past its rows as one)")
    return None


def _tokenizer_mismatch(draft_path: str, draft_rows: int, source: TokenizerSource | None) -> str | None:
    """vocab_mismatch of the draft directory's tokenizer and the target's; or why it cannot be
    told, as a clause."""
    if source is None:
        return "the target's tokenizer was not given to compare with the draft's"
    # transformers makes a tokenizer of the special tokens alone from a bare config.json.
    if not set(_TOKENIZER_FILES) & set(os.listdir(draft_path)):
        return (f"the draft directory has no tokenizer to compare with the target's (none of "
                f"{', '.join(_TOKENIZER_FILES)})")
    try:
        theirs = source.target()
    except Exception as e:  # the loader's own errors: OSError, ValueError, ... as it raises them
        return f"the target's tokenizer could not be read ({type(e).__name__}: {e})"
    if theirs is None:
        return "the target's tokenizer is not loaded (skip_tokenizer_init)"
    try:
        mine = source.draft(draft_path)
    except Exception as e:
        return f"the draft's tokenizer could not be read ({type(e).__name__}: {e})"
    return vocab_mismatch(mine, theirs, draft_rows)


def _validate_draft(path: str | None, target_vocab_size: int | None,
                    target_tokenizer: TokenizerSource | None = None) -> None:
    if not path:
        raise OuroborosConfigError(
            "ouroboros: the draft model is missing; pass it as speculative_config 'model' "
            "(a local Hugging Face directory) or --spec-model"
        )
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise OuroborosConfigError(
            f"ouroboros: draft model {path!r} is not a local model directory with a config.json"
        )
    with open(config_path) as f:
        draft_cfg = json.load(f)
    # The worker would refuse an architecture it cannot run only once the engine starts, behind
    # the engine's start-up traceback; read it here, as the worker will.
    from vllm_ouroboros.draft.model import DraftConfig

    try:
        DraftConfig.from_hf(draft_cfg)
    except (ValueError, NotImplementedError, KeyError, TypeError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else str(e)
        raise OuroborosConfigError(f"ouroboros: draft model {path!r} cannot be run: {what}") from e
    vocab = draft_cfg.get("vocab_size") or draft_cfg.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise OuroborosConfigError(f"ouroboros: draft model {path!r} has no vocab_size in its config.json")
    # Another number of embedding rows is one tokenizer padded to another size only where the
    # tokenizers agree (DraftModel.fit_vocab serves that); else the ids mean other tokens.
    if target_vocab_size is not None and vocab != target_vocab_size:
        why = _tokenizer_mismatch(path, vocab, target_tokenizer)
        if why is not None:
            raise OuroborosConfigError(
                f"ouroboros: the draft's vocabulary ({vocab} ids, {path}) has another size than "
                f"the target's ({target_vocab_size}), and {why}; draft and target must share one "
                "tokenizer (its embeddings may be padded to other sizes)")


def split_speculative_config(spec: dict[str, Any], vllm_keys: set[str]) -> tuple[OuroborosConfig, dict[str, Any]]:
    """Split a user speculative config into (OuroborosConfig, the keys vLLM keeps).

    `spec` has method == "ouroboros". `vllm_keys` are the field names of vLLM's SpeculativeConfig.
    Unknown keys raise, listing ours. Of vLLM's fields only num_speculative_tokens (and the target
    configs vLLM adds itself) pass: the others describe a draft vLLM would manage, another
    method, or change vLLM's verification (rejection_sample_method "synthetic" would accept
    drafts without the target's say) or its KV reservations (parallel_drafting), so they are
    refused by name rather than passed on to do something else or nothing.
    """
    spec = dict(spec)
    spec.pop("method", None)
    draft = spec.pop("model", None)
    ours = {k: spec.pop(k) for k in list(spec) if k in OUROBOROS_KEYS}
    passed = {"num_speculative_tokens", "target_model_config", "target_parallel_config"}
    hints = {"enforce_eager": " (the draft's CUDA graphs follow 'draft_round', and the engine's "
                              "--enforce-eager)"}
    for key in list(spec):
        if key in passed:
            continue
        if key not in vllm_keys:
            raise OuroborosConfigError(
                f"ouroboros: unknown speculative_config key '{key}'. Ouroboros keys: "
                f"{', '.join(sorted(OUROBOROS_KEYS))}; or a vLLM SpeculativeConfig field"
            )
        raise OuroborosConfigError(
            f"ouroboros: speculative_config key '{key}' is not used by the ouroboros method"
            f"{hints.get(key, '')}")
    # num_speculative_tokens is both vLLM's (scheduler budget) and ours (cap): keep them equal.
    if "num_speculative_tokens" in spec:
        ours["num_speculative_tokens"] = spec.pop("num_speculative_tokens")
    try:
        cfg = OuroborosConfig(draft_model=draft, **ours)
    except TypeError as e:  # pragma: no cover - keys were filtered above
        raise OuroborosConfigError(f"ouroboros: {e}") from e
    return cfg, spec
