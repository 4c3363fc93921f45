"""Whole decode steps on a pool that has seen traffic, with the page allocator's runs and
claims and with every take popped off the free list (GPU only).

A server's pool is not fresh: requests came and went, and a free list popped page by page
hands a new prompt scattered pages, whose tiles the attention kernel gathers instead of
loading by TMA (``tools/slot_runs.py`` counts them, ``tools/gather_cost.py`` times the
kernel both ways). This times what that costs a user: each ``deft bench e2e --device cuda``
workload, on the Llama-3-8B-shaped random model, in an engine (CUDA graphs, the default) whose
pool first ran ``--churn`` requests (``slot_runs.churn``), once with the allocator as shipped
(a take of ``RUN_PAGES`` or more pages gets consecutive free pages where a run holds it, and
a node with an expectation takes a run for all of it and claims the rest: each sequence in one
run) and once with ``run_pages`` above the pool (every take pops), in alternating order over
``--rounds``. ms/step as in the e2e benchmark (decode steps' wall time, host work included;
the last step's graph replayed alone for the GPU's part).

Usage: python3 tools/churn_steps.py [WORKLOAD ...] [--rounds N] [--churn N] [--layers N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.e2e_gpu import (GPU_WORKLOADS, POOL_PAGES, _measure, model_config,  # noqa: E402
                                workload_inputs)
from deft.engine import TreeEngine  # noqa: E402
from deft.model.synthetic import byte_tokenizer, random_model  # noqa: E402
from slot_runs import churn  # noqa: E402

DEFAULT = ["few-shot b=20", "beam k=16", "Medusa APPS-64 verify"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="*", default=DEFAULT, metavar="WORKLOAD",
                    help=f"e2e workload names (default: {', '.join(DEFAULT)})")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both allocators (default 2)")
    ap.add_argument("--churn", type=int, default=64, help="requests run first (default 64)")
    ap.add_argument("--layers", type=int, default=None, help="model layers (default: all 32)")
    a = ap.parse_args(argv)
    chosen = [w for w in GPU_WORKLOADS if w.name in a.workloads]
    if len(chosen) != len(set(a.workloads)) or a.rounds < 1 or a.churn < 1:
        ap.error(f"expected workloads of {', '.join(w.name for w in GPU_WORKLOADS)}, "
                 "--rounds >= 1 and --churn >= 1")
    config = model_config("llama-3-8b", a.layers, chosen)
    model, tok = random_model(config, "cuda"), byte_tokenizer(config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    inputs = {w.name: workload_inputs(w, None, config.vocab_size, gen) for w in chosen}
    print("| round | workload | allocator | ms/step | GPU ms, last step | plan ms/step | s |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for r in range(a.rounds):
        for name, (w, prompts, parents, trace) in inputs.items():
            for runs in (True, False)[::1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                engine = TreeEngine(model, tok, num_pages=POOL_PAGES)
                if not runs:
                    engine.cache.allocator.run_pages = engine.cache.num_pages + 1
                churn(engine, a.churn, torch.Generator().manual_seed(1), config.vocab_size)
                m = _measure(engine, w, prompts, parents, trace,
                             lambda msg: print(f"  {msg}", file=sys.stderr))
                gpu = "" if m["gpu_ms"] is None else f"{m['gpu_ms']:.3f}"
                print(f"| {r} | {name} | {'runs and claims' if runs else 'pages popped'} "
                      f"| {m['ms_step']:.3f} | {gpu} | {m['plan_ms']:.3f} "
                      f"| {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
