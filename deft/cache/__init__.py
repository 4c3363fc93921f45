"""Paged tree KV cache: K/V pools, a refcounted page allocator and the node tree."""

from .pages import CacheFullError, PageAllocator
from .pool import KVPool
from .tree import TreeKVCache

__all__ = ["CacheFullError", "KVPool", "PageAllocator", "TreeKVCache"]
