import random
from collections import OrderedDict

import pytest
import torch

from conftest import DEVICE, import_kernel_module

# Triton's interpreter must be on when triton is first imported (no CUDA device): the "triton"
# form below runs the pool's kernels.
pool_insert = import_kernel_module("vllm_ouroboros.kernels.pool_insert")
pool_lookup = import_kernel_module("vllm_ouroboros.kernels.pool_lookup")

from vllm_ouroboros.pool import PhrasePool  # noqa: E402


def T(x):
    return torch.tensor(x, device=DEVICE)

A, B, C, D, E = (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)


# Tiny tensors: thread wake-ups cost more than the work (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# How `make`'s pools insert and look up: set by the autouse `forms` fixture for every test here.
POOL_KERNELS = "torch"


def make(vocab=16, L=2, W=2, pages=None, shared=True):
    pages = vocab if pages is None else pages
    return PhrasePool(vocab, L, W, PhrasePool.budget_for(vocab, L, W, pages), device=DEVICE,
                      shared=shared, kernels=POOL_KERNELS)


def ins(pool, key, phrases, owner=0):
    """Insert rows of one key, in order (later = newer)."""
    n = len(phrases)
    pool.insert(T([key] * n), T(phrases), T([owner] * n))


def get(pool, key, slot=0, n=None):
    """Visible phrases of `key` for request `slot`, best first."""
    phrases, valid = pool.lookup(T([key]), T([slot]), n or pool.W)
    return [tuple(p) for p, v in zip(phrases[0].tolist(), valid[0].tolist()) if v]


def test_lru_within_key():
    pool = make(W=2)
    ins(pool, 7, [A])
    ins(pool, 7, [B])
    ins(pool, 7, [C])
    assert get(pool, 7) == [C, B]
    ins(pool, 7, [B])  # refreshes B to newest: C is now the oldest
    ins(pool, 7, [D])
    # tempting wrong answer: [D, C] -- evicting B because it was first inserted before C
    assert get(pool, 7) == [D, B]


def test_duplicates_in_one_batch_count_once_newest_wins():
    pool = make(W=3)
    pool.insert(T([5, 5, 5, 5]), T([A, B, A, C]), T([0, 1, 2, 3]),
                valid=T([True, True, True, False]))
    # tempting wrong answers: [A, B, A] (stored twice), or A ranked by its first occurrence
    assert get(pool, 5, slot=9) == [A, B]
    assert pool.num_phrases() == 2
    assert get(pool, 5, slot=1) == [B, A]  # B is slot 1's own; the newest A belongs to slot 2
    assert get(pool, 5, slot=2) == [A, B]


def test_more_than_W_new_phrases_in_one_batch_keep_newest_W():
    pool = make(W=2)
    ins(pool, 3, [E])
    ins(pool, 3, [A, B, C, D])
    assert get(pool, 3) == [D, C]  # E and the two oldest incoming phrases are gone
    ins(pool, 3, [A, B, A])        # with duplicates: two distinct phrases, A newest
    assert get(pool, 3) == [A, B]


def test_batched_lookup_with_unseen_key():
    pool = make(vocab=16, L=2, W=3)
    pool.insert(T([1, 2, 1, 4]), T([A, B, C, D]), T([0, 0, 0, 0]))
    phrases, valid = pool.lookup(T([1, 9, 4, 2, -1]), T([0, 0, 0, 0, 0]), 2)
    assert phrases.shape == (5, 2, 2) and valid.shape == (5, 2)
    assert valid.tolist() == [[True, True], [False, False], [True, False], [True, False],
                              [False, False]]
    assert phrases[0].tolist() == [list(C), list(A)]
    assert phrases[2, 0].tolist() == list(D) and phrases[3, 0].tolist() == list(B)
    assert (phrases[~valid] == 0).all()  # padding is 0 tokens
    s = pool.stats()
    assert (s["lookups"], s["hits"], s["phrases_returned"]) == (5, 3, 4)


