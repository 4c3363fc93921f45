"""What the engine asks of a model: the decoder contract every registered family keeps.

The engine and its runner never ask for a class. They read ``config`` (``vocab_size``,
``max_position_embeddings``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``),
``device`` and ``dtype``; ask ``attention(...)`` for a :class:`~deft.TreeAttention` of the
model's heads; size the K/V pool from ``kv_shape``; and call the model once per step with
the step's tensors (the signature of :meth:`DecoderModel.__call__`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from ..attention import TreeAttention
from ..cache.pool import KVPool

__all__ = ["DecoderModel", "check_decoder"]

_CONFIG_FIELDS = ("vocab_size", "max_position_embeddings", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim")


@runtime_checkable
class DecoderModel(Protocol):
    """A causal LM over a tree KV cache, as the engine drives it."""

    config: Any

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the K/V pool it reads and writes."""

    def attention(self, device: str | torch.device | None = None, backend: str = "auto",
                  **kwargs: Any) -> TreeAttention:
        """A :class:`~deft.TreeAttention` of the model's heads (``kwargs``: its options)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 write_slots: torch.Tensor, attn: TreeAttention, pool: KVPool,
                 logits_rows: torch.Tensor | None = None,
                 captured: bool = False) -> torch.Tensor:
        """Float32 logits ``[R, vocab]`` of the planned step's ``logits_rows`` (all rows by
        default), writing each token's K/V at its slot of ``pool`` first."""


def check_decoder(model: Any, name: str = "model") -> DecoderModel:
    """``model`` if it keeps the contract, else a ``TypeError`` naming what it lacks."""
    missing = [a for a in ("config", "device", "dtype", "kv_shape", "attention")
               if not hasattr(model, a)]
    if not callable(model):
        missing.append("__call__")
    config = getattr(model, "config", None)
    missing += [f"config.{f}" for f in _CONFIG_FIELDS if config is not None
                and not hasattr(config, f)]
    if missing:
        raise TypeError(f"{name}: expected a decoder model (deft.model.DecoderModel), got "
                        f"{type(model).__name__} without {', '.join(missing)}")
    return model
