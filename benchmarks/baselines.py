"""Baselines measured beside DeFT: per-query SDPA and FlexAttention with the tree mask.

Both take the same inputs as ``TreeAttention.run`` and return ``o [Q, H_q, D]``; their
set-up (materialising per-query KV, building the block mask) happens once, outside the
timed call, which favours the baselines.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deft.layout import TreeLayout
from deft.ops.reference import visibility_mask

__all__ = ["sdpa_per_query", "flex_tree_attention"]


def sdpa_per_query(layout: TreeLayout, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, sm_scale: float) -> Callable[[], torch.Tensor]:
    """Each query attends to its own materialised, padded copy of its path's KV (one SDPA call)."""
    vis = torch.as_tensor(visibility_mask(layout), device=q.device)  # [Q, T]
    slots = torch.tensor(layout.kv_indices, device=q.device)
    lens = vis.sum(1)
    lmax = max(int(lens.max()), 1) if lens.numel() else 1
    # Visible token positions of each query, left-aligned and padded.
    order = torch.argsort((~vis).to(torch.int8), dim=1, stable=True)[:, :lmax]
    valid = torch.arange(lmax, device=q.device)[None, :] < lens[:, None]
    idx = slots[order]
    k = k_cache.reshape(-1, *k_cache.shape[-2:])[idx].transpose(1, 2).contiguous()  # [Q, H_kv, L, D]
    v = v_cache.reshape(-1, *v_cache.shape[-2:])[idx].transpose(1, 2).contiguous()
    mask = valid[:, None, None, :]
    qb = q[:, :, None, :]  # [Q, H_q, 1, D]
    gqa = q.shape[1] != k.shape[1]

    def run() -> torch.Tensor:
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=gqa)
        return o[:, :, 0, :]

    return run


def flex_tree_attention(layout: TreeLayout, q: torch.Tensor, k_caches: list[torch.Tensor],
                        v_caches: list[torch.Tensor], sm_scale: float,
                        kernel_options: dict | None = None) -> Callable[[int], torch.Tensor]:
    """Compiled FlexAttention over the tree's tokens with the visibility mask as a block mask.

    Returns ``run(layer)``; the block mask is built once and every layer's K/V is gathered
    into layout order once (a view when the layout's slots are already ``0..T-1``).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    vis = torch.as_tensor(visibility_mask(layout), device=q.device)
    nq, nt = vis.shape

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001
        return vis[q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, None, None, nq, nt, device=str(q.device))
    identity = bool((layout.kv_indices == range(nt)).all())
    slots = torch.tensor(layout.kv_indices, device=q.device)

    def bhtd(cache: torch.Tensor) -> torch.Tensor:
        flat = cache.reshape(-1, *cache.shape[-2:])
        return (flat[:nt] if identity else flat[slots]).transpose(0, 1)[None]  # [1, H_kv, T, D]

    ks = [bhtd(k) for k in k_caches]
    vs = [bhtd(v) for v in v_caches]
    qb = q.transpose(0, 1)[None].contiguous()  # [1, H_q, Q, D]
    compiled = torch.compile(flex_attention, dynamic=False)
    gqa = q.shape[1] != k_caches[0].shape[-2]

    def run(layer: int = 0) -> torch.Tensor:
        o = compiled(qb, ks[layer], vs[layer], block_mask=block_mask, scale=sm_scale,
                     enable_gqa=gqa, kernel_options=kernel_options)
        return o[0].transpose(0, 1)

    return run
