"""The compiled DeFT-Flatten planner: ``flatten_plan.c``, built when the package is installed.

The C code computes in a few linear passes exactly what
:func:`~deft.plan.step.flatten_cut`, :func:`~deft.plan.coarsen.refine` and
:func:`~deft.plan.packing.pack` compute with numpy (about 150 small numpy calls per step), in one call that takes
the layout's arrays as they are. It is the extension module ``deft.plan._flatten_plan``,
compiled by ``pip install`` (``setup.py``). When the build failed (no compiler or Python
headers), or with ``DEFT_FASTPLAN=0``, :func:`flatten_plan` returns ``None`` (with one
warning for the former) and callers plan with numpy. For the torch backend the same module
gives the uncoarsened plan with each tile's ``mask_from`` (:func:`flatten_tiles`) and
dense visibility masks of any plan's tiles (:func:`tile_masks`); likewise ``None`` without it.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
import warnings
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..layout import TreeLayout
from .coarsen import Coarsening
from .packing import WORK_FIELDS, HostBuffer, PackedPlan
from .tree_plan import TreePlan

__all__ = ["flatten_plan", "flatten_tiles", "tile_masks", "load_library"]

# The TreePlan arrays in the order flatten_plan.c writes them (then the reduction map).
_PLAN_FIELDS = ("token_slots", "token_lo", "token_hi", "token_off", "tile_indptr",
                "tile_q_start", "tile_q_end", "partial_indptr", "query_order", "query_pre",
                "query_len")
_LOCAL = threading.local()  # per thread: the workspace kept between calls


@functools.cache
def load_library() -> ModuleType | None:
    """The compiled planner module; ``None`` (with a warning) if it was not built."""
    try:
        return importlib.import_module("deft.plan._flatten_plan")
    except ImportError as exc:
        warnings.warn(f"deft: the compiled planner was not built at install ({exc}); planning "
                      f"with numpy (slower). Reinstall with a C compiler and the Python "
                      f"headers to build it.", RuntimeWarning, stacklevel=2)
        return None


def _workspace(size: int) -> np.ndarray:
    """This thread's workspace of at least ``size`` int64."""
    ws = getattr(_LOCAL, "ws", None)
    if ws is None or ws.shape[0] < size:
        ws = _LOCAL.ws = np.empty(max(size, 2 * (ws.shape[0] if ws is not None else 0)), np.int64)
    return ws


def _count(i: int) -> Any:
    """A property reading entry ``i`` of a ``_CompiledPlan``'s sizes, in place of TreePlan's,
    which read the arrays."""
    return property(lambda self: self.__dict__["_counts"][i])


