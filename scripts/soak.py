"""Soak test of `vllm serve` with ouroboros: the same seeded request mix against a server without
speculation and one with ouroboros (K = 3 token tree, phrase drafting and speculation pinned on),
one after the other on loopback, compared request by request.

    source scripts/env.sh && python scripts/soak.py --tiny --requests 1000 --concurrency 32
    source scripts/env.sh && python scripts/soak.py --requests 120 --concurrency 8 --max-tokens 64

The mix (seeded, bounded in count and time): prompts from 1 token to near max_model_len, as text
and as token ids; max_tokens 1..--max-tokens; temperature 0 and 0.7 with top_p / top_k; a
frequency, presence or repetition penalty on a tenth; stop strings and stop token ids; n = 2; logprobs; completions and chat, streaming and not; a share of
streams disconnected by the client after a few chunks (and a few non-streaming requests
cancelled); bad input mixed in (empty prompt, prompt over max_model_len, token ids outside the
vocabulary, max_tokens 0 and huge, malformed JSON, a speculative config in the request body, a
negative temperature, an unknown model, no chat messages). The KV cache is made small
(--kv-blocks) so that vLLM preempts requests.

Prints one table: requests sent, completed, aborted, 4xx by cause, 5xx (must be 0), greedy
outputs identical to the no-speculation server (count, and the first differences), server RSS and
pool bytes at start / middle / end, preemptions and the ouroboros counters; writes JSON with
--json. Exit status 0 only when every check holds: no 5xx, no transport error, every bad input a
4xx on both servers, both servers answering each request alike, every completed greedy request
identical, both still serving at the end, the ouroboros server's RSS and pool bytes growing < 5%
from the middle to the end (--rss-tolerance; the no-speculation server's RSS is printed as the
reference for vLLM's own growth), preemption seen on both (unless --no-preemption-check) and the
pool file the ouroboros server saved loadable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench_serve import start_server
from serve_process import stop_on_sigterm
from generate import humaneval_prompts, models_dir

REPO = Path(__file__).resolve().parents[1]

# The ouroboros server's settings: the token tree (K = 3), phrase drafting on and speculation
# for every request whatever the load, so that the soak exercises the whole speculative path
# (the defaults would back off under load on this CPU and test little of it).
OUROBOROS_SPEC = {"num_suffixes": 3, "use_suffixes": True, "use_lookahead": True,
                  "use_guesses": True}

# A minimal chat template for tokenizers without one (the tiny test models).
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")

BAD_INPUTS = ["empty prompt", "prompt over max_model_len", "token id outside vocabulary",
              "max_tokens 0", "max_tokens huge", "malformed JSON", "speculative config in body",
              "negative temperature", "unknown model", "no chat messages"]
# Bad input the OpenAI server accepts on purpose: vLLM ignores unknown request fields (logged),
# so a per-request speculative config is not applied and the request is served (200).
ACCEPTED_BAD = {"speculative config in body"}


@dataclass
class Req:
    """One request of the mix. body is a dict, or raw bytes for malformed JSON."""

    idx: int
    endpoint: str  # "completions" | "chat"
    body: dict | bytes
    stream: bool = False
    disconnect_after: int | None = None  # streams: chunks read before the client hangs up
    cancel_after: float | None = None  # non-streams: seconds before the client hangs up
    bad: str | None = None  # cause, for bad input

    @property
    def greedy(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("temperature", 1.0) == 0.0


@dataclass
class Result:
    status: int  # HTTP status; 0 for a transport error
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    tokens: int | None = None  # usage.completion_tokens (non-streaming)
    aborted: bool = False
    error: str = ""


# ---- the mix ---------------------------------------------------------------------------------

def corpus_ids(tokenizer, min_tokens: int) -> list[int]:
    """Token ids of real text to cut prompts from: HumanEval prompts where installed, else the
    tokenizer's own vocabulary spelled out (at least min_tokens ids)."""
    try:
        text = "\n".join(humaneval_prompts(164))
    except SystemExit:
        text = " ".join(tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size))))
    ids = tokenizer(text).input_ids
    while len(ids) < min_tokens:
        ids = ids + ids
    return ids


