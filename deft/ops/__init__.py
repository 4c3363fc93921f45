"""Attention backends and their registry.

A backend executes a :class:`~deft.plan.TreePlan`. ``prepare`` runs once per step (at
``TreeAttention.plan``) and may build device tensors; ``run`` runs once per layer. A
backend may also define ``refine_plan(plan, num_qo_heads, num_kv_heads, head_dim, device)``
to reshape the plan for its kernels (e.g. coarser tiles) before ``prepare``;
``plan_fast(layout, plan_kind, block_kv, num_qo_heads, num_kv_heads, head_dim, device,
previous)``, which ``TreeAttention.plan`` tries first and which returns ``(plan, prepared)``
equal to those three steps, or ``None`` to use them (e.g. a compiled planner for one plan
kind); ``previous`` is the caller's last prepared value (or ``None``), whose device buffers
it may reuse, since a plan invalidates the last one's CUDA graphs; and
``run_output(prepared, q, k_cache, v_cache, sm_scale) -> o``, which ``TreeAttention.run``
calls instead of ``run`` when the caller does not want the log-sum-exp. A backend with
``writes_out = True`` takes ``out=`` (and ``run`` also ``lse_out=``) and writes there;
``TreeAttention`` copies other backends' results into the caller's tensors. A backend with
a ``max_slot`` attribute rejects layouts that use a larger slot (at ``plan``).
New backends plug in with :func:`register_backend` without touching callers.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

import torch

from ..layout import TreeLayout
from ..plan import TreePlan

__all__ = ["Backend", "register_backend", "get_backend", "backend_names", "resolve_backend"]


class Backend(Protocol):
    """What a backend provides. ``prepared`` is whatever ``prepare`` returned."""

    name: str
    dtypes: tuple[torch.dtype, ...]

    def prepare(self, plan: TreePlan, layout: TreeLayout, device: torch.device,
                num_qo_heads: int, num_kv_heads: int, head_dim: int) -> Any: ...

    def run(
        self,
        prepared: Any,
        q: torch.Tensor,  # [Q, H_q, D]
        k_cache: torch.Tensor,  # [num_slots, H_kv, D]
        v_cache: torch.Tensor,  # [num_slots, H_kv, D]
        sm_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # o [Q, H_q, D] in q.dtype, lse [Q, H_q] float32
        ...


_FACTORIES: dict[str, Callable[[], Backend]] = {}
_INSTANCES: dict[str, Backend] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register ``factory`` (called once, on first use) under ``name``."""
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def backend_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` lists the choices otherwise."""
    if name not in _FACTORIES:
        raise ValueError(f"backend: expected one of auto, {', '.join(_FACTORIES)}, got {name!r}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _FACTORIES[name]()
    return _INSTANCES[name]


def resolve_backend(name: str, device: torch.device) -> str:
    """Map ``"auto"`` to ``triton`` on CUDA when it imports, else ``torch``."""
    if name != "auto":
        get_backend(name)  # validates the name
        return name
    if device.type == "cuda" and "triton" in _FACTORIES:
        try:
            get_backend("triton")
            return "triton"
        except ImportError:
            pass
    return "torch"


def _lazy(module: str, attr: str) -> Callable[[], Backend]:
    def factory() -> Backend:
        return getattr(importlib.import_module(module, __name__), attr)()

    return factory


register_backend("torch", _lazy(".torch_backend", "TorchBackend"))
register_backend("reference", _lazy(".reference", "ReferenceBackend"))
register_backend("triton", _lazy(".triton_backend", "TritonBackend"))
