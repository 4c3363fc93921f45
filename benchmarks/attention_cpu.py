"""``deft bench attention --device cpu``: DeFT's torch backend against per-query decoding
(the same executor with the per-query plan, and PyTorch SDPA on materialised per-query KV)
and compiled FlexAttention with the tree mask, on one layer, measured in one process."""

from __future__ import annotations

from pathlib import Path

import torch

from deft.attention import TreeAttention
from deft.layout import TreeLayout

from .baselines import flex_tree_attention, sdpa_per_query
from .report import markdown_table, record, write_record
from .timing import median_seconds
from .trees import CPU_SUITE, available

__all__ = ["cpu_attention_table"]

LLAMA3_8B = (32, 8, 128)  # query heads, KV heads, head_dim


def _qkv(layout: TreeLayout, h_q: int, h_kv: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    n = int(layout.kv_indices.max()) + 1
    return (torch.randn(layout.num_queries, h_q, d, generator=g).to(dtype),
            torch.randn(n, h_kv, d, generator=g).to(dtype),
            torch.randn(n, h_kv, d, generator=g).to(dtype))


def cpu_attention_table(names: list[str] | None = None, workloads: Path | None = None,
                        dtype: torch.dtype = torch.float32, flex: bool = True,
                        reps: int = 10, progress=None,  # noqa: ANN001
                        json_path: str | None = None) -> str:
    """Markdown table: ms per layer and DeFT's speedup over each peer, plus KV bytes read
    (also written as a result record to ``json_path``, when given)."""
    h_q, h_kv, d = LLAMA3_8B
    rows = []
    for name, layout in available(names or CPU_SUITE, workloads):
        q, k, v = _qkv(layout, h_q, h_kv, d, dtype)
        deft = TreeAttention(h_q, h_kv, d, backend="torch")
        plan = deft.plan(layout)
        per_q = TreeAttention(h_q, h_kv, d, backend="torch", plan_kind="per_query")
        pq_plan = per_q.plan(layout)
        peers = {
            "DeFT-Flatten": lambda: deft.run(q, k, v),
            "per-query (same executor)": lambda: per_q.run(q, k, v),
            "per-query SDPA": sdpa_per_query(layout, q, k, v, deft.sm_scale),
        }
        if flex:
            peers["FlexAttention"] = flex_tree_attention(layout, q, [k], [v], deft.sm_scale)
        ref = peers["DeFT-Flatten"]().double()
        times, err = {}, 0.0
        for peer, fn in peers.items():
            if progress:
                progress(f"{name}: {peer}")
            err = max(err, float((fn().double() - ref).abs().max()))
            times[peer] = median_seconds(fn, reps=reps) * 1e3
        kv_deft = plan.io_bytes(h_q, h_kv, d, dtype.itemsize)["kv"]
        kv_pq = pq_plan.io_bytes(h_q, h_kv, d, dtype.itemsize)["kv"]
        t0 = times["DeFT-Flatten"]
        rows.append([name, layout.num_tokens, layout.num_queries, t0,
                     *(times[p] / t0 for p in list(peers)[1:]),
                     kv_deft / 2**20, kv_pq / kv_deft, deft.plan_seconds * 1e3, err])
    headers = ["workload", "tokens", "queries", "DeFT (ms)", "x vs per-query exec",
               "x vs SDPA per-query", *(["x vs FlexAttention"] if flex else []),
               "DeFT KV MiB", "per-query KV / DeFT", "plan (ms)", "max |diff|"]
    if json_path:
        write_record(json_path, record(headers, rows, "cpu", threads=torch.get_num_threads(),
                                       dtype=str(dtype).removeprefix("torch."), reps=reps))
    return markdown_table(headers, rows)
