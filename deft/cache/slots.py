"""Which slots the nodes of a tree cache hold: pages handed out slot by slot.

Plain Python/numpy bookkeeping, no tensors. A page is handed out through its fill
pointer ``fill[p]`` (slots ``[0, fill[p])`` were handed out), so several nodes share one
partly filled page without copying, and a node counts as one user of every page its
slots touch (the :class:`PageAllocator`'s reference counts):

* A node's next tokens go into the free tail of the page of its own last slot, then
  into fresh pages (its *target page*). A node with an expectation (``Node.expect``) takes
  its fresh pages as its allocator's owner: its first ones from a run that holds all it
  expects, the rest of which it claims, the next ones from its claim
  (:meth:`PageAllocator.take`); without tokens yet, it starts on such a run where the pool
  has room for one.
* A node without tokens (just forked) starts in its parent's *group page*: the
  parent's last page at first, later the fresh page the latest sibling opened, so
  siblings with few tokens (draft tokens) pack densely.
* Releasing nodes marks their slots dead and rewinds each touched page's fill pointer
  to just past its last live slot; a page is freed when its last user goes.

A decode step touches a page or two per node, so the fill pointers are an ``array('q')``
and the live flags a ``bytearray`` that Python ints index cheaply; ``fill`` and ``live``
are numpy views of the same memory for the vectorised work of big subtrees.

The tree itself (parents, children, layouts) is :class:`~deft.cache.TreeKVCache`'s.
"""

from __future__ import annotations

from array import array

import numpy as np

from ..checks import positive_int
from .node import Node, join_slots
from .pages import CacheFullError, PageAllocator

__all__ = ["SlotAllocator"]

