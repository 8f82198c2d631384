"""Prefix cache: full pages found again by a chained hash of their tokens.

A page's hash covers its parent page's hash and its own 16 token ids, so equal hashes mean the same token
prefix, hence (at the same absolute positions) the same K, V and indexer keys in every layer: the forward
pass writes all three together, so reusing a page is exact for dense and MSA layers alike. Only full pages
whose K/V the forward pass has already written are registered (never a partial page, never a page of a step
that has not run yet). Unreferenced cached pages stay valid until evicted, least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

ROOT_HASH = b""


def page_hash(parent: bytes, token_ids: Sequence[int], content: bytes = b"") -> bytes:
    """Chained hash of one full page. 128-bit blake2b: a collision would silently serve wrong K/V. `content`: the
    digests of the images whose tokens the page holds (their token ids say nothing of the pixels)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes() + content, digest_size=16).digest()


class PrefixCache:
    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # Cached pages nobody holds, least recently used first: the eviction order.
        self._idle: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, h: bytes) -> int | None:
        return self._page_of.get(h)

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def register(self, h: bytes, page: int) -> None:
        """Remember `page` (fully written) under `h`, unless another page already holds that prefix."""
        if h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h

    def park_held(self, pages: Sequence[int]) -> list[int]:
        """`pages` lost their last holders: keep the cached ones, most recently used in the order given (the last
        parked is evicted last); returns the others."""
        cached = self._hash_of
        idle = self._idle
        others = []
        for page in pages:
            if page in cached:
                idle[page] = None
            else:
                others.append(page)
        return others

    def unpark(self, page: int) -> None:
        """A request took `page` again."""
        del self._idle[page]

    def evict(self) -> int:
        """Forget the least recently used idle page and hand it back for reuse."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        return page
