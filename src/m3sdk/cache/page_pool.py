"""PagePool: which physical pages are free and how many requests hold each one.

A page is 16 token slots (Contract 1). A page with a reference count of 0 is either free or parked in the
prefix cache (still holding valid K/V and index keys, evictable); the pool only tracks the free ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from m3sdk_kernels.layout import PAGE_SIZE


def pages_for(num_tokens: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // PAGE_SIZE)


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free page, now held once. The caller checked that one is free."""
        page = self._free.popleft()
        self.ref_counts[page] = 1
        return page

    def incref(self, page: int) -> None:
        self.ref_counts[page] += 1

    def decref_all(self, pages: Iterable[int]) -> list[int]:
        """Drop one holder of each of `pages` (distinct); returns those left with none, in the order given: the
        caller frees or parks them. One loop without calls: a million-token request returns 65,000 pages."""
        counts = self.ref_counts
        unheld = []
        for page in pages:
            count = counts[page] - 1
            if count < 0:
                raise RuntimeError(f"page {page} released more often than taken")
            counts[page] = count
            if count == 0:
                unheld.append(page)
        return unheld

    def release(self, page: int) -> None:
        """Return an unreferenced page to the free list."""
        assert self.ref_counts[page] == 0, f"page {page} still held"
        self._free.append(page)

    def release_all(self, pages: Iterable[int]) -> None:
        """Return pages that `decref_all` left with no holder to the free list, in order."""
        self._free.extend(pages)
