"""One rank of ``deft bench tp`` (launched by :mod:`benchmarks.tp` under ``torchrun``).

Every rank loads its shard and builds the engine; rank 0 times, the others follow. After a
warm-up, two workloads: parallel sampling of ``branches`` sequences from one
``prompt_tokens``-token prompt (``new_tokens`` each, no stop token; tokens/s end to end, and
the decode step time: the run less a run of one new token, over the steps between them),
and the verification of a ``draft_tokens``-token draft tree under the prompt (one forward
per tree, median of ``reps``). The all-reduce time per step is measured apart: the
``2 x layers`` all-reduces of one step's ``[queries, hidden]`` activations, synchronised,
median of ``reps``. Rank 0 writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from deft.distributed import init_tensor_parallel
from deft.engine import SamplingParams, TreeEngine, sample
from deft.model import is_random_spec, load_model, load_random
from deft.model.sharding import shard_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _draft_parents(n: int, seed: int = 0) -> list[int]:
    """A random draft tree of ``n`` tokens: each token under one of the 8 latest (or the root)."""
    rng = np.random.default_rng(seed)
    return [-1 if i == 0 else int(rng.integers(max(-1, i - 8), i)) for i in range(n)]


def _allreduce_ms(tp, rows: int, hidden: int, layers: int, dtype: torch.dtype, reps: int) -> float:
    x = torch.randn(rows, hidden, dtype=dtype, device=tp.device)
    times = []
    for i in range(reps + 2):
        _sync(tp.device)
        t0 = time.perf_counter()
        for _ in range(2 * layers):
            tp.all_reduce(x)
        _sync(tp.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("size", "prompt_tokens", "branches", "new_tokens", "draft_tokens", "reps",
                 "num_pages"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    p.add_argument("--model")
    p.add_argument("--device", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    tp = init_tensor_parallel(a.size, a.device)
    if is_random_spec(a.model):
        whole, tok = load_random(a.model, tp.device)
        model = shard_model(whole, tp)
        del whole
    else:
        model, tok = load_model(a.model, device=tp.device, tp=tp)
    num_pages = tp.agree(a.num_pages, "agreeing on pages")
    engine = TreeEngine(model, tok, num_pages=num_pages, device=tp.device, tp_group=tp)
    if tp.leader:
        with engine:
            row = _run(engine, a)
    else:
        engine.follow()
    c = model.config  # every rank takes part in the all-reduces
    decode_ar = _allreduce_ms(tp, a.branches, c.hidden_size, c.num_layers, model.dtype, a.reps)
    tree_ar = _allreduce_ms(tp, a.draft_tokens, c.hidden_size, c.num_layers, model.dtype, a.reps)
    tp.close()
    if tp.leader:
        row.update(size=a.size, device=str(tp.device), dtype=str(model.dtype).removeprefix("torch."),
                   heads_on_rank0=c.num_heads, allreduce_ms_per_decode_step=decode_ar,
                   allreduce_ms_per_tree_step=tree_ar)
        with open(a.out, "w") as f:
            json.dump(row, f)


def _timed_sample(engine: TreeEngine, prompt: list[int], branches: int, new_tokens: int
                  ) -> tuple[float, int, int]:
    """Seconds, forwards and tokens of sampling ``branches`` continuations of ``prompt``."""
    device = engine.device
    engine.reset_stats()
    _sync(device)
    t0 = time.perf_counter()
    out = sample(engine, [prompt], branches,
                 SamplingParams(temperature=1.0, seed=0, max_new_tokens=new_tokens,
                                stop_token_ids=frozenset()))
    _sync(device)
    return (time.perf_counter() - t0, int(engine.stats["steps"]),
            sum(len(r.token_ids) for r in out[0]))


def _run(engine: TreeEngine, a: argparse.Namespace) -> dict:
    """Rank 0's timings: sampling (end to end, and per decode step: the run of ``new_tokens``
    less the run of one, which is the prefill and the first token) and tree verification."""
    vocab = engine.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, vocab - 10, a.prompt_tokens).tolist()
    _timed_sample(engine, prompt, a.branches, 4)  # warm-up: every graph bucket the runs use
    first_s, first_steps, _ = _timed_sample(engine, prompt, a.branches, 1)
    seconds, steps, tokens = _timed_sample(engine, prompt, a.branches, a.new_tokens)
    root = engine.add_prompt(prompt)
    engine.extend([(root, [11])], logits="none")
    parents = _draft_parents(a.draft_tokens)
    draft = rng.integers(10, vocab - 10, a.draft_tokens).tolist()
    tree_times = []
    for i in range(a.reps + 1):
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.extend_tree(root, parents, draft)
        _sync(engine.device)
        if i:
            tree_times.append(time.perf_counter() - t0)
        for child in engine.cache.children(root):
            engine.cache.prune(child)
    engine.cache.prune(root)
    return {"sampling_tokens_per_s": tokens / seconds,
            "sampling_decode_step_ms": 1e3 * (seconds - first_s) / max(steps - first_steps, 1),
            "tree_verify_ms": 1e3 * statistics.median(tree_times)}


if __name__ == "__main__":
    main()
