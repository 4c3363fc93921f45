"""Phi-3: Llama's decoder whose checkpoint fuses q/k/v (``self_attn.qkv_proj``) and gate/up
(``mlp.gate_up_proj``); Hugging Face ``phi3`` directories and GGUF ``phi3`` files (llama.cpp
keeps the fused tensors as ``attn_qkv`` and ``ffn_up``, gate rows first, and q/k rows in
rotate-half order). The fused tensors are shown under Llama's names as row slices, so every
loader (and a per-rank one) sees one layout. The 128k Phi-3 and Phi-3.5 models' LongRoPE is
exact up to their original context (4k), where the context is capped."""

from __future__ import annotations

import os
import re
from functools import partial
from typing import Any, Iterator, Mapping

import torch

from ..checks import int_at_least
from .config import LlamaConfig
from .families import Family
from .gguf_file import GGUFFile
from .gguf_loader import BLOCK_NAMES, load_gguf
from .hf_loader import load_hf
from .llama import LlamaModel
from .tokenizer import Tokenizer

__all__ = ["PHI3", "phi3_config", "load_phi3_gguf", "Phi3Tensors"]

_FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")
# GGUF block tensor kind -> the Hugging Face fused module it holds
_GGUF_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GGUF_FUSED_NAME = re.compile(r"blk\.\d+\.(attn_qkv|ffn_up)\.weight")
# Files converted before llama.cpp wrote the sliding window: context length -> the window
# of the models of that context (Phi-3-mini/medium-4k's config.json)
_UNSTATED_WINDOW = {4096: 2047}
# Phi3Config's names of LongRoPE, and its original context where config.json states none
_LONGROPE_NAMES = ("longrope", "su", "yarn")
_ORIGINAL_CONTEXT = 4096


def phi3_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """A Phi-3 ``config.json`` as a :class:`LlamaConfig`, read as transformers' Phi3Config
    reads it: ``su`` and ``yarn`` RoPE are LongRoPE, whose original context is the top-level
    ``original_max_position_embeddings``. Partial rotary (``partial_rotary_factor``: Phi-4-mini)
    is read by :meth:`LlamaConfig.from_hf_config`, as for any family."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters")
    if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) in _LONGROPE_NAMES:
        rope = {**rope, "rope_type": "longrope", "original_max_position_embeddings":
                raw.get("original_max_position_embeddings", _ORIGINAL_CONTEXT)}
        raw = {**raw, "rope_parameters": rope, "rope_scaling": None}
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


def load_phi3_gguf(
    path: str | os.PathLike | GGUFFile, device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32, tp: Any = None,
) -> tuple[LlamaModel, Tokenizer]:
    """Model and tokenizer from the GGUF ``phi3`` file at ``path`` (or already opened), as
    :func:`~deft.model.gguf_loader.load_gguf` loads one; with ``tp``, this rank's shard.

    The context is capped at the sliding window, within which full attention is exact, and
    for LongRoPE files (``rope_factors_long``/``_short``: the 128k Phi-3 and Phi-3.5
    models) at the original context (as for a Hugging Face directory). Fused tensors whose
    shape disagrees with the metadata raise ``ValueError`` naming ``path`` and the tensor.
    """
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    return load_gguf(f, device, dtype, tp, adapt=partial(_gguf_config, f), permuted_qk=False,
                     block_names={**BLOCK_NAMES, **_GGUF_FUSED}, view=Phi3Tensors)


def _gguf_config(f: GGUFFile, config: LlamaConfig) -> LlamaConfig:
    """``config`` (read from ``f``'s metadata) capped at the sliding window, once ``f`` is
    known to hold fused tensors of the shapes it implies."""
    c = config
    rows = {"attn_qkv": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, "ffn_up": 2 * c.intermediate_size}
    for name, t in f.tensors.items():
        m = _GGUF_FUSED_NAME.fullmatch(name)
        if m and t.shape != (expected := (rows[m.group(1)], c.hidden_size)):
            raise ValueError(f"tensor {name!r} has shape {t.shape}, expected {expected} from the metadata")
    key = f"{f.metadata.get('general.architecture')}.attention.sliding_window"
    if key in f.metadata:
        window = int_at_least(f.metadata[key], key, 0)  # 0: none
    elif c.rope_scaling is not None and c.rope_scaling.kind == "longrope":
        window = 0  # the 128k models' windows lie past their original context
    else:
        window = _UNSTATED_WINDOW.get(c.max_position_embeddings, 0)
    if not window:
        return c
    return c.capped(window, "its sliding window")


PHI3 = Family("phi3", hf_model_types=("phi3",), gguf_architectures=("phi3",),
              load_hf=partial(load_hf, to_config=phi3_config, view=Phi3Tensors),
              load_gguf=load_phi3_gguf, tensor_parallel=True)
