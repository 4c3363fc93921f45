"""Exact plan executor in plain PyTorch: the CPU path, also correct on CUDA tensors.

Small steps run as one tile: per layer one gather, a masked matmul, a softmax and a matmul,
with the mask built once per plan. For larger steps ``plan`` sorts the plan's tiles into
buckets of equal padded shape (tile length and group size rounded up to a power of two or
1.5 times one), so ``run`` is a handful of batched matmuls per bucket: every tile's K/V is
gathered once and all queries of its group and all GQA heads of each KV head are computed
against it. Partial states are merged through the plan's reduction map, padded to a dense
``[Q, S]`` index. Accumulation is float32 (float64 inputs stay float64).

Non-finite K/V are isolated: gathered rows holding a NaN or ±inf are zeroed before any
matmul (a masked probability times 0 is exactly what it was times a finite value), and the
(query, head) pairs that see such a row of their KV head get NaN ``o`` and ``lse``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..layout import TreeLayout
from ..plan import TreePlan, make_plan, visible
from ..plan.packing import mask_from
from .base import Backend, Heads

__all__ = ["TorchBackend"]

# Largest score block per batched matmul, in elements; bounds peak memory.
_SCORE_BUDGET = 1 << 24


@dataclass(frozen=True)
class _Bucket:
    tok: torch.Tensor  # [nt, L] cache slot of each tile token (0 where padded)
    qry: torch.Tensor  # [nt, G] original query index (0 where padded)
    mask: torch.Tensor | None  # [nt, G, L] bool, query sees token (False where padded); None: all
    pid: torch.Tensor  # [nt, G] partial id (num_partials where padded: a dump row)
    chunk: int  # tiles per batched matmul


@dataclass(frozen=True)
class _Prepared:
    plan: TreePlan
    buckets: tuple[_Bucket, ...]
    merge_idx: torch.Tensor  # [Q, S] partial ids per query, padded with num_partials
    num_partials: int


# Padded sizes: powers of two and 1.5x between them, so padding wastes at most a third.
_SIZES = np.unique(np.concatenate([1 << np.arange(31), 3 << np.arange(30)]))


def _pad_size(x: np.ndarray) -> np.ndarray:
    return _SIZES[np.searchsorted(_SIZES, np.maximum(x, 1))]


@dataclass(frozen=True)
class _Dense:
    """A small step as one tile: every plan token loaded once, all queries against it."""

    plan: TreePlan
    slots: torch.Tensor  # [N] cache slot of each plan token
    bias: torch.Tensor  # [Q * g, N] float32: 0 where visible, -inf elsewhere (rows: query, GQA head)
    empty_rows: torch.Tensor | None  # bias rows that see no token (softmax gives NaN there)


class TorchBackend(Backend):
    """Batched-tensor executor of any :class:`~deft.plan.TreePlan`.

    Steps with at most ``dense_limit`` (query, token) pairs — single-sequence decoding,
    small trees — run as one tile: one gather and two matmuls, no merge. Larger steps run
    tile by tile in padded buckets; one-tile steps skip the log-sum-exp unless asked for it.
    """

    name = "torch"
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    # On one CPU core the one-tile path beats the tiled one up to ~2^18 pairs even when most
    # pairs are masked (prompts in a forest); past that its wasted work dominates.
    dense_limit = 1 << 18
    default_block_kv = 256

    def plan(self, layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
             device: torch.device, previous: object = None) -> _Prepared | _Dense:
        plan = make_plan(layout, plan_kind, block_kv)
        if plan.kind != "per_query" and plan.num_queries * plan.num_plan_tokens <= self.dense_limit:
            return _dense(plan, heads.num_qo_heads // heads.num_kv_heads, device)
        tile_len = np.diff(plan.tile_indptr)
        group = plan.tile_q_end - plan.tile_q_start
        lp, gp = _pad_size(tile_len), _pad_size(group)
        buckets = []
        num_p = plan.num_partials
        # Tiles whose whole group sees all their tokens (most prompt tiles) need no
        # per-token visibility test: they form buckets of their own, without a mask when
        # unpadded; in the others, tokens before ``mask_from`` are seen by the whole group.
        first = mask_from(plan) if plan.needs_mask else plan.tile_indptr[1:]
        partly = first < plan.tile_indptr[1:]
        for l_pad, g_pad, part in sorted(set(zip(lp.tolist(), gp.tolist(), partly.tolist()))):
            tiles = np.flatnonzero((lp == l_pad) & (gp == g_pad) & (partly == part))
            t_pos = plan.tile_indptr[tiles, None] + np.arange(l_pad)
            t_ok = np.arange(l_pad) < tile_len[tiles, None]
            t_pos = np.where(t_ok, t_pos, 0)
            q_pos = plan.tile_q_start[tiles, None] + np.arange(g_pad)
            q_ok = np.arange(g_pad) < group[tiles, None]
            q_pos = np.where(q_ok, q_pos, 0)
            unpadded = bool(q_ok.all() and t_ok.all())
            mask = None if unpadded and not part else q_ok[:, :, None] & t_ok[:, None, :]
            if part:
                c0 = int((first[tiles] - plan.tile_indptr[tiles]).min())
                tp = t_pos[:, c0:]
                mask[:, :, c0:] &= visible(
                    plan.query_pre[q_pos][:, :, None], plan.query_len[q_pos][:, :, None],
                    plan.token_lo[tp][:, None, :], plan.token_hi[tp][:, None, :],
                    plan.token_off[tp][:, None, :])
            pid = plan.partial_indptr[tiles, None] + np.arange(g_pad)
            pid = np.where(q_ok, pid, num_p)
            per_tile = max(1, g_pad * l_pad)
            buckets.append(
                _Bucket(
                    tok=torch.as_tensor(plan.token_slots[t_pos], device=device),
                    qry=torch.as_tensor(plan.query_order[q_pos], device=device),
                    mask=None if mask is None else torch.as_tensor(mask, device=device),
                    pid=torch.as_tensor(pid, device=device),
                    chunk=max(1, _SCORE_BUDGET // per_tile),
                )
            )
        count = np.diff(plan.merge_indptr)
        width = int(count.max(initial=0))
        col = np.arange(width)
        pos = np.minimum(plan.merge_indptr[:-1, None] + col, max(num_p - 1, 0))
        merge_idx = np.where(col < count[:, None], plan.merge_partials[pos] if num_p else 0, num_p)
        return _Prepared(
            plan=plan,
            buckets=tuple(buckets),
            merge_idx=torch.as_tensor(merge_idx, device=device),
            num_partials=num_p,
        )

    def run(self, prepared: _Prepared | _Dense, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, sm_scale: float, *, out: torch.Tensor | None = None,
            lse_out: torch.Tensor | None = None,
            want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(prepared, _Dense):
            return _dense_attention(prepared, q, k_cache, v_cache, sm_scale, return_lse=want_lse)
        h_q, d = q.shape[1], q.shape[2]
        h_kv = k_cache.shape[1]
        g = h_q // h_kv
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        num_p = prepared.num_partials
        # One extra dump row absorbs the padded group slots.
        po = torch.zeros(num_p + 1, h_q, d, dtype=acc, device=q.device)
        plse = torch.full((num_p + 1, h_q), float("-inf"), dtype=acc, device=q.device)
        for b in prepared.buckets:
            for s in range(0, b.tok.shape[0], b.chunk):
                sl = slice(s, s + b.chunk)
                o, lse = _tile_attention(
                    _rows(q, b.qry[sl]), _rows(k_cache, b.tok[sl]), _rows(v_cache, b.tok[sl]),
                    None if b.mask is None else b.mask[sl], g, sm_scale, acc,
                )
                po[b.pid[sl]] = o
                plse[b.pid[sl]] = lse
        return _merge_partials(po, plse, prepared.merge_idx, q.dtype)


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for an index tensor of any shape, through ``index_select`` (faster on CPU)."""
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def _dense(plan: TreePlan, g: int, device: torch.device) -> _Dense:
    """Visibility of every plan token to every query (original query order), as a bias."""
    inv = np.empty_like(plan.query_order)
    inv[plan.query_order] = np.arange(plan.num_queries)
    pre, qlen = plan.query_pre[inv][:, None], plan.query_len[inv][:, None]
    lo, hi, off = plan.token_lo[None, :], plan.token_hi[None, :], plan.token_off[None, :]
    vis = visible(pre, qlen, lo, hi, off)  # [Q, N]
    rows = np.repeat(vis, g, axis=0)
    bias = np.where(rows, 0.0, -np.inf).astype(np.float32)
    empty = np.flatnonzero(~rows.any(axis=1))
    return _Dense(plan=plan, slots=torch.as_tensor(plan.token_slots.copy(), device=device),
                  bias=torch.as_tensor(bias, device=device),
                  empty_rows=torch.as_tensor(empty, device=device) if empty.size else None)


