"""Time the triton backend's kernels alone on a few trees, for several configs (GPU only).

Usage: [PROBE_ALL=0] python3 tools/kernel_probe.py [TREE ...]  (prints a table: per-layer µs of partial and merge kernels)
"""
import itertools
import os
import sys

import torch
import triton.testing

from deft import TreeAttention
from deft.bench.trees import build
from deft.ops import triton_backend as tb

H_Q, H_KV, D = 32, 8, 128
trees = sys.argv[1:] or ["few-shot b=20", "speculative t=256", "long prompt 20k x64"]
configs = [tb.KernelConfig(m, n, w, s, wv) for m, n, w, s, wv in itertools.product(
    [64, 128], [32, 64], [4, 8], [2, 3], [1.0, 4.0])]
if os.environ.get("PROBE_ALL", "1") == "0":  # only the shipped config
    configs = [tb.kernel_config(D)]
print("tree | config | partial µs | merge µs | IO-floor µs (1 layer)")
for name in trees:
    layout = build(name, None)
    n = layout.num_tokens
    k = torch.randn(n, H_KV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=torch.bfloat16)
    floor = n * H_KV * D * 4 / 4.2e12 * 1e6
    best = None
    for cfg in configs:
        tb._GPU_CONFIGS[D] = cfg
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
        plan = attn.plan(layout)
        prep = attn._prepared
        backend = attn._backend
        o, lse = backend.run(prep, q, k, v, D**-0.5)
        a = prep.arrays
        full = triton.testing.do_bench(lambda: backend.run(prep, q, k, v, D**-0.5), return_mode="median") * 1e3
        merge = triton.testing.do_bench(lambda: tb.launch_merge(prep.partial_o, prep.partial_lse, o, lse, a["merge_indptr"], a["merge_partials"]), return_mode="median") * 1e3
        print(f"{name} | m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} waves{cfg.waves} tiles{plan.num_tiles} | {full - merge:.1f} | {merge:.1f} | {floor:.1f}", flush=True)
        if best is None or full < best[0]:
            best = (full, cfg)
    print(f"BEST {name}: {best[0]:.1f} µs {best[1]}")
