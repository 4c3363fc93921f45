"""The partial kernel's builds on the engine's own draft trees, each graph-safe step timed (GPU).

A benchmark tree holds every token in consecutive slots; in the engine a draft tree's tokens
land in the pool's pages wherever the cache puts them, and the kernel gathers them. This
builds each tree in a :class:`~deft.engine.TreeEngine` (random Llama-3-8B-shaped weights, all
32 layers, so each layer's K/V is its own pool buffer), takes the padded layout its graph
bucket planned, and times a 32-layer graph-safe attention step of it over the pool, reserved
for each build: ``default``, ``light`` (uncapped, coarsened for the programs it keeps) and
``light, same tiles`` (uncapped, the default's tiles). Also prints the build the tree asks for
(``TreeAttention.build``). Trees: 64 one-token leaves on a 2,000-token prompt, and the Medusa
APPS-64 and APPS-128 draft trees on a 4,000-token prompt (docs/decisions.md, "The register
cap stays, but for steps of few programs").

Usage: ``python tools/engine_builds.py`` (the Medusa trees need the recorded
workloads, ``$DEFT_WORKLOADS``, else ``../shared/workloads``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable
from _usage import args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.attention_gpu import time_us  # noqa: E402
from benchmarks.trees import apps_tree, medusa_parents  # noqa: E402
from deft import TreeAttention  # noqa: E402
from deft.engine import TreeEngine  # noqa: E402
from deft.engine.graphs import StepGraphs  # noqa: E402
from deft.layout import TreeLayout  # noqa: E402
from deft.model.synthetic import RandomSpec, byte_tokenizer, random_model  # noqa: E402
from deft.ops import Capacity  # noqa: E402
from deft.ops.triton import backend  # noqa: E402
from deft.recorded import workloads_dir  # noqa: E402

LIGHT = backend.light_config
BUILDS: dict[str, tuple[str, Callable]] = {  # label: (reserved build, its light config)
    "default": ("default", LIGHT),
    "light": ("light", LIGHT),
    "light, same tiles": ("light", lambda cfg: None if LIGHT(cfg) is None
                          else dataclasses.replace(LIGHT(cfg), resident_per_sm=None)),
}


def engine_layout(engine: TreeEngine, seen: list[TreeLayout], prompt_len: int,
                  parents: list[int]) -> TreeLayout:
    """The padded layout of a step verifying draft tree ``parents`` on a random prompt of
    ``prompt_len`` tokens, after two such steps (the engine as a speculative loop leaves it)."""
    prompt = torch.randint(0, 1000, (prompt_len,)).tolist()
    root = engine.add_prompt(prompt[:-1])
    engine.extend([(root, prompt[-1:])])
    for _ in range(3):
        nodes, _ = engine.extend_tree(root, parents, list(range(len(parents))))
        layout = seen[-1]
        engine.cache.prune(nodes[0])
    engine.cache.prune(root)
    return layout


def main() -> None:
    config = RandomSpec("llama-3-8b").config
    model, tok = random_model(config, "cuda"), byte_tokenizer(config.vocab_size)
    engine = TreeEngine(model, tok, num_pages=1024)
    seen: list[TreeLayout] = []
    planned = StepGraphs.plan

    def recording(self: StepGraphs, layout: TreeLayout):  # noqa: ANN202
        seen.append(layout)
        return planned(self, layout)

    StepGraphs.plan = recording
    medusa = workloads_dir(None)
    trees = {"64 leaves on 2,000 tokens": (2000, [-1] * 64),
             "Medusa APPS-64 on 4,000 tokens": (4000, medusa_parents(apps_tree(64, medusa))),
             "Medusa APPS-128 on 4,000 tokens": (4000, medusa_parents(apps_tree(128, medusa)))}
    pool, h, d = engine.runner.pool, config.num_heads, config.head_dim
    print("| tree | asks | " + " | ".join(f"{b} µs/step (tiles)" for b in BUILDS) + " |")
    print("| --- | --- |" + " --- |" * len(BUILDS))
    for name, (prompt_len, parents) in trees.items():
        layout = engine_layout(engine, seen, prompt_len, parents)
        n = layout.num_queries
        q = torch.randn(n, h, d, device="cuda", dtype=model.dtype)
        out = torch.empty_like(q)
        cells, asks = [], ""
        for label, (build, light) in BUILDS.items():
            backend.light_config = light
            try:
                attn = TreeAttention(h, config.num_kv_heads, d, backend="triton", device="cuda",
                                     capacity=Capacity(n, 16384, 4096, build))
                attn.plan(layout, pool.dtype)
            finally:
                backend.light_config = LIGHT
            asks = asks or attn.build

            def step(attn: TreeAttention = attn) -> None:
                for layer in range(config.num_layers):
                    attn.run(q, pool.k_slots[layer], pool.v_slots[layer], out=out)

            cells.append(f"{time_us(step, graph=True):,.0f} ({attn.current_plan.num_tiles})")
        print(f"| {name} | {asks} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    args(__doc__)
    main()
