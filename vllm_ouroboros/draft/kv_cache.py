"""The draft model's KV cache: fixed-size pages shared by every sequence (request slot).

A dense cache (one region of max_len tokens per slot) grows every slot whenever one request
gets long, and copies all of them to do it. Here a sequence holds only the pages its own length
needs, as vLLM's target cache does:

  k, v         [num_layers, num_pages, page_size, Hkv, D]: vLLM's block layout, which the
               tree-attention kernel reads (kernels/tree_attention.py) with a block table;
  block_table  [num_seqs, max_pages] int32 on the device: token t of sequence s is row
               t % page_size of page block_table[s, t // page_size].

Page 0 is never handed out: every unassigned table entry points at it, so a read past a
sequence's pages (a masked column of the dense attention path) stays in bounds and finite.
Callers reserve every token a row commits; what a forward writes past a row's pages (the
padding columns of a ragged batch, the rows that pad a fixed-shape batch in
draft/device_round.py) lands on page 0: finite values that only masked columns and padding,
whose outputs nobody reads, ever see. Pages are assigned on
the host (`reserve`, lowest free page first, so the assignment depends only on the calls) and
go back when the sequence ends (`release`); the table rows that change are copied to the device
with the reserve, so a CUDA graph that reads the table sees them at its next replay. Where the
free pages do not suffice the page store grows, all or nothing: a new store is allocated before
the old one is copied and dropped, and a failure (device memory, or the byte limit) raises
DraftCacheFull with nothing changed. No vLLM imports.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ouroboros.host_copy import to_device

PAGE_SIZE = 16  # tokens per page (vLLM's default block size)
NULL_PAGE = 0


class DraftCacheFull(RuntimeError):
    """The draft's KV cache could not take the pages asked for (device memory, or its
    draft_cache_max_mb budget): nothing changed, and the rows that fit (`fits`) can still run."""


def pages_for(tokens, page_size: int = PAGE_SIZE):
    """Pages that hold `tokens` tokens (int or int64 array)."""
    return -(-np.asarray(tokens, np.int64) // page_size) if np.ndim(tokens) else -(-int(tokens) // page_size)


def _allocation_failed(e: RuntimeError) -> bool:
    """An allocator's refusal: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError
    ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return "can't allocate memory" in text or "out of memory" in text.lower()


