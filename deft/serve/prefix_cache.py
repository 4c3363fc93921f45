"""The prefix cache across requests: computed prompts kept in the tree, LRU-evicted.

A finished request's prompt node stays in the engine's tree (pinned: branch releases
stop there) as long as pages allow. A new prompt forks from the longest path any cached
prompt shares with it (splitting a cached node where the shared part ends, nothing
copied) and prefills only the rest. Only unreferenced entries (no live children: no
request reads them) are evicted, oldest use first.
"""

from __future__ import annotations

from collections import OrderedDict

from ..cache import TreeKVCache

__all__ = ["PrefixCache"]


class PrefixCache:
    """Implements :class:`deft.engine.decoding.PrefixStore` over one tree cache.

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
        self.hits = self.lookups = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """The node to fork ``tokens`` from and how many of them its path holds, or ``None``."""
        self.lookups += 1
        self._drop_dead()
        best, best_len = None, 0
        limit = len(tokens) - 1  # the last prompt token is fed: its logits start decoding
        for node, path in self._entries.items():
            common = _common_prefix(path, tokens, limit)
            if common > best_len:
                best, best_len = node, common
        if best is None or best_len < self.min_tokens:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.hit_tokens += best_len
        return self._fork_point(best, len(self._entries[best]), best_len), best_len

    def insert(self, tokens: list[int], node: int) -> None:
        """Keep ``node`` (its path holds ``tokens``, computed) unless an entry holds them already."""
        key = tuple(tokens)
        if key in self._entries.values():
            return
        self._entries[node] = key
        self.pinned.add(node)
        while len(self._entries) > self.max_entries and self._evict_one(spare=node):
            pass

    def evict(self, pages: int) -> None:
        """Release the least recently used unreferenced entries until ``pages`` more are free."""
        target = self.cache.num_free_pages + pages
        while self.cache.num_free_pages < target and self._evict_one():
            pass

    def clear(self) -> None:
        """Release every unreferenced entry."""
        while self._evict_one():
            pass

    # ------------------------------------------------------------ internals

    def _evict_one(self, spare: int | None = None) -> bool:
        """Release the oldest unreferenced entry but ``spare`` (one about to be forked)."""
        self._drop_dead()
        for node in self._entries:
            if node != spare and not self.cache.children(node):
                del self._entries[node]
                self.pinned.discard(node)
                self.cache.prune(node, release_unused_ancestors=True, keep=self.pinned)
                return True
        return False

    def _drop_dead(self) -> None:
        live = set(self.cache.live_nodes)
        for node in [n for n in self._entries if n not in live]:
            del self._entries[node]
            self.pinned.discard(node)

    def _fork_point(self, node: int, end: int, at: int) -> int:
        """The node whose path is the first ``at`` tokens of ``node``'s path (``end`` long),
        splitting the node that holds token ``at`` if ``at`` falls inside it."""
        cache = self.cache
        while True:
            start = end - cache.num_tokens(node)
            if at == end:
                return node
            if at > start:
                return cache.split(node, at - start)
            node, end = cache.parent(node), start


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
