"""vLLM's own serving benchmark (`vllm bench serve`) against `vllm serve` with and without
ouroboros, one server after the other, on HumanEval prompts, side by side.

    source scripts/env.sh && python scripts/bench_serve.py --num-prompts 8 --concurrency 1

For each configuration: start `vllm serve TARGET [--speculative-config ...]`, wait for /health, run

    vllm bench serve --backend vllm --base-url http://127.0.0.1:PORT --model TARGET \
        --dataset-name custom --dataset-path humaneval.jsonl --skip-chat-template \
        --custom-output-len 64 --num-prompts N --max-concurrency C --temperature 0 \
        --ignore-eos --save-result --result-dir DIR --result-filename CONFIG.json

then stop the server. Prints vLLM's report for each and a table of output tokens/s, the ratio to
no speculation from this run, and mean time per output token. Needs pandas (vLLM's custom
dataset reader; scripts/setup.sh installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from generate import humaneval_prompts, models_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> list[str]:
    exe = Path(sys.executable).parent / "vllm"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def start_server(target: Path, extra: list[str], log_path: Path, max_num_seqs: int,
                 timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [*vllm_cli(), "serve", str(target), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
           "--max-num-seqs", str(max_num_seqs), *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"vllm serve exited ({proc.returncode}); log: {log_path}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                return proc, base
            except OSError:
                if time.time() > deadline:
                    sys.exit(f"vllm serve not healthy after {timeout:.0f} s; log: {log_path}")
                time.sleep(1)
    except BaseException:  # also SIGTERM (stop_on_sigterm) while it starts: no server left behind
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its own session), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # also what is left of a server whose leader exited
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_on_sigterm() -> None:
    """SIGTERM ends this script through its `finally` blocks, which stop the servers it
    started: they run in sessions of their own, so a signal to this script's process group
    (a test's time-out) never reaches them, and SIGTERM's default action skips the blocks."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec", default="{}", help="extra ouroboros keys as JSON, e.g. '{\"num_suffixes\": 3}'")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "ouroboros-bench-serve")
    args = ap.parse_args()
    stop_on_sigterm()
    target = args.target or models_dir() / "qwen2.5-coder-1.5b-instruct"
    draft = args.draft or models_dir() / "qwen2.5-coder-0.5b-instruct"
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "humaneval.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in humaneval_prompts(args.num_prompts)))
    spec = json.dumps({"method": "ouroboros", "model": str(draft), **json.loads(args.spec)})
    configs = {"no-spec": [], "ouroboros": ["--speculative-config", spec]}
    results = {}
    for name, extra in configs.items():
        print(f"== {name}: vllm serve {target.name} {' '.join(extra)}", flush=True)
        proc, base = start_server(target, extra, args.out / f"serve-{name}.log",
                                  max(args.concurrency, 1))
        try:
            cmd = [*vllm_cli(), "bench", "serve", "--backend", "vllm", "--base-url", base,
                   "--model", str(target), "--dataset-name", "custom", "--dataset-path", str(dataset),
                   "--skip-chat-template", "--custom-output-len", str(args.max_tokens),
                   "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                   "--temperature", "0", "--ignore-eos", "--save-result",
                   "--result-dir", str(args.out), "--result-filename", f"{name}.json"]
            print("$ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        finally:
            stop_server(proc)
        results[name] = json.loads((args.out / f"{name}.json").read_text())
        done, failed = results[name].get("completed"), results[name].get("failed", 0)
        if failed or done != args.num_prompts:
            # The throughput of a run that lost requests is not the config's.
            print(f"bench_serve: {name}: {done} of {args.num_prompts} requests completed, "
                  f"{failed} failed", file=sys.stderr)
            return 1
    base_tps = results["no-spec"]["output_throughput"]
    print(f"\n{args.num_prompts} HumanEval prompts x {args.max_tokens} tokens, concurrency "
          f"{args.concurrency}, greedy, float32 (vllm bench serve):")
    print(f"{'config':<12}{'output tok/s':>14}{'x no-spec':>11}{'mean TPOT ms':>14}")
    for name, r in results.items():
        print(f"{name:<12}{r['output_throughput']:>14.2f}{r['output_throughput'] / base_tps:>11.2f}"
              f"{r['mean_tpot_ms']:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
