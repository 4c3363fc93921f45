"""The prefix cache across requests: computed prompts kept in the tree, LRU-evicted.

A finished request's prompt node stays in the engine's tree (pinned: branch releases
stop there) as long as pages allow, and so does the path of a request's one answer
(prompt and answer: what a chat's next turn starts with). A new prompt forks from the longest path any cached
prompt shares with it (splitting a cached node where the shared part ends, nothing
copied) and prefills only the rest. Only unreferenced entries (no live children: no
request reads them) are evicted, oldest use first.

Lookups cost the prompt's length, not the cache's size: each entry is indexed under the
chained hashes of its first 1, 2, ... blocks of ``min_tokens`` tokens, so a prompt finds the
entries sharing its most blocks by one dict lookup per block, then compares the next block's
tokens with those entries only. The chosen path is compared token by token before it is
used (a hash collision falls back to comparing every entry). A prompt waiting for room is
looked up at every step; its answer is kept until an entry is added or the entry it names
is gone (losing other entries cannot lengthen a match), so a blocked 32k-token prompt is
hashed once, not at every step.

The server's gauge of pages on running requests' paths is the pages in use less the pages
only idle entries hold. The cache tracks which of its nodes (the entries and the nodes above
them: the *kept forest*) a running request reads, through the nodes of requests hanging
below them, and parks the pages of the others with the allocator
(:meth:`~deft.cache.PageAllocator.park`), which counts the pages every user of which is
parked as pages are shared and dropped. Keeping that up to date costs a look at the children
of each kept node that requests hang from, per step, and a node's pages when it turns idle
or is read again; never a walk over the tokens held.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Collection, Iterator

import numpy as np

from ..cache import TreeKVCache
from ..engine.prompts import common_prefix

__all__ = ["PrefixCache"]


class _Kept:
    """A node of the kept forest: whether running requests read it, and why."""

    __slots__ = ("parent", "kids", "active_kids", "anchor", "active", "pages")

    def __init__(self, parent: int, kids: int, active_kids: int, anchor: bool, active: bool) -> None:
        self.parent = parent  # its parent's id, -1 for a root
        self.kids = kids  # its kept children
        self.active_kids = active_kids  # its kept children whose ``active`` is set
        self.anchor = anchor  # it has children outside the kept forest: running requests' nodes
        self.active = active  # read by a running request: anchor or active_kids, once settled
        self.pages: list[int] | None = None  # its pages while parked


class PrefixCache:
    """Implements :class:`deft.engine.scheduling.PrefixStore` over one tree cache.

    ``min_tokens``: shortest shared prefix worth a fork (a page by default);
    ``max_entries`` bounds the bookkeeping. ``hits``/``lookups`` count matches, and
    ``hit_tokens`` the prompt tokens they spared.
    """

    def __init__(self, cache: TreeKVCache, min_tokens: int | None = None, max_entries: int = 4096) -> None:
        self.cache = cache
        self.min_tokens = cache.page_size if min_tokens is None else min_tokens
        self.max_entries = max_entries
        self.pinned: set[int] = set()
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # node -> its path tokens
        self._by_tokens: dict[tuple[int, ...], int] = {}  # path tokens -> node
        self._blocks: dict[int, set[int]] = {}  # chained hash of the first i blocks -> nodes
        self.hits = self.lookups = self.hit_tokens = 0
        self._kept: dict[int, _Kept] = {}  # every entry and every node above one
        self._anchors: set[int] = set()  # kept nodes with a request's node among their children
        self._dirty: set[int] = set()  # kept nodes whose children may have changed
        # id(tokens) -> (tokens, their length, the answer of ``cached``), while no entry is added
        self._answers: dict[int, tuple[list[int], int, tuple[int, int] | None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def cached(self, tokens: list[int]) -> tuple[int, int] | None:
        """The entry :meth:`match` would fork ``tokens`` from and how many of them its path
        holds, or ``None``; nothing counted, split or marked."""
        self._drop_dead()
        known = self._answers.get(id(tokens))
        if known is not None and known[0] is tokens and known[1] == len(tokens):
            found = known[2]
            if found is None or found[0] in self._entries:
                return found
        limit = len(tokens) - 1  # the last prompt token is fed: its logits start decoding
        best, best_len = self._longest(tokens, limit)
        found = None if best is None or best_len < self.min_tokens else (best, best_len)
        if len(self._answers) >= 64:  # the prompts waiting at the head of a queue
            self._answers.clear()
        self._answers[id(tokens)] = (tokens, len(tokens), found)
        return found

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """The node to fork ``tokens`` from and how many of them its path holds, or ``None``."""
        self.lookups += 1
        found = self.cached(tokens)
        if found is None:
            return None
        best, best_len = found
        self._entries.move_to_end(best)
        self.hits += 1
        self.hit_tokens += best_len
        point = self._fork_point(best, len(self._entries[best]), best_len)
        self._set_anchor(point, True)  # the request forks from it now
        return point, best_len

    def insert(self, tokens: list[int], node: int) -> bool:
        """Keep ``node`` (its path holds ``tokens``, computed) unless an entry holds them
        already; whether it was kept."""
        self._drop_dead()  # an entry whose node is gone must not stand in for this one
        key = tuple(tokens)
        if key in self._by_tokens:
            return False
        self._answers.clear()  # a new entry may match any prompt further
        self._entries[node], self._by_tokens[key] = key, node
        for h in self._chain(key, len(key)):
            self._blocks.setdefault(h, set()).add(node)
        self.pinned.add(node)
        self._keep(node)
        while len(self._entries) > self.max_entries and self._evict_one(spare=(node,)):
            pass
        return True

    def evict(self, pages: int, spare: Collection[int] = ()) -> None:
        """Release the least recently used unreferenced entries but ``spare`` until ``pages``
        more are free."""
        target = self.cache.num_free_pages + pages
        while self.cache.num_free_pages < target and self._evict_one(spare):
            pass

    def clear(self) -> None:
        """Release every unreferenced entry."""
        while self._evict_one():
            pass

    def idle_pages(self) -> int:
        """Pages in use that only entries no running request reads hold (the other pages in
        use lie on running requests' paths): the allocator's count, once this cache has
        settled which of its nodes the requests hanging below them read."""
        self._settle()
        return self.cache.allocator.num_parked

    # ------------------------------------------------------------ internals

    def _chain(self, tokens: tuple[int, ...] | list[int], limit: int) -> Iterator[int]:
        """Chained hashes of the full ``min_tokens`` blocks among ``tokens[:limit]``, made as
        they are read (a lookup stops hashing at its first miss)."""
        b, h = max(1, self.min_tokens), 0
        for end in range(b, min(limit, len(tokens)) + 1, b):
            h = hash((h, tuple(tokens[end - b:end])))
            yield h

    def _longest(self, tokens: list[int], limit: int) -> tuple[int | None, int]:
        """The entry sharing the longest prefix of ``tokens[:limit]``, and its length."""
        b, cands, depth = max(1, self.min_tokens), None, 0
        for h in self._chain(tokens, limit):
            found = self._blocks.get(h)
            if not found:
                break
            cands, depth = found, depth + 1
        if cands is None:
            return None, 0
        start, stop = depth * b, min(limit, (depth + 1) * b)
        best = max(cands, key=lambda n: common_prefix(self._entries[n], tokens, stop, start))
        common = common_prefix(self._entries[best], tokens, limit)
        if common < start:  # a hash collision: compare every entry
            best, common = None, 0
            for node, path in self._entries.items():
                c = common_prefix(path, tokens, limit)
                if c > common:
                    best, common = node, c
        return best, common

    def _forget(self, node: int) -> None:
        key = self._entries.pop(node)
        del self._by_tokens[key]
        for h in self._chain(key, len(key)):
            found = self._blocks[h]
            found.discard(node)
            if not found:
                del self._blocks[h]
        self.pinned.discard(node)

    def _evict_one(self, spare: Collection[int] = ()) -> bool:
        """Release the oldest unreferenced entry not in ``spare`` (about to be forked)."""
        self._drop_dead()
        cache = self.cache
        for node in self._entries:
            if node not in spare and not cache.children(node):
                self._forget(node)
                # What the prune below releases: the entry and the ancestors it alone used.
                gone, up = [node], cache.parent(node)
                while up >= 0 and up not in self.pinned and len(cache.children(up)) == 1:
                    gone.append(up)
                    up = cache.parent(up)
                for n in gone:  # unparked before their pages are dropped
                    self._unkeep(n)
                cache.prune(node, release_unused_ancestors=True, keep=self.pinned)
                return True
        return False

    def _drop_dead(self) -> None:
        """Forget the entries whose node is gone (a prompt pruned with its request)."""
        for node in [n for n in self._entries if not self.cache.is_live(n)]:
            self._forget(node)
            self._dirty.add(node)

    # -------------------------------------------- which kept nodes requests read

    def _keep(self, node: int) -> None:
        """Add entry ``node`` and the nodes above it to the kept forest, read (a request's
        node until the next settle says otherwise)."""
        cache, new, up = self.cache, [], node
        while up >= 0 and up not in self._kept:
            new.append(up)
            up = cache.parent(up)
        self._dirty.add(node)  # (a node above an entry already: pinned now)
        for n in reversed(new):  # each has one kept child, the next one, but the entry
            self._kept[n] = _Kept(cache.parent(n), int(n != node), int(n != node), anchor=True, active=True)
            self._anchors.add(n)
            self._dirty.add(n)
        if new and up >= 0:  # a kept node gains a read child
            k = self._kept[up]
            k.kids += 1
            k.active_kids += 1
            self._dirty.add(up)
            self._update(up)

    def _unkeep(self, node: int) -> None:
        """Take ``node`` out of the kept forest (going, or no entry below it any more)."""
        k = self._kept.pop(node)
        self._anchors.discard(node)
        self._unpark(k)
        parent = self._kept.get(k.parent)
        if parent is not None:
            parent.kids -= 1
            parent.active_kids -= k.active
            self._dirty.add(k.parent)

    def _settle(self) -> None:
        """Bring every kept node's ``active`` up to date: count the children of the nodes
        requests hang from and of those whose children changed."""
        cache, kept = self.cache, self._kept
        self._dirty |= self._anchors
        while self._dirty:
            node = self._dirty.pop()
            k = kept.get(node)
            if k is None:
                continue
            if not cache.is_live(node):
                self._unkeep(node)
            elif node not in self.pinned and not k.kids:
                self._unkeep(node)  # its entries went: a request's node now, if anything
            else:
                self._set_anchor(node, len(cache.children(node)) > k.kids)

    def _set_anchor(self, node: int, anchor: bool) -> None:
        self._kept[node].anchor = anchor
        if anchor:
            self._anchors.add(node)
        else:
            self._anchors.discard(node)
        self._update(node)

    def _update(self, node: int) -> None:
        """Re-derive ``node``'s ``active``; on a change, park or unpark its pages and tell
        its parent, up the kept forest."""
        k = self._kept[node]
        while True:
            active = k.anchor or k.active_kids > 0
            if active == k.active:
                return
            k.active = active
            if active:
                self._unpark(k)
            else:
                self._park(node, k)
            node, k = k.parent, self._kept.get(k.parent)
            if k is None:
                return
            k.active_kids += 1 if active else -1

    def _park(self, node: int, k: _Kept) -> None:
        k.pages = np.unique(self.cache.slots(node) // self.cache.page_size).tolist()
        self.cache.allocator.park(k.pages)

    def _unpark(self, k: _Kept) -> None:
        if k.pages is not None:
            self.cache.allocator.unpark(k.pages)
            k.pages = None

    def _split(self, node: int, at: int) -> int:
        """Split kept ``node`` before its token ``at`` (see :meth:`TreeKVCache.split`); the
        head, kept, as read as ``node`` was."""
        k = self._kept[node]
        parked = k.pages is not None
        self._unpark(k)  # its pages change
        head = self.cache.split(node, at)
        h = self._kept[head] = _Kept(k.parent, 1, int(k.active), anchor=False, active=k.active)
        k.parent = head
        if parked:
            self._park(node, k)
            self._park(head, h)
        return head

    def _fork_point(self, node: int, end: int, at: int) -> int:
        """The node whose path is the first ``at`` tokens of ``node``'s path (``end`` long),
        splitting the node that holds token ``at`` if ``at`` falls inside it."""
        cache = self.cache
        while True:
            start = end - cache.num_tokens(node)
            if at == end:
                return node
            if at > start:
                return self._split(node, at - start)
            node, end = cache.parent(node), start

