"""Where the graph-safe tax goes: a graph-safe step (buffers reserved for the tree's size, as
the engine's captured steps launch) re-specialised on what its plan allows, which a graph
that replays every plan cannot assume: queries already in plan order (no ``q_order`` load),
every tile's slots consecutive (no slot loads), no mask. Each is timed next to the
plan-specialised and the plain graph-safe step (32-layer graph replay, Llama-3-8B attention
shape) and checked against the float64 reference of layer 0.

Usage: python3 tools/graph_safe_tax.py TREE ...   (GPU only)
"""

import numpy as np
import torch
from benchmarks.attention_gpu import D, H_KV, H_Q, LAYERS, random_inputs, time_us
from benchmarks.trees import available
from deft import TreeAttention
from deft.ops import Capacity
from deft.ops.reference import reference_attention
from deft.recorded import workloads_dir
from _usage import args

names = args(__doc__)
print("tree | variant | µs/step | µs/layer | max|diff|")
for name, layout in available(names, workloads_dir(None)):
    n = layout.num_tokens
    ks, vs, q = random_inputs(n, layout.num_queries)
    ref, _ = reference_attention(q, ks[0], vs[0], layout, D**-0.5)
    out = torch.empty_like(q)
    variants = [("plan-specialised", False, {})]
    gs = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda",
                       capacity=Capacity(layout.num_queries, n))
    gs.plan(layout)
    p = gs._prepared
    order = p.segment("q_order")[:layout.num_queries].cpu().numpy()
    sorted_ok = bool((order == np.arange(layout.num_queries)).all())
    work = p.segment("work")[:p.num_work * 8].view(-1, 8).cpu().numpy()
    contig_ok = bool((work[:, 6] >= 0).all())
    mask_ok = not p.plan.needs_mask
    print(f"# {name}: sorted {sorted_ok}, contiguous {contig_ok}, maskless {mask_ok}, "
          f"{p.num_work} work items, {p.programs} programs", flush=True)
    variants.append(("graph-safe", True, {}))
    if sorted_ok:
        variants.append(("gs + sorted", True, {"sorted_queries": True}))
    if contig_ok:
        variants.append(("gs + contiguous", True, {"contiguous": True}))
    if mask_ok:
        variants.append(("gs + no mask", True, {"needs_mask": False}))
    if sorted_ok and contig_ok:
        variants.append(("gs + sorted + contiguous", True,
                         {"sorted_queries": True, "contiguous": True}))
    for label, reserved, fields in variants:
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda",
                             capacity=Capacity(layout.num_queries, n) if reserved else None)
        attn.plan(layout)
        # The launch flags re-specialised (launches then go through Triton, not the driver).
        attn._prepared.__dict__.update(fields, native=None)
        diff = float((attn.run(q, ks[0], vs[0]).double() - ref.double()).abs().max())

        def step(attn=attn) -> None:
            for layer in range(LAYERS):
                attn.run(q, ks[layer], vs[layer], out=out)

        us = time_us(step, graph=True)
        print(f"{name} | {label} | {us:.0f} | {us / LAYERS:.1f} | {diff:.2e}", flush=True)
