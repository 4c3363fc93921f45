"""Compiled fast path of DeFT-Flatten planning for the triton backend.

``csrc/flatten_plan.c`` computes in a few linear passes exactly what :func:`deft.plan.make_plan`
(kind ``"flatten"``), the triton backend's coarsening and its host-side ``prepare`` compute
with numpy (about 150 small numpy calls, 0.5–1 ms per step). It is compiled with the system C
compiler (``$CC``, else ``cc``) on first use into a cache directory (``$DEFT_CACHE_DIR``, else
``~/.cache/deft``, else a private temporary directory) under a name keyed by a hash of the
source, compiler, flags and machine, and loaded with ctypes. Without a working compiler (a
warning, once), or with ``DEFT_FASTPLAN=0``, :func:`flatten_plan` returns ``None`` and callers
use the numpy planner.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from .layout import TreeLayout
from .plan import TreePlan

__all__ = ["FlattenPlan", "flatten_plan", "load_library"]

_SOURCE = Path(__file__).with_name("csrc") / "flatten_plan.c"
_CFLAGS = ["-O3", "-std=c99", "-shared", "-fPIC"]
_LOCK = threading.Lock()

# Header slots of the workspace (the enum at the top of flatten_plan.c).
_H_N, _H_T, _H_P, _H_W, _H_Q, _H_SORTED, _H_ALL_MERGED, _H_OUT_SIZE, _H_SEG = range(9)
_H_END = _H_SEG + 11
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


def _compile(cc: list[str]) -> Path:
    """Build the shared library with the command ``cc`` (compiler, then its own flags), or
    reuse a cached build of the same source, command, flags and machine."""
    source = _SOURCE.read_bytes()
    config = " ".join([*cc, *_CFLAGS, platform.machine()])
    key = hashlib.sha256(source + config.encode()).hexdigest()[:16]
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    target = _cache_dir() / f"flatten_plan-{key}{suffix}"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*cc, *_CFLAGS, "-o", tmp, "-x", "c", "-", "-lm"], input=source,
                       check=True, capture_output=True)
        os.replace(tmp, target)  # atomic: a concurrent build of the same key is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled planner, built on first use; ``None`` (with a warning) if that fails."""
    with _LOCK:
        try:
            cc = shlex.split(os.environ.get("CC") or "cc")  # e.g. CC="ccache gcc"
            compiler = shutil.which(cc[0]) if cc else None
            if compiler is None:
                raise OSError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not found)")
            lib = ctypes.CDLL(str(_compile([compiler, *cc[1:]])))
        except (OSError, ValueError, subprocess.CalledProcessError) as exc:
            stderr = getattr(exc, "stderr", None)
            detail = stderr.decode(errors="replace").strip() if stderr else exc
            warnings.warn(f"deft: the compiled planner is unavailable, planning with numpy "
                          f"(slower): {detail}", RuntimeWarning, stacklevel=2)
            return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.deft_flatten_plan.argtypes = ([ptr] * 4 + [i64] * 5 + [ctypes.c_double] + [i64] * 4
                                      + [ptr, i64])
    lib.deft_flatten_plan.restype = i64
    lib.deft_flatten_fill.argtypes = [ptr] * 5
    lib.deft_flatten_fill.restype = i64
    return lib


# numpy's __array_struct__ capsule holds a PyArrayInterface; C reads the data address from
# it, which is cheaper from Python than ``ndarray.ctypes.data`` (about 1.3 us per array).
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


class FlattenPlan(NamedTuple):
    """What :func:`flatten_plan` returns: the plan and the triton backend's host data."""

    plan: TreePlan  # equal to refine_plan(make_plan(layout, "flatten", block_kv))
    packed: Any  # the int32 host buffer ``host_buffer`` returned, filled
    starts: list[int]  # offsets of its 10 segments, then its length
    num_work: int  # work items (rows of 8 in the ``work`` segment)
    all_contiguous: bool  # every tile's slots are consecutive
    any_contiguous: bool  # some tile's slots are
    sorted_queries: bool  # query_order is the identity
    every_query_merged: bool  # every query owns at least one partial state


