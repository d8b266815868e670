"""DraftModel vs Hugging Face transformers (float32, eager attention) on tiny random models.

The DraftModel runs on the test device (conftest.device); the HF reference runs on the host.
Tests build their inputs on the host and drive the model through `_fwd` / `_greedy`.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vllm_ouroboros.draft import DraftModel  # noqa: E402
from vllm_ouroboros.draft.attention import build_attention_metadata  # noqa: E402

ATOL = 1e-4
VOCAB = 300


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF init leaves biases at 0 and norms at 1, which would hide bias / norm bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)


def _make_hf(family: str, tie: bool, rope_parameters=None):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, tie_word_embeddings=tie,
                  max_position_embeddings=256)
    if rope_parameters is not None:
        common["rope_parameters"] = rope_parameters
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
    else:
        cfg = transformers.Qwen2Config(**common)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM)(cfg)
    _randomize(model, seed=1 if family == "llama" else 2)
    return model.float().eval()


# llama: rope_theta 5e5, untied LM head. qwen2: q/k/v biases, tied LM head.
FAMILIES = {
    "llama": dict(tie=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen2": dict(tie=True, rope_parameters=None),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(hf_model, path): a tiny random HF model saved with safetensors."""
    family = request.param
    hf = _make_hf(family, **FAMILIES[family])
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, str(path)


def _load(path, device, num_slots=4, max_len=64) -> DraftModel:
    m = DraftModel.from_pretrained(path, dtype=torch.float32, device=device)
    m.allocate_cache(num_slots, max_len)
    return m


def _fwd(m, *inputs, **kw) -> torch.Tensor:
    """m.forward on host inputs, moved to the model's device; hidden states back on the host."""
    return m(*(x.to(m.device) for x in inputs), **kw).cpu()


def _greedy(m, hidden) -> torch.Tensor:
    return m.greedy_tokens(hidden.to(m.device)).cpu()


@torch.no_grad()
def _hf_hidden(hf, ids) -> torch.Tensor:
    """Final-normed hidden states of a plain causal sequence. Shape: ids [T] -> [T, H]."""
    return hf.model(input_ids=torch.as_tensor(ids)[None]).last_hidden_state[0]


def _causal(B, Q):
    return torch.ones(Q, Q, dtype=torch.bool).tril().expand(B, Q, Q)


def test_config_and_loading(pair, device):
    hf, path = pair
    m = _load(path, device)
    assert (m.vocab_size, m.num_layers, m.num_kv_heads, m.head_dim, m.hidden_size) == (VOCAB, 2, 2, 32, 64)
    # Pages of 16 tokens: 4 slots x 64 tokens = 16 pages, each slot its own 4, plus the null page.
    assert m.k_cache.shape == (2, 17, 16, 2, 32)
    table = m.kv.block_table.cpu()
    assert table.shape == (4, 4) and sorted(table.flatten().tolist()) == list(range(1, 17))
    assert (m.lm_head is None) == hf.config.tie_word_embeddings
    assert all(not p.requires_grad for p in m.parameters())


