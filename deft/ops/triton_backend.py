"""The ``triton`` backend: checks, workspaces and launches for ``triton_kernels``.

Per step (``refine_plan`` + ``prepare``, outside any CUDA graph): coarsen the DeFT-Flatten
tiles so every program streams about the same number of tokens, flag tiles whose slots
are consecutive (no slot loads) or fully visible (no mask), list the work items (query-row
chunks of each tile, largest tiles first, chunks of one tile adjacent so they share its KV
through L2), upload the plan arrays as int32 and allocate the fp32 partial-state
workspace. Per layer (``run``): two launches, no host synchronisation, and no allocation when the
caller passes the output tensors. Runs on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (with small blocks, for tests).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton

from ..layout import TreeLayout
from ..plan import TreePlan, coarsen_plan
from .triton_kernels import merge_kernel, tree_partial_kernel

__all__ = ["TritonBackend", "KernelConfig", "kernel_config"]


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch shape of the partial kernel."""

    block_m: int  # query rows (query, GQA head) per program
    block_n: int  # KV tokens per inner step
    num_warps: int
    num_stages: int
    waves: float  # programs per SM the coarsened launch aims for
    contig: bool = True  # when every tile's slots are consecutive, skip the slot loads
    fuse_merge: bool = False  # the last program of a row merges it (no merge launch)


# Keyed by head_dim. 128 is tuned on an H200 (tools/coarsen_sweep.py, docs/benchmarks.md);
# 64 follows it, 256 keeps 8 warps and 2 stages to fit its K/V blocks in shared memory.
_GPU_CONFIGS = {
    64: KernelConfig(64, 32, 4, 3, 4.0),
    128: KernelConfig(64, 32, 4, 3, 4.0),
    256: KernelConfig(64, 32, 8, 2, 4.0),
}
# Coarsened tiles are at least this many tokens (while the launch keeps one program per SM):
# shorter loops cost more in prologue and epilogue (loads of the work item and Q,
# partial-state stores) than they gain in balance.
_MIN_TILE_TOKENS = 256
_INTERPRET_CONFIG = KernelConfig(16, 16, 1, 1, 2.0)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_config(head_dim: int) -> KernelConfig:
    if interpreting():
        return _INTERPRET_CONFIG
    return _GPU_CONFIGS.get(head_dim, _GPU_CONFIGS[128])


@dataclass(frozen=True)
class _Prepared:
    config: KernelConfig
    arrays: dict[str, torch.Tensor]
    num_work: int
    num_queries: int
    partial_o: torch.Tensor  # [P, H_q, D] fp32
    partial_lse: torch.Tensor  # [P, H_q] fp32
    lse: torch.Tensor  # [Q, H_q] fp32 workspace for steps whose caller wants no lse
    needs_mask: bool
    contiguous: bool  # every tile's slots are consecutive (slot0 >= 0)
    sorted_queries: bool  # query_order is the identity
    counts: torch.Tensor | None  # [Q * H_q] int32 zeros when the merge is fused, else None


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _full_tiles(plan: TreePlan) -> np.ndarray:
    """``[T]`` 1 where every query of the tile's group sees every token of the tile.

    Token ``j`` is seen by the sorted queries whose node lies in ``[lo_j, hi_j)`` (a range
    ``[a_j, b_j)``), except queries on node ``lo_j`` itself with ``query_kv_len <= off_j``;
    the latter is checked against the smallest ``query_kv_len`` on that node (conservative).
    """
    if plan.num_tiles == 0:
        return np.zeros(0, np.int64)
    if not plan.needs_mask:
        return np.ones(plan.num_tiles, np.int64)
    num_nodes = int(plan.token_hi.max()) + 1
    first_q = np.searchsorted(plan.query_pre, np.arange(num_nodes + 1), side="left")
    a, b = first_q[plan.token_lo], first_q[plan.token_hi]
    min_len = np.full(num_nodes + 1, np.iinfo(np.int64).max)
    np.minimum.at(min_len, np.minimum(plan.query_pre, num_nodes), plan.query_len)
    tile = np.repeat(np.arange(plan.num_tiles), np.diff(plan.tile_indptr))
    ok = (a <= plan.tile_q_start[tile]) & (b >= plan.tile_q_end[tile])
    ok &= min_len[plan.token_lo] > plan.token_off
    return np.logical_and.reduceat(ok, plan.tile_indptr[:-1]).astype(np.int64)


