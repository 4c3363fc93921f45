"""Attention backends and their registry.

Every backend keeps the contract of :class:`~deft.ops.base.Backend` (``plan`` once per
step, ``run`` once per layer, declared capabilities). Backends are registered by name with
a factory called once, on first use; :func:`get_backend` checks what it returns. New
backends plug in with :func:`register_backend` without touching callers.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from .base import Backend, Capacity, CapacityError, Heads, Prepared, check_backend

__all__ = ["Backend", "Capacity", "CapacityError", "Heads", "Prepared", "register_backend", "get_backend", "backend_names",
           "resolve_backend"]

_FACTORIES: dict[str, Callable[[], Backend]] = {}
_INSTANCES: dict[str, Backend] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register ``factory`` (a :class:`Backend` subclass, or a callable returning an
    instance; called once, on first use) under ``name``."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name: expected a non-empty backend name other than 'auto', got {name!r}")
    if isinstance(factory, type) and not issubclass(factory, Backend):
        raise TypeError(f"factory: expected a subclass of deft.ops.Backend, got {factory.__name__}")
    if not callable(factory):
        raise TypeError(f"factory: expected a callable returning a Backend, got {factory!r}")
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in registration order (``backend=`` takes each)."""
    return tuple(_FACTORIES)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` lists the choices otherwise."""
    if name not in _FACTORIES:
        raise ValueError(f"backend: expected one of auto, {', '.join(_FACTORIES)}, got {name!r}")
    if name not in _INSTANCES:
        _INSTANCES[name] = check_backend(_FACTORIES[name](), name)
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
register_backend("triton", _lazy(".triton", "TritonBackend"))
