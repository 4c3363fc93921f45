"""Sweeps of the triton backend's kernel configs and work split on the GPU suite (timed on a
GPU; ``--plans`` runs anywhere).

For each tree and variant, time the benchmark's 32-layer step (partial + merge kernels, one KV
buffer per layer, Llama-3-8B attention shape) replayed as a CUDA graph, and check layer 0
against the float64 reference. ``--sweep`` picks the variants, each against the shipped
config and coarsening (``deft.plan.coarsen.refine``):

* ``merge`` (default): the merge fused into the partial kernel;
* ``factors``: fixed coarsening factors (``--factors``, default 2,4,8,16,32) instead of
  the coarsening rule;
* ``shapes``: other block shapes (rows x tokens, warps, stages), and slot loads forced on;
* ``tma``: TMA loads of consecutive-slot tiles off (gathered loads), and TMA block shapes;
* ``occupancy``: 2 stages, a 128-register cap (4 programs per SM instead of 3), other waves,
  the launch model and graph-safe grid at 2 programs per SM;
* ``pipeline``: deeper K/V rings (16-token blocks with 5, 6 or 8 stages, 32 with 4), so
  loads are issued further ahead of their use;
* ``pdl``: programmatic dependent launch off;
* ``partials``: partial o in fp32, or in q's dtype with and without a register cap, for
  every step (shipped: q's dtype with the cap in the ``wide`` regimes only);
* ``mergecfg``: one merge-kernel shape (partial states per step, warps) for every step,
  instead of the shipped one per row regime of the config table;
* ``mergeheads``: merge programs of several query heads (states per step, warps, heads),
  for every step;
* ``ring``: the K/V ring's block and depth (tokens per block, stages), with no register cap
  and under a 168-register one (3 programs per SM), for every K/V width: one-byte K/V bring
  half the bytes per block;
* ``cap``: the register cap of the large-step regimes lifted (two programs per SM instead of
  three, no spills), with the coarsening planned for the programs it keeps, and with a
  graph-safe grid of one wave;
* ``few``: the few-row build of FP8 trees of few rows per K/V token (``kv8_few_rows``,
  shipped 16 x 64): none, 32 x 64, 16 x 32, or taken from a share of 0.3 of the token work
  in tiles of few rows (``kv8_few_share``; shipped 0.1).
* ``model``: the coarsening's launch model on the config's program slots for every launch
  with no masked tile charged (``masked_cost``, shipped 128) or cut off (``masked_apart``):
  the rule before this model; on the config's slots with the cut but no charge; a program
  cost of 256 tokens; masked tiles charged 0 or 256; not cut off, charged 128 or not. The
  graph-safe grid stays as shipped (docs/decisions.md, "Where a graph-safe partial launch
  spends its time").
* ``tails``: the masked tiles' kernel variants, for every K/V width: neither, the masked
  loop from the block boundary before each tile's ``mask_from`` (``aligned_mask``), a
  masked block's range loads before its K load (``ranges_first``), or both (shipped on
  sm_90 over 16-bit K/V, and over one-byte K/V for head_dim 128 below 2,048 rows).
* ``checks``: the isolation's checks of non-finite K/V: ``checked`` (every check in
  place, each value tested), masked blocks that leave V's values unchecked, with a work
  item whose state comes out non-finite computed again with the checks
  (``deferred_v_checks``, for every K/V width); over e4m3 K (which holds no infinities) no
  -inf score made NaN (``e4m3_finite_scores``; no change over 16-bit K/V); and both. Then
  the shipped checks with what the sm90 configs take at a work item's end and in its
  unmasked blocks undone: every value tested (no ``sum_checks``, ``inf_by_fma`` or
  ``acc_checks``), rows tested value by value (no ``sum_checks``), a -inf score made NaN
  by a select (no ``inf_by_fma``; no change over e4m3 K under ``e4m3_finite_scores``), the
  output's rows tested and NaN selected into a bad row's values (no ``acc_checks``); and
  rows tested by their sums over one-byte K/V too (``kv8_sum_checks``). The timed steps'
  K/V are finite, so no item is computed again.
* ``nodes``: flatten tiles never cut at long nodes (``node_cut`` 0; shipped on sm_90: at
  nodes of 32+ tokens where the launch model says the cut plan finishes sooner), or cut at
  nodes of 128+ tokens (docs/decisions.md, "Adopted: tiles cut at long nodes where the launch
  model says").
* ``order``: a graph-safe launch reads whether the plan's queries are in plan order from
  its header and then loads no query order (``header_in_order``; all but the Medusa
  trees' queries are in plan order); a work item's query order, prefixes and lengths
  loaded after the PDL wait (no ``early_item_loads``, which the sm90 configs take); and
  both.

``--plans`` makes each variant's plans on this machine, as an H200's backend would (its
configs and 132 SMs), and prints their tiles, programs and build without timing anything
(no GPU needed): which variants change which trees' plans.

With ``--graph-safe`` every variant launches as the engine's captured steps do (fixed
buffers and grid for any tree of the step's size, ``TreeAttention(capacity=...)``). With
``--kv-dtype fp8_e4m3`` the K/V are FP8 copies with per-head scales (as a calibrated
pool holds them), checked against the float64 reference of the dequantised K/V.

Usage: ``python -m benchmarks.sweep [--sweep NAME[,NAME...]] [--kv-dtype fp8_e4m3] [--graph-safe]
[--eager] [--only LABEL,...] [--factors 2,4,8,16,32] [--plans] [--workloads DIR] [--json PATH]
[TREE ...]``: one line per (tree,
variant), then registers and spills of every compiled partial-kernel variant, the best
variants per tree and each variant's mean slowdown against the per-tree best.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from deft.ops.base import Capacity, Heads
from deft.ops.reference import reference_attention
from deft.ops.triton import backend, configs, kernels
from deft.plan import coarsen_plan, step as plan_step
from deft.plan.coarsen import (Coarsening, coarsen_factor, lpt_factor, plan_runs,
                               resident_wave)
from deft.plan.tree_plan import TreePlan
from deft.recorded import workloads_dir

from .attention_gpu import (D, DTYPE, FP8, H_KV, H_Q, LAYERS, fp8_copy, planned_as_engine,
                            time_us)
from .report import record, write_record
from .trees import GPU_SUITE, available

__all__ = ["SWEEPS", "variants", "variant", "planned_as_h200", "plan_rows", "main"]

SHAPES = [(64, 32, 4, 2), (64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (128, 32, 8, 3),
          (128, 64, 8, 2), (64, 16, 4, 4), (16, 32, 2, 3), (16, 64, 4, 3), (32, 32, 2, 3),
          (32, 64, 4, 3)]
TMA_SHAPES = [(64, 32, 4, 4), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 2)]
RING = [(32, 4), (64, 3), (64, 4), (128, 2), (128, 3)]
SWEEPS = ("merge", "factors", "shapes", "tma", "occupancy", "pipeline", "mergecfg", "mergeheads",
          "pdl", "partials", "ring", "few", "cap", "model", "tails", "checks", "order", "nodes")


Refine = Callable[[TreePlan, Coarsening], TreePlan]


def config_slots_model() -> Refine:
    """The coarsening rule with the launch model on the config's program slots for every
    launch (``resident_slots`` only for the one-wave check of
    :func:`~deft.plan.coarsen.resident_wave`) and no masked tiles charged: the rule before
    uncapped launches were modelled on the programs they keep resident."""
    def refine(plan: TreePlan, params: Coarsening) -> TreePlan:
        if plan.num_tiles == 0:
            return plan
        base = coarsen_factor(plan, params._replace(slots=0))  # the rule before the model
        best = lpt_factor(plan, base, params.g, params.block_m, params.num_kv_heads,
                          params.slots, params.program_cost, params.max_factor)
        if 0 < params.resident_slots < params.slots:
            best = resident_wave(plan_runs(plan, params.g, params.block_m), best,
                                 min(4 * base, params.max_factor), params.num_kv_heads,
                                 plan.block_kv, params.resident_slots, params.program_cost)
        return coarsen_plan(plan, best, params.masked_apart)
    return refine


def variants(sweep: str, factors: str = "2,4,8,16,32"
             ) -> list[tuple[str, dict, int | Refine | None]]:
    """(label, changes to every row regime of head_dim ``D``'s configs, fixed coarsening
    factor, a coarsening of its own, or None for the shipped rule), the shipped configs
    first."""
    def v(**changes) -> dict:
        return changes

    shipped: dict = {}
    out = [("shipped", shipped, None)]
    if sweep == "merge":
        out.append(("fused merge", v(fuse_merge=True), None))
    elif sweep == "factors":
        out += [(f"u={u}", shipped, int(u)) for u in factors.split(",")]
    elif sweep == "shapes":
        out += [(f"m{m}n{n}w{w}s{st}", v(block_m=m, block_n=n, num_warps=w, num_stages=st), None)
                for m, n, w, st in SHAPES]
        out.append(("slot loads", v(contig=False), None))
    elif sweep == "tma":
        out.append(("gather", v(tma=False), None))
        out += [(f"tma m{m}n{n}w{w}s{st}", v(block_m=m, block_n=n, num_warps=w, num_stages=st), None)
                for m, n, w, st in TMA_SHAPES]
    elif sweep == "occupancy":
        out += [("s2", v(num_stages=2), None),
                ("s2 maxnreg 128", v(num_stages=2, maxnreg=128), None),
                ("waves 3", v(waves=3.0), None),
                ("s2 maxnreg 128 waves 6", v(num_stages=2, maxnreg=128, waves=6.0), None),
                ("2 programs per SM", v(programs_per_sm=2), None)]
    elif sweep == "pipeline":
        # Triton issues block i + stages - 1's loads at the end of iteration i, so a load has
        # stages - 2 iterations to land; 16-token blocks give 6 stages the shipped ring's
        # shared memory (48 KB of K/V) and twice its lead in tokens.
        out += [(f"n{n} s{st}", v(block_n=n, num_stages=st), None)
                for n, st in ((16, 5), (16, 6), (16, 8), (32, 4))]
    elif sweep == "mergecfg":
        out += [(f"merge b{b} w{w}", v(merge_block=b, merge_warps=w), None)
                for b, w in ((16, 2), (8, 2), (32, 4), (4, 1))]
    elif sweep == "mergeheads":
        out += [(f"merge b{b} w{w} h{h}", v(merge_block=b, merge_warps=w, merge_heads=h), None)
                for b, w, h in ((16, 2, 1), (4, 1, 1), (8, 2, 2), (4, 2, 4), (8, 4, 4),
                                (4, 4, 8), (2, 4, 8))]
    elif sweep == "pdl":
        out.append(("no pdl", v(pdl=False), None))
    elif sweep == "partials":
        out += [("fp32 partials", v(narrow_partials=False, maxnreg=None), None),
                ("narrow partials", v(narrow_partials=True, maxnreg=None), None),
                ("narrow maxnreg 168", v(narrow_partials=True, maxnreg=168), None)]
    elif sweep == "ring":
        out += [(f"n{n} s{st}{' maxnreg 168' if cap else ''}",
                 v(block_n=n, num_stages=st, maxnreg=cap), None)
                for cap in (None, 168) for n, st in [(32, 3), *RING]]
    elif sweep == "few":
        out += [("one build", v(kv8_few_rows=None), None),
                ("few m32n64", v(kv8_few_rows=(32, 64)), None),
                ("few m16n32", v(kv8_few_rows=(16, 32)), None),
                ("few share 0.3", v(kv8_few_share=0.3), None)]
    elif sweep == "model":
        out += [("before: config slots and masked tiles neither apart nor charged",
                 v(masked_apart=False, masked_cost=0), config_slots_model()),
                ("model on config slots", shipped, config_slots_model()),
                ("cost 256", v(program_cost=256), None),
                ("masked 0", v(masked_cost=0), None),
                ("masked 256", v(masked_cost=256), None),
                ("not apart", v(masked_apart=False), None),
                ("not apart + masked 0", v(masked_apart=False, masked_cost=0), None)]
    elif sweep == "tails":
        out += [(label, v(aligned_mask=aligned, ranges_first=first), None)
                for label, aligned, first in (("neither", False, False),
                                              ("aligned mask", True, False),
                                              ("ranges first", False, True),
                                              ("aligned mask + ranges first", True, True))]
    elif sweep == "checks":
        per_value = dict(sum_checks=False, inf_by_fma=False, acc_checks=False)
        out += [("checked", v(deferred_v_checks=False, e4m3_finite_scores=False, **per_value),
                 None),
                ("deferred V checks", v(deferred_v_checks=True, e4m3_finite_scores=False),
                 None),
                ("finite e4m3 scores", v(deferred_v_checks=False, e4m3_finite_scores=True),
                 None),
                ("deferred V checks + finite e4m3 scores",
                 v(deferred_v_checks=True, e4m3_finite_scores=True), None),
                ("per-value checks", v(**per_value), None),
                ("row checks by values", v(sum_checks=False), None),
                ("-inf by select", v(inf_by_fma=False), None),
                ("checks on the output", v(acc_checks=False), None),
                ("row checks by sums over one-byte K/V", v(kv8_sum_checks=True), None)]
    elif sweep == "order":
        out += [("queries in order by header", v(header_in_order=True), None),
                ("item loads after the wait", v(early_item_loads=False), None),
                ("in order + item loads after the wait",
                 v(header_in_order=True, early_item_loads=False), None)]
    elif sweep == "nodes":
        out += [("no cut at nodes", v(node_cut=0), None),
                ("cut at nodes of 128+", v(node_cut=128), None)]
    elif sweep == "cap":
        out += [("no cap", v(maxnreg=None), None),
                ("no cap resident 2", v(maxnreg=None, resident_per_sm=2), None),
                ("no cap resident 2 waves 1", v(maxnreg=None, resident_per_sm=2, graph_waves=1),
                 None)]
    else:
        raise ValueError(f"sweep: expected one of {', '.join(SWEEPS)}, got {sweep!r}")
    return out


@contextlib.contextmanager
def variant(changes: dict, u: int | Refine | None) -> Iterator[None]:
    """The configs of head_dim ``D`` changed by ``changes`` and the coarsening ``u`` (see
    :func:`variants`) while the block runs; the shipped ones after."""
    shipped_table, shipped_refine = dict(configs.CONFIGS), plan_step.refine
    opted_out = os.environ.get("DEFT_FASTPLAN")
    # A variant's cap, block, V checks and masked tiles hold for one-byte K/V too.
    changes = {**{f"kv8_{f}": changes[f] for f in ("maxnreg", "block_n", "deferred_v_checks",
                                                   "aligned_mask", "ranges_first")
                  if f in changes},
               **changes}
    try:
        for key, cfg in shipped_table.items():
            if key[1] == D:
                configs.CONFIGS[key] = dataclasses.replace(cfg, **changes)
        if callable(u):
            plan_step.refine = u
        elif u is not None:
            plan_step.refine = lambda plan, params, u=u: coarsen_plan(plan, u)
        # The compiled planner coarsens as shipped: other coarsenings plan with numpy.
        os.environ["DEFT_FASTPLAN"] = "1" if u is None else "0"
        yield
    finally:
        configs.CONFIGS.update(shipped_table)
        plan_step.refine = shipped_refine
        if opted_out is None:
            os.environ.pop("DEFT_FASTPLAN", None)
        else:
            os.environ["DEFT_FASTPLAN"] = opted_out


@contextlib.contextmanager
def planned_as_h200(sms: int = 132) -> Iterator[None]:
    """In the block, the triton backend plans as an H200's does (its sm90 configs, ``sms``
    SMs) on any machine, even under Triton's interpreter."""
    shipped = backend._num_sms, configs.arch_of
    backend._num_sms, configs.arch_of = (lambda device: sms), (lambda device: "sm90")
    try:
        yield
    finally:
        backend._num_sms, configs.arch_of = shipped


