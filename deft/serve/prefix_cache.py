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
used (a hash collision falls back to comparing every entry).
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
        self._by_tokens: dict[tuple[int, ...], int] = {}  # path tokens -> node
        self._blocks: dict[int, set[int]] = {}  # chained hash of the first i blocks -> nodes
        self.hits = self.lookups = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """The node to fork ``tokens`` from and how many of them its path holds, or ``None``."""
        self.lookups += 1
        self._drop_dead()
        limit = len(tokens) - 1  # the last prompt token is fed: its logits start decoding
        best, best_len = self._longest(tokens, limit)
        if best is None or best_len < self.min_tokens:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.hit_tokens += best_len
        return self._fork_point(best, len(self._entries[best]), best_len), best_len

    def insert(self, tokens: list[int], node: int) -> bool:
        """Keep ``node`` (its path holds ``tokens``, computed) unless an entry holds them
        already; whether it was kept."""
        self._drop_dead()  # an entry whose node is gone must not stand in for this one
        key = tuple(tokens)
        if key in self._by_tokens:
            return False
        self._entries[node], self._by_tokens[key] = key, node
        for h in self._chain(key, len(key)):
            self._blocks.setdefault(h, set()).add(node)
        self.pinned.add(node)
        while len(self._entries) > self.max_entries and self._evict_one(spare=node):
            pass
        return True

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

    def _chain(self, tokens: tuple[int, ...] | list[int], limit: int) -> list[int]:
        """Chained hashes of the full ``min_tokens`` blocks among ``tokens[:limit]``."""
        b, h, out = max(1, self.min_tokens), 0, []
        for end in range(b, min(limit, len(tokens)) + 1, b):
            h = hash((h, tuple(tokens[end - b:end])))
            out.append(h)
        return out

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
        best = max(cands, key=lambda n: _common_prefix(self._entries[n], tokens, stop, start))
        common = _common_prefix(self._entries[best], tokens, limit)
        if common < start:  # a hash collision: compare every entry
            best, common = None, 0
            for node, path in self._entries.items():
                c = _common_prefix(path, tokens, limit)
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

    def _evict_one(self, spare: int | None = None) -> bool:
        """Release the oldest unreferenced entry but ``spare`` (one about to be forked)."""
        self._drop_dead()
        for node in self._entries:
            if node != spare and not self.cache.children(node):
                self._forget(node)
                self.cache.prune(node, release_unused_ancestors=True, keep=self.pinned)
                return True
        return False

    def _drop_dead(self) -> None:
        live = set(self.cache.live_nodes)
        for node in [n for n in self._entries if n not in live]:
            self._forget(node)

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


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int, start: int = 0) -> int:
    """Where ``a`` and ``b`` first differ within ``limit`` (they agree before ``start``)."""
    n = min(len(a), len(b), limit)
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
