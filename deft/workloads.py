"""Tree workloads as layouts: synthetic shapes and the recorded DeFT/Medusa workloads.

The recorded files live outside the repository (``../shared/workloads`` beside the
checkout, or a directory named by ``DEFT_WORKLOADS`` or passed explicitly); they are
read, never copied.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from .layout import TreeLayout
from .recorded import load_reasoning_records

__all__ = [
    "few_shot_layout",
    "fan_layout",
    "medusa_layout",
    "reasoning_layout",
    "shuffle_slots",
]


def shuffle_slots(layout: TreeLayout, seed: int = 0, num_slots: int | None = None) -> TreeLayout:
    """The same trees with each token moved to a random distinct slot in ``[0, num_slots)``."""
    rng = np.random.default_rng(seed)
    n = max(layout.num_tokens, num_slots or 0)
    slots = rng.permutation(n)[: layout.num_tokens]
    return TreeLayout(layout.parents, layout.node_kv_indptr, slots, layout.query_nodes,
                      layout.query_kv_lens)


def few_shot_layout(prompt_len: int, branches: int, branch_len: int) -> TreeLayout:
    """A shared prompt with ``branches`` children of ``branch_len`` tokens; one query per branch
    (its newest token, which sees the prompt and its whole branch)."""
    parents = [-1] + [0] * branches
    lens = [prompt_len] + [branch_len] * branches
    return TreeLayout.from_node_lengths(parents, lens, list(range(1, branches + 1)))


def fan_layout(prompt_len: int, leaves: int) -> TreeLayout:
    """A prompt with ``leaves`` one-token children, each a query (a flat speculative tree)."""
    return few_shot_layout(prompt_len, leaves, 1)


def medusa_layout(choices: Sequence[Sequence[int]], prompt_len: int) -> TreeLayout:
    """A prompt node, then the draft tree: a root token and one 1-token node per choice path.

    Every draft token is a query that sees the prompt, its ancestors and itself.
    """
    index = {(): 1}
    parents = [-1, 0]
    for path in sorted((tuple(p) for p in choices), key=lambda p: (len(p), p)):
        if path[:-1] not in index:
            raise ValueError(f"choices: path {list(path)} has no parent path {list(path[:-1])}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
    lens = [prompt_len] + [1] * (len(parents) - 1)
    return TreeLayout.from_node_lengths(parents, lens, list(range(1, len(parents))))


def reasoning_layout(path: str | os.PathLike[str], record: int | None = None,
                     iteration: int | None = None) -> TreeLayout:
    """A snapshot of a recorded Graph-of-Thoughts tree at one decoding iteration.

    Nodes that started by ``iteration`` hold the tokens decoded so far; finished nodes with
    no active descendant are pruned; each active node has one query (its newest token).
    By default the (record, iteration) with the most active nodes is taken.
    """
    records = load_reasoning_records(path)
    if not records:
        raise ValueError(f"{path}: no complete records")
    if record is None or iteration is None:
        best = (-1, 0, 0)
        for r_i, rec in enumerate(records):
            if record is not None and r_i != record:
                continue
            nodes = rec["data"].values()
            starts = np.array([n["start"] for n in nodes if n["id"] != 0])
            ends = np.array([n["end"] for n in nodes if n["id"] != 0])
            events = np.concatenate([starts, ends + 1])
            delta = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
            order = np.lexsort((delta, events))  # ends (-1) before starts at equal times
            active = np.cumsum(delta[order])
            k = int(np.argmax(active))
            if active[k] > best[0]:
                best = (int(active[k]), r_i, int(events[order][k]))
        _, record, iteration = best if iteration is None else (0, best[1], iteration)
    return _snapshot(records[record]["data"], iteration)


def _snapshot(data: dict[str, dict[str, Any]], it: int) -> TreeLayout:
    nodes = {int(k): v for k, v in data.items()}
    parent = {c: n for n, v in nodes.items() for c in v["children"]}
    active = [n for n, v in nodes.items() if n != 0 and v["start"] <= it <= v["end"]]
    keep: set[int] = set()
    for n in active:
        while n not in keep:
            keep.add(n)
            if n not in parent:
                break
            n = parent[n]
    keep.add(0)
    ids = sorted(keep)
    dense = {n: i for i, n in enumerate(ids)}
    parents = [dense[parent[n]] if n in parent else -1 for n in ids]
    lens = [
        nodes[n]["value"] if n == 0 else min(it, nodes[n]["end"]) - nodes[n]["start"] + 1
        for n in ids
    ]
    return TreeLayout.from_node_lengths(parents, lens, [dense[n] for n in active])
