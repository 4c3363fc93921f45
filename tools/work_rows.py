"""Rows per work item in the triton backend's plans of the GPU benchmark trees, on the CPU.

A work item is ``block_m`` query rows (group query, GQA head) of one tile; an item of fewer rows
pads its dots to ``block_m``. Per tree: work items, those of at most ``--small`` rows, the share
of the plan's token work (tokens x items) in them, the share of dot rows that are padding, the
share by tiles that picks the few-row build for FP8 K/V (``deft.plan.packing.few_rows_share``,
against ``KernelConfig.kv8_few_share``), the build the tree asks for (``TreeAttention.build``),
the items with a masked part, and those of them whose unmasked part ends inside a K/V block (a
partial block run outside the pipelined loop, unless ``KernelConfig.aligned_mask``), and the
share of the K/V blocks that the programs run masked (those ``KernelConfig.deferred_v_checks``
makes cheaper), and how many times the work items read each K/V block of their tiles (a
tile's row chunks each read it: 1.00 where every tile is one item). It tells which trees
smaller dots serve (docs/decisions.md, "16-row dots for FP8" and "A few-row build per tree"),
which take the light build ("The register cap stays, but for steps of few programs") and
what row chunks that share their tile's loads would save ("Row chunks read their tile's K/V
again"). Plans are made as on an H200 (the sm90 configs and their
default build, the backend's tile size, ``--sms`` SMs), for one-byte K/V with ``--kv-dtype
fp8_e4m3``.

Usage: ``python tools/work_rows.py [--small 16] [--sms 132] [--kv-dtype auto|fp8_e4m3]
[--workloads DIR] [TREE ...]`` (recorded trees skipped without their directory).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # the sm90 configs, even under the CPU test suite
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.attention_gpu import D, H_KV, H_Q  # noqa: E402
from benchmarks.sweep import planned_as_h200  # noqa: E402
from benchmarks.trees import GPU_SUITE, available  # noqa: E402
from deft.cache.pool import FP8  # noqa: E402
from deft.ops.base import Heads  # noqa: E402
from deft.ops.triton import backend  # noqa: E402
from deft.ops.triton import configs  # noqa: E402
from deft.ops.triton.configs import few_rows_config  # noqa: E402
from deft.plan.packing import few_rows_share  # noqa: E402
from deft.recorded import workloads_dir  # noqa: E402


def work_rows(layout, sms: int,  # noqa: ANN001
              kv_dtype: torch.dtype | None) -> tuple[np.ndarray, np.ndarray, int, str, str,
                                                     np.ndarray, np.ndarray, float]:
    """Each work item's tokens and rows in the default build's plan of ``layout`` on ``sms``
    SMs, ``block_m``, the tiles' few-row share ("-" without a few-row build for this K/V), the
    build the tree asks for, ``[W, 2]`` flags: the item has a masked part, and its unmasked
    part ends inside a K/V block of the launched config; and ``[W, 2]`` K/V blocks each item
    runs, unmasked and masked (the masked ones from the block boundary at or before its
    ``mask_from`` where the launched config aligns them); and the K/V blocks the items read
    over those of their tiles (each tile's once)."""
    with planned_as_h200(sms):
        plan, packed, cfg, build = backend._pack(
            layout, "flatten", backend.TritonBackend.default_block_kv, Heads(H_Q, H_KV, D),
            torch.device("cpu"),
            lambda n: torch.empty(n, dtype=torch.int32), None, kv_dtype, build="default")
    work = packed.work()
    tokens = (work[:, 1] - work[:, 0]).astype(np.int64)
    rows = np.minimum(cfg.block_m, (work[:, 3] - work[:, 2]) * (H_Q // H_KV) - work[:, 7])
    few = few_rows_config(cfg, kv_dtype)
    share = ("-" if few is None else
             f"{few_rows_share(plan, H_Q // H_KV, cfg.block_m, few.block_m):.2f}")
    masked = work[:, 5] < work[:, 1]
    launched = configs.kv_config(cfg, kv_dtype)
    block_n = launched.block_n
    mid = masked & ((work[:, 5] - work[:, 0]) % block_n > 0)
    split = work[:, 5].astype(np.int64)  # where each item's masked loop starts
    if launched.aligned_mask:
        split[mid] -= (split[mid] - work[mid, 0]) % block_n
    blocks = -(-np.stack([split - work[:, 0], work[:, 1] - split], 1) // block_n)
    tiles = np.unique(work[:, :2], axis=0)
    tile_blocks = int((-(-(tiles[:, 1] - tiles[:, 0]) // block_n)).sum())
    reads = (-(-tokens // block_n)).sum() / max(tile_blocks, 1)
    return tokens, rows, cfg.block_m, share, build, np.stack([masked, mid], 1), blocks, reads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", metavar="TREE", help="benchmark trees (default: the GPU suite)")
    ap.add_argument("--small", type=int, default=16, help="rows of a small item (default 16)")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the planned-for GPU (H200: 132)")
    ap.add_argument("--kv-dtype", choices=("auto", "fp8_e4m3"), default="auto")
    ap.add_argument("--workloads", metavar="DIR", help="recorded workloads directory "
                    "(default: $DEFT_WORKLOADS or ../shared/workloads; recorded trees skipped without)")
    args = ap.parse_args(argv)
    try:
        workloads: Path | None = workloads_dir(args.workloads)
    except FileNotFoundError:
        workloads = None
    kv = FP8 if args.kv_dtype == "fp8_e4m3" else None
    print(f"| tree | items | items of <= {args.small} rows | their share of token work "
          "| padded dot rows | few-row share of tiles | build asked | masked items "
          "| their unmasked part ending mid-block | masked share of blocks | K/V block reads "
          "over the tiles' |")
    print("| --- " * 11 + "|")
    for name, layout in available(args.trees or GPU_SUITE, workloads):
        tokens, rows, block_m, share, build, flags, blocks, reads = work_rows(layout, args.sms, kv)
        small = rows <= args.small
        padded = 1 - float((tokens * rows).sum()) / float(tokens.sum() * block_m)
        print(f"| {name} | {len(rows)} | {int(small.sum())} "
              f"| {tokens[small].sum() / tokens.sum():.2f} | {padded:.0%} | {share} | {build} "
              f"| {int(flags[:, 0].sum())} | {int(flags[:, 1].sum())} "
              f"| {blocks[:, 1].sum() / blocks.sum():.2f} | {reads:.2f} |", flush=True)


if __name__ == "__main__":
    main()
