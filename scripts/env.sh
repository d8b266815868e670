# Runtime environment for vLLM on this kind of CPU machine.   Usage: source scripts/env.sh
#
# Activates <repo>/.venv and sets defaults only for variables the user has not set already.
# Sourced, not executed: no `set -e` here, it would leak into the caller's shell.

_ouro_repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
_ouro_venv="$_ouro_repo/.venv"

if [[ ! -f "$_ouro_venv/bin/activate" ]]; then
    echo "env.sh: no venv at $_ouro_venv; run scripts/setup.sh first" >&2
    unset _ouro_repo _ouro_venv
    return 1
fi
if [[ "${VIRTUAL_ENV:-}" != "$_ouro_venv" ]]; then
    # shellcheck disable=SC1091
    source "$_ouro_venv/bin/activate"
fi

# No model hub is reachable: fail fast instead of retrying downloads.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# Otherwise vLLM binds to the first NIC's address.
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
# Intel OpenMP shipped in the venv: about 10x faster CPU kernels than the default libgomp here.
if [[ -z "${LD_PRELOAD:-}" && -f "$_ouro_venv/lib/libiomp5.so" ]]; then
    export LD_PRELOAD="$_ouro_venv/lib/libiomp5.so"
fi
# With Intel OpenMP preloaded, numba's OpenMP layer leaves the model's matmuls on one thread.
export NUMBA_THREADING_LAYER="${NUMBA_THREADING_LAYER:-workqueue}"
# GiB of KV cache the CPU backend reserves.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
# Binding the OpenMP threads to all cores roughly doubles decode speed here.
# The cores this shell may use (a container's cpuset need not start at 0).
_ouro_cpus="$(python3 -c 'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))' 2>/dev/null \
    || echo "0-$(($(nproc) - 1))")"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$_ouro_cpus}"
unset _ouro_cpus
export OUROBOROS_MODELS_DIR="${OUROBOROS_MODELS_DIR:-$_ouro_repo/models}"

unset _ouro_repo _ouro_venv