def test_own_first_ranking_shared_and_invisibility_not_shared():
    for shared in (True, False):
        pool = make(W=4, shared=shared)
        ins(pool, 8, [A], owner=0)
        ins(pool, 8, [B], owner=1)
        ins(pool, 8, [C], owner=0)
        ins(pool, 8, [D], owner=-1)
        if shared:
            # tempting wrong answer: [D, C, B, A] -- pure recency, ignoring ownership
            assert get(pool, 8, slot=0) == [C, A, D, B]
            assert get(pool, 8, slot=1) == [B, D, C, A]
            assert get(pool, 8, slot=2) == [D, C, B, A]
        else:
            assert get(pool, 8, slot=0) == [C, A]
            assert get(pool, 8, slot=1) == [B]
            assert get(pool, 8, slot=2) == []


def test_release_shared_keeps_phrases_for_everyone():
    pool = make(W=4, shared=True)
    ins(pool, 8, [A], owner=0)
    ins(pool, 8, [B], owner=1)
    pool.release(T([0]))
    assert pool.num_phrases() == 2
    assert get(pool, 8, slot=1) == [B, A]
    assert get(pool, 8, slot=0) == [B, A]  # a new request in slot 0 does not own A any more


def test_private_pools_hold_each_owners_copy_apart():
    """Not shared: two requests holding the same phrase each keep their copy. One's insert does
    not take the other's, its release does not delete it, its refinement does not remove it."""
    pool = make(vocab=16, L=2, W=4, shared=False)
    key, phrase = T([5]), T([[1, 2]])
    pool.insert(key, phrase, T([0]))
    pool.insert(key, phrase, T([1]))
    pool.insert(T([5, 5]), T([[3, 4], [3, 4]]), T([0, 1]))  # both in one call
    for slot in (0, 1):
        got, ok = pool.lookup(T([5]), T([slot]), 4)
        assert sorted(tuple(p) for p, v in zip(got[0].tolist(), ok[0].tolist()) if v) == [(1, 2), (3, 4)], slot
    pool.replace(key, phrase, T([[7, 7]]), T([1]))  # request 1 refines its copy
    pool.release(T([1]))
    got, ok = pool.lookup(T([5]), T([0]), 4)
    assert [tuple(p) for p, v in zip(got[0].tolist(), ok[0].tolist()) if v] == [(3, 4), (1, 2)]
    assert pool.num_phrases() == 2


def test_release_not_shared_deletes_and_frees_pages():
    pool = make(W=4, pages=2, shared=False)
    ins(pool, 8, [A], owner=0)
    ins(pool, 8, [B], owner=1)
    ins(pool, 9, [C], owner=0)
    pool.release(T([0, 5]))
    assert get(pool, 8, slot=0) == [] and get(pool, 8, slot=1) == [B]
    assert pool.num_phrases() == 1 and pool.num_keys() == 1
    assert pool.key_to_page[9] == -1  # its page is free again, not waiting for LRU eviction
    ins(pool, 10, [D], owner=2)
    assert pool.key_to_page[8] >= 0 and get(pool, 10, slot=2) == [D]
    assert pool.stats()["page_evictions"] == 0


def test_a_saved_state_holds_no_phrase_the_pool_no_longer_has():
    """A released request's private phrases (and a removed one) leave the slots empty: the
    state a file gets has their tokens zeroed and their owner cleared, the live ones as they
    are (the buffers kept the old tokens, unread, and a saved file held them)."""
    pool = make(W=4, pages=2, shared=False)
    ins(pool, 8, [A], owner=0)
    ins(pool, 8, [B], owner=1)
    ins(pool, 9, [C], owner=1)
    pool.release(T([0]))
    pool.remove(T([9]), T([C]), owners=T([1]))
    sd = pool.state_dict()
    empty = sd["stamp"] == 0
    assert (sd["tokens"][empty] == 0).all() and (sd["owner"][empty] == -1).all()
    assert [tuple(p) for p in sd["tokens"][~empty].tolist()] == [B] and sd["owner"][~empty].tolist() == [1]
    again = make(W=4, pages=2, shared=False)
    again.load_state_dict(sd)
    assert get(again, 8, slot=1) == [B] and get(again, 8, slot=0) == [] and get(again, 9, slot=1) == []