def _dense_attention(
    prepared: _Dense, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    sm_scale: float, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every query against every plan token: ``o [Q, H_q, D]`` and, if asked, ``lse [Q, H_q]``."""
    nq, h_q, d = q.shape
    h_kv = k_cache.shape[1]
    g = h_q // h_kv
    out_dtype = q.dtype
    k = k_cache.index_select(0, prepared.slots)  # [N, H_kv, D]
    v = v_cache.index_select(0, prepared.slots)
    bias = prepared.bias
    if q.dtype not in (torch.float32, torch.float64):
        q, k, v = q.float(), k.float(), v.float()
    elif q.dtype == torch.float64:
        bias = bias.double()
    bad = _sanitize(k, v)  # [N, H_kv] or None
    # Rows of one KV head: (query, GQA head) pairs, matching the bias rows.
    qh = q.reshape(nq, h_kv, g, d).transpose(0, 1).reshape(h_kv, nq * g, d)
    s = torch.baddbmm(bias, qh, k.permute(1, 2, 0), alpha=sm_scale)  # [H_kv, Q*g, N]
    p = torch.softmax(s, dim=-1)
    if prepared.empty_rows is not None:
        p.index_fill_(1, prepared.empty_rows, 0.0)  # their NaN rows: output 0
    o = torch.bmm(p, v.transpose(0, 1)).view(h_kv, nq, g, d).transpose(0, 1)
    o = o.reshape(nq, h_q, d).to(out_dtype)
    lse = None
    if return_lse:
        lse = torch.logsumexp(s, dim=-1)  # [H_kv, Q*g]; -inf for empty rows
        lse = lse.view(h_kv, nq, g).transpose(0, 1).reshape(nq, h_q).float()
    if bad is not None:
        seen = (bias == 0).to(k.dtype) @ bad.to(k.dtype) > 0  # [Q*g, H_kv]
        o, lse = _poison(o, lse, seen.view(nq, g, h_kv).transpose(1, 2).reshape(nq, h_q))
    return o, lse


def _tile_attention(
    q: torch.Tensor,  # [nt, G, H_q, D]
    k: torch.Tensor,  # [nt, L, H_kv, D]
    v: torch.Tensor,  # [nt, L, H_kv, D]
    mask: torch.Tensor | None,  # [nt, G, L]; None: every query sees every token
    g: int,
    sm_scale: float,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial states of every group query against its tile: ``[nt, G, H_q, D]``, ``[nt, G, H_q]``."""
    nt, gq, h_q, d = q.shape
    h_kv = k.shape[2]
    # Query rows of one KV head: (group query, GQA head) pairs, computed against one K load.
    qh = q.to(acc).view(nt, gq, h_kv, g, d).permute(0, 2, 1, 3, 4).reshape(nt, h_kv, gq * g, d)
    kh = k.to(acc).permute(0, 2, 1, 3)  # [nt, H_kv, L, D]
    vh = v.to(acc).permute(0, 2, 1, 3)
    bad = _sanitize(kh, vh)  # [nt, H_kv, L] or None
    s = torch.matmul(qh, kh.transpose(-1, -2)) * sm_scale  # [nt, H_kv, G*g, L]
    if mask is not None:
        m = mask[:, None, :, None, :].expand(nt, 1, gq, g, mask.shape[-1]).reshape(nt, 1, gq * g, -1)
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [nt, H_kv, G*g]
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    o = torch.matmul(p, vh)  # [nt, H_kv, G*g, D]
    o = o.view(nt, h_kv, gq, g, d).permute(0, 2, 1, 3, 4).reshape(nt, gq, h_q, d)
    lse = lse.view(nt, h_kv, gq, g).permute(0, 2, 1, 3).reshape(nt, gq, h_q)
    if bad is not None:
        if mask is None:
            seen = bad.any(-1)[:, None, :].expand(nt, gq, h_kv)
        else:
            seen = mask.to(acc) @ bad.transpose(1, 2).to(acc) > 0  # [nt, G, H_kv]
        o, lse = _poison(o, lse, seen.repeat_interleave(g, dim=2))
    return o, lse


def _sanitize(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """Zero the NaN/±inf values of the gathered ``k, v [..., D]`` (copies of the cache) in
    place; return which rows ``[...]`` held one, or ``None`` if none can have.

    Any NaN or inf makes a sum non-finite, so on CPU one reduction per tensor clears clean
    K/V; elsewhere the exact test always runs (reading the sum would synchronise).
    """
    if k.device.type == "cpu" and bool(torch.isfinite(k.sum() + v.sum())):
        return None
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    k.nan_to_num_(0.0, 0.0, 0.0)
    v.nan_to_num_(0.0, 0.0, 0.0)
    return bad


def _poison(o: torch.Tensor, lse: torch.Tensor | None,
            seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """NaN ``o [..., H_q, D]`` and ``lse [..., H_q]`` where ``seen [..., H_q]``: the (query,
    head) pairs that see a non-finite K/V row."""
    nan = float("nan")
    return o.masked_fill(seen[..., None], nan), None if lse is None else lse.masked_fill(seen, nan)


def _merge_partials(
    po: torch.Tensor,  # [P + 1, H_q, D]; row P is an empty state
    plse: torch.Tensor,  # [P + 1, H_q]
    merge_idx: torch.Tensor,  # [Q, S] partial ids of each query, padded with P
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of each query's partial states (a query with none gets 0, -inf)."""
    s = plse[merge_idx]  # [Q, S, H_q]
    m = s.amax(dim=1) if s.shape[1] else s.new_full((s.shape[0], s.shape[2]), float("-inf"))
    m = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(s - m[:, None, :])  # [Q, S, H_q]; 0 for empty states
    den = w.sum(dim=1)
    o = torch.einsum("qsh,qshd->qhd", w, po[merge_idx])
    o = o / torch.where(den > 0, den, 1.0).unsqueeze(-1)
    return o.to(out_dtype), (m + torch.log(den)).float()
