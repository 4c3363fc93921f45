"""Dense masked attention in float64: the independent reference the tests compare against.

It reads the layout directly (never the plan), builds the full ``[Q, num_tokens]``
visibility mask by walking ancestors, and runs plain softmax attention. It is also the
specification of non-finite K/V: a (query, head) that sees a token whose K or V row of its
KV head holds a NaN or ±inf gets NaN ``o`` and ``lse``; every other (query, head) is exactly
what it would be with any finite values in the rows it does not see.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..layout import TreeLayout
from ..plan import TreePlan, make_plan
from .base import Backend, Heads

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
    """Float64 ``(o [Q, H_q, D], lse [Q, H_q])``; a query that sees nothing gets 0 and -inf,
    a (query, head) that sees a non-finite K/V row of its KV head NaN and NaN."""
    h_q, h_kv = q.shape[1], k_cache.shape[-2]
    slots = torch.tensor(layout.kv_indices, device=q.device)
    k = k_cache.reshape(-1, h_kv, k_cache.shape[-1])[slots].double()
    v = v_cache.reshape(-1, h_kv, v_cache.shape[-1])[slots].double()
    g = h_q // h_kv
    k = k.repeat_interleave(g, dim=1)  # [T, H_q, D]
    v = v.repeat_interleave(g, dim=1)
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [T, H_q]
    k, v = (torch.where(torch.isfinite(x), x, 0.0) for x in (k, v))
    scores = torch.einsum("qhd,thd->hqt", q.double(), k) * sm_scale
    mask = torch.as_tensor(visibility_mask(layout), device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Q]
    p = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    o = torch.einsum("hqt,thd->qhd", p, v)
    seen = (mask[None] & bad.T[:, None, :]).any(-1).T  # [Q, H_q]
    return o.masked_fill(seen[..., None], float("nan")), lse.T.masked_fill(seen, float("nan"))


@dataclass(frozen=True)
class _Step:
    plan: TreePlan
    layout: TreeLayout


class ReferenceBackend(Backend):
    """Registry adapter for :func:`reference_attention` (tests only; slow). It reads the
    layout, not the plan: an oracle independent of the planner."""

    name = "reference"
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def plan(self, layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
             device: torch.device, previous: object = None,
             kv_dtype: torch.dtype | None = None) -> _Step:
        return _Step(make_plan(layout, plan_kind, block_kv), layout)

    def run(self, prepared: _Step, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, sm_scale: float, *, out: torch.Tensor | None = None,
            lse_out: torch.Tensor | None = None, want_lse: bool = True,
            k_scale: object = None, v_scale: object = None, captured: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = reference_attention(q, k_cache, v_cache, prepared.layout, sm_scale)
        return o.to(q.dtype), lse.float()
