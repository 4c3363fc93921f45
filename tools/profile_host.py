"""Host time of DeFT-Flatten's ``plan`` and of one eager ``run`` (one layer), with the top
functions by own time under cProfile. Runs on CUDA (or on CPU with ``TRITON_INTERPRET=1``,
planning only).

Usage: python3 tools/profile_host.py [TREE ...]
"""
import cProfile
import os
import pstats
import sys
from pathlib import Path

import torch

from benchmarks.timing import median_seconds
from benchmarks.trees import build
from deft import TreeAttention

H_Q, H_KV, D = 32, 8, 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"
workloads = Path(os.environ.get("DEFT_WORKLOADS", ".workloads"))


def median_us(fn, n: int) -> float:
    return median_seconds(fn, reps=n, max_seconds=60.0) * 1e6


for name in sys.argv[1:] or ["few-shot b=20", "speculative t=32", "long prompt 20k x64"]:
    layout = build(name, workloads)
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device=DEV)
    attn.plan(layout)
    plan_us = median_us(lambda: attn.plan(layout), 200)
    line = f"{name}: plan {plan_us:.1f} µs"
    prof = [("plan", "attn.plan(layout)")]
    if DEV == "cuda":
        q = torch.randn(layout.num_queries, H_Q, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(layout.num_tokens, H_KV, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        attn.run(q, k, v, out=out)
        torch.cuda.synchronize()
        run_us = median_us(lambda: attn.run(q, k, v, out=out), 200)
        torch.cuda.synchronize()
        line += f", eager run (one layer, host) {run_us:.1f} µs"
        prof.append(("run", "attn.run(q, k, v, out=out)"))
    print(line, flush=True)
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
