"""Host work of a decode loop with the model's forward stubbed out: what a step costs the
host alone (the decode loop, cache, layout, plan and token picks), on any machine.

A small random Llama (one layer) whose forward is replaced by rows of precomputed random
logits over a ``--vocab``-entry vocabulary, so every step's time is host work. Loops:
``greedy32`` (greedy decoding of 32 prompts of 1,000 tokens, the e2e suite's "greedy, 32
prompts"), ``sampled32`` (the same prompts sampled at temperature 0.8, a request each), ``topp32``
(the same with top-p 0.9), ``beam16`` (beam search k=16 from one 2,000-token prompt),
``verify256`` (the e2e suite's "Medusa APPS-256 verify": the APPS-256 draft tree added under a
4,000-token prompt, its logits' argmax read, the tree pruned, each step; needs the
recorded workloads, ``$DEFT_WORKLOADS``, else ``../shared/workloads``; not run unless
named). Prints ms of host work per decode step: a run of ``--steps`` new tokens minus a
run of one, best of ``--repeats``; with ``--profile``, cProfile's top functions of one run. On the CPU the picks
run as PyTorch ops on the host; with ``--device cuda`` the forward is stubbed the same way,
so the figure includes launching the picks but no model.

With ``--graph-plan`` (CPU only; ``beam16`` and ``verify256``) the runner's part stays: each step is planned into its
CUDA-graph bucket as an H200's engine plans it (Llama-3-8B's heads in one layer) and its
inputs staged, and only the replayed forward is stubbed, so the figure is all of the host's
part of a step that waits for the GPU (beam search, verification) but the graph's launch
itself.

Usage: python tools/host_work.py [LOOP ...] [--vocab N] [--steps N] [--repeats N]
[--device DEV] [--profile] [--graph-plan]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOOPS = ("greedy32", "sampled32", "topp32", "beam16", "verify256")
WAITING = ("beam16", "verify256")  # the loops whose host work the GPU waits for
TABLE, MAX_ROWS = 512, 256  # rows of precomputed logits, and at most a step's, sliced from them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("loops", nargs="*", metavar="LOOP",
                    help=f"decode loops to time, of {', '.join(LOOPS)} (default: all but "
                    f"{LOOPS[-1]}; with --graph-plan, {' and '.join(WAITING)})")
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary size, at least 259 "
                    "(default 1000)")
    ap.add_argument("--steps", type=int, default=64, help="new tokens of a timed run, at least 2 "
                    "(default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs, best kept (default 5)")
    ap.add_argument("--device", default="cpu", help="the engine's device (default cpu)")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    ap.add_argument("--graph-plan", action="store_true",
                    help="keep the runner's part: each step is planned into its CUDA-graph bucket "
                    "as on an H200 (the triton backend's sm90 configs, 132 SMs; Llama-3-8B's 32 "
                    "query and 8 KV heads of 128 in one layer) and its inputs staged, only the "
                    "replayed forward is stubbed (CPU only)")
    a = ap.parse_args()
    a.loops = a.loops or list(WAITING if a.graph_plan else LOOPS[:-1])
    unknown = [n for n in a.loops if n not in LOOPS]
    if unknown:
        ap.error(f"unknown loop(s) {unknown}; known: {', '.join(LOOPS)}")
    if a.vocab < 259 or a.steps < 2 or a.repeats < 1:
        ap.error("expected --vocab >= 259, --steps >= 2 and --repeats >= 1")
    if a.graph_plan and a.device != "cpu":
        ap.error("--graph-plan: on the CPU only (it plans as an H200 would)")
    if a.graph_plan and set(a.loops) - set(WAITING):
        ap.error(f"--graph-plan: for the loops that wait for each step ({', '.join(WAITING)}); "
                 "its pool does not hold 32 prompts")
    if a.graph_plan:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend on CPU tensors

    import torch

    from deft.engine import SamplingParams, TreeEngine, beam_search, generate
    from deft.model import LlamaConfig
    from deft.model.synthetic import byte_tokenizer, random_model
    from deft.recorded import workloads_dir

    heads = dict(hidden_size=4096, num_heads=32, num_kv_heads=8) if a.graph_plan else \
        dict(hidden_size=64, num_heads=2, num_kv_heads=1)
    config = LlamaConfig(vocab_size=a.vocab, intermediate_size=128, num_layers=1,
                         max_position_embeddings=8192, **heads)
    engine = TreeEngine(random_model(config, a.device), byte_tokenizer(a.vocab),
                        **(dict(num_pages=1024, backend="triton") if a.graph_plan else
                           dict(num_pages=8192)))
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(TABLE, a.vocab, generator=gen).to(engine.device)
    offsets = iter(torch.randint(0, TABLE - MAX_ROWS, (1 << 20,), generator=gen).tolist())

    def rows(n: int) -> torch.Tensor:
        return table[next(offsets):][:n].clone()

    def stub(step):  # the logits a step returns, from the table
        return rows(len(step.logits_rows))

    runner = engine.runner
    if a.graph_plan:
        from benchmarks.sweep import planned_as_h200
        from deft.engine.graphs import StepGraphs

        # The scratch slot lies past the pool (the engine adds a page for it on CUDA): only
        # the stubbed forward would write it.
        graphs = runner.graphs = StepGraphs(runner.model, runner.pool,
                                            engine.config.num_pages * engine.config.page_size)
        graphs._forward = lambda b, n: rows(n)
        planned = runner.run
        # A prompt computed in one step of more queries than the largest bucket would run
        # eagerly: it is no decode step's host work.
        runner.run = lambda step: planned(step) if graphs.bucket(step.num_queries) else stub(step)
    else:
        runner.run = stub
    never = frozenset()

    def prompt(n: int, seed: int) -> list[int]:
        return torch.randint(258, a.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def verify(n: int, prompt: list[int], parents: list[int]) -> None:
        root = engine.add_prompt(prompt[:-1])
        engine.extend([(root, prompt[-1:])])
        tokens = list(range(len(parents)))
        for _ in range(n):
            nodes, logits = engine.extend_tree(root, parents, tokens)
            logits.argmax(-1).tolist()
            engine.cache.prune(nodes[0])
        engine.cache.prune(root)

    def loop(name: str):
        """A run of ``name`` with ``n`` new tokens per sequence, as a callable of ``n``."""
        if name == "verify256":
            from benchmarks.trees import apps_tree, medusa_parents

            workloads = workloads_dir()
            parents = medusa_parents(apps_tree(256, workloads))
            return lambda n, p=prompt(4000, 7): verify(n, p, parents)
        if name != "beam16":
            prompts = [prompt(1000, i) for i in range(32)]
            hot, top_p = {"greedy32": (0.0, 1.0), "sampled32": (0.8, 1.0), "topp32": (0.8, 0.9)}[name]
            return lambda n: generate(engine, prompts, SamplingParams(
                max_new_tokens=n, temperature=hot, top_p=top_p, seed=0, stop_token_ids=never))
        beam_prompt = prompt(2000, 99)
        return lambda n: beam_search(engine, beam_prompt, 16, n, stop_token_ids=never)

    def timed(run, n: int) -> float:
        t = time.perf_counter()
        run(n)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    with planned_as_h200() if a.graph_plan else contextlib.nullcontext():
        for name in a.loops:
            run = loop(name)
            timed(run, 4)
            best = min(timed(run, a.steps) - timed(run, 1) for _ in range(a.repeats))
            print(f"{name}: {best / (a.steps - 1) * 1e3:.3f} ms of host work per decode step "
                  f"(vocabulary {a.vocab}, {engine.device}"
                  f"{', planned into graph buckets' if a.graph_plan else ''})", flush=True)
            if a.profile:
                pr = cProfile.Profile()
                pr.enable()
                run(a.steps)
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
