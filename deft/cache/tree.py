"""Paged tree KV cache: nodes of tokens over refcounted pages, emitting step layouts.

Each node owns a list of slots (any slots, not necessarily page-aligned or
contiguous); which slots a node gets, and when a page is shared or freed, is the
:class:`~deft.cache.slots.SlotAllocator`'s bookkeeping: several nodes share one partly
filled page without copying, a forked child starts in its parent's partly filled
page, and a leaf whose drafts are pruned continues right after its own last token.
This module keeps the tree: parents and children, fork, split, prune, commit of an
accepted draft path, and the layouts of a step.

See ``docs/cache.md`` for the design and its trade-offs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from ..checks import int_at_least, int_in_range, is_int
from ..layout import TreeLayout, as_index_array, trusted_layout
from .node import EMPTY, DenseNodes, Node, concat
from .slots import SlotAllocator

__all__ = ["TreeKVCache"]

_I = np.int64


class TreeKVCache:
    """A forest of token nodes over ``num_pages`` pages of ``page_size`` slots.

    Slot ``s`` is row ``s`` of the flattened pool (page ``s // page_size``); callers
    write K/V into the slots that :meth:`add_root`, :meth:`append` and
    :meth:`add_subtree` return (e.g. with :meth:`KVPool.write`). The cache holds no K/V:
    it is host bookkeeping, and whoever owns the pool applies the rows it moves. Node ids are stable
    integer handles, never reused. Operations validate everything and check free pages
    before changing anything: a ``ValueError`` or :class:`CacheFullError` leaves the
    cache as it was (but :meth:`append_each`, which is :meth:`append` of each node in
    turn and stops where one does not fit).

    Parameters
    ----------
    num_pages, page_size:
        Pool geometry; ``page_size`` may be 1.
    on_copy:
        Optional callable, called with :meth:`commit_path`'s ``(src, dst)`` rows whenever
        it moves any: the pool's owner copies them before any other K/V write (the engine
        queues them into its next step).
    """

    def __init__(self, num_pages: int, page_size: int = 16,
                 on_copy: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        self._slot_alloc = SlotAllocator(num_pages, page_size)
        self.allocator = self._slot_alloc.allocator
        num_pages, page_size = self._slot_alloc.num_pages, self._slot_alloc.page_size
        if on_copy is not None and not callable(on_copy):
            raise TypeError(f"on_copy: expected a callable or None, got {type(on_copy).__name__}")
        self.num_pages, self.page_size, self._on_copy = num_pages, page_size, on_copy
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
    def _fill(self) -> np.ndarray:
        """``[num_pages]`` slots handed out per page (white-box tests read it)."""
        return self._slot_alloc.fill

    @property
    def _live(self) -> np.ndarray:
        """``[num_slots]`` slots held by a live node (white-box tests read it)."""
        return self._slot_alloc.live

    @property
    def live_nodes(self) -> list[int]:
        """Ids of all live nodes, oldest first."""
        return list(self._nodes)

    def is_live(self, node: int) -> bool:
        """Whether ``node`` is a live node id (``False`` once pruned), in O(1)."""
        return is_int(node) and int(node) in self._nodes

    def slots(self, node: int) -> np.ndarray:
        """``[num_tokens(node)]`` the node's own slots in token order (a copy)."""
        return self._get(node).slots.copy()

    def num_tokens(self, node: int) -> int:
        return self._get(node).n

    def position(self, node: int) -> int:
        """Tokens on the path root..``node``: the position of its next token (O(1))."""
        nd = self._get(node)
        return nd.start + nd.n

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
        return concat(parts[::-1])

    # ---------------------------------------------------------------- growing

    def add_root(self, num_tokens: int = 0) -> int:
        """New root (a prompt) holding ``num_tokens`` fresh slots; returns its id."""
        slots, pages = self._slot_alloc.new_slots(int_at_least(num_tokens, "num_tokens", 0))
        root = Node(self._next_id, None, slots, pages)
        self._register([root])
        return root.id

    def fork(self, node: int, n: int) -> list[int]:
        """``n`` new empty children of ``node`` (which may already have children).

        Nothing is copied: the children see ``node``'s tokens through the tree, and
        their own first tokens go into ``node``'s partly filled last page.
        """
        par = self._get(node)
        first = self._next_id
        n = int_at_least(n, "n", 1)
        self._slot_alloc.settle(par)
        self._register(Node.tree(par, first, [-1] * n, [EMPTY] * n, [[] for _ in range(n)]))
        return list(range(first, self._next_id))

    def append(self, node: int, num_tokens: int = 1) -> np.ndarray:
        """Give leaf ``node`` ``num_tokens`` more slots; returns them, ``[num_tokens]``."""
        nd = self._get(node)
        num_tokens = int_at_least(num_tokens, "num_tokens", 0)
        if nd.children:
            raise ValueError(
                f"node: expected a node without live children to append to, got node "
                f"{nd.id} with children {list(nd.children)}"
            )
        return self._append(nd, num_tokens)

    def append_each(self, nodes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One more slot for each of leaves ``nodes`` in turn, as :meth:`append` of each with
        one token (a node listed twice gets two; a decode step's beams or branches).

        Returns ``[m]`` each: the slots, each node's tokens once it got its slot (the new
        token's ``query_kv_len``) and the new token's position. A node with children raises
        ``ValueError`` naming ``nodes[i]`` before anything changes; :class:`CacheFullError`
        comes as :meth:`append`'s would, the nodes before the one it stopped at keeping
        their slots.
        """
        nds = [self._get(node, f"nodes[{i}]") for i, node in enumerate(nodes)]
        for i, nd in enumerate(nds):
            if nd.children:
                raise ValueError(f"nodes[{i}]: expected a node without live children to append "
                                 f"to, got node {nd.id} with children {list(nd.children)}")
        slots, lens, positions = [], [], []
        alloc, update = self._slot_alloc, self._dense.update
        for nd in nds:
            slots.append(alloc.append(nd, 1).item(0))
            update(nd)
            lens.append(nd.n)
            positions.append(nd.start + nd.n - 1)
        return np.array(slots, _I), np.array(lens, _I), np.array(positions, _I)

    def expect(self, node: int, num_tokens: int) -> None:
        """Expect leaf ``node`` to hold about ``num_tokens`` tokens of its own in all (a prompt
        about to be fed in chunks, then its decode tokens; ``0``: no expectation).

        A hint, not a reservation: the node's fresh pages are then taken as one run where the
        pool has room for all of it, the pages after them claimed for it, which other takes
        pass by while others are free (:class:`PageAllocator`), so its K/V lie in
        consecutive slots however the appends of other nodes interleave with its own; the
        attention kernel loads such tiles by TMA. Nothing is held: the claim goes when the
        node forks or is pruned, or is given ``0`` (the engine does so when a branch ends),
        and other takes that find no other free page take from its end.
        """
        nd = self._get(node)
        num_tokens = int_at_least(num_tokens, "num_tokens", 0)
        if nd.children:
            raise ValueError(f"node: expected a node without live children, got node {nd.id} "
                             f"with children {list(nd.children)}")
        self._slot_alloc.expect(nd, num_tokens)

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
        if is_int(num_tokens):
            lens = np.full(m, int_at_least(num_tokens, "num_tokens", 0), _I)
        else:
            lens = as_index_array(num_tokens, "num_tokens")
            if lens.shape != (m,):
                raise ValueError(
                    f"num_tokens: expected an int or shape ({m},) like parents, got {lens.shape}"
                )
            if lens.size and lens.min() < 0:
                i = int(np.argmax(lens < 0))
                raise ValueError(f"num_tokens[{i}]: expected an integer >= 0, got {int(lens[i])}")
        slots, own, pages = self._slot_alloc.subtree(nd, lens)
        first = self._next_id
        self._register(Node.tree(nd, first, par.tolist(), own, pages),
                       np.where(par < 0, nd.dense, par + len(self._dense)), lens)
        return list(range(first, first + m)), slots.copy()

    def split(self, node: int, at: int) -> int:
        """Cut ``node`` before its token ``at``; returns the id of the new head node.

        The head takes the first ``at`` tokens and ``node``'s place under its parent;
        ``node`` keeps its id, its children and its tokens from ``at`` on, and becomes
        the head's only child. A page holding tokens of both parts gains a user; nothing
        is copied. Use it to branch from the middle of a node (then ``fork`` the head).
        """
        nd = self._get(node)
        at = int_in_range(at, "at", 1, nd.n - 1)
        old_parent = nd.parent
        head = Node(self._next_id, old_parent, *self._slot_alloc.split(nd, at))
        nd.start = head.start + head.n
        self._next_id += 1
        if old_parent is not None:
            old_parent.children = {
                (head.id if cid == nd.id else cid): (head if c is nd else c)
                for cid, c in old_parent.children.items()
            }
        head.children = {nd.id: nd}
        nd.parent = head
        self._nodes[head.id] = head
        self._dense.add_all([head])
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
        removed, cur = self._bottom_up([nd]), nd
        if release_unused_ancestors:
            while (
                cur.parent is not None
                and len(cur.parent.children) == 1
                and cur.parent.id not in keep_ids
            ):
                cur = cur.parent
                removed.append(cur)
        self._remove(removed, [cur])
        return [r.id for r in removed]

    def prune_many(
        self, nodes: Sequence[int], release_unused_ancestors: bool = False,
        keep: Collection[int] = ()
    ) -> list[int]:
        """:meth:`prune` of each of ``nodes`` in turn (a node an earlier one removed is
        skipped), in one pass over the pages (beam search drops several beams a step): the
        same nodes go, in the same order, so the layout's node order is the same too. Only
        placement can differ: the freed pages go on the free list in one sorted run, and a
        surviving parent whose group page is freed forgets it. Returns the removed ids."""
        tops = [self._get(node, f"nodes[{i}]") for i, node in enumerate(nodes)]
        if len(tops) < 2:
            return self.prune(tops[0].id, release_unused_ancestors, keep) if tops else []
        keep_ids = {self._get(k, "keep").id for k in keep}
        removed: list[Node] = []
        gone: set[int] = set()
        # As prune of each in turn: what is left of its subtree, bottom-up, then the
        # ancestors that leaves without children.
        for cur in tops:
            if cur.id in gone:
                continue
            sub = [nd for nd in self._bottom_up([cur]) if nd.id not in gone]
            removed += sub
            gone.update(nd.id for nd in sub)
            par = cur.parent
            while (release_unused_ancestors and par is not None and par.id not in keep_ids
                   and all(c in gone for c in par.children)):
                removed.append(par)
                gone.add(par.id)
                par = par.parent
        self._remove(removed, [nd for nd in removed if nd.parent is None or nd.parent.id not in gone])
        return [r.id for r in removed]

    def commit_path(self, leaf: int, path: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Keep an accepted draft path: append its tokens to ``leaf``, prune all drafts.

        ``path`` is a chain of ``leaf``'s descendants (``path[0]`` a child of ``leaf``,
        each next one a child of the previous). Every descendant of ``leaf`` is pruned
        and ``leaf`` gains the path's tokens in order. Their K/V rows move to ``leaf``'s
        next slots: usually right after its last token in its own last page, where the
        drafts were packed, so only rows not already in place are copied.

        Returns ``(src, dst)``, ``[c]`` each: the rows that moved, which the pool's owner
        must copy (every layer, K and V) before writing any other K/V; ``on_copy`` gets
        them too. Raises :class:`CacheFullError` (changing nothing)
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
        src = concat([c.slots for c in chain])
        tops = list(lf.children.values())
        removed = self._bottom_up(tops)
        self._slot_alloc.check_fits(lf, src.shape[0], removed)
        self._remove(removed, tops)
        dst = self._append(lf, src.shape[0])
        moved = src != dst
        src, dst = src[moved], dst[moved]
        if self._on_copy is not None and src.size:
            self._on_copy(src, dst)
        return src, dst

    # ----------------------------------------------------------------- layout

    def layout(self, queries: Sequence[int | tuple[int, int | None]]) -> TreeLayout:
        """The step's :class:`~deft.TreeLayout` over all live nodes.

        ``queries`` lists each query as a node id or ``(node, query_kv_len)``
        (``None``: all of the node's tokens); layout query ``i`` is ``queries[i]``.
        Layout node ``j`` is node ``layout_nodes()[j]`` (valid until the tree changes).
        Cost: numpy work plus one view per live node and a few operations per query.
        """
        dense, lens, live = [], [], self._nodes
        for i, q in enumerate(queries):
            node, qlen = q if type(q) is tuple and len(q) == 2 else (q, None)
            nd = live.get(node) if type(node) is int else None  # fast path; _get validates
            if nd is None:
                nd = self._get(node, f"queries[{i}]")
            dense.append(nd.dense)
            if qlen is None:
                lens.append(nd.n)
            elif type(qlen) is int and 0 <= qlen <= nd.n:
                lens.append(qlen)
            else:
                lens.append(int_at_least(qlen, f"queries[{i}]", 0))
                if lens[-1] > nd.n:
                    raise ValueError(
                        f"queries[{i}]: expected query_kv_len in [0, {nd.n}] (tokens of node "
                        f"{nd.id}) or None, got {qlen!r}"
                    )
        return self._emit(np.array(dense, _I), np.array(lens, _I))

    def layout_of(self, nodes: Sequence[int], kv_lens: Any) -> TreeLayout:
        """:meth:`layout` of the queries ``(nodes[i], kv_lens[i])``, given as two columns.

        ``nodes``: ``[q]`` node ids; ``kv_lens``: ``[q]`` integers, each query's
        ``query_kv_len`` (no ``None``). For callers that hold a step's queries this way
        (the engine): the checks are whole-column passes, not a few operations per query.
        A bad id or length raises ``ValueError`` naming ``nodes[i]`` or ``kv_lens[i]``.
        """
        dense = None
        if set(map(type, nodes)) <= {int}:  # the common case: one pass of dict lookups
            try:
                dense = [nd.dense for nd in map(self._nodes.get, nodes)]
            except AttributeError:  # a missing id (None): the loop below names it
                pass
        if dense is None:
            dense = [self._get(node, f"nodes[{i}]").dense for i, node in enumerate(nodes)]
        qn = np.array(dense, _I)
        lens = as_index_array(kv_lens, "kv_lens").copy()  # the layout freezes its arrays
        if lens.shape != qn.shape:
            raise ValueError(f"kv_lens: expected shape {qn.shape} like nodes, got {lens.shape}")
        cap = self._dense.lengths()[qn]
        bad = (lens < 0) | (lens > cap)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"kv_lens[{i}]: expected query_kv_len in [0, {int(cap[i])}] "
                             f"(tokens of node {nodes[i]}), got {int(lens[i])}")
        return self._emit(qn, lens)

    def layout_nodes(self) -> np.ndarray:
        """``[num_live]`` node id of each layout node index."""
        return self._dense.ids()

    # --------------------------------------------------------------- internals

    def _get(self, node: Any, name: str = "node") -> Node:
        nd = self._nodes.get(node) if type(node) is int else None  # the common case first
        if nd is not None:
            return nd
        nd = self._nodes.get(int(node)) if is_int(node) else None
        if nd is None:
            known = is_int(node) and 0 <= node < self._next_id
            why = "pruned" if known else "never created"
            raise ValueError(f"{name}: expected a live node id, got {node!r} ({why})")
        return nd

    def _emit(self, query_nodes: np.ndarray, query_kv_lens: np.ndarray) -> TreeLayout:
        """The layout of checked queries: ``[q]`` dense node indices and valid lengths."""
        parents, indptr, kv = self._dense.arrays()
        # Valid by construction (checked queries, a forest of live nodes).
        return trusted_layout(parents, indptr, kv, query_nodes, query_kv_lens)

    def _register(self, new: list[Node], parents: np.ndarray | None = None,
                  lens: np.ndarray | None = None) -> None:
        """Register ``new`` nodes, numbered from ``_next_id`` on, each after its parent and
        already in its children; ``parents`` and ``lens`` as for :meth:`DenseNodes.add_all`."""
        first = self._next_id
        self._next_id += len(new)
        self._nodes.update(zip(range(first, self._next_id), new))
        self._dense.add_all(new, parents, lens)

    def _append(self, nd: Node, k: int) -> np.ndarray:
        slots = self._slot_alloc.append(nd, k)
        self._dense.update(nd)
        return slots

    def _bottom_up(self, tops: list[Node]) -> list[Node]:
        """``tops`` and all their descendants, every node after all of its children."""
        order, stack = [], list(tops)
        while stack:
            cur = stack.pop()
            order.append(cur)
            if cur.children:
                stack += cur.children.values()
        return order[::-1]

    def _remove(self, nodes: list[Node], tops: list[Node]) -> None:
        """Remove ``nodes``, the subtrees of ``tops`` (each node after its children), free
        and rewind pages."""
        live = self._nodes
        for nd in nodes:
            del live[nd.id]
            nd.children.clear()  # all removed too
        survivors = []
        for nd in tops:
            if nd.parent is not None:
                del nd.parent.children[nd.id]
                survivors.append(nd.parent)
        self._dense.remove_all(nodes)
        self._slot_alloc.release(nodes, survivors)