def test_ragged_prefill_then_decode_matches_hf_greedy(pair, device):
    hf, path = pair
    m = _load(path, device)
    g = torch.Generator().manual_seed(3)
    lens = [5, 9, 3]
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    slots = torch.tensor([2, 0, 3])  # not 0..B-1: slot indexing must follow `slots`
    B, Q = len(lens), max(lens)
    ids = torch.zeros(B, Q, dtype=torch.long)  # padded with token 0 after each prompt
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    positions = torch.arange(Q).expand(B, Q)
    h = _fwd(m, ids, positions, slots, torch.zeros(B, dtype=torch.long), _causal(B, Q))
    for b, p in enumerate(prompts):
        torch.testing.assert_close(h[b, :len(p)], _hf_hidden(hf, p), atol=ATOL, rtol=0)
    lg = m.logits(h.to(device)).cpu()
    assert lg.dtype == torch.float32 and lg.shape == (B, Q, VOCAB)
    with torch.no_grad():
        hf_lg = hf(input_ids=prompts[1][None]).logits[0]
    torch.testing.assert_close(lg[1], hf_lg, atol=ATOL, rtol=0)

    # Incremental decode, committing exactly the real tokens (padding scratch is simply overwritten).
    cache_lens = torch.tensor(lens)
    last = h[torch.arange(B), cache_lens - 1]  # [B, H]
    tok = _greedy(m, last)  # [B]
    generated = [[] for _ in range(B)]
    steps = 6
    for _ in range(steps):
        for b in range(B):
            generated[b].append(int(tok[b]))
        h = _fwd(m, tok[:, None], cache_lens[:, None], slots, cache_lens, _causal(B, 1),
                 max_cache_len=int(cache_lens.max()))
        for b in range(B):
            ref = _hf_hidden(hf, torch.cat([prompts[b], torch.tensor(generated[b])]))[-1]
            torch.testing.assert_close(h[b, 0], ref, atol=ATOL, rtol=0)
        cache_lens = cache_lens + 1
        tok = _greedy(m, h[:, 0])
    for b in range(B):
        generated[b].append(int(tok[b]))
        out = hf.generate(prompts[b][None], max_new_tokens=steps + 1, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        assert out[0, lens[b]:].tolist() == generated[b]


def test_chunked_prefill_mixed_with_decode(pair, device):
    """Ragged Q within one forward: row 0 continues its prompt (3 tokens), row 1 decodes 1 token (padded)."""
    hf, path = pair
    m = _load(path, device)
    g = torch.Generator().manual_seed(4)
    seq0, seq1 = torch.randint(0, VOCAB, (7,), generator=g), torch.randint(0, VOCAB, (5,), generator=g)
    slots = torch.tensor([1, 3])
    # step 1: row 0 prefills 4 tokens, row 1 prefills 4 tokens
    _fwd(m, torch.stack([seq0[:4], seq1[:4]]), torch.arange(4).expand(2, 4), slots,
         torch.zeros(2, dtype=torch.long), _causal(2, 4))
    # step 2: row 0 gets seq0[4:7] at positions 4..6; row 1 gets seq1[4] + 2 pads
    ids = torch.stack([seq0[4:7], torch.tensor([int(seq1[4]), 0, 0])])
    pos = torch.tensor([[4, 5, 6], [4, 5, 6]])
    h = _fwd(m, ids, pos, slots, torch.tensor([4, 4]), _causal(2, 3))
    torch.testing.assert_close(h[0], _hf_hidden(hf, seq0)[4:7], atol=ATOL, rtol=0)
    torch.testing.assert_close(h[1, 0], _hf_hidden(hf, seq1)[4], atol=ATOL, rtol=0)


def _tree_inputs():
    """Two rows with different prefixes and interleaved branches sharing positions.

    Row 0: prefix of 6; branch A = 3 tokens at positions 6,7,8, branch B = 2 tokens at 6,7, laid out
    interleaved [a0, b0, a1, b1, a2]. Row 1: prefix of 4; branch C = 5 tokens at 4..8 (a chain).
    A cache-index RoPE (instead of `positions`) or a causal mask gets both rows wrong.
    """
    g = torch.Generator().manual_seed(5)
    prefix = [torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (4,), generator=g)]
    A, Bb = torch.randint(0, VOCAB, (3,), generator=g), torch.randint(0, VOCAB, (2,), generator=g)
    C = torch.randint(0, VOCAB, (5,), generator=g)
    ids = torch.stack([torch.stack([A[0], Bb[0], A[1], Bb[1], A[2]]), C])
    pos = torch.tensor([[6, 6, 7, 7, 8], [4, 5, 6, 7, 8]])
    branch = torch.tensor([0, 1, 0, 1, 0])
    order = torch.arange(5)
    m0 = (branch[:, None] == branch[None, :]) & (order[None, :] <= order[:, None])
    mask = torch.stack([m0, torch.ones(5, 5, dtype=torch.bool).tril()])
    return prefix, (A, Bb, C), ids, pos, mask


def _prefill_prefixes(m, prefix, slots):
    Q = max(len(p) for p in prefix)
    ids = torch.zeros(len(prefix), Q, dtype=torch.long)
    for b, p in enumerate(prefix):
        ids[b, :len(p)] = p
    _fwd(m, ids, torch.arange(Q).expand(len(prefix), Q), slots,
         torch.zeros(len(prefix), dtype=torch.long), _causal(len(prefix), Q))
    return torch.tensor([len(p) for p in prefix])