def plan_rows(name: str, layout, variant_list, fp8: bool = False,  # noqa: ANN001
              sms: int = 132) -> list[dict]:
    """Each variant's plan of one tree as an H200's backend makes it (its configs, ``sms``
    SMs, the build the tree asks for), on any machine, even under Triton's interpreter:
    tiles, the longest one's tokens, partial states, programs and a digest of the tiles
    (equal digests: the same tiles)."""
    rows = []
    for label, changes, u in variant_list:
        with planned_as_h200(sms), variant(changes, u):
            plan, packed, _, build = backend._pack(
                layout, "flatten", backend.TritonBackend.default_block_kv, Heads(H_Q, H_KV, D),
                torch.device("cpu"), lambda n: torch.empty(n, dtype=torch.int32), None,
                FP8 if fp8 else None)
        tokens = np.diff(plan.tile_indptr)
        digest = hashlib.sha1(np.stack([plan.tile_indptr[1:], plan.tile_q_start]).tobytes())
        rows.append({"tree": name, "variant": label, "build": build,
                     "tiles": plan.num_tiles, "longest tile": int(tokens.max(initial=0)),
                     "partials": plan.num_partials, "programs": packed.num_work * H_KV,
                     "plan": digest.hexdigest()[:8]})
    return rows


def _compiled() -> dict:
    """The partial kernel's compiled instances on this device, by cache key."""
    caches = kernels.tree_partial_kernel.device_caches
    return dict(caches[torch.cuda.current_device()][0]) if caches else {}


