"""Dense masked attention in float64: the independent reference the tests compare against.

It reads the layout directly (never the plan), builds the full ``[Q, num_tokens]``
visibility mask by walking ancestors, and runs plain softmax attention.
"""

from __future__ import annotations

import numpy as np
import torch

from ..layout import TreeLayout
from ..plan import TreePlan

__all__ = ["ReferenceBackend", "visibility_mask", "reference_attention"]


def visibility_mask(layout: TreeLayout) -> np.ndarray:
    """``[num_queries, num_tokens]`` bool: query i sees layout token j (``kv_indices`` order)."""
    n, nq, nt = layout.num_nodes, layout.num_queries, layout.num_tokens
    node_of_tok = np.repeat(np.arange(n), layout.node_lens)
    off = np.arange(nt) - layout.node_kv_indptr[node_of_tok]
    mask = np.zeros((nq, nt), dtype=bool)
    for i in range(nq):
        own = int(layout.query_nodes[i])
        mask[i] |= (node_of_tok == own) & (off < layout.query_kv_lens[i])
        anc = int(layout.parents[own])
        while anc >= 0:
            mask[i] |= node_of_tok == anc
            anc = int(layout.parents[anc])
    return mask


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: TreeLayout,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(o [Q, H_q, D], lse [Q, H_q])``; a query that sees nothing gets 0 and -inf."""
    h_q, h_kv = q.shape[1], k_cache.shape[-2]
    slots = torch.tensor(layout.kv_indices, device=q.device)
    k = k_cache.reshape(-1, h_kv, k_cache.shape[-1])[slots].double()
    v = v_cache.reshape(-1, h_kv, v_cache.shape[-1])[slots].double()
    g = h_q // h_kv
    k = k.repeat_interleave(g, dim=1)  # [T, H_q, D]
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q.double(), k) * sm_scale
    mask = torch.as_tensor(visibility_mask(layout), device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Q]
    p = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    o = torch.einsum("hqt,thd->qhd", p, v)
    return o, lse.transpose(0, 1).contiguous()


class ReferenceBackend:
    """Registry adapter for :func:`reference_attention` (tests only; slow)."""

    name = "reference"
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def prepare(self, plan: TreePlan, layout: TreeLayout, device: torch.device,
                num_qo_heads: int, num_kv_heads: int, head_dim: int) -> TreeLayout:
        return layout

    def run(self, prepared: TreeLayout, q, k_cache, v_cache, sm_scale):  # noqa: ANN001
        o, lse = reference_attention(q, k_cache, v_cache, prepared, sm_scale)
        return o.to(q.dtype), lse.float()
