"""Page allocator with reference counts: plain Python/numpy bookkeeping, no tensors.

A page's reference count is the number of live cache nodes that hold at least one of
its slots; a page returns to the free list when its count drops to zero. Every public
method checks its whole input before changing anything, so a failed call leaves the
allocator as it was.

A take of :data:`RUN_PAGES` or more pages (a prompt, a draft tree) gets consecutive free
pages where there are enough in a row: the free list's top when it is such a run, else the
smallest run that holds it (best fit keeps the long runs for long takes). Its slots are then
consecutive, and the attention kernel loads such tiles by TMA instead of gathering them
(``tools/gather_cost.py``: gathered tiles cost graph-safe steps 4-22% more on an H100).
Smaller takes pop the free list. The entries a run take leaves on the list are skipped when
popped, so the list may hold more entries than there are free pages.

A node that will grow on (a prompt fed in chunks, then its decode tokens) takes as an
*owner*: its first take of a long expected growth gets the start of a run that holds all of
it and *claims* the rest of that run, and its later takes continue into the claim. Claimed
pages stay free (counted in :attr:`num_free`), but other takes pass them by while other pages
are free; claims are given up when their owner is done (:meth:`release_claim`), and when other
takes need the pages, those at the ends of the oldest claims (each owner keeps the pages right
after its own). So the K/V of prompts prefilled together, in chunks taken in turns, each lie in
one run of slots rather than one per chunk.

The counts live in an ``array('q')`` that ``refcounts`` views as numpy without a copy:
the cache's per-step updates touch one or two pages, and Python ints index an array
faster than numpy scalars do. :meth:`take`, :meth:`share` and
:meth:`drop` are the unchecked forms the cache calls with pages it holds.

A holder of cached nodes (the server's prefix cache) may :meth:`park` the users of nodes
that no running request reads; :attr:`num_parked` then counts, in O(1) as pages are
shared and dropped, the pages whose every user is parked: what only that cache holds.
"""

from __future__ import annotations

from array import array
from collections import Counter

import numpy as np

from ..checks import int_at_least, positive_int

__all__ = ["CacheFullError", "PageAllocator", "RUN_PAGES"]

