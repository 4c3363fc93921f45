"""The backend contract: what :class:`~deft.attention.TreeAttention` calls, once.

A backend plans a step (``plan``, once per step, outside any CUDA graph) into a *prepared*
value that holds the step's :class:`~deft.plan.TreePlan` as ``.plan`` and whatever device
data its kernels read, then runs it per layer (``run``). Capabilities are class attributes:

* ``writes_out``: ``run`` writes into caller-given ``out``/``lse_out`` (and allocates
  nothing then); otherwise ``TreeAttention`` copies the result in;
* ``graph_safe``: ``run`` makes no host synchronisation or allocation with ``out`` given,
  so the layers of a step can be captured in a CUDA graph, and ``reserve(capacity, block_kv,
  heads, device)`` returns fixed buffers that, passed as ``previous``, make every later plan
  write into them with launches whose arguments never change: a graph captured once then
  replays every later plan that fits (a plan that does not fit raises
  :class:`CapacityError`, a ``ValueError``);
* ``max_slot``: the largest cache slot its plan arrays can address (``None``: any);
* ``default_block_kv``: the tile size used when the caller gives none;
* ``kv_dtypes``: the K/V dtypes ``run`` reads besides ``q``'s own (``None``: only
  ``q``'s); ``plan`` is told the step's K/V dtype (``kv_dtype``), as kernels are
  specialised on it;
* ``builds``: its kernel builds, ``"default"`` first; a plan picks the one its tree asks
  for, a :class:`Capacity` reserves one;
* ``kv_scales``: ``run`` applies dequantisation scales (one per layer, or per layer and
  KV head): the K/V it reads are ``k_cache * k_scale`` and ``v_cache * v_scale``
  (otherwise both are ``None``). FP8 (``float8_e4m3fn``) K/V always come with scales.

Planning may be split from upload (``plan_host`` once, ``upload`` to one or several
devices); by default ``plan_host`` defers everything to ``upload``, which calls ``plan``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Protocol

import torch

from ..layout import TreeLayout
from ..plan import TreePlan

__all__ = ["Backend", "Capacity", "CapacityError", "Deferred", "Heads", "Prepared",
           "check_backend"]


class Heads(NamedTuple):
    """The attention shape a plan is made for."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int


class Capacity(NamedTuple):
    """What a graph-safe backend's fixed buffers hold: every plan of this many queries, at
    most ``tokens`` plan tokens (KV tokens loaded per KV head; a ``flatten`` plan loads each
    visible token once) and at most ``partials`` partial states (``None``: enough for any
    ``flatten`` plan of ``tokens`` tokens, ``queries`` times the number of tiles).
    ``build``: the kernels every plan launches, ``"default"`` or another of the backend's
    ``builds`` that some trees run faster on; an unreserved attention picks per plan the
    build its tree asks for (``TreeAttention.build``)."""

    queries: int
    tokens: int
    partials: int | None = None
    build: str = "default"


class CapacityError(ValueError):
    """A step that does not fit a reserved :class:`Capacity`: ``what`` (the triton backend's
    ``"plan tokens"``, ``"partial states"``, or the ``"work items"`` and ``"plan ints"``
    derived from both) needs ``needed``, beyond ``room``."""

    def __init__(self, what: str, needed: int, room: int) -> None:
        super().__init__(f"layout: this step needs {needed} {what}, beyond the reserved "
                         f"capacity of {room}; reserve a larger Capacity")
        self.what, self.needed, self.room = what, needed, room


class Prepared(Protocol):
    """What ``Backend.plan`` returns: at least the step's plan."""

    plan: TreePlan


class Deferred(NamedTuple):
    """A host plan of a backend that plans and uploads in one go: what ``plan`` needs."""

    layout: TreeLayout
    plan_kind: str
    block_kv: int
    heads: Heads
    kv_dtype: torch.dtype | None


