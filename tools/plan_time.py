"""Host time of DeFT-Flatten's ``TreeAttention.plan`` on CUDA for the GPU benchmark trees:
the median of 21 back-to-back plans started right after a synchronisation (some GPU work,
then a sync, as before a decode step's plan) and of 2,000 back-to-back plans (a warm host),
in µs. For A/B runs of two checkouts, run it once per checkout (``PYTHONPATH``).

Usage: python3 tools/plan_time.py [TREE ...]
"""

import torch

from benchmarks.attention_gpu import D, H_KV, H_Q
from benchmarks.timing import median_plan_seconds
from benchmarks.trees import GPU_SUITE, available
from deft import TreeAttention
from deft.cli.common import workloads as recorded_workloads
from _usage import args

names = args(__doc__) or GPU_SUITE
workloads = recorded_workloads(None)

print(f"{'workload':26s} {'after sync':>11s} {'warm':>8s}  (µs per plan)")
for name, layout in available(names, workloads):
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
    attn.plan(layout)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # some GPU work, then a sync, as before a decode step's plan
        x = x @ x / 64
    torch.cuda.synchronize()
    cold = median_plan_seconds(attn, layout, 21) * 1e6
    warm = median_plan_seconds(attn, layout, 2000) * 1e6
    print(f"{name:26s} {cold:11.1f} {warm:8.1f}", flush=True)
