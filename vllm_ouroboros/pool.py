"""The phrase pool P: key token -> up to W phrases of L = beta-1 tokens, LRU per key, on the device.

Storage is paged: one page holds the W phrase slots of one key, and pages are handed to keys as they
occur, under a fixed memory budget; when none is free the least recently used page is recycled.
Lookup, insert, replace, remove and release are batched over requests and free of host-device
syncs (no `.item()`, no boolean indexing, no `torch.unique`, no shape that depends on data), so
they only queue work on the device and can be captured in a CUDA graph (the recency clock is a
device tensor for that reason: a host counter would be frozen into the graph); stats and
persistence may sync. Masked rows go through the
same scatter as real rows with a no-op value (a zero delta, or a value that loses a min/max).
"""
import contextlib
import logging
import os
import tempfile
import time
from typing import Optional

import torch

from vllm_ouroboros import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

_NEVER = torch.iinfo(torch.int64).max  # loses every amin; marks pages that may not be evicted
_OWN = 1 << 62  # added to an own phrase's stamp so it outranks every other phrase

_STATS = ("lookups", "hits", "phrases_returned", "page_evictions")
_BUFFERS = ("key_to_page", "page_key", "page_last_used", "tokens", "stamp", "owner", "counters")
_SCALARS = ("vocab_size", "phrase_len", "phrases_per_key", "budget_bytes", "shared", "clock")


class PoolFileError(ValueError):
    """A pool file that cannot be loaded; the message says why (after the file's name)."""


# Devices whose pools add at indices with scatter_add_ (one kernel) rather than
# index_put_(accumulate=True), which CUDA runs as a radix sort of the indices (several kernels)
# and then the add; on a CPU index_put_ is the faster. tests/test_pool.py runs both.
SCATTER_ADD_DEVICES = {"cuda"}


def _index_put_add(buf: torch.Tensor, index: tuple[torch.Tensor, ...], delta: torch.Tensor) -> None:
    """buf[index] += delta, in place (index_put_ with accumulate).

    Shape: buf [R, ...] or [R, S, ...]; index (rows [N],) or (rows [N], columns [N]) int64;
    delta [N, ...] (any integer dtype; cast to buf's). Rows that must change nothing add 0
    wherever their index points, so the one row with a real change to an entry is the only one
    that moves it."""
    buf.index_put_(index, delta.to(buf.dtype), accumulate=True)


def _scatter_add(buf: torch.Tensor, index: tuple[torch.Tensor, ...], delta: torch.Tensor) -> None:
    """_index_put_add as one scatter_add_ (same shapes, same result): an insert makes seven of
    these, which as index_put_ were most of a drafting round's pool kernels on a GPU."""
    flat, at = buf, index[0]
    if len(index) == 2:  # (row, column) into the [R * S, ...] view
        flat, at = buf.view(-1, *buf.shape[2:]), index[0] * buf.shape[1] + index[1]
    idx = at.view(-1, *[1] * (flat.dim() - 1)).expand(-1, *flat.shape[1:])
    flat.scatter_add_(0, idx, delta.to(buf.dtype).expand_as(idx))


def _recut(tokens: torch.Tensor, stamp: torch.Tensor, owner: torch.Tensor, W: int) -> dict:
    """Pages of another width as pages of W slots: each page's newest phrases (highest stamps;
    empty slots have stamp 0) first, cut to W or padded with empty slots.

    Shape: tokens [P, W0, L], stamp [P, W0], owner [P, W0] -> the same with W for W0."""
    order = torch.argsort(stamp, dim=1, descending=True, stable=True)[:, :W]
    tokens = tokens.gather(1, order[..., None].expand(-1, -1, tokens.shape[2]))
    stamp, owner = stamp.gather(1, order), owner.gather(1, order)
    pad = W - order.shape[1]
    if pad > 0:
        tokens = torch.nn.functional.pad(tokens, (0, 0, 0, pad))
        stamp = torch.nn.functional.pad(stamp, (0, pad))
        owner = torch.nn.functional.pad(owner, (0, pad), value=-1)
    return {"tokens": tokens, "stamp": stamp, "owner": owner}


