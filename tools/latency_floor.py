"""The fixed cost of a DeFT-Flatten layer on the GPU: steps whose KV is too small to matter.

Times the benchmark's 32-layer step (CUDA-graph replay, one KV buffer per layer, the
Llama-3-8B attention shape) on synthetic trees from one 32-token sequence up to the
benchmark's speculative t=32, and prints µs per layer next to the IO floor of the layer's
unique KV bytes at ``BW`` bytes/s (default 4.2e12, the H200's measured read bandwidth).
What a tiny tree takes is launch and dependency latency, not bytes: no tree runs faster.

Usage: python3 tools/latency_floor.py   (GPU only)
"""
import os

import torch

from benchmarks.attention_gpu import D, DTYPE, H_KV, H_Q, LAYERS, time_us
from benchmarks.trees import fan_layout
from deft import TreeAttention

BW = float(os.environ.get("BW", 4.2e12))
TREES = {
    "1 query on 32 tokens": fan_layout(32, 1),
    "1 query on 512 tokens": fan_layout(512, 1),
    "1 query on 2,000 tokens": fan_layout(2000, 1),
    "32 leaves on 32 tokens": fan_layout(32, 32),
    "32 leaves on 512 tokens": fan_layout(512, 32),
    "32 leaves on 2,000 tokens (speculative t=32)": fan_layout(2000, 32),
}

print("tree | programs | partials | µs/layer (graph) | IO floor µs/layer")
for name, layout in TREES.items():
    n = layout.num_tokens
    ks = [torch.randn(n, H_KV, D, device="cuda", dtype=DTYPE) for _ in range(LAYERS)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
    plan = attn.plan(layout)

    def step() -> None:
        for layer in range(LAYERS):
            attn.run(q, ks[layer], vs[layer], out=out)

    us = time_us(step, graph=True) / LAYERS
    floor = 2 * n * H_KV * D * ks[0].element_size() / BW * 1e6
    print(f"{name} | {attn._prepared.num_work * H_KV} | {plan.num_partials} | {us:.1f} | "
          f"{floor:.2f}", flush=True)
