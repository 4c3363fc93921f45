"""The benchmark trees: layout builders for synthetic and recorded tree shapes, and the named
trees the suites run (``WORKLOADS``; recorded ones need the workloads directory).

The recorded files live outside the repository (``../shared/workloads`` beside the checkout, or
a directory named by ``DEFT_WORKLOADS`` or passed explicitly) and are read by
:mod:`deft.recorded`, never copied.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from deft.layout import TreeLayout
from deft.recorded import load_medusa_choices, load_reasoning_records

__all__ = [
    "WORKLOADS", "GPU_SUITE", "CPU_SUITE", "PLAN_SUITE", "build", "available",
    "few_shot_layout", "fan_layout", "medusa_parents", "apps_tree", "medusa_layout", "reasoning_layout", "random_forest_layout",
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


def medusa_parents(choices: Sequence[Sequence[int]]) -> list[int]:
    """Parents of a Medusa draft tree: a root token (``-1``), then one token per choice path
    (shortest first), each a child of its path without the last choice."""
    index = {(): 0}
    parents = [-1]
    for path in sorted((tuple(p) for p in choices), key=lambda p: (len(p), p)):
        if path[:-1] not in index:
            raise ValueError(f"choices: path {list(path)} has no parent path {list(path[:-1])}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
    return parents


def apps_tree(size: int, workloads: Path) -> list[list[int]]:
    """The recorded Medusa choices ``APPS_tree_size{size}``."""
    return load_medusa_choices(workloads / "deft" / "speculative" / f"APPS_tree_size{size}.json")


def medusa_layout(choices: Sequence[Sequence[int]], prompt_len: int) -> TreeLayout:
    """A prompt node, then the draft tree: a root token and one 1-token node per choice path.

    Every draft token is a query that sees the prompt, its ancestors and itself.
    """
    parents = [-1] + [p + 1 for p in medusa_parents(choices)]
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



def random_forest_layout(num_nodes: int = 1000, num_tokens: int = 100_000, seed: int = 0) -> TreeLayout:
    """A random forest of 4 roots; every leaf is a query."""
    rng = np.random.default_rng(seed)
    parents = np.full(num_nodes, -1, np.int64)
    for i in range(4, num_nodes):
        parents[i] = rng.integers(0, i)
    lens = rng.integers(1, 200, num_nodes)
    lens = np.maximum(1, lens * num_tokens // lens.sum())
    leaves = np.flatnonzero(np.bincount(parents[parents >= 0], minlength=num_nodes) == 0)
    return TreeLayout.from_node_lengths(parents, lens, leaves)


def _medusa(size: int) -> Callable[[Path], TreeLayout]:
    return lambda d: medusa_layout(apps_tree(size, d), 4096)


def _reasoning(task: str) -> Callable[[Path], TreeLayout]:
    return lambda d: reasoning_layout(d / "deft" / "reasoning" / f"{task}.json")


# name -> (family, builder(workloads_dir) -> layout)
WORKLOADS: dict[str, tuple[str, Callable[[Path], TreeLayout]]] = {
    **{f"few-shot b={b}": ("few-shot", lambda d, b=b: few_shot_layout(4000, b, 200)) for b in (20, 30, 50)},
    **{f"speculative t={t}": ("speculative", lambda d, t=t: fan_layout(2000, t)) for t in (32, 64, 128, 256)},
    **{f"medusa APPS-{s}": ("medusa", _medusa(s)) for s in (32, 64, 128, 256)},
    "medusa mc_sim_7b_63": ("medusa", lambda d: medusa_layout(
        load_medusa_choices(d / "medusa" / "mc_sim_7b_63.json"), 4096)),
    **{f"reasoning {t}": ("reasoning", _reasoning(t)) for t in ("sorting128ToT", "docmergeToT", "keywordToT")},
    "long prompt 20k x64": ("long-prompt", lambda d: fan_layout(20_000, 64)),
    **{f"long prompt {k}k x{b}": ("long-prompt", lambda d, k=k, b=b: fan_layout(k * 1024, b))
       for k in (32, 128) for b in (16, 64)},
    "forest 1000 nodes 100k": ("forest", lambda d: random_forest_layout()),
    "prompts 32 x 1000": ("forest", lambda d: TreeLayout.from_node_lengths(
        [-1] * 32, [1000] * 32, list(range(32)))),
    "fan 4000 x256": ("speculative", lambda d: fan_layout(4000, 256)),
}

GPU_SUITE = [n for n in WORKLOADS
             if not n.startswith(("forest", "prompts", "fan 4000", "medusa mc_sim",
                                  "long prompt 128k"))]
CPU_SUITE = ["few-shot b=20", "medusa mc_sim_7b_63", "medusa APPS-64"]
PLAN_SUITE = ["fan 4000 x256", "forest 1000 nodes 100k", "few-shot b=50", "speculative t=256",
              "medusa APPS-256", "reasoning docmergeToT", "long prompt 20k x64"]


def build(name: str, workloads: Path | None) -> TreeLayout:
    """The layout of workload ``name``; ``FileNotFoundError`` if it is recorded and absent."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {name!r}")
    family, builder = WORKLOADS[name]
    if workloads is None and family in ("medusa", "reasoning"):
        raise FileNotFoundError(f"{name} needs the recorded workloads directory")
    return builder(workloads)  # type: ignore[arg-type]


def available(names: Sequence[str], workloads: Path | None) -> Iterator[tuple[str, TreeLayout]]:
    """``(name, layout)`` of each workload in ``names`` that can be built (recorded ones are
    skipped when the workloads directory is absent)."""
    for name in names:
        try:
            yield name, build(name, workloads)
        except FileNotFoundError:
            continue
