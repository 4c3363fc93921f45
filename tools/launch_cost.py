"""What each of a layer's two launches costs on the GPU (GPU only).

Per tree, µs per layer of the benchmark's 32-layer step (CUDA-graph replay, one KV buffer
per layer, the Llama-3-8B attention shape): the shipped step, the partial kernel alone
(merge skipped), the merge kernel alone (partial kernel skipped; it merges whatever the
workspace holds), and the fused merge (``fuse_merge``: one launch per layer). Then the
floor of the launches themselves: an empty Triton kernel once and twice per layer, and
twice with programmatic dependent launch (second grid 132 or 1,024 programs; the shipped step
chains its launches with it).

Usage: python3 tools/launch_cost.py [TREE ...]   (default: small steps of the GPU suite)
"""
import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.attention_gpu import D, DTYPE, H_KV, H_Q, LAYERS, time_us
from benchmarks.trees import available, fan_layout
from deft import TreeAttention
from deft.ops.triton import configs, launch
from deft.cli.common import workloads as recorded_workloads
from _usage import args

names = args(__doc__) or ["speculative t=32", "reasoning keywordToT", "medusa APPS-32",
                         "few-shot b=20", "speculative t=256"]
workloads = recorded_workloads(None)
SHIPPED = dict(configs.CONFIGS)
FUSED = {key: dataclasses.replace(cfg, fuse_merge=True) for key, cfg in SHIPPED.items()}


class _Skipped:
    """Stands in for a kernel: launching it does nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None

    def warmup(self, *a, **k) -> None:
        pass


def layer_us(layout, variant: str) -> float:
    n = layout.num_tokens
    ks = [torch.randn(n, H_KV, D, device="cuda", dtype=DTYPE) for _ in range(LAYERS)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    kernel, merge = launch.tree_partial_kernel, launch.launch_merge
    configs.CONFIGS.update(FUSED if variant == "fused" else SHIPPED)
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
    attn.plan(layout)
    attn.run(q, ks[0], vs[0], out=out)  # compile both kernels before any is skipped
    if variant == "partial only":
        launch.launch_merge = lambda *a, **k: None
    elif variant == "merge only":
        launch.tree_partial_kernel = _Skipped()
    try:
        return time_us(lambda: [attn.run(q, ks[i], vs[i], out=out) for i in range(LAYERS)],
                     graph=True) / LAYERS
    finally:
        launch.tree_partial_kernel, launch.launch_merge = kernel, merge
        configs.CONFIGS.update(SHIPPED)


@triton.jit
def _empty(X, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if tl.program_id(0) < 0:  # never: keeps X an argument
        tl.store(X, 0)


VARIANTS = ("shipped", "partial only", "merge only", "fused")
print("tree | " + " | ".join(f"{v} µs/layer" for v in VARIANTS))
trees = {"1 query on 32 tokens": fan_layout(32, 1), **dict(available(names, workloads))}
for name, layout in trees.items():
    print(f"{name} | " + " | ".join(f"{layer_us(layout, v):.1f}" for v in VARIANTS), flush=True)

x = torch.zeros(1, device="cuda")
for label, second, pdl in (("1 empty launch, 132 programs", 0, False),
                           ("2 empty launches, 132 + 132 programs", 132, False),
                           ("2 empty launches (PDL), 132 + 132 programs", 132, True),
                           ("2 empty launches (PDL), 132 + 1024 programs", 1024, True)):
    def step(second=second, pdl=pdl) -> None:
        for _ in range(LAYERS):
            _empty[(132,)](x, PDL=pdl, launch_pdl=pdl)
            if second:
                _empty[(second,)](x, PDL=pdl, launch_pdl=pdl)
    print(f"{label}: {time_us(step, graph=True) / LAYERS:.1f} µs/layer")
