"""Which slots the nodes of a tree cache hold: pages handed out slot by slot.

Plain numpy bookkeeping, no tensors. A page is handed out through its fill pointer
``fill[p]`` (slots ``[0, fill[p])`` were handed out), so several nodes share one partly
filled page without copying, and a node counts as one user of every page its slots
touch (the :class:`PageAllocator`'s reference counts):

* A node's next tokens go into the free tail of the page of its own last slot, then
  into fresh pages (its *target page*).
* A node without tokens (just forked) starts in its parent's *group page*: the
  parent's last page at first, later the fresh page the latest sibling opened, so
  siblings with few tokens (draft tokens) pack densely.
* Releasing nodes marks their slots dead and rewinds each touched page's fill pointer
  to just past its last live slot; a page is freed when its last user goes.

The tree itself (parents, children, layouts) is :class:`~deft.cache.TreeKVCache`'s.
"""

from __future__ import annotations

import numpy as np

from ..checks import positive_int
from .node import EMPTY, Node, concat
from .pages import CacheFullError, PageAllocator

__all__ = ["SlotAllocator"]

_I = np.int64


class SlotAllocator:
    """The slots of ``num_pages`` pages of ``page_size``, handed out to :class:`Node` s.

    ``fill [num_pages]``: slots handed out per page; ``live [num_pages * page_size]``:
    slots held by a live node; ``allocator``: the pages' free list and user counts. Every
    method checks free pages before changing anything (:class:`CacheFullError`).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = positive_int(page_size, "page_size")
        self.allocator = PageAllocator(num_pages)
        self.num_pages = self.allocator.num_pages
        self.fill = np.zeros(self.num_pages, _I)
        self.live = np.zeros(self.num_pages * self.page_size, bool)

    # ---------------------------------------------------------- handing out

    def new_slots(self, k: int) -> tuple[np.ndarray, list[int]]:
        """``k`` slots in fresh pages (a new root); returns them and their pages."""
        slots, _, fresh = self._take(-1, k)
        return slots, fresh.tolist()

    def append(self, nd: Node, k: int) -> np.ndarray:
        """Give ``nd`` ``k`` more slots (its target page's free tail, then fresh pages)."""
        page = self.target_page(nd)
        had = nd.n
        slots, take, fresh = self._take(page, k)
        if take and not had:  # a node with tokens already uses its last page
            self.allocator.incref(np.array([page], _I))
            nd.pages.append(page)
        nd.pages.extend(fresh.tolist())
        nd.extend(slots)
        nd.group_page = -1
        if not had and nd.parent is not None and slots.size:
            nd.parent.group_page = int(slots[-1]) // self.page_size
        return slots

    def subtree(self, nd: Node, lens: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, list[int]]]]:
        """Slots for ``m`` new nodes under ``nd`` holding ``lens [m]`` tokens each, packed in
        order from ``nd``'s group page.

        Returns ``slots [sum(lens)]`` and, per new node, its slots and pages (one user per
        (new node, page) pair already counted).
        """
        m, ps = lens.shape[0], self.page_size
        slots, _, fresh = self._take(self.group_page(nd), int(lens.sum()))
        # One user per (new node, page) pair; alloc already counted one user per fresh page.
        owner = np.repeat(np.arange(m, dtype=_I), lens)
        pairs = np.unique(owner * self.num_pages + slots // ps)
        pair_owner, pair_page = pairs // self.num_pages, pairs % self.num_pages
        extra = np.ones(pairs.shape[0], bool)
        uniq, first = np.unique(pair_page, return_index=True)
        extra[first[np.isin(uniq, fresh)]] = False
        self.allocator.incref(pair_page[extra])
        if slots.size:
            nd.group_page = int(slots[-1]) // ps
        bounds = np.zeros(m + 1, _I)
        np.cumsum(lens, out=bounds[1:])
        pair_bounds = np.searchsorted(pair_owner, np.arange(m + 1))
        parts = [(slots[bounds[i] : bounds[i + 1]], pair_page[pair_bounds[i] : pair_bounds[i + 1]].tolist())
                 for i in range(m)]
        return slots, parts

    def split(self, nd: Node, at: int) -> tuple[np.ndarray, list[int]]:
        """Take ``nd``'s first ``at`` slots away from it; returns them and their pages.

        A page holding slots of both parts gains a user.
        """
        ps = self.page_size
        first, rest = nd.buf[:at], nd.buf[at : nd.n]
        pages = np.unique(first // ps).tolist()
        nd.buf, nd.n, nd.pages = rest, rest.shape[0], np.unique(rest // ps).tolist()
        self.allocator.incref(np.intersect1d(pages, nd.pages))
        return first, pages

    # ------------------------------------------------------------ releasing

    def check_fits(self, nd: Node, k: int, removed: list[Node]) -> None:
        """Raise :class:`CacheFullError` unless ``k`` tokens fit ``nd`` once ``removed`` go."""
        ps = self.page_size
        used = concat([np.asarray(r.pages, _I) for r in removed])
        pages, counts = np.unique(used, return_counts=True)
        freed = pages[self.allocator.refcounts[pages] == counts]
        page = self.target_page(nd)
        room = 0
        if page >= 0 and self.allocator.refcount(page) > 0 and page not in freed:
            dead = concat([r.buf[: r.n] for r in removed])
            seg = self.live[page * ps : (page + 1) * ps].copy()
            seg[dead[dead // ps == page] - page * ps] = False
            room = int(np.argmax(seg[::-1])) if seg.any() else ps  # free tail after rewinding
        needed = -(-max(k - room, 0) // ps)
        free = self.allocator.num_free + freed.shape[0]
        if needed > free:
            raise CacheFullError(needed, free, self.allocator.num_pages)

    def release(self, nodes: list[Node], survivors: list[Node]) -> None:
        """Free the slots of removed ``nodes``: drop their page users, rewind fill pointers.

        ``survivors``: live parents of removed nodes, whose group page may have been freed.
        """
        self.live[concat([nd.buf[: nd.n] for nd in nodes])] = False
        touched = concat([np.asarray(nd.pages, _I) for nd in nodes])
        self.allocator.decref(touched)
        refs = self.allocator.refcounts
        for par in survivors:
            if par.group_page >= 0 and refs[par.group_page] == 0:
                par.group_page = -1
        touched = np.unique(touched)
        touched = touched[refs[touched] > 0]
        if touched.size:  # rewind each fill pointer to just past the page's last live slot
            ps = self.page_size
            seg = self.live.reshape(-1, ps)[touched]
            self.fill[touched] = np.where(seg.any(1), ps - np.argmax(seg[:, ::-1], 1), 0)

    # ---------------------------------------------------------------- policy

    def group_page(self, nd: Node) -> int:
        """Page where ``nd``'s token-less children start (``-1``: none, use fresh pages)."""
        return nd.group_page if nd.group_page >= 0 else self.target_page(nd)

    def target_page(self, nd: Node) -> int:
        """Page whose free tail ``nd``'s next tokens go to first.

        The page of its last slot; for a token-less node, the group page of the nearest
        ancestor that has one, or that ancestor's last page.
        """
        while not nd.n:
            if nd.parent is None:
                return -1
            nd = nd.parent
            if nd.group_page >= 0:
                return nd.group_page
        return int(nd.buf[nd.n - 1]) // self.page_size

    def _room(self, page: int) -> int:
        # A stale group page may have been freed: its tail is not ours to hand out.
        if page < 0 or self.allocator.refcount(page) == 0:
            return 0
        return self.page_size - int(self.fill[page])

    def _take(self, page: int, k: int) -> tuple[np.ndarray, int, np.ndarray]:
        """Hand out ``k`` slots: the free tail of ``page``, then fresh pages.

        Returns ``slots [k]``, how many came from ``page`` and the ``fresh`` pages (one
        user each). Raises :class:`CacheFullError` before changing anything.
        """
        ps = self.page_size
        take = min(k, self._room(page))
        rest = k - take
        fresh = self.allocator.alloc(-(-rest // ps)) if rest else EMPTY
        start = page * ps + int(self.fill[page]) if take else 0
        slots = np.arange(start, start + take, dtype=_I)
        if take:
            self.fill[page] += take
            self.live[start : start + take] = True
        if rest:
            tail = (fresh[:, None] * ps + np.arange(ps)).reshape(-1)[:rest]
            self.fill[fresh] = ps
            self.fill[fresh[-1]] = rest - (fresh.size - 1) * ps
            self.live[tail] = True
            slots = np.concatenate((slots, tail))
        return slots, take, fresh