def _sweep_tree(name: str, layout, variant_list, graph: bool, registers: dict,  # noqa: ANN001
                fp8: bool = False, graph_safe: bool = False) -> list[dict]:
    """Time every variant on one tree (``fp8``: over FP8 K/V; ``graph_safe``: with buffers
    reserved for any tree of its size); the shipped configs and coarsening are restored."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = layout.num_tokens
    ks = [torch.randn(n, H_KV, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(LAYERS)]
    vs = [torch.randn(n, H_KV, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(LAYERS)]
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=DTYPE, generator=gen)
    scales: list[dict] = [{} for _ in range(LAYERS)]
    if fp8:
        for layer in range(LAYERS):
            (ks[layer], ks_), (vs[layer], vs_) = fp8_copy(ks[layer]), fp8_copy(vs[layer])
            scales[layer] = {"k_scale": ks_, "v_scale": vs_}
        k0, v0 = scales[0]["k_scale"], scales[0]["v_scale"]  # layer 0's, which is checked
        ref, _ = reference_attention(q, ks[0].double() * k0[:, None].double(),
                                     vs[0].double() * v0[:, None].double(), layout, D**-0.5)
    else:
        ref, _ = reference_attention(q, ks[0], vs[0], layout, D**-0.5)
    rows = []
    for label, changes, u in variant_list:
        with variant(changes, u):
            capacity = Capacity(layout.num_queries, max(n, 1)) if graph_safe else None
            attn = planned_as_engine(layout, capacity, FP8 if fp8 else None)
            plan = attn.current_plan
            before = _compiled()
            try:
                diff = float((attn.run(q, ks[0], vs[0], **scales[0]).double() - ref.double()).abs().max())

                def step(attn=attn) -> None:
                    for layer in range(LAYERS):
                        attn.run(q, ks[layer], vs[layer], **scales[layer])

                us = time_us(step, graph=graph)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                print(f"{name} | {label} | ERROR {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            programs = attn._prepared.num_work * H_KV
            for key, k in _compiled().items():
                if key not in before:
                    k._init_handles()  # eager steps launch natively: maybe never loaded by Triton
                    registers.setdefault(label, set()).add((k.n_regs, k.n_spills))
            rows.append({"tree": name, "variant": label, "tiles": plan.num_tiles,
                         "partials": plan.num_partials, "programs": programs,
                         "µs/step": us, "µs/layer": us / LAYERS, "max |diff| vs ref": diff})
            print(f"{name} | {label} | {plan.num_tiles} | {plan.num_partials} | {programs} | "
                  f"{us:.0f} | {us / LAYERS:.1f} | {diff:.2e}", flush=True)
    return rows


def sweep_names(text: str) -> list[str]:
    """``--sweep``'s comma list of sweep names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SWEEPS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown sweep {', '.join(unknown)} (expected {', '.join(SWEEPS)})")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sweep",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", metavar="TREE", help="benchmark trees (default: the GPU suite)")
    ap.add_argument("--sweep", type=sweep_names, default="merge", metavar="NAME[,NAME...]",
                    help=f"which variants (default merge): {', '.join(SWEEPS)}; several run in "
                    "one process, the shipped configs once")
    ap.add_argument("--factors", default="2,4,8,16,32", help="(--sweep factors) comma-separated factors")
    ap.add_argument("--kv-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                    help="K/V format: auto (bf16, like q) or fp8_e4m3 (FP8 with per-head scales)")
    ap.add_argument("--graph-safe", action="store_true",
                    help="launch as the engine's captured steps do (buffers reserved for any tree "
                    "of the step's size)")
    ap.add_argument("--eager", action="store_true", help="time the step launched from Python, not replayed")
    ap.add_argument("--only", metavar="LABEL,...", help="keep just these variants")
    ap.add_argument("--workloads", metavar="DIR", help="recorded workloads directory "
                    "(default: $DEFT_WORKLOADS or ../shared/workloads; recorded trees skipped without)")
    ap.add_argument("--plans", action="store_true",
                    help="only make each variant's plans as an H200 would, and print their "
                    "tiles and programs (no GPU needed)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as a result record")
    args = ap.parse_args(argv)
    variant_list = [variants(args.sweep[0], args.factors)[0]]
    for name in args.sweep:
        variant_list += variants(name, args.factors)[1:]
    labels = [label for label, _, _ in variant_list]
    if len(set(labels)) < len(labels):
        ap.error(f"--sweep {','.join(args.sweep)}: two variants share a label")
    if args.only:
        only = {label.strip() for label in args.only.split(",")}
        unknown = sorted(only - set(labels))
        if unknown:
            ap.error(f"--only: no variant {', '.join(map(repr, unknown))} in --sweep "
                     f"{','.join(args.sweep)} (its variants: {', '.join(labels)})")
        variant_list = [v for v in variant_list if v[0] in only]
    try:
        workloads: Path | None = workloads_dir(args.workloads)
    except FileNotFoundError:
        workloads = None
    if args.plans:
        print("| tree | variant | build | tiles | longest tile | partials | programs | plan |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, layout in available(args.trees or GPU_SUITE, workloads):
            for r in plan_rows(name, layout, variant_list, args.kv_dtype == "fp8_e4m3"):
                print("| " + " | ".join(str(x) for x in r.values()) + " |", flush=True)
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --plans)")
    mode = ("eager" if args.eager else "graph") + (" graph-safe" if args.graph_safe else "")
    print(f"tree | variant | tiles | partials | programs | µs/step {mode} | µs/layer | max|diff| vs ref")
    results: list[dict] = []
    registers: dict[str, set] = {}
    for name, layout in available(args.trees or GPU_SUITE, workloads):
        results += _sweep_tree(name, layout, variant_list, not args.eager, registers,
                               args.kv_dtype == "fp8_e4m3", args.graph_safe)
        torch.cuda.empty_cache()
    if args.json:
        rec = record(list(results[0]) if results else [], [list(r.values()) for r in results],
                     "cuda", sweep=",".join(args.sweep), mode=mode,
                     kv_dtype=args.kv_dtype)
        write_record(args.json, rec)
    print("\npartial kernel (registers, spills) compiled per variant:")
    for label, regs in registers.items():
        print(f"{label}: {sorted(regs)}")
    print("\nbest per tree:")
    best = {}
    for name in dict.fromkeys(r["tree"] for r in results):
        rows = sorted((r for r in results if r["tree"] == name), key=lambda r: r["µs/step"])
        best[name] = rows[0]["µs/step"]
        print(name, " | ".join(f"{r['variant']} {r['µs/layer']:.1f}" for r in rows[:4]))
    for label, _, _ in variant_list:
        rows = [r for r in results if r["variant"] == label]
        if rows:
            slowdown = sum(r["µs/step"] / best[r["tree"]] for r in rows) / len(rows)
            print(f"{label}: mean slowdown vs per-tree best {slowdown:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
