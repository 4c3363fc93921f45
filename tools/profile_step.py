"""Run one layer of DeFT-Flatten on a few benchmark trees, for a profiler (GPU only).

Per tree: one eager run (2 launches), then 3 replays of the layer captured in a CUDA graph
(TMA loads, as in the benchmark's graph column), 2 kernels each.

Usage: ncu --clock-control none -k regex:"tree_partial|merge_kernel" --launch-skip 4 \
           --launch-count 2 --section SpeedOfLight ... python3 tools/profile_step.py TREE
"""

import torch

from benchmarks.trees import available
from deft import TreeAttention
from deft.cli.common import workloads as recorded_workloads
from _usage import args

H_Q, H_KV, D = 32, 8, 128
names = args(__doc__) or ["few-shot b=20", "long prompt 20k x64"]
workloads = recorded_workloads(None)
for name, layout in available(names, workloads):
    k = torch.randn(layout.num_tokens, H_KV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=torch.bfloat16)
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
    attn.plan(layout)
    out = torch.empty_like(q)
    attn.run(q, k, v, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    print(name, "done", flush=True)
