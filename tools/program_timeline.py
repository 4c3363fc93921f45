"""When and where each (work item, KV head) pair of a graph-safe step runs (GPU).

An instrumented copy of the partial kernel's graph-safe loop calls the shipped ``_work_item``
per pair and records the SM it ran on and ``%globaltimer`` before and after it, with the
item's tokens, its group's query rows, whether its slots are consecutive (TMA) or gathered,
and its masked tokens (those past ``mask_from``). The step is a captured 32-layer graph-safe
step of a benchmark tree (bf16), planned as the engine plans it, replayed a few times; the
last replay's layers are read back. The copy waits for the previous launch once at its
start, not after loading its first item, so the pairs' times exclude that wait; its step
runs slower than the shipped one (it prints its replay time).

Per tree and coarsening it prints the partial launch's span, a least-squares fit of a
pair's duration (a fixed part, per token, and what a masked part and gathered slots add),
the kinds of pair that end last, and list scheduling of the recorded order with each kind's
median duration (how much of the span the pairs' order and lengths explain). ``--json``
writes every pair; ``--from-json`` summarises such a file again without a GPU.

Usage: ``python tools/program_timeline.py TREE ... [--factors 6,8] [--sweep NAME [--only
LABEL,...]] [--json PATH]``: the shipped step, then each variant of ``python -m
benchmarks.sweep --sweep NAME`` (default ``factors``: the coarsening factors of ``--factors``,
planned with numpy); ``--only`` keeps just the labels it names (``shipped`` for the shipped
step), e.g. ``--sweep tails --only "shipped,aligned mask"``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from benchmarks import sweep  # noqa: E402
from benchmarks.attention_gpu import (H_KV, H_Q, LAYERS, planned_as_engine,  # noqa: E402
                                     random_inputs)
from benchmarks.trees import available  # noqa: E402
from deft.ops.base import Capacity  # noqa: E402
from deft.ops.triton import kernels, launch  # noqa: E402
from deft.recorded import workloads_dir  # noqa: E402

FIELDS = 10  # per pair: sm, t0, t1, tok0, tok1, qs, qe, mask_from, slot0, program


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def timeline_kernel(
    Q, K, V, desc_k, desc_v, PO, PLSE, plan, off_lo, off_hi, off_off, off_work, off_order,
    off_pre, off_len, O, LSE, counts, merge_indptr, merge_partials, qk_scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_pn, stride_ph, stride_ln,
    stride_on, stride_oh, num_heads, KS, VS, stride_s, TL,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr, CONTIG: tl.constexpr, TMA: tl.constexpr, SORTED: tl.constexpr,
    FUSE_MERGE: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, HEADER: tl.constexpr,
    SCALED: tl.constexpr, F16_DOTS: tl.constexpr, ALIGN_MASK: tl.constexpr,
    RANGES_FIRST: tl.constexpr, INF_K: tl.constexpr, DEFER_V: tl.constexpr,
    IN_ORDER: tl.constexpr, EARLY: tl.constexpr, SUMS: tl.constexpr, ACC_CHECK: tl.constexpr,
    HEAD_D: tl.constexpr,
):
    """The graph-safe partial kernel's loop (``HEADER`` only), timing each pair into ``TL``."""
    h_kv = num_heads // G
    num_work, off_lo, off_hi, off_off, off_work, off_order, off_pre, off_len = (
        _plan_header(plan))
    in_order = tl.load(plan - 6) if IN_ORDER else 0
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    total = num_work * h_kv
    pid = tl.program_id(0)
    sm = _smid()
    for item in range(pid, total, tl.num_programs(0)):
        t0 = _globaltimer()
        w = item // h_kv
        _work_item(
            w, item % h_kv, Q, K, V, desc_k, desc_v, PO, PLSE, plan, off_lo, off_hi, off_off,
            off_work, off_order, off_pre, off_len, O, LSE, counts, merge_indptr,
            merge_partials, qk_scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_pn,
            stride_ph, stride_ln, stride_on, stride_oh, num_heads, KS, VS, stride_s, in_order,
            G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, USE_MASK=USE_MASK, CONTIG=CONTIG,
            TMA=TMA, SORTED=SORTED, FUSE_MERGE=FUSE_MERGE, IEEE=IEEE, WAIT=False,
            SCALED=SCALED, F16_DOTS=F16_DOTS, ALIGN_MASK=ALIGN_MASK,
            RANGES_FIRST=RANGES_FIRST, INF_K=INF_K, DEFER_V=DEFER_V, IN_ORDER=IN_ORDER,
            EARLY=EARLY, SUMS=SUMS, ACC_CHECK=ACC_CHECK, HEAD_D=HEAD_D)
        t1 = _globaltimer()
        desc = plan + off_work + w * 8
        rec = TL + item.to(tl.int64) * 10  # FIELDS per pair
        tl.store(rec, sm.to(tl.int64))
        tl.store(rec + 1, t0)
        tl.store(rec + 2, t1)
        tl.store(rec + 3, tl.load(desc).to(tl.int64))
        tl.store(rec + 4, tl.load(desc + 1).to(tl.int64))
        tl.store(rec + 5, tl.load(desc + 2).to(tl.int64))
        tl.store(rec + 6, tl.load(desc + 3).to(tl.int64))
        tl.store(rec + 7, tl.load(desc + 5).to(tl.int64))
        tl.store(rec + 8, tl.load(desc + 6).to(tl.int64))
        tl.store(rec + 9, pid.to(tl.int64))


