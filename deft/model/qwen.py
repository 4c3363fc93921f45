"""Qwen2 / Qwen2.5 and Qwen3: Llama's decoder with q/k/v biases (Qwen2) or per-head q/k
RMSNorm (Qwen3), from Hugging Face ``qwen2``/``qwen3`` directories and GGUF ``qwen2``/``qwen3``
files (llama.cpp keeps their q/k rows in rotate-half order)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

from .config import LlamaConfig
from .families import Family
from .gguf_loader import load_gguf
from .hf_loader import load_hf

__all__ = ["QWEN2", "QWEN3", "qwen2_config", "qwen3_config", "used_window"]


def used_window(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with its window only where ``use_sliding_window`` says it is used: Qwen2 and
    SmolLM3 checkpoints state ``sliding_window`` even when it is not."""
    return {**raw, "sliding_window": raw.get("sliding_window") if raw.get("use_sliding_window") else None}


def qwen2_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """A Qwen2/Qwen2.5 ``config.json`` as a :class:`LlamaConfig`: q/k/v biases, no o bias."""
    return dataclasses.replace(LlamaConfig.from_hf_config(used_window(raw)), qkv_bias=True)


def qwen3_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """A Qwen3 ``config.json`` as a :class:`LlamaConfig`: per-head q/k RMSNorm."""
    return dataclasses.replace(LlamaConfig.from_hf_config(used_window(raw)), qk_norm=True)


QWEN2 = Family(
    "qwen2", hf_model_types=("qwen2",), gguf_architectures=("qwen2",),
    load_hf=partial(load_hf, to_config=qwen2_config),
    load_gguf=partial(load_gguf, adapt=partial(dataclasses.replace, qkv_bias=True), permuted_qk=False),
    tensor_parallel=True)
QWEN3 = Family(
    "qwen3", hf_model_types=("qwen3",), gguf_architectures=("qwen3",),
    load_hf=partial(load_hf, to_config=qwen3_config),
    load_gguf=partial(load_gguf, adapt=partial(dataclasses.replace, qk_norm=True), permuted_qk=False),
    tensor_parallel=True)
