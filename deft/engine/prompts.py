"""Prompts as the strategies take them: text or token ids, one prompt or a batch."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..checks import is_int
from ..layout import as_index_array
from .core import TreeEngine

__all__ = ["Prompt", "as_prompts", "common_prefix"]

Prompt = str | Sequence[int]


def _check_not_bytes(p: object, name: str) -> None:
    if isinstance(p, (bytes, bytearray)):
        raise TypeError(f"{name}: expected text or token ids, got {type(p).__name__} "
                        "(decode bytes to text first)")


def as_prompts(prompts: Prompt | Sequence[Prompt], engine: TreeEngine) -> list[list[int]]:
    """A batch of token-id prompts from one prompt or many (text is encoded).

    Token ids may be a list or a 1-D numpy/torch integer array (a 2-D array is a batch).
    """
    _check_not_bytes(prompts, "prompts")
    arrays = (np.ndarray, torch.Tensor)
    if isinstance(prompts, arrays):
        prompts = list(prompts) if prompts.ndim == 2 else [prompts]
    elif isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and all(is_int(t) for t in prompts)
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts: expected a prompt or a non-empty list of prompts, got {prompts!r}")
    out = []
    for i, p in enumerate(prompts):
        _check_not_bytes(p, f"prompts[{i}]")
        if isinstance(p, arrays):
            p = as_index_array(p, f"prompts[{i}]").tolist()
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else p
        if not isinstance(ids, Sequence) or not ids or not all(is_int(t) for t in ids):
            raise ValueError(f"prompts[{i}]: expected text or a non-empty list of token ids, got {p!r}")
        if len(ids) > engine.max_positions:
            raise ValueError(f"prompts[{i}]: the prompt has {len(ids)} tokens, more than "
                             f"{engine.context_text}")
        out.append([int(t) for t in ids])
    return out


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None, start: int = 0) -> int:
    """Where token sequences ``a`` and ``b`` first differ within their first ``limit`` tokens
    (all by default), given that they agree before ``start``."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
