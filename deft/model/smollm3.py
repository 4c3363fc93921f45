"""SmolLM3: Llama's decoder whose every fourth layer (``no_rope_layers``' zeros) applies no
RoPE to q and k, from Hugging Face ``smollm3`` directories (Llama's tensor names)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

from .config import LlamaConfig
from .families import Family
from .hf_loader import load_hf
from .qwen import used_window

__all__ = ["SMOLLM3", "smollm3_config"]


def smollm3_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """A SmolLM3 ``config.json`` as a :class:`LlamaConfig`, read as transformers' SmolLM3Config
    reads it: ``no_rope_layers`` holds a 1 per layer with RoPE, a 0 per layer without; absent,
    every ``no_rope_layer_interval``-th layer (default 4) has none. A window is used only with
    ``use_sliding_window``."""
    layers = raw.get("num_hidden_layers")
    flags = raw.get("no_rope_layers")
    if flags is None and isinstance(layers, int):
        interval = raw.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"no_rope_layer_interval: expected a positive integer, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers: expected a 0 or 1 per layer ({layers}), got {flags!r}")
    return dataclasses.replace(LlamaConfig.from_hf_config(used_window(raw)),
                               nope_layers=tuple(i for i, f in enumerate(flags) if not f))


SMOLLM3 = Family("smollm3", hf_model_types=("smollm3",),
                 load_hf=partial(load_hf, to_config=smollm3_config), tensor_parallel=True)
