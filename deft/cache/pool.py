"""Per-layer paged K/V tensors: the memory a tree cache hands out page by page."""

from __future__ import annotations

import torch

from ..checks import positive_int

__all__ = ["KVPool"]


class KVPool:
    """K and V pools of every layer, each ``[num_pages, page_size, num_kv_heads, head_dim]``.

    Slot ``s`` is row ``s`` of ``k[layer].view(-1, num_kv_heads, head_dim)``
    (page ``s // page_size``, offset ``s % page_size``). The pool holds tensors only;
    which slots are in use is the cache's bookkeeping.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        num_layers, num_pages = positive_int(num_layers, "num_layers"), positive_int(num_pages, "num_pages")
        page_size = positive_int(page_size, "page_size")
        num_kv_heads, head_dim = positive_int(num_kv_heads, "num_kv_heads"), positive_int(head_dim, "head_dim")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [N, num_kv_heads, head_dim]`` at ``slots [N]`` of ``layer``."""
        h, d = self.num_kv_heads, self.head_dim
        self.k[layer].view(-1, h, d)[slots] = k.to(self.k[layer].dtype)
        self.v[layer].view(-1, h, d)[slots] = v.to(self.v[layer].dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V rows ``src [N]`` to ``dst [N]`` in every layer (e.g. a partly filled page)."""
        h, d = self.num_kv_heads, self.head_dim
        for layer in range(self.num_layers):
            for pool in (self.k[layer], self.v[layer]):
                flat = pool.view(-1, h, d)
                flat[dst] = flat[src]
