"""One validated engine configuration: what a :class:`~deft.engine.TreeEngine` and its
runner are built from (the CLI and the server build it from their flags)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..cache.pool import KVSpec
from ..checks import int_at_least
from ..ops import get_backend
from ..plan import PLAN_KINDS

__all__ = ["DEFAULT_BUCKETS", "EngineConfig"]

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs; every field is checked here, once.

    ``num_pages``, ``page_size``: pool geometry (``num_pages * page_size`` token slots,
    shared by every tree). ``backend``: the :class:`~deft.TreeAttention` backend
    (``"auto"``: triton on CUDA, else torch). ``plan_kind``: ``"flatten"`` (DeFT), or
    ``"per_query"`` (each query reads its whole path, as per-branch decoding does, for
    comparisons), ``"node"``, ``"node_chunk"``. ``device``: where the pool and plans live
    (``None``: the model's; its kind must be the model's). ``count_io``: count the K/V
    bytes each step reads (costs a per-query plan per step). ``prefill_chunk``: the
    strategies feed a prompt at most this many tokens per forward. ``cuda_graphs``: replay
    steps of at most ``max(graph_buckets)`` queries as CUDA graphs, one per bucket
    (``None``: on for CUDA with a graph-safe backend). ``overlap``: the decode loop's
    default, tokens sampled on the device feed the next step there (``None``: on for
    CUDA). ``kv``: the K/V format (:class:`~deft.KVSpec`, or a ``--kv-dtype`` name of
    :data:`~deft.cache.pool.KV_DTYPE_NAMES`: ``"fp8_e4m3"`` is FP8 with per-head scales,
    calibrated on the first step unless given to the pool; ``None`` or ``"auto"``: the
    model's dtype, unscaled).
    """

    num_pages: int = 4096
    page_size: int = 16
    backend: str = "auto"
    plan_kind: str = "flatten"
    device: torch.device | str | None = None
    count_io: bool = False
    prefill_chunk: int = 256
    cuda_graphs: bool | None = None
    graph_buckets: Sequence[int] = DEFAULT_BUCKETS
    overlap: bool | None = None
    kv: KVSpec | str | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("num_pages", int_at_least(self.num_pages, "num_pages", 1))
        set_("page_size", int_at_least(self.page_size, "page_size", 1))
        set_("prefill_chunk", int_at_least(self.prefill_chunk, "prefill_chunk", 1))
        if not isinstance(self.backend, str):
            raise TypeError(f"backend: expected a backend name, got {type(self.backend).__name__}")
        if self.backend != "auto":
            get_backend(self.backend)  # a ValueError listing the choices
        if self.plan_kind not in PLAN_KINDS:
            raise ValueError(f"plan_kind: expected one of {', '.join(PLAN_KINDS)}, got "
                             f"{self.plan_kind!r}")
        if self.device is not None:
            set_("device", torch.device(self.device))
        for name in ("count_io", "cuda_graphs", "overlap"):  # the last two: None = by device
            value = getattr(self, name)
            if value is None and name != "count_io":
                continue
            if not isinstance(value, (bool, int)):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
            set_(name, bool(value))
        buckets = self.graph_buckets
        if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
            raise ValueError(f"graph_buckets: expected positive query counts, got {buckets!r}")
        set_("graph_buckets", tuple(sorted({int_at_least(b, "graph_buckets", 1) for b in buckets})))
        if not self.graph_buckets:
            raise ValueError("graph_buckets: expected positive query counts, got none")
        if isinstance(self.kv, str):
            try:
                set_("kv", KVSpec.named(self.kv))
            except ValueError as exc:
                raise ValueError(f"kv: {str(exc).partition(': ')[2]}") from None
        if self.kv is not None and not isinstance(self.kv, KVSpec):
            raise TypeError(f"kv: expected a deft.KVSpec, a K/V dtype name or None, got "
                            f"{type(self.kv).__name__}")

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """``config`` (the defaults if ``None``) with ``options`` replacing its fields;
        an unknown option is a ``TypeError`` naming it."""
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected a deft EngineConfig, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"{', '.join(unknown)}: not an engine option (expected any of "
                            f"{', '.join(sorted(names))})")
        return cls(**options) if config is None else dataclasses.replace(config, **options)