def _workspace(size: int) -> tuple[np.ndarray, int]:
    """This thread's workspace of at least ``size`` int64 and its address."""
    ws = getattr(_LOCAL, "ws", None)
    if ws is None or ws[0].shape[0] < size:
        arr = np.empty(max(size, 2 * (ws[0].shape[0] if ws else 0)), np.int64)
        ws = _LOCAL.ws = (arr, arr.ctypes.data)
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
            flat = _plan(layout, block_kv, params, None)
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


def flatten_plan(
    layout: TreeLayout,
    block_kv: int,
    *,
    g: int,
    block_m: int,
    num_kv_heads: int,
    sms: int,
    waves: float,
    min_tile_tokens: int,
    max_factor: int,
    slots: int,
    program_cost: int,
    host_buffer: Callable[[int], Any],
) -> FlattenPlan | None:
    """Plan, coarsen and pack a DeFT-Flatten step in compiled code; ``None`` if unavailable.

    The parameters are the triton backend's (``g = H_q / H_kv``, its kernel config's
    ``block_m`` and ``waves``, the SM count, the coarsened-tile floor, 0 when interpreting,
    the largest coarsening factor, and the launch model's slots and per-program cost; see
    ``TritonBackend.refine_plan``). ``host_buffer(n)`` allocates the int32 buffer of
    ``n`` elements (anything with ``data_ptr()``) for the segments token slots, lo, hi, off,
    work items, query order, pre, len, merge indptr and merge partials. The returned plan
    computes its arrays on first access (see ``_CompiledPlan``).
    """
    if os.environ.get("DEFT_FASTPLAN") == "0":
        return None
    params = (g, block_m, num_kv_heads, sms, waves, min_tile_tokens, max_factor, slots,
              program_cost)
    return _plan(layout, block_kv, params, host_buffer)


def _plan(layout: TreeLayout, block_kv: int, params: tuple,
          host_buffer: Callable[[int], Any] | None) -> FlattenPlan | None:
    """Run the compiled planner. With ``host_buffer``, the plan is a ``_CompiledPlan``
    (no arrays yet); without, a TreePlan with its arrays, packed into a numpy buffer."""
    lib = load_library()
    if lib is None:
        return None
    # Views (e.g. reversed query_nodes) are copied; the capsules keep the arrays alive.
    caps = [np.ascontiguousarray(a).__array_struct__ for a in (
        layout.parents, layout.node_kv_indptr, layout.query_nodes, layout.query_kv_lens,
        layout.kv_indices)]
    parents_p, indptr_p, nodes_p, qlens_p, kv_p = [_capsule_pointer(c, None) for c in caps]
    ws, ws_p = _workspace(0)
    args = (parents_p, indptr_p, nodes_p, qlens_p, block_kv, *params)
    rc = lib.deft_flatten_plan(*args, ws_p, ws.shape[0])
    if rc > 0:
        ws, ws_p = _workspace(rc)
        rc = lib.deft_flatten_plan(*args, ws_p, ws.shape[0])
    if rc != 0:  # a malformed forest or array (TreeLayout rules both out)
        return None
    head = ws[:_H_END].tolist()
    ntok, ntiles, npart, nwork, nq = head[:5]
    starts = head[_H_SEG:_H_END]
    if host_buffer is not None:
        packed = host_buffer(starts[-1])
        flags = lib.deft_flatten_fill(indptr_p, kv_p, ws_p, None, packed.data_ptr())
        plan = object.__new__(_CompiledPlan)
        plan.__dict__.update(kind="flatten", block_kv=block_kv,
                             num_layout_tokens=layout.num_tokens, needs_mask=True,
                             _counts=(ntiles, nq, npart, ntok), _source=(layout, block_kv, params))
    else:
        packed = np.empty(starts[-1], np.int32)
        out = np.empty(head[_H_OUT_SIZE], np.int64)
        out_cap = out.__array_struct__
        flags = lib.deft_flatten_fill(indptr_p, kv_p, ws_p, _capsule_pointer(out_cap, None),
                                       packed.ctypes.data)
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
    return FlattenPlan(plan, packed, starts, nwork, bool(flags & 1),
                       bool(flags & 2), bool(head[_H_SORTED]), bool(head[_H_ALL_MERGED]))