_I = np.int64
_FEW = 16  # releasing more nodes than this clears their live flags with numpy


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
        self._fill = array("q", bytes(8 * self.num_pages))
        self._live = bytearray(self.num_pages * self.page_size)
        self.fill = np.frombuffer(self._fill, _I)  # views of the same memory
        self.live = np.frombuffer(self._live, bool)

    # ---------------------------------------------------------- handing out

    def new_slots(self, k: int) -> tuple[np.ndarray, list[int]]:
        """``k`` slots in fresh pages (a new root); returns them and their pages."""
        slots, _, fresh = self._take(-1, k)
        return slots, fresh

    def append(self, nd: Node, k: int) -> np.ndarray:
        """Give ``nd`` ``k`` more slots (its target page's free tail, then fresh pages)."""
        had = nd.n
        # A token-less node with an expectation starts on a run of its own where the pool has
        # room for one, not in its parent's group page (else it shares it as any child does).
        run = nd.expect and not had and self.allocator.room_for_run(-(-nd.expect // self.page_size))
        page = -1 if run else self.target_page(nd)
        slots, take, fresh = self._take(page, k, nd if nd.expect else None)
        if take and not had:  # a node with tokens already uses its last page
            self.allocator.share([page])
            nd.pages.append(page)
        nd.pages += fresh
        nd.extend(slots)
        nd.group_page = -1
        if not had and nd.parent is not None and k and not nd.expect:
            nd.parent.group_page = int(slots[-1]) // self.page_size
        return slots

    def expect(self, nd: Node, total: int) -> None:
        """Expect ``nd`` to hold ``total`` tokens of its own (``0``: no expectation)."""
        if not total:
            self.settle(nd)
        nd.expect = total

    def settle(self, nd: Node) -> None:
        """``nd`` grows no more (it has children now): its expectation and claim go."""
        if nd.expect:
            nd.expect = 0
            self.allocator.release_claim(nd.id)

    def subtree(self, nd: Node, lens: np.ndarray
                ) -> tuple[np.ndarray, list[np.ndarray], list[list[int]]]:
        """Slots for ``m`` new nodes under ``nd`` holding ``lens [m]`` tokens each, packed in
        order from ``nd``'s group page; ``nd``, now a parent, settles (:meth:`settle`).

        Returns ``slots [sum(lens)]`` and, per new node, its slots (views of ``slots``) and
        its pages (one user per (new node, page) pair already counted).
        """
        m, ps = lens.shape[0], self.page_size
        page, k = self.group_page(nd), int(lens.sum())
        fresh = -(-max(k - self._room(page), 0) // ps)
        if fresh > self.allocator.num_free:  # before ``nd`` settles: a failed call changes nothing
            raise CacheFullError(fresh, self.allocator.num_free, self.allocator.num_pages)
        self.settle(nd)  # its claim goes first, so the new nodes' pages follow its own
        slots, take, _ = self._take(page, k)
        # Each page is one run of ``slots`` and each node's slots are another, so a new
        # (node, page) pair starts wherever the node or the page changes: one user each,
        # but for the pair that opens a fresh page (alloc counted it).
        page = slots // ps
        opens = np.ones(slots.shape[0], bool)
        opens[1:] = page[1:] != page[:-1]
        if take:
            opens[0] = False
        if slots.size:
            nd.group_page = int(slots[-1]) // ps
        if (lens == 1).all():  # one token each (draft tokens)
            self.allocator.share_many(page[~opens])
            return slots, list(slots.reshape(m, 1)), [[p] for p in page.tolist()]
        owner = np.repeat(np.arange(m, dtype=_I), lens)
        pair = opens.copy()
        if slots.size:
            pair[0] = True
            pair[1:] |= owner[1:] != owner[:-1]
        self.allocator.share_many(page[pair & ~opens])
        pair_page = page[pair].tolist()
        cuts = np.zeros(m + 1, _I)
        np.cumsum(lens, out=cuts[1:])
        pair_cuts = np.searchsorted(owner[pair], np.arange(m + 1)).tolist()
        cuts = cuts.tolist()
        return (slots, [slots[cuts[i] : cuts[i + 1]] for i in range(m)],
                [pair_page[pair_cuts[i] : pair_cuts[i + 1]] for i in range(m)])

    def split(self, nd: Node, at: int) -> tuple[np.ndarray, list[int]]:
        """Take ``nd``'s first ``at`` slots away from it; returns them and their pages.

        A page holding slots of both parts gains a user.
        """
        ps = self.page_size
        first, rest = nd.slots[:at], nd.slots[at:]
        if nd.expect:
            self.expect(nd, max(nd.expect - at, 0))
        pages = np.unique(first // ps).tolist()
        nd.hold(rest)
        nd.pages = np.unique(rest // ps).tolist()
        self.allocator.share(sorted(set(pages) & set(nd.pages)))
        return first, pages

    # ------------------------------------------------------------ releasing

    def check_fits(self, nd: Node, k: int, removed: list[Node]) -> None:
        """Raise :class:`CacheFullError` unless ``k`` tokens fit ``nd`` once ``removed`` go."""
        ps = self.page_size
        used = np.array([p for r in removed for p in r.pages], _I)
        pages, counts = np.unique(used, return_counts=True)
        freed = pages[self.allocator.refcounts[pages] == counts]
        page = self.target_page(nd)
        room = 0
        if page >= 0 and self.allocator.users[page] > 0 and page not in freed:
            dead = join_slots([r.slots for r in removed])
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
        live = self._live
        touched = [p for nd in nodes for p in nd.pages]
        self.allocator.drop(touched)  # first: a double free raises with nothing changed
        if len(nodes) > _FEW:  # a draft tree: one numpy pass
            self.live[join_slots([nd.slots for nd in nodes])] = False
        else:
            for nd in nodes:
                if nd.n == 1:
                    live[nd.buf.item(0)] = 0
                elif nd.n:
                    self.live[nd.slots] = False
        if self.allocator.num_claimed:
            for nd in nodes:
                if nd.expect:
                    self.allocator.release_claim(nd.id)
        users, fill, ps = self.allocator.users, self._fill, self.page_size
        for par in survivors:
            if par.group_page >= 0 and not users[par.group_page]:
                par.group_page = -1
        for p in set(touched):  # rewind each fill pointer to just past the page's last live slot
            if users[p]:  # (a page with users holds a live slot)
                fill[p] = live.rfind(1, p * ps, (p + 1) * ps) + 1 - p * ps

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
        """Free slots at the tail of ``page`` that a take may hand out (none for ``-1`` or a
        stale group page that was freed: its tail is not ours)."""
        return self.page_size - self._fill[page] if page >= 0 and self.allocator.users[page] else 0

    def _take(self, page: int, k: int, nd: Node | None = None
              ) -> tuple[np.ndarray, int, list[int]]:
        """Hand out ``k`` slots: the free tail of ``page``, then fresh pages (taken for
        ``nd``, a node with an expectation whose last page is ``page`` if it has tokens).

        Returns ``slots [k]``, how many came from ``page`` and the ``fresh`` pages (one
        user each). Raises :class:`CacheFullError` before changing anything. A stale group
        ``page`` may have been freed: its tail is not ours to hand out.
        """
        ps, fill = self.page_size, self._fill
        take = min(k, self._room(page))
        rest = k - take
        if nd is None:
            fresh = self.allocator.take(-(-rest // ps))
        else:
            fresh = self.allocator.take(-(-rest // ps), page if nd.n else -1, nd.id,
                                        -(-(nd.expect - nd.n - take) // ps))
        start = page * ps + fill[page] if take else 0
        if take:
            fill[page] += take
            self._live[start : start + take] = b"\1" * take
        if not rest:
            return np.arange(start, start + take, dtype=_I), take, fresh
        for p in fresh:
            fill[p] = ps
        fill[fresh[-1]] = rest - (len(fresh) - 1) * ps
        if len(fresh) == 1:
            lo = fresh[0] * ps
            self._live[lo : lo + rest] = b"\1" * rest
            tail = np.arange(lo, lo + rest, dtype=_I)
        else:
            tail = (np.array(fresh, _I)[:, None] * ps + np.arange(ps)).reshape(-1)[:rest]
            self.live[tail] = True
        if not take:
            return tail, take, fresh
        return np.concatenate((np.arange(start, start + take, dtype=_I), tail)), take, fresh
