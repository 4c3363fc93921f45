"""The public attention API: plan once per step, run once per layer."""

from __future__ import annotations

import math
import time
import weakref
from typing import Any, NamedTuple

import torch

from .checks import positive_int, real_number
from .cache.pool import FP8
from .layout import TreeLayout
from .ops import Capacity, Heads, get_backend, resolve_backend
from .plan import PLAN_KINDS, TreePlan, make_plan

__all__ = ["HostPlan", "TreeAttention", "tree_attention"]


class HostPlan(NamedTuple):
    """A step planned on the host (:meth:`TreeAttention.plan_host`), to upload to devices."""

    key: tuple
    layout: TreeLayout
    kv_dtype: torch.dtype | None
    backend_plan: Any


class _CheckedCaches(NamedTuple):
    """A K/V cache pair that passed :meth:`TreeAttention.run`'s checks, held by weak
    references: a later run with the same tensors, their shape, dtype and storage address
    unchanged, checks only ``q`` and the plan's slots (host time is what an eager layer pays)."""

    k: weakref.ref
    v: weakref.ref
    shape: torch.Size
    k_ptr: int
    v_ptr: int
    dtype: torch.dtype
    q_dtype: torch.dtype
    planned: torch.dtype | None  # the kv_dtype planned when they were checked
    device: torch.device
    slots: int

    def match(self, q: Any, k: torch.Tensor, v: torch.Tensor, planned: torch.dtype | None) -> bool:
        """Whether ``k`` and ``v`` are this pair, unchanged, and ``q`` and the planned K/V
        dtype are those they were checked with."""
        return (planned is self.planned and self.k() is k and self.v() is v and type(q) is torch.Tensor
                and k.shape == self.shape and v.shape == self.shape and k.data_ptr() == self.k_ptr
                and v.data_ptr() == self.v_ptr and k.dtype == self.dtype and v.dtype == self.dtype
                and q.dtype == self.q_dtype and q.device == self.device)


