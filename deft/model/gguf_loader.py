"""Load a model of a Llama-like family and its tokenizer from a GGUF file (dequantised to
``dtype``)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .config import LlamaConfig
from .gguf_file import GGUFFile
from .gguf_tokenizer import tokenizer_from_gguf
from .hf_loader import TensorView
from .llama import LlamaModel
from .sharding import LazyTensors, build_hf
from .tokenizer import Tokenizer

__all__ = ["BLOCK_NAMES", "load_gguf"]

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp's per-block tensor names -> Llama's Hugging Face names
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that set RoPE's frequencies, not weights: Llama 3.1's, and LongRoPE's past and within
# the original context
_ROPE_FREQS, _LONG_FACTORS, _SHORT_FACTORS = ("rope_freqs.weight", "rope_factors_long.weight",
                                              "rope_factors_short.weight")
_ROPE_TENSORS = (_ROPE_FREQS, _LONG_FACTORS, _SHORT_FACTORS)


def _hf_name(name: str, blocks: Mapping[str, str]) -> str | None:
    """The Hugging Face name of a GGUF tensor (``blocks``: GGUF block tensor kind -> Hugging
    Face module), or ``None`` if it is not a weight of the model."""
    m = _BLOCK.fullmatch(name)
    if m:
        block, kind, suffix = m.groups()
        return f"model.layers.{block}.{blocks[kind]}.{suffix}" if kind in blocks else None
    base, _, suffix = name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{suffix}" if base in _GLOBAL_NAMES else None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for interleaved RoPE: back to rotate-half ``[rows, ...]``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str | os.PathLike | GGUFFile, device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32, tp: Any = None, *,
    adapt: Callable[[LlamaConfig], LlamaConfig] | None = None, permuted_qk: bool = True,
    block_names: Mapping[str, str] = BLOCK_NAMES, norm_offset: float = 0.0,
    view: TensorView | None = None,
) -> tuple[LlamaModel, Tokenizer]:
    """Model and tokenizer from the GGUF file at ``path`` (or already opened); with ``tp``
    (a :class:`~deft.distributed.TPGroup`), this rank's shard (of a split tensor, only the
    rank's rows are dequantised, and its columns where they fall on quantisation blocks).

    A family passes ``adapt`` (the config read from the metadata, its flags set and checked),
    ``permuted_qk=False`` where llama.cpp's converter keeps q/k rows in rotate-half order
    (it permutes them only for its ``llama`` architecture), and where its tensors differ
    from Llama's, ``block_names`` (GGUF block tensor kinds -> Hugging Face modules, e.g. a
    fused one), ``norm_offset`` (what the converter added to every norm weight, Gemma's
    ``1 + w``: it is subtracted) and ``view`` (as for :func:`~deft.model.hf_loader.load_hf`).
    A LongRoPE file (``rope_factors_long``/``_short``) is read with its short factors and
    its context capped at the original one (see
    :meth:`~deft.model.config.LlamaConfig.from_gguf_metadata`). Raises
    ``FileNotFoundError`` for a missing file and ``ValueError`` naming ``path`` for a
    corrupt file, an unsupported architecture, tokenizer or quantisation type.
    """
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    path = f.path
    try:
        longrope = _LONG_FACTORS in f.tensors or _SHORT_FACTORS in f.tensors
        if longrope and _SHORT_FACTORS not in f.tensors:
            raise ValueError(f"tensor {_SHORT_FACTORS!r}: missing (LongRoPE's factors within the "
                             "original context)")
        config = LlamaConfig.from_gguf_metadata(
            f.metadata, tie_word_embeddings="output.weight" not in f.tensors,
            short_factor=_factors(f, _SHORT_FACTORS) if longrope else None,
        )
        if _ROPE_FREQS in f.tensors:
            config = dataclasses.replace(config, rope_freq_factors=_factors(f, _ROPE_FREQS))
        if adapt is not None:
            config = adapt(config)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    unknown = sorted(n for n in f.tensors if n not in _ROPE_TENSORS and _hf_name(n, block_names) is None)
    if unknown:
        raise ValueError(f"{path}: unsupported tensors for a {f.metadata.get('general.architecture')} "
                         f"model: {unknown[:3]}")
    tokenizer = tokenizer_from_gguf(f.metadata, path)  # before the slow part: fail fast
    tensors: Mapping[str, torch.Tensor] = _Tensors(f, config, permuted_qk, block_names, norm_offset)
    if view is not None:
        tensors = view(config, tensors)
    return build_hf(config, tensors, path, dtype, device, tp,
                    getattr(tensors, "read_slice", None)), tokenizer


def _factors(f: GGUFFile, name: str) -> tuple[float, ...]:
    """The values of ``f``'s RoPE factor tensor ``name``."""
    return tuple(f.dequantize(name).reshape(-1).tolist())


class _Tensors(LazyTensors):
    """A GGUF file's weights under their Hugging Face names, dequantised when read (q and k
    rows back in rotate-half order where the converter permuted them, ``norm_offset`` taken
    off the norm weights)."""

    def __init__(self, f: GGUFFile, config: LlamaConfig, permuted_qk: bool,
                 block_names: Mapping[str, str], norm_offset: float) -> None:
        self.f, self.config, self.permuted_qk, self.norm_offset = f, config, permuted_qk, norm_offset
        self.names = {_hf_name(n, block_names): n for n in f.tensors if n not in _ROPE_TENSORS}
        super().__init__(self.names)

    def __getitem__(self, hf: str) -> torch.Tensor:
        return self.read_slice(hf, None, 0, None)

    def read_slice(self, hf: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        """Rows or columns ``[start, stop)`` along ``dim`` of tensor ``hf`` (all of it when
        ``dim`` is None), dequantised alone where the file allows (a rank's shard, as
        :meth:`~deft.model.hf_loader.Checkpoint.read_slice`)."""
        name, c = self.names[hf], self.config
        heads = 0
        if self.permuted_qk and name.startswith("blk.") and (".attn_q." in name or ".attn_k." in name):
            heads = c.num_heads if ".attn_q." in name else c.num_kv_heads
            rows = self.f.tensors[name].shape[0]
            if rows != heads * c.head_dim:
                raise ValueError(f"{self.f.path}: tensor {name!r} has {rows} rows, expected "
                                 f"{heads * c.head_dim} ({heads} heads x head_dim {c.head_dim})")
        if heads and dim == 0 and (start % c.head_dim or (stop or rows) % c.head_dim):
            return self.read_slice(hf, None, 0, None)[start:stop]  # not whole heads
        w = self.f.dequantize(name, dim, start, stop)
        if heads:  # the heads of the rows read
            w = _unpermute(w, w.shape[0] // c.head_dim)
        if self.norm_offset and hf.endswith("norm.weight"):
            w = w - np.float32(self.norm_offset)
        return torch.from_numpy(w)