def _tile_slot0(plan: TreePlan) -> np.ndarray:
    """``[T]`` first slot of each tile whose slots are consecutive, else -1."""
    if plan.num_tiles == 0:
        return np.zeros(0, np.int64)
    slots = plan.token_slots
    starts = plan.tile_indptr[:-1]
    step_ok = np.ones(slots.shape[0], bool)
    step_ok[1:] = slots[1:] == slots[:-1] + 1
    step_ok[starts] = True
    contig = np.logical_and.reduceat(step_ok, starts)
    return np.where(contig, slots[starts], -1)


def _work_items(plan: TreePlan, g: int, block_m: int) -> np.ndarray:
    """``[W, 8]`` descriptor of every program: the tile's ``tok0, tok1, q_start, q_end,
    first partial, full flag, slot0`` and the program's first row. Largest tiles come first;
    the row chunks of one tile are adjacent, so they share its K/V through L2."""
    rows = (plan.tile_q_end - plan.tile_q_start) * g
    chunks = -(-rows // block_m)
    order = np.argsort(-np.diff(plan.tile_indptr), kind="stable")
    tiles = np.repeat(order, chunks[order])
    first = np.cumsum(chunks[order]) - chunks[order]
    row0 = (np.arange(tiles.shape[0]) - np.repeat(first, chunks[order])) * block_m
    per_tile = np.stack([plan.tile_indptr[:-1], plan.tile_indptr[1:], plan.tile_q_start,
                         plan.tile_q_end, plan.partial_indptr[:-1], _full_tiles(plan),
                         _tile_slot0(plan)], axis=1)
    return np.concatenate([per_tile[tiles], row0[:, None]], axis=1)


class TritonBackend:
    """DeFT-Flatten on GPU: one partial-attention launch and one merge launch per layer."""

    name = "triton"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def refine_plan(self, plan: TreePlan, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                    device: torch.device) -> TreePlan:
        """Merge same-group tiles into tiles of about ``work / (waves * SMs)`` tokens.

        ``work`` counts (token, query-row chunk, KV head) triples, so each program streams
        about the same number of tokens. The length is at least ``_MIN_TILE_TOKENS`` unless
        that would leave fewer programs than SMs (single-sequence decoding), and is rounded
        down to a power of two of plan tiles: on an H200 sweep of the benchmark trees this
        is within 3% of the best fixed factor per tree on average.
        """
        if plan.num_tiles == 0:
            return plan
        cfg = kernel_config(head_dim)
        g = num_qo_heads // num_kv_heads
        chunks = -(-(plan.tile_q_end - plan.tile_q_start) * g // cfg.block_m)
        work = num_kv_heads * float((np.diff(plan.tile_indptr) * chunks).sum())
        sms = _num_sms(device)
        # Interpreted (tests): no floor, so tiny trees keep several tiles and merges.
        floor = 0 if interpreting() else min(_MIN_TILE_TOKENS, work / sms)
        length = max(floor, plan.block_kv, work / (cfg.waves * sms))
        factor = 2 ** max(0, math.floor(math.log2(length / plan.block_kv)))
        return coarsen_plan(plan, min(factor, 1024))

    def prepare(self, plan: TreePlan, layout: TreeLayout, device: torch.device,
                num_qo_heads: int, num_kv_heads: int, head_dim: int) -> _Prepared:
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"head_dim: the triton backend needs a power of two >= 16, got {head_dim}")
        cfg = kernel_config(head_dim)
        g = num_qo_heads // num_kv_heads
        work = _work_items(plan, g, cfg.block_m)
        host = {
            "tok_slot": plan.token_slots, "tok_lo": plan.token_lo, "tok_hi": plan.token_hi,
            "tok_off": plan.token_off, "work": work.reshape(-1),
            "q_order": plan.query_order, "q_pre": plan.query_pre, "q_len": plan.query_len,
            "merge_indptr": plan.merge_indptr, "merge_partials": plan.merge_partials,
        }
        # One int32 buffer, one host-to-device copy; the kernels get views into it.
        # Segments start at multiples of 4 elements, keeping every view 16-byte aligned.
        sizes = [a.shape[0] for a in host.values()]
        starts = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes])
        packed = np.zeros(int(starts[-1]), np.int32)
        for a, st in zip(host.values(), starts):
            packed[st:st + a.shape[0]] = a
        buf = torch.from_numpy(packed).to(device)
        arrays = {name: buf[st:st + n] for name, st, n in zip(host, starts.tolist(), sizes)}
        p = max(plan.num_partials, 1)
        return _Prepared(
            config=cfg, arrays=arrays, num_work=int(work.shape[0]),
            num_queries=plan.num_queries,
            partial_o=torch.empty(p, num_qo_heads, head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(p, num_qo_heads, dtype=torch.float32, device=device),
            lse=torch.empty(plan.num_queries, num_qo_heads, dtype=torch.float32, device=device),
            needs_mask=plan.needs_mask,
            contiguous=cfg.contig and bool((work[:, 6] >= 0).all()),
            sorted_queries=bool((plan.query_order == np.arange(plan.num_queries)).all()),
            # Fused merge needs every query to own a partial (else nobody writes its row).
            counts=torch.zeros(plan.num_queries * num_qo_heads, dtype=torch.int32, device=device)
            if cfg.fuse_merge and plan.num_queries and bool((np.diff(plan.merge_indptr) > 0).all())
            else None,
        )

    writes_out = True  # run/run_output write into caller-given tensors, allocating nothing

    def run(self, prepared: _Prepared, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, sm_scale: float, out: torch.Tensor | None = None,
            lse_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        lse = (torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
               if lse_out is None else lse_out)
        self._launch(prepared, q, k_cache, v_cache, sm_scale, o, lse)
        return o, lse

    def run_output(self, prepared: _Prepared, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, sm_scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Like :meth:`run` but only ``o``; the lse goes to the plan's workspace."""
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        self._launch(prepared, q, k_cache, v_cache, sm_scale, o, prepared.lse)
        return o

    def _launch(self, prepared: _Prepared, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, sm_scale: float, o: torch.Tensor, lse: torch.Tensor) -> None:
        """The step's two launches (one when the merge is fused), writing ``o`` and ``lse``."""
        nq, h_q, d = q.shape
        h_kv = k_cache.shape[1]
        if nq == 0:
            return
        q = q if q.stride(-1) == 1 else q.contiguous()
        a, cfg = prepared.arrays, prepared.config
        po, plse = prepared.partial_o, prepared.partial_lse
        fused = prepared.counts is not None
        if prepared.num_work:
            tree_partial_kernel[(prepared.num_work, h_kv)](
                q, k_cache, v_cache, po, plse,
                a["tok_slot"], a["tok_lo"], a["tok_hi"], a["tok_off"],
                a["work"], a["q_order"], a["q_pre"], a["q_len"],
                o, lse, prepared.counts if fused else a["merge_indptr"],
                a["merge_indptr"], a["merge_partials"],
                sm_scale * math.log2(math.e),
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                po.stride(0), po.stride(1), plse.stride(0), o.stride(0), o.stride(1), h_q,
                G=h_q // h_kv, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                USE_MASK=prepared.needs_mask, CONTIG=prepared.contiguous,
                SORTED=prepared.sorted_queries, FUSE_MERGE=fused,
                IEEE=q.dtype == torch.float32,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        if not fused:
            launch_merge(po, plse, o, lse, a["merge_indptr"], a["merge_partials"])


def launch_merge(po: torch.Tensor, plse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 indptr: torch.Tensor, indices: torch.Tensor) -> None:
    """Merge states ``po [P, H, D]``, ``plse [P, H]`` into ``o [N, H, D]``, ``lse [N, H]`` (CSR)."""
    n, h, d = o.shape
    merge_kernel[(n, h)](
        po, plse, o, lse, indptr, indices, h,
        po.stride(0), po.stride(1), plse.stride(0), o.stride(0), o.stride(1),
        D=d, BLOCK_S=4 if interpreting() else 16, num_warps=1 if interpreting() else 2,
    )
