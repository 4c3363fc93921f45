"""Time the partial kernel alone under variants (GPU): mask on/off, waves, blocks.

Usage: [VARIANTS=shipped] python3 tools/kernel_variants.py  — one line per (tree, variant): µs per layer.
"Mask off" gives wrong results; it only measures what the mask costs.
"""
import math
import os

import torch
import triton.testing

from deft import TreeAttention
from deft.bench.trees import build
from deft.ops import triton_backend as tb
from deft.ops.triton_kernels import tree_partial_kernel

H_Q, H_KV, D = 32, 8, 128
VARIANTS = [(64, 64, 4, 3, 4.0), (64, 64, 4, 3, 1.0), (64, 64, 4, 3, 16.0), (128, 64, 8, 3, 4.0),
            (64, 128, 8, 2, 4.0), (128, 128, 8, 2, 4.0), (64, 64, 4, 2, 4.0), (64, 32, 4, 4, 4.0)]
if os.environ.get("VARIANTS") == "shipped":
    VARIANTS = VARIANTS[:1]


def time_partial(attn, q, k, v, use_mask):
    p, a, cfg = attn._prepared, attn._prepared.arrays, attn._prepared.config
    po, plse = p.partial_o, p.partial_lse

    def go():
        tree_partial_kernel[(p.num_work, H_KV)](
            q, k, v, po, plse, a["tok_slot"], a["tok_lo"], a["tok_hi"], a["tok_off"],
            a["work_tile"], a["work_row0"], a["tile_tok"], a["tile_qs"], a["tile_qe"], a["tile_p0"], a["tile_full"],
            a["tile_slot0"], a["q_order"], a["q_pre"], a["q_len"], D**-0.5 * math.log2(math.e),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), po.stride(0), po.stride(1), plse.stride(0),
            G=H_Q // H_KV, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_MASK=use_mask, CONTIG=p.contiguous, IEEE=False,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    go()
    return triton.testing.do_bench(go, return_mode="median") * 1e3


for name in ["few-shot b=30", "speculative t=256", "long prompt 20k x64"]:
    layout = build(name, None)
    n = layout.num_tokens
    k = torch.randn(n, H_KV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(layout.num_queries, H_Q, D, device="cuda", dtype=torch.bfloat16)
    for kind in ["flatten", "per_query"]:
        for m, nb, w, s, waves in VARIANTS:
            tb._GPU_CONFIGS[D] = tb.KernelConfig(m, nb, w, s, waves)
            attn = TreeAttention(H_Q, H_KV, D, backend="triton", plan_kind=kind, device="cuda")
            plan = attn.plan(layout)
            for use_mask in ([True, False] if kind == "flatten" else [False]):
                try:
                    us = time_partial(attn, q, k, v, use_mask)
                except Exception as exc:  # noqa: BLE001
                    us = float("nan"); print("ERR", type(exc).__name__, str(exc)[:100])
                print(f"{name} | {kind} | m{m} n{nb} w{w} s{s} waves{waves} | tiles {plan.num_tiles} "
                      f"work {attn._prepared.num_work} | mask {use_mask} | {us:.1f} µs", flush=True)
