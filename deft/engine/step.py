"""A step as a value: everything one forward needs, built by the engine from its tree.

:class:`Step` holds the layout, each query's token id, position and K/V write slot, the
rows whose logits are wanted, the tokens that come from the device (the last step's
samples, when steps overlap) and the slot copies to apply first (rows that committing a
draft path moved). A :class:`~deft.engine.runner.ModelRunner` needs nothing else to run
it on its device, so the same step can go to several runners; only its device tokens are a
tensor of one device (a runner on another needs them there first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..cache import TreeKVCache
from ..layout import TreeLayout

__all__ = ["Feed", "Step", "build_step"]

_I = np.int64


class Step(NamedTuple):
    """One forward over ``layout``'s queries (query ``i`` is token ``i``)."""

    layout: TreeLayout
    token_ids: np.ndarray  # [n] int64; placeholders where ``device_tokens`` fill in
    positions: np.ndarray  # [n] int64
    write_slots: np.ndarray  # [n] int64: where each token's K/V is written
    logits_rows: np.ndarray  # [r] int64: the rows whose logits the step returns, in order
    # (values, moved): ``token_ids[moved[0]] = values[moved[1]]`` on the device
    device_tokens: tuple[torch.Tensor, np.ndarray] | None = None
    # (src, dst) slot arrays to copy, in order, in every layer before anything is written
    copies: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

    @property
    def num_queries(self) -> int:
        return self.token_ids.shape[0]


@dataclass
class Feed:
    """Tokens computed in the next step: appended to one node, one each to several leaves
    (a step's one-token items), or a draft tree."""

    nodes: list[int]  # [n] the node of each token's query
    kv_lens: np.ndarray  # [n] each query's query_kv_len
    tokens: np.ndarray  # [n]
    positions: np.ndarray  # [n]
    slots: np.ndarray  # [n]
    logits: str  # "last", "all" or "none"
    source: int = -1  # >= 0: the one token is this row of the step's device tokens


def build_step(cache: TreeKVCache, feeds: list[Feed], values: torch.Tensor | None,
               copies: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
               ) -> tuple[Step, list[tuple[int, int]]]:
    """The step computing ``feeds`` (live nodes of ``cache``), and per feed the range of
    the step's logits rows that are its own. ``values``: the device tokens that feeds with a
    ``source`` read."""
    rows: list[int] = []
    bounds, moved, n = [], [], 0
    for f in feeds:
        k, start = len(f.nodes), len(rows)
        if f.logits == "last":
            rows.append(n + k - 1)
        elif f.logits == "all":
            rows += range(n, n + k)
        bounds.append((start, len(rows)))
        if f.source >= 0:
            moved.append((n, f.source))
        n += k
    layout = cache.layout_of([x for f in feeds for x in f.nodes],
                             np.concatenate([f.kv_lens for f in feeds]))
    tokens, positions, slots = (np.concatenate([getattr(f, a) for f in feeds])
                                for a in ("tokens", "positions", "slots"))
    device_tokens = None if not moved else (values, np.array(moved, _I).T.copy())
    return Step(layout, tokens, positions, slots, np.array(rows, _I), device_tokens,
                copies), bounds
