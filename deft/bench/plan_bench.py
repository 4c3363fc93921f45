"""``deft bench plan``: planning time of every plan kind on the benchmark trees (CPU)."""

from __future__ import annotations

from pathlib import Path

from ..plan import PLAN_KINDS, make_plan
from .report import markdown_table
from .timing import median_seconds
from .trees import PLAN_SUITE, build

__all__ = ["plan_table"]


def plan_table(names: list[str] | None = None, workloads: Path | None = None,
               block_kv: int = 64, reps: int = 50) -> str:
    """Markdown table of median planning time (ms) per plan kind, with the flatten plan's shape."""
    rows = []
    for name in names or PLAN_SUITE:
        try:
            layout = build(name, workloads)
        except FileNotFoundError:
            continue
        plan = make_plan(layout, "flatten", block_kv)
        times = [median_seconds(lambda k=k: make_plan(layout, k, block_kv), reps=reps) * 1e3
                 for k in PLAN_KINDS]
        rows.append([name, layout.num_nodes, layout.num_tokens, layout.num_queries,
                     plan.num_tiles, plan.max_group, *times])
    headers = ["workload", "nodes", "tokens", "queries", "tiles", "max group",
               *(f"{k} (ms)" for k in PLAN_KINDS)]
    return markdown_table(headers, rows)
