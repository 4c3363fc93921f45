"""Node records of the tree cache and the compact index that layouts are emitted from.

Node ids are stable handles that are never reused; layouts need dense indices
``0..num_live-1`` instead. :class:`DenseNodes` keeps live nodes in a list with their
parent's dense index and their length in two columns, updated in O(1) per change
(removal swaps the last node into the hole), so emitting a layout costs numpy work plus
one read of each node's slots view, never a walk over tokens.
"""

from __future__ import annotations

from array import array
from operator import attrgetter

import numpy as np

__all__ = ["DenseNodes", "EMPTY", "Node", "concat", "join_slots"]

_I = np.int64
_dense = attrgetter("dense")
EMPTY = np.zeros(0, _I)  # the read-only slots of a node without tokens
EMPTY.setflags(write=False)


def concat(arrays: list[np.ndarray]) -> np.ndarray:
    """``arrays`` of slots (or pages) end to end, a fresh int64 array (empty for none)."""
    return np.concatenate(arrays) if arrays else np.zeros(0, _I)


def join_slots(arrays: list[np.ndarray]) -> np.ndarray:
    """:func:`concat` of nodes' slot arrays (contiguous int64), read-only.

    ``bytes.join`` copies the buffers in one C loop, faster than ``np.concatenate`` for
    hundreds of one-token nodes.
    """
    return np.frombuffer(b"".join(arrays), _I)


class Node:
    """One live node: its own slots ``buf[:n]`` and the pages those slots lie in.

    ``slots`` is the view ``buf[:n]``, kept with every change: a layout reads every live
    node's, and an attribute costs a fraction of a slice. It is never written through
    (appends go past it).

    ``start`` is the number of tokens on the path above it (its first token's position),
    fixed at creation: a node with children never grows.

    ``group_page`` is the page this node's token-less children start filling (``-1``:
    wherever this node's own next token would go), so siblings share one partly filled
    page.

    ``expect`` is how many tokens of its own the node is expected to hold (``0``: no
    expectation): its pages are then taken as a run that can hold them all
    (:meth:`~deft.cache.TreeKVCache.expect`).
    """

    __slots__ = ("id", "parent", "children", "buf", "n", "slots", "pages", "group_page", "dense",
                 "start", "expect")

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        slots: np.ndarray = EMPTY,
        pages: list[int] | None = None,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[int, Node] = {}  # insertion-ordered
        self.buf = self.slots = slots  # [capacity] int64; a given array is never written
        self.n = len(slots)
        self.pages: list[int] = pages if pages is not None else []  # distinct pages of its slots
        self.group_page = -1
        self.dense = -1
        self.start = 0 if parent is None else parent.start + parent.n
        self.expect = 0

    @classmethod
    def tree(cls, top: Node, first_id: int, parents: list[int], slots: list[np.ndarray],
             pages: list[list[int]]) -> list[Node]:
        """``Node(first_id + i, parent, slots[i], pages[i])`` for each ``i``, each linked
        into its parent's ``children``: a child of ``top`` where ``parents[i] < 0``, else of
        new node ``parents[i] < i``.

        The attributes are set in one loop, without a constructor call per node: a draft
        tree brings hundreds of nodes each step.
        """
        new: list[Node] = []
        make, add = cls.__new__, new.append
        for i, p, own, pg in zip(range(first_id, first_id + len(parents)), parents, slots, pages):
            nd = make(cls)
            nd.id = i
            nd.parent = par = top if p < 0 else new[p]
            nd.children = {}
            nd.buf = nd.slots = own
            nd.n = len(own)
            nd.pages = pg
            nd.group_page = nd.dense = -1
            nd.start = par.start + par.n
            nd.expect = 0
            par.children[i] = nd
            add(nd)
        return new

    def hold(self, slots: np.ndarray) -> None:
        """Hold exactly ``slots [n]`` from now on (kept, not copied)."""
        self.buf = self.slots = slots
        self.n = len(slots)

    def extend(self, slots: np.ndarray) -> None:
        """Append ``slots [k]``, growing the buffer geometrically (amortised O(1) per slot)."""
        need = self.n + slots.shape[0]
        if need == self.n:
            return
        if need > self.buf.shape[0]:
            buf = np.empty(max(need, 2 * self.buf.shape[0], 4), _I)
            buf[: self.n] = self.slots
            self.buf = buf
        self.buf[self.n : need] = slots
        self.n = need
        self.slots = self.buf[:need]


class DenseNodes:
    """Live nodes in dense order, with each node's parent's dense index and its length.

    The two columns are ``array('q')`` (O(1) appends, pops and Python-int stores);
    :meth:`arrays` copies them out as numpy once per layout.
    """

    def __init__(self) -> None:
        self.order: list[Node] = []
        self._parent = array("q")  # [N] parent's dense index, -1 for roots
        self._lens = array("q")  # [N] tokens per node

    def __len__(self) -> int:
        return len(self.order)

    def add_all(self, nodes: list[Node], parents: np.ndarray | None = None,
                lens: np.ndarray | None = None) -> None:
        """Append ``nodes``, each after its parent.

        ``parents [m]`` (their parents' dense indices) and ``lens [m]`` (their lengths), int64,
        spare reading the nodes for the columns (a big subtree); both or neither.
        """
        for i, nd in enumerate(nodes, len(self.order)):
            nd.dense = i
        self.order += nodes
        if parents is None:
            self._parent.extend([nd.parent.dense if nd.parent is not None else -1 for nd in nodes])
            self._lens.extend([nd.n for nd in nodes])
        else:
            self._parent.frombytes(parents.astype(_I, copy=False).tobytes())
            self._lens.frombytes(lens.astype(_I, copy=False).tobytes())

    def remove(self, node: Node) -> None:
        """Drop childless ``node``; the last node takes its index (its children re-pointed)."""
        i, last = node.dense, self.order.pop()
        parent, n = self._parent.pop(), self._lens.pop()
        node.dense = -1
        if last is node:
            return
        self.order[i] = last
        last.dense = i
        self._parent[i], self._lens[i] = parent, n
        for child in last.children.values():
            self._parent[child.dense] = i

    def remove_all(self, nodes: list[Node]) -> None:
        """:meth:`remove` each of ``nodes`` in order (each childless by its turn).

        When they are the last ``len(nodes)`` dense nodes (a draft tree just added), no
        other node moves whatever the order, so the columns are cut at once.
        """
        cut = len(self.order) - len(nodes)
        if nodes and min(map(_dense, nodes)) < cut:
            for nd in nodes:
                self.remove(nd)
            return
        for nd in nodes:
            nd.dense = -1
        del self.order[cut:], self._parent[cut:], self._lens[cut:]

    def update(self, node: Node) -> None:
        """Refresh ``node``'s length and parent index after it changed."""
        self._parent[node.dense] = node.parent.dense if node.parent is not None else -1
        self._lens[node.dense] = node.n

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Fresh ``parents [N]``, ``node_kv_indptr [N + 1]`` and ``kv_indices [T]``."""
        indptr = np.zeros(len(self.order) + 1, _I)
        np.cumsum(np.array(self._lens, _I), out=indptr[1:])
        kv = join_slots([nd.slots for nd in self.order])
        return np.array(self._parent, _I), indptr, kv

    def lengths(self) -> np.ndarray:
        """Fresh ``[N]``: tokens of each dense node."""
        return np.array(self._lens, _I)

    def ids(self) -> np.ndarray:
        """``[N]`` node id of each dense index."""
        return np.fromiter((nd.id for nd in self.order), _I, len(self.order))
