"""A step's host planning for a kernel backend, in one call: plan, coarsen, pack."""

from __future__ import annotations

from typing import Callable

from ..layout import TreeLayout
from .coarsen import Coarsening, modelled_makespan, refine
from .compiled import flatten_plan
from .packing import HostBuffer, PackedPlan, pack
from .tree_plan import TreePlan, make_plan

__all__ = ["plan_step", "flatten_cut"]


def flatten_cut(layout: TreeLayout, block_kv: int, params: Coarsening) -> TreePlan:
    """The ``flatten`` plan of ``layout``, its tiles also cut at nodes of at least
    ``params.node_cut`` tokens (``make_plan``'s ``node_cut``) where the launch model says
    that plan, coarsened, finishes sooner (:func:`~deft.plan.coarsen.modelled_makespan`; on
    a tie, where it holds fewer partial states coarsened: less to write and merge) and holds
    no more partial states than the plain plan before coarsening (which bounds what
    graph-safe buffers reserve). A node that starts inside a tile makes that tile serve the
    groups on both sides, masked: on separate prompts or long branches that costs programs
    and masked parts, while on a tree of short branches one tile per node would cost many
    short programs (docs/decisions.md, "Tiles cut at long nodes")."""
    return _flatten_cut(layout, block_kv, params)[0]


def _flatten_cut(layout: TreeLayout, block_kv: int,
                 params: Coarsening) -> tuple[TreePlan, TreePlan | None]:
    """:func:`flatten_cut`'s plan, and that plan refined where choosing it refined it
    (else ``None``), so that a step refines it once."""
    plan = make_plan(layout, "flatten", block_kv)
    if params.node_cut <= 0 or params.slots <= 0:
        return plan, None
    cut = make_plan(layout, "flatten", block_kv, params.node_cut)
    span, span_cut = modelled_makespan(plan, params), modelled_makespan(cut, params)
    if span_cut > span:
        return plan, None
    cut_refined = refine(cut, params)
    fits = cut_refined.num_partials <= plan.num_partials
    if span_cut < span:
        return (cut, cut_refined) if fits else (plan, None)
    plan_refined = refine(plan, params)
    if fits and cut_refined.num_partials < plan_refined.num_partials:
        return cut, cut_refined
    return plan, plan_refined


def plan_step(layout: TreeLayout, kind: str, block_kv: int, params: Coarsening,
              host_buffer: Callable[[int], HostBuffer],
              reuse: HostBuffer | None = None) -> tuple[TreePlan, PackedPlan]:
    """Plan ``layout`` (``flatten``: :func:`flatten_cut`), coarsen ``flatten`` and
    ``per_query`` plans with ``params`` and pack the result for programs of
    ``params.block_m`` rows into ``reuse`` or ``host_buffer(n)``. ``flatten`` plans come from
    the compiled planner when it is built (identical results)."""
    if kind == "flatten":
        done = flatten_plan(layout, block_kv, params, host_buffer, reuse)
        if done is not None:
            return done
        plan, refined = _flatten_cut(layout, block_kv, params)
        plan = refine(plan, params) if refined is None else refined
    else:
        plan = make_plan(layout, kind, block_kv)
        if kind == "per_query":
            plan = refine(plan, params)
    return plan, pack(plan, params.g, params.block_m, host_buffer, reuse)
