"""patches/bias_min_p.py against vLLM's own logit_bias and min_p processors (float32, random
shapes): the same rows masked and biased, on every verified row of ragged requests; and the
tree walk's per-row processing (patches/tree_verify.row_processing) against vLLM's sampler pieces.
The engine runs (tree walk and vLLM's rejection sampler, K = 1, 2, 3) are in
tests/test_e2e_tiny.py::test_greedy_requests_beside_a_sampled_one_identical ("bias")."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

# vLLM is imported inside the tests: importing it at collection would import Triton before
# conftest.py sets TRITON_INTERPRET for the kernel tests.


@pytest.fixture
def builtin():
    pytest.importorskip("vllm", reason="the processors compared against are vLLM's")
    from vllm.v1.sample.logits_processor import builtin

    return builtin


@pytest.fixture
def bias_min_p(builtin):
    from vllm_ouroboros.patches import bias_min_p

    return bias_min_p


def vllm_min_p(B: int, values):
    """vLLM's MinPLogitsProcessor holding per-request min_p values, as its update_state leaves it."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    proc = MinPLogitsProcessor(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=B)),
                               torch.device("cpu"), False)
    proc.min_p_cpu[:B] = values
    proc.min_p_count = int(np.count_nonzero(values))
    proc.min_p = proc.min_p_device[:B].unsqueeze(1)
    return proc


def vllm_bias(biases: dict[int, dict[int, float]], removed=(), moved=()):
    """vLLM's LogitBiasLogitsProcessor after its update_state saw these requests added (batch
    index -> logit_bias), then `removed` indices and `moved` (a, b, direction) entries."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    proc = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    added = [(i, SamplingParams(logit_bias=lb), None, []) for i, lb in biases.items()]
    proc.update_state(BatchUpdate(batch_size=max(biases, default=-1) + 1, removed=[], added=added, moved=[]))
    if removed or moved:
        proc.update_state(BatchUpdate(batch_size=len(biases), removed=list(removed), added=[], moved=list(moved)))
    return proc


def biased_reference(logits, proc, row_start, num_rows):
    """Each request's rows, one by one, get its logit_bias (float32 adds)."""
    expect = logits.clone()
    for b, lb in proc.biases.items():
        if b < len(num_rows):
            for t, v in lb.items():
                expect[row_start[b]:row_start[b] + num_rows[b], t] += v
    return expect


@pytest.mark.parametrize("seed", range(4))
def test_min_p_mask_is_vllms(seed, bias_min_p):
    g = torch.Generator().manual_seed(seed)
    B, V = 7, 50 + 37 * seed
    x = torch.randn(B, V, generator=g) * (1 + seed)
    values = np.array([0.0, 0.05, 0.3, 1.0, 0.9, 0.5, 0.01], np.float32)
    expect = vllm_min_p(B, values).apply(x.clone())
    got = x.masked_fill(bias_min_p.min_p_mask(x, torch.from_numpy(values)), float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    assert torch.isinf(got[3]).sum() >= V - 2 and not torch.isinf(got[0]).any()


def test_min_p_in_the_rejection_samplers_constraints(bias_min_p):
    """The wrapper masks each drafted row as vLLM's Sampler would after dividing by the
    request's temperature (greedy rows by 1), then hands over; requests without min_p and
    batches of greedy requests only are left alone."""
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 2, 4]
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    logits = torch.randn(sum(counts), 60, generator=g) * 3
    temperature = torch.tensor([0.7, 1.0, -1.0, 1.5])  # request 2 greedy (vLLM's -1)
    proc = vllm_min_p(4, np.array([0.4, 0.2, 0.5, 0.0], np.float32))
    sm = SimpleNamespace(all_greedy=False, temperature=temperature,
                         logitsprocs=SimpleNamespace(all=[proc]))
    wrapped = bias_min_p._apply_sampling_constraints(lambda x, cu_, sm_: x)
    got = wrapped(logits.clone(), cu, sm)
    req = np.repeat(np.arange(4), counts)
    temp = torch.where(temperature < 1e-5, 1.0, temperature)[req]
    expect = vllm_min_p(len(req), np.array([0.4, 0.2, 0.5, 0.0], np.float32)[req]).apply(
        logits / temp[:, None])
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])  # raw values kept
    assert not torch.isinf(got[req == 3]).any() and torch.isinf(got[req == 0]).any()
    sm.all_greedy = True
    assert torch.equal(wrapped(logits.clone(), cu, sm), logits)


