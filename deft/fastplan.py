"""Compiled fast path of DeFT-Flatten planning for the triton backend.

``csrc/flatten_plan.c`` computes in a few linear passes exactly what :func:`deft.plan.make_plan`
(kind ``"flatten"``), the triton backend's coarsening and its host-side ``prepare`` compute
with numpy (about 150 small numpy calls, 0.5–1 ms per step). It is a CPython extension
module, so that a step's planning is one call taking the layout's arrays as they are (a
planning step is tens of microseconds, and per-argument overheads of a foreign-function
call were a third of it). It is compiled with the system C compiler (``$CC``, else ``cc``)
and this Python's headers on first use into a cache directory (``$DEFT_CACHE_DIR``, else
``~/.cache/deft``, else a private temporary directory) under a name keyed by a hash of the
source, compiler, flags, Python ABI and machine. Without a working compiler or the Python
headers (a warning, once), or with ``DEFT_FASTPLAN=0``, :func:`flatten_plan` returns
``None`` and callers use the numpy planner.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple

import numpy as np

from .layout import TreeLayout
from .plan import TreePlan

__all__ = ["FlattenPlan", "PlanParams", "flatten_plan", "load_library"]

_SOURCE = Path(__file__).with_name("csrc") / "flatten_plan.c"
_CFLAGS = ["-O3", "-std=c11", "-shared", "-fPIC"]
_MODULE = "_deft_flatten_plan"  # its PyInit__deft_flatten_plan
_LOCK = threading.Lock()

# The TreePlan arrays in the order flatten_plan.c writes them (then the reduction map).
_PLAN_FIELDS = ("token_slots", "token_lo", "token_hi", "token_off", "tile_indptr",
                "tile_q_start", "tile_q_end", "partial_indptr", "query_order", "query_pre",
                "query_len")
_LOCAL = threading.local()  # per thread: the workspace kept between calls


def _cache_dir() -> Path:
    """A writable directory for the compiled library."""
    env = os.environ.get("DEFT_CACHE_DIR")
    for cand in ([Path(env)] if env else []) + [Path.home() / ".cache" / "deft"]:
        try:
            cand.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(cand, os.W_OK):
            return cand
    return _private_temp_dir()


def _private_temp_dir() -> Path:
    """``$TMPDIR/deft-<uid>``, made private; a fresh private directory instead when that path
    is not a directory of ours closed to others (a library planted there would be loaded)."""
    if not hasattr(os, "getuid"):
        return Path(tempfile.mkdtemp(prefix="deft-"))
    path = Path(tempfile.gettempdir()) / f"deft-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="deft-"))


def _flags() -> list[str]:
    """Compiler flags: optimised shared object, with this Python's headers."""
    flags = [*_CFLAGS, "-I" + sysconfig.get_paths()["include"]]
    if sys.platform == "darwin":  # the interpreter provides the Python symbols at load time
        flags += ["-undefined", "dynamic_lookup"]
    return flags


def _compile(cc: list[str]) -> Path:
    """Build the extension with the command ``cc`` (compiler, then its own flags), or
    reuse a cached build of the same source, command, flags, Python ABI and machine."""
    source = _SOURCE.read_bytes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    config = " ".join([*cc, *_flags(), suffix, platform.machine()])
    key = hashlib.sha256(source + config.encode()).hexdigest()[:16]
    target = _cache_dir() / f"flatten_plan-{key}{suffix}"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*cc, *_flags(), "-o", tmp, "-x", "c", "-", "-lm"], input=source,
                       check=True, capture_output=True)
        os.replace(tmp, target)  # atomic: a concurrent build of the same key is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load_library() -> ModuleType | None:
    """The compiled planner module, built on first use; ``None`` (with a warning) if that
    fails."""
    with _LOCK:
        try:
            cc = shlex.split(os.environ.get("CC") or "cc")  # e.g. CC="ccache gcc"
            compiler = shutil.which(cc[0]) if cc else None
            if compiler is None:
                raise OSError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not found)")
            spec = importlib.util.spec_from_file_location(_MODULE, _compile([compiler, *cc[1:]]))
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load the compiled planner as {_MODULE}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (OSError, ValueError, ImportError, subprocess.CalledProcessError) as exc:
            stderr = getattr(exc, "stderr", None)
            detail = stderr.decode(errors="replace").strip() if stderr else exc
            warnings.warn(f"deft: the compiled planner is unavailable, planning with numpy "
                          f"(slower): {detail}", RuntimeWarning, stacklevel=2)
            return None
    return module


class FlattenPlan(NamedTuple):
    """What :func:`flatten_plan` returns: the plan and the triton backend's host data."""

    plan: TreePlan  # equal to refine_plan(make_plan(layout, "flatten", block_kv))
    packed: Any  # the filled int32 host buffer: ``reuse``, or what ``host_buffer`` returned
    starts: list[int]  # offsets of its 10 segments, then its length
    num_work: int  # work items (rows of 8 in the ``work`` segment)
    all_contiguous: bool  # every tile's slots are consecutive
    any_contiguous: bool  # some tile's slots are
    sorted_queries: bool  # query_order is the identity
    every_query_merged: bool  # every query owns at least one partial state


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
            d.update(vars(flat.plan))
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


class PlanParams(NamedTuple):
    """The triton backend's parameters of a step's planning (see
    ``TritonBackend.refine_plan``)."""

    g: int  # query heads per KV head
    block_m: int  # query rows per program (the kernel config's)
    num_kv_heads: int
    sms: int
    waves: float  # programs per SM the coarsening aims for (the kernel config's)
    min_tile_tokens: int  # the coarsened-tile floor, 0 when interpreting
    max_factor: int  # the largest coarsening factor
    slots: int  # the launch model's program slots
    program_cost: int  # the launch model's fixed cost of a program, in tokens


def flatten_plan(layout: TreeLayout, block_kv: int, params: PlanParams,
                 host_buffer: Callable[[int], Any], reuse: Any = None) -> FlattenPlan | None:
    """Plan, coarsen and pack a DeFT-Flatten step in compiled code; ``None`` if unavailable.

    The int32 segments token slots, lo, hi, off, work items, query order, pre, len, merge
    indptr and merge partials are packed into ``reuse`` (an int32 buffer with ``data_ptr()``
    and ``numel()``) when it is large enough, else into ``host_buffer(n)``, a new buffer of
    ``n`` elements. The returned plan computes its arrays on first access (see
    ``_CompiledPlan``).
    """
    if os.environ.get("DEFT_FASTPLAN") == "0":
        return None
    return _plan(layout, block_kv, params, host_buffer, reuse)


def _plan(layout: TreeLayout, block_kv: int, params: PlanParams,
          host_buffer: Callable[[int], Any] | None, reuse: Any) -> FlattenPlan | None:
    """Run the compiled planner. With ``host_buffer``, the plan is a ``_CompiledPlan``
    (no arrays yet); without, a TreePlan with its arrays, packed into a numpy buffer."""
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
    return FlattenPlan(plan, packed, starts, nwork, bool(flags & 1), bool(flags & 2),
                       bool(sorted_queries), bool(all_merged))