class Backend(ABC):
    """An executor of plans. Subclass it and register a factory with
    :func:`deft.register_backend`."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    writes_out: bool = False
    graph_safe: bool = False
    max_slot: int | None = None
    default_block_kv: int = 64
    kv_dtypes: tuple[torch.dtype, ...] | None = None
    kv_scales: bool = False
    builds: tuple[str, ...] = ("default",)

    @abstractmethod
    def plan(self, layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
             device: torch.device, previous: Any = None,
             kv_dtype: torch.dtype | None = None) -> Prepared:
        """Plan one step of ``layout`` over K/V of ``kv_dtype`` (``None``: ``q``'s).
        ``previous`` is the same caller's last prepared value (or ``None``), whose device
        buffers may be reused: ``plan`` and ``run`` share one stream, which orders the
        reuse after the last plan's launches."""

    @abstractmethod
    def run(self, prepared: Any, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, sm_scale: float, *, out: torch.Tensor | None = None,
            lse_out: torch.Tensor | None = None, want_lse: bool = True,
            k_scale: Any = None, v_scale: Any = None,
            captured: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o [Q, H_q, D] in q.dtype, lse [Q, H_q] float32)`` of the planned step over
        ``k_cache, v_cache [num_slots, H_kv, D]``; ``lse`` may be ``None`` without
        ``want_lse``. ``out``/``lse_out`` are given only to backends with ``writes_out``;
        ``k_scale``/``v_scale`` (a float, or a float32 tensor ``[1]`` or ``[H_kv]``, one
        per KV head) only to backends with ``kv_scales``. ``captured``: the launches go
        into a CUDA graph, or are its warm-up (a backend may launch differently there)."""

    def plan_host(self, layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
                  device: torch.device, kv_dtype: torch.dtype | None = None,
                  previous: Any = None) -> Any:
        """The host part of :meth:`plan`, to :meth:`upload` to one or more devices of
        ``device``'s kind whose ``previous`` values are alike (``previous``: one of them)."""
        return Deferred(layout, plan_kind, block_kv, heads, kv_dtype)

    def upload(self, host: Any, device: torch.device, previous: Any = None) -> Prepared:
        """The prepared value of a :meth:`plan_host` result on ``device``."""
        return self.plan(host.layout, host.plan_kind, host.block_kv, host.heads, device,
                         previous, host.kv_dtype)

    def reserve(self, capacity: Capacity, block_kv: int, heads: Heads,
                device: torch.device) -> Any:
        """Fixed buffers for every plan of ``capacity``, to pass as ``previous`` (backends
        with ``graph_safe`` only)."""
        raise NotImplementedError(f"backend {self.name!r} is not graph-safe")


_CONTRACT = {name: inspect.signature(getattr(Backend, name)) for name in ("plan", "run")}


def check_backend(backend: Any, name: str) -> Backend:
    """``backend`` if it keeps the contract, else a ``TypeError`` saying what is missing."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {name!r}: expected an instance of deft.ops.Backend, got "
                        f"{type(backend).__name__}")
    for attr in ("name", "dtypes"):
        if not hasattr(backend, attr):
            raise TypeError(f"backend {name!r}: missing the attribute {attr!r}")
    for attr in ("dtypes", "kv_dtypes"):
        got = getattr(backend, attr)
        if (attr == "kv_dtypes" and got is None) or (
                got and all(isinstance(d, torch.dtype) for d in got)):
            continue
        raise TypeError(f"backend {name!r}: {attr}: expected a non-empty tuple of torch dtypes, "
                        f"got {got!r}")
    builds = getattr(backend, "builds", None)
    if not (isinstance(builds, tuple) and builds[:1] == ("default",)
            and all(isinstance(b, str) for b in builds)):
        raise TypeError(f"backend {name!r}: builds: expected a tuple of names starting with "
                        f"'default', got {builds!r}")
    for method, expected in _CONTRACT.items():
        got = inspect.signature(getattr(backend, method))
        want = [p for p in expected.parameters if p != "self"]
        missing = [p for p in want if p not in got.parameters]
        if missing:
            raise TypeError(f"backend {name!r}: {method}() lacks the parameters "
                            f"{', '.join(missing)} of the contract {method}{expected}")
    return backend
