"""Host time of DeFT-Flatten's ``plan`` and of eager ``run`` calls, with the top functions
by own time under cProfile. Runs on CUDA (or on CPU with ``TRITON_INTERPRET=1``, planning
only).

Per tree, on CUDA, host µs per layer of eager runs launched two ways in the same process:
through Triton alone (the plan's driver records off) and as shipped (after a plan's first
call of a kind, through the CUDA driver: ``deft.ops.triton.native_launch``). "layer" is one
``run`` of a planned step, repeated (and, driver-launched, its backend's share: the run
without ``TreeAttention``'s argument checks); "step" is ``plan`` and then a 32-layer step (a
K/V buffer and an output per layer), its runs' share per layer: re-planning the same tree
(whose launches are the last plan's, so are its driver records), a changed tree (no records
yet: its first layer launches through Triton), and a graph-safe attention (``capacity``:
every plan launches alike). The GPU is idle at the start of each timed call (host time only).

Usage: python3 tools/profile_host.py [TREE ...]
"""
import cProfile
import pstats
import statistics
import time

import torch

from benchmarks.timing import median_seconds
from benchmarks.trees import available
from deft import Capacity, TreeAttention
from deft.cli.common import workloads as recorded_workloads
from _usage import args

H_Q, H_KV, D, LAYERS = 32, 8, 128, 32
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def median_us(fn, n: int) -> float:
    return median_seconds(fn, reps=n, max_seconds=60.0) * 1e6


def host_us(fn, reps: int) -> float:
    """Median host time of ``fn`` over ``reps`` calls, each started on an idle GPU."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def triton_only(attn: TreeAttention) -> None:
    """Launch the current plan's layers through Triton alone: no driver records."""
    attn._prepared.__dict__["native"] = None


names = args(__doc__) or ["few-shot b=20", "speculative t=32", "long prompt 20k x64"]
workloads = recorded_workloads(None)
rows = []
for name, layout in available(names, workloads):
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device=DEV)
    attn.plan(layout)
    plan_us = median_us(lambda: attn.plan(layout), 200)
    print(f"{name}: plan {plan_us:.1f} µs", flush=True)
    prof = [("plan", "attn.plan(layout)")]
    if DEV == "cuda":
        q = torch.randn(layout.num_queries, H_Q, D, device=DEV, dtype=torch.bfloat16)
        ks = [torch.randn(layout.num_tokens, H_KV, D, device=DEV, dtype=torch.bfloat16)
              for _ in range(LAYERS)]
        vs = [torch.randn_like(k) for k in ks]
        outs = [torch.empty_like(q) for _ in range(LAYERS)]
        k, v, out = ks[0], vs[0], outs[0]
        figures = {}
        safe = TreeAttention(H_Q, H_KV, D, backend="triton", device=DEV,
                             capacity=Capacity(layout.num_queries, layout.num_tokens + 256))
        for how in ("triton", "driver", "driver, new records", "driver, graph-safe"):
            a = safe if how == "driver, graph-safe" else attn
            a.plan(layout)
            if how == "triton":
                triton_only(a)
            if how in ("triton", "driver"):
                figures[f"{how} layer"] = host_us(lambda: a.run(q, k, v, out=out), 300)

            def step(a=a, how=how) -> None:
                if how == "driver, new records":  # what a changed tree costs: no records yet
                    a._prepared.__dict__["native"] = {}
                a.plan(layout)
                if how == "triton":
                    triton_only(a)
                for i in range(LAYERS):
                    a.run(q, ks[i], vs[i], out=outs[i])

            planned_us = median_us(lambda: safe.plan(layout), 200) if a is safe else plan_us
            figures[f"{how} step"] = (host_us(step, 60) - planned_us) / LAYERS
        attn.plan(layout)  # the backend's share of a driver-launched layer (no argument checks)
        backend, prepared, scale = attn._backend, attn._prepared, attn.sm_scale
        figures["driver backend.run"] = host_us(
            lambda: backend.run(prepared, q, k, v, scale, out=out, want_lse=False), 300)
        print(" ".join(f"{key} {value:.1f} µs" for key, value in figures.items()), flush=True)
        rows.append((name, figures))
        attn.plan(layout)
        prof.append(("run", "attn.run(q, k, v, out=out)"))
    for label, stmt in prof:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(500):
            exec(stmt)
        pr.disable()
        if DEV == "cuda":
            torch.cuda.synchronize()
        print(f"-- {name}: {label}, 500 calls, by own time")
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)

if rows:
    print(f"\nhost µs per eager layer (Triton launches | driver launches; step: plan and "
          f"{LAYERS} layers, the runs' share per layer)")
    print("tree | layer, Triton | layer, driver | of which backend.run | step, Triton | "
          "step, driver: same tree | new tree | graph-safe")
    for name, f in rows:
        print(f"{name} | {f['triton layer']:.1f} | {f['driver layer']:.1f} | "
              f"{f['driver backend.run']:.1f} | {f['triton step']:.1f} | {f['driver step']:.1f} | "
              f"{f['driver, new records step']:.1f} | {f['driver, graph-safe step']:.1f}")