class TreeAttention:
    """Exact attention of many queries over one tree (or forest) of KV cache.

    ``plan(layout)`` once per decode step builds the schedule (and the backend's
    device-side metadata); ``run(q, k_cache, v_cache)`` then executes it for each layer.
    ``plan_host(layout)`` does the host part alone: its result, passed to ``plan`` of
    several attentions (one per device), is planned once and uploaded to each.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim:
        Attention shape; ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    sm_scale:
        Softmax scale, ``1 / sqrt(head_dim)`` by default.
    backend:
        ``"auto"`` (``triton`` for CUDA when available, else ``torch``), or any
        registered backend name.
    plan_kind:
        ``"flatten"`` (DeFT-Flatten), ``"node"``, ``"node_chunk"`` or ``"per_query"``.
    block_kv:
        KV tile size in tokens; by default the backend's preferred size.
    device:
        Where ``run`` will be called; plan metadata is placed there.
    capacity:
        With a graph-safe backend (``triton``): fixed device buffers for every step of
        ``capacity.queries`` queries and at most ``capacity.tokens`` plan tokens. Every
        plan then writes into them and every ``run`` launches with the same arguments, so
        a CUDA graph captured once replays correctly after any later plan; a plan that does
        not fit raises ``ValueError`` and leaves the buffers as the last plan left them.
        ``capacity.build`` picks the kernels' build for every plan (see :attr:`build`).
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sm_scale: float | None = None,
        backend: str = "auto",
        plan_kind: str = "flatten",
        block_kv: int | None = None,
        device: str | torch.device = "cpu",
        capacity: Capacity | None = None,
    ) -> None:
        self.num_qo_heads = positive_int(num_qo_heads, "num_qo_heads")
        self.num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = positive_int(head_dim, "head_dim")
        if num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_qo_heads}"
            )
        if plan_kind not in PLAN_KINDS:
            raise ValueError(f"plan_kind: expected one of {', '.join(PLAN_KINDS)}, got {plan_kind!r}")
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(self.head_dim)
        self.sm_scale = real_number(sm_scale, "sm_scale", "a positive finite number",
                                    lambda x: x > 0)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {self.device} requested but no CUDA device is available")
        self.backend_name = resolve_backend(backend, self.device)
        self._backend = get_backend(self.backend_name)
        self._heads = Heads(self.num_qo_heads, self.num_kv_heads, self.head_dim)
        self.plan_kind = plan_kind
        self.block_kv = (
            positive_int(block_kv, "block_kv")
            if block_kv is not None
            else self._backend.default_block_kv
        )
        self._plan: TreePlan | None = None
        self._prepared: Any = None
        self.kv_dtype: torch.dtype | None = None  # the planned K/V dtype (None: q's)
        self._checked: dict[int, _CheckedCaches] = {}  # by id(k_cache); dropped with the tensor
        self._checked_out: dict[str, tuple[Any, ...]] = {}  # "out"/"lse_out": (ref, dtype, device)
        self.capacity = capacity
        self._reserved: Any = None
        if capacity is not None:
            if not isinstance(capacity, Capacity):
                raise TypeError(f"capacity: expected a deft.Capacity, got {type(capacity).__name__}")
            if not self._backend.graph_safe:
                raise ValueError(f"capacity: the {self.backend_name} backend is not graph-safe")
            if capacity.build not in self._backend.builds:
                raise ValueError(f"capacity.build: expected one of the {self.backend_name} "
                                 f"backend's builds {self._backend.builds}, got "
                                 f"{capacity.build!r}")
            capacity = Capacity(positive_int(capacity.queries, "capacity.queries"),
                                positive_int(capacity.tokens, "capacity.tokens"),
                                None if capacity.partials is None else
                                positive_int(capacity.partials, "capacity.partials"),
                                capacity.build)
            self._reserved = self._backend.reserve(capacity, self.block_kv, self._heads,
                                                   self.device)
            self.capacity = self._reserved.capacity
        self._max_slot = -1
        self.plan_seconds = 0.0

    def __repr__(self) -> str:
        return (
            f"TreeAttention(num_qo_heads={self.num_qo_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, backend={self.backend_name!r}, "
            f"plan_kind={self.plan_kind!r}, block_kv={self.block_kv}, device={str(self.device)!r})"
        )

    @property
    def graph_safe(self) -> bool:
        """Whether the backend is graph-safe (``capacity`` and captured runs work)."""
        return self._backend.graph_safe

    @property
    def current_plan(self) -> TreePlan:
        """The plan made by the last :meth:`plan` call."""
        if self._plan is None:
            raise RuntimeError("TreeAttention.plan(layout) must be called before run()")
        return self._plan

    def plan(self, layout: TreeLayout | HostPlan, kv_dtype: torch.dtype | None = None) -> TreePlan:
        """Plan one step over ``layout`` (or a :meth:`plan_host` result of an attention of
        the same shape, backend and plan kind); the result is reused by every later
        :meth:`run`. ``kv_dtype``: the K/V caches' dtype, if not ``q``'s (one of the
        backend's ``kv_dtypes``, e.g. FP8).

        Plan and run on one CUDA stream: a plan may reuse the last plan's device buffers,
        which the stream orders after the last plan's launches. Without a ``capacity``,
        CUDA graphs captured before this call must not be replayed after it; with one,
        they replay this plan."""
        t0 = time.perf_counter()
        host = None
        if not isinstance(layout, TreeLayout):
            if not isinstance(layout, HostPlan):
                raise TypeError(f"layout: expected a deft.TreeLayout, got {type(layout).__name__}")
            if layout.key != self._host_key:
                raise ValueError(f"layout: a host plan of {layout.key}, expected one of this "
                                 f"attention's (backend, plan kind, block_kv, heads, device "
                                 f"type, capacity's build) {self._host_key}")
            if kv_dtype is not None and kv_dtype != layout.kv_dtype:
                raise ValueError(f"kv_dtype: {kv_dtype} given, the host plan's is "
                                 f"{layout.kv_dtype}")
            host, layout, kv_dtype = layout, layout.layout, layout.kv_dtype
        self._check_kv_dtype(kv_dtype)
        max_slot = int(layout.kv_indices.max(initial=-1))
        limit = self._backend.max_slot
        if limit is not None and max_slot > limit:
            raise ValueError(f"layout: slot {max_slot} is beyond the {self.backend_name} backend's "
                             f"largest addressable slot {limit}")
        # The last plan's device buffers (or the reserved ones) may be reused; until this plan
        # succeeds, there is no current plan.
        previous, self._plan, self._prepared = self._prepared or self._reserved, None, None
        if host is None:
            self._prepared = self._backend.plan(layout, self.plan_kind, self.block_kv,
                                                self._heads, self.device, previous, kv_dtype)
        else:
            self._prepared = self._backend.upload(host.backend_plan, self.device, previous)
        plan = self._prepared.plan
        self._plan = plan
        self._max_slot = max_slot
        self.kv_dtype = kv_dtype
        self.plan_seconds = time.perf_counter() - t0
        return plan

    def plan_host(self, layout: TreeLayout, kv_dtype: torch.dtype | None = None) -> HostPlan:
        """The host part of :meth:`plan` (planning, packing), for :meth:`plan` of this
        attention or of others of the same shape, backend and plan kind on other devices."""
        if not isinstance(layout, TreeLayout):
            raise TypeError(f"layout: expected a deft.TreeLayout, got {type(layout).__name__}")
        self._check_kv_dtype(kv_dtype)
        return HostPlan(self._host_key, layout, kv_dtype, self._backend.plan_host(
            layout, self.plan_kind, self.block_kv, self._heads, self.device, kv_dtype,
            self._reserved))

    def make_plan(self, layout: TreeLayout, plan_kind: str | None = None) -> TreePlan:
        """The planner's plan of ``layout`` under this attention's tile size (``plan_kind``:
        this attention's by default), on the host only: what a step loads and merges (for
        counting and capacities), not what runs."""
        return make_plan(layout, self.plan_kind if plan_kind is None else plan_kind,
                         self.block_kv)

    def check_kv(self, kv_dtype: torch.dtype, q_dtype: torch.dtype, scaled: bool,
                 name: str = "kv") -> None:
        """Raise unless the backend reads K/V of ``kv_dtype`` next to queries of ``q_dtype``
        (and, if ``scaled``, their scales; FP8 K/V need them): a K/V format checked before
        any step runs."""
        self._check_kv_dtype(kv_dtype)
        if kv_dtype != q_dtype and kv_dtype not in (self._backend.kv_dtypes or ()):
            raise TypeError(f"{name}: backend {self.backend_name!r} reads K/V in the queries' "
                            f"dtype {q_dtype}{_besides(self._backend.kv_dtypes)} only, got "
                            f"{kv_dtype}")
        if scaled and not self._backend.kv_scales:
            raise ValueError(f"{name}: the {self.backend_name} backend reads no K/V scales; "
                             "expected an unscaled format")
        if kv_dtype == FP8 and not scaled:
            raise ValueError(f"{name}: FP8 K/V need dequantisation scales; expected a scaled "
                             "format")

    @property
    def build(self) -> str:
        """The kernel build the last plan's tree asks for, one of the backend's ``builds``.
        The ``triton`` backend's: ``"few_rows"`` for a tree over FP8 K/V whose K/V tokens
        are mostly seen by few (query, query head) rows, as in parallel sampling's branches
        and tree-of-thought (programs of 16 rows, ``KernelConfig.kv8_few_rows``);
        ``"light"`` for a step of at least 2,048 rows whose programs fit one wave of the
        uncapped build, as a wide draft tree on a short context (``KernelConfig.light_per_sm``);
        ``"default"`` otherwise. An unreserved attention launches that build; one with a
        ``capacity`` keeps its own (``Capacity.build``), so a caller replaying graphs may
        keep one attention per build and plan into the one the tree asks for, read from the
        attention of the default build (one of another build judges by its own plan)."""
        return getattr(self._prepared, "build", "default")

    @property
    def _host_key(self) -> tuple:
        build = None if self.capacity is None else self.capacity.build
        return (self.backend_name, self.plan_kind, self.block_kv, self._heads, self.device.type,
                build)

    def _check_kv_dtype(self, kv_dtype: Any) -> None:
        if kv_dtype is None:
            return
        allowed = tuple(dict.fromkeys(self._backend.dtypes + (self._backend.kv_dtypes or ())))
        if kv_dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise TypeError(f"kv_dtype: expected one of {names} for backend "
                            f"{self.backend_name!r}, got {kv_dtype!r}")

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        return_lse: bool = False,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        captured: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention output for the planned step.

        Parameters
        ----------
        q:
            ``[num_queries, num_qo_heads, head_dim]``, in the layout's query order.
        k_cache, v_cache:
            ``[num_slots, num_kv_heads, head_dim]`` or paged
            ``[num_pages, page_size, num_kv_heads, head_dim]``; the planned ``kv_dtype``
            (``q``'s if none was given) and ``q``'s device.
        return_lse:
            Also return the float32 natural-log sum-exp ``[num_queries, num_qo_heads]``.
        out, lse_out:
            Contiguous tensors to write ``o`` (and, with ``return_lse``, ``lse``) into. With
            the ``triton`` backend the kernels write there directly and ``run`` allocates
            nothing (its workspaces are sized by :meth:`plan`), so the layers of a step can
            be captured in one CUDA graph; other backends copy their result in. A captured
            graph reads this plan's buffers: replay it only until the next :meth:`plan`,
            unless the attention has a ``capacity``.
        k_scale, v_scale:
            Dequantisation scales of this layer's K and V: a positive float, or a float32
            tensor ``[1]`` or ``[num_kv_heads]`` (one per KV head) on the device, e.g. a
            :class:`~deft.KVPool`'s ``scales(layer)``: attention reads ``k_cache * k_scale``
            and ``v_cache * v_scale``. Both or neither; only for backends with
            ``kv_scales``; required for FP8 (``float8_e4m3fn``) caches. Tensors are read on
            the device at run time (a captured graph reads their current values).
        captured:
            This run is launched into a CUDA graph, or is its warm-up (a capture itself
            is detected): the backend launches as it does inside graphs.

        Returns
        -------
        ``o`` ``[num_queries, num_qo_heads, head_dim]`` in ``q.dtype`` (and ``lse``); ``out``
        and ``lse_out`` themselves when given. A query that sees no token gets ``o = 0`` and
        ``lse = -inf``.

        Non-finite K/V, on every backend: a (query, head) whose KV head holds a NaN or ±inf in
        a K or V row the query sees gets NaN ``o`` and NaN ``lse``; every other (query, head)
        is bitwise what it is when those rows are finite. Rows a query does not see (other
        branches, other trees, unused slots, its own node's tokens past ``query_kv_len``)
        never enter its arithmetic: masked entries are selected away, not multiplied by 0.
        FP8 caches hold no inf: a non-finite value written into a :class:`~deft.KVPool`
        becomes NaN there (:func:`deft.cache.pool.quantize`), which the same rule isolates.
        """
        plan = self.current_plan
        checked = self._checked.get(id(k_cache))
        if (checked is not None and checked.match(q, k_cache, v_cache, self.kv_dtype)
                and q.shape == (plan.num_queries, self.num_qo_heads, self.head_dim)
                and self._max_slot < checked.slots):
            k_flat, v_flat = _flat(k_cache, v_cache)
        else:
            k_flat, v_flat = self._check_inputs(q, k_cache, v_cache, plan)
        if k_scale is not None or v_scale is not None:
            self._check_scales(k_scale, v_scale, q.device)
        elif self.kv_dtype is FP8:
            raise ValueError("k_scale, v_scale: FP8 K/V (float8_e4m3fn) need their "
                             "dequantisation scales, got None")
        if out is not None:
            self._check_out_once(out, "out", q.shape, q.dtype, q.device)
        if lse_out is not None:
            if not return_lse:
                raise ValueError("lse_out: given but return_lse is False")
            self._check_out_once(lse_out, "lse_out", q.shape[:2], torch.float32, q.device)
        if self._backend.writes_out:
            o, lse = self._backend.run(self._prepared, q, k_flat, v_flat, self.sm_scale, out=out,
                                       lse_out=lse_out, want_lse=return_lse, k_scale=k_scale,
                                       v_scale=v_scale, captured=captured)
            return (o, lse) if return_lse else o
        o, lse = self._backend.run(self._prepared, q, k_flat, v_flat, self.sm_scale,
                                   want_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
                                   captured=captured)
        o = o if out is None else out.copy_(o)
        if not return_lse:
            return o
        return o, (lse if lse_out is None else lse_out.copy_(lse))

    def _check_inputs(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TreePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Run per layer of every eager step: each tensor attribute is read once (host time).
        if not (type(q) is torch.Tensor and type(k_cache) is torch.Tensor
                and type(v_cache) is torch.Tensor):
            for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        expect_q = (plan.num_queries, self.num_qo_heads, self.head_dim)
        if q.shape != expect_q:
            raise ValueError(f"q: expected shape {expect_q} [num_queries, H_q, D], got {tuple(q.shape)}")
        dtype = q.dtype
        if dtype not in self._backend.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self._backend.dtypes)
            raise TypeError(f"q: expected dtype {names} for backend {self.backend_name!r}, got {dtype}")
        tail = (self.num_kv_heads, self.head_dim)
        ks = k_cache.shape
        if len(ks) not in (3, 4) or ks[-2] != tail[0] or ks[-1] != tail[1]:
            raise ValueError(
                f"k_cache: expected shape [num_slots, {tail[0]}, {tail[1]}] or "
                f"[num_pages, page_size, {tail[0]}, {tail[1]}], got {tuple(ks)}"
            )
        if v_cache.shape != ks:
            raise ValueError(f"v_cache: expected shape {tuple(ks)} like k_cache, got {tuple(v_cache.shape)}")
        kv_dtype = dtype if self.kv_dtype is None else self.kv_dtype
        if kv_dtype != dtype and kv_dtype not in (self._backend.kv_dtypes or ()):
            raise TypeError(f"q: expected dtype {kv_dtype}, the planned kv_dtype: backend "
                            f"{self.backend_name!r} reads K/V in q's dtype"
                            f"{_besides(self._backend.kv_dtypes)} only, got {dtype}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != kv_dtype:
                like = "like q" if self.kv_dtype is None else "the planned kv_dtype"
                raise TypeError(f"{name}: expected dtype {kv_dtype} {like}, got {t.dtype}")
        want = self.device
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            got = t.device
            if got != want and not (got.type == want.type and want.index is None):
                raise ValueError(f"{name}: expected device {want} (the planned device), got {got}")
        k_flat, v_flat = _flat(k_cache, v_cache)
        slots = k_flat.shape[0]
        if self._max_slot >= slots:
            raise ValueError(
                f"k_cache: the layout uses slot {self._max_slot} but the cache holds "
                f"{slots} slots"
            )
        key, known = id(k_cache), self._checked

        def forget(_ref: weakref.ref) -> None:  # a dying tensor takes its own entry along
            entry = known.get(key)
            if entry is not None and (entry.k() is None or entry.v() is None):
                del known[key]

        known[key] = _CheckedCaches(weakref.ref(k_cache, forget), weakref.ref(v_cache, forget),
                                    ks, k_cache.data_ptr(), v_cache.data_ptr(), kv_dtype, dtype,
                                    self.kv_dtype, q.device, slots)
        return k_flat, v_flat

    def _check_scales(self, k_scale: Any, v_scale: Any, device: torch.device) -> None:
        if not self._backend.kv_scales:
            raise ValueError(f"k_scale, v_scale: the {self.backend_name} backend reads no K/V "
                             "scales; expected None")
        h = self.num_kv_heads
        for name, s, other in (("k_scale", k_scale, "v_scale"), ("v_scale", v_scale, "k_scale")):
            if s is None:
                raise ValueError(f"{name}: expected a scale, as {other} is given")
            if isinstance(s, torch.Tensor):
                if (s.dtype != torch.float32 or s.device.type != device.type
                        or s.shape not in ((1,), (h,)) or s.stride(0) != 1):
                    raise ValueError(f"{name}: expected a float32 tensor of shape [1] or "
                                     f"[num_kv_heads={h}] (contiguous) on {device}, got "
                                     f"{s.dtype} {tuple(s.shape)} on {s.device}")
            else:
                real_number(s, name, "a positive finite number or a float32 tensor",
                            lambda x: x > 0)

    def _check_out_once(self, t: Any, name: str, shape: torch.Size, dtype: torch.dtype,
                        device: torch.device) -> None:
        """:func:`_check_out`, but for the tensor last checked as ``name`` with this dtype and
        device only its shape and contiguity again."""
        seen = self._checked_out.get(name)
        if (seen and seen[0]() is t and seen[1] is dtype and seen[2] == device
                and t.shape == shape and t.is_contiguous()):
            return
        _check_out(t, name, tuple(shape), dtype, device)
        self._checked_out[name] = (weakref.ref(t), dtype, device)


def _besides(kv_dtypes: tuple[torch.dtype, ...] | None) -> str:
    """`` or <kv_dtypes>`` for messages, empty for ``None``."""
    return "".join(f" or {d}" for d in kv_dtypes or ())


def _flat(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as ``[num_slots, H_kv, D]`` (paged ones reshaped)."""
    if k_cache.dim() == 3:
        return k_cache, v_cache
    return k_cache.reshape(-1, *k_cache.shape[2:]), v_cache.reshape(-1, *v_cache.shape[2:])


def _check_out(t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name}: expected a {dtype} tensor of shape {shape} on {device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: TreeLayout,
    sm_scale: float | None = None,
    backend: str = "auto",
    plan_kind: str = "flatten",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One-shot tree attention: plan ``layout`` and run it (see :class:`TreeAttention`)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(
            f"q: expected a tensor [num_queries, H_q, D], got "
            f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
        )
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() not in (3, 4):
        raise ValueError("k_cache: expected a tensor [num_slots, H_kv, D] or [num_pages, page_size, H_kv, D]")
    attn = TreeAttention(
        q.shape[1], k_cache.shape[-2], q.shape[2], sm_scale=sm_scale, backend=backend,
        plan_kind=plan_kind, device=q.device,
    )
    attn.plan(layout)
    return attn.run(q, k_cache, v_cache, return_lse=return_lse)