def test_a_clock_near_the_scores_range_moves_back_keeping_the_order(monkeypatch):
    """Eviction scores are recency * pages + page in int64: a pool whose clock ran up to near
    2^63 / pages (long uptime, or a file saved after it) moves the clock, stamps and pages'
    last use back, keeping their order: from there it evicts, ranks and looks
    up exactly as the same pool with a small clock."""
    def build():
        pool = make(vocab=12, W=2, pages=3)
        for k, ph in ((1, A), (2, B), (1, C), (3, D), (2, A)):
            ins(pool, k, [ph])
        get(pool, 2)
        return pool

    small, big = build(), make(vocab=12, W=2, pages=3)
    sd = small.state_dict()
    far = (1 << 63) // small.num_pages + 10  # the scores wrap: recency * pages > 2^63
    sd["clock"] += far
    sd["stamp"] = torch.where(sd["stamp"] > 0, sd["stamp"] + far, 0)
    sd["page_last_used"] = sd["page_last_used"] + far
    big.load_state_dict(sd)  # moved back on load
    assert int(big.clock) <= big.clock_limit() and not big.rebase_clock()
    for pool in (small, big):
        ins(pool, 4, [B])  # evicts the least recently used page (key 3)
        pool.insert(T([5, 1]), T([C, D]), T([0, 0]))
    for k in range(12):
        assert get(small, k) == get(big, k), k
    assert sorted(small.page_key.tolist()) == sorted(big.page_key.tolist())  # the same keys evicted
    # in serving: the proposer checks every CLOCK_CHECK_INTERVAL seconds
    monkeypatch.setattr(PhrasePool, "clock_limit", lambda self: 4)
    assert small.rebase_clock() and int(small.clock) <= small.W * small.num_pages + small.num_pages + 1
    assert (small.stamp[small.stamp > 0] >= 1).all()


def _order(pool):
    """Every pairwise order (and tie) among the stamps, the pages' last use and the clock."""
    v = torch.cat([pool.stamp.view(-1), pool.page_last_used, pool.clock.view(1)])
    return torch.sign(v[:, None] - v[None, :]), v == 0


@pytest.mark.parametrize("out_of_memory", [False, True])
def test_moving_the_clock_back_keeps_every_order_and_tie(monkeypatch, out_of_memory):
    """The clock moves back by ranking stamps, last use and clock together: stamps far older
    than the limit keep their order (one offset made them all 1, and equal stamps may be
    ranked differently by the torch and Triton lookups). Where the ranking's temporary does not
    fit, the offset stands in: the clock still moves back below the limit."""
    def build():
        pool = make(vocab=12, W=3, pages=4)
        for k, ph in ((1, A), (2, B), (1, C), (3, D), (2, A), (4, B), (1, D), (4, C)):
            ins(pool, k, [ph])
            # masked rows advance the clock too (a fixed-shape drafting round): gaps in the stamps
            pool.insert(T([k] * 8), T([ph] * 8), T([0] * 8), valid=torch.zeros(8, dtype=torch.bool))
        get(pool, 2), get(pool, 1)
        return pool

    moved, kept = build(), build()
    before = _order(moved)
    monkeypatch.setattr(PhrasePool, "clock_limit", lambda self: 40)
    if out_of_memory:
        def no_room(*a, **k):
            raise torch.OutOfMemoryError("test")
        monkeypatch.setattr(torch, "unique", no_room)
        assert moved.rebase_clock() and int(moved.clock) == 20
        assert (moved.stamp[moved.stamp > 0] >= 1).all()
        return
    assert int(moved.clock) > 40 and moved.rebase_clock() and int(moved.clock) < 20
    after = _order(moved)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    monkeypatch.undo()
    for pool in (moved, kept):  # from here on both act alike: evictions, ranks, lookups
        ins(pool, 5, [A])
        pool.insert(T([6, 1, 3]), T([C, D, A]), T([0, 0, 0]))
        get(pool, 4)
        ins(pool, 7, [B])
    for k in range(12):
        for slot in range(3):
            assert get(moved, k, slot=slot) == get(kept, k, slot=slot), (k, slot)
    assert torch.equal(moved.page_key, kept.page_key)


