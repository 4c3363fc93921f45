"""A :class:`Tokenizer` from GGUF metadata.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, ...)
are rebuilt with ``tokenizers`` directly, splitting text the way llama.cpp does for the
file's ``tokenizer.ggml.pre``. SentencePiece vocabularies (``"llama"``: Llama 2, Mistral)
are converted by ``transformers``, which must then be installed.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, NoReturn

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from ..checks import is_int
from .tokenizer import Tokenizer, end_of_turn_ids

__all__ = ["tokenizer_from_gguf", "PRE_TOKENIZERS"]

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _llama3() -> pre_tokenizers.PreTokenizer:
    return _split_bytes(_LLAMA3_SPLIT)


def _qwen2() -> pre_tokenizers.PreTokenizer:
    return _split_bytes(_QWEN2_SPLIT)


# tokenizer.ggml.pre -> pre-tokenizer (llama.cpp's regexes for these names).
PRE_TOKENIZERS = {
    "default": _gpt2, "gpt2": _gpt2, "gpt-2": _gpt2,
    "smollm": _digits_gpt2, "starcoder": _digits_gpt2, "refact": _digits_gpt2,
    "llama3": _llama3, "llama-v3": _llama3, "llama-bpe": _llama3, "smaug-bpe": _llama3,
    "qwen2": _qwen2,
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def tokenizer_from_gguf(metadata: Mapping[str, Any], path: str) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata (``path`` names it in errors)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    _check_types(metadata, path)
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", ())]
    if kind == "gpt2":
        try:
            backend = _byte_level_bpe(metadata, types, path)
        except ValueError:
            raise
        except Exception as exc:  # tokenizers raises a bare Exception for a vocabulary it rejects
            raise ValueError(f"{path}: invalid tokenizer ({exc})") from None
    elif kind == "llama":
        backend = _sentencepiece_via_transformers(path)
    else:
        raise ValueError(f"{path}: tokenizer.ggml.model: expected 'gpt2' or 'llama', got {kind!r}")
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL]

    def text(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eos = {int(metadata[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in metadata}
    return Tokenizer(
        backend,
        eos | end_of_turn_ids(backend, special),
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=text("bos"),
        eos_token=text("eos"),
    )


def _check_types(metadata: Mapping[str, Any], path: str) -> None:
    """``ValueError`` naming ``path`` and the key for tokenizer metadata of the wrong type."""
    def fail(key: str, expected: str) -> NoReturn:
        got = repr(metadata[key])
        raise ValueError(f"{path}: {key}: expected {expected}, got {got[:60] + '...' if len(got) > 60 else got}")

    for key in ("model", "pre"):
        if not isinstance(metadata.get(f"tokenizer.ggml.{key}", ""), str):
            fail(f"tokenizer.ggml.{key}", "a string")
    if not isinstance(metadata.get("tokenizer.chat_template", ""), str):
        fail("tokenizer.chat_template", "a string")
    if not isinstance(metadata.get("tokenizer.ggml.add_bos_token", False), bool):
        fail("tokenizer.ggml.add_bos_token", "a bool")
    for key in ("bos", "eos", "eot", "eom"):
        if not is_int(metadata.get(f"tokenizer.ggml.{key}_token_id", 0)):
            fail(f"tokenizer.ggml.{key}_token_id", "an integer")
    tokens = metadata["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        fail("tokenizer.ggml.tokens", "a list of strings")
    merges = metadata.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        fail("tokenizer.ggml.merges", "a list of 'left right' strings")
    types = metadata.get("tokenizer.ggml.token_type", [])
    if not (isinstance(types, np.ndarray) and types.dtype.kind in "iu"
            or isinstance(types, list) and all(is_int(t) for t in types)):
        fail("tokenizer.ggml.token_type", "a list of integers")


def _byte_level_bpe(metadata: Mapping[str, Any], types: list[int], path: str) -> _Backend:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre: expected one of {', '.join(sorted(PRE_TOKENIZERS))}, got {pre!r}"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
    backend = _Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        if not 0 <= bos < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.bos_token_id: expected < {len(tokens)}, got {bos}")
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return backend


def _sentencepiece_via_transformers(path: str) -> _Backend:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"{path}: a SentencePiece GGUF tokenizer needs transformers (pip install transformers)"
        ) from None
    folder, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name).backend_tokenizer
