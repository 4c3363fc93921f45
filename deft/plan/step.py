"""A step's host planning for a kernel backend, in one call: plan, coarsen, pack."""

from __future__ import annotations

from typing import Callable

from ..layout import TreeLayout
from .coarsen import Coarsening, refine
from .compiled import flatten_plan
from .packing import HostBuffer, PackedPlan, pack
from .tree_plan import TreePlan, make_plan

__all__ = ["plan_step"]


def plan_step(layout: TreeLayout, kind: str, block_kv: int, params: Coarsening,
              host_buffer: Callable[[int], HostBuffer],
              reuse: HostBuffer | None = None) -> tuple[TreePlan, PackedPlan]:
    """Plan ``layout``, coarsen ``flatten`` and ``per_query`` plans with ``params`` and pack
    the result for programs of ``params.block_m`` rows into ``reuse`` or ``host_buffer(n)``.
    ``flatten`` plans come from the compiled planner when it is built (identical results)."""
    if kind == "flatten":
        done = flatten_plan(layout, block_kv, params, host_buffer, reuse)
        if done is not None:
            return done
    plan = make_plan(layout, kind, block_kv)
    if kind in ("flatten", "per_query"):
        plan = refine(plan, params)
    return plan, pack(plan, params.g, params.block_m, host_buffer, reuse)
