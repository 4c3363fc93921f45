"""Gemma 3: Llama's decoder with Gemma's ``(1 + w)`` RMSNorms before and after attention
and MLP, GeGLU, embeddings scaled by ``sqrt(hidden_size)``, per-head q/k norms, a softmax
scale of ``query_pre_attn_scalar ** -0.5`` and a RoPE of its own for the sliding-window
layers. Hugging Face ``gemma3_text`` directories (``Gemma3ForCausalLM``), the language model
of ``gemma3`` ones (``Gemma3ForConditionalGeneration``: text in, text out; the vision tower is
not read) and GGUF ``gemma3`` files (llama.cpp's conventions: norm weights stored as ``1 + w``,
every 6th layer full).

The engine has no windowed attention; within the window a sliding layer sees every token,
so the context is capped to ``sliding_window`` (exact, never approximated). Gemma 2 is
refused by name.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

import torch

from ..checks import positive_int
from .config import LlamaConfig, rope_from_hf
from .families import Family
from .gguf_file import GGUFFile
from .gguf_loader import BLOCK_NAMES, load_gguf
from .hf_loader import load_hf
from .llama import LlamaModel
from .sharding import LazyTensors
from .tokenizer import Tokenizer

__all__ = ["GEMMA2_REFUSED", "GEMMA3", "GEMMA3_MULTIMODAL", "Gemma3TextTensors", "LAYER_TYPES",
           "gemma3_config", "gemma3_gguf_config", "gemma3_multimodal_config", "load_gemma3_gguf"]

LAYER_TYPES = ("sliding_attention", "full_attention")
# Gemma3TextConfig's defaults (a config.json may leave them out: the multimodal checkpoints'
# text_config states only what differs from them).
_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
             "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
             "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256,
             "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}
# Where a multimodal checkpoint keeps the language model's tensors -> Gemma3ForCausalLM's
# names (the first older transformers' files, the second newer ones).
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
# llama.cpp's names of a Gemma 3 block's norms (the others are Llama's).
_GGUF_BLOCKS = {**BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# What llama.cpp fixes for a Gemma 3 GGUF rather than reading it: with a sliding window, every
# 6th layer full and the others sliding with RoPE theta 10000, unscaled; the softmax scale of
# head_dim, or of hidden_size / heads for the 62-layer 27B model.
_GGUF_PATTERN, _GGUF_LOCAL_THETA, _GGUF_27B_LAYERS = 6, 10_000.0, 62


def _layer_types(raw: Mapping[str, Any], layers: int) -> list[str]:
    """Each layer's ``layer_types`` entry; older configs state a ``sliding_window_pattern``
    (every n-th layer full, the others sliding)."""
    types = raw.get("layer_types")
    if types is None:
        n = positive_int(raw.get("sliding_window_pattern", 6), "sliding_window_pattern")
        return ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types: expected {layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
    return types


def _ropes(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The RoPE objects of the full and the sliding layers, as transformers reads them: a
    per-layer-type ``rope_parameters``, or the older ``rope_theta`` (full),
    ``rope_local_base_freq`` (sliding) and ``rope_scaling`` (full)."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or not set(params) <= set(LAYER_TYPES):
        raise ValueError(f"rope_parameters: expected an object of {', '.join(LAYER_TYPES)}, got {params!r}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta") or 1_000_000.0)
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", raw.get("rope_local_base_freq") or 10_000.0)
    return full, local


def gemma3_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """A Gemma 3 text ``config.json`` as a :class:`LlamaConfig`; soft-capping and
    bidirectional attention are refused by name."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ValueError(f"{key}: expected null (tanh soft-capping cannot be exact in the tree "
                             f"kernel's softmax), got {raw[key]!r}")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: expected false (causal decoding), got "
                         f"{raw['use_bidirectional_attention']!r}")
    raw = {**_DEFAULTS, **raw}
    full, local = _ropes(raw)
    config = LlamaConfig.from_hf_config({**raw, "hidden_act": raw["hidden_activation"],
                                         "rope_parameters": full, "rope_theta": full["rope_theta"],
                                         "sliding_window": None})
    sliding = tuple(i for i, t in enumerate(_layer_types(raw, config.num_layers))
                    if t == "sliding_attention")
    if sliding:  # within the window, a sliding layer's attention is full attention
        config = config.capped(positive_int(raw["sliding_window"], "sliding_window"), "its sliding window")
    theta, scaling = rope_from_hf(local)
    return dataclasses.replace(
        config, qk_norm=True, norm_plus_one=True,
        sandwich_norms=True, embed_scale=config.hidden_size ** 0.5,
        query_pre_attn_scalar=raw["query_pre_attn_scalar"], local_rope_theta=theta,
        local_rope_scaling=scaling, local_rope_layers=sliding)


