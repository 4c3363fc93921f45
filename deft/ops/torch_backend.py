"""Exact plan executor in plain PyTorch: the CPU path, also correct on CUDA tensors.

Small steps run as one tile: per layer one gather, a masked matmul, a softmax and a matmul,
with the mask built once per plan. For larger steps ``plan`` sorts the plan's tiles into
buckets of equal padded shape (tile length and group size rounded up to a power of two or
1.5 times one), so ``run`` is a handful of batched matmuls per bucket: every tile's K/V is
gathered once and all queries of its group and all GQA heads of each KV head are computed
against it. Partial states are merged through the plan's reduction map, padded to a dense
``[Q, S]`` index. Accumulation is float32 (float64 inputs stay float64). ``flatten`` plans
and the visibility masks come from the compiled planner when it is built (the same arrays).

K/V of another dtype than ``q`` (16-bit, FP8) and scaled K/V are dequantised as gathered, exactly as
specified: ``k * k_scale`` in the accumulation dtype (one float32 rounding; exact in float64).

Non-finite K/V are isolated: gathered rows holding a NaN or ±inf are zeroed before any
matmul (a masked probability times 0 is exactly what it was times a finite value), and the
(query, head) pairs that see such a row of their KV head get NaN ``o`` and ``lse``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cache.pool import FP8
from ..layout import TreeLayout
from ..plan import TreePlan, make_plan, visible
from ..plan.compiled import flatten_tiles, tile_masks
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
    kv_dtypes = (torch.float16, torch.bfloat16, torch.float32, FP8)  # e.g. a 16-bit cache, fp32 q
    kv_scales = True
    # On one CPU core the one-tile path beats the tiled one up to ~2^18 pairs even when most
    # pairs are masked (prompts in a forest); past that its wasted work dominates.
    dense_limit = 1 << 18
    default_block_kv = 256

    def plan(self, layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
             device: torch.device, previous: object = None,
             kv_dtype: torch.dtype | None = None) -> _Prepared | _Dense:
        fast = flatten_tiles(layout, block_kv) if plan_kind == "flatten" else None
        plan, first = fast if fast is not None else (make_plan(layout, plan_kind, block_kv), None)
        g = heads.num_qo_heads // heads.num_kv_heads
        if plan.kind != "per_query" and plan.num_queries * plan.num_plan_tokens <= self.dense_limit:
            return _dense(plan, g, device)
        if first is None:
            first = mask_from(plan) if plan.needs_mask else plan.tile_indptr[1:]
        tile_len = plan.tile_indptr[1:] - plan.tile_indptr[:-1]
        group = plan.tile_q_end - plan.tile_q_start
        lp, gp = _pad_size(tile_len), _pad_size(group)
        # Tiles whose whole group sees all their tokens (``first``, the first token some
        # group query may not see, is the tile's end: most prompt tiles) need no per-token
        # visibility test: they form buckets of their own, without a mask when unpadded.
        partly = first < plan.tile_indptr[1:]
        order = np.lexsort((partly, gp, lp))  # tiles by bucket
        new = np.ones(order.shape[0] + 1, bool)
        lpo, gpo, pao = lp[order], gp[order], partly[order]
        new[1:-1] = (lpo[1:] != lpo[:-1]) | (gpo[1:] != gpo[:-1]) | (pao[1:] != pao[:-1])
        bounds = np.flatnonzero(new).tolist()
        firsts = order[bounds[:-1]]
        num_p = plan.num_partials
        buckets = []
        for s, e, l_pad, g_pad, part in zip(bounds[:-1], bounds[1:], lp[firsts].tolist(),
                                            gp[firsts].tolist(), partly[firsts].tolist()):
            tiles = order[s:e]
            t0, q0, lens, grp = (plan.tile_indptr[tiles], plan.tile_q_start[tiles],
                                 tile_len[tiles], group[tiles])
            t_pos = t0[:, None] + np.arange(l_pad)
            q_pos = q0[:, None] + np.arange(g_pad)
            pid = plan.partial_indptr[tiles, None] + np.arange(g_pad)
            t_ok = None if (lens == l_pad).all() else np.arange(l_pad) < lens[:, None]
            q_ok = None if (grp == g_pad).all() else np.arange(g_pad) < grp[:, None]
            if t_ok is not None:
                t_pos[~t_ok] = 0
            if q_ok is not None:
                q_pos[~q_ok] = 0
                pid[~q_ok] = num_p  # the dump row
            if part:
                mask = _masks(plan, t0, lens, q0, grp, g_pad, l_pad)
            elif t_ok is None and q_ok is None:
                mask = None
            else:
                mask = ((np.arange(g_pad) < grp[:, None])[:, :, None]
                        & (np.arange(l_pad) < lens[:, None])[:, None, :])
            buckets.append(
                _Bucket(
                    tok=_tensor(plan.token_slots[t_pos], device),
                    qry=_tensor(plan.query_order[q_pos], device),
                    mask=None if mask is None else _tensor(mask, device),
                    pid=_tensor(pid, device),
                    chunk=max(1, _SCORE_BUDGET // max(1, g_pad * l_pad)),
                )
            )
        count = plan.merge_indptr[1:] - plan.merge_indptr[:-1]
        width = int(count.max(initial=0))
        col = np.arange(width)
        pos = np.minimum(plan.merge_indptr[:-1, None] + col, max(num_p - 1, 0))
        merge_idx = np.where(col < count[:, None], plan.merge_partials[pos] if num_p else 0, num_p)
        return _Prepared(
            plan=plan,
            buckets=tuple(buckets),
            merge_idx=_tensor(merge_idx, device),
            num_partials=num_p,
        )

    def run(self, prepared: _Prepared | _Dense, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, sm_scale: float, *, out: torch.Tensor | None = None,
            lse_out: torch.Tensor | None = None, want_lse: bool = True,
            k_scale: object = None, v_scale: object = None, captured: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(prepared, _Dense):
            return _dense_attention(prepared, q, k_cache, v_cache, sm_scale, want_lse,
                                    k_scale, v_scale)
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
                    _rows(q, b.qry[sl]), _dequant(_rows(k_cache, b.tok[sl]), k_scale, acc),
                    _dequant(_rows(v_cache, b.tok[sl]), v_scale, acc),
                    None if b.mask is None else b.mask[sl], g, sm_scale, acc,
                )
                po[b.pid[sl]] = o
                plse[b.pid[sl]] = lse
        return _merge_partials(po, plse, prepared.merge_idx, q.dtype)


def _tensor(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """The new (writable) array ``x`` on ``device``; no copy on the CPU."""
    return torch.from_numpy(x).to(device)


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for an index tensor of any shape, through ``index_select`` (faster on CPU);
    FP8 rows as bytes (which every device's ``index_select`` takes)."""
    if x.dtype == FP8:
        return _rows(x.view(torch.uint8), idx).view(FP8)
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def _dequant(x: torch.Tensor, scale: torch.Tensor | float | None,
             dtype: torch.dtype) -> torch.Tensor:
    """Gathered rows ``x [..., H_kv, D]`` in ``dtype``, times ``scale`` (``[1]`` or ``[H_kv]``;
    ``None``: none)."""
    x = x.to(dtype)
    if scale is None:
        return x
    if isinstance(scale, torch.Tensor):
        scale = scale.to(dtype)[:, None]
    return x * scale


