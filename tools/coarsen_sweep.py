"""Sweep the triton backend's kernel configs and work split on the GPU suite (GPU only).

For each tree and variant, time a 32-layer step replayed as a CUDA graph (partial + merge
kernels, one KV buffer per layer) and check layer 0 against the float64 reference.
``SWEEP`` picks the variants (each against the shipped config and ``refine_plan``):

* ``merge`` (default): the merge fused into the partial kernel;
* ``factors``: fixed coarsening factors (``FACTORS``, default 2,4,8,16,32) instead of
  ``refine_plan``;
* ``shapes``: other block shapes (rows x tokens, warps, stages), and slot loads forced on;
* ``tma``: TMA loads of consecutive-slot tiles off (gathered loads), and TMA block shapes;
* ``occupancy``: 2 stages, a 128-register cap (4 programs per SM instead of 3), other waves;
* ``pipeline``: deeper K/V rings (16-token blocks with 5, 6 or 8 stages, 32 with 4), so
  loads are issued further ahead of their use;
* ``pdl``: programmatic dependent launch off;
* ``partials``: partial o in fp32, or in q's dtype with and without a register cap, for
  every step (shipped: q's dtype with the cap in the ``wide`` regime only);
* ``mergecfg``: one merge-kernel shape (partial states per step, warps) for every step,
  instead of the shipped one per regime (``KernelConfig.for_rows``);
* ``mergeheads``: merge programs of several query heads (states per step, warps, heads),
  for every step.

``EAGER=1`` times the step launched from Python instead of replayed; ``ONLY=label,...``
keeps just those variants.

Usage: [SWEEP=factors] python3 tools/coarsen_sweep.py [TREE ...]   (one line per (tree, variant))
"""
import json
import os
import sys
from pathlib import Path

import torch

from deft import TreeAttention
from deft.bench.gpu_bench import D, DTYPE, H_KV, H_Q, LAYERS, _time
from deft.bench.trees import GPU_SUITE, build
from deft.ops import triton_backend as tb
from deft.ops import triton_kernels as tk
from deft.ops.reference import reference_attention
from deft.plan import coarsen_plan

SHIPPED = tb.kernel_config(D)
SHAPES = [(64, 32, 4, 2), (64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (128, 32, 8, 3),
          (128, 64, 8, 2), (64, 16, 4, 4), (16, 32, 2, 3), (16, 64, 4, 3), (32, 32, 2, 3),
          (32, 64, 4, 3)]
TMA_SHAPES = [(64, 32, 4, 4), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 2)]


def variant(**changes) -> tb.KernelConfig:
    """The shipped config with ``changes``, in its ``wide`` variants (many queries) too."""
    return SHIPPED.replace_all(**changes)


# (label, config, fixed coarsening factor or None for the shipped refine_plan)
VARIANTS = [("shipped", SHIPPED, None)]
SWEEP = os.environ.get("SWEEP", "merge")
if SWEEP == "merge":
    VARIANTS.append(("fused merge", variant(fuse_merge=True), None))
elif SWEEP == "factors":
    FACTORS = os.environ.get("FACTORS", "2,4,8,16,32")
    VARIANTS += [(f"u={u}", SHIPPED, int(u)) for u in FACTORS.split(",")]
elif SWEEP == "shapes":
    VARIANTS += [(f"m{m}n{n}w{w}s{st}",
                  variant(block_m=m, block_n=n, num_warps=w, num_stages=st), None)
                 for m, n, w, st in SHAPES]
    VARIANTS.append(("slot loads", variant(contig=False), None))
elif SWEEP == "tma":
    VARIANTS.append(("gather", variant(tma=False), None))
    VARIANTS += [(f"tma m{m}n{n}w{w}s{st}",
                  variant(block_m=m, block_n=n, num_warps=w, num_stages=st), None)
                 for m, n, w, st in TMA_SHAPES]
elif SWEEP == "occupancy":
    VARIANTS += [
        ("s2", variant(num_stages=2), None),
        ("s2 maxnreg 128", variant(num_stages=2, maxnreg=128), None),
        ("waves 3", variant(waves=3.0), None),
        ("s2 maxnreg 128 waves 6", variant(num_stages=2, maxnreg=128, waves=6.0), None),
    ]
elif SWEEP == "pipeline":
    # Deeper K/V rings: Triton issues block i + stages - 1's loads at the end of iteration i,
    # so a load has stages - 2 iterations to land; 16-token blocks give 6 stages the shipped
    # ring's shared memory (48 KB of K/V) and twice its lead in tokens.
    VARIANTS += [(f"n{n} s{st}", variant(block_n=n, num_stages=st), None)
                 for n, st in ((16, 5), (16, 6), (16, 8), (32, 4))]