def test_tree_mask_matches_hf_branches(pair, device):
    hf, path = pair
    m = _load(path, device)
    prefix, (A, Bb, C), ids, pos, mask = _tree_inputs()
    slots = torch.tensor([3, 1])
    cache_lens = _prefill_prefixes(m, prefix, slots)
    h = _fwd(m, ids, pos, slots, cache_lens, mask)
    ref_a = _hf_hidden(hf, torch.cat([prefix[0], A]))[6:]
    ref_b = _hf_hidden(hf, torch.cat([prefix[0], Bb]))[6:]
    ref_c = _hf_hidden(hf, torch.cat([prefix[1], C]))[4:]
    torch.testing.assert_close(h[0, [0, 2, 4]], ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(h[0, [1, 3]], ref_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(h[1], ref_c, atol=ATOL, rtol=0)
    # greedy over a [B, Q] block equals per-token argmax of the logits
    h = h.to(device)
    assert torch.equal(m.greedy_tokens(h), m.logits(h).argmax(-1))


def test_rollback_and_partial_commit(pair, device):
    """Scratch K/V are invisible until committed by advancing cache_lens; committing a prefix of them works."""
    hf, path = pair
    m = _load(path, device)
    prefix, (A, Bb, C), ids, pos, mask = _tree_inputs()
    slots = torch.tensor([3, 1])
    cache_lens = _prefill_prefixes(m, prefix, slots)
    x = torch.tensor([[7], [11]])
    fresh = _fwd(m, x, cache_lens[:, None], slots, cache_lens, _causal(2, 1))  # before any scratch
    _fwd(m, ids, pos, slots, cache_lens, mask)  # scratch: tree tokens written after each prefix
    again = _fwd(m, x, cache_lens[:, None], slots, cache_lens, _causal(2, 1))  # rolled back: old cache_lens
    torch.testing.assert_close(again, fresh, atol=0, rtol=0)
    torch.testing.assert_close(again[0, 0], _hf_hidden(hf, torch.cat([prefix[0], x[0]]))[-1],
                               atol=ATOL, rtol=0)

    # Commit row 0's a0 (cache index 6) and row 1's C[0:3] (indices 4..6), then continue.
    _fwd(m, ids, pos, slots, cache_lens, mask)
    committed = cache_lens + torch.tensor([1, 3])
    y = torch.tensor([[5], [9]])
    h = _fwd(m, y, committed[:, None], slots, committed, _causal(2, 1))
    torch.testing.assert_close(h[0, 0], _hf_hidden(hf, torch.cat([prefix[0], A[:1], y[0]]))[-1],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(h[1, 0], _hf_hidden(hf, torch.cat([prefix[1], C[:3], y[1]]))[-1],
                               atol=ATOL, rtol=0)


def test_slots_grow_page_by_page(pair, device):
    """Slots that grow take pages as they go (interleaved, not contiguous: each row's reads and
    writes follow its block table), the page store grows by a copy that keeps every page, and
    a new slot starts from the pages the others left free."""
    hf, path = pair
    m = _load(path, device, num_slots=2, max_len=12)  # one page each, none free
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (8,), generator=g), torch.randint(0, VOCAB, (6,), generator=g)]
    slots = torch.tensor([1, 0])
    cache_lens = _prefill_prefixes(m, prompts, slots)
    old_k, old_v = m.k_cache.clone(), m.v_cache.clone()
    ptr = m.k_cache.data_ptr()
    m.kv.reserve([0, 1], [12, 12])  # already held: no-op
    assert m.k_cache.data_ptr() == ptr
    assert m.kv.num_pages == 3
    m.kv.resize(5, 40)
    for extra in (16, 32):  # two steps: the second row's pages come after the first's
        m.kv.reserve([1, 0], [8 + extra, 6 + extra])
    assert m.kv.num_pages > 3 and torch.equal(m.k_cache[:, :3], old_k) and torch.equal(m.v_cache[:, :3], old_v)
    held = m.kv.block_table[:2, :3].cpu()
    assert (held[:, 1:] - held[:, :-1] != 1).any()  # a slot's pages are not one contiguous run
    # continue both rows with 20 tokens each (past the old max_len), plus a new slot 4 from scratch
    ext = torch.randint(0, VOCAB, (2, 20), generator=g)
    h = _fwd(m, ext, cache_lens[:, None] + torch.arange(20), slots, cache_lens, _causal(2, 20))
    for b in range(2):
        torch.testing.assert_close(h[b], _hf_hidden(hf, torch.cat([prompts[b], ext[b]]))[-20:],
                                   atol=ATOL, rtol=0)
    m.kv.reserve([4], [20])
    h4 = _fwd(m, ext[:1], torch.arange(20)[None], torch.tensor([4]), torch.tensor([0]), _causal(1, 20))
    torch.testing.assert_close(h4[0], _hf_hidden(hf, ext[0]), atol=ATOL, rtol=0)


def test_greedy_tokens_chunked(pair, device):
    _, path = pair
    m = _load(path, device)
    hidden = torch.randn(3, 7, m.hidden_size, device=device)
    m.logits_chunk_elems = VOCAB * 4  # 4 rows per chunk: 21 rows -> 6 chunks, last one partial
    assert torch.equal(m.greedy_tokens(hidden), m.logits(hidden).argmax(-1))


def test_fit_vocab_to_a_target_with_more_or_fewer_ids(pair, device):
    """One tokenizer, embeddings padded to other sizes (DraftModel.fit_vocab): for a target
    with fewer ids the head chooses among the target's only (a drafted id past them would fault
    the target's embedding); for one with more, its ids past the draft's rows read as the last
    row (a gather past the table would fault a GPU), everything else unchanged."""
    _, path = pair
    ids = torch.tensor([[5, VOCAB - 1, 9, 2]])
    args = (torch.arange(4)[None], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            _causal(1, 4))
    ref = _load(path, device)
    h_ref = _fwd(ref, ids, *args)
    hidden = torch.randn(3, 5, ref.hidden_size)
    hidden[0, 0] = ref.lm_head_weight[VOCAB - 1].cpu() * 50  # a row whose argmax is the last id
    logits = ref.logits(hidden.to(device)).cpu()
    assert logits[0, 0].argmax() == VOCAB - 1

    fewer = _load(path, device)
    fewer.fit_vocab(VOCAB - 7)
    assert fewer.vocab_size == VOCAB - 7 and fewer.lm_head_weight.shape[0] == VOCAB - 7
    assert torch.equal(_greedy(fewer, hidden), logits[..., :VOCAB - 7].argmax(-1))
    torch.testing.assert_close(_fwd(fewer, ids, *args), h_ref, atol=0, rtol=0)

    more = _load(path, device)
    more.fit_vocab(VOCAB + 100)
    assert more.vocab_size == VOCAB and torch.equal(_greedy(more, hidden), logits.argmax(-1))
    past = torch.tensor([[5, VOCAB + 99, 9, 2]])  # an id the target has, past the draft's rows
    torch.testing.assert_close(_fwd(more, past, *args), h_ref, atol=0, rtol=0)
    with pytest.raises(IndexError):  # unfitted, the same ids read past the embedding
        _fwd(_load(path, "cpu"), past, *args)

    m = _load(path, device)
    m.use_gemm(lambda w: lambda x, b: torch.nn.functional.linear(x, w, b))
    with pytest.raises(RuntimeError, match="after use_gemm"):
        m.fit_vocab(VOCAB - 7)


def test_dense_mask_layout(device):
    """Prefix columns visible, new tokens at cache_lens[b] + j' per new_mask, nothing past them."""
    new_mask = torch.tensor([[[1, 0], [1, 1]], [[1, 0], [0, 1]]], dtype=torch.bool, device=device)
    table = torch.tensor([[1], [2]], dtype=torch.int32, device=device)
    meta = build_attention_metadata(torch.tensor([0, 1], device=device),
                                    torch.tensor([3, 1], device=device), new_mask, table, 16)
    assert meta.kv_len == 5
    expect = torch.tensor([
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],  # row 0: prefix 0..2, new tokens at 3, 4
        [[1, 1, 0, 0, 0], [1, 0, 1, 0, 0]],  # row 1: prefix 0, new tokens at 1, 2 (no causal link)
    ], dtype=torch.bool)
    assert torch.equal(meta.dense_mask[:, 0].cpu(), expect)


