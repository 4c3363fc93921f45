"""Page allocator with reference counts: plain Python/numpy bookkeeping, no tensors.

A page's reference count is the number of live cache nodes that hold at least one of
its slots; a page returns to the free list when its count drops to zero. Every public
method checks its whole input before changing anything, so a failed call leaves the
allocator as it was.

The counts live in an ``array('q')`` that ``refcounts`` views as numpy without a copy:
the cache's per-step updates touch one or two pages, and Python ints index an array
faster than numpy scalars do. :meth:`take`, :meth:`share` and
:meth:`drop` are the unchecked forms the cache calls with pages it holds.
"""

from __future__ import annotations

from array import array
from collections import Counter

import numpy as np

from ..checks import int_at_least, positive_int

__all__ = ["CacheFullError", "PageAllocator"]

_I = np.int64


class CacheFullError(RuntimeError):
    """Not enough free pages; nothing was changed, so the caller can prune and retry.

    With ``total`` (the pool's page count) smaller than ``needed``, pruning cannot help and
    the message says that the pool is too small instead.
    """

    def __init__(self, needed: int, free: int, total: int | None = None) -> None:
        if total is not None and needed > total:
            hint = f"the whole pool has {total} pages; use a larger pool (num_pages)"
        else:
            hint = "prune finished nodes and retry"
        super().__init__(f"KV cache is full: needed {needed} free pages, {free} free; {hint}")
        self.needed, self.free, self.total = needed, free, total


class PageAllocator:
    """Free list and per-page user counts for ``num_pages`` pages.

    The free list is a LIFO stack (a list whose top is the end), so recently freed
    pages, likely still in cache, are reused first. ``users[p]`` is page ``p``'s count
    (``array('q')``, read-only for callers).
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages = positive_int(num_pages, "num_pages")
        self.users = array("q", bytes(8 * num_pages))
        self._refcount = np.frombuffer(self.users, _I)  # the same memory, as numpy
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def refcounts(self) -> np.ndarray:
        """``[num_pages]`` users of each page (read-only view; 0 means free)."""
        view = self._refcount.view()
        view.setflags(write=False)
        return view

    def refcount(self, page: int) -> int:
        """Users of one ``page``."""
        return self.users[page]

    def free_pages(self) -> np.ndarray:
        """``[num_free]`` the free pages; :meth:`alloc` takes them from the end."""
        return np.array(self._free, _I)

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free pages, each with one user; ``[n]`` int64 page ids.

        Raises :class:`CacheFullError` (and changes nothing) when fewer than ``n`` are free.
        """
        return np.array(self.take(int_at_least(n, "n", 0)), _I)

    def incref(self, pages: np.ndarray) -> None:
        """Add one user to each entry of ``pages`` (repeats add several); all must be in use."""
        pages = self._check(pages, "pages")
        if pages.size and (self._refcount[pages] == 0).any():
            bad = int(pages[np.argmax(self._refcount[pages] == 0)])
            raise ValueError(f"pages: expected pages in use, got free page {bad}")
        self.share(pages.tolist())

    def decref(self, pages: np.ndarray) -> np.ndarray:
        """Remove one user per entry of ``pages``; returns ``[m]`` the pages that became free.

        Raises ``ValueError`` (and changes nothing) if a page would drop below zero users.
        """
        return np.array(self.drop(self._check(pages, "pages").tolist()), _I)

    def take(self, n: int) -> list[int]:
        """:meth:`alloc` for a known ``int`` ``n >= 0``: the pages as a list."""
        free = self._free
        if n > len(free):
            raise CacheFullError(n, len(free), self.num_pages)
        if not n:
            return []
        pages = free[-n:][::-1]
        del free[-n:]
        users = self.users
        for p in pages:
            users[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add one user per entry of ``pages``, pages known to be in use."""
        users = self.users
        for p in pages:
            users[p] += 1

    def share_many(self, pages: np.ndarray) -> None:
        """:meth:`share` for an int64 array of many pages, in one numpy pass."""
        np.add.at(self._refcount, pages, 1)

    def drop(self, pages: list[int]) -> list[int]:
        """:meth:`decref` for valid page ids: the pages that became free, ascending."""
        users = self.users
        counts = Counter(pages)
        bad = [p for p, c in counts.items() if users[p] < c]
        if bad:
            p = min(bad)
            raise ValueError(f"pages: page {p} has {users[p]} users, got {counts[p]} releases "
                             "(a double free)")
        freed = []
        for p, c in counts.items():
            users[p] -= c
            if not users[p]:
                freed.append(p)
        freed.sort()
        self._free += freed[::-1]
        return freed

    def _check(self, pages: np.ndarray, name: str) -> np.ndarray:
        pages = np.asarray(pages, dtype=_I).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            bad = int(pages[np.argmax((pages < 0) | (pages >= self.num_pages))])
            raise ValueError(f"{name}: expected page ids in [0, {self.num_pages}), got {bad}")
        return pages
