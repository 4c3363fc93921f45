"""Load a model of a Llama-like family and its tokenizer from a Hugging Face model directory.

The directory holds ``config.json``, the weights as ``model.safetensors`` or shards listed
by ``model.safetensors.index.json``, and ``tokenizer.json`` (plus, optionally,
``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``). The
shards are memory-mapped and each tensor is read once, straight to its device and dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as _Backend
from tqdm import tqdm

from ..checks import is_int
from .config import LlamaConfig
from .llama import LlamaModel
from .sharding import LazyTensors, build_hf
from .tokenizer import Tokenizer, end_of_turn_ids

__all__ = ["Checkpoint", "load_hf", "read_json"]

# A family's view of a checkpoint's tensors under Llama's Hugging Face names (lazy: a Mapping).
TensorView = Callable[[LlamaConfig, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def read_json(path: str, required: bool = True) -> dict[str, Any]:
    """The JSON object in ``path`` (``{}`` for a missing optional file); errors name the file."""
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"{path}: not found")
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _shards(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: expected a 'weight_map' object")
        return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")


class Checkpoint(LazyTensors):
    """The tensors of a directory's safetensors shards, memory-mapped: each is read when
    asked for, straight to ``device`` and converted to ``dtype`` there; ``bar`` counts them."""

    def __init__(self, folder: str, device: torch.device | str, dtype: torch.dtype,
                 bar: tqdm | None = None) -> None:
        self.device, self.dtype, self.bar = torch.device(device), dtype, bar
        self._files: dict[str, Any] = {}  # tensor name -> its opened shard
        super().__init__(self._files)
        for shard in _shards(folder):
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"{shard}: listed in the index but not found")
            try:
                opened = safe_open(shard, framework="pt", device=str(self.device))
            except SafetensorError as exc:
                raise ValueError(f"{shard}: corrupt safetensors file ({exc})") from None
            self._files.update(dict.fromkeys(opened.keys(), opened))

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._files[name].get_tensor(name).to(self.dtype)
        if self.bar is not None:
            self.bar.update(1)
        return t

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of ``name``, read alone
        (a tensor-parallel rank's part)."""
        index = (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))
        t = self._files[name].get_slice(name)[index].to(self.device, self.dtype)
        if self.bar is not None:
            self.bar.update(1)
        return t


def _token_text(config: dict[str, Any], key: str, file: str) -> str | None:
    """A special token's text: a string, ``{"content": string}`` or absent."""
    value = config.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{file}: {key}: expected a token's text, got {value!r}")
    return text


def _ids(config: dict[str, Any], key: str, file: str) -> set[int]:
    """Token ids under ``key``: one id, a list of them or absent."""
    value = config.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"{file}: {key}: expected a token id or a list of them, got {value!r}")
    return {int(i) for i in ids}


def _chat_template(folder: str, tok_config: dict[str, Any]) -> str | None:
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as fh:
                return fh.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{jinja}: not UTF-8 text ({exc})") from None
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{os.path.join(folder, 'tokenizer_config.json')}: chat_template: expected "
                         f"a Jinja template string, got {type(template).__name__}")
    return template


def hf_tokenizer(folder: str, config: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (``config`` is its config.json)."""
    tok_file = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"{tok_file}: not found (only fast tokenizers are supported)")
    try:
        backend = _Backend.from_file(tok_file)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{tok_file}: invalid tokenizer ({exc})") from None
    tok_file, gen_file = (os.path.join(folder, f) for f in ("tokenizer_config.json", "generation_config.json"))
    tok_config, gen_config = read_json(tok_file, required=False), read_json(gen_file, required=False)
    bos, eos = _token_text(tok_config, "bos_token", tok_file), _token_text(tok_config, "eos_token", tok_file)
    eos_ids = (_ids(config, "eos_token_id", os.path.join(folder, "config.json"))
               | _ids(gen_config, "eos_token_id", gen_file))
    if eos is not None and backend.token_to_id(eos) is not None:
        eos_ids.add(backend.token_to_id(eos))
    special = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    return Tokenizer(backend, eos_ids | end_of_turn_ids(backend, special),
                     chat_template=_chat_template(folder, tok_config), bos_token=bos, eos_token=eos)


def load_hf(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    to_config: Callable[[Mapping[str, Any]], LlamaConfig] = LlamaConfig.from_hf_config,
    view: TensorView | None = None,
    tp: Any = None,
) -> tuple[LlamaModel, Tokenizer]:
    """Model and tokenizer from the Hugging Face model directory ``path``; with ``tp`` (a
    :class:`~deft.distributed.TPGroup`), this rank's shard, reading only its slices.

    A family passes ``to_config`` (its ``config.json`` to a :class:`LlamaConfig`) and
    ``view`` (its tensors under Llama's Hugging Face names) where it differs from Llama.
    Raises ``FileNotFoundError`` for missing files and ``ValueError`` naming the file for an
    unsupported model type or feature or corrupt/mismatched weights.
    """
    folder = os.fspath(path)
    config_file = os.path.join(folder, "config.json")
    raw = read_json(config_file)
    try:
        config = to_config(raw)
    except ValueError as exc:
        raise ValueError(f"{config_file}: {exc}") from None
    tokenizer = hf_tokenizer(folder, raw)  # before the slow part: fail fast
    with tqdm(desc=f"loading {os.path.basename(os.path.abspath(folder))}", unit="tensor",
              leave=False, disable=None) as bar:
        tensors: Mapping[str, torch.Tensor] = Checkpoint(folder, device, dtype, bar)
        bar.total = len(tensors)
        pair = ("lm_head.weight", "model.embed_tokens.weight")
        if (config.tie_word_embeddings and all(n in tensors for n in pair)
                and not torch.equal(*(tensors[n] for n in pair))):
            # As transformers does: a stored head that differs from the embedding is used, untied.
            warnings.warn(f"{folder}: tie_word_embeddings is true but the stored lm_head.weight "
                          "differs from model.embed_tokens.weight; using the stored head (untied), "
                          "as transformers does", UserWarning, stacklevel=2)
            config = dataclasses.replace(config, tie_word_embeddings=False)
        read_slice = tensors.read_slice
        if view is not None:  # slices are cut after reading, unless the view reads them itself
            tensors = view(config, tensors)
            read_slice = getattr(tensors, "read_slice", None)
        return build_hf(config, tensors, folder, dtype, device, tp, read_slice), tokenizer