def _masks(plan: TreePlan, tok0: np.ndarray, tok_len: np.ndarray, q0: np.ndarray,
           group: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``[nt, rows, cols]`` bool: sorted query ``q0[t] + i`` sees plan token ``tok0[t] + j``
    (False past ``group[t]`` rows and ``tok_len[t]`` columns); compiled when built."""
    mask = tile_masks(plan, tok0, tok_len, q0, group, rows, cols)
    if mask is not None:
        return mask
    t_ok = np.arange(cols) < tok_len[:, None]
    t_pos = np.where(t_ok, tok0[:, None] + np.arange(cols), 0)[:, None, :]
    q_ok = np.arange(rows) < group[:, None]
    q_pos = np.where(q_ok, q0[:, None] + np.arange(rows), 0)[:, :, None]
    vis = visible(plan.query_pre[q_pos], plan.query_len[q_pos], plan.token_lo[t_pos],
                  plan.token_hi[t_pos], plan.token_off[t_pos])
    return vis & q_ok[:, :, None] & t_ok[:, None, :]


_NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf, as its bits


def _dense(plan: TreePlan, g: int, device: torch.device) -> _Dense:
    """Visibility of every plan token to every query (original query order), as a bias."""
    nq, n = plan.num_queries, plan.num_plan_tokens
    zero = np.zeros(1, np.int64)  # one tile of every token and query
    vis = _masks(plan, zero, zero + n, zero, zero + nq, nq, n)[0]  # [Q, N], sorted query order
    rank = np.empty(nq, np.int64)  # sorted position of each query
    rank[plan.query_order] = np.arange(nq)
    rows = np.repeat(rank, g)  # bias rows: (query, GQA head) pairs, original query order
    # 0.0 (all bits 0) where visible, -inf elsewhere, in one integer multiply.
    bias = (np.logical_not(vis).view(np.uint8) * _NEG_INF_BITS).view(np.float32)[rows]
    empty = np.flatnonzero(~vis.any(axis=1)[rows])
    return _Dense(plan=plan, slots=_tensor(plan.token_slots.copy(), device),
                  bias=_tensor(bias, device),
                  empty_rows=_tensor(empty, device) if empty.size else None)


def _dense_attention(
    prepared: _Dense, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    sm_scale: float, return_lse: bool, k_scale: torch.Tensor | float | None,
    v_scale: torch.Tensor | float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every query against every plan token: ``o [Q, H_q, D]`` and, if asked, ``lse [Q, H_q]``."""
    nq, h_q, d = q.shape
    h_kv = k_cache.shape[1]
    g = h_q // h_kv
    out_dtype = q.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = _dequant(_rows(k_cache, prepared.slots), k_scale, acc)  # [N, H_kv, D]
    v = _dequant(_rows(v_cache, prepared.slots), v_scale, acc)
    bias = prepared.bias if acc == torch.float32 else prepared.bias.double()
    q = q.to(acc)
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
    k: torch.Tensor,  # [nt, L, H_kv, D] in acc, dequantised (a copy of the cache rows)
    v: torch.Tensor,  # [nt, L, H_kv, D] likewise
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
    kh = k.permute(0, 2, 1, 3)  # [nt, H_kv, L, D]
    vh = v.permute(0, 2, 1, 3)
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
