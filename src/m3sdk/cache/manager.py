"""CacheManager: the seam that owns pages; PagedCacheManager: the default (ref-counted pages + prefix cache).

Per request it keeps a block table (logical page -> physical page) and the chained hashes of the request's
full pages. The KV tensors themselves (K, V, FP8 scales, index keys: Contract 1) live in `self.kv`, created
here from a KVCacheSpec whose page count comes from a byte budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.cache.page_pool import PAGE_SIZE, PagePool, pages_for
from m3sdk.cache.prefix_cache import ROOT_HASH, PrefixCache, page_hash

if TYPE_CHECKING:
    from m3sdk.request import Request

# Without a device to measure, the KV cache of a CPU engine gets this many bytes unless told otherwise.
DEFAULT_CPU_CACHE_BYTES = 1 << 30


class CacheManager(Protocol):
    """Pages for requests. Every method is called from the engine thread only."""

    kv: KVPool
    num_pages: int

    def match_prefix(self, request: Request) -> list[int]:
        """Cached pages holding a prefix of the request's tokens (read only: nothing is taken yet); none for a
        request that needs its prompt logprobs (its prefill computes every prompt position)."""

    def allocate(self, request: Request, num_new_tokens: int, prefix_pages: Sequence[int] = ()) -> bool:
        """Hold pages for `num_computed_tokens + num_new_tokens` tokens (a new request first takes
        `prefix_pages`). False, with nothing changed, when not enough pages are free."""

    def commit(self, request: Request) -> None:
        """The step ran: full pages up to `num_computed_tokens` hold valid K/V and may be shared."""

    def free(self, request: Request) -> None:
        """Drop every page the request holds (finish, abort, preemption)."""

    def retain(self, request: Request) -> list[int]:
        """Hold the request's pages once more, past its `free`, until `release_pages` (I/O still reads or writes
        them); returns them."""

    def release_pages(self, pages: Sequence[int]) -> None:
        """Drop the hold `retain` took."""

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Drop the request's pages past the first `num_tokens` slots (speculative decoding's rejected drafts);
        those pages were never committed, so none is shared or cached."""

    def page_table(self, request: Request) -> list[int]:
        """Physical page of each logical page of the request. The list only grows (appends) while it is the
        request's: pages dropped (free, truncate) put a new list in its place, so whoever keeps the list may rely on
        the entries it has seen (the CUDA graphs upload only a list's new entries: graphs.DecodeGraphs)."""

    def num_free_pages(self) -> int: ...

    def stats(self) -> dict[str, int]: ...


class PagedCacheManager:
    def __init__(self, spec: KVCacheSpec, enable_prefix_caching: bool = True):
        self.kv = KVPool(spec)
        self.num_pages = spec.num_pages
        self.pool = PagePool(spec.num_pages)
        self.prefix = PrefixCache() if enable_prefix_caching else None
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_committed: dict[str, int] = {}  # leading pages already offered to the prefix cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found cached

    def num_free_pages(self) -> int:
        """Pages a request could take: free ones plus cached ones nobody holds."""
        return self.pool.num_free + (self.prefix.num_idle if self.prefix else 0)

    def page_table(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    def match_prefix(self, request: Request) -> list[int]:
        if self.prefix is None or request.request_id in self._tables or request.needs_prompt_logprobs:
            return []
        # At least the last token is computed again: its logits start the generation.
        hashes = self._page_hashes(request, (request.num_tokens - 1) // PAGE_SIZE)
        pages = []
        for h in hashes:
            page = self.prefix.lookup(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate(self, request: Request, num_new_tokens: int, prefix_pages: Sequence[int] = ()) -> bool:
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            table = []
            needed = pages_for(len(prefix_pages) * PAGE_SIZE + num_new_tokens) - len(prefix_pages)
            # Idle prefix pages count as free until we take them ourselves.
            idle_hits = sum(1 for p in prefix_pages if self.prefix.is_idle(p)) if prefix_pages else 0
            if needed > self.num_free_pages() - idle_hits:
                return False
            for page in prefix_pages:
                if self.pool.ref_counts[page] == 0:
                    self.prefix.unpark(page)
                self.pool.incref(page)
                table.append(page)
            self._tables[rid] = table
            self._num_committed[rid] = len(prefix_pages)
            if self.prefix is not None:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += len(prefix_pages) * PAGE_SIZE
        else:
            needed = pages_for(request.num_computed_tokens + num_new_tokens) - len(table)
            if needed > self.num_free_pages():
                return False
        for _ in range(needed):
            table.append(self._take_page())
        return True

    def commit(self, request: Request) -> None:
        if self.prefix is None:
            return
        rid = request.request_id
        table = self._tables[rid]
        full = request.num_computed_tokens // PAGE_SIZE
        hashes = self._page_hashes(request, full)
        for i in range(self._num_committed[rid], full):
            self.prefix.register(hashes[i], table[i])
        self._num_committed[rid] = full

    def free(self, request: Request) -> None:
        rid = request.request_id
        self._hashes.pop(rid, None)
        self._num_committed.pop(rid, None)
        self.release_pages(self._tables.pop(rid, []))

    def retain(self, request: Request) -> list[int]:
        pages = list(self.page_table(request))
        for page in pages:
            self.pool.incref(page)
        return pages

    def release_pages(self, pages: Sequence[int]) -> None:
        # Tail first: parked last-pages are evicted before the prefixes they depend on.
        unheld = self.pool.decref_all(reversed(pages))
        if self.prefix is not None:
            unheld = self.prefix.park_held(unheld)
        self.pool.release_all(unheld)

    def truncate(self, request: Request, num_tokens: int) -> None:
        table = self._tables.get(request.request_id)
        keep = pages_for(num_tokens)
        if table is None or len(table) <= keep:
            return
        self._tables[request.request_id] = table[:keep]  # a new list: the old one's entries stay as they were
        self.pool.release_all(self.pool.decref_all(reversed(table[keep:])))

    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.num_pages,
            "pages_free": self.num_free_pages(),
            "pages_cached": self.prefix.num_cached if self.prefix else 0,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
        }

    def _take_page(self) -> int:
        if self.pool.num_free == 0:
            self.pool.release(self.prefix.evict())
        return self.pool.take()

    def _page_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """Chained hashes of the request's first `num_pages` full pages, extended as it grows."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.token_ids
        for i in range(len(hashes), num_pages):
            lo, hi = i * PAGE_SIZE, (i + 1) * PAGE_SIZE
            content = b"".join(im.digest for im in request.images if im.offset < hi and im.offset + im.num_tokens > lo)
            hashes.append(page_hash(hashes[-1] if hashes else ROOT_HASH, tokens[lo:hi], content))
        return hashes


def cache_budget_bytes(kv_cache_memory: int | None, gpu_memory_fraction: float, device: torch.device) -> int:
    """Bytes for the KV cache: the explicit budget, else a fraction of the device's free memory (measured
    after the model is loaded), else on a CPU a fixed default."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * gpu_memory_fraction)
    return DEFAULT_CPU_CACHE_BYTES


def num_pages_for_budget(bytes_per_page: int, budget: int, max_useful_pages: int) -> int:
    """Pages that fit in `budget`, never more than the engine could ever hold at once."""
    return min(budget // bytes_per_page, max_useful_pages)
