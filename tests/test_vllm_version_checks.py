"""The patches refuse a vLLM whose internals they read differently, at engine start and naming
the supported versions, rather than failing mid-serving or, worse, sampling without a setting
they do not know (tree_verify samples the tree itself)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm", reason="checks the installed vLLM's classes; vLLM is not installed here")

from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402

from vllm_ouroboros.patches import model_runner  # noqa: E402


def test_the_installed_vllms_sampling_metadata_is_the_known_one():
    model_runner._check_sampling_metadata()
    assert set(SamplingMetadata.__dataclass_fields__) == model_runner.SAMPLING_FIELDS


def test_a_new_sampling_field_is_refused(monkeypatch):
    """A field the walk does not know (a new per-request sampling setting) would be dropped."""
    fields = dict(SamplingMetadata.__dataclass_fields__)
    fields["typical_p"] = dataclasses.field(default=None)
    monkeypatch.setattr(SamplingMetadata, "__dataclass_fields__", fields)
    with pytest.raises(RuntimeError, match=r"SamplingMetadata.typical_p .*would not apply.*Supported vLLM versions"):
        model_runner._check_sampling_metadata()


def test_a_missing_sampling_field_is_refused(monkeypatch):
    fields = {k: v for k, v in SamplingMetadata.__dataclass_fields__.items() if k != "no_penalties"}
    monkeypatch.setattr(SamplingMetadata, "__dataclass_fields__", fields)
    monkeypatch.delattr(SamplingMetadata, "no_penalties", raising=False)
    with pytest.raises(RuntimeError, match=r"cannot hook .*no_penalties.*Supported vLLM versions"):
        model_runner._check_sampling_metadata()


def test_a_processor_without_the_state_read_is_refused():
    """The built-in processors' per-request state is read by name each step: a renamed one is
    refused naming the versions (an AttributeError mid-step before)."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    from vllm_ouroboros.patches.tree_verify import unsupported_sampling

    proc = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)  # no min_toks set
    sm = SimpleNamespace(logprob_token_ids=None, max_num_logprobs=None, no_penalties=True,
                         bad_words_token_ids={}, allowed_token_ids_mask=None,
                         thinking_budget_state_holder=None, logitsprocs=SimpleNamespace(all=[proc]))
    with pytest.raises(RuntimeError, match=r"min_toks.*Supported vLLM versions"):
        unsupported_sampling(sm)
    proc.min_toks = {}
    assert unsupported_sampling(sm) is None
    proc.min_toks = {0: (3, [], set(), False)}
    assert unsupported_sampling(sm) == "min_tokens"



@pytest.mark.parametrize("version, ok", [("0.32.0+cpu", True), ("0.32.1.dev3+g1234abc", True),
                                         ("0.33.0rc1", True), ("0.31.9", False), ("0.34.0", False),
                                         ("dev", False)])
def test_version_check_takes_nightlies_in_the_range(version, ok):
    """A nightly or release candidate within the supported range passes whatever packaging's
    default on pre-releases; a version that does not parse gets the supported-range message."""
    from vllm_ouroboros.plugin import check_vllm_version

    if ok:
        assert check_vllm_version(version) == version
    else:
        with pytest.raises(RuntimeError, match="vllm-ouroboros supports vLLM"):
            check_vllm_version(version)


def test_patching_a_staticmethod_twice_wraps_it_once():
    from vllm_ouroboros.patches._util import patch_method

    calls = []

    class C:
        @staticmethod
        def f(x):
            return x

    def make(original):
        def override(x):
            calls.append(x)
            return original(x)
        return override

    patch_method(C, "f", make)
    patch_method(C, "f", make)
    assert C.f(3) == 3 and calls == [3]