def test_page_eviction_lru_and_current_keys_survive():
    pool = make(vocab=10, W=2, pages=3)
    assert pool.num_pages == 3
    for k in (1, 2, 3):
        ins(pool, k, [A])
    get(pool, 1)       # touches key 1's page
    ins(pool, 4, [B])
    mapped = lambda: [k for k in range(10) if pool.key_to_page[k] >= 0]
    # tempting wrong answer: [2, 3, 4] -- evicting key 1 as the first inserted, ignoring the lookup
    assert mapped() == [1, 3, 4]
    # key 3 is now the LRU page, but it is written in this call, so key 1 goes instead
    pool.insert(T([3, 5]), T([B, C]), T([0, 0]))
    assert mapped() == [3, 4, 5]
    assert get(pool, 3) == [B, A] and get(pool, 5) == [C]  # recycled page holds only new phrases
    # more new keys than pages in one call: the newest keys win
    pool.insert(T([6, 7, 8, 9]), T([A, B, C, D]), T([0, 0, 0, 0]))
    assert mapped() == [7, 8, 9]
    assert get(pool, 7) == [B] and get(pool, 9) == [D]
    assert pool.stats()["page_evictions"] == 1 + 1 + 3
    assert pool.memory_bytes() <= pool.budget_bytes


def test_million_phrases_stay_within_budget():
    V, L, W, budget = 151936, 4, 8, 8 << 20
    pool = PhrasePool(V, L, W, budget, device=DEVICE)
    assert pool.memory_bytes() <= budget
    g = torch.Generator().manual_seed(0)
    newest = {}
    batches, rows = 100, 10000
    for b in range(batches):
        keys = torch.randint(0, V, (rows,), generator=g)
        phrases = torch.randint(0, V, (rows, L), generator=g)
        pool.insert(keys, phrases, torch.zeros(rows, dtype=torch.long))
        if b >= batches - 2:  # 20k rows need ~20k pages; the pool has ~35k
            newest.update(zip(keys.tolist(), map(tuple, phrases.tolist())))
    assert pool.memory_bytes() <= budget and pool.num_pages < 40000
    assert pool.stats()["page_evictions"] > 0
    keys = T(list(newest))
    phrases, valid = pool.lookup(keys, torch.zeros_like(keys), 1)
    assert valid.all()
    assert [tuple(p) for p in phrases[:, 0].tolist()] == list(newest.values())


def test_replace_refines():
    pool = make(W=3)
    ins(pool, 2, [A, B])
    pool.replace(T([2]), T([A]), T([C]), T([0]))
    assert get(pool, 2) == [C, B]
    pool = make(W=2)
    ins(pool, 2, [A, B])
    pool.replace(T([2]), T([B]), T([C]), T([0]))
    # tempting wrong answer: [C] -- inserting first evicts A from the full key, then B is removed
    assert get(pool, 2) == [C, A]
    pool.replace(T([2, 2]), T([E, A]), T([D, B]), T([0, 0]), valid=T([True, False]))
    assert get(pool, 2) == [D, C]  # E was absent: D is still inserted; the invalid row is ignored


