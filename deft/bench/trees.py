"""The benchmark trees, by name. Recorded ones need the workloads directory."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ..layout import TreeLayout
from ..recorded import load_medusa_choices
from ..workloads import fan_layout, few_shot_layout, medusa_layout, reasoning_layout

__all__ = ["WORKLOADS", "GPU_SUITE", "CPU_SUITE", "PLAN_SUITE", "build", "random_forest_layout"]


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
    return lambda d: medusa_layout(
        load_medusa_choices(d / "deft" / "speculative" / f"APPS_tree_size{size}.json"), 4096
    )


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
    "forest 1000 nodes 100k": ("forest", lambda d: random_forest_layout()),
    "fan 4000 x256": ("speculative", lambda d: fan_layout(4000, 256)),
}

GPU_SUITE = [n for n in WORKLOADS if not n.startswith(("forest", "fan 4000", "medusa mc_sim"))]
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