def gemma3_multimodal_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """The language model of a multimodal Gemma 3 ``config.json`` (its ``text_config``)."""
    text = raw.get("text_config") or {}
    if not isinstance(text, Mapping) or text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ValueError(f"text_config: expected a gemma3_text configuration, got {text!r}")
    return gemma3_config({**text, "tie_word_embeddings": raw.get(
        "tie_word_embeddings", text.get("tie_word_embeddings", True))})


class Gemma3TextTensors(LazyTensors):
    """The language model's tensors of a multimodal Gemma 3 checkpoint under
    ``Gemma3ForCausalLM``'s names; the vision tower and projector are left out."""

    def __init__(self, config: LlamaConfig, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._names: dict[str, str] = {}  # ours -> the checkpoint's
        super().__init__(self._names)
        for name in tensors:
            for prefix, ours in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    self._names[ours + name[len(prefix):]] = name
                    break

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[self._names[name]]

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows or columns ``[start, stop)`` along ``dim`` of tensor ``name``, read alone (a
        rank's shard, as :meth:`~deft.model.hf_loader.Checkpoint.read_slice`)."""
        return self._tensors.read_slice(self._names[name], dim, start, stop)


def gemma3_gguf_config(metadata: Mapping[str, Any], config: LlamaConfig) -> LlamaConfig:
    """A Gemma 3 GGUF's :class:`LlamaConfig`: ``config`` (read from the keys llama.cpp's
    architectures share) with what llama.cpp reads or fixes for ``gemma3``."""
    arch = metadata.get("general.architecture")
    softcap = metadata.get(f"{arch}.final_logit_softcapping")
    if softcap:
        raise ValueError(f"{arch}.final_logit_softcapping: expected none (tanh soft-capping cannot "
                         f"be exact in the tree kernel's softmax), got {softcap!r}")
    window = metadata.get(f"{arch}.attention.sliding_window") or 0
    sliding = tuple(i for i in range(config.num_layers) if (i + 1) % _GGUF_PATTERN) if window else ()
    if sliding:  # within the window, a sliding layer's attention is full attention
        config = config.capped(positive_int(window, f"{arch}.attention.sliding_window"), "its sliding window")
    scalar = (config.hidden_size // config.num_heads if config.num_layers == _GGUF_27B_LAYERS
              else config.head_dim)
    return dataclasses.replace(
        config, qk_norm=True, norm_plus_one=True,
        sandwich_norms=True, hidden_act="gelu_pytorch_tanh", embed_scale=config.hidden_size ** 0.5,
        query_pre_attn_scalar=scalar, local_rope_theta=_GGUF_LOCAL_THETA, local_rope_layers=sliding)


def load_gemma3_gguf(f: GGUFFile, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     tp: Any = None) -> tuple[LlamaModel, Tokenizer]:
    """Model and tokenizer of the opened Gemma 3 GGUF ``f`` (see :func:`~.gguf_loader.load_gguf`)."""
    return load_gguf(f, device, dtype, tp, adapt=partial(gemma3_gguf_config, f.metadata),
                     permuted_qk=False, block_names=_GGUF_BLOCKS, norm_offset=1.0)


GEMMA3 = Family("gemma3_text", hf_model_types=("gemma3_text",), gguf_architectures=("gemma3",),
                load_hf=partial(load_hf, to_config=gemma3_config), load_gguf=load_gemma3_gguf,
                tensor_parallel=True)
GEMMA3_MULTIMODAL = Family("gemma3", hf_model_types=("gemma3",), load_hf=partial(
    load_hf, to_config=gemma3_multimodal_config, view=Gemma3TextTensors), tensor_parallel=True)

# Why the loader refuses Gemma 2 (see :func:`~deft.model.families.refuse`).
GEMMA2_REFUSED = "Gemma 2: its attention-logit soft-capping cannot be exact in the tree kernel's softmax"