def make_mix(n: int, seed: int, tokenizer, model: str, max_model_len: int, max_tokens: int,
             vocab_size: int, abort_share: float, bad_share: float) -> list[Req]:
    """n seeded requests (see the module docstring)."""
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer, 4 * max_model_len)
    eos = tokenizer.eos_token_id
    common = [t for t, _ in Counter(ids).most_common(40) if t != eos]
    bad_at = set(rng.sample(range(n), round(bad_share * n)))
    abort_at = set(rng.sample(sorted(set(range(n)) - bad_at), round(abort_share * n)))
    out = []
    for i in range(n):
        if i in bad_at:
            out.append(bad_request(i, rng.choice(BAD_INPUTS), model, max_model_len, vocab_size,
                                   ids))
            continue
        budget = rng.choice([rng.randint(1, 8), rng.randint(1, max_tokens), rng.randint(1, max_tokens)])
        if i in abort_at:  # long enough to hang up in the middle
            budget = rng.randint(min(16, max_tokens), max_tokens)
        # Prompt lengths log-uniform from 1 token to what leaves room for max_tokens.
        longest = max(max_model_len - budget - 1, 1)
        plen = min(int(round(2 ** rng.uniform(0, (longest).bit_length()))), longest)
        start = rng.randrange(0, len(ids) - plen)
        prompt_ids = ids[start:start + plen]
        body: dict = {"model": model, "max_tokens": budget}
        if rng.random() < 0.55:
            body["temperature"] = 0.0
        else:
            body["temperature"] = 0.7
            if rng.random() < 0.5:
                body["top_p"] = round(rng.uniform(0.6, 0.95), 2)
            if rng.random() < 0.5:
                body["top_k"] = rng.randint(2, 40)
            body["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.15:
            body["stop"] = [tokenizer.decode(ids[j:j + 1]) for j in rng.sample(range(len(ids)), 2)]
        if rng.random() < 0.1:
            body["stop_token_ids"] = rng.sample(common, 2)
        if body["temperature"] > 0 and rng.random() < 0.2:
            body["n"] = 2  # vLLM refuses n > 1 for greedy requests (400)
        if rng.random() < 0.1:  # vLLM's sampler verifies such batches (patches/cpu_sampler.py)
            key = rng.choice(["frequency_penalty", "presence_penalty", "repetition_penalty"])
            body[key] = 1.2 if key == "repetition_penalty" else 0.5
        chat = rng.random() < 0.3
        text = tokenizer.decode(prompt_ids)
        # Text is tokenized again by the server, and the chat template adds tokens: only where
        # the result still leaves room for max_tokens is it valid input.
        fits = len(tokenizer(text).input_ids) + (48 if chat else 0) <= longest
        if chat and fits:
            body["messages"] = [{"role": "user", "content": text}]
            if rng.random() < 0.2:
                body["logprobs"], body["top_logprobs"] = True, rng.randint(1, 3)
        else:
            chat = False
            body["prompt"] = text if fits and rng.random() < 0.5 else prompt_ids
            if rng.random() < 0.2:
                body["logprobs"] = rng.randint(1, 3)
        req = Req(i, "chat" if chat else "completions", body, stream=rng.random() < 0.5)
        if i in abort_at:
            req.stream, req.disconnect_after = True, rng.randint(1, 6)
        elif not req.stream and body["max_tokens"] >= 16 and rng.random() < 0.03:
            req.cancel_after = rng.uniform(0.05, 1.0)
        out.append(req)
    return out


def bad_request(i: int, cause: str, model: str, max_model_len: int, vocab_size: int,
                ids: list[int]) -> Req:
    body: dict = {"model": model, "max_tokens": 8, "temperature": 0.0, "prompt": ids[:5]}
    endpoint = "completions"
    if cause == "empty prompt":
        body["prompt"] = ""
    elif cause == "prompt over max_model_len":
        body["prompt"] = ids[: max_model_len + 8]
    elif cause == "token id outside vocabulary":
        body["prompt"] = [3, vocab_size + 7, 5]
    elif cause == "max_tokens 0":
        body["max_tokens"] = 0
    elif cause == "max_tokens huge":
        body["max_tokens"] = 10**9
    elif cause == "malformed JSON":
        return Req(i, endpoint, b'{"model": "' + model.encode() + b'", "prompt": [1, 2', bad=cause)
    elif cause == "speculative config in body":
        body["speculative_config"] = {"method": "ouroboros", "num_suffixes": 99, "bogus": 1}
    elif cause == "negative temperature":
        body["temperature"] = -1.0
    elif cause == "unknown model":
        body["model"] = "no-such-model"
    elif cause == "no chat messages":
        endpoint = "chat"
        body.pop("prompt")
        body["messages"] = []
    return Req(i, endpoint, body, bad=cause)


# ---- the client ------------------------------------------------------------------------------

async def send(session, base: str, req: Req, timeout: float) -> Result:
    import aiohttp

    url = f"{base}/v1/{'chat/completions' if req.endpoint == 'chat' else 'completions'}"
    body = req.body
    if isinstance(body, dict):
        body = dict(body, stream=req.stream)
        data = json.dumps(body).encode()
    else:
        data = body
    n = body.get("n", 1) if isinstance(body, dict) else 1
    res = Result(0, [""] * n, [None] * n)
    try:
        async def go():
            async with session.post(url, data=data, headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                res.status = r.status
                if r.status != 200:
                    res.error = (await r.text())[:300]
                    return
                if not req.stream:
                    js = await r.json()
                    for c in js["choices"]:
                        res.texts[c["index"]] = (c["message"]["content"] or "") if req.endpoint == "chat" else c["text"]
                        res.finish[c["index"]] = c["finish_reason"]
                    res.tokens = js.get("usage", {}).get("completion_tokens")
                    return
                chunks = 0
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    js = json.loads(payload)
                    if "error" in js:  # an error after the stream started
                        res.status, res.error = js["error"].get("code", 500) or 500, str(js["error"])[:300]
                        return
                    for c in js.get("choices", []):
                        piece = (c.get("delta", {}).get("content") or "") if req.endpoint == "chat" else c.get("text", "")
                        res.texts[c["index"]] += piece
                        if c.get("finish_reason"):
                            res.finish[c["index"]] = c["finish_reason"]
                    chunks += 1
                    if req.disconnect_after is not None and chunks >= req.disconnect_after \
                            and not all(res.finish):
                        res.aborted = True
                        r.close()  # hang up mid-stream: the server must abort the request
                        return

        if req.cancel_after is not None:
            try:
                await asyncio.wait_for(go(), req.cancel_after)
            except asyncio.TimeoutError:
                res.aborted = True
        else:
            await go()
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.status, res.error = 0, f"{type(e).__name__}: {e}"[:300]
    return res


def read_metrics(base: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over label sets}."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def group_rss(pgid: int) -> int:
    """Resident bytes of every process in the server's process group (API server, engine)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if int(stat.rpartition(")")[2].split()[2]) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def probe(base: str, pgid: int) -> dict:
    m = read_metrics(base)
    return {"rss_bytes": group_rss(pgid), "pool_bytes": m.get("vllm:ouroboros_pool_memory_bytes"),
            "draft_cache_bytes": m.get("vllm:ouroboros_draft_cache_memory_bytes"),
            "pool_phrases": m.get("vllm:ouroboros_pool_phrases"),
            "preemptions": m.get("vllm:num_preemptions_total", 0.0), "metrics": m}


async def run_mix(base: str, pgid: int, reqs: list[Req], concurrency: int, deadline: float,
                  timeout: float) -> tuple[list[Result | None], dict]:
    """Send reqs with at most `concurrency` in flight; probe the server at the middle."""
    import aiohttp

    results: list[Result | None] = [None] * len(reqs)
    probes = {}
    sem = asyncio.Semaphore(concurrency)
    done = 0
    half = asyncio.Event()

    async def one(session, req):
        nonlocal done
        async with sem:
            if time.monotonic() > deadline:
                return
            results[req.idx] = await send(session, base, req, timeout)
        done += 1
        if done == len(reqs) // 2:
            half.set()

    async def middle():
        await half.wait()
        probes["middle"] = await asyncio.to_thread(probe, base, pgid)

    # One connection per request: reusing kept-alive connections races the server closing
    # idle ones ("Server disconnected"), a client artefact that would read as a server fault.
    conn = aiohttp.TCPConnector(limit=concurrency + 4, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        mid = asyncio.create_task(middle())
        await asyncio.gather(*(one(session, r) for r in reqs))
        if not mid.done():
            mid.cancel()
    return results, probes


# ---- one server ------------------------------------------------------------------------------

def run_server(name: str, target: Path, extra: list[str], reqs: list[Req], args,
               log_dir: Path) -> dict:
    server = start_server(target, extra, log_dir / f"serve-{name}.log", args.concurrency)
    base, proc = server.base, server.proc
    try:
        # Warm-up (also brings the pool past its first pages), then the start probe.
        warm = [Req(-1, "completions", {"model": str(target), "prompt": "def f(x):",
                                       "max_tokens": 16, "temperature": 0.0})] * 8
        asyncio.run(run_mix(base, proc.pid, [Req(i, w.endpoint, w.body) for i, w in enumerate(warm)],
                            8, time.monotonic() + 300, 300))
        start = probe(base, proc.pid)
        t0 = time.monotonic()
        results, probes = asyncio.run(run_mix(base, proc.pid, reqs, args.concurrency,
                                              t0 + args.time_limit, args.request_timeout))
        elapsed = time.monotonic() - t0
        end = probe(base, proc.pid)
        # Still serving after everything: one more greedy request.
        final, _ = asyncio.run(run_mix(base, proc.pid, [Req(0, "completions", {
            "model": str(target), "prompt": "def g(y):", "max_tokens": 8, "temperature": 0.0})],
            1, time.monotonic() + 120, 120))
    finally:
        server.stop()
    # Tracebacks while serving; stopping the server logs the engine's death on purpose.
    log = (log_dir / f"serve-{name}.log").read_text(errors="replace").split("[shutdown]")[0]
    return {"results": results, "start": start, "middle": probes.get("middle", end), "end": end,
            "seconds": elapsed, "serving_after": final[0] is not None and final[0].status == 200,
            "log_tracebacks": log.count("Traceback (most recent call last)")}


# ---- report ----------------------------------------------------------------------------------

def summarize(reqs: list[Req], runs: dict[str, dict]) -> dict:
    base, spec = runs["no-spec"], runs["ouroboros"]
    rows = {}
    for name, run in runs.items():
        res = run["results"]
        sent = [r for r in res if r is not None]
        by_cause = Counter()
        for q, r in zip(reqs, res):
            if r is not None and 400 <= r.status < 500:
                by_cause[q.bad or f"valid request ({r.error[:60]})"] += 1
        rows[name] = {
            "sent": len(sent), "not_sent": len(res) - len(sent),
            "completed": sum(r.status == 200 and not r.aborted for r in sent),
            "aborted": sum(r.aborted for r in sent),
            "4xx": sum(400 <= r.status < 500 for r in sent), "4xx_by_cause": dict(by_cause),
            "5xx": sum(r.status >= 500 for r in sent),
            # A non-streaming request the client cancelled has no status: it is aborted.
            "transport_errors": sum(r.status == 0 and not r.aborted for r in sent),
            "errors": [f"#{q.idx} {r.status} {r.error}" for q, r in zip(reqs, res) if r is not None
                       and (r.status >= 500 or (r.status == 0 and not r.aborted))][:5],
            "valid_4xx": [f"#{q.idx} {r.status} {r.error}" for q, r in zip(reqs, res) if r is not None
                          and q.bad is None and 400 <= r.status < 500][:10],
            "seconds": run["seconds"], "serving_after": run["serving_after"],
            "log_tracebacks": run["log_tracebacks"],
            "rss_mb": [run[p]["rss_bytes"] / 2**20 for p in ("start", "middle", "end")],
            "pool_bytes": [run[p]["pool_bytes"] for p in ("start", "middle", "end")],
            "draft_cache_mb": [None if run[p]["draft_cache_bytes"] is None else run[p]["draft_cache_bytes"] / 2**20
                               for p in ("start", "middle", "end")],
            "preemptions": run["end"]["preemptions"],
        }
    # Bad input: a 4xx on both servers (or served, where vLLM ignores the field on purpose).
    bad_wrong = []
    for q in reqs:
        if q.bad is None:
            continue
        for name, run in runs.items():
            r = run["results"][q.idx]
            if r is None:
                continue
            ok = r.status == 200 if q.bad in ACCEPTED_BAD else 400 <= r.status < 500
            if not ok:
                bad_wrong.append(f"#{q.idx} {q.bad}: {name} answered {r.status} {r.error[:80]}")
    # Both servers answer every request alike (status class), whatever its sampling.
    disagree = [f"#{q.idx}: no-spec {base['results'][q.idx].status}, ouroboros "
                f"{spec['results'][q.idx].status} {spec['results'][q.idx].error[:80]}"
                for q in reqs if base["results"][q.idx] is not None
                and spec["results"][q.idx] is not None
                and not (base["results"][q.idx].aborted or spec["results"][q.idx].aborted)
                and base["results"][q.idx].status // 100 != spec["results"][q.idx].status // 100]
    # Greedy identity over requests both servers completed.
    same, diffs = 0, []
    for q in reqs:
        a, b = base["results"][q.idx], spec["results"][q.idx]
        if not q.greedy or q.bad or a is None or b is None or a.aborted or b.aborted \
                or a.status != 200 or b.status != 200:
            continue
        if (a.texts, a.finish, a.tokens) == (b.texts, b.finish, b.tokens):
            same += 1
        else:
            diffs.append({"idx": q.idx, "body": {k: v for k, v in q.body.items()
                                                 if k not in ("prompt", "messages")},
                          "no-spec": [a.texts, a.finish, a.tokens],
                          "ouroboros": [b.texts, b.finish, b.tokens]})
    m0, m1 = spec["start"]["metrics"], spec["end"]["metrics"]
    counters = {k.removeprefix("vllm:ouroboros_"): m1[k] - m0.get(k, 0.0) for k in sorted(m1)
                if k.startswith("vllm:ouroboros_") and k.endswith("_total")}
    spec_decode = {k.removeprefix("vllm:"): m1[k] - m0.get(k, 0.0) for k in sorted(m1)
                   if k.startswith("vllm:spec_decode_num_") and k.endswith("_total")}
    return {"rows": rows, "bad_input_wrong": bad_wrong, "status_disagree": disagree,
            "greedy_identical": same,
            "greedy_diffs": diffs, "ouroboros_counters": counters, "spec_decode": spec_decode}


def growth(values: list) -> float | None:
    mid, end = values[1], values[2]
    if mid is None or end is None or mid == 0:
        return None
    return end / mid - 1


def print_report(s: dict, args) -> list[str]:
    """Print the table; return the failed checks."""
    names = list(s["rows"])
    print(f"\n{'':<34}" + "".join(f"{n:>16}" for n in names))
    keys = ["sent", "not_sent", "completed", "aborted", "4xx", "5xx", "transport_errors",
            "log_tracebacks", "preemptions", "seconds"]
    for k in keys:
        print(f"{k:<34}" + "".join(f"{s['rows'][n][k]:>16.0f}" for n in names))
    for n in names:
        r = s["rows"][n]
        print(f"{n}: RSS MiB start/middle/end " + " / ".join(f"{v:.0f}" for v in r["rss_mb"])
              + ("; pool bytes " + " / ".join("?" if v is None else f"{v:.0f}" for v in r["pool_bytes"])
                 if r["pool_bytes"][2] is not None else "")
              + ("; draft KV pages MiB " + " / ".join(f"{v:.0f}" for v in r["draft_cache_mb"])
                 if r["draft_cache_mb"][2] is not None else ""))
    causes = sorted({c for n in names for c in s["rows"][n]["4xx_by_cause"]})
    if causes:
        print("\n4xx by cause" + " " * 22 + "".join(f"{n:>16}" for n in names))
        for c in causes:
            print(f"  {c[:32]:<32}" + "".join(f"{s['rows'][n]['4xx_by_cause'].get(c, 0):>16}" for n in names))
    for n in names:
        for e in s["rows"][n]["valid_4xx"]:
            print(f"  {n}: valid request answered 4xx: {e[:200]}")
    print(f"\ngreedy requests completed by both: {s['greedy_identical'] + len(s['greedy_diffs'])}, "
          f"identical {s['greedy_identical']}, different {len(s['greedy_diffs'])}")
    for d in s["greedy_diffs"][:3]:
        print("  DIFF", json.dumps(d)[:600])
    print("ouroboros counters over the mix:", json.dumps({k: round(v) for k, v in s["ouroboros_counters"].items()}))
    print("vLLM spec decode counters over the mix:", json.dumps({k: round(v) for k, v in s["spec_decode"].items()}))
    failed = []
    for n in names:
        r = s["rows"][n]
        if r["5xx"]:
            failed.append(f"{n}: {r['5xx']} server errors: {r['errors']}")
        if r["transport_errors"]:
            failed.append(f"{n}: {r['transport_errors']} transport errors: {r['errors']}")
        if r["not_sent"]:
            failed.append(f"{n}: {r['not_sent']} requests not sent within --time-limit")
        if not r["serving_after"]:
            failed.append(f"{n}: not serving after the mix")
        if r["completed"] == 0:
            failed.append(f"{n}: no request completed")
    # A traceback in the ouroboros server's log that the no-speculation one has not (a failed
    # save or metrics write, a drafting step that fell back) fails the run, though the
    # requests were answered.
    extra = s["rows"]["ouroboros"]["log_tracebacks"] - s["rows"]["no-spec"]["log_tracebacks"]
    if extra > 0:
        failed.append(f"ouroboros: {extra} more tracebacks in the server log than without speculation")
    if not s["ouroboros_counters"].get("drafted_tokens_total"):
        failed.append("ouroboros: nothing drafted over the mix (speculation never ran)")
    # Memory: ours must stay flat; the no-speculation server's RSS is printed for reference
    # (vLLM's own growth, which the plugin does not change).
    r = s["rows"]["ouroboros"]
    for what, vals in (("RSS", r["rss_mb"]), ("pool bytes", r["pool_bytes"])):
        g = growth(vals)
        if g is None:  # a metric renamed, a process group not found: the check would pass unseen
            failed.append(f"ouroboros: {what} not measured in the middle and at the end ({vals})")
        elif g > args.rss_tolerance:
            failed.append(f"ouroboros: {what} grew {100 * g:.1f}% from the middle to the end")
    if s["bad_input_wrong"]:
        failed.append(f"bad input not answered with 4xx: {s['bad_input_wrong'][:5]}")
    if s["status_disagree"]:
        failed.append(f"servers answered differently: {s['status_disagree'][:5]}")
    if s["greedy_diffs"]:
        failed.append(f"{len(s['greedy_diffs'])} greedy outputs differ from no speculation")
    if not args.no_preemption_check and not all(s["rows"][n]["preemptions"] > 0 for n in names):
        failed.append("no preemption observed (lower --kv-blocks)")
    return failed


def tiny_pair(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import model_pair

    paths = model_pair(root)
    return paths["target"], paths["draft"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random models built here (as the tests do)")
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="KV cache blocks (vLLM's --num-gpu-blocks-override); default: enough "
                         "for about 1.5 full-length requests, so that vLLM preempts")
    ap.add_argument("--block-size", type=int, default=32, help="CPU attention wants multiples of 32")
    ap.add_argument("--abort-share", type=float, default=0.12,
                    help="share of requests streamed and disconnected after 1-6 chunks")
    ap.add_argument("--bad-share", type=float, default=0.06)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=3600.0, help="seconds per server for the mix")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--no-preemption-check", action="store_true")
    ap.add_argument("--spec", default="{}", help="extra ouroboros keys as JSON")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    stop_on_sigterm()
    t_start = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ouroboros-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        target, draft = tiny_pair(work / "tiny")
    else:
        target = args.target or models_dir() / "qwen2.5-coder-1.5b-instruct"
        draft = args.draft or models_dir() / "qwen2.5-coder-0.5b-instruct"
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    vocab = AutoConfig.from_pretrained(target).vocab_size
    kv_blocks = args.kv_blocks or (3 * args.max_model_len) // (2 * args.block_size)
    common = ["--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
              "--num-gpu-blocks-override", str(kv_blocks)]
    if not getattr(tok, "chat_template", None):
        (work / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        common += ["--chat-template", str(work / "chat_template.jinja")]
    pool_file = work / "pool.pt"
    spec = {"method": "ouroboros", "model": str(draft), **OUROBOROS_SPEC,
            "max_speculative_batch": args.concurrency, "pool_save_path": str(pool_file),
            **json.loads(args.spec)}
    reqs = make_mix(args.requests, args.seed, tok, str(target), args.max_model_len,
                    args.max_tokens, vocab, args.abort_share, args.bad_share)
    print(f"soak: {len(reqs)} requests ({sum(q.bad is not None for q in reqs)} bad input, "
          f"{sum(q.disconnect_after is not None or q.cancel_after is not None for q in reqs)} to "
          f"disconnect), concurrency {args.concurrency}, max_model_len {args.max_model_len}, "
          f"{kv_blocks} KV blocks of {args.block_size}; target {target}, draft {draft}", flush=True)
    runs = {}
    for name, extra in (("no-spec", common),
                        ("ouroboros", common + ["--speculative-config", json.dumps(spec)])):
        print(f"== {name}", flush=True)
        runs[name] = run_server(name, target, extra, reqs, args, work)
        print(f"   {runs[name]['seconds']:.0f} s", flush=True)
    s = summarize(reqs, runs)
    failed = print_report(s, args)
    # The pool the server saved periodically and at exit must load (saves are atomic).
    from vllm_ouroboros.pool import PhrasePool

    try:
        pool = PhrasePool.load(pool_file)
        print(f"saved pool {pool_file}: {pool.num_phrases()} phrases, loads")
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        failed.append(f"saved pool {pool_file} does not load: {e}")
    s["wall_seconds"] = time.monotonic() - t_start
    s["command"] = " ".join(sys.argv)
    s["failed"] = failed
    print(f"\nwall time {s['wall_seconds'] / 60:.1f} min")
    print("ALL CHECKS PASSED" if not failed else "FAILED:\n  " + "\n  ".join(failed))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(s, indent=1, default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