def test_bias_on_every_row_of_its_request(bias_min_p, builtin):
    """Each request's rows (ragged, some with none) get its bias; a request index past the
    batch (vLLM's dict may hold it while the batch shrinks) is ignored."""
    proc = vllm_bias({0: {3: 1.5, 7: -100.0}, 2: {3: 0.25}, 5: {1: 9.0}})
    num_rows = np.array([3, 2, 4, 1])
    row_start = np.cumsum(num_rows) - num_rows
    logits = torch.randn(int(num_rows.sum()), 10, generator=torch.Generator().manual_seed(1))
    got = logits.clone()
    bias_min_p.add_bias(got, proc, row_start, num_rows)
    expect = biased_reference(logits, proc, row_start, num_rows)
    assert torch.equal(got, expect) and not torch.equal(got, logits)
    # Only the drafted rows (bonus rows left to vLLM's Sampler): fewer rows from each start.
    got = logits.clone()
    bias_min_p.add_bias(got, proc, row_start, num_rows - 1)
    assert torch.equal(got[row_start + num_rows - 1], logits[row_start + num_rows - 1])


@pytest.mark.parametrize("seed", range(5))
def test_bias_on_random_ragged_batches(seed, bias_min_p):
    """Random batches: requests with and without a bias, 0 to 6 rows each, a bias table that
    vLLM's update_state has shrunk and moved (indices renumbered as its batch condenses); the
    device scatter equals the row-by-row reference, and with one row per request it is vLLM's
    own apply."""
    rng = np.random.default_rng(seed)
    B, V = int(rng.integers(1, 9)), int(rng.integers(8, 80))
    biases = {int(b): {int(t): float(rng.normal(0, 5)) for t in rng.choice(V, rng.integers(1, 6), replace=False)}
              for b in range(B + 2) if rng.random() < 0.6}
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    gone = [b for b in biases if rng.random() < 0.3]
    keep = [b for b in biases if b not in gone]
    moved = [(keep[0], B + 3, MoveDirectionality.UNIDIRECTIONAL)] if keep and rng.random() < 0.5 else []
    proc = vllm_bias(biases, removed=gone, moved=moved)
    num_rows = rng.integers(0, 7, B)
    row_start = np.cumsum(num_rows) - num_rows
    logits = torch.randn(int(num_rows.sum()), V, generator=torch.Generator().manual_seed(seed))
    got = logits.clone()
    bias_min_p.add_bias(got, proc, row_start, num_rows)
    assert torch.equal(got, biased_reference(logits, proc, row_start, num_rows))
    one = torch.randn(max(proc.biases, default=0) + 1, V, generator=torch.Generator().manual_seed(seed))
    got = one.clone()
    bias_min_p.add_bias(got, proc, np.arange(len(one)), np.ones(len(one), np.int64))
    assert torch.equal(got, proc.apply(one.clone()))


