"""The draft's paged KV cache (draft/kv_cache.py): page assignment, release, growth, limits."""

import numpy as np
import pytest
import torch

from vllm_ouroboros.draft.kv_cache import NULL_PAGE, DraftCacheFull, PagedKVCache, pages_for


def make(device, num_seqs=4, max_seq_len=64, num_pages=9, limit=None):
    # 2 layers, 2 kv heads, D 8, pages of 4 tokens: page bytes = 2 * 2 * 4 * 2 * 8 * 4 = 1 KiB
    return PagedKVCache(2, 2, 8, torch.float32, device, num_seqs, max_seq_len, num_pages,
                        page_size=4, limit_bytes=limit)


def rows(kv, seq):
    return kv.table[seq, : kv.held[seq]].tolist()


def assert_device_table(kv):
    assert torch.equal(kv.block_table.cpu(), torch.from_numpy(kv.table))


def test_reserve_gives_the_lowest_free_pages_and_keeps_what_a_sequence_holds(device):
    kv = make(device)
    assert kv.bytes_for(1) == 1024 and kv.bytes == 9 * 1024 and kv.max_seq_len == 64
    kv.reserve([2, 0], [5, 4])  # 2 pages, 1 page
    assert rows(kv, 2) == [1, 2] and rows(kv, 0) == [3]
    kv.reserve([0, 2], [4, 8])  # already held: nothing changes
    assert rows(kv, 2) == [1, 2] and rows(kv, 0) == [3] and kv.free_pages == 5
    kv.reserve([0], [13])  # 3 more, after the one it has
    assert rows(kv, 0) == [3, 4, 5, 6]
    # every other entry is the null page; the device table mirrors the host's
    assert (kv.table[1] == NULL_PAGE).all() and (kv.table[0, 4:] == NULL_PAGE).all()
    assert_device_table(kv)
    assert kv.stats() == {"memory_bytes": 9 * 1024, "pages": 8, "pages_used": 6}
    assert not kv.free[NULL_PAGE]


def test_release_returns_pages_for_the_next_sequence(device):
    kv = make(device)
    kv.reserve([0, 1], [8, 8])
    kv.release([0, 3])  # 3 holds nothing: ignored
    assert kv.held[0] == 0 and (kv.table[0] == NULL_PAGE).all() and kv.free_pages == 6
    kv.reserve([3], [12])  # pages 1, 2 (freed) first, then 5
    assert rows(kv, 3) == [1, 2, 5]
    assert_device_table(kv)


def test_lengths_are_capped_at_the_longest_sequence(device):
    kv = make(device, max_seq_len=8, num_pages=9)
    kv.reserve([1], [1000])
    assert kv.held[1] == 2


def test_fits_takes_the_rows_needing_fewest_pages_first(device):
    kv = make(device, num_pages=6)  # 5 usable pages
    kv.reserve([3], [4])  # 4 left
    # extras 3, 4, 1, 0 (seq 3 holds its page already): 1 + 3 <= 4 fit, 4 more would not
    assert kv.fits([0, 1, 2, 3], [12, 16, 4, 4]).tolist() == [True, False, True, True]
    assert kv.fits([7], [4]).tolist() == [True]  # a sequence past the table holds nothing yet


def test_a_sequence_past_the_table_gets_rows(device):
    kv = make(device, num_seqs=2)
    g = kv.generation
    kv.reserve([5], [4])
    assert kv.num_seqs == 6 and rows(kv, 5) == [1] and kv.generation > g
    assert_device_table(kv)


def test_growing_keeps_every_page_and_doubles_within_the_limit(device):
    kv = make(device, num_pages=3, limit=7 * 1024)
    kv.reserve([0], [8])
    with torch.inference_mode():  # the cache's tensors are inference tensors
        kv.k[:, 1:3] = 1.0
        kv.v[:, 1:3] = 2.0
    g = kv.generation
    kv.reserve([1], [4])  # short by one page: 3 -> 6 pages (doubling fits the limit)
    assert kv.num_pages == 6 and kv.generation > g and rows(kv, 1) == [3]
    assert (kv.k[:, 1:3] == 1).all() and (kv.v[:, 1:3] == 2).all() and (kv.k[:, 3:] == 0).all()
    kv.reserve([1], [4 * 4])  # 3 more: 8 needed, the limit holds 7
    with pytest.raises(DraftCacheFull, match="over draft_cache_max_mb"):
        kv.reserve([2], [4 * 2])


def test_doubling_stops_at_the_limit(device):
    kv = make(device, num_pages=3, limit=5 * 1024)
    kv.reserve([0, 1], [8, 4])  # 3 pages needed, 2 free: 6 would pass the limit, 5 does not
    assert kv.num_pages == 5 and kv.bytes == 5 * 1024


