"""The engine's sequences keep their K/V in runs of consecutive slots (CPU).

Prompts prefilled together take their chunks in turns; each request's node tells the cache
how many tokens it will hold (``TreeKVCache.expect``), so its pages come as one run and its
decode tokens follow in it, and the triton backend's tiles over it load by TMA. Where pages
lie must not change what a request computes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deft import TreeLayout
from deft.engine import SamplingParams, TreeEngine, generate, sample
from deft.model import LlamaConfig
from deft.model.synthetic import byte_tokenizer, random_model

VOCAB = 300
NEVER: frozenset[int] = frozenset()


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, max_position_embeddings=1024)
    return random_model(config, "cpu"), byte_tokenizer(VOCAB)


def watched(model, **kwargs) -> tuple[TreeEngine, list[TreeLayout]]:
    """An engine whose every step's layout is kept."""
    engine = TreeEngine(*model, **kwargs)
    seen, run = [], engine.runner.run
    engine.runner.run = lambda step: (seen.append(step.layout), run(step))[1]
    return engine, seen


def runs_per_node(layout: TreeLayout) -> list[int]:
    """How many runs of consecutive slots each node's K/V lie in."""
    ptr, kv = layout.node_kv_indptr, layout.kv_indices
    return [1 + int(np.count_nonzero(np.diff(kv[a:b]) != 1)) if b > a else 0
            for a, b in zip(ptr[:-1].tolist(), ptr[1:].tolist())]


def prompts(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(258, VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


def test_prompts_prefilled_together_decode_from_one_run_each(model):
    asks = prompts(6, 150)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=NEVER)
    engine, seen = watched(model, num_pages=128, page_size=16, prefill_chunk=32)
    together = generate(engine, asks, params)
    assert all(runs_per_node(lay) == [1] * lay.num_nodes for lay in seen)
    assert engine.cache.allocator.num_claimed == 0 and engine.cache.num_free_pages == 128
    engine.cache.allocator.run_pages = 129  # every take pops: the chunks interleave
    popped = generate(engine, asks, params)
    assert [r.token_ids for r in popped] == [r.token_ids for r in together]
    alone = [generate(TreeEngine(*model, num_pages=128, page_size=16, prefill_chunk=32), [a],
                      params)[0] for a in asks]
    assert [r.token_ids for r in alone] == [r.token_ids for r in together]


def test_samples_of_one_prompt_each_decode_into_a_run(model):
    engine, seen = watched(model, num_pages=128, page_size=16, prefill_chunk=64)
    sample(engine, prompts(1, 200)[0], 4, SamplingParams(max_new_tokens=70, temperature=1.0,
                                                           seed=0, stop_token_ids=NEVER))
    last = seen[-1]
    assert last.num_nodes == 5 and runs_per_node(last) == [1] * 5
    assert engine.cache.allocator.num_claimed == 0


def test_claims_give_way_when_the_pool_is_short(model):
    """Four 150-token prompts with 40 new tokens each would take 48 pages of a pool of 40:
    claims are given up to other takes (some sequence then spans several runs) and
    requests are preempted, yet each finishes as it would alone."""
    asks = prompts(4, 150)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=NEVER)
    engine, seen = watched(model, num_pages=40, page_size=16, prefill_chunk=32)
    tight = generate(engine, asks, params)
    assert max(max(runs_per_node(lay)) for lay in seen) > 1
    alone = [generate(TreeEngine(*model, num_pages=40, page_size=16), [a], params)[0]
             for a in asks]
    assert [r.token_ids for r in tight] == [r.token_ids for r in alone]
    assert engine.cache.num_free_pages == 40 and engine.cache.allocator.num_claimed == 0


def test_requests_that_fork_from_cached_prefixes_decode_from_runs(model):
    """Requests whose prompts extend a cached prompt (the server's prefix cache) feed only
    their rest, on nodes forked from the cached one: the rest and each answer lie in a run."""
    pytest.importorskip("fastapi")  # deft.serve's package imports its app
    from conftest import run_batch
    from deft.engine.decoding import Batch, Request
    from deft.serve import PrefixCache

    engine, seen = watched(model, num_pages=256, page_size=16, prefill_chunk=32)
    batch = Batch(engine, prefixes=PrefixCache(engine.cache))
    params = SamplingParams(max_new_tokens=70, stop_token_ids=NEVER)
    system = prompts(1, 100)[0]
    batch.add(Request(system, 1, params, pin_prompt=True))
    run_batch(batch)
    turns = [Request(system + rest, 2, params, pin_prompt=True) for rest in prompts(3, 120)]
    for r in turns:
        batch.add(r)
    start = len(seen)
    run_batch(batch)
    assert seen[-1].num_queries == 6  # two answers each
    assert all(max(runs_per_node(lay)) == 1 for lay in seen[start:])
    for r in turns:
        (ref,) = generate(TreeEngine(*model, num_pages=256, page_size=16), [r.prompt], params)
        assert r.branches[0].tokens == ref.token_ids


def test_an_answer_kept_for_later_requests_holds_no_claim(model):
    """An answer that stops long before its ``max_new_tokens`` and is kept by the prefix
    cache grows no more: its claim on the pages after it goes with its end, not with its
    eviction."""
    pytest.importorskip("fastapi")  # deft.serve's package imports its app
    from deft.engine.decoding import Batch, Request
    from deft.serve import PrefixCache

    engine = TreeEngine(*model, num_pages=128, page_size=16, prefill_chunk=32)
    batch = Batch(engine, prefixes=PrefixCache(engine.cache))
    req = Request(prompts(1, 40)[0], 1, SamplingParams(max_new_tokens=600, stop_token_ids=NEVER),
                  pin_prompt=True)
    batch.add(req)
    claimed = 0
    while batch.step():
        claimed = max(claimed, engine.cache.allocator.num_claimed)
        if len(req.branches[0].tokens) >= 20:  # as a stop token would end it
            batch.finish(req.branches[0], "stop")
    assert claimed > 0  # it decoded into a claim
    answer = req.branches[0].node
    assert engine.cache.is_live(answer) and engine.cache.num_tokens(answer) >= 19  # kept
    assert engine.cache.allocator.num_claimed == 0