def test_bias_in_the_rejection_samplers_processors(bias_min_p, builtin):
    """The wrapper of vLLM's RejectionSampler.apply_logits_processors biases the drafted tokens'
    rows of each request (grouped by num_draft_tokens), before vLLM's own step runs."""
    proc = vllm_bias({1: {2: 4.0}, 2: {0: -1.5, 5: 0.5}})
    num_draft = [2, 0, 3, 1]
    logits = torch.randn(sum(num_draft), 8, generator=torch.Generator().manual_seed(2))
    seen = []
    wrapped = bias_min_p._apply_logits_processors(lambda self, x, sm, meta: seen.append(x.clone()) or x)
    sm = SimpleNamespace(logitsprocs=SimpleNamespace(all=[proc]))
    got = wrapped(None, logits.clone(), sm, SimpleNamespace(num_draft_tokens=num_draft))
    expect = logits.clone()
    expect[2:5, 0] -= 1.5
    expect[2:5, 5] += 0.5  # request 1 drafted nothing: its bias has no row here
    assert torch.equal(got, expect) and torch.equal(seen[0], expect)


def test_requests_with_bias_or_min_p_admitted_by_ouroboros_engines_only(bias_min_p):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from vllm_ouroboros.patches.engine_args import PROPOSER_PATH

    bias_min_p.apply()
    ours = SimpleNamespace(method="custom_class", model=PROPOSER_PATH)
    for params in (SamplingParams(min_p=0.2), SamplingParams(logit_bias={3: 1.0})):
        params._validate_spec_decode(ours)
        params._validate_spec_decode(None)
        for other in (SimpleNamespace(method="ngram", model=None),
                      SimpleNamespace(method="custom_class", model="some.OtherProposer")):
            with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
                params._validate_spec_decode(other)


@pytest.mark.parametrize("seed", range(3))
def test_tree_walk_processes_rows_as_vllms_sampler(seed, bias_min_p):
    """patches/tree_verify.row_processing on one row per request (what the tree walk asks for
    at each depth step) and on all rows at once (its table form) gives each row what vLLM's
    sampler pieces give the whole step's rows, each request's temperature (greedy ones: 1),
    min_p, top-k and top-p on all of its rows; its scaling alone (what seeded requests hand
    vLLM's top-k / top-p sampler) what they give before top-k / top-p."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from vllm_ouroboros.patches.tree_verify import row_processing

    g = torch.Generator().manual_seed(seed)
    B, V = 5, 300 + 41 * seed
    counts = np.array([3, 1, 4, 2, 5])
    logits = torch.randn(int(counts.sum()), V, generator=g) * (1 + seed)
    temperature = torch.tensor([0.7, -1.0, 1.0, 1.6, 0.4])  # request 1 greedy (vLLM's -1)
    min_p = np.array([0.0, 0.2, 0.05, 0.0, 0.1], np.float32)
    sm = SimpleNamespace(temperature=temperature, top_k=torch.tensor([V, 5, 40, 3, V]),
                         top_p=torch.tensor([0.9, 1.0, 0.5, 1.0, 0.8]))
    req = np.repeat(np.arange(B), counts)
    temp = torch.where(temperature < 1e-5, 1.0, temperature)[req]
    scaled = vllm_min_p(len(req), min_p[req]).apply(logits / temp[:, None])
    want = apply_top_k_top_p(scaled.clone(), sm.top_k[req], sm.top_p[req])

    process, scale = row_processing(sm, B, vllm_min_p(B, min_p))
    start = np.cumsum(counts) - counts
    for j in range(counts.max()):  # depth step j: row j of each request (its last if shorter)
        rows = start + np.minimum(j, counts - 1)
        got = process(logits[rows].clone(), None)
        assert torch.equal(torch.isinf(got), torch.isinf(want[rows]))
        assert torch.equal(got[~torch.isinf(got)], want[rows][~torch.isinf(got)])
    got = process(logits.clone(), torch.from_numpy(req))  # the table form: all rows at once
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(got)])
    got = scale(logits.clone(), torch.from_numpy(req))
    assert torch.equal(torch.isinf(got), torch.isinf(scaled)) and torch.isinf(got).any()
    assert torch.equal(got[~torch.isinf(got)], scaled[~torch.isinf(got)])
    assert not torch.equal(torch.isinf(got), torch.isinf(want))  # top-k / top-p left out
    assert torch.isinf(want).any(dim=1).all()  # every row was cut by something