class _CompiledPlan(TreePlan):
    """A ``flatten`` plan from the compiled planner: sizes at once, arrays on first access.

    Running a plan needs only the packed device buffer, so ``plan()`` skips the int64 plan
    arrays (for a 20,000-token prompt, about a third of the planner's time). The first
    access to any of them plans the same layout again, with the same parameters, and keeps
    the result. TreePlan has no ``__post_init__``: instances are built without ``__init__``.
    """

    def _arrays(self) -> dict[str, Any]:
        d = self.__dict__
        if "token_slots" not in d:
            layout, block_kv, params = d["_source"]
            flat = _plan(layout, block_kv, params, None, None)
            if flat is None:  # only if the compiler's library vanished since the plan
                raise RuntimeError("deft: the compiled planner is no longer available")
            d.update(vars(flat[0]))
        return d

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes missing from the instance: the arrays before first use.
        if name in _PLAN_FIELDS:
            return self._arrays()[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def _reduction_map(self) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        return self._arrays()["_reduction_map"]

    num_tiles = _count(0)
    num_queries = _count(1)
    num_partials = _count(2)
    num_plan_tokens = _count(3)


def flatten_plan(layout: TreeLayout, block_kv: int, params: Coarsening,
                 host_buffer: Callable[[int], HostBuffer],
                 reuse: HostBuffer | None = None) -> tuple[TreePlan, PackedPlan] | None:
    """``refine(flatten_cut(layout, block_kv, params), params)`` and its packing for
    programs of ``params.block_m`` rows, in compiled code; ``None`` if unavailable.

    The segments are packed into ``reuse`` when it is large enough, else into
    ``host_buffer(n)``, a new buffer of ``n`` elements. The returned plan computes its
    arrays on first access (see ``_CompiledPlan``).
    """
    if os.environ.get("DEFT_FASTPLAN") == "0":
        return None
    return _plan(layout, block_kv, params, host_buffer, reuse)


def flatten_tiles(layout: TreeLayout, block_kv: int) -> tuple[TreePlan, np.ndarray] | None:
    """``make_plan(layout, "flatten", block_kv)`` with its arrays, and ``[T]``
    :func:`~deft.plan.packing.mask_from` of it, in compiled code; ``None`` if unavailable."""
    if os.environ.get("DEFT_FASTPLAN") == "0":
        return None
    # No coarsening, and programs as wide as the step: one work item per tile.
    params = Coarsening(g=1, block_m=max(layout.num_queries, 1), num_kv_heads=1, sms=1,
                        waves=1.0, min_tile_tokens=0, max_factor=1, slots=0, program_cost=0)
    done = _plan(layout, block_kv, params, None, None)
    if done is None:
        return None
    plan, packed = done
    start = packed.starts[4]
    work = packed.buffer[start:start + WORK_FIELDS * packed.num_work].reshape(-1, WORK_FIELDS)
    first = np.empty(plan.num_tiles, np.int64)
    first[np.searchsorted(plan.tile_indptr, work[:, 0])] = work[:, 5]
    return plan, first


def tile_masks(plan: TreePlan, tok0: np.ndarray, tok_len: np.ndarray, q0: np.ndarray,
               group: np.ndarray, rows: int, cols: int) -> np.ndarray | None:
    """``[nt, rows, cols]`` bool: the sorted query ``q0[t] + i`` sees the plan token
    ``tok0[t] + j`` (:func:`~deft.plan.visible`), for ``i < group[t]`` and ``j <
    tok_len[t]``; False elsewhere (all ``[nt]`` int64). ``None`` if unavailable."""
    lib = load_library() if os.environ.get("DEFT_FASTPLAN") != "0" else None
    if lib is None:
        return None
    out = np.empty((tok0.shape[0], rows, cols), bool)
    arrays = (plan.query_pre, plan.query_len, plan.token_lo, plan.token_hi, plan.token_off,
              tok0, tok_len, q0, group)
    rc = lib.mask(*(np.ascontiguousarray(a, np.int64) for a in arrays), rows, cols, out)
    return out if rc == 0 else None


def _plan(layout: TreeLayout, block_kv: int, params: Coarsening,
          host_buffer: Callable[[int], HostBuffer] | None,
          reuse: HostBuffer | None) -> tuple[TreePlan, PackedPlan] | None:
    """Run the compiled planner. With ``host_buffer``, the plan is a ``_CompiledPlan``
    (no arrays yet); without, a TreePlan with its arrays, packed into a new buffer."""
    lib = load_library()
    if lib is None:
        return None
    arrays = (layout.parents, layout.node_kv_indptr, layout.query_nodes, layout.query_kv_lens,
              layout.kv_indices)
    ws = _workspace(0)
    target = (reuse.data_ptr(), reuse.numel()) if reuse is not None and host_buffer else (0, 0)
    res = lib.plan(*arrays, block_kv, *params, ws, *target)
    if res == -2:  # views (e.g. a reversed query_nodes): contiguous copies
        arrays = tuple(np.ascontiguousarray(a) for a in arrays)
        res = lib.plan(*arrays, block_kv, *params, ws, *target)
    if isinstance(res, int) and res > 0:  # the workspace was too small
        ws = _workspace(res)
        res = lib.plan(*arrays, block_kv, *params, ws, *target)
    if isinstance(res, int):  # a malformed forest or array (TreeLayout rules both out)
        return None
    flags, ntok, ntiles, npart, nwork, nq, sorted_queries, all_merged, out_size, *starts = res
    if host_buffer is not None:
        packed = reuse
        if flags == -3:  # not filled: no buffer to reuse, or too small
            packed = host_buffer(starts[-1])
            flags = lib.fill(arrays[1], arrays[4], ws, None, packed.data_ptr())
        plan = object.__new__(_CompiledPlan)
        plan.__dict__.update(kind="flatten", block_kv=block_kv,
                             num_layout_tokens=layout.num_tokens, needs_mask=True,
                             _counts=(ntiles, nq, npart, ntok), _source=(layout, block_kv, params))
    else:
        packed = np.empty(starts[-1], np.int32)
        out = np.empty(out_size, np.int64)
        flags = lib.fill(arrays[1], arrays[4], ws, out, packed.ctypes.data)
        out.setflags(write=False)  # so every view below is read-only
        lengths = (ntok, ntok, ntok, ntok, ntiles + 1, ntiles, ntiles, ntiles + 1, nq, nq, nq,
                   nq + 1, npart)
        views, o = [], 0
        for m in lengths:
            views.append(out[o:o + m])
            o += m
        plan = object.__new__(TreePlan)
        plan.__dict__.update(zip(_PLAN_FIELDS, views), kind="flatten", block_kv=block_kv,
                             num_layout_tokens=layout.num_tokens, needs_mask=True,
                             _reduction_map=(views[11], views[12]))
    if flags < 0:
        return None
    return plan, PackedPlan(packed, starts, nwork, bool(flags & 1), bool(flags & 2),
                            bool(sorted_queries), bool(all_merged))
