"""Eager launches of compiled Triton kernels straight through the CUDA driver.

A Triton launch costs much host time: binding and specialising every argument,
looking the compiled kernel up under that specialisation, then a native launcher that parses
the arguments again and asks the driver about every pointer. A step's plan fixes all but a
few arguments of a layer's launches, so a :class:`NativeLaunch` keeps, for one compiled kernel
and one argument list, the driver's launch configuration and parameter array packed once
(the layout of Triton's launcher: the arguments Triton did not specialise away, in order,
then its global and profile scratch pointers), some of them stored in a shared ``inputs``
array that the caller rewrites before each launch; a launch is one ``cuLaunchKernelEx`` call
through ctypes.

What keeps it exact is the caller's part: the kernel was launched by Triton with these very
arguments first (which compiled and loaded it and chose its specialisation), and a record is
only reused for calls that Triton would specialise alike (same dtypes, strides, scalars,
16-byte alignment of the rewritten pointers, same device). :func:`native_launch` returns
``None`` for anything Triton's launcher would do beyond this (tensor descriptors, scratch
memory, clusters, cooperative grids, launch hooks as the profiler sets them), and without
the driver library. Pointers are passed as their addresses (Triton's launcher maps them
through ``cuPointerGetAttribute``, the identity for device memory).

A layer's launches run in one call of the compiled helper ``_driver_launch`` (built with the
package, like the planner; :func:`batched`), which writes the rebound addresses and the
stream and calls the driver for each; without it, one ctypes call per launch.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import sys
from typing import Any, Callable, Mapping, Sequence

__all__ = ["LaunchAttribute", "LaunchConfig", "NativeLaunch", "batched", "driver_launch",
           "native_launch"]

_PDL = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_INT_BITS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64,
             "u1": 8, "u8": 8, "u16": 16, "u32": 32, "u64": 64}


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def driver_launch() -> Callable[..., int] | None:
    """``cuLaunchKernelEx(config, function, params, extra)`` of the CUDA driver, called with
    the GIL held (a launch is short; releasing the GIL could wait on another thread for
    much longer); ``None`` without ``libcuda.so.1`` or on a big-endian host."""
    if sys.byteorder != "little":  # integer arguments are stored in the low bytes of a slot
        return None
    try:
        fn = ctypes.PyDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


class _Entry(ctypes.Structure):
    """One launch as ``driver_launch.c`` reads it."""

    _fields_ = [("config", ctypes.c_void_p), ("function", ctypes.c_void_p),
                ("params", ctypes.c_void_p)]


@functools.cache
def _helper() -> Callable[..., int] | None:
    try:
        from ._driver_launch import launch_all
    except ImportError:
        return None
    return launch_all


class NativeLaunch:
    """One compiled kernel's launch with its parameters packed: ``launch(stream)`` enqueues
    it on ``stream`` (a raw ``CUstream``) and says whether the driver accepted it.

    ``values`` holds the packed arguments (8 bytes each), ``params`` the address of each
    kernel parameter's value, in ``values`` or in the caller's ``inputs``; the objects keep
    that memory alive."""

    __slots__ = ("kernel", "function", "config", "attrs", "values", "params", "inputs",
                 "_launch", "_config", "_params")

    def __init__(self, kernel: Any, function: int, grid: Sequence[int], block: int, shared: int, pdl: bool,
                 values: ctypes.Array, params: ctypes.Array, inputs: ctypes.Array | None,
                 launch: Callable[..., int]) -> None:
        self.kernel, self.function = kernel, function  # the kernel keeps its module loaded
        self.attrs = (LaunchAttribute * 1)()
        self.attrs[0].id = _PDL
        self.attrs[0].value[0] = 1
        self.config = LaunchConfig((ctypes.c_uint * 3)(*grid, *(1,) * (3 - len(grid))),
                                   (ctypes.c_uint * 3)(block, 1, 1), shared, None,
                                   self.attrs, 1 if pdl else 0)
        self.values, self.params, self.inputs = values, params, inputs
        self._launch = launch
        self._config = ctypes.addressof(self.config)
        self._params = ctypes.addressof(params)

    def __call__(self, stream: int) -> bool:
        self.config.stream = stream
        return self._launch(self._config, self.function, self._params, None) == 0


def _pack(ty: str, value: Any) -> int | None:
    """``value`` of Triton type ``ty`` as the 8-byte little-endian slot its parameter reads
    (``None``: a type this module does not pack)."""
    if ty.startswith("*"):
        if value is None or isinstance(value, int):
            return value or 0
        return value.data_ptr()
    bits = _INT_BITS.get(ty)
    if bits is not None:
        return int(value) & ((1 << bits) - 1)
    if ty in ("fp32", "f32"):  # Triton packs a Python float as float32, rounded to nearest
        try:
            return struct.unpack("<I", struct.pack("<f", value))[0]
        except OverflowError:
            return None
    return None


def native_launch(kernel: Any, grid: Sequence[int], args: Sequence[Any],
                  inputs: ctypes.Array | None = None, bound: Mapping[int, int] | None = None,
                  launch: Callable[..., int] | None = None) -> NativeLaunch | None:
    """The launch of ``kernel`` (a ``CompiledKernel`` that Triton just launched with ``args``
    on ``grid``, every other parameter a constexpr keyword) packed for the driver, or
    ``None`` where it cannot be exact (see the module docstring) or the driver is missing.

    ``bound`` maps the positions of pointer arguments to indices of ``inputs`` (a
    ``ctypes.c_uint64`` array): those parameters read their address there at each launch.
    ``launch`` stands in for :func:`driver_launch` (tests)."""
    launch = driver_launch() if launch is None else launch
    bound = bound or {}
    if launch is None or len(grid) > 3 or min(grid, default=0) <= 0:
        return None
    try:
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
        meta, function = kernel.metadata, kernel.function
        names, signature = list(kernel.src.fn.arg_names), dict(kernel.src.signature)
        backend, num_warps, shared = meta.target.backend, int(meta.num_warps), int(meta.shared)
    except (AttributeError, ImportError, TypeError, ValueError):
        return None
    if (any(getattr(h, "calls", h) for h in hooks) or not isinstance(function, int)
            or backend != "cuda" or getattr(meta, "num_ctas", 1) != 1
            or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "tensordesc_meta", None)
            or getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)
            or len(args) > len(names) or list(signature) != names
            or any(signature[n] != "constexpr" for n in names[len(args):])):
        return None
    slots: list[int] = []  # the packed values
    where: list[tuple[bool, int]] = []  # each parameter's value: (in inputs, index there)
    for i, (name, value) in enumerate(zip(names, args)):
        ty = signature[name]
        if ty == "constexpr":  # constexpr or specialised (None, the integer 1): no parameter
            continue
        if not isinstance(ty, str):
            return None
        if i in bound:
            if not ty.startswith("*") or inputs is None or not 0 <= bound[i] < len(inputs):
                return None
            where.append((True, bound[i]))
            continue
        packed = _pack(ty, value)
        if packed is None:
            return None
        where.append((False, len(slots)))
        slots.append(packed)
    where += [(False, len(slots)), (False, len(slots) + 1)]  # global, profile scratch: none
    values = (ctypes.c_uint64 * (len(slots) + 2))(*slots, 0, 0)
    base, in_base = ctypes.addressof(values), inputs is not None and ctypes.addressof(inputs)
    params = (ctypes.c_void_p * len(where))(
        *((in_base if in_inputs else base) + 8 * j for in_inputs, j in where))
    return NativeLaunch(kernel, function, tuple(grid), 32 * num_warps, shared,
                        bool(getattr(meta, "launch_pdl", False)), values, params, inputs, launch)


def batched(launches: Sequence[NativeLaunch], inputs: ctypes.Array
            ) -> Callable[..., int] | None:
    """``call(stream, *addresses)``: write ``addresses`` into ``inputs`` and run
    ``launches`` in order on ``stream`` in one call of the compiled helper, returning how
    many the driver took; ``None`` without the helper, or when the launches do not go
    through one C function (a stand-in driver written in Python)."""
    helper = _helper()
    fn = launches[0]._launch if launches else None
    if (helper is None or not isinstance(fn, ctypes._CFuncPtr)
            or any(x._launch is not fn for x in launches)):
        return None
    entries = (_Entry * len(launches))(*((x._config, x.function, x._params) for x in launches))
    call = functools.partial(helper, ctypes.cast(fn, ctypes.c_void_p).value,
                             ctypes.addressof(entries), len(launches), ctypes.addressof(inputs))
    call.keep = (entries, launches, inputs)  # the memory the helper reads
    return call