def test_a_failed_growth_changes_nothing(device, monkeypatch):
    kv = make(device, num_pages=3)
    kv.reserve([0], [4])
    before = (kv.table.copy(), kv.held.copy(), kv.free.copy(), kv.k, kv.v, kv.generation,
              kv.block_table.clone())

    def no_memory(num_pages):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kv, "_new_store", no_memory)
    # 3 pages asked, 1 free: a store of 5 (then the doubling, 6) would be needed
    with pytest.raises(DraftCacheFull, match=r"5 pages of 4 tokens \(.* MiB\): CUDA out of memory"):
        kv.reserve([0, 1], [8, 8])
    after = (kv.table, kv.held, kv.free, kv.k, kv.v, kv.generation, kv.block_table)
    for a, b in zip(before[:3], after[:3]):
        assert (a == b).all()
    assert before[3] is after[3] and before[4] is after[4] and before[5] == after[5]
    assert torch.equal(before[6], after[6])


def test_an_out_of_memory_doubling_falls_back_to_what_was_asked(device, monkeypatch):
    kv = make(device, num_pages=8)
    kv.reserve([0], [4 * 7])  # every page held
    real = kv._new_store

    def small_only(num_pages):
        if num_pages > 10:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(num_pages)

    monkeypatch.setattr(kv, "_new_store", small_only)
    kv.reserve([1], [4 * 2])  # 16 fails, 10 (the 8 and the 2 asked) fits
    assert kv.num_pages == 10 and rows(kv, 1) == [8, 9]


def test_the_cpu_allocators_refusal_falls_back_too(device, monkeypatch):
    """The CPU allocator refuses with a RuntimeError, not OutOfMemoryError: the doubling falls
    back to what was asked as on CUDA, and a refusal of both is DraftCacheFull (the rows that
    do not fit decode plainly), not an error that turns drafting off. Other errors pass."""
    kv = make(device, num_pages=8)
    kv.reserve([0], [4 * 7])
    real = kv._new_store

    def small_only(num_pages):
        if num_pages > 10:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2 GB")
        return real(num_pages)

    monkeypatch.setattr(kv, "_new_store", small_only)
    kv.reserve([1], [4 * 2])
    assert kv.num_pages == 10 and rows(kv, 1) == [8, 9]
    with pytest.raises(DraftCacheFull, match="DefaultCPUAllocator: can't allocate memory"):
        kv.reserve([2], [4 * 3])
    monkeypatch.setattr(kv, "_new_store", lambda n: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        kv.reserve([2], [4 * 3])


def test_a_failed_doubling_holds_no_memory_while_the_fallback_is_tried(monkeypatch):
    """The doubled store's keys, allocated before its values failed, are freed before the
    smaller store is tried (neither the store's frame nor the exception's traceback keeps
    them): where the smaller store fits beside the old one but not beside those keys too."""
    import weakref

    kv = make("cpu", num_pages=8)
    kv.reserve([0], [4 * 7])
    live, real_zeros = {}, torch.zeros
    budget = [None]

    def zeros(shape, dtype=None, device=None):
        n = int(np.prod(shape)) * dtype.itemsize
        if budget[0] is not None and sum(live.values()) + n > budget[0]:
            raise torch.OutOfMemoryError(f"budget: {sum(live.values())} used, {n} asked")
        t = real_zeros(shape, dtype=dtype, device=device)
        live[id(t)] = n
        weakref.finalize(t, live.pop, id(t), None)
        return t

    monkeypatch.setattr(torch, "zeros", zeros)
    page = kv.bytes_for(1) // 2  # one page of keys (or of values)
    budget[0] = 2 * 10 * page + page // 2  # a 10-page store (the old one, made before, is not counted)
    kv.reserve([1], [4 * 2])  # the 16-page doubling fails at its values; 10 pages fit
    assert kv.num_pages == 10 and rows(kv, 1) == [8, 9]


def test_resize_keeps_entries(device):
    kv = make(device, num_seqs=2, max_seq_len=8)
    kv.reserve([1], [8])
    kv.resize(3, 20)
    assert kv.table.shape == (3, 5) and rows(kv, 1) == [1, 2] and kv.max_seq_len == 20
    assert_device_table(kv)
    g = kv.generation
    kv.resize(2, 8)  # never shrinks
    assert kv.table.shape == (3, 5) and kv.generation == g


def test_pages_for():
    assert pages_for(0, 16) == 0 and pages_for(1, 16) == 1 and pages_for(16, 16) == 1
    assert pages_for(np.array([0, 17, 32]), 16).tolist() == [0, 2, 2]


def test_too_small_a_store_is_refused(device):
    with pytest.raises(ValueError, match="null page"):
        make(device, num_pages=1)
    with pytest.raises(DraftCacheFull, match="over the limit"):
        make(device, num_pages=4, limit=3 * 1024)