class PhrasePool:
    """Paged LRU phrase pool (see module docstring).

    Owners are request slot indices (>= 0) or -1 (nobody). With `shared=True` every phrase is
    visible to every request, own phrases ranked first, and `release` hands a finished request's
    phrases to nobody (warm start); with `shared=False` a request sees only its own phrases and
    `release` deletes them.

    `kernels` picks how inserts and lookups run: "torch" (the reference: 159 and 39 launches),
    "triton" (kernels/pool_insert.py, four kernels, and kernels/pool_lookup.py, one; raises where
    Triton cannot run on `device`), or "auto": each op through its kernels on a CUDA device once
    they have matched torch there (their `check_kernel`), else torch. The chosen ones are
    `insert_backend` and `lookup_backend` ("torch" or "triton"; why not "triton" in `backend_reasons`).
    """

    def __init__(self, vocab_size: int, phrase_len: int, phrases_per_key: int, budget_bytes: int,
                 device="cpu", shared: bool = True, kernels: str = "auto"):
        if min(vocab_size, phrase_len, phrases_per_key) < 1:
            raise ValueError("vocab_size, phrase_len and phrases_per_key must all be >= 1")
        self.vocab_size, self.L, self.W = vocab_size, phrase_len, phrases_per_key
        self.budget_bytes, self.device, self.shared = budget_bytes, torch.device(device), shared
        fixed = self.budget_for(vocab_size, phrase_len, phrases_per_key, 0)
        per_page = self.budget_for(vocab_size, phrase_len, phrases_per_key, 1) - fixed
        if budget_bytes < fixed + per_page:
            raise ValueError(
                f"budget_bytes={budget_bytes} cannot hold the key->page table plus one page: need "
                f"at least {fixed + per_page} bytes ({fixed} fixed for vocab_size={vocab_size}, "
                f"{per_page} per page for W={phrases_per_key}, L={phrase_len})")
        # more pages than keys could never be used
        self.num_pages = P = min(vocab_size, (budget_bytes - fixed) // per_page)
        kw = dict(device=self.device)
        self.key_to_page = torch.full((vocab_size,), -1, dtype=torch.int32, **kw)
        self.page_key = torch.full((P,), -1, dtype=torch.int32, **kw)
        self.page_last_used = torch.zeros(P, dtype=torch.int64, **kw)
        self.tokens = torch.zeros(P, self.W, self.L, dtype=torch.int32, **kw)
        self.stamp = torch.zeros(P, self.W, dtype=torch.int64, **kw)  # 0 = empty slot
        self.owner = torch.full((P, self.W), -1, dtype=torch.int32, **kw)
        self.counters = torch.zeros(len(_STATS), dtype=torch.int64, **kw)
        # Recency clock: an insert of N rows takes N stamps, a lookup one. On the device, so that
        # a replayed CUDA graph advances it; only the order of stamps matters.
        self.clock = torch.zeros((), dtype=torch.int64, **kw)
        self._add_at = _scatter_add if self.device.type in SCATTER_ADD_DEVICES else _index_put_add
        if kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels={kernels!r}: expected 'auto', 'torch' or 'triton'")
        self.backend_reasons: dict[str, str] = {}
        # kernels/pool_insert.insert_triton and kernels/pool_lookup.lookup_triton where they run
        self._insert_kernels = self._pick_kernel("insert", kernels)
        self._lookup_kernel = self._pick_kernel("lookup", kernels)
        self.insert_backend = "torch" if self._insert_kernels is None else "triton"
        self.lookup_backend = "torch" if self._lookup_kernel is None else "triton"

    def _pick_kernel(self, op: str, kernels: str):
        """The host function of `op`'s kernels where they are to run, else None (torch)."""
        from vllm_ouroboros.kernels.triton_runtime import choose_kernels

        module = "pool_insert" if op == "insert" else "pool_lookup"
        why = choose_kernels(kernels, self.device, module,
                             "place_kernel" if op == "insert" else "lookup_kernel", f"the pool's {op}")
        if why:
            logger.warning("phrase pool %ss run in torch on %s: %s", op, self.device, why)
            self.backend_reasons[op] = why
        if why is not None:
            return None
        if op == "insert":
            from vllm_ouroboros.kernels.pool_insert import insert_triton as fn
        else:
            from vllm_ouroboros.kernels.pool_lookup import lookup_triton as fn
        return fn

    def empty_like(self, num_pages: int) -> "PhrasePool":
        """An empty pool of `num_pages` pages with this one's vocabulary, L, W, sharing, device
        and kernels (the same insert and lookup backends): a scratch pool that launches what
        this one would (pool_warmup.py)."""
        other = PhrasePool(self.vocab_size, self.L, self.W,
                           self.budget_for(self.vocab_size, self.L, self.W, num_pages),
                           device=self.device, shared=self.shared, kernels="torch")
        other._insert_kernels, other._lookup_kernel = self._insert_kernels, self._lookup_kernel
        other.insert_backend, other.lookup_backend = self.insert_backend, self.lookup_backend
        other.backend_reasons = dict(self.backend_reasons)
        return other

    @staticmethod
    def budget_for(vocab_size: int, phrase_len: int, phrases_per_key: int, num_pages: int) -> int:
        """Bytes a pool with `num_pages` pages owns (all tensors, the key->page table included)."""
        per_page = phrases_per_key * (4 * phrase_len + 8 + 4) + 4 + 8
        return 4 * vocab_size + 8 * len(_STATS) + 8 + num_pages * per_page  # 8: the clock

    def _check_rows(self, keys: torch.Tensor, phrases: torch.Tensor):
        if keys.dim() != 1 or tuple(phrases.shape) != (keys.shape[0], self.L):
            raise ValueError(f"expected keys [N] and phrases [N, {self.L}], got "
                             f"{tuple(keys.shape)} and {tuple(phrases.shape)}")

    def _pages_of(self, keys: torch.Tensor) -> torch.Tensor:
        """Page of each key, -1 for none (also for out-of-range keys such as -1 padding)."""
        ok = (keys >= 0) & (keys < self.vocab_size)
        return torch.where(ok, self.key_to_page[keys.clamp(0, self.vocab_size - 1)].long(), -1)

    # ---- readers -----------------------------------------------------------------------------

    @torch.no_grad()
    def lookup(self, keys: torch.Tensor, slots: torch.Tensor, n: int,
               rows: Optional[torch.Tensor] = None):
        """The n best phrases of each key for the request in that row, best first.

        Shape: keys [B] (int), slots [B] (int, the requesting request's slot), rows [B] (bool)
        or None: rows with False (padding, finished rows of a fixed-shape round) get phrases
        too but touch neither the pages' recency nor the counters.
        Returns phrases [B, n, L] (long, 0 where not valid) and valid [B, n] (bool).
        This torch body is the reference of kernels/pool_lookup.py, which runs instead where
        `lookup_backend` is "triton".
        """
        if not 1 <= n <= self.W:
            raise ValueError(f"n={n} must be in [1, phrases_per_key={self.W}]")
        if self._lookup_kernel is not None:
            out = self._lookup_kernel(self, keys, slots, n, rows)
            if out is not None:
                return out
        keys, slots = keys.to(self.device).long(), slots.to(self.device).long()
        page = self._pages_of(keys)
        pg = page.clamp(min=0)
        stamp = self.stamp[pg]                                    # [B, W]
        own = self.owner[pg].long() == slots[:, None]             # [B, W]
        visible = (page >= 0)[:, None] & (stamp > 0)
        if self.shared:
            score = stamp + own.long() * _OWN
        else:
            score, visible = stamp, visible & own
        top, idx = torch.where(visible, score, -1).topk(n, dim=1)  # [B, n]
        valid = top > 0
        phrases = self.tokens[pg[:, None], idx].long() * valid[..., None]
        self.clock += 1
        seen = page >= 0
        if rows is not None:
            rows = rows.to(self.device, torch.bool)
            seen = seen & rows
        self.page_last_used.scatter_reduce_(0, pg, torch.where(seen, self.clock, 0), "amax")
        counted = valid if rows is None else valid & rows[:, None]
        self.counters[0] += keys.shape[0] if rows is None else rows.sum()
        self.counters[1] += counted[:, 0].sum()
        self.counters[2] += counted.sum()
        return phrases, valid

    # ---- writers -----------------------------------------------------------------------------

    @torch.no_grad()
    def insert(self, keys: torch.Tensor, phrases: torch.Tensor, owners: torch.Tensor,
               valid: Optional[torch.Tensor] = None):
        """Insert phrases as newest; later rows are newer than earlier ones. This torch body is
        the reference of kernels/pool_insert.py, which runs instead where `insert_backend` is
        "triton" (up to its MAX_ROWS rows a call).

        Shape: keys [N] (int), phrases [N, L] (int), owners [N] (int), valid [N] (bool) or None.
        Rows with valid False or a key outside [0, vocab_size) are ignored.
        """
        N, V, W, dev = keys.shape[0], self.vocab_size, self.W, self.device
        self._check_rows(keys, phrases)
        if N == 0:
            return
        if self._insert_kernels is not None and self._insert_kernels(self, keys, phrases, owners, valid):
            return
        keys, owners = keys.to(dev).long(), owners.to(dev).long()
        phrases = phrases.to(dev).long()
        keep = (keys >= 0) & (keys < V)
        if valid is not None:
            keep &= valid.to(dev, torch.bool)
        t0 = self.clock.clone()
        self.clock += N
        i = torch.arange(N, device=dev)

        # Repeated (key, phrase) rows: a lexicographic sort (stable sorts, last column first, rows
        # newest first) puts each run together with its newest row first; the rest are dropped.
        # Private pools (not shared): a phrase is (key, phrase, owner), so one request's insert
        # neither takes another's copy nor leaves it to be deleted with the other's release.
        kq = torch.where(keep, keys, V)
        perm = i.flip(0)
        cols = [phrases[:, c] for c in reversed(range(self.L))] + [kq]
        for col in ([] if self.shared else [owners]) + cols:
            perm = perm[torch.sort(col[perm], stable=True).indices]
        rows = torch.cat([kq[:, None], phrases] + ([] if self.shared else [owners[:, None]]), 1)[perm]
        dup = torch.zeros_like(keep)
        dup[perm[1:]] = (rows[1:] == rows[:-1]).all(1)
        kq = torch.where(keep & ~dup, keys, V)

        # Group by key, newest first; from here on every row tensor is in this order.
        perm = i.flip(0)
        perm = perm[torch.sort(kq[perm], stable=True).indices]
        key, phr, own = kq[perm], phrases[perm], owners[perm]
        start = torch.ones_like(keep)
        start[1:] = key[1:] != key[:-1]
        first = torch.cummax(torch.where(start, i, 0), 0).values  # start of this row's key group
        rank = i - first                                           # 0 = newest phrase of its key
        has_key = key < V
        page = torch.where(has_key, self._pages_of(key), -1)

        # Keys without a page take free pages first, then least recently used ones; pages of keys
        # in this call are never taken. The newest keys win when pages run short.
        P = self.num_pages
        protect = torch.zeros(P, dtype=torch.int32, device=dev)
        self._add_at(protect, (page.clamp(min=0),), (page >= 0).int())
        protect = protect > 0
        # Pages of equal recency (inserted by one call) go in index order: scores made unique
        # (recency * P + index; free pages negative), so the k smallest are the same pages
        # whatever k, and the pool's state does not depend on how many rows a call carried
        # (masked rows included: the fixed-shape drafting round relies on it). A full sort
        # would do the same at 3x topk's cost on a CPU. int64 holds recency * P for clocks
        # up to ~6e13 at a 150k-token vocabulary.
        score = torch.where(self.page_key < 0, -1, self.page_last_used) * P + torch.arange(P, device=dev)
        k = min(N, P)
        cand_score, cand = torch.where(protect, _NEVER, score).topk(k, largest=False)
        need = start & has_key & (page < 0)
        need_rank = torch.empty_like(i)
        need_rank[torch.argsort(torch.where(need, -perm, 1))] = i
        usable = (torch.arange(k, device=dev) < need.sum()) & (cand_score < _NEVER)
        j = need_rank.clamp(max=k - 1)
        got, new_page = need & (need_rank < k) & usable[j], cand[j]
        old_key = self.page_key[new_page].long()
        evict = got & (old_key >= 0)
        # Accumulated deltas: rows that change nothing add 0 wherever their clamped index points.
        self._add_at(self.key_to_page, (torch.cat([old_key.clamp(min=0), key.clamp(max=V - 1)]),),
                torch.cat([torch.where(evict, -1 - new_page, 0), torch.where(got, new_page + 1, 0)]))
        self._add_at(self.page_key, (new_page,), torch.where(got, key - old_key, 0))
        self._add_at(self.stamp, (new_page,),  # a recycled page starts empty
                torch.where(got[:, None], -self.stamp[new_page], 0))
        self.counters[3] += evict.sum()
        page = torch.where(got, new_page, page)[first]
        live = has_key & (rank < W) & (page >= 0)
        pg = page.clamp(min=0)

        # A re-inserted phrase gives up its old slot, so it is stored once, as newest.
        stored = self.stamp[pg]                                                    # [N, W]
        same = (self.tokens[pg] == phr[:, None, :]).all(-1) & (stored > 0) & live[:, None]
        if not self.shared:
            same &= self.owner[pg] == own[:, None]
        flat = pg[:, None] * W + torch.arange(W, device=dev)
        self.stamp.view(-1).scatter_reduce_(0, flat.view(-1), torch.where(same, 0, _NEVER).view(-1),
                                            "amin")
        # All incoming phrases are newer than all stored ones, so the c newest incoming phrases of
        # a key take its c oldest (or empty) slots; rows of one key see the same page state.
        slot = torch.argsort(self.stamp[pg], dim=1, stable=True).gather(
            1, rank.clamp(max=W - 1)[:, None]).squeeze(1)
        for buf, val in ((self.tokens, phr), (self.stamp, t0 + 1 + perm), (self.owner, own)):
            cur = buf[pg, slot]
            m = live.view(-1, *[1] * (cur.dim() - 1))
            self._add_at(buf, (pg, slot), torch.where(m, val - cur, 0))
        self.page_last_used.scatter_reduce_(0, pg, torch.where(live, t0 + N, 0), "amax")

    @torch.no_grad()
    def remove(self, keys: torch.Tensor, phrases: torch.Tensor,
               valid: Optional[torch.Tensor] = None, owners: Optional[torch.Tensor] = None):
        """Delete phrases where present: in a private pool (not shared) only the copies of
        `owners` where given (each request holds its own), else every copy.

        Shape: keys [N] (int), phrases [N, L] (int), valid [N] (bool) or None, owners [N] (int)
        or None.
        """
        self._check_rows(keys, phrases)
        keys, phrases = keys.to(self.device).long(), phrases.to(self.device)
        page = self._pages_of(keys)
        pg = page.clamp(min=0)
        hit = (self.tokens[pg] == phrases[:, None, :]).all(-1) & (page >= 0)[:, None]   # [N, W]
        if owners is not None and not self.shared:
            hit &= self.owner[pg] == owners.to(self.device, self.owner.dtype)[:, None]
        if valid is not None:
            hit &= valid.to(self.device, torch.bool)[:, None]
        flat = pg[:, None] * self.W + torch.arange(self.W, device=self.device)
        self.stamp.view(-1).scatter_reduce_(0, flat.view(-1), torch.where(hit, 0, _NEVER).view(-1),
                                            "amin")

    def replace(self, keys: torch.Tensor, old_phrases: torch.Tensor, new_phrases: torch.Tensor,
                owners: torch.Tensor, valid: Optional[torch.Tensor] = None):
        """Candidate refinement: drop the old phrase (if stored; in a private pool, the owner's
        copy) and insert the new one as newest.

        Shape: keys [N] (int), old_phrases [N, L], new_phrases [N, L] (int), owners [N] (int),
        valid [N] (bool) or None.
        """
        self.remove(keys, old_phrases, valid, owners)
        self.insert(keys, new_phrases, owners, valid)

    @torch.no_grad()
    def release(self, slots: torch.Tensor):
        """Finished requests: their phrases go to nobody (shared) or are deleted (not shared).

        Shape: slots [S] (int). Scans the whole pool; meant for request completion, not every step.
        """
        if slots.numel() == 0:
            return
        # membership by binary search: torch.isin would call unique, which syncs on CUDA. int32
        # positions, clamped in place: the int64 default and a second copy took 55% of the
        # pool's budget on top of it (a 64 MiB pool: 35 MB), which neither the budget nor vLLM's
        # memory profile sees.
        done = torch.sort(slots.to(self.device).int()).values
        at = torch.searchsorted(done, self.owner, out_int32=True).clamp_(max=done.numel() - 1)
        mine = done[at] == self.owner
        if self.shared:
            self.owner.masked_fill_(mine, -1)
            return
        self.stamp.masked_fill_(mine, 0)
        # pages left empty go back to the free list, so they do not wait for LRU eviction
        empty = (self.stamp == 0).all(1) & (self.page_key >= 0)
        p = torch.arange(self.num_pages, device=self.device)
        self._add_at(self.key_to_page, (self.page_key.long().clamp(min=0),), torch.where(empty, -1 - p, 0))
        self.page_key.masked_fill_(empty, -1)

    # ---- stats (these sync) --------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Device bytes of all the pool's tensors (what budget_for counts)."""
        return sum(getattr(self, n).nbytes for n in _BUFFERS) + self.clock.nbytes

    def num_phrases(self) -> int:
        return int((self.stamp > 0).sum())

    def num_keys(self) -> int:
        return int(((self.stamp > 0).any(1) & (self.page_key >= 0)).sum())

    def stats(self) -> dict:
        out = dict(zip(_STATS, self.counters.tolist()))
        out["hit_rate"] = out["hits"] / max(out["lookups"], 1)
        out.update(phrases=self.num_phrases(), keys=self.num_keys(), pages=self.num_pages,
                   memory_bytes=self.memory_bytes())
        return out

    # ---- persistence ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The pool's buffers (on the CPU) and sizes. A slot emptied (stamp 0: a finished
        request's private phrases released, a refined phrase removed, an evicted page) keeps
        its old tokens in the buffers, unread; here they are zeroed with its owner, so a saved
        file holds no phrase the pool no longer has (a finished request's prompt)."""
        sd = {n: getattr(self, n).detach().cpu().clone() for n in _BUFFERS}
        empty = sd["stamp"] == 0
        sd["tokens"][empty] = 0
        sd["owner"][empty] = -1
        sd.update(vocab_size=self.vocab_size, phrase_len=self.L, phrases_per_key=self.W,
                  budget_bytes=self.budget_bytes, shared=self.shared, clock=int(self.clock))
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        """Load pages; if this pool has fewer pages, the most recently used ones are kept. A
        state saved with another phrases_per_key (window size) is re-cut to this pool's: each
        key keeps its newest phrases, as many as a page of this pool holds. Owners and counters
        as saved (an exact copy; `load`, for another engine, clears them)."""
        for name, mine in (("vocab_size", self.vocab_size), ("phrase_len", self.L)):
            if sd[name] != mine:
                raise ValueError(f"pool state has {name}={sd[name]}, this pool has {name}={mine}")
        if sd["phrases_per_key"] != self.W:
            sd = {**sd, **_recut(sd["tokens"], sd["stamp"], sd["owner"], self.W)}
        used = torch.nonzero(sd["page_key"] >= 0).squeeze(1)
        used = used[torch.argsort(sd["page_last_used"][used], descending=True)][:self.num_pages]
        n, dev = used.numel(), self.device
        self.key_to_page.fill_(-1)
        self.page_key.fill_(-1)
        self.page_last_used.zero_()
        self.tokens.zero_()
        self.stamp.zero_()
        self.owner.fill_(-1)
        for name in ("page_key", "page_last_used", "tokens", "stamp", "owner"):
            getattr(self, name)[:n] = sd[name][used].to(dev)
        self.key_to_page[self.page_key[:n].long()] = torch.arange(n, device=dev, dtype=torch.int32)
        self.counters.copy_(sd["counters"])
        self.clock.fill_(int(sd["clock"]))
        self.rebase_clock()

    def clock_limit(self) -> int:
        """The recency clock past which `rebase_clock` moves it back: eviction scores are
        recency * num_pages + page (int64), so a clock near 2^63 / num_pages wraps them. An
        insert advances the clock by its rows, masked ones too: a 512-row drafting round of 20
        window rows at 400 forwards a second reaches 2^63 / 600k pages in some 40 days."""
        return (1 << 61) // max(self.num_pages, 1)

    @torch.no_grad()
    def rebase_clock(self) -> bool:
        """Where the clock passed clock_limit(), renumber the stamps, the pages' last use and
        the clock by their rank among all of them (0, empty, stays 0): every order and every
        tie is kept, so eviction and the lookups' choices go on as before, in the torch and the
        Triton paths alike, and the clock restarts below the number of slots. Reads the clock
        to the host (one synchronisation) and sorts every stamp (a temporary of some 4x the
        stamps' bytes): call it now and then, not per step. Where that temporary does not fit,
        everything moves back by one offset instead, and stamps older than clock_limit() / 2
        ticks all become the oldest (1). Returns whether it moved."""
        clock, limit = int(self.clock), self.clock_limit()
        if clock <= limit:
            return False
        try:
            values = torch.cat([self.clock.new_zeros(1), self.stamp.view(-1), self.page_last_used,
                                self.clock.view(1)])
            rank = torch.unique(values, sorted=True, return_inverse=True)[1]
        except torch.OutOfMemoryError:
            off = clock - limit // 2
            self.stamp.copy_(torch.where(self.stamp > 0, (self.stamp - off).clamp(min=1), 0))
            self.page_last_used.sub_(off).clamp_(min=0)
            self.clock.sub_(off)
            return True
        n = self.stamp.numel()
        self.stamp.copy_(rank[1:n + 1].view_as(self.stamp))
        self.page_last_used.copy_(rank[n + 1:-1])
        self.clock.copy_(rank[-1])
        return True

    def save(self, path):
        """Write the pool to `path` atomically: a reader (or a crash mid-write) never sees half
        a file; the previous file stays until the new one is complete."""
        self.write_state(self.state_dict(), path)

    @staticmethod
    def write_state(sd: dict, path) -> None:
        """Write a state_dict() to `path` atomically (`save`; any thread: touches no device)."""
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                                   dir=os.path.dirname(os.path.abspath(path)))
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _remove_stale_temporaries(path)

    @staticmethod
    def read_state(path, mmap: bool = False) -> dict:
        """The state saved in a pool file, checked; raises PoolFileError saying what is wrong
        (unreadable or truncated, a key missing, shapes that do not fit together).
        mmap=True maps the tensors instead of reading them (a cheap check at start-up)."""
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
            raise PoolFileError(f"cannot be read as a saved phrase pool (truncated, corrupt or "
                                f"not written by vllm-ouroboros): {type(e).__name__}: {e}") from e
        if not isinstance(sd, dict):
            raise PoolFileError(f"holds a {type(sd).__name__}, not a saved phrase pool")
        missing = [k for k in _BUFFERS + _SCALARS if k not in sd]
        if missing:
            raise PoolFileError(f"is not a complete saved phrase pool: missing {', '.join(missing)}")
        V, L, W = sd["vocab_size"], sd["phrase_len"], sd["phrases_per_key"]
        if not all(isinstance(x, int) and x >= 1 for x in (V, L, W)):
            raise PoolFileError(f"has vocab_size={V!r}, phrase_len={L!r}, phrases_per_key={W!r}")
        P = sd["page_key"].shape[0] if torch.is_tensor(sd["page_key"]) else -1
        want = {"key_to_page": (V,), "page_key": (P,), "page_last_used": (P,),
                "tokens": (P, W, L), "stamp": (P, W), "owner": (P, W), "counters": (len(_STATS),)}
        for name, shape in want.items():
            t = sd[name]
            if not torch.is_tensor(t) or tuple(t.shape) != shape:
                got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
                raise PoolFileError(f"has {name} of shape {got}, expected {shape}")
        if P and (int(sd["page_key"].min()) < -1 or int(sd["page_key"].max()) >= V):
            raise PoolFileError(f"has page keys outside the vocabulary [0, {V})")
        held = sd["page_key"][sd["page_key"] >= 0]
        if held.unique().numel() != held.numel():
            # The pool never writes one; loaded, a key's page table would point into another
            # key's page after the next eviction of either.
            raise PoolFileError("has a key on more than one page")
        return sd

    @classmethod
    def load(cls, path, device="cpu", budget_bytes: Optional[int] = None,
             shared: Optional[bool] = None, kernels: str = "auto",
             phrases_per_key: Optional[int] = None) -> "PhrasePool":
        """A pool with the saved config and pages; budget, sharing mode and phrases per key (the
        window size: pages re-cut, each key's newest phrases kept) may be overridden.
        Raises PoolFileError for a file that is not a complete saved pool."""
        sd = cls.read_state(path)
        pool = cls(sd["vocab_size"], sd["phrase_len"],
                   sd["phrases_per_key"] if phrases_per_key is None else phrases_per_key,
                   sd["budget_bytes"] if budget_bytes is None else budget_bytes, device=device,
                   shared=sd["shared"] if shared is None else shared, kernels=kernels)
        pool.load_state_dict(sd)
        # The phrases belong to nobody (owner -1, as `release` leaves a finished request's in a
        # shared pool): the saved owners were the saving engine's slots, whose numbers this
        # engine's requests reuse. The counters start at 0: the stats are this pool's.
        pool.owner.fill_(-1)
        pool.counters.zero_()
        return pool


STALE_TEMPORARY_S = 3600.0


def _remove_stale_temporaries(path: str) -> None:
    """Remove the temporary files of saves to `path` that were killed mid-write (vLLM SIGKILLs
    an engine that takes over 5 s to stop: a large pool on slow storage), a pool-sized file
    each. Only those older than STALE_TEMPORARY_S: another engine (data parallelism) may be
    writing its own now."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = os.path.basename(path) + "."
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name.startswith(prefix) and entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if now - entry.stat().st_mtime > STALE_TEMPORARY_S:
                        os.unlink(entry.path)
