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
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import serve_process
from generate import humaneval_prompts, models_dir
from serve_process import Server, ServerFailed, stop_on_sigterm


def start_server(target: Path, extra: list[str], log_path: Path, max_num_seqs: int,
                 timeout: float = 600.0) -> Server:
    """The benchmarks' `vllm serve TARGET` (float32, eager, seed 0, max_model_len 2048): exits
    the script with the server's log tail where it does not come up."""
    try:
        return serve_process.start(target, ["--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
                                            "--seed", "0", "--max-num-seqs", str(max_num_seqs), *extra],
                                   log_path, timeout)
    except ServerFailed as e:
        sys.exit(str(e))


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
        server = start_server(target, extra, args.out / f"serve-{name}.log", max(args.concurrency, 1))
        try:
            cmd = [*serve_process.vllm_cli(), "bench", "serve", "--backend", "vllm", "--base-url", server.base,
                   "--model", str(target), "--dataset-name", "custom", "--dataset-path", str(dataset),
                   "--skip-chat-template", "--custom-output-len", str(args.max_tokens),
                   "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                   "--temperature", "0", "--ignore-eos", "--save-result",
                   "--result-dir", str(args.out), "--result-filename", f"{name}.json"]
            print("$ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        finally:
            server.stop()
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
