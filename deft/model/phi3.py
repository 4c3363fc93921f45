"""Phi-3: Llama's decoder whose checkpoint fuses q/k/v (``self_attn.qkv_proj``) and gate/up
(``mlp.gate_up_proj``); Hugging Face ``phi3`` directories. The fused tensors are shown under
Llama's names as row slices, so every loader (and a per-rank one) sees one layout."""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Iterator, Mapping

import torch

from .config import LlamaConfig
from .families import Family
from .hf_loader import load_hf

__all__ = ["PHI3", "phi3_config", "Phi3Tensors"]

_FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")


def phi3_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """A Phi-3 ``config.json`` as a :class:`LlamaConfig`; partial rotary is refused by name."""
    factor = raw.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ValueError(f"partial_rotary_factor: expected 1.0 (partial RoPE is not supported), got {factor!r}")
    return LlamaConfig.from_hf_config(raw)


class Phi3Tensors(Mapping[str, torch.Tensor]):
    """``tensors`` with each fused ``qkv_proj``/``gate_up_proj`` weight shown as its
    ``q/k/v_proj`` or ``gate/up_proj`` row slices (read when asked for; the last fused
    tensor is kept, so the slices of one are read once)."""

    def __init__(self, config: LlamaConfig, tensors: Mapping[str, torch.Tensor]) -> None:
        c = config
        q, kv, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        parts = {"self_attn.qkv_proj": (("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, kv),
                                        ("self_attn.v_proj", q + kv, kv)),
                 "mlp.gate_up_proj": (("mlp.gate_proj", 0, i), ("mlp.up_proj", i, i))}
        self._tensors = tensors
        self._last: tuple[str, torch.Tensor] | None = None
        self._slices: dict[str, tuple[str, int, int, int]] = {}  # name -> (fused, start, rows, all rows)
        for name in tensors:
            m = _FUSED.fullmatch(name)
            if m:
                total = sum(rows for _, _, rows in parts[m.group(2)])
                for part, start, rows in parts[m.group(2)]:
                    self._slices[f"{m.group(1)}{part}.weight"] = (name, start, rows, total)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._slices:
            return self._tensors[name]
        fused, start, rows, total = self._slices[name]
        if self._last is None or self._last[0] != fused:
            self._last = (fused, self._tensors[fused])
        t = self._last[1]
        if t.shape[0] != total:
            raise ValueError(f"tensor {fused!r} has {t.shape[0]} rows, expected {total} from the config")
        return t[start:start + rows]

    def __contains__(self, name: object) -> bool:
        return name in self._slices or (name in self._tensors and not _FUSED.fullmatch(str(name)))

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in self._tensors if not _FUSED.fullmatch(n))
        yield from self._slices

    def __len__(self) -> int:
        return sum(1 for _ in self)


PHI3 = Family("phi3", hf_model_types=("phi3",), load_hf=partial(load_hf, to_config=phi3_config, view=Phi3Tensors),
              tensor_parallel=True)
