"""The draft's torch attention path must not assume SDPA returns a contiguous tensor: CUDA's
flash / memory-efficient kernels return [B, H, Q, D] with a token-major layout, and a `view` on
it raised for every draft forward of more than 64 new tokens per row (prompt prefills) on a GPU."""

import torch
import torch.nn.functional as F

from vllm_ouroboros.draft import attention


def test_prefix_attention_accepts_token_major_sdpa_output(monkeypatch, device):
    torch.manual_seed(0)
    B, Hq, Hkv, Q, D, S, P = 2, 4, 2, 5, 32, 3, 7
    q = torch.randn(B, Hq, Q, D, device=device)
    k_cache = torch.randn(3 * S, 4, Hkv, D, device=device)  # pages of 4 tokens
    v_cache = torch.randn(3 * S, 4, Hkv, D, device=device)
    table = torch.randperm(3 * S, device=device).view(S, 3).int()
    meta = attention.build_attention_metadata(
        torch.tensor([2, 0], device=device), torch.tensor([P, 3], device=device),
        torch.ones(B, Q, Q, device=device).tril().bool(), table, 4, backend="torch")
    want = attention.prefix_and_masked_attention(q, k_cache, v_cache, meta, 0.2)
    sdpa = F.scaled_dot_product_attention

    def token_major(*a, **kw):  # same values, the strides CUDA's kernels give
        out = sdpa(*a, **kw)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", token_major)
    got = attention.prefix_and_masked_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_writes_past_the_block_table_go_to_the_null_page(device):
    """A row whose new tokens run past its block table (padding of a fixed-width forward) writes
    them to the null page, not over the row's last page (the clamp's old target)."""
    table = torch.tensor([[5, 6, 7], [1, 2, 3]], dtype=torch.int32, device=device)  # 3 pages of 4
    meta = attention.build_attention_metadata(
        torch.tensor([0, 1], device=device), torch.tensor([9, 0], device=device),
        torch.ones(2, 6, 6, device=device).tril().bool(), table, 4, backend="torch")
    # row 0: positions 9..14; 9, 10, 11 on page 7, 12..14 past the table -> page 0
    assert meta.write_index[0].tolist() == [7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 0, 1, 2]
    assert meta.write_index[1].tolist() == [4, 5, 6, 7, 8, 9]


def test_a_loose_cache_bound_past_the_table_is_correct(device):
    """max_cache_len is any upper bound: one whose columns run past the block table reads no
    more than the table (the torch path's mask was wider than its gathered pages and raised)."""
    torch.manual_seed(1)
    B, Hq, Hkv, Q, D = 1, 4, 2, 4, 8
    table = torch.tensor([[3, 1]], dtype=torch.int32, device=device)  # 2 pages of 4: 8 columns
    k_cache = torch.randn(4, 4, Hkv, D, device=device)
    v_cache = torch.randn(4, 4, Hkv, D, device=device)
    q = torch.randn(B, Hq, Q, D, device=device)
    mask = torch.ones(B, Q, Q, device=device).tril().bool()
    args = (torch.tensor([0], device=device), torch.tensor([3], device=device), mask, table, 4)
    tight = attention.build_attention_metadata(*args, max_cache_len=3, backend="torch")
    want = attention.prefix_and_masked_attention(q, k_cache, v_cache, tight, 0.3)
    for bound in (4, 5, 40):
        loose = attention.build_attention_metadata(*args, max_cache_len=bound, backend="torch")
        got = attention.prefix_and_masked_attention(q, k_cache, v_cache, loose, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rows_in_groups_under_the_mask_budget(monkeypatch, device):
    """A forward whose folded mask would pass MASK_BUDGET elements runs its rows in groups:
    the same output as in one call."""
    torch.manual_seed(2)
    B, Hq, Hkv, Q, D = 5, 6, 2, 3, 8
    k_cache = torch.randn(12, 4, Hkv, D, device=device)
    v_cache = torch.randn(12, 4, Hkv, D, device=device)
    table = torch.randperm(11, device=device)[:10].add(1).view(5, 2).int()
    q = torch.randn(B, Hq, Q, D, device=device)
    meta = attention.build_attention_metadata(
        torch.arange(B, device=device), torch.tensor([1, 4, 0, 5, 2], device=device),
        torch.ones(B, Q, Q, device=device).tril().bool(), table, 4, backend="torch")
    want = attention.prefix_and_masked_attention(q, k_cache, v_cache, meta, 0.3)
    calls = []
    real = attention._folded_attention
    monkeypatch.setattr(attention, "_folded_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    monkeypatch.setattr(attention, "MASK_BUDGET", 2 * 3 * Q * meta.kv_len)  # two rows a group
    got = attention.prefix_and_masked_attention(q, k_cache, v_cache, meta, 0.3)
    assert calls == [2, 2, 1]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # SDPA's own batch-size rounding
