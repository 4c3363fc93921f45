"""How much of the engine's own decode steps the partial kernel can load by TMA (CPU).

A tile of the triton backend's plan loads by TMA only where all its slots are consecutive
(``slot0 >= 0``); every other tile gathers. The benchmark trees hold every token in
consecutive slots; the engine's do not: a node's K/V lands in the pool's pages wherever the
cache finds free ones, and a tile that runs past a node's first pages or into a child node
crosses into other pages. This runs the engine's decode loops with the model's forward
stubbed out (rows of random logits, as ``tools/host_work.py`` does), plans each step's
layout as the backend would on an H200 (Llama-3-8B heads, the sm90 configs, 132 SMs) and
prints, over each loop's last ``--steps`` steps, the share of token work in tiles of
consecutive slots, and the share of the config's K/V blocks whose slots are consecutive (what
a kernel that chose TMA per block could load so). Each loop runs on a fresh pool and on one
after churn (``--churn`` requests of random lengths run first and released), as a server's
pool is; and after churn with every take of pages popped off the free list (the allocator's
``run_pages`` above the pool: no take looks for a run of consecutive free pages, no node
claims one). Loops:
``sample16`` (16 samples of a 2,000-token prompt), ``beam16`` (beam search k=16 on a
2,000-token prompt), ``greedy32`` (greedy decoding of 32 prompts of 1,000 tokens).

Usage: ``python tools/slot_runs.py [LOOP ...] [--steps N] [--churn N]``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # the sm90 configs, even under the CPU test suite
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.attention_gpu import D, H_KV, H_Q  # noqa: E402
from benchmarks.sweep import planned_as_h200  # noqa: E402
from deft.engine import SamplingParams, TreeEngine, beam_search, generate, sample  # noqa: E402
from deft.layout import TreeLayout  # noqa: E402
from deft.model import LlamaConfig  # noqa: E402
from deft.model.synthetic import byte_tokenizer, random_model  # noqa: E402
from deft.ops.base import Heads  # noqa: E402
from deft.ops.triton import backend, configs  # noqa: E402

LOOPS = ("sample16", "beam16", "greedy32")
VOCAB, TABLE = 512, 256
NEVER: frozenset[int] = frozenset()


def consecutive(layout: TreeLayout, sms: int = 132) -> tuple[int, int, int, int]:
    """Token work in ``layout``'s plan (as an H200's backend makes it): all of it, that in
    tiles of consecutive slots; K/V blocks run by the work items: all, those of consecutive
    slots."""
    with planned_as_h200(sms):
        plan, packed, cfg, _ = backend._pack(
            layout, "flatten", backend.TritonBackend.default_block_kv, Heads(H_Q, H_KV, D),
            torch.device("cpu"), lambda n: torch.empty(n, dtype=torch.int32), None, None)
    work, slots = packed.work(), packed.segment("tok_slot").astype(np.int64)
    tokens = work[:, 1] - work[:, 0]
    block_n = configs.kv_config(cfg, None).block_n
    blocks = good = 0
    for tok0, tok1 in work[:, :2]:
        steps = np.diff(slots[tok0:tok1]) == 1
        for b in range(0, tok1 - tok0, block_n):
            blocks += 1
            good += bool(steps[b:b + block_n - 1].all())
    return int(tokens.sum()), int(tokens[work[:, 6] >= 0].sum()), blocks, good


def churn(engine: TreeEngine, requests: int, gen: torch.Generator, vocab: int) -> None:
    """Run ``requests`` requests on ``engine`` and release them, as a server's pool sees
    traffic: prompts of 50-1,499 random tokens, two samples each, eight requests at a time
    (one call, 1-63 new tokens, the same for the eight) so that their pages interleave."""
    lengths = torch.randint(50, 1500, (requests,), generator=gen).tolist()
    new = torch.randint(1, 64, (requests,), generator=gen).tolist()
    for i in range(0, requests, 8):
        prompts = [torch.randint(258, vocab, (n,), generator=gen).tolist()
                   for n in lengths[i:i + 8]]
        sample(engine, prompts, 2, SamplingParams(max_new_tokens=new[i], temperature=0.8, seed=i,
                                                  stop_token_ids=NEVER))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("loops", nargs="*", default=list(LOOPS), metavar="LOOP",
                    help=f"decode loops, of {', '.join(LOOPS)} (default: all)")
    ap.add_argument("--steps", type=int, default=16, help="last decode steps counted (default 16)")
    ap.add_argument("--churn", type=int, default=64,
                    help="requests run and released before the churned pool's loop (default 64)")
    a = ap.parse_args(argv)
    unknown = [n for n in a.loops if n not in LOOPS]
    if unknown or a.steps < 1 or a.churn < 1:
        ap.error(f"expected loops of {', '.join(LOOPS)}, --steps >= 1 and --churn >= 1")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_heads=2, num_kv_heads=1, max_position_embeddings=4096)
    print("| loop | pool | steps | token work in consecutive tiles | consecutive K/V blocks |")
    print("| --- | --- | --- | --- | --- |")
    for name in a.loops:
        for pool in ("fresh", "after churn", "after churn, pages popped"):
            churned = pool != "fresh"
            gen = torch.Generator().manual_seed(0)

            def prompt(n: int) -> list[int]:
                return torch.randint(258, VOCAB, (n,), generator=gen).tolist()

            engine = TreeEngine(random_model(config, "cpu"), byte_tokenizer(VOCAB), num_pages=8192)
            if pool.endswith("popped"):
                engine.cache.allocator.run_pages = engine.cache.num_pages + 1
            table = torch.randn(TABLE, VOCAB, generator=gen)
            seen: list[TreeLayout] = []

            def run(step, table=table, seen=seen):  # noqa: ANN001, ANN202
                seen.append(step.layout)
                row = int(torch.randint(0, TABLE - len(step.logits_rows), (), generator=gen))
                return table[row:row + len(step.logits_rows)].clone()

            engine.runner.run = run
            if churned:
                churn(engine, a.churn, gen, VOCAB)
            new_tokens = a.steps + 2
            if name == "sample16":
                sample(engine, [prompt(2000)], 16, SamplingParams(
                    max_new_tokens=new_tokens, temperature=0.8, seed=0, stop_token_ids=NEVER))
            elif name == "beam16":
                beam_search(engine, prompt(2000), 16, new_tokens, stop_token_ids=NEVER)
            else:
                generate(engine, [prompt(1000) for _ in range(32)], SamplingParams(
                    max_new_tokens=new_tokens, stop_token_ids=NEVER))
            counts = np.array([consecutive(lay) for lay in seen[-a.steps:]]).sum(0)
            print(f"| {name} | {pool} | {min(a.steps, len(seen))} "
                  f"| {counts[1] / counts[0]:.1%} | {counts[3] / counts[2]:.1%} |", flush=True)


if __name__ == "__main__":
    main()
