"""Run one layer of DeFT-Flatten on a few benchmark trees, for a profiler (GPU only).

Usage: ncu --clock-control none -k regex:tree_partial --section SpeedOfLight ... \
           python3 tools/profile_step.py [TREE ...]
"""
import sys

import torch

from deft import TreeAttention
from deft.bench.trees import build

H_Q, H_KV, D = 32, 8, 128
for name in sys.argv[1:] or ["few-shot b=20", "long prompt 20k x64"]:
    layout = build(name, None)
    k = torch.randn(layout.num_tokens, H_KV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=torch.bfloat16)
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
    attn.plan(layout)
    for _ in range(3):
        attn.run(q, k, v)
    torch.cuda.synchronize()
    print(name, "done", flush=True)