def test_remove():
    pool = make(W=3)
    ins(pool, 2, [A, B, C])
    pool.remove(T([2, 2, 2, 5]), T([A, A, C, B]), valid=T([True, True, False, True]))
    assert get(pool, 2) == [C, B]


_STATS_COUNTED = ("lookups", "hits", "phrases_returned", "page_evictions", "hit_rate")


def test_save_load_round_trip_and_mismatch(tmp_path):
    pool = make(vocab=32, L=3, W=4, shared=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        pool.insert(torch.randint(0, 32, (20,), generator=g),
                    torch.randint(0, 5, (20, 3), generator=g),
                    torch.randint(-1, 3, (20,), generator=g))
    pool.save(tmp_path / "pool.pt")
    loaded = PhrasePool.load(tmp_path / "pool.pt", device=DEVICE)
    # The saved owners were the saving engine's slots, which another engine's requests reuse:
    # loaded, every phrase belongs to nobody, as if each of those requests had finished, and
    # the counters are the new pool's own.
    assert (loaded.owner == -1).all() and loaded.stats()["lookups"] == 0
    saved = pool.stats()
    pool.release(torch.arange(3))
    keys = torch.arange(32).repeat(4)
    slots = torch.arange(-1, 3).repeat_interleave(32)
    for a, b in zip(pool.lookup(keys, slots, 4), loaded.lookup(keys, slots, 4)):
        assert torch.equal(a, b)
    assert {k: v for k, v in loaded.stats().items() if k not in _STATS_COUNTED} == \
        {k: v for k, v in saved.items() if k not in _STATS_COUNTED}
    for kw, name in ((dict(vocab=33, L=3, W=4), "vocab_size"),
                     (dict(vocab=32, L=2, W=4), "phrase_len")):
        with pytest.raises(ValueError, match=name):
            make(**kw).load_state_dict(pool.state_dict())


@pytest.mark.parametrize("W", [1, 2, 6])
def test_load_into_another_window_size(tmp_path, W):
    """A pool saved with 4 phrases per key loads into W: each key keeps its newest min(W, 4)
    phrases, ranked newest first (loaded, they belong to nobody), and takes new ones as a W-pool
    does."""
    pool = make(vocab=32, L=3, W=4, shared=True)
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        pool.insert(torch.randint(0, 32, (20,), generator=g), torch.randint(0, 5, (20, 3), generator=g),
                    torch.randint(-1, 3, (20,), generator=g))
    pool.release(torch.tensor([2]))  # some phrases belong to nobody now
    pool.save(tmp_path / "pool.pt")
    # a budget for every page at the new width (with less, the least recently used pages go:
    # test_load_into_smaller_budget_keeps_recent_pages)
    loaded = PhrasePool.load(tmp_path / "pool.pt", device=DEVICE, phrases_per_key=W, kernels=POOL_KERNELS,
                             budget_bytes=PhrasePool.budget_for(32, 3, W, 32))
    assert loaded.W == W and loaded.memory_bytes() <= loaded.budget_bytes
    keys = torch.arange(32).repeat(4)
    slots = torch.arange(-1, 3).repeat_interleave(32)
    n = min(W, 4)
    # the newest phrases of every key in the old pool, newest first for every reader (the loaded
    # phrases are nobody's own); the re-cut pool holds each key's n newest
    stamp = pool.stamp[pool.key_to_page.long().clamp(min=0)]        # [32, 4]
    newest = stamp.argsort(dim=1, descending=True)[:, :n]
    got = loaded.lookup(T(keys), T(slots), n)
    for k, s, phr, ok in zip(keys.tolist(), slots.tolist(), got[0].tolist(), got[1].tolist()):
        page = int(pool.key_to_page[k])
        kept = [] if page < 0 else [(int(pool.stamp[page, j]), int(pool.owner[page, j]), tuple(pool.tokens[page, j].tolist()))
                                    for j in newest[k].tolist() if pool.stamp[page, j] > 0]
        want = sorted(kept, key=lambda e: -e[0])
        assert [tuple(p) for p, v in zip(phr, ok) if v] == [e[2] for e in want], (k, s)
    assert loaded.num_phrases() == sum(min(int((pool.stamp[p] > 0).sum()), n) for p in range(pool.num_pages)
                                       if pool.page_key[p] >= 0)
    ins(loaded, 5, [(9, 9, 9)])  # a new phrase is the key's newest; the oldest goes where the page is full
    assert get(loaded, 5, slot=9)[0] == (9, 9, 9)  # slot 9 owns nothing: newest first


def test_load_into_smaller_budget_keeps_recent_pages():
    pool = make(vocab=10, W=2, pages=4)
    for k in (1, 2, 3, 4):
        ins(pool, k, [A, B])
    get(pool, 1)
    small = make(vocab=10, W=2, pages=2)
    small.load_state_dict(pool.state_dict())
    mapped = lambda: [k for k in range(10) if small.key_to_page[k] >= 0]
    assert mapped() == [1, 4]
    ins(small, 5, [C])  # the loaded clock keeps LRU order consistent: key 4 is older than key 1
    assert mapped() == [1, 5]
    assert get(small, 1) == [B, A] and get(small, 5) == [C]


def test_budget_too_small_raises():
    need = PhrasePool.budget_for(151936, 4, 16, 1)
    with pytest.raises(ValueError, match="budget_bytes"):
        PhrasePool(151936, 4, 16, need - 1)
    pool = PhrasePool(151936, 4, 16, need)
    assert pool.num_pages == 1 and pool.memory_bytes() == need


class RefPool:
    """Pure-Python reference: key -> OrderedDict((phrase, owner) -> owner), oldest first, no
    page limit. A shared pool holds a phrase once (the owner in its identity is None); a private
    one holds each owner's copy apart."""

    def __init__(self, W, shared):
        self.W, self.shared, self.d = W, shared, {}

    def _id(self, p, o):
        return (p, None if self.shared else o)

    def insert(self, keys, phrases, owners, valid):
        for k, p, o, v in zip(keys, phrases, owners, valid):
            if v:
                od = self.d.setdefault(k, OrderedDict())
                od.pop(self._id(p, o), None)
                od[self._id(p, o)] = o
                if len(od) > self.W:
                    od.popitem(last=False)

    def remove(self, keys, phrases, valid, owners=None):
        for i, (k, p, v) in enumerate(zip(keys, phrases, valid)):
            if v:
                od = self.d.get(k, {})
                for pid in [pid for pid in od if pid[0] == p]:
                    if self.shared or owners is None or pid[1] == owners[i]:
                        del od[pid]

    def release(self, slots):
        for od in self.d.values():
            for pid, o in list(od.items()):
                if o in slots:
                    if self.shared:
                        od[pid] = -1  # keeps its position
                    else:
                        del od[pid]

    def lookup(self, key, slot, n):
        items = list(self.d.get(key, {}).items())[::-1]
        own = [pid[0] for pid, o in items if o == slot]
        return (own + ([pid[0] for pid, o in items if o != slot] if self.shared else []))[:n]


@pytest.fixture(autouse=True, params=["index_put", "scatter_add", "triton"])
def forms(request, monkeypatch):
    """Every way a pool inserts and looks up, here: torch with either form of its adds at indices
    (pool.SCATTER_ADD_DEVICES picks one per device), and the Triton kernels (kernels/pool_insert.py,
    kernels/pool_lookup.py; compiled on CUDA, else under the interpreter)."""
    from vllm_ouroboros import pool as pool_module

    if request.param == "triton":
        why = pool_insert.pick_kernel(pool_insert.place_kernel, torch.device(DEVICE),
                                      pool_insert._TRITON_IMPORT_ERROR)[1] or pool_lookup.pick_kernel(
            pool_lookup.lookup_kernel, torch.device(DEVICE), pool_lookup._TRITON_IMPORT_ERROR)[1]
        if why is not None:
            pytest.skip(f"Triton cannot run the pool's kernels in this process: {why}")
        request.getfixturevalue("triton_interpreter")  # the interpreter reads it while running
    devices = {DEVICE, "meta"} if request.param == "scatter_add" else set()
    monkeypatch.setattr(pool_module, "SCATTER_ADD_DEVICES", devices)
    monkeypatch.setitem(globals(), "POOL_KERNELS", "triton" if request.param == "triton" else "torch")
    return request.param


@pytest.mark.parametrize("shared", [True, False])
def test_randomized_against_reference(shared, forms):
    V, L, W, slots = 12, 2, 3, 4
    # Triton's interpreter runs the kernels one program at a time: fewer steps there
    # (tests/test_pool_kernels.py compares the kernels with torch at length)
    steps = 60 if forms == "triton" and DEVICE != "cuda" else 300
    rng = random.Random(shared)
    pool, ref = make(vocab=V, L=L, W=W, shared=shared), RefPool(W, shared)

    def rows(n):
        keys = [rng.randrange(V) for _ in range(n)]
        phrases = [tuple(rng.randrange(3) for _ in range(L)) for _ in range(n)]
        owners = [rng.randrange(-1, slots) for _ in range(n)]
        valid = [rng.random() < 0.8 for _ in range(n)]
        return keys, phrases, owners, valid

    all_keys = torch.arange(V).repeat(slots + 1)
    all_slots = torch.arange(-1, slots).repeat_interleave(V)
    for step in range(steps):
        op = rng.random()
        if op < 0.55:
            keys, phrases, owners, valid = rows(rng.randrange(1, 25))
            pool.insert(T(keys), T(phrases), T(owners), T(valid))
            ref.insert(keys, phrases, owners, valid)
        elif op < 0.75:
            keys, old, owners, valid = rows(rng.randrange(1, 10))
            new = [tuple(rng.randrange(3) for _ in range(L)) for _ in keys]
            pool.replace(T(keys), T(old), T(new), T(owners), T(valid))
            ref.remove(keys, old, valid, owners)
            ref.insert(keys, new, owners, valid)
        elif op < 0.9:
            keys, phrases, _, valid = rows(rng.randrange(1, 10))
            pool.remove(T(keys), T(phrases), T(valid))
            ref.remove(keys, phrases, valid)
        else:
            released = rng.sample(range(slots), rng.randrange(1, 3))
            pool.release(T(released))
            ref.release(released)
        n = rng.randrange(1, W + 1)
        phrases, valid = pool.lookup(all_keys, all_slots, n)
        rows_out = zip(all_keys.tolist(), all_slots.tolist(), phrases.tolist(), valid.tolist())
        for k, s, p, v in rows_out:
            got = [tuple(x) for x, ok in zip(p, v) if ok]
            assert got == ref.lookup(k, s, n), (step, k, s)
        assert pool.num_phrases() == sum(len(od) for od in ref.d.values())
    assert pool.stats()["page_evictions"] == 0


def test_batched_ops_need_no_host_sync():
    # on the meta device every data-dependent step (.item(), bool(), masks, nonzero, unique) raises
    pool = PhrasePool(1000, 4, 8, PhrasePool.budget_for(1000, 4, 8, 50), device="meta")
    keys = torch.zeros(64, dtype=torch.long, device="meta")
    phrases = torch.zeros(64, 4, dtype=torch.long, device="meta")
    valid = torch.ones(64, dtype=torch.bool, device="meta")
    pool.insert(keys, phrases, keys, valid)
    out, ok = pool.lookup(keys, keys, 4)
    assert out.shape == (64, 4, 4) and ok.shape == (64, 4)
    pool.replace(keys, phrases, phrases, keys, valid)
    pool.remove(keys, phrases, valid)
    pool.release(keys[:3])
