"""What gathered K/V costs a step: each tree with its slots consecutive (as the benchmark
holds them: tiles load by TMA) and with its tokens scattered over the pool by pages (the
engine's 16-token pages in a random order, as a server's pool holds them after churn:
``tools/slot_runs.py``; tiles gather), the same attention either way (K/V moved with their
slots). Timed plan-specialised and graph-safe (32-layer graph replay, Llama-3-8B attention
shape) and checked against the float64 reference of layer 0.

Usage: python3 tools/gather_cost.py TREE ...   (GPU only)
"""

import numpy as np
import torch
from benchmarks.attention_gpu import D, DTYPE, H_KV, H_Q, LAYERS, random_inputs, time_us
from benchmarks.trees import available
from deft import TreeAttention
from deft.layout import TreeLayout
from deft.ops import Capacity
from deft.ops.reference import reference_attention
from deft.recorded import workloads_dir
from _usage import args

PAGE = 16


def scattered(layout: TreeLayout, seed: int = 0) -> tuple[TreeLayout, np.ndarray]:
    """``layout`` with slot ``s`` moved to ``moved[s]``: whole pages of ``PAGE`` slots in a
    random order (a slot keeps its offset in its page), and ``moved``."""
    pages = -(-int(layout.kv_indices.max(initial=0) + 1) // PAGE)
    order = np.random.default_rng(seed).permutation(pages)
    slots = np.arange(pages * PAGE)
    moved = order[slots // PAGE] * PAGE + slots % PAGE
    return TreeLayout(layout.parents, layout.node_kv_indptr, moved[layout.kv_indices],
                      layout.query_nodes, layout.query_kv_lens), moved


names = args(__doc__)
print("tree | slots | launch | µs/step | µs/layer | tiles of consecutive slots | max|diff|")
for name, layout in available(names, workloads_dir(None)):
    n = int(layout.kv_indices.max(initial=0)) + 1
    ks, vs, q = random_inputs(n, layout.num_queries)
    ref, _ = reference_attention(q, ks[0], vs[0], layout, D**-0.5)
    out = torch.empty_like(q)
    moved_layout, moved = scattered(layout)
    where = torch.as_tensor(moved[:n], device="cuda")
    size = -(-n // PAGE) * PAGE

    def scatter(x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(size, H_KV, D, device="cuda", dtype=DTYPE)
        y[where] = x
        return y

    for label, lay, kk, vv in (("consecutive", layout, ks, vs),
                               ("pages scattered", moved_layout, [scatter(k) for k in ks],
                                [scatter(v) for v in vs])):
        for launch in ("plan-specialised", "graph-safe"):
            cap = Capacity(lay.num_queries, lay.num_tokens) if launch == "graph-safe" else None
            attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda", capacity=cap)
            attn.plan(lay)
            p = attn._prepared
            work = p.segment("work")[:p.num_work * 8].view(-1, 8).cpu().numpy()
            tokens = work[:, 1] - work[:, 0]
            share = tokens[work[:, 6] >= 0].sum() / max(tokens.sum(), 1)
            diff = float((attn.run(q, kk[0], vv[0]).double() - ref.double()).abs().max())

            def step(attn=attn, kk=kk, vv=vv) -> None:
                for layer in range(LAYERS):
                    attn.run(q, kk[layer], vv[layer], out=out)

            us = time_us(step, graph=True)
            print(f"{name} | {label} | {launch} | {us:.0f} | {us / LAYERS:.1f} | {share:.0%} "
                  f"| {diff:.2e}", flush=True)