def test_patching_a_classmethod_twice_wraps_it_once_and_binds_the_caller():
    """A class's own classmethod (a descriptor, not callable) is patched as one: the override
    gets the class it is called through (a subclass too) and is installed once."""
    from vllm_ouroboros.patches._util import patch_method

    calls = []

    class C:
        @classmethod
        def make(cls, x):
            return cls, x

    class D(C):
        pass

    def wrap(original):
        def override(cls, x):
            calls.append(cls)
            return original(cls, x)
        return override

    patch_method(C, "make", wrap)
    patch_method(C, "make", wrap)
    assert C.make(1) == (C, 1) and D.make(2) == (D, 2) and D().make(3) == (D, 3)
    assert calls == [C, D, D]


def test_the_source_tree_fallback_range_is_setups():
    """plugin._FALLBACK_RANGE (a source tree without installed metadata) repeats setup.py's
    VLLM_RANGE, the one place the range is declared; the installed metadata carries it too."""
    import re
    from pathlib import Path

    from packaging.specifiers import SpecifierSet

    from vllm_ouroboros import plugin

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    declared = re.search(r'^VLLM_RANGE = "([^"]+)"', setup, re.M).group(1)
    assert plugin._FALLBACK_RANGE == declared
    assert plugin.supported_vllm_range() == str(SpecifierSet(declared))


@pytest.mark.parametrize("name", ["OUROBOROS_DISABLE", "VLLM_OUROBOROS_DISABLE"])
def test_the_plugin_can_be_turned_off(name):
    """OUROBOROS_DISABLE=1 (and the old VLLM_OUROBOROS_DISABLE) leave vLLM unpatched: checked
    in a fresh process, where the registration has not run yet."""
    import os
    import subprocess
    import sys

    code = ("from vllm_ouroboros import plugin; plugin.register()\n"
            "from vllm.sampling_params import SamplingParams\n"
            "print(hasattr(SamplingParams._validate_spec_decode, '__ouroboros_original__'))\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith("OUROBOROS_DISABLE")}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    off = subprocess.run([sys.executable, "-c", code], env={**env, name: "1"}, capture_output=True, text=True,
                         timeout=300)
    assert on.stdout.split()[-1:] == ["True"], on.stderr[-2000:]
    assert off.stdout.split()[-1:] == ["False"], off.stderr[-2000:]


def test_batches_vllms_rejection_sampler_gets_wrong_are_named():
    """Chosen token ids go through the walk; beside a feature that leaves the batch to vLLM's
    rejection sampler (which drops them) they are named, so that the step samples its roots as
    without speculation (tree_verify.root_sample) and drafting pauses; so is a max_num_logprobs
    of -1 (vLLM 0.32's input batch asks for the vocabulary's size instead: tested end to end)."""
    from types import SimpleNamespace

    from vllm_ouroboros.patches.tree_verify import rejection_sampler_fails, unsupported_sampling

    def batch(**kw):
        fields = dict(logprob_token_ids=None, max_num_logprobs=None, no_penalties=True, bad_words_token_ids={},
                      allowed_token_ids_mask=None, thinking_budget_state_holder=None,
                      logitsprocs=SimpleNamespace(all=[]))
        return SimpleNamespace(**{**fields, **kw})

    ids = batch(logprob_token_ids={0: [5, 6]})
    assert unsupported_sampling(ids) is None and rejection_sampler_fails(ids) == "logprobs of chosen token ids"
    both = batch(logprob_token_ids={0: [5, 6]}, bad_words_token_ids={1: [[7]]})
    assert unsupported_sampling(both) == "bad_words" and rejection_sampler_fails(both)
    whole = batch(max_num_logprobs=-1)
    assert unsupported_sampling(whole) == rejection_sampler_fails(whole) == "logprobs of the whole vocabulary"
    top = batch(max_num_logprobs=3, bad_words_token_ids={1: [[7]]})
    assert unsupported_sampling(top) == "bad_words" and rejection_sampler_fails(top) is None
    # Penalties go through the walk (tree_penalties.py), chosen token ids beside them too.
    assert unsupported_sampling(batch(logprob_token_ids={0: [5, 6]}, no_penalties=False)) is None
