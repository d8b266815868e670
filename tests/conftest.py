"""Shared fixtures: tiny random models built once per test session (no model hub here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import model_pair  # noqa: E402

# vLLM on this CPU machine: bind to loopback, never reach a hub, keep the KV cache small.
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{"target", "draft", "llama"}: tiny Qwen2 target, a perturbed-copy draft, a Llama model."""
    root = Path(os.environ.get("OUROBOROS_TINY_MODELS") or tmp_path_factory.mktemp("tiny"))
    return model_pair(root)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-tensor tests: on this busy 2-core machine the
    intra-op pool's wake-ups cost more than the work (up to 10x slower otherwise)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
