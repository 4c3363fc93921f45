"""Paged tree KV cache: K/V pools, a refcounted page allocator, slot bookkeeping and the node tree."""

from .pages import CacheFullError, PageAllocator
from .pool import KVPool, KVSpec
from .slots import SlotAllocator
from .tree import TreeKVCache

__all__ = ["CacheFullError", "KVPool", "KVSpec", "PageAllocator", "SlotAllocator", "TreeKVCache"]
