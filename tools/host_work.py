"""Host work of a decode loop with the model's forward stubbed out: what a step costs the
host alone (the decode loop, cache, layout, plan and token picks), on any machine.

A small random Llama (one layer) whose forward is replaced by rows of precomputed random
logits over a ``--vocab``-entry vocabulary, so every step's time is host work. Loops:
``greedy32`` (greedy decoding of 32 prompts of 1,000 tokens, the e2e suite's "greedy, 32
prompts"), ``sampled32`` (the same prompts sampled at temperature 0.8, a request each), ``topp32``
(the same with top-p 0.9), ``beam16`` (beam search k=16 from one 2,000-token prompt),
``verify256`` (the e2e suite's "Medusa APPS-256 verify": the APPS-256 draft tree added under a
4,000-token prompt, its logits' argmax read, the tree pruned, each step; needs
``$DEFT_WORKLOADS``, default ``.workloads``). Prints ms of host
work per decode step: a run of ``--steps`` new tokens minus a run of one, best of
``--repeats``; with ``--profile``, cProfile's top functions of one run. On the CPU the picks
run as PyTorch ops on the host; with ``--device cuda`` the forward is stubbed the same way,
so the figure includes launching the picks but no model.

Usage: python tools/host_work.py [LOOP ...] [--vocab N] [--steps N] [--repeats N]
[--device DEV] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOOPS = ("greedy32", "sampled32", "topp32", "beam16", "verify256")
TABLE = 256  # rows of precomputed logits a step's rows are sliced from


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("loops", nargs="*", default=list(LOOPS), metavar="LOOP",
                    help=f"decode loops to time, of {', '.join(LOOPS)} (default: all)")
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary size, at least 259 "
                    "(default 1000)")
    ap.add_argument("--steps", type=int, default=64, help="new tokens of a timed run, at least 2 "
                    "(default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs, best kept (default 5)")
    ap.add_argument("--device", default="cpu", help="the engine's device (default cpu)")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    a = ap.parse_args()
    unknown = [n for n in a.loops if n not in LOOPS]
    if unknown:
        ap.error(f"unknown loop(s) {unknown}; known: {', '.join(LOOPS)}")
    if a.vocab < 259 or a.steps < 2 or a.repeats < 1:
        ap.error("expected --vocab >= 259, --steps >= 2 and --repeats >= 1")

    import torch

    from deft.engine import SamplingParams, TreeEngine, beam_search, generate
    from deft.model import LlamaConfig
    from deft.model.synthetic import byte_tokenizer, random_model

    config = LlamaConfig(vocab_size=a.vocab, hidden_size=64, intermediate_size=128,
                         num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=4096)
    engine = TreeEngine(random_model(config, a.device), byte_tokenizer(a.vocab), num_pages=8192)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(TABLE, a.vocab, generator=gen).to(engine.device)
    offsets = iter(torch.randint(0, TABLE - 32, (1 << 20,), generator=gen).tolist())
    engine.runner.run = lambda step: table[next(offsets):][:len(step.logits_rows)].clone()
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
            import os

            from benchmarks.trees import apps_tree, medusa_parents

            workloads = Path(os.environ.get("DEFT_WORKLOADS", ".workloads"))
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

    for name in a.loops:
        run = loop(name)
        timed(run, 4)
        best = min(timed(run, a.steps) - timed(run, 1) for _ in range(a.repeats))
        print(f"{name}: {best / (a.steps - 1) * 1e3:.3f} ms of host work per decode step "
              f"(vocabulary {a.vocab}, {engine.device})", flush=True)
        if a.profile:
            pr = cProfile.Profile()
            pr.enable()
            run(a.steps)
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
