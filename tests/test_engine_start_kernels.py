"""The engine-start decisions of patches/tree_verify.prepare about its two step kernels: on a
CUDA runner each serves once its check_kernel passes at the engine's shapes, else the torch path
serves, with the reason logged; off CUDA nothing is checked. The kernels' own checks are stood in
for (their tests are tests/test_sampled_walk_kernel.py and tests/test_kv_move_kernel.py)."""

import logging
from types import SimpleNamespace

import pytest

from conftest import import_kernel_module

from vllm_ouroboros import LOGGER_NAME

# Imported as the kernel tests import them (under the interpreter where there is no GPU): a
# module imported here first otherwise decides for them, and their kernels would not run.
kv_move = import_kernel_module("vllm_ouroboros.kernels.kv_move")
sampled_walk = import_kernel_module("vllm_ouroboros.kernels.sampled_walk")

# (TreeState attribute, the module whose check decides it, what the check is asked, the warning)
KERNELS = {
    "walk": (sampled_walk, ("cuda", 3, 151936), "sampled steps walk their trees in torch"),
    "kv_move": (kv_move, ("cuda",), "a winning suffix's KV is moved in torch"),
}


@pytest.mark.parametrize("attr", list(KERNELS))
def test_engine_start_picks_the_kernel_on_a_gpu(attr, monkeypatch, caplog):
    # Imported here, not at collection: patches import kernels/tree_attention, whose tests need
    # it imported under the interpreter first.
    from vllm_ouroboros.patches import tree_verify

    module, asked_with, warning = KERNELS[attr]
    asked = []

    def check(device, *shape):
        asked.append((device.type, *shape))
        return verdict

    for name, (other, _, _) in KERNELS.items():
        monkeypatch.setattr(other, "check_kernel", check if other is module else (lambda *a: None))
    drafter = SimpleNamespace(cfg=SimpleNamespace(tree_verification=False, num_suffixes=3),
                              set_tree_available=lambda reason: None, all_ranks_ok=bool)

    def start(device):
        runner = SimpleNamespace(device=SimpleNamespace(type=device),
                                 model_config=SimpleNamespace(get_vocab_size=lambda: 151936))
        return getattr(tree_verify.prepare(runner, drafter), attr)

    verdict = None
    assert start("cuda") == "triton" and asked == [asked_with]
    verdict = "the kernel failed its check: boom"
    log = logging.getLogger(LOGGER_NAME)  # vLLM's logging may stop propagation to the root
    log.addHandler(caplog.handler)
    try:
        assert start("cuda") == "torch"
    finally:
        log.removeHandler(caplog.handler)
    assert f"{warning}: the kernel failed its check: boom" in caplog.text
    assert start("cpu") == "torch" and len(asked) == 2


def test_a_rank_that_cannot_run_a_step_kernel_turns_it_off_on_every_rank(monkeypatch):
    """Under tensor parallelism the first rank sends trees to every rank and each walks its
    sampled trees: where another rank's tree kernel or walk kernel failed its check (all_ranks_ok
    False), this rank, whose passed, serves without them too (a tree it could not verify would
    fail its step; a walk of its own could accept other tokens than the first rank's)."""
    from vllm_ouroboros import kv_relocate
    from vllm_ouroboros.patches import tree_attention, tree_verify

    monkeypatch.setattr(tree_attention, "install", lambda runner, max_nodes: None)
    for other, _, _ in KERNELS.values():
        monkeypatch.setattr(other, "check_kernel", lambda *a: None)
    decided = []
    for everywhere in (True, False):
        drafter = SimpleNamespace(cfg=SimpleNamespace(tree_verification=True, tree_suffixes=3, num_suffixes=3),
                                  num_spec_tokens=20, set_tree_available=decided.append,
                                  all_ranks_ok=lambda ok, everywhere=everywhere: ok and everywhere)
        runner = SimpleNamespace(device=SimpleNamespace(type="cuda"),
                                 model_config=SimpleNamespace(get_vocab_size=lambda: 151936))
        monkeypatch.setattr(kv_relocate, "warm_move", lambda caches: None)
        monkeypatch.setattr(tree_verify, "_kv_caches", lambda runner: [])
        st = tree_verify.prepare(runner, drafter)
        assert (st.reason is None, st.walk) == ((True, "triton") if everywhere else (False, "torch"))
    assert decided[0] is None and "another tensor-parallel rank" in decided[1]


def test_a_start_up_check_that_raises_is_a_reason_every_rank_hears(monkeypatch, caplog):
    """A check that raises (the tree's install reading an unexpected cache, a kernel's compile)
    is read as its reason: the rank still reaches the collective that shares the verdicts (it
    raised past it, and the other tensor-parallel ranks waited there), and serves without it."""
    from vllm_ouroboros import kv_relocate
    from vllm_ouroboros.patches import tree_attention, tree_verify

    def boom(*a, **k):
        raise RuntimeError("unexpected cache layout (test)")

    monkeypatch.setattr(tree_attention, "install", boom)
    monkeypatch.setattr(sampled_walk, "check_kernel", boom)
    monkeypatch.setattr(kv_move, "check_kernel", lambda *a: None)
    monkeypatch.setattr(kv_relocate, "warm_move", boom)
    heard, decided = [], []
    drafter = SimpleNamespace(cfg=SimpleNamespace(tree_verification=True, tree_suffixes=3, num_suffixes=3),
                              num_spec_tokens=20, set_tree_available=decided.append,
                              all_ranks_ok=lambda ok: heard.append(ok) or ok)
    runner = SimpleNamespace(device=SimpleNamespace(type="cuda"),
                             model_config=SimpleNamespace(get_vocab_size=lambda: 151936))
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(caplog.handler)
    try:
        st = tree_verify.prepare(runner, drafter)
    finally:
        log.removeHandler(caplog.handler)
    assert heard == [False, False], "a rank skipped the collective"
    assert "raised RuntimeError: unexpected cache layout (test)" in st.reason and decided == [st.reason]
    assert (st.walk, st.kv_move) == ("torch", "triton")  # the move's warm-up runs only with the tree
    assert "sampled steps walk their trees in torch: its check raised RuntimeError" in caplog.text
