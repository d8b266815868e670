"""The pieces of the analysis scripts whose numbers results/README.md reports."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from pool_key_sim import (ContextRankedPool, LruPool, branch_tree, chain_tree, match,  # noqa: E402
                          replay_pool_mode, sent_tokens)


def test_lru_pool_keeps_the_newest_phrases_of_a_key():
    pool = LruPool(2)
    for phrase in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.insert("k", phrase)
    # (1, 2) re-inserted moved to the front, then (5, 6) pushed (3, 4) out
    assert pool.get("k") == [(5, 6), (1, 2)]
    assert pool.get("other") == []


def test_context_ranked_pool_puts_phrases_after_the_same_token_first():
    pool = ContextRankedPool(3)
    for phrase, before in [((1, 2), "a"), ((3, 4), "b"), ((5, 6), "a"), ((1, 2), "b"), ((7, 8), "c")]:
        pool.insert("k", phrase, before)
    # (1, 2) moved to the front with its new context "b"; (3, 4), the oldest, fell out of 3 slots
    assert pool.get("k", "b", 3) == [(1, 2), (7, 8), (5, 6)]
    assert pool.get("k", "a", 2) == [(5, 6), (7, 8)]  # the match, then the newest
    assert pool.get("k", "z", 2) == [(7, 8), (1, 2)]  # no match: newest first
    assert pool.get("other", "a", 2) == []


def test_match_is_the_longest_guessed_prefix():
    assert match([(1, 2, 9), (1, 2, 3)], [1, 2, 3]) == 3
    assert match([(1, 9), (7, 8)], [1, 2, 3]) == 1
    assert match([(4,)], [1, 2]) == 0
    assert match([], [1]) == 0
    assert match([(1, 2, 3, 4)], [1, 2]) == 2  # the text ends before the phrase does


def test_generate_ratios_are_to_the_mean_of_the_no_spec_readings():
    """generate.py over a palindrome of configs: each row's ratio and each config's mean are
    against the mean of every no-spec reading, not the first one; a config whose output
    differed is left out of the means."""
    from generate import compare, repeated_readings

    def row(config, tps, out="same"):
        return {"config": config, "tokens_per_s": tps, "outputs": [out]}

    rows = compare([row("no-spec", 6.0), row("a", 9.0), row("b", 7.0, "other"), row("a", 7.0),
                    row("no-spec", 10.0)])
    assert [r["speedup"] for r in rows] == [0.75, 1.125, 0.875, 0.875, 1.25]
    assert [r["identical"] for r in rows] == [True, True, False, True, True]
    assert repeated_readings(rows) == [("no-spec", [6.0, 10.0], 1.0), ("a", [9.0, 7.0], 1.0)]
    assert repeated_readings(compare([row("no-spec", 5.0), row("a", 6.0)])) == []


def test_pool_mode_trees_chain_and_branches():
    pool = LruPool(3)
    for key, phrase in [(1, (2, 3)), (1, (4, 5)), (5, (6, 7)), (7, (8, 9)), (3, (1, 1))]:
        pool.insert(key, phrase)
    # newest first: key 1 -> (4, 5), then (2, 3); the chain follows 5 -> 7 -> 9, cut at 5 tokens
    assert chain_tree(pool, 1, 5, 1) == [[4, 5, 6, 7, 8]]  # nothing after 8: no suffix
    assert chain_tree(pool, 1, 4, 2) == [[4, 5, 6, 7], [4, 5, 6, 7, 8, 9]]
    assert chain_tree(pool, 9, 4, 2) == []
    assert branch_tree(pool, 1, 2) == [[4, 5], [2, 3]]
    assert branch_tree(pool, 1, 3, chain_first=5) == [[4, 5, 6, 7, 8], [2, 3]]
    assert sent_tokens(chain_tree(pool, 1, 4, 2)) == 6 and sent_tokens(branch_tree(pool, 1, 2)) == 4


def test_pool_mode_replay_counts_steps_and_learns_the_text():
    # After 9 the prompt had "2 3", then "4 5"; the output goes on as after the first 9.
    prompt, out = [7, 9, 2, 3, 7, 9, 4, 5, 7, 9], [2, 3, 6, 6]
    chain = replay_pool_mode([(prompt, out)], 2, 2, lambda p, k: chain_tree(p, k, 2, 1))
    branches = replay_pool_mode([(prompt, out)], 2, 2, lambda p, k: branch_tree(p, k, 2))
    # The chain tries 9's newest phrase (4 5, then 5's 7 9: 4 nodes) and gets the target's token
    # alone; then 2's (3 7): one token and the target's; then nothing for 6: 4 tokens, 3 steps.
    assert chain == (4 / 3, 6 / 3)
    # The branches try both of 9's phrases: 2 3 and the target's 6; nothing for 6: 2 steps.
    assert branches == (2.0, 2.0)


def test_self_lookahead_writes_the_models_own_greedy_text(tiny_models, one_thread):
    """scripts/self_lookahead_sim.py takes every round's draft whole: that is lookahead decoding
    of the model only if the drafts are its greedy text, checked here against Hugging Face."""
    import numpy as np
    import torch
    transformers = pytest.importorskip("transformers")
    from self_lookahead_sim import self_lookahead

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, n).tolist() for n in (5, 12)]
    r = self_lookahead(tiny_models["target"], prompts, max_tokens=20, gamma=6, beta=3, window=2,
                       guesses=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_models["target"], dtype=torch.float32, attn_implementation="eager").eval()
    for prompt, text in zip(prompts, r["texts"]):
        assert len(text) >= 20
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=len(text), do_sample=False,
                               min_new_tokens=len(text))[0, len(prompt):].tolist()
        assert text == want
    assert r["tokens"] == sum(len(t) for t in r["texts"])
    assert r["tokens_per_forward"] == round(r["tokens"] / r["forwards"], 3) >= 1


def test_step_width_cost_times_both_forms(monkeypatch, capsys, one_thread):
    """scripts/step_width_cost.py (results/README.md, "a decode step carries one token per row")
    times the one-column and the padded decode steps side by side, on the same contexts."""
    import step_width_cost

    monkeypatch.setattr(sys, "argv", ["step_width_cost.py", "--tiny", "--rounds", "2", "--batches", "1", "2"])
    assert step_width_cost.main() == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("B=")]
    assert [ln.split(":")[0] for ln in lines] == ["B=1", "B=2"]
    # bench_gpu's tiny drafts: beta 5, so L + 1 = 5 columns padded
    assert all(" 1 column " in ln and " 5 columns " in ln and "ratio" in ln for ln in lines), lines


def test_draft_agreement_fits_a_draft_with_another_vocabulary_size(tiny_models, tmp_path):
    """draft_agreement.py with a draft of fewer rows than the target's ids (Qwen2.5-0.5B for 7B)
    indexed its embedding with the target's ids past its rows (an IndexError); with more rows
    it could rank ids the target has not. Fitted as the engine fits it: clamped ids, the shared
    ids only."""
    import torch
    from transformers import AutoModelForCausalLM

    from draft_agreement import draft_topk
    from tiny_models import padded_vocab_copy

    wide = padded_vocab_copy(tiny_models["draft"], tmp_path / "wide", 640, scale=3.0, seed=5)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    narrow, wide = load(tiny_models["draft"]), load(wide)
    seq = torch.tensor([5, 383, 384, 511, 7, 450, 2])  # a 512-id target's text, past 384 too
    top = draft_topk(narrow, seq, 512)
    assert top.shape == (7, 3) and int(top.max()) < 384
    # Ids past the rows read as the last row: the same top-k as that row's text.
    assert torch.equal(top, draft_topk(narrow, seq.clamp(max=383), 512))
    top = draft_topk(wide, seq, 512)
    assert int(top.max()) < 512
    assert int(wide(seq[None]).logits[0].argmax(-1).max()) >= 512  # unfitted it would choose them


def test_backoff_recovery_replays_the_stuck_prior_and_its_drift(monkeypatch):
    """scripts/backoff_recovery.py, whose numbers README gives: with the drift the pool drafts
    again soon after hard text turns easy; without it (as before) never."""
    import backoff_recovery

    from vllm_ouroboros import backoff_estimates

    hard_then_easy = lambda t: 0.08 if t < 30 else 0.7  # noqa: E731
    first, _ = backoff_recovery.replay(hard_then_easy, 300, 0.9e-3)
    assert first is not None and first - 30 < 30
    monkeypatch.setattr(backoff_estimates, "PRIOR_DRIFT", 0.0)
    assert backoff_recovery.replay(hard_then_easy, 300, 0.9e-3)[0] is None


def test_request_table_cost_times_both_tables(monkeypatch, capsys):
    """scripts/request_table_cost.py (results/README.md, the request table's cost per step):
    a row per batch and case, both tables timed where both exist."""
    import request_table_cost

    monkeypatch.setattr(request_table_cost, "per_call_us", lambda fn, setup=None, min_s=0: (
        setup() if setup else None, fn(), 1.0)[-1])
    monkeypatch.setattr(sys, "argv", ["request_table_cost.py", "--batch", "4"])
    request_table_cost.main()
    rows = [ln.split("|")[1:-1] for ln in capsys.readouterr().out.splitlines()[2:]]
    assert [r[1].strip() for r in rows] == ["steady batch", "one request swapped", "4 arrivals (_start_requests)"]
    assert all(r[0].strip() == "4" and r[2].strip() for r in rows) and rows[0][3].strip() == "1.0"


def test_a_serving_script_stopped_by_sigterm_stops_its_server(tmp_path):
    """bench_serve.py and soak.py start `vllm serve` in a session of its own; SIGTERM to the
    script (tests/test_soak.py's time-out) ended it without its `finally` blocks and left the
    server running. Here a stand-in server that never becomes healthy, the script stopped
    while it waits for /health."""
    import os
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "server.pid"
    stand_in = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'scripts')!r})\n"
        "from pathlib import Path\n"
        "import bench_serve, serve_process\n"
        f"serve_process.vllm_cli = lambda: [sys.executable, '-c', {stand_in!r}]\n"
        "serve_process.stop_on_sigterm()\n"
        f"bench_serve.start_server(Path('target'), [], Path({str(tmp_path / 'serve.log')!r}), 1)\n")
    script = subprocess.Popen([sys.executable, str(driver)])
    server = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert script.poll() is None and time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.05)
        server = int(pid_file.read_text())
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=90) == 128 + signal.SIGTERM
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            server = None
        assert server is None, "the server outlived the script"
    finally:
        script.kill()
        if server is not None:
            os.kill(server, signal.SIGKILL)