def test_llama3_rope_scaling_and_sharded_checkpoint(tmp_path, device):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = _make_hf("llama", tie=True, rope_parameters=rope)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    m = _load(str(tmp_path), device)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(7))
    h = _fwd(m, ids, torch.arange(100, 140)[None], torch.tensor([0]), torch.tensor([0]), _causal(1, 40))
    with torch.no_grad():
        ref = hf.model(input_ids=ids, position_ids=torch.arange(100, 140)[None]).last_hidden_state
    torch.testing.assert_close(h, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("extra", [
    # a model card's scaling added to a config transformers 5 saved: rope_scaling wins
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling={"type": "linear", "factor": 4.0}),
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}, original_max_position_embeddings=1024),
    # original_max_position_embeddings missing: max_position_embeddings stands in
    dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}),
    dict(rope_theta=2e4),
])
def test_rope_settings_read_as_transformers_reads_them(extra):
    """The draft reads RoPE settings with transformers' precedence (the target is read so): the
    inverse frequencies equal those of transformers' own parse of the same config."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from vllm_ouroboros.draft.model import DraftConfig, rope_inv_freq

    raw = dict(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
               num_attention_heads=2, max_position_embeddings=4096, **extra)
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    kind = hf.rope_parameters["rope_type"]
    want = (ROPE_INIT_FUNCTIONS[kind](hf, "cpu")[0] if kind != "default"
            else 1.0 / hf.rope_parameters["rope_theta"] ** (torch.arange(0, 32, 2).float() / 32))
    got = rope_inv_freq(DraftConfig.from_hf(raw))
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_unsupported_configs_raise(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        DraftModel.from_pretrained(str(tmp_path), torch.float32, "cpu")
    cfg = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
               num_attention_heads=1, rope_scaling={"type": "yarn", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="yarn"):
        DraftModel.from_pretrained(str(tmp_path), torch.float32, "cpu")


def _onednn_factory(min_rows):
    pytest.importorskip("vllm", reason="vLLM's oneDNN GEMM needs vLLM installed")
    from vllm_ouroboros.patches.cpu_gemm import onednn_gemm_factory

    factory = onednn_gemm_factory(min_rows=min_rows)
    if factory is None:
        pytest.skip("this vLLM build has no oneDNN GEMM (non-x86 build)")
    return factory


def test_onednn_gemm_takes_another_dtype_through_f_linear():
    """The oneDNN primitive reads its input as the weight's dtype: a float32 input to a
    bfloat16 product gave values off by up to 8e37, no error. Such an input takes F.linear (an
    error there: a dtype mismatch is a caller's bug)."""
    from vllm_ouroboros.patches.cpu_gemm import onednn_gemm_factory

    pytest.importorskip("vllm", reason="vLLM's oneDNN GEMM needs vLLM installed")
    factory = onednn_gemm_factory(dtype=torch.bfloat16, min_rows=1)
    if factory is None:
        pytest.skip("this vLLM build or CPU has no bfloat16 oneDNN GEMM")
    w = torch.randn(32, 64).to(torch.bfloat16)
    gemm = factory(w)
    x = torch.randn(8, 64)
    torch.testing.assert_close(gemm(x.to(torch.bfloat16), None).float(),
                               torch.nn.functional.linear(x.to(torch.bfloat16), w).float(), atol=0.1, rtol=0.02)
    with pytest.raises(RuntimeError, match="dtype"):
        gemm(x, None)


@pytest.mark.parametrize("min_rows", [1, 4])
def test_onednn_gemm_matches_f_linear(pair, min_rows):
    """The draft's products through vLLM's oneDNN GEMM (every size, and from 4 rows on as the
    proposer installs it) give the F.linear forward's hidden states and logits (float32)."""
    _, path = pair
    factory = _onednn_factory(min_rows)
    ref, m = _load(path, "cpu"), _load(path, "cpu")  # vLLM's CPU GEMM: on the host everywhere
    m.use_gemm(factory)
    g = torch.Generator().manual_seed(3)
    for B, Q in ((1, 1), (2, 3), (3, 6)):  # 1, 6 and 18 rows: both sides of min_rows
        ids = torch.randint(0, VOCAB, (B, Q), generator=g)
        pos = torch.arange(Q).expand(B, Q)
        slots, zero = torch.arange(B), torch.zeros(B, dtype=torch.long)
        h_ref = ref.forward(ids, pos, slots, zero, _causal(B, Q))
        h = m.forward(ids, pos, slots, zero, _causal(B, Q))
        torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(m.logits(h), ref.logits(h), atol=ATOL, rtol=0)
        assert torch.equal(m.greedy_tokens(h), ref.greedy_tokens(h))


def test_onednn_factory_for_bfloat16_works_or_declines(pair, caplog):
    """A bfloat16 draft (dtype "auto" under a bfloat16 target) on a CPU whose oneDNN has no
    bfloat16 product (AVX2) must fall back to F.linear with a logged reason, not fail at load;
    where oneDNN has one, its products agree with F.linear to bfloat16 precision."""
    pytest.importorskip("vllm", reason="vLLM's oneDNN GEMM needs vLLM installed")
    import logging

    from vllm_ouroboros import LOGGER_NAME
    from vllm_ouroboros.patches.cpu_gemm import onednn_gemm_factory

    if onednn_gemm_factory() is None:
        pytest.skip("this vLLM build has no oneDNN GEMM (non-x86 build)")
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        factory = onednn_gemm_factory(dtype=torch.bfloat16)
    if factory is None:
        print("oneDNN declined bfloat16 on this CPU:", caplog.text.strip().splitlines()[-1])
        assert "no torch.bfloat16 GEMM" in caplog.text
        return
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(factory(w)(x, None).float(), torch.nn.functional.linear(x, w).float(),
                               atol=0.1, rtol=0.02)


def test_use_gemm_routes_every_product(pair, device):
    """Every projection of every layer and the LM head go through the installed factory's product."""
    _, path = pair
    m = _load(path, device)
    calls = []

    def factory(weight):
        def gemm(x, bias):
            calls.append(tuple(weight.shape))
            return torch.nn.functional.linear(x, weight, bias)
        return gemm

    m.use_gemm(factory)
    ids = torch.tensor([[1, 2, 3]])
    _greedy(m, _fwd(m, ids, torch.arange(3)[None], torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long), _causal(1, 3)))
    assert len(calls) == 4 * m.num_layers + 1
    assert calls[-1] == tuple(m.lm_head_weight.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_are_the_per_forward_formula_bit_for_bit(pair, device, dtype):
    """The table's rows are what computing cos/sin per forward gives (the formula before the
    table), bit for bit in each dtype: elementwise float32 products on the same device."""
    _, path = pair
    m = DraftModel.from_pretrained(path, dtype=dtype, device=device)
    m.allocate_cache(2, 64)
    table = m._rope
    assert table is not None and table.shape == (256, 2, 32)  # max_position_embeddings > 64
    positions = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(3)).to(device)
    cos, sin = m.rope_rows(positions)
    freqs = positions[..., None].float() * m.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    assert cos.shape == sin.shape == (3, 7, 1, 32)
    assert torch.equal(cos, emb.cos().to(dtype)) and torch.equal(sin, emb.sin().to(dtype))
    # Past the table: its last row, not a fault.
    far = m.rope_rows(torch.full((1, 2), 10_000, device=device))
    assert torch.equal(far[0], m.rope_rows(torch.full((1, 2), 255, device=device))[0])


def test_rope_table_grows_with_the_cache(pair, device):
    _, path = pair
    m = DraftModel.from_pretrained(path, dtype=torch.float32, device=device)
    m.allocate_cache(2, 64)
    generation = m.kv.generation
    m.kv.resize(2, 400)
    assert m.kv.generation > generation  # graphs holding the old table are captured again
    cos, _ = m.rope_rows(torch.tensor([[399]], device=device))
    assert m._rope.shape[0] == 400
    freqs = torch.tensor([399.0], device=device) * m.inv_freq
    assert torch.equal(cos[0, 0, 0], torch.cat((freqs, freqs)).cos())
