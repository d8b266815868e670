#!/usr/bin/env bash
# Set everything up (venv, vLLM, this plugin, the real models) and run the main job:
# Ouroboros vs no speculation on the Qwen2.5-Coder 1.5B/0.5B pair over HumanEval prompts.
#   bash scripts/run.sh [generate.py args...]     e.g. --prompts 10 --max-tokens 128
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
# shellcheck disable=SC1091
source "$REPO/scripts/env.sh"
mkdir -p "$REPO/results"
exec python "$REPO/scripts/generate.py" --json "$REPO/results/generate.json" "$@"
