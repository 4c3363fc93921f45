"""Page allocator with reference counts: plain numpy bookkeeping, no tensors.

A page's reference count is the number of live cache nodes that hold at least one of
its slots; a page returns to the free list when its count drops to zero. Every method
checks its whole input before changing anything, so a failed call leaves the allocator
as it was.
"""

from __future__ import annotations

import numpy as np

from ..checks import int_at_least, positive_int

__all__ = ["CacheFullError", "PageAllocator"]


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

    The free list is a LIFO stack (``[num_pages]`` int64), so recently freed pages,
    likely still in cache, are reused first.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages = positive_int(num_pages, "num_pages")
        self._refcount = np.zeros(num_pages, np.int64)
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)  # top is the end
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    @property
    def refcounts(self) -> np.ndarray:
        """``[num_pages]`` users of each page (read-only view; 0 means free)."""
        view = self._refcount.view()
        view.setflags(write=False)
        return view

    def refcount(self, page: int) -> int:
        """Users of one ``page``."""
        return int(self._refcount[page])

    def free_pages(self) -> np.ndarray:
        """``[num_free]`` the free pages; :meth:`alloc` takes them from the end."""
        return self._free[: self._num_free].copy()

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free pages, each with one user; ``[n]`` int64 page ids.

        Raises :class:`CacheFullError` (and changes nothing) when fewer than ``n`` are free.
        """
        n = int_at_least(n, "n", 0)
        if n > self._num_free:
            raise CacheFullError(n, self._num_free, self.num_pages)
        top = self._num_free
        pages = self._free[top - n : top][::-1].copy()
        self._num_free = top - n
        self._refcount[pages] = 1
        return pages

    def incref(self, pages: np.ndarray) -> None:
        """Add one user to each entry of ``pages`` (repeats add several); all must be in use."""
        pages = self._check(pages, "pages")
        if pages.size and (self._refcount[pages] == 0).any():
            bad = int(pages[np.argmax(self._refcount[pages] == 0)])
            raise ValueError(f"pages: expected pages in use, got free page {bad}")
        np.add.at(self._refcount, pages, 1)

    def decref(self, pages: np.ndarray) -> np.ndarray:
        """Remove one user per entry of ``pages``; returns ``[m]`` the pages that became free.

        Raises ``ValueError`` (and changes nothing) if a page would drop below zero users.
        """
        pages = self._check(pages, "pages")
        if pages.size == 0:
            return pages
        uniq, counts = np.unique(pages, return_counts=True)
        left = self._refcount[uniq] - counts
        if (left < 0).any():
            i = int(np.argmax(left < 0))
            raise ValueError(
                f"pages: page {int(uniq[i])} has {int(self._refcount[uniq[i]])} users, "
                f"got {int(counts[i])} releases (a double free)"
            )
        self._refcount[uniq] = left
        freed = uniq[left == 0]
        top = self._num_free
        self._free[top : top + freed.size] = freed[::-1]
        self._num_free = top + freed.size
        return freed

    def _check(self, pages: np.ndarray, name: str) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            bad = int(pages[np.argmax((pages < 0) | (pages >= self.num_pages))])
            raise ValueError(f"{name}: expected page ids in [0, {self.num_pages}), got {bad}")
        return pages
