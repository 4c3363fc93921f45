"""Paged tree KV cache: nodes of tokens over refcounted pages, emitting step layouts.

Each node owns a list of slots (any slots, not necessarily page-aligned or
contiguous) and counts as one user of every page its slots touch. A page is handed
out slot by slot through its fill pointer ``fill[p]`` (slots ``[0, fill[p])`` were
handed out), so several nodes can share one partly filled page without copying:

* A node appends into the free tail of the page of its own last slot, then into
  fresh pages.
* A node without tokens (just forked) starts in its parent's *group page*: the
  parent's last page at first, later the fresh page the latest sibling opened. Forking
  therefore copies nothing, and siblings with few tokens (draft tokens) pack densely.
* Pruning marks the node's slots dead and rewinds each touched page's fill pointer
  to just past its last live slot, so a leaf whose drafts are pruned continues right
  after its own last token; a page is freed when its last user goes.

See ``docs/cache.md`` for the design and its trade-offs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch

from ..layout import TreeLayout, as_index_array
from .node import DenseNodes, Node
from .pages import CacheFullError, PageAllocator
from .pool import KVPool

__all__ = ["TreeKVCache"]

_I = np.int64
_EMPTY = np.zeros(0, _I)
_EMPTY.setflags(write=False)


def _count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, _I)


class TreeKVCache:
    """A forest of token nodes over ``num_pages`` pages of ``page_size`` slots.

    Slot ``s`` is row ``s`` of the flattened pool (page ``s // page_size``); callers
    write K/V into the slots that :meth:`add_root`, :meth:`append` and
    :meth:`add_subtree` return (e.g. with :meth:`KVPool.write`). Node ids are stable
    integer handles, never reused. Operations validate everything and check free pages
    before changing anything: a ``ValueError`` or :class:`CacheFullError` leaves the
    cache as it was.

    Parameters
    ----------
    num_pages, page_size:
        Pool geometry; ``page_size`` may be 1.
    pool:
        Optional :class:`KVPool` with the same geometry, used only by
        :meth:`commit_path` to copy accepted draft rows.
    """

    def __init__(self, num_pages: int, page_size: int = 16, pool: KVPool | None = None) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected a positive integer, got {page_size!r}")
        self.allocator = PageAllocator(num_pages)
        if pool is not None:
            if not isinstance(pool, KVPool):
                raise TypeError(
                    f"pool: expected a deft.cache.KVPool or None, got {type(pool).__name__}"
                )
            if (pool.num_pages, pool.page_size) != (num_pages, page_size):
                raise ValueError(
                    f"pool: expected num_pages={num_pages}, page_size={page_size} like the cache, "
                    f"got num_pages={pool.num_pages}, page_size={pool.page_size}"
                )
        self.num_pages, self.page_size, self.pool = num_pages, page_size, pool
        self._fill = np.zeros(num_pages, _I)  # [num_pages] slots handed out per page
        self._live = np.zeros(num_pages * page_size, bool)  # [num_slots] held by a live node
        self._nodes: dict[int, Node] = {}
        self._dense = DenseNodes()
        self._next_id = 0

    def __repr__(self) -> str:
        return (
            f"TreeKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"live_nodes={len(self._nodes)}, free_pages={self.num_free_pages})"
        )

    # ----------------------------------------------------------------- accessors

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def live_nodes(self) -> list[int]:
        """Ids of all live nodes, oldest first."""
        return list(self._nodes)

    def slots(self, node: int) -> np.ndarray:
        """``[num_tokens(node)]`` the node's own slots in token order (a copy)."""
        return self._get(node).slots.copy()

    def num_tokens(self, node: int) -> int:
        return self._get(node).n

    def parent(self, node: int) -> int:
        """The parent's id, ``-1`` for a root."""
        par = self._get(node).parent
        return par.id if par is not None else -1

    def children(self, node: int) -> list[int]:
        """Ids of the live children, oldest first."""
        return list(self._get(node).children)

    def path_slots(self, node: int) -> np.ndarray:
        """``[T]`` every slot from the root down to ``node``, in token order."""
        parts: list[np.ndarray] = []
        nd: Node | None = self._get(node)
        while nd is not None:
            parts.append(nd.slots)
            nd = nd.parent
        return _concat(parts[::-1])

    # ---------------------------------------------------------------- growing

    def add_root(self, num_tokens: int = 0) -> int:
        """New root (a prompt) holding ``num_tokens`` fresh slots; returns its id."""
        num_tokens = _count(num_tokens, "num_tokens", 0)
        slots, _, fresh = self._take(-1, num_tokens)
        return self._new_node(None, slots, fresh.tolist()).id

    def fork(self, node: int, n: int) -> list[int]:
        """``n`` new empty children of ``node`` (which may already have children).

        Nothing is copied: the children see ``node``'s tokens through the tree, and
        their own first tokens go into ``node``'s partly filled last page.
        """
        par = self._get(node)
        n = _count(n, "n", 1)
        return [self._new_node(par).id for _ in range(n)]

    def append(self, node: int, num_tokens: int = 1) -> np.ndarray:
        """Give leaf ``node`` ``num_tokens`` more slots; returns them, ``[num_tokens]``."""
        nd = self._get(node)
        num_tokens = _count(num_tokens, "num_tokens", 0)
        if nd.children:
            raise ValueError(
                f"node: expected a node without live children to append to, got node "
                f"{nd.id} with children {list(nd.children)}"
            )
        return self._append(nd, num_tokens)

    def add_subtree(
        self, node: int, parents: Any, num_tokens: Any = 1
    ) -> tuple[list[int], np.ndarray]:
        """Add many nodes under ``node`` at once, e.g. a speculative draft tree.

        New node ``i`` is a child of ``node`` if ``parents[i] == -1``, else of new node
        ``parents[i] < i``, and holds ``num_tokens`` (an int, or ``[m]`` per node) slots.
        All slots are packed in node order, starting in ``node``'s group page.

        Returns the ``m`` new ids and ``[sum(num_tokens)]`` their slots in node order.
        """
        nd = self._get(node)
        par = as_index_array(parents, "parents")
        m = par.shape[0]
        bad = (par < -1) | (par >= np.arange(m))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"parents[{i}]: expected -1 (a child of node {nd.id}) or an earlier index "
                f"in [0, {i}), got {int(par[i])}"
            )
        if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
            lens = np.full(m, _count(num_tokens, "num_tokens", 0), _I)
        else:
            lens = as_index_array(num_tokens, "num_tokens")
            if lens.shape != (m,):
                raise ValueError(
                    f"num_tokens: expected an int or shape ({m},) like parents, got {lens.shape}"
                )
            if lens.size and lens.min() < 0:
                i = int(np.argmax(lens < 0))
                raise ValueError(f"num_tokens[{i}]: expected an integer >= 0, got {int(lens[i])}")
        slots, _, fresh = self._take(self._group_page(nd), int(lens.sum()))
        # One user per (new node, page) pair; alloc already counted one user per fresh page.
        owner = np.repeat(np.arange(m, dtype=_I), lens)
        pairs = np.unique(owner * self.num_pages + slots // self.page_size)
        pair_owner, pair_page = pairs // self.num_pages, pairs % self.num_pages
        extra = np.ones(pairs.shape[0], bool)
        uniq, first = np.unique(pair_page, return_index=True)
        extra[first[np.isin(uniq, fresh)]] = False
        self.allocator.incref(pair_page[extra])
        if slots.size:
            nd.group_page = int(slots[-1]) // self.page_size
        bounds = np.zeros(m + 1, _I)
        np.cumsum(lens, out=bounds[1:])
        pair_bounds = np.searchsorted(pair_owner, np.arange(m + 1))
        new: list[Node] = []
        for i, p in enumerate(par.tolist()):
            new.append(self._new_node(
                nd if p < 0 else new[p],
                slots[bounds[i] : bounds[i + 1]],
                pair_page[pair_bounds[i] : pair_bounds[i + 1]].tolist(),
            ))
        return [c.id for c in new], slots.copy()

    def split(self, node: int, at: int) -> int:
        """Cut ``node`` before its token ``at``; returns the id of the new head node.

        The head takes the first ``at`` tokens and ``node``'s place under its parent;
        ``node`` keeps its id, its children and its tokens from ``at`` on, and becomes
        the head's only child. A page holding tokens of both parts gains a user; nothing
        is copied. Use it to branch from the middle of a node (then ``fork`` the head).
        """
        nd = self._get(node)
        if isinstance(at, bool) or not isinstance(at, (int, np.integer)) or not 0 < at < nd.n:
            raise ValueError(
                f"at: expected an integer in [1, {nd.n - 1}] (inside node {nd.id}), got {at!r}"
            )
        at = int(at)
        old_parent, first, rest = nd.parent, nd.buf[:at], nd.buf[at : nd.n]
        head = Node(self._next_id, old_parent, first, np.unique(first // self.page_size).tolist())
        self._next_id += 1
        nd.buf, nd.n, nd.pages = rest, rest.shape[0], np.unique(rest // self.page_size).tolist()
        self.allocator.incref(np.intersect1d(head.pages, nd.pages))
        if old_parent is not None:
            old_parent.children = {
                (head.id if cid == nd.id else cid): (head if c is nd else c)
                for cid, c in old_parent.children.items()
            }
        head.children = {nd.id: nd}
        nd.parent = head
        self._nodes[head.id] = head
        self._dense.add(head)
        self._dense.update(nd)
        return head.id

    # --------------------------------------------------------------- shrinking

    def prune(
        self, node: int, release_unused_ancestors: bool = False, keep: Collection[int] = ()
    ) -> list[int]:
        """Remove ``node`` and its whole subtree; returns the removed ids.

        With ``release_unused_ancestors``, ancestors left without live children are
        removed too, walking up until an ancestor still has another child or is listed
        in ``keep`` (nodes that still have queries of their own, or a prompt to reuse).
        Pages no live node uses any more return to the free list.
        """
        nd = self._get(node)
        keep_ids = {self._get(k, "keep").id for k in keep}
        removed = self._bottom_up([nd])
        if release_unused_ancestors:
            cur = nd
            while (
                cur.parent is not None
                and len(cur.parent.children) == 1
                and cur.parent.id not in keep_ids
            ):
                cur = cur.parent
                removed.append(cur)
        self._remove(removed)
        return [r.id for r in removed]

    def commit_path(self, leaf: int, path: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Keep an accepted draft path: append its tokens to ``leaf``, prune all drafts.

        ``path`` is a chain of ``leaf``'s descendants (``path[0]`` a child of ``leaf``,
        each next one a child of the previous). Every descendant of ``leaf`` is pruned
        and ``leaf`` gains the path's tokens in order. Their K/V rows move to ``leaf``'s
        next slots: usually right after its last token in its own last page, where the
        drafts were packed, so only rows not already in place are copied.

        Returns ``(src, dst)``, ``[c]`` each: the rows that moved. With a pool they are
        copied already (every layer, K and V); without one the caller must copy them
        before writing any other K/V. Raises :class:`CacheFullError` (changing nothing)
        if the path does not fit even after the drafts are pruned.
        """
        lf = self._get(leaf, "leaf")
        chain, prev = [], lf
        for i, p in enumerate(path):
            step = self._get(p, f"path[{i}]")
            if step.parent is not prev:
                raise ValueError(
                    f"path[{i}]: expected a child of node {prev.id}, got node {step.id} "
                    f"(parent {step.parent.id if step.parent is not None else 'none, a root'})"
                )
            chain.append(step)
            prev = step
        src = _concat([c.slots for c in chain])
        removed = self._bottom_up(list(lf.children.values()))
        self._check_commit_fits(lf, src.shape[0], removed)
        self._remove(removed)
        dst = self._append(lf, src.shape[0])
        moved = src != dst
        src, dst = src[moved], dst[moved]
        if self.pool is not None and src.size:
            dev = self.pool.k[0].device
            self.pool.copy_slots(torch.as_tensor(src, device=dev), torch.as_tensor(dst, device=dev))
        return src, dst

    # ----------------------------------------------------------------- layout

    def layout(self, queries: Sequence[int | tuple[int, int | None]]) -> TreeLayout:
        """The step's :class:`~deft.TreeLayout` over all live nodes.

        ``queries`` lists each query as a node id or ``(node, query_kv_len)``
        (``None``: all of the node's tokens); layout query ``i`` is ``queries[i]``.
        Layout node ``j`` is node ``layout_nodes()[j]`` (valid until the tree changes).
        Cost: numpy work plus one slice per live node and a few operations per query.
        """
        num_q = len(queries)
        qn, ql = np.empty(num_q, _I), np.empty(num_q, _I)
        live = self._nodes
        for i, q in enumerate(queries):
            node, qlen = q if type(q) is tuple and len(q) == 2 else (q, None)
            nd = live.get(node) if type(node) is int else None  # fast path; _get validates
            if nd is None:
                nd = self._get(node, f"queries[{i}]")
            qn[i] = nd.dense
            if qlen is None:
                ql[i] = nd.n
            elif type(qlen) is int and 0 <= qlen <= nd.n:
                ql[i] = qlen
            else:
                ql[i] = _count(qlen, f"queries[{i}]", 0)
                if ql[i] > nd.n:
                    raise ValueError(
                        f"queries[{i}]: expected query_kv_len in [0, {nd.n}] (tokens of node "
                        f"{nd.id}) or None, got {qlen!r}"
                    )
        parents, indptr, kv = self._dense.arrays()
        return TreeLayout(parents, indptr, kv, qn, ql)

    def layout_nodes(self) -> np.ndarray:
        """``[num_live]`` node id of each layout node index."""
        return self._dense.ids()

    # --------------------------------------------------------------- internals

    def _get(self, node: Any, name: str = "node") -> Node:
        nd = None
        if isinstance(node, (int, np.integer)) and not isinstance(node, bool):
            nd = self._nodes.get(int(node))
        if nd is None:
            known = isinstance(node, (int, np.integer)) and 0 <= node < self._next_id
            why = "pruned" if known else "never created"
            raise ValueError(f"{name}: expected a live node id, got {node!r} ({why})")
        return nd

    def _new_node(
        self, parent: Node | None, slots: np.ndarray = _EMPTY, pages: list[int] | None = None
    ) -> Node:
        """Register a node holding ``slots`` (kept, not copied) that lie in ``pages``."""
        nd = Node(self._next_id, parent, slots, pages)
        self._next_id += 1
        self._nodes[nd.id] = nd
        if parent is not None:
            parent.children[nd.id] = nd
        self._dense.add(nd)
        return nd

    def _group_page(self, nd: Node) -> int:
        """Page where ``nd``'s token-less children start (``-1``: none, use fresh pages)."""
        return nd.group_page if nd.group_page >= 0 else self._target_page(nd)

    def _target_page(self, nd: Node) -> int:
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
        return self.page_size - int(self._fill[page])

    def _take(self, page: int, k: int) -> tuple[np.ndarray, int, np.ndarray]:
        """Hand out ``k`` slots: the free tail of ``page``, then fresh pages.

        Returns ``slots [k]``, how many came from ``page`` and the ``fresh`` pages (one
        user each). Raises :class:`CacheFullError` before changing anything.
        """
        ps = self.page_size
        take = min(k, self._room(page))
        rest = k - take
        fresh = self.allocator.alloc(-(-rest // ps)) if rest else _EMPTY
        start = page * ps + int(self._fill[page]) if take else 0
        slots = np.arange(start, start + take, dtype=_I)
        if take:
            self._fill[page] += take
            self._live[start : start + take] = True
        if rest:
            tail = (fresh[:, None] * ps + np.arange(ps)).reshape(-1)[:rest]
            self._fill[fresh] = ps
            self._fill[fresh[-1]] = rest - (fresh.size - 1) * ps
            self._live[tail] = True
            slots = np.concatenate((slots, tail))
        return slots, take, fresh

    def _append(self, nd: Node, k: int) -> np.ndarray:
        page = self._target_page(nd)
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
        self._dense.update(nd)
        return slots

    def _bottom_up(self, tops: list[Node]) -> list[Node]:
        """``tops`` and all their descendants, every node after all of its children."""
        order, stack = [], list(tops)
        while stack:
            cur = stack.pop()
            order.append(cur)
            stack.extend(cur.children.values())
        return order[::-1]

    def _check_commit_fits(self, lf: Node, k: int, removed: list[Node]) -> None:
        """Raise :class:`CacheFullError` unless ``k`` tokens fit ``lf`` once ``removed`` go."""
        ps = self.page_size
        used = _concat([np.asarray(r.pages, _I) for r in removed])
        pages, counts = np.unique(used, return_counts=True)
        freed = pages[self.allocator.refcounts[pages] == counts]
        page = self._target_page(lf)
        room = 0
        if page >= 0 and self.allocator.refcount(page) > 0 and page not in freed:
            dead = _concat([r.buf[: r.n] for r in removed])
            seg = self._live[page * ps : (page + 1) * ps].copy()
            seg[dead[dead // ps == page] - page * ps] = False
            room = int(np.argmax(seg[::-1])) if seg.any() else ps  # free tail after rewinding
        needed = -(-max(k - room, 0) // ps)
        free = self.allocator.num_free + freed.shape[0]
        if needed > free:
            raise CacheFullError(needed, free)

    def _remove(self, nodes: list[Node]) -> None:
        """Remove ``nodes`` (each after its removed children), free and rewind pages."""
        for nd in nodes:
            del self._nodes[nd.id]
        survivors = []
        for nd in nodes:
            par = nd.parent
            if par is not None:
                del par.children[nd.id]
                if par.id in self._nodes:
                    survivors.append(par)
            self._dense.remove(nd)
        self._live[_concat([nd.buf[: nd.n] for nd in nodes])] = False
        touched = _concat([np.asarray(nd.pages, _I) for nd in nodes])
        self.allocator.decref(touched)
        refs = self.allocator.refcounts
        for par in survivors:
            if par.group_page >= 0 and refs[par.group_page] == 0:
                par.group_page = -1
        touched = np.unique(touched)
        touched = touched[refs[touched] > 0]
        if touched.size:  # rewind each fill pointer to just past the page's last live slot
            ps = self.page_size
            seg = self._live.reshape(-1, ps)[touched]
            self._fill[touched] = np.where(seg.any(1), ps - np.argmax(seg[:, ::-1], 1), 0)