class PagedKVCache:
    """Pages, the block table and the free page map of the draft's KV cache (module docstring).

    num_seqs: block table rows (sequences addressable); max_seq_len: most tokens one sequence
    can hold (rounded up to whole pages); num_pages: the page store, page 0 (the null page)
    included; limit_bytes: the most the k and v stores may take together (None: unbounded).
    """

    @torch.inference_mode()
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, num_seqs: int, max_seq_len: int, num_pages: int,
                 page_size: int = PAGE_SIZE, limit_bytes: int | None = None):
        if num_pages < 2:
            raise ValueError(f"a paged cache needs the null page and at least one more, got {num_pages}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.limit_bytes = limit_bytes
        self._page_shape = (page_size, num_kv_heads, head_dim)
        self.num_layers, self.dtype = num_layers, dtype
        # Bumped whenever k, v or block_table are reallocated: CUDA graphs hold their addresses.
        self.generation = 0
        if limit_bytes is not None and self.bytes_for(num_pages) > limit_bytes:
            raise DraftCacheFull(f"{num_pages} pages ({self.bytes_for(num_pages) / 2**20:.1f} MiB) "
                                 f"over the limit of {limit_bytes / 2**20:g} MiB")
        self.k, self.v = self._new_store(num_pages)
        self.free = np.ones(num_pages, bool)
        self.free[NULL_PAGE] = False
        self.held = np.zeros(0, np.int64)  # [num_seqs] pages each sequence holds
        self.table = np.zeros((0, 0), np.int32)  # host copy of block_table
        self.block_table = torch.zeros(0, 0, dtype=torch.int32, device=self.device)
        self.resize(num_seqs, max_seq_len)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def num_seqs(self) -> int:
        return self.table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]

    @property
    def max_seq_len(self) -> int:
        """Most tokens one sequence can address (whole pages)."""
        return self.max_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return int(self.free.sum())

    @property
    def bytes(self) -> int:
        """Device bytes of the k and v stores."""
        return self.bytes_for(self.num_pages)

    def bytes_for(self, num_pages: int) -> int:
        """Bytes of the k and v stores at num_pages pages."""
        per_page = int(np.prod(self._page_shape)) * self.num_layers * self.dtype.itemsize
        return 2 * num_pages * per_page

    def stats(self) -> dict:
        """Gauges for metrics: memory_bytes, pages (null page excluded), pages_used."""
        return {"memory_bytes": self.bytes, "pages": self.num_pages - 1,
                "pages_used": int(self.held.sum())}

    # ---- sequences ---------------------------------------------------------------------------
    @torch.inference_mode()
    def resize(self, num_seqs: int, max_seq_len: int) -> None:
        """At least num_seqs sequences of max_seq_len tokens in the block table (it never
        shrinks; the pages held stay). Reallocates the device table when it grows."""
        rows = max(num_seqs, self.num_seqs)
        cols = max(pages_for(max_seq_len, self.page_size), self.max_pages)
        if (rows, cols) == self.table.shape:
            return
        table = np.full((rows, cols), NULL_PAGE, np.int32)
        table[: self.num_seqs, : self.max_pages] = self.table
        self.table = table
        self.held = np.concatenate([self.held, np.zeros(rows - len(self.held), np.int64)])
        self.block_table = torch.from_numpy(table).to(self.device)
        self.generation += 1

    def _extra(self, seqs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        seqs = np.asarray(seqs, np.int64)
        need = pages_for(np.minimum(np.asarray(lengths, np.int64), self.max_seq_len), self.page_size)
        have = np.zeros(len(seqs), np.int64)
        known = seqs < self.num_seqs  # a row past the table holds nothing yet
        have[known] = self.held[seqs[known]]
        return np.maximum(need - have, 0)

    def fits(self, seqs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Which rows could hold `lengths` tokens together with the pages free now (no
        growing): bool [B]. The rows needing the fewest new pages first, so the most rows fit."""
        extra = self._extra(seqs, lengths)
        order = np.argsort(extra, kind="stable")
        out = np.zeros(len(extra), bool)
        out[order] = np.cumsum(extra[order]) <= self.free_pages
        return out

    @torch.inference_mode()
    def reserve(self, seqs: np.ndarray, lengths: np.ndarray) -> None:
        """Give each sequence seqs[b] pages for its first lengths[b] tokens (at most
        max_seq_len), growing the page store where the free pages are short, and the block
        table where a sequence is past its rows. All or nothing: DraftCacheFull leaves every
        page and table entry as it was.

        Shape: seqs [B] int64, distinct; lengths [B] int64 (tokens)."""
        seqs = np.asarray(seqs, np.int64)
        extra = self._extra(seqs, lengths)
        total = int(extra.sum())
        if total == 0:
            return
        short = total - self.free_pages
        if short > 0:
            self._grow(self.num_pages + short)  # the one step that may fail: first
        self.resize(int(seqs.max()) + 1, self.max_seq_len)
        pages = np.flatnonzero(self.free)[:total]
        grow = extra > 0
        s, e = seqs[grow], extra[grow]
        rows = np.repeat(s, e)
        first = np.repeat(np.cumsum(e) - e, e)
        cols = np.repeat(self.held[s], e) + np.arange(total) - first
        self.table[rows, cols] = pages
        self.free[pages] = False
        self.held[s] += e
        self._upload(s)

    @torch.inference_mode()
    def release(self, seqs) -> None:
        """The sequences ended: their pages go back to the free map, their rows to the null page."""
        seqs = np.asarray(seqs, np.int64).reshape(-1)
        seqs = seqs[seqs < self.num_seqs]
        seqs = seqs[self.held[seqs] > 0]
        if len(seqs) == 0:
            return
        owned = np.arange(self.max_pages)[None, :] < self.held[seqs, None]
        self.free[self.table[seqs][owned]] = True
        self.table[seqs] = NULL_PAGE
        self.held[seqs] = 0
        self._upload(seqs)

    def _upload(self, seqs: np.ndarray) -> None:
        # The changed rows, copied in stream order (host_copy): queued forwards that read the
        # table run first, later ones (graph replays too) see the new rows.
        rows, idx = to_device(self.device, self.table[seqs], seqs.astype(np.int64, copy=False))
        self.block_table[idx] = rows

    # ---- the page store ----------------------------------------------------------------------
    def _new_store(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Zeroed: a never-written row is finite (masked columns still enter softmax @ V).
        # Both before either is kept: an allocation that fails leaves the cache as it was.
        shape = (self.num_layers, num_pages, *self._page_shape)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        try:
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except BaseException:
            k = None  # noqa: F841 (the traceback keeps this frame: the smaller store tried next needs the room)
            raise
        return k, v

    @torch.inference_mode()
    def _grow(self, at_least: int) -> None:
        """A store of at least `at_least` pages (doubling where the limit and the device allow:
        growing copies the store), its content kept. Raises DraftCacheFull with nothing changed."""
        limit = self.limit_bytes
        if limit is not None and self.bytes_for(at_least) > limit:
            raise DraftCacheFull(f"{at_least} pages of {self.page_size} tokens "
                                 f"({self.bytes_for(at_least) / 2**20:.1f} MiB, over "
                                 f"draft_cache_max_mb = {limit / 2**20:g})")
        want = max(at_least, 2 * self.num_pages)
        if limit is not None:
            want = max(at_least, min(want, limit // self.bytes_for(1)))
        for size in dict.fromkeys((want, at_least)):  # the doubling, else only what was asked
            try:
                k, v = self._new_store(size)
                break
            except RuntimeError as e:  # torch.OutOfMemoryError is one
                if not _allocation_failed(e):
                    raise
                # The message only: the exception's traceback would hold the failed store's
                # frames (and what they allocated) while the smaller one is tried.
                error = (str(e).splitlines() or [""])[0][:200]
        else:
            raise DraftCacheFull(f"{at_least} pages of {self.page_size} tokens "
                                 f"({self.bytes_for(at_least) / 2**20:.1f} MiB): {error}")
        old = self.num_pages
        k[:, :old].copy_(self.k)
        v[:, :old].copy_(self.v)
        self.k, self.v = k, v
        self.free = np.concatenate([self.free, np.ones(size - old, bool)])
        self.generation += 1
