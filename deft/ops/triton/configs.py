"""Tuning of the ``triton`` backend, as data: one flat table of kernel configs.

``CONFIGS`` is keyed by ``(arch, head_dim, rows_from)``: the config of steps of at least
``rows_from`` (query, query head) rows on GPUs of that architecture (``"sm90"``, or
``"interpreter"`` for ``TRITON_INTERPRET=1``, whose key takes any head_dim as 0). A GPU
without rows in the table uses ``DEFAULT_ARCH``'s, a head_dim without rows uses
``DEFAULT_HEAD_DIM``'s. Why each entry was chosen is in docs/decisions.md;
``python -m benchmarks.sweep`` reruns the sweeps.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..runtime import capability, interpreting

__all__ = ["KernelConfig", "CONFIGS", "kernel_config", "kv_config", "few_rows_config",
           "light_config", "interpreting", "arch_of", "block_head_dim"]


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch shape of the partial and merge kernels, and the parameters of
    the coarsening rule and launch model that size their programs."""

    block_m: int  # query rows (query, GQA head) per program
    block_n: int  # KV tokens per inner step
    num_warps: int
    num_stages: int
    waves: float  # programs per SM the coarsened launch aims for
    contig: bool = True  # when every tile's slots are consecutive, skip the slot loads
    tma: bool = False  # with contig: such tiles' K/V by TMA (sm_90+, in CUDA-graph capture only)
    fuse_merge: bool = False  # the last program of a row merges it (no merge launch)
    maxnreg: int | None = None  # register cap per thread (more programs per SM, maybe spills)
    # Over one-byte (FP8) K/V, whose conversion goes through shared memory in the inner loop,
    # the partial kernel launches with these instead of ``maxnreg`` and ``block_n`` (None:
    # the same): where a third program per SM hides the round trip's latency better than
    # spills cost, a cap keeps it; longer blocks make fewer round trips where many rows
    # share each block.
    kv8_maxnreg: int | None = None
    kv8_block_n: int | None = None
    # Over one-byte K/V, plans whose tiles of at most ``kv8_few_rows[0]`` rows hold at least
    # ``kv8_few_share`` of the token work (``deft.plan.packing.few_rows_share``) run programs
    # of ``kv8_few_rows`` (rows, tokens per block) instead: below 64 rows the dots run on
    # ``mma.sync`` with the converted K/V in registers, skipping the shared-memory round
    # trip, but re-read a block once per ``kv8_few_rows[0]`` rows of a tile.
    kv8_few_rows: tuple[int, int] | None = None
    kv8_few_maxnreg: int | None = None  # the few-row build's ``kv8_maxnreg``
    kv8_few_share: float = 0.1
    # Plans whose programs (work items times KV heads) fit one wave of ``light_per_sm``
    # programs per SM launch ``light_config`` instead: this config without its register cap,
    # which keeps that many programs per SM, none spilling. Under the cap a third program
    # per SM hides the loads of longer steps; in a step this small no program waits for a
    # slot, and each one's own speed paces it.
    light_per_sm: int | None = None
    pdl: bool = False  # programmatic dependent launch (sm_90+): starts before the last launch ends
    merge_block: int = 16  # partial states per step of the merge kernel
    merge_warps: int = 2  # warps per merge program
    merge_heads: int = 1  # query heads per merge program (a power of two)
    # Partial o stored in q's dtype for fp16/bf16 (fp32 for fp32): half the bytes the partial
    # kernel writes and the merge reads; lse stays fp32. Each partial is a weighted mean of V
    # rows, so rounding it costs about one more rounding of the output.
    narrow_partials: bool = False
    min_tile_tokens: int = 384  # coarsened tiles' floor, unless it leaves fewer programs than SMs
    max_coarsen: int = 1024  # at most this many plan tiles per coarsened tile
    programs_per_sm: int = 3  # partial-kernel programs per SM in the launch model
    # Programs the partial kernel really keeps per SM when it launches without a register cap
    # (``maxnreg`` None) and its registers allow fewer than ``programs_per_sm`` (None: as
    # many): coarsening may then lengthen tiles to fit one such wave
    # (``deft.plan.coarsen.resident_wave``).
    resident_per_sm: int | None = None
    program_cost: int = 128  # a program's fixed cost in tokens: work item and Q loads, stores
    graph_waves: int = 1  # graph-safe launches: a grid of this many waves of programs
    # A tile's masked loop starts at the block boundary at or before its ``mask_from``, so
    # its unmasked loop has no partial last block (run outside the pipelined loop).
    # ``kv8_aligned_mask``: the same over one-byte K/V.
    aligned_mask: bool = False
    kv8_aligned_mask: bool = False
    # A masked TMA block issues its tokens' range loads before its K load, so that a block
    # outside the pipelined loop waits for both at once. ``kv8_ranges_first``: the same over
    # one-byte K/V.
    ranges_first: bool = False
    kv8_ranges_first: bool = False
    # Coarsening cuts a run's masked last plan tile off into a tile of its own
    # (``deft.plan.coarsen.coarsen_plan``).
    masked_apart: bool = False
    # The launch model charges a tile with a masked part this many tokens more
    # (``deft.plan.coarsen.Coarsening.masked_cost``).
    masked_cost: int = 0
    # Flatten plans also cut at nodes of at least this many tokens where the launch model
    # says so (``deft.plan.coarsen.Coarsening.node_cut``; 0: never).
    node_cut: int = 0
    # Over e4m3 K (no infinities) and a 16-bit q, no score is made NaN for being -inf: only
    # a ±inf K value or an fp32 overflow could give one (``softmax.no_neg_inf``).
    e4m3_finite_scores: bool = False
    # Masked blocks leave V's values unchecked; a work item whose state comes out non-finite
    # is computed again with the checks (``kernels._work_item``). ``kv8_deferred_v_checks``:
    # the same over one-byte K/V.
    deferred_v_checks: bool = False
    kv8_deferred_v_checks: bool = False
    # Graph-safe launches read from the plan's header whether its queries are in plan order
    # (which trees' are: docs/decisions.md) and then load no query order before a work
    # item's Q rows.
    header_in_order: bool = False
    # A work item's query order, prefixes and lengths (stream-ordered plan arrays, like its
    # description) load before the PDL wait, not after it.
    early_item_loads: bool = False
    # A work item's end reads whether a row is non-finite from the row's sum (its values
    # tested one by one only where some row's sum is not finite): the epilogue's check and
    # the deferred V checks' (``softmax.bad_rows_by_sum``). ``kv8_sum_checks``: the same
    # over one-byte K/V.
    sum_checks: bool = False
    kv8_sum_checks: bool = False
    # In the unmasked blocks, a -inf score makes its probability NaN through the exponent's
    # FMA (``score * 0`` is NaN only for a non-finite score) instead of a test and a select
    # of every score (``softmax.softmax_step``).
    inf_by_fma: bool = False
    # A work item's end checks its accumulator's rows once (the deferred V checks' test
    # reused) instead of its output's, and marks a bad row's state by its NaN lse alone,
    # which every merge turns into a NaN row, instead of also selecting NaN into each of
    # its o values (``kernels._work_item``).
    acc_checks: bool = False

    def inf_k(self, k_dtype: torch.dtype, q_dtype: torch.dtype) -> int:
        """How the partial kernel makes -inf scores NaN over K of ``k_dtype`` and q of
        ``q_dtype`` (its ``INF_K``): 0 not at all (over e4m3 K and a 16-bit q under
        ``e4m3_finite_scores``), else 1 by a select of every score, or 2 under
        ``inf_by_fma``: by an FMA in the unmasked blocks, a select in the others."""
        if (self.e4m3_finite_scores and k_dtype == torch.float8_e4m3fn
                and q_dtype.itemsize == 2):
            return 0
        return 2 if self.inf_by_fma else 1


