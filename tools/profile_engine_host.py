"""Where a decode loop's host time goes when the host is on the critical path: beam search
and draft-tree verification wait for each step's scores before they build the next step.
Runs the loop of ``deft bench e2e --device cuda`` (Llama-3-8B shapes, random bf16 weights)
once to warm up, then under cProfile, and prints wall ms per step and the top functions by
own time, per step.

Loops: ``beam16`` (beam search k=16 from a 2,000-token prompt), ``beam4`` (k=4), ``t=256``
(verifying Medusa's APPS-256 tree on a 4,000-token prompt; needs ``$DEFT_WORKLOADS``,
default ``.workloads``).

Usage: python3 tools/profile_engine_host.py [LOOP ...]   (GPU only)
"""
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch

from benchmarks.trees import apps_tree, medusa_parents
from deft.engine import TreeEngine, beam_search
from deft.model.synthetic import load_random

STEPS = 32


def loop(engine: TreeEngine, name: str, gen: torch.Generator):
    """A callable running ``STEPS`` steps of loop ``name`` (its prompt fed first)."""
    vocab = engine.vocab_size
    if name in ("beam16", "beam4"):
        prompt = torch.randint(0, vocab, (2000,), generator=gen).tolist()
        width = int(name[4:])
        return lambda: beam_search(engine, prompt, width, STEPS, stop_token_ids=frozenset())
    if name == "t=256":
        parents = medusa_parents(apps_tree(256, Path(os.environ.get("DEFT_WORKLOADS", ".workloads"))))
        prompt = torch.randint(0, vocab, (4000,), generator=gen).tolist()
        tokens = list(range(len(parents)))

        def verify() -> None:
            root = engine.add_prompt(prompt[:-1])
            engine.extend([(root, prompt[-1:])])
            for _ in range(STEPS):
                nodes, logits = engine.extend_tree(root, parents, tokens)
                logits.argmax(-1).tolist()
                engine.cache.prune(nodes[0])
            engine.cache.prune(root)
        return verify
    raise SystemExit(f"unknown loop {name!r}: expected beam16, beam4 or t=256")


def main(argv: list[str]) -> None:
    model, tok = load_random("random:llama-3-8b", "cuda")
    engine = TreeEngine(model, tok, num_pages=4096)
    gen = torch.Generator().manual_seed(0)
    for name in argv or ["beam16", "t=256"]:
        run = loop(engine, name, gen)
        run()  # compiles and captures what the profiled run replays
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        run()
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        print(f"\n== {name}: {1e3 * wall / STEPS:.2f} ms per step without the profiler "
              f"(prefill included); top functions by own time, µs per step:")
        for (file, line, func), (_, calls, own, cum, _) in sorted(
                stats.stats.items(), key=lambda kv: -kv[1][2])[:25]:
            where = f"{Path(file).name}:{line}({func})"
            print(f"  {1e6 * own / STEPS:8.1f} own {1e6 * cum / STEPS:8.1f} cum "
                  f"{calls / STEPS:6.1f} calls  {where}")


if __name__ == "__main__":
    main(sys.argv[1:])
