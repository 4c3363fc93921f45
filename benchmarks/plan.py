"""``deft bench plan``: planning time of every plan kind on the benchmark trees (CPU), the
torch backend's whole step planning (``TreeAttention.plan``'s work: plan, tile buckets and
masks), and the triton backend's whole host-side step planning (flatten plan, coarsening,
kernel metadata) with numpy and with the compiled planner."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from deft.layout import TreeLayout
from deft.ops import Backend, Heads, get_backend
from deft.plan import PLAN_KINDS, compiled, make_plan

from .report import markdown_table, record, write_record
from .timing import median_seconds
from .trees import PLAN_SUITE, available

__all__ = ["plan_table"]

# Llama-3-8B attention shape, as in the GPU benchmark.
_HEADS = (32, 8, 128)


def _triton_host_ms(be: Backend, layout: TreeLayout, block_kv: int,
                    reps: int) -> tuple[float, float]:
    """Median ms of the triton backend ``be``'s step planning on the host (device ``cpu``: no
    upload), with numpy and compiled; the second is NaN without a compiled planner."""
    cpu = torch.device("cpu")

    def step() -> object:
        return be.plan(layout, "flatten", block_kv, Heads(*_HEADS), cpu)

    built = compiled.load_library() is not None and os.environ.get("DEFT_FASTPLAN") != "0"
    fast = median_seconds(step, reps=reps) * 1e3 if built else math.nan
    old = os.environ.get("DEFT_FASTPLAN")
    os.environ["DEFT_FASTPLAN"] = "0"
    try:
        slow = median_seconds(step, reps=reps) * 1e3
    finally:
        if old is None:
            del os.environ["DEFT_FASTPLAN"]
        else:
            os.environ["DEFT_FASTPLAN"] = old
    return slow, fast


def plan_table(names: list[str] | None = None, workloads: Path | None = None,
               block_kv: int = 64, reps: int = 50, json_path: str | None = None) -> str:
    """Markdown table of median planning time (ms) per plan kind, with the flatten plan's
    shape, then the triton backend's host planning (numpy, compiled) when triton imports
    (also written as a result record to ``json_path``, when given)."""
    try:
        triton_be: Backend | None = get_backend("triton")
    except ImportError:
        triton_be = None
    rows = []
    for name, layout in available(names or PLAN_SUITE, workloads):
        plan = make_plan(layout, "flatten", block_kv)
        times = [median_seconds(lambda k=k: make_plan(layout, k, block_kv), reps=reps) * 1e3
                 for k in PLAN_KINDS]
        torch_be = get_backend("torch")
        torch_ms = median_seconds(lambda: torch_be.plan(
            layout, "flatten", torch_be.default_block_kv, Heads(*_HEADS), torch.device("cpu")),
            reps=reps) * 1e3
        extra = list(_triton_host_ms(triton_be, layout, block_kv, reps)) if triton_be else []
        rows.append([name, layout.num_nodes, layout.num_tokens, layout.num_queries,
                     plan.num_tiles, plan.max_group, *times, torch_ms, *extra])
    headers = ["workload", "nodes", "tokens", "queries", "tiles", "max group",
               *(f"{k} (ms)" for k in PLAN_KINDS), "torch step (ms)"]
    if triton_be:
        headers += ["triton step, numpy (ms)", "triton step, compiled (ms)"]
    if json_path:
        write_record(json_path, record(headers, rows, "cpu", numpy=np.__version__,
                                       block_kv=block_kv, reps=reps))
    return markdown_table(headers, rows)
