"""The fixed cost of a DeFT-Flatten layer on the GPU: steps whose KV is too small to matter.

Times the benchmark's 32-layer step (CUDA-graph replay, one KV buffer per layer, the
Llama-3-8B attention shape) on synthetic trees from one 32-token sequence up to the
benchmark's speculative t=32, plan-specialised and graph-safe (buffers reserved for the
tree's size, as the engine's captured steps launch), and prints µs per layer next to the IO
floor of the layer's unique KV bytes at the ``BW`` environment variable's bytes/s (default
4.2e12, the H200's measured read bandwidth). What a tiny tree takes is launch and dependency
latency, not bytes: no tree runs faster. ``--json PATH`` also writes the rows as a record.

Usage: python3 tools/latency_floor.py [--json PATH]   (GPU only)
"""
import argparse
import os

import torch

from benchmarks.attention_gpu import D, DTYPE, H_KV, H_Q, LAYERS, time_us
from benchmarks.report import record, write_record
from benchmarks.trees import fan_layout
from deft import TreeAttention
from deft.ops import Capacity

BW = float(os.environ.get("BW", 4.2e12))
TREES = {
    "1 query on 32 tokens": fan_layout(32, 1),
    "1 query on 512 tokens": fan_layout(512, 1),
    "1 query on 2,000 tokens": fan_layout(2000, 1),
    "32 leaves on 32 tokens": fan_layout(32, 32),
    "32 leaves on 512 tokens": fan_layout(512, 32),
    "32 leaves on 2,000 tokens (speculative t=32)": fan_layout(2000, 32),
}

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--json", help="write the rows as a record here")
args = ap.parse_args()
rows = []
print("tree | programs | partials | µs/layer (graph) | graph-safe | IO floor µs/layer")
for name, layout in TREES.items():
    n = layout.num_tokens
    ks = [torch.randn(n, H_KV, D, device="cuda", dtype=DTYPE) for _ in range(LAYERS)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    times = []
    for capacity in (None, Capacity(layout.num_queries, n)):
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda", capacity=capacity)
        plan = attn.plan(layout)

        def step(attn=attn) -> None:
            for layer in range(LAYERS):
                attn.run(q, ks[layer], vs[layer], out=out)

        times.append(time_us(step, graph=True) / LAYERS)
        if capacity is None:
            programs = attn._prepared.num_work * H_KV
    floor = 2 * n * H_KV * D * ks[0].element_size() / BW * 1e6
    rows.append({"tree": name, "programs": programs, "partial states": plan.num_partials,
                 "µs per layer": round(times[0], 1), "µs per layer graph-safe": round(times[1], 1),
                 "IO floor µs": round(floor, 2)})
    print(f"{name} | {programs} | {plan.num_partials} | {times[0]:.1f} | {times[1]:.1f} | "
          f"{floor:.2f}", flush=True)
if args.json:
    headers = list(rows[0])
    write_record(args.json, record(
        headers, [[r[h] for h in headers] for r in rows], device="cuda",
        title="The fixed cost of a DeFT-Flatten layer on tiny trees (H200, 32-layer CUDA graph)",
        io_floor_bandwidth_tb_s=BW / 1e12))