# Deferred V checks and row checks by sums over 16-bit K/V only, the masked tiles' aligned
# loop with ranges first (over one-byte K/V only where a config says so), finite scores over
# e4m3 K, -inf scores by an FMA, checks on the accumulator, a work item's loads before the
# PDL wait, masked tiles apart and charged 128 tokens: docs/decisions.md.
_SM90 = dict(tma=True, pdl=True, graph_waves=3, kv8_maxnreg=168, deferred_v_checks=True,
             e4m3_finite_scores=True, sum_checks=True, inf_by_fma=True, acc_checks=True,
             early_item_loads=True, masked_apart=True, masked_cost=128, node_cut=32,
             aligned_mask=True, ranges_first=True)
_NARROW = dict(_SM90, narrow_partials=True, maxnreg=168, kv8_block_n=64)
CONFIGS: dict[tuple[str, int, int], KernelConfig] = {
    ("sm90", 64, 0): KernelConfig(64, 32, 4, 3, 4.0, **_SM90),
    # Uncapped, this build takes 255 registers: two programs per SM (over FP8 K/V too; its
    # few-row build keeps the cap). Below 2,048 rows one-byte K/V take the masked tiles'
    # aligned loop with ranges first too.
    ("sm90", 128, 0): KernelConfig(64, 32, 4, 3, 4.0, resident_per_sm=2, kv8_few_rows=(16, 64),
                                   **dict(_SM90, kv8_maxnreg=None, kv8_few_maxnreg=168,
                                          kv8_aligned_mask=True, kv8_ranges_first=True)),
    ("sm90", 128, 2048): KernelConfig(64, 32, 4, 3, 4.0, merge_block=4, merge_warps=1,
                                      light_per_sm=2, **_NARROW),
    ("sm90", 128, 8192): KernelConfig(64, 32, 4, 3, 4.0, merge_block=2, merge_warps=4,
                                      merge_heads=8, **_NARROW),
    ("sm90", 256, 0): KernelConfig(64, 32, 8, 2, 4.0, **_SM90),
    # Small blocks and no tile floor, so tiny test trees keep several tiles and merges.
    ("interpreter", 0, 0): KernelConfig(16, 16, 1, 1, 2.0, merge_heads=2, min_tile_tokens=0),
}
DEFAULT_ARCH = "sm90"
DEFAULT_HEAD_DIM = 128


