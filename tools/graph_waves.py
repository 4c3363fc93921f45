"""Graph-safe attention against the plan-specialised launch, by the fixed grid's waves.

Per tree, the benchmark's 32-layer step (Llama-3-8B attention shape, one KV buffer per
layer) replayed as a CUDA graph: planned without a capacity (grid and kernel specialised to
the plan) and graph-safe (``Capacity`` of the tree's queries and tokens) as shipped, with a
grid of one wave of programs (``KernelConfig.graph_waves=1``) and without the register cap,
each checked against the float64 reference on layer 0; then the registers and spills of
every compiled partial kernel.

Usage: python3 tools/graph_waves.py [TREE ...]   (GPU only)
"""
import dataclasses

import torch

from benchmarks.attention_gpu import D, H_KV, H_Q, LAYERS, random_inputs, time_us
from benchmarks.trees import available, fan_layout
from deft import TreeAttention
from deft.ops import Capacity
from deft.ops.reference import reference_attention
from deft.ops.triton import configs, kernels
from deft.cli.common import workloads as recorded_workloads
from _usage import args

VARIANTS = {"graph-safe": {}, "graph-safe, 1 wave": {"graph_waves": 1},
            "graph-safe, no register cap": {"maxnreg": None}}
names = args(__doc__) or ["few-shot b=20", "speculative t=64", "speculative t=256",
                         "medusa APPS-256", "reasoning sorting128ToT", "long prompt 20k x64"]
trees = dict(available(names, recorded_workloads(None)))
trees["1 query on 1,000 tokens"] = fan_layout(1000, 1)
shipped = dict(configs.CONFIGS)
print("tree | plan-specialised µs | " + " | ".join(f"{v} µs" for v in VARIANTS))
for name, layout in trees.items():
    n = layout.num_tokens
    ks, vs, q = random_inputs(n, layout.num_queries)
    ref = reference_attention(q.double(), ks[0].double(), vs[0].double(), layout, D**-0.5)[0]
    cells = []
    for label in (None, *VARIANTS):
        changes = VARIANTS.get(label, {})
        configs.CONFIGS.update({k: dataclasses.replace(c, **changes) for k, c in shipped.items()})
        cap = None if label is None else Capacity(layout.num_queries, n)
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda", capacity=cap)
        attn.plan(layout)
        err = (attn.run(q, ks[0], vs[0]).double() - ref).abs().max().item()
        us = time_us(lambda: [attn.run(q, ks[i], vs[i]) for i in range(LAYERS)], graph=True)
        cells.append(f"{us:.0f}" + ("" if err < 5e-2 else f" (WRONG {err:.2g})"))
    configs.CONFIGS.update(shipped)
    print(f"{name} | " + " | ".join(cells), flush=True)
caches = kernels.tree_partial_kernel.device_caches[torch.cuda.current_device()][0]
for key, k in caches.items():
    print(f"registers {k.n_regs}, spills {k.n_spills}: {str(key)[-240:]}")
