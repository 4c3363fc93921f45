"""Planning: from a :class:`~deft.layout.TreeLayout` to a step's schedule, once per step.

* :mod:`.tree_plan` — the plan kinds and :class:`TreePlan` (tiles, KV-guided query groups,
  compact visibility mask, reduction map), the Python specification;
* :mod:`.visibility` — the visibility predicate every backend evaluates;
* :mod:`.coarsen` — merging same-group tiles: the coarsening rule and its launch model;
* :mod:`.packing` — the kernels' int32 buffer layout (work items, tile flags, segments);
* :mod:`.compiled` — the C extension that computes exactly the above for ``flatten``;
* :mod:`.step` — all of it in one call for a kernel backend.

Nothing here runs attention or calls CUDA.
"""

from .coarsen import Coarsening, coarsen_plan, group_runs
from .step import plan_step
from .tree_plan import PLAN_KINDS, PlanKind, TreePlan, dfs_preorder, make_plan
from .visibility import visible

__all__ = ["PLAN_KINDS", "PlanKind", "TreePlan", "make_plan", "dfs_preorder", "Coarsening",
           "coarsen_plan", "group_runs", "plan_step", "visible"]