_work_item = kernels._work_item
_plan_header = kernels.plan_header


class _Timed:
    """Stands in for ``tree_partial_kernel`` in ``launch``: each launch gets the next
    layer's record buffer."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers, self.calls = buffers, 0

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def run(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            if not kw.get("HEADER"):
                raise SystemExit("program_timeline: graph-safe steps only")
            tl_buf = self.buffers[self.calls % len(self.buffers)]
            self.calls += 1
            return timeline_kernel[grid](*args, tl_buf, **kw)
        return run


def timeline(name: str, layout, variant: tuple,  # noqa: ANN001
             replays: int = 3) -> list[dict]:
    """Every pair of the last replay's layers, for ``variant`` (label, config changes,
    coarsening: one of ``benchmarks.sweep.variants``)."""
    n = layout.num_tokens
    ks, vs, q = random_inputs(n, layout.num_queries)
    label, changes, u = variant
    with sweep.variant(changes, u):
        attn = planned_as_engine(layout, Capacity(layout.num_queries, max(n, 1)), None)
    pairs = attn._prepared.num_work * H_KV
    buffers = [torch.zeros(pairs * FIELDS, dtype=torch.int64, device="cuda")
               for _ in range(LAYERS)]
    real, timed = launch.tree_partial_kernel, _Timed(buffers)
    launch.tree_partial_kernel = timed
    try:
        for layer in range(LAYERS):
            attn.run(q, ks[layer], vs[layer], captured=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        timed.calls = 0
        with torch.cuda.graph(graph):
            for layer in range(LAYERS):
                attn.run(q, ks[layer], vs[layer])
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"{name}, {label}: instrumented step "
              f"{start.elapsed_time(end) * 1e3 / replays:.0f} µs")
    finally:
        launch.tree_partial_kernel = real
    rows = []
    for layer, buf in enumerate(buffers):
        rec = buf.view(-1, FIELDS).cpu().numpy()
        base = rec[:, 1].min()
        for r in rec:
            rows.append({"tree": name, "variant": label, "layer": layer,
                         "sm": int(r[0]), "start_us": (r[1] - base) / 1e3,
                         "end_us": (r[2] - base) / 1e3, "tokens": int(r[4] - r[3]),
                         "group_rows": int(r[6] - r[5]) * (H_Q // H_KV),
                         "masked": int(r[4] - max(r[7], r[3])), "gathered": bool(r[8] < 0),
                         "program": int(r[9])})
    return rows


def _kind(r: dict) -> tuple:
    return (r["tokens"], r["group_rows"], r["masked"], r["gathered"])


def _list_schedule(durations: list[float], slots: int) -> float:
    """Makespan of ``durations`` started in order, each on the first free of ``slots``."""
    free = [0.0] * slots
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def summarise(rows: list[dict]) -> None:
    """Over the layers after the first two: the partial launch's span; a least-squares fit
    of a pair's duration; the kinds of pair that end last; and list scheduling of the
    recorded order onto two programs per SM, each pair taking its kind's median duration
    (how much of the span the order and the pairs' lengths explain)."""
    rows = [r for r in rows if r["layer"] >= 2]
    layers = sorted({r["layer"] for r in rows})
    spans = [max(r["end_us"] for r in rows if r["layer"] == ly) for ly in layers]
    dur = np.array([r["end_us"] - r["start_us"] for r in rows])
    print(f"  partial launch span {np.median(spans):.1f} µs (median of {len(layers)} layers),"
          f" {len(rows) // len(layers)} pairs")
    x = np.array([[1.0, r["tokens"], float(r["masked"] > 0), float(r["gathered"])]
                  for r in rows])
    coef = np.linalg.lstsq(x, dur, rcond=None)[0]
    rms = float(np.sqrt(((dur - x @ coef) ** 2).mean()))
    print(f"  pair µs = {coef[0]:.2f} + {coef[1] * 1e3:.1f} per 1k tokens + {coef[2]:.2f} if"
          f" any token is masked + {coef[3]:.2f} if gathered (rms residual {rms:.2f})")
    kinds: dict = {}
    for r, d in zip(rows, dur):
        kinds.setdefault(_kind(r), []).append((d, r["start_us"], r["end_us"]))
    median = {k: float(np.median([v[0] for v in vs])) for k, vs in kinds.items()}
    late = sorted(kinds, key=lambda k: -np.median([v[2] for v in kinds[k]]))[:4]
    for k in late:
        v = np.array(kinds[k])
        dur_us, start_us, end_us = (np.median(v[:, i]) for i in range(3))
        print(f"  ends late: {k[0]} tokens, {k[1]} group rows, {k[2]} masked,"
              f" {'gathered' if k[3] else 'TMA'}: {len(v) // len(layers)} pairs, µs median"
              f" {dur_us:.1f} from {start_us:.1f} to {end_us:.1f}")
    slots = 2 * len({r["sm"] for r in rows})
    one = sorted((r for r in rows if r["layer"] == layers[len(layers) // 2]),
                 key=lambda r: r["program"])
    durations = [median[_kind(r)] for r in one]
    print(f"  list schedule of median durations on {slots} slots: in the recorded order"
          f" {_list_schedule(durations, slots):.1f} µs, longest first"
          f" {_list_schedule(sorted(durations, reverse=True), slots):.1f} µs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", metavar="TREE")
    ap.add_argument("--factors", default="", help="comma-separated fixed coarsening factors "
                    "to time next to the shipped rule")
    ap.add_argument("--sweep", choices=sweep.SWEEPS, default="factors",
                    help="time the variants of this sweep (default factors: those of --factors)")
    ap.add_argument("--only", metavar="LABEL,...", help="keep just these variants")
    ap.add_argument("--json", metavar="PATH", help="write every pair")
    ap.add_argument("--from-json", metavar="PATH", help="summarise pairs a run wrote (no GPU)")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for tree, label in dict.fromkeys((r["tree"], r["variant"]) for r in saved):
            print(f"{tree}, {label}:")
            summarise([r for r in saved if r["tree"] == tree and r["variant"] == label])
        return 0
    if not args.trees:
        ap.error("name at least one tree")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    variant_list = (sweep.variants(args.sweep, args.factors)
                    if args.sweep != "factors" or args.factors else [("shipped", {}, None)])
    if args.only:
        only = {label.strip() for label in args.only.split(",")}
        variant_list = [v for v in variant_list if v[0] in only]
    everything = []
    for name, layout in available(args.trees, workloads_dir(None)):
        for variant in variant_list:
            rows = timeline(name, layout, variant)
            print(f"{name}, {variant[0]}:")
            summarise(rows)
            everything += rows
    if args.json:
        Path(args.json).write_text(json.dumps(everything))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
