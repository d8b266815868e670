"""Through `vllm serve` (OpenAI completions API): ouroboros output equals the server's output
without speculation, with the method selected by the CLI shorthands and by `-sc` JSON."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import serve_process  # noqa: E402

from vllm_ouroboros.patches.engine_shutdown import PROCESS_GRACE_S  # noqa: E402

pytestmark = pytest.mark.engine

PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np\n", "class Stack:\n    def"]


def _seconds_from_sigterm_to_kill(log: str) -> float | None:
    """Seconds between vLLM's SIGTERM to the engine process and its SIGKILL, from a serve
    log's timestamps (whole seconds); None where it was not killed."""
    def when(marker):
        line = next((x for x in log.splitlines() if marker in x), None)
        if line is None:
            return None
        return datetime.strptime(re.search(r"\d\d-\d\d \d\d:\d\d:\d\d", line).group(0), "%m-%d %H:%M:%S")

    term, kill = when("send sigterm to process EngineCore"), when("force killing remaining process")
    if kill is None:
        return None
    assert term is not None, "killed without a SIGTERM logged"
    return (kill - term).total_seconds()


@contextmanager
def serve(model: Path, *extra: str, timeout: float = 600.0, stop_server_only: bool = False,
          log_path: Path | None = None):
    """A `vllm serve` of `model` (extra: more CLI arguments; scripts/serve_process.py), yielding
    its base URL; stopped by SIGTERM to its whole process group, or (stop_server_only) to the
    API server alone, as a container runtime stops it, waiting for it to exit. Its output goes
    to log_path (default: a file under TMPDIR)."""
    try:
        server = serve_process.start(model, ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                                             "--seed", "0", *extra], log_path, timeout)
    except serve_process.ServerFailed as e:
        pytest.fail(str(e))
    try:
        yield server.base
    finally:
        server.stop(group=not stop_server_only)


def complete(base: str, model: Path, prompt: str, max_tokens: int = 48, **extra) -> dict:
    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "logprobs": 1, **extra}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choice = json.load(r)["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "finish": choice["finish_reason"]}


# vLLM refuses both with its own speculative methods (a 400); ouroboros serves them. min_p = 1
# keeps only the top token: the sampled request is as deterministic as a greedy one.
BIAS_MIN_P = {"logit_bias": {"40": 3.0, "148": 2.0}, "temperature": 0.8, "min_p": 1.0, "seed": 5}
# Sampled with a seed: the tokens vLLM samples without speculation (seeded_sampling.py).
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11}


def complete_all(base: str, model: Path) -> list[dict]:
    """The greedy PROMPTS, then the first prompt with BIAS_MIN_P, then the second with SEEDED."""
    return [complete(base, model, p) for p in PROMPTS] + [complete(base, model, PROMPTS[0], **BIAS_MIN_P),
                                                          complete(base, model, PROMPTS[1], **SEEDED)]


def metrics(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def ouroboros_metrics(text: str) -> dict[str, float]:
    """Our series in a /metrics text, by name."""
    return {l.split()[0]: float(l.split()[-1]) for l in text.splitlines()
            if l.startswith("vllm:ouroboros_")}


def vllm_counter(text: str, name: str) -> float:
    """vLLM's counter `name` in a /metrics text (one engine)."""
    lines = [l for l in text.splitlines() if l.startswith(name + "{") or l.startswith(name + " ")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].split()[-1])


def assert_counts_are_vllms(text: str) -> dict[str, float]:
    """Our verification counters in /metrics equal vLLM's own spec-decode ones, read in the same
    scrape right after the last response: each is current, the burst's last step included (a
    rate-limited snapshot missed it: metrics_export.CounterFile). Returns ours."""
    ours = ouroboros_metrics(text)
    for mine, theirs in (("target_forwards", "num_drafts"), ("drafted_tokens", "num_draft_tokens"),
                         ("accepted_tokens", "num_accepted_tokens")):
        assert ours[f"vllm:ouroboros_{mine}_total"] == vllm_counter(text, f"vllm:spec_decode_{theirs}_total"), \
            (mine, theirs, ours)
    return ours


@pytest.fixture(scope="module")
def expected(tiny_models):
    target = tiny_models["target"]
    with serve(target) as base:
        out = complete_all(base, target)
    assert out[-2]["tokens"] != out[0]["tokens"]  # the bias bites
    assert out[-1]["tokens"] != out[1]["tokens"]  # the seeded request samples
    return out