_I = np.int64
RUN_PAGES = 4  # takes of at least this many pages look for a run of consecutive free pages


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
    pages, likely still in cache, are reused first; entries of pages in use (left by run
    takes) or repeated are skipped when popped and dropped when the list is rebuilt.
    ``run_pages`` (default :data:`RUN_PAGES`) is the smallest take, or owner's expected
    extent, that looks for a run; above ``num_pages`` every take pops (no claims either), as
    ``tools/slot_runs.py`` compares. ``users[p]`` is
    page ``p``'s count (``array('q')``, read-only for callers); ``_parked[p]`` how many of
    them are parked.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages = positive_int(num_pages, "num_pages")
        self.users = array("q", bytes(8 * num_pages))
        self._refcount = np.frombuffer(self.users, _I)  # the same memory, as numpy
        self._free = list(range(num_pages - 1, -1, -1))
        self._num_free = num_pages
        self.run_pages = RUN_PAGES  # takes of this many pages or more look for a run
        self._parked = array("q", bytes(8 * num_pages))
        self._parked_np = np.frombuffer(self._parked, _I)
        self._num_parked = 0  # pages in use whose every user is parked
        self._marks = 0  # parked users of all pages: none, and the hot paths skip the checks
        self._owner = array("q", [-1]) * num_pages  # the owner that claims each free page, or -1
        self._owner_np = np.frombuffer(self._owner, _I)
        self._claims: dict[int, tuple[int, int]] = {}  # owner -> its claimed pages [lo, hi)
        self._num_claimed = 0
        # At least the longest run of free unclaimed pages (None: unknown): takes and claims
        # only shorten it, so a run search that cannot succeed is skipped until pages are
        # freed or unclaimed.
        self._longest: int | None = None

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    @property
    def num_claimed(self) -> int:
        """Free pages claimed by an owner (see :meth:`take`); other takes use them last."""
        return self._num_claimed

    @property
    def num_parked(self) -> int:
        """Pages in use whose every user is parked (see :meth:`park`), kept up to date in O(1)."""
        return self._num_parked

    @property
    def refcounts(self) -> np.ndarray:
        """``[num_pages]`` users of each page (read-only view; 0 means free)."""
        view = self._refcount.view()
        view.setflags(write=False)
        return view

    def free_pages(self) -> np.ndarray:
        """``[num_free]`` the free pages; :meth:`alloc` pops them from the end (a take of
        :data:`RUN_PAGES` or more takes a run of consecutive ones first, where there is one),
        claimed pages last (listed first)."""
        claimed = [p for lo, hi in self._claims.values() for p in range(lo, hi)]
        return np.array(claimed + self._listed(), _I)

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

    def take(self, n: int, after: int = -1, owner: int = -1, extent: int = 0) -> list[int]:
        """:meth:`alloc` for a known ``int`` ``n >= 0``: the pages as a list (ascending for a
        run).

        ``owner >= 0`` (a node's id) takes for a node that grows on, whose last page is
        ``after`` (``-1``: none yet) and which expects to need ``extent`` pages from here in
        all: the ``n`` pages after ``after`` where its claim starts there (the claim moves
        past them); else, with ``extent > n`` and at least ``run_pages``, the first ``n``
        pages of the smallest run of ``extent`` free unclaimed pages (where none is that
        long, of the longest run, if it holds ``n`` and ``run_pages``), the rest of which it
        claims (what it claimed before is given up). Otherwise as for no owner.
        """
        if n > self._num_free:
            raise CacheFullError(n, self._num_free, self.num_pages)
        if not n:
            return []
        pages = None
        if owner >= 0:
            pages = self._follow(after, n, owner)
            if pages is None:
                self.release_claim(owner)
                shortest = max(n, self.run_pages)
                if n < extent and self.run_pages <= extent and self.room_for_run(shortest):
                    pages = self._run(extent, shortest)
                    if pages is not None:
                        self._claim(owner, pages[0] + n, pages[-1] + 1)
                        pages = pages[:n]
        if pages is None:
            if n > self._num_free - self._num_claimed:
                self._release_claims_for(n)
            pages = self._run(n) if n >= self.run_pages and not self._run_on_top(n) else None
            if pages is None:
                pages = self._pop(n)
        users = self.users
        for p in pages:
            users[p] = 1
        self._num_free -= n
        self._bound_list()
        return pages

    def room_for_run(self, pages: int) -> bool:
        """Whether an owner expecting ``pages`` pages takes them as a run (at least
        ``run_pages``) and the free unclaimed pages are as many."""
        return self.run_pages <= pages <= self._num_free - self._num_claimed

    def release_claim(self, owner: int) -> None:
        """Give up the pages ``owner`` claims, if any (its node is done growing or gone):
        back on the free list."""
        claim = self._claims.get(owner)
        if claim is not None:
            self._unclaim(owner, claim[0])

    def _unclaim(self, owner: int, cut: int) -> None:
        """Give up ``owner``'s claimed pages from page ``cut`` on (all of them from its
        claim's first page): back on the free list."""
        lo, hi = self._claims[owner]
        if cut <= lo:
            cut = lo
            del self._claims[owner]
        else:
            self._claims[owner] = (lo, cut)
        self._owner_np[cut:hi] = -1
        self._num_claimed -= hi - cut
        self._free += range(hi - 1, cut - 1, -1)
        self._longest = None
        self._bound_list()

    def _bound_list(self) -> None:
        """Rebuild the free list once it holds more than twice the free pages + 64 entries."""
        if len(self._free) > 2 * self._num_free + 64:
            self._free = self._listed()

    def _claim(self, owner: int, lo: int, hi: int) -> None:
        """``owner`` claims the free pages ``[lo, hi)``, which no one claims."""
        if hi > lo:
            self._claims[owner] = (lo, hi)
            self._owner_np[lo:hi] = owner
            self._num_claimed += hi - lo

    def _follow(self, after: int, n: int, owner: int) -> list[int] | None:
        """The ``n`` pages after page ``after`` where ``owner``'s claim starts right there and
        holds them (or the pages past its end are free and unclaimed); the claim then moves
        past them. Else ``None``."""
        claim = self._claims.get(owner)
        if claim is None or claim[0] != after + 1:
            return None
        lo, end = claim
        hi = lo + n
        if hi > end:
            if hi > self.num_pages:
                return None
            users, own = self.users, self._owner
            if any(users[p] or own[p] >= 0 for p in range(end, hi)):
                return None
        mine = min(hi, end)  # its claimed pages it takes now
        self._owner_np[lo:mine] = -1
        self._num_claimed -= mine - lo
        if hi < end:
            self._claims[owner] = (hi, end)
        else:
            del self._claims[owner]
        return list(range(lo, hi))

    def _release_claims_for(self, n: int) -> None:
        """Give up claimed pages until ``n`` free pages are unclaimed: those at the ends of
        the oldest claims, so that every owner keeps the pages right after its own."""
        for owner in list(self._claims):
            short = n - (self._num_free - self._num_claimed)
            if short <= 0:
                return
            self._unclaim(owner, self._claims[owner][1] - short)

    def _pop(self, n: int) -> list[int]:
        """``n`` free pages from the free list's top, skipping entries of pages in use."""
        free = self._free
        if len(free) == self._num_free and not self._num_claimed:  # no stale or repeated entries
            pages = free[-n:][::-1]
            del free[-n:]
            return pages
        users, own, pages, seen = self.users, self._owner, [], set()
        while len(pages) < n:
            p = free.pop()  # a claimed page's entry goes: its claim's release lists it again
            if not users[p] and own[p] < 0 and p not in seen:
                seen.add(p)
                pages.append(p)
        return pages

    def _run_on_top(self, n: int) -> bool:
        """Whether the free list's top ``n`` entries are consecutive free pages, as a fresh
        pool's are and a released draft tree's are for the next: popped, they are a run,
        found without scanning the counts."""
        free, users, own = self._free, self.users, self._owner
        top = free[-1]
        return (free[-n:] == list(range(top + n - 1, top - 1, -1))
                and not any(users[p] or own[p] >= 0 for p in range(top, top + n)))

    def _run(self, n: int, shortest: int | None = None) -> list[int] | None:
        """The first ``n`` pages of the smallest run of consecutive free unclaimed pages that
        holds ``n`` (the lowest such run); where none does, with ``shortest``, the whole
        longest run if it holds ``shortest`` pages; else ``None``. One numpy pass over the
        counts, skipped where the longest run known is too short."""
        least = n if shortest is None else min(n, shortest)  # what any run it returns holds
        if self._longest is not None and self._longest < least:
            return None
        free = self._refcount == 0
        if self._num_claimed:
            free &= self._owner_np < 0
        edges = np.flatnonzero(np.diff(free, prepend=False, append=False))
        starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
        self._longest = int(lengths.max()) if lengths.size else 0
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            start = int(starts[fits[np.argmin(lengths[fits])]])
            return list(range(start, start + n))
        if shortest is None or not lengths.size or lengths.max() < shortest:
            return None
        longest = int(np.argmax(lengths))
        return list(range(int(starts[longest]), int(starts[longest] + lengths[longest])))

    def _listed(self) -> list[int]:
        """The free list without entries of pages in use, claimed or repeated (the top's
        kept)."""
        users, own, seen, kept = self.users, self._owner, set(), []
        for p in reversed(self._free):
            if not users[p] and own[p] < 0 and p not in seen:
                seen.add(p)
                kept.append(p)
        return kept[::-1]

    def share(self, pages: list[int]) -> None:
        """Add one user per entry of ``pages``, pages known to be in use."""
        users = self.users
        if self._marks:
            parked = self._parked
            for p in pages:
                if parked[p] and users[p] == parked[p]:  # a parked page gains a user that is not
                    self._num_parked -= 1
                users[p] += 1
            return
        for p in pages:
            users[p] += 1

    def share_many(self, pages: np.ndarray) -> None:
        """:meth:`share` for an int64 array of many pages, in one numpy pass."""
        if self._marks:
            u = np.unique(pages)
            parked = self._parked_np[u]
            self._num_parked -= int(np.count_nonzero((parked > 0) & (self._refcount[u] == parked)))
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
        parked = self._parked
        if self._marks:
            bad = [p for p, c in counts.items() if users[p] - c < parked[p]]
            if bad:
                p = min(bad)
                raise ValueError(f"pages: page {p} has {users[p]} users, {parked[p]} of them parked, "
                                 f"got {counts[p]} releases (unpark a node's pages before releasing it)")
        freed = []
        for p, c in counts.items():
            users[p] -= c
            if not users[p]:
                freed.append(p)
            elif users[p] == parked[p]:  # its last user that is not parked went
                self._num_parked += 1
        freed.sort()
        self._free += freed[::-1]
        self._num_free += len(freed)
        if freed:
            self._longest = None
        return freed

    def park(self, pages: list[int]) -> None:
        """Mark one user of each entry of ``pages`` parked: kept, read by no running request.

        ``pages`` are the pages of nodes that the caller keeps for later (a page once per
        node that touches it); it :meth:`unpark` s them before the nodes grow, split or go.
        Raises ``ValueError`` (and changes nothing) for a page with no unparked user left.
        """
        users, parked = self.users, self._parked
        counts = Counter(self._check(np.asarray(pages), "pages").tolist())
        bad = [p for p, c in counts.items() if parked[p] + c > users[p]]
        if bad:
            p = min(bad)
            raise ValueError(f"pages: page {p} has {users[p]} users, {parked[p]} of them parked, "
                             f"got {counts[p]} more to park")
        for p, c in counts.items():
            parked[p] += c
            if parked[p] == users[p]:
                self._num_parked += 1
        self._marks += sum(counts.values())

    def unpark(self, pages: list[int]) -> None:
        """Undo :meth:`park` of ``pages`` (a node read again, or about to change).

        Raises ``ValueError`` (and changes nothing) for a page with fewer parked users.
        """
        users, parked = self.users, self._parked
        counts = Counter(self._check(np.asarray(pages), "pages").tolist())
        bad = [p for p, c in counts.items() if parked[p] < c]
        if bad:
            p = min(bad)
            raise ValueError(f"pages: page {p} has {parked[p]} parked users, got {counts[p]} to unpark")
        for p, c in counts.items():
            if parked[p] == users[p]:
                self._num_parked -= 1
            parked[p] -= c
        self._marks -= sum(counts.values())

    def num_parked_with(self, pages: list[int]) -> int:
        """How many pages :attr:`num_parked` would count more were one user of each entry of
        ``pages`` (pages in use, a page once per user) parked too: the pages those users
        share with parked users only. O(len(pages))."""
        users, parked = self.users, self._parked
        return sum(users[p] == parked[p] + c for p, c in Counter(pages).items())

    def _check(self, pages: np.ndarray, name: str) -> np.ndarray:
        pages = np.asarray(pages, dtype=_I).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            bad = int(pages[np.argmax((pages < 0) | (pages >= self.num_pages))])
            raise ValueError(f"{name}: expected page ids in [0, {self.num_pages}), got {bad}")
        return pages
