"""The phrase pool against an independent pure-Python model of it: pages claimed by keys (free
pages first, then the least recently used, never a page of a key in the same insert, newest
keys first when pages run short), each page's W slots (a re-inserted phrase refreshed, the
oldest slot replaced), own phrases ranked first in a shared pool and hidden from other owners in
a private one, release, remove and candidate refinement. Every table (page keys, key to page,
last use, stamps) and every lookup equal after every call, over random sizes with few pages
(evictions on most inserts). tests/test_pool.py's randomized test runs with a page for every key
(no eviction); tests/test_pool_kernels.py holds the Triton kernels to PhrasePool's torch code,
so a mistake both share shows here."""

import random

import pytest
import torch

from conftest import DEVICE

from vllm_ouroboros.pool import PhrasePool

pytestmark = pytest.mark.usefixtures("one_thread")


class Model:
    """The pool as lists: page keys, last use, each page's slots as (phrase, stamp, owner)."""

    def __init__(self, V, L, W, P, shared):
        self.V, self.L, self.W, self.P, self.shared = V, L, W, P, shared
        self.pk = [-1]*P; self.lu = [0]*P; self.slots = [[(None, 0, -1)]*W for _ in range(P)]; self.k2p = {}
        self.clock = 0
        self.evicted = 0
    def insert(self, keys, phr, own, valid):
        N = len(keys); t0 = self.clock; self.clock += N
        kept = [valid[i] and 0 <= keys[i] < self.V for i in range(N)]
        ident = lambda i: (keys[i], phr[i]) + (() if self.shared else (own[i],))
        seen = set()
        for i in reversed(range(N)):
            if kept[i]:
                if ident(i) in seen: kept[i] = False
                else: seen.add(ident(i))
        groups = {}
        for i in reversed(range(N)):
            if kept[i]: groups.setdefault(keys[i], []).append(i)   # newest first
        prot = {self.k2p[k] for k in groups if k in self.k2p}
        need = sorted([k for k in groups if k not in self.k2p], key=lambda k: -groups[k][0])
        cands = sorted([p for p in range(self.P) if p not in prot],
                       key=lambda p: ((-1 if self.pk[p] < 0 else self.lu[p]), p))[:min(N, self.P)]
        for r, k in enumerate(need):
            if r < len(cands):
                p = cands[r]
                if self.pk[p] >= 0:
                    del self.k2p[self.pk[p]]
                    self.evicted += 1
                self.pk[p] = k; self.k2p[k] = p
                self.slots[p] = [(t, 0, o) for t, st, o in self.slots[p]]
        for k, rows in groups.items():
            if k not in self.k2p: continue
            p = self.k2p[k]; rows = rows[:self.W]
            sl = self.slots[p]
            for j,(t,st,o) in enumerate(sl):
                if st > 0 and any(t == phr[i] and (self.shared or o == own[i]) for i in rows):
                    sl[j] = (t, 0, o)
            order = sorted(range(self.W), key=lambda j: (sl[j][1], j))
            for r, i in enumerate(rows):
                sl[order[r]] = (phr[i], t0 + 1 + i, own[i])
            self.lu[p] = max(self.lu[p], t0 + N)
    def lookup(self, keys, slots, n, rows=None):
        self.clock += 1; out = []
        for b, k in enumerate(keys):
            p = self.k2p.get(k, -1) if 0 <= k < self.V else -1
            res = []
            if p >= 0:
                vis = [(st + ((1 << 62) if (self.shared and o == slots[b]) else 0), t) for t, st, o in self.slots[p]
                       if st > 0 and (self.shared or o == slots[b])]
                res = [t for _, t in sorted(vis, reverse=True)[:n]]
                if rows is None or rows[b]: self.lu[p] = max(self.lu[p], self.clock)
            out.append(res)
        return out
    def release(self, done):
        for p in range(self.P):
            for j, (t, st, o) in enumerate(self.slots[p]):
                if o in done:
                    self.slots[p][j] = (t, st, -1) if self.shared else (t, 0, o)
            if not self.shared and self.pk[p] >= 0 and all(st == 0 for _, st, _ in self.slots[p]):
                del self.k2p[self.pk[p]]; self.pk[p] = -1
    def remove(self, keys, phr, valid, owners=None):
        for i, k in enumerate(keys):
            if not valid[i] or k not in self.k2p: continue
            p = self.k2p[k]
            for j, (t, st, o) in enumerate(self.slots[p]):
                if t == phr[i] and (self.shared or owners is None or o == owners[i]):
                    self.slots[p][j] = (t, 0, o)


def T(x):
    return torch.tensor(x, device=DEVICE)


def run(seed: int) -> int:
    """60 random calls on a pool and on the model; returns the pages evicted (claimed while
    holding another key)."""
    rng = random.Random(seed)
    V, L, W = rng.choice([6, 12, 30]), rng.randint(1, 3), rng.randint(1, 4)
    P = rng.randint(1, V)
    shared = rng.random() < 0.5
    pool = PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, P), device=DEVICE, shared=shared, kernels="torch")
    assert pool.num_pages == P
    model = Model(V, L, W, P, shared)
    for step in range(60):
        op = rng.random()
        n = rng.randint(1, 30)
        keys = [rng.randrange(-1, V + 1) for _ in range(n)]  # out of range both ways too
        if rng.random() < 0.5:
            keys = [k % 4 for k in keys]  # many rows of a key: groups over a page
        phr = [tuple(rng.randrange(3) for _ in range(L)) for _ in range(n)]
        own = [rng.randrange(-1, 3) for _ in range(n)]
        valid = [rng.random() < 0.85 for _ in range(n)]
        if op < 0.5:
            pool.insert(T(keys), T(phr).view(n, L), T(own), T(valid))
            model.insert(keys, phr, own, valid)
        elif op < 0.6:
            new = [tuple(rng.randrange(3) for _ in range(L)) for _ in range(n)]
            pool.replace(T(keys), T(phr).view(n, L), T(new).view(n, L), T(own), T(valid))
            model.remove(keys, phr, valid, own)
            model.insert(keys, new, own, valid)
        elif op < 0.85:
            m = rng.randint(1, W)
            rows = valid if rng.random() < 0.5 else None
            got, ok = pool.lookup(T(keys), T(own), m, None if rows is None else T(rows))
            want = model.lookup(keys, own, m, rows)
            for b in range(n):
                g = [tuple(x) for x, v in zip(got[b].tolist(), ok[b].tolist()) if v]
                assert g == want[b], (seed, step, b, g, want[b])
        elif op < 0.93:
            pool.remove(T(keys), T(phr).view(n, L), T(valid))
            model.remove(keys, phr, valid)
        else:
            done = rng.sample(range(-1, 3), 2)
            pool.release(T(done))
            model.release(done)
        where = (seed, step)
        assert pool.page_key.tolist() == model.pk, (where, "page keys")
        assert pool.page_last_used.tolist() == model.lu, (where, "last use")
        assert pool.key_to_page.tolist() == [model.k2p.get(k, -1) for k in range(V)], (where, "key to page")
        assert pool.stamp.tolist() == [[x[1] for x in sl] for sl in model.slots], (where, "stamps")
    return model.evicted


def test_the_pool_is_its_model_through_evictions():
    evicted = sum(run(seed) for seed in range(120))
    assert evicted > 500, f"only {evicted} evictions: the pages did not run short"