def test_serve_spec_method_shorthand(tiny_models, expected):
    """`vllm serve T --spec-method ouroboros --spec-model D`."""
    target, draft = tiny_models["target"], tiny_models["draft"]
    with serve(target, "--spec-method", "ouroboros", "--spec-model", str(draft)) as base:
        got = complete_all(base, target)
        text = metrics(base)
    assert got == expected
    # vLLM's own speculative counters see our drafts; ours sit next to them and agree.
    assert vllm_counter(text, "vllm:spec_decode_num_draft_tokens_total") > 0
    ours = assert_counts_are_vllms(text)
    # All on auto: the tiny draft's forward (~1 ms here) costs ~5x the tiny target's linear
    # layers (~0.2 ms), so the load-time choice drafts from the pool alone (no draft forward);
    # the mode review (mode_review.py) then measures the engine's step (tens of ms here), which
    # the draft model's more tokens per target forward amortise, and switches to it.
    assert ours.get("vllm:ouroboros_rounds_total", 0) > 0, sorted(ours)
    assert ours.get("vllm:ouroboros_mode_switches_total", 0) >= 1, sorted(ours)
    assert ours.get("vllm:ouroboros_draft_forwards_total", 0) > 0, sorted(ours)
    assert ours.get("vllm:ouroboros_accepted_tokens_total", 0) > 0
    assert ours.get("vllm:ouroboros_pool_phrases", 0) > 0


def test_serve_speculative_config_json(tiny_models, expected, tmp_path):
    """`vllm serve T --speculative-config '{"method": "ouroboros", ...}'`, here with SpecDec++'s
    adaptive draft length (a fixed-weight acceptance head for the tiny draft): drafts cut by
    the head's rule change nothing in the served output."""
    from tiny_models import acceptance_head_file

    target, draft = tiny_models["target"], tiny_models["draft"]
    head = acceptance_head_file(draft, tmp_path / "head.safetensors", 0.5)
    spec = json.dumps({"method": "ouroboros", "model": str(draft), "beta": 3, "num_suffixes": 1,
                       "draft_length": "adaptive", "acceptance_head": str(head),
                       "max_draft_length": 6, "max_speculative_batch": 8})
    with serve(target, "--speculative-config", spec) as base:
        got = complete_all(base, target)
        text = metrics(base)
    assert got == expected
    ours = assert_counts_are_vllms(text)
    assert ours.get("vllm:ouroboros_stops_rule_total", 0) > 0, sorted(ours)
    # Adaptive length keeps the draft model on auto (its head stops the model's drafts).
    assert ours.get("vllm:ouroboros_draft_forwards_total", 0) > 0, sorted(ours)
    assert ours.get("vllm:ouroboros_accepted_tokens_total", 0) > 0


def test_serve_token_tree_k3(tiny_models, expected, tmp_path):
    """K = 3 suffixes verified as one token tree through the server (with logprobs requested,
    which the tree walk serves itself): same tokens, text and finish reasons. The close draft,
    so that four short completions reach their suffixes whatever the CPU's rounding.
    Stopped by SIGTERM to the API server alone (as `docker stop` does), the engine writes its
    pool: with vLLM's default shutdown_timeout 0 the engine process was SIGKILLed in the
    millisecond of its SIGTERM, the save lost (the real pair's 19-64 MB pools) or left a
    temporary file (engine_shutdown.py). The tiny pool's save can win that race: the log says
    whether the engine was killed."""
    target, draft = tiny_models["target"], tiny_models["close_draft"]
    pool, log = tmp_path / "pool.pt", tmp_path / "serve.log"
    spec = json.dumps({"method": "ouroboros", "model": str(draft), "num_suffixes": 3,
                       "use_suffixes": True, "max_speculative_batch": 64,  # whole drafts: no timing
                       "pool_save_path": str(pool)})
    with serve(target, "--speculative-config", spec, stop_server_only=True, log_path=log) as base:
        got = complete_all(base, target)
        text = metrics(base)
        time.sleep(1)  # a periodic save's thread under way finishes
        pool.unlink(missing_ok=True)  # what is there after the stop is the shutdown's
    assert got == expected
    served = log.read_text()
    assert "to write its phrase pool before it is killed" in served
    # Killed, if at all, after the grace (a loaded machine's teardown may outlast it), not in
    # the millisecond of the SIGTERM as vLLM's shutdown_timeout 0 does.
    waited = _seconds_from_sigterm_to_kill(served)
    assert waited is None or waited >= PROCESS_GRACE_S - 1, \
        [line for line in served.splitlines() if "shutdown" in line]
    assert pool.exists(), "the pool was not written at shutdown"
    assert not list(tmp_path.glob("pool.pt.*")), "a save was cut off: " + str(list(tmp_path.iterdir()))
    from vllm_ouroboros.pool import PhrasePool

    assert (PhrasePool.read_state(str(pool))["page_key"] >= 0).any()
    ours = assert_counts_are_vllms(text)
    assert ours.get("vllm:ouroboros_suffix_accepted_total", 0) > 0, sorted(ours)
    print("tree suffix tokens accepted:", ours.get("vllm:ouroboros_tree_suffix_accepted_total"))
    # The tree was sent, not the chain: available at load and never fallen back from.
    assert "tree verification unavailable" not in served
    assert ours["vllm:ouroboros_chain_fallback_steps_total"] == 0, ours