@functools.lru_cache(maxsize=None)
def arch_of(device: torch.device | None) -> str:
    """The table's architecture key for ``device`` (``"interpreter"`` when interpreting)."""
    if interpreting():
        return "interpreter"
    if device is None or device.type != "cuda":
        return DEFAULT_ARCH
    major, minor = capability(device)
    return f"sm{major}{minor}"


def block_head_dim(head_dim: int) -> int:
    """The head dim the kernels' blocks span: ``head_dim`` rounded up to a power of two, at
    least 16 (``tl.dot``'s smallest); the columns past ``head_dim`` are padding."""
    return max(16, 1 << (head_dim - 1).bit_length())


def kernel_config(head_dim: int, rows: int = 0, device: torch.device | None = None) -> KernelConfig:
    """The config of a step of ``rows`` (query, query head) rows on ``device``, for heads of
    ``head_dim`` (the table's of its :func:`block_head_dim`)."""
    head_dim = block_head_dim(head_dim)
    arch = arch_of(device)
    if arch == "interpreter":
        head_dim = 0
    best, fallback = None, None  # (rows_from, config) of this head_dim, of the defaults'
    for (a, d, r), cfg in CONFIGS.items():
        if r > rows:
            continue
        if a == arch and d == head_dim:
            if best is None or r > best[0]:
                best = (r, cfg)
        elif a in (arch, DEFAULT_ARCH) and d in (head_dim, DEFAULT_HEAD_DIM) and best is None:
            # Nearest defaults: this arch's default head_dim, then the default arch's rows.
            rank = (a == arch, d == head_dim, r)
            if fallback is None or rank > fallback[0]:
                fallback = (rank, cfg)
    if best is not None:
        return best[1]
    return fallback[1]


@functools.lru_cache(maxsize=64)
def _one_byte(cfg: KernelConfig) -> KernelConfig:
    return dataclasses.replace(cfg, maxnreg=cfg.kv8_maxnreg or cfg.maxnreg,
                               block_n=cfg.kv8_block_n or cfg.block_n,
                               deferred_v_checks=cfg.kv8_deferred_v_checks,
                               sum_checks=cfg.kv8_sum_checks,
                               aligned_mask=cfg.kv8_aligned_mask,
                               ranges_first=cfg.kv8_ranges_first)


@functools.lru_cache(maxsize=64)
def few_rows_config(cfg: KernelConfig, kv_dtype: torch.dtype | None) -> KernelConfig | None:
    """``cfg`` with programs of ``kv8_few_rows`` rows and tokens, for plans over K/V of
    ``kv_dtype`` whose K/V tokens are mostly seen by few rows; None where ``cfg`` has none
    for that K/V (16-bit K/V: always)."""
    if cfg.kv8_few_rows is None or kv_dtype is None or kv_dtype.itemsize != 1:
        return None
    m, n = cfg.kv8_few_rows
    return dataclasses.replace(cfg, block_m=m, block_n=n, kv8_block_n=None, kv8_few_rows=None,
                               kv8_maxnreg=cfg.kv8_few_maxnreg)


@functools.lru_cache(maxsize=64)
def light_config(cfg: KernelConfig) -> KernelConfig | None:
    """``cfg`` without its register cap, for plans of few programs (``light_per_sm``); None
    where ``cfg`` has no such build."""
    if cfg.light_per_sm is None:
        return None
    return dataclasses.replace(cfg, maxnreg=None, kv8_maxnreg=None,
                               resident_per_sm=cfg.light_per_sm, light_per_sm=None)


def kv_config(cfg: KernelConfig, kv_dtype: torch.dtype | None) -> KernelConfig:
    """``cfg`` as the partial kernel launches it over K/V of ``kv_dtype`` (None: q's): one-byte
    K/V take the ``kv8_`` fields."""
    return _one_byte(cfg) if kv_dtype is not None and kv_dtype.itemsize == 1 else cfg