elif SWEEP == "mergecfg":
    VARIANTS += [(f"merge b{b} w{w}", variant(merge_block=b, merge_warps=w), None)
                 for b, w in ((16, 2), (8, 2), (32, 4), (4, 1))]
elif SWEEP == "mergeheads":
    VARIANTS += [(f"merge b{b} w{w} h{h}", variant(merge_block=b, merge_warps=w, merge_heads=h),
                  None)
                 for b, w, h in ((16, 2, 1), (4, 1, 1), (8, 2, 2), (4, 2, 4), (8, 4, 4),
                                 (4, 4, 8), (2, 4, 8))]
elif SWEEP == "pdl":
    VARIANTS.append(("no pdl", variant(pdl=False), None))
elif SWEEP == "partials":
    VARIANTS += [("fp32 partials", variant(narrow_partials=False, maxnreg=None), None),
                 ("narrow partials", variant(narrow_partials=True, maxnreg=None), None),
                 ("narrow maxnreg 168", variant(narrow_partials=True, maxnreg=168), None)]
else:
    sys.exit(f"SWEEP: expected merge, factors, shapes, tma, occupancy, pipeline, mergecfg, "
             f"mergeheads, pdl or partials, got {SWEEP!r}")
if os.environ.get("ONLY"):  # comma-separated labels: run just these variants
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["ONLY"].split(",")]
TREES = GPU_SUITE

workloads = Path(os.environ.get("DEFT_WORKLOADS", ".workloads"))
names = sys.argv[1:] or TREES
shipped_refine = tb.TritonBackend.refine_plan
registers: dict[str, set] = {}


def compiled() -> dict:
    """The partial kernel's compiled instances on this device, by cache key."""
    caches = tk.tree_partial_kernel.device_caches
    return dict(caches[torch.cuda.current_device()][0]) if caches else {}
results = []
mode = "eager" if os.environ.get("EAGER") == "1" else "graph"
print(f"tree | variant | tiles | partials | programs | µs/step {mode} | µs/layer | max|diff| vs ref")
for name in names:
    try:
        layout = build(name, workloads)
    except FileNotFoundError:
        continue
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = layout.num_tokens
    ks = [torch.randn(n, H_KV, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(LAYERS)]
    vs = [torch.randn(n, H_KV, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(LAYERS)]
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=DTYPE, generator=gen)
    ref, _ = reference_attention(q, ks[0], vs[0], layout, D**-0.5)
    for label, cfg, u in VARIANTS:
        tb._GPU_CONFIGS[D] = cfg
        if u is None:
            tb.TritonBackend.refine_plan = shipped_refine
        else:
            tb.TritonBackend.refine_plan = lambda self, plan, *a, u=u: coarsen_plan(plan, u)
        # The compiled planner (deft.fastplan) coarsens as shipped: fixed factors plan with numpy.
        os.environ["DEFT_FASTPLAN"] = "1" if u is None else "0"
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
        plan = attn.plan(layout)
        before = compiled()
        try:
            diff = float((attn.run(q, ks[0], vs[0]).double() - ref.double()).abs().max())

            def step(attn=attn) -> None:
                for layer in range(LAYERS):
                    attn.run(q, ks[layer], vs[layer])

            us = _time(step, graph=os.environ.get("EAGER") != "1")
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            print(f"{name} | {label} | ERROR {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        programs = attn._prepared.num_work * H_KV
        registers.setdefault(label, set()).update(
            (k.n_regs, k.n_spills) for key, k in compiled().items() if key not in before)
        row = dict(tree=name, variant=label, tiles=plan.num_tiles, partials=plan.num_partials,
                   programs=programs, us=us, diff=diff)
        results.append(row)
        print(f"{name} | {label} | {plan.num_tiles} | {plan.num_partials} | {programs} | {us:.0f} | "
              f"{us / LAYERS:.1f} | {diff:.2e}", flush=True)
    del ks, vs
    torch.cuda.empty_cache()
tb._GPU_CONFIGS[D] = SHIPPED
tb.TritonBackend.refine_plan = shipped_refine
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "coarsen_sweep.json").write_text(json.dumps(results, indent=1))
print("\npartial kernel (registers, spills) compiled per variant:")
for label, regs in registers.items():
    print(f"{label}: {sorted(regs)}")
print("\nbest per tree:")
for name in dict.fromkeys(r["tree"] for r in results):
    rows = sorted((r for r in results if r["tree"] == name), key=lambda r: r["us"])
    print(name, " | ".join(f"{r['variant']} {r['us'] / LAYERS:.1f}" for r in rows[:4]))
for label, _, _ in VARIANTS:
    rows = [r for r in results if r["variant"] == label]
    best = {r["tree"]: min(x["us"] for x in results if x["tree"] == r["tree"]) for r in rows}
    if rows:
        print(f"{label}: mean slowdown vs per-tree best {sum(r['us'] / best[r['tree']] for r in rows) / len(rows):.3f}")
