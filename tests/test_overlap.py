"""Overlapped decode steps (:mod:`deft.engine.inflight`): tokens drawn on the device feed
the next forward there and reach the host one step later. Forced on here on CPU, where
nothing is asynchronous, so every test compares with the same batch waiting for its tokens:
same tokens, log-probabilities, top pairs and finish reasons, same cache state after.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from conftest import run_batch
from deft import CacheFullError
from deft.engine import SamplingParams, TreeEngine
from deft.engine.decoding import Batch, Request
from deft.model import load_random

run = partial(run_batch, limit=400)


def outcome(requests: list[Request]) -> tuple[list, list]:
    """What must be equal (tokens, finish reasons, top tokens), and the log-probabilities,
    equal up to rounding (a step's batch holds a stopped branch's row one step longer)."""
    branches = [b for r in requests for b in r.branches]
    exact = [(b.tokens, b.finish_reason, [[t for t, _ in top] for top in b.tops]) for b in branches]
    return exact, [b.logprobs + [v for top in b.tops for _, v in top] for b in branches]


@pytest.fixture(scope="module")
def prompts(smol):
    _, tok = smol
    return [tok.encode(f"List {i}: red, green, blue and") for i in range(3)]


@pytest.fixture(scope="module")
def stops(smol, prompts):
    """Token ids the sampled runs below emit early on (so branches stop at different steps)."""
    engine = TreeEngine(*smol, num_pages=64)
    req = Request(prompts[0], 4, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    batch = Batch(engine, overlap=False)
    batch.add(req)
    run(batch)
    return frozenset(b.tokens[2 + i] for i, b in enumerate(req.branches[:2]))


def requests(prompts, stops):
    sampled = SamplingParams(max_new_tokens=9, temperature=1.0, seed=3, stop_token_ids=stops)
    return ([Request(prompts[0], 4, sampled, top_logprobs=2),
             Request(prompts[1], 1, SamplingParams(max_new_tokens=5))],
            [Request(prompts[2], 2, SamplingParams(max_new_tokens=7, temperature=0.7, top_k=20,
                                                   seed=5))])


def test_overlapped_steps_equal_steps_that_wait(smol, prompts, stops):
    got = {}
    for overlap in (False, True):
        engine = TreeEngine(*smol, num_pages=64)
        first, later = requests(prompts, stops)
        batch = Batch(engine, overlap=overlap)
        for r in first:
            batch.add(r)
        run(batch, join=later)
        assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64
        got[overlap] = outcome(first + later)
    assert got[True][0] == got[False][0]
    assert {b[1] for b in got[True][0]} == {"stop", "length"}  # both ends are exercised
    assert any(b[2] for b in got[True][0])  # and the top pairs
    for a, b in zip(got[True][1], got[False][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_tiny_page_budget_and_cancels_with_tokens_in_flight(smol, prompts):
    """Preemption (4 pages for requests needing 2 each) and a cancel while a token is drawn."""
    alone = []
    for p in prompts:
        engine = TreeEngine(*smol, num_pages=64)
        batch = Batch(engine, overlap=False)
        r = Request(p, 1, SamplingParams(max_new_tokens=10))
        batch.add(r)
        run(batch)
        alone.append(r.branches[0].tokens)
    engine = TreeEngine(*smol, num_pages=4, page_size=16)
    batch = Batch(engine, overlap=True)
    reqs = [Request(p, 1, SamplingParams(max_new_tokens=10)) for p in prompts]
    doomed = Request(prompts[0], 2, SamplingParams(max_new_tokens=30, temperature=1.0, seed=1))
    for r in reqs + [doomed]:
        batch.add(r)
    steps = 0
    while batch.step():
        steps += 1
        if doomed.status == "running" and any(b.tokens for b in doomed.branches):
            batch.cancel(doomed)  # its drawn token is in flight now
        assert steps < 400
    assert [r.branches[0].tokens for r in reqs] == alone
    assert {b.finish_reason for b in doomed.branches} == {"cancelled"}
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 4


def test_extend_reads_device_tokens(smol, prompts):
    engine = TreeEngine(*smol, num_pages=64)
    ids = prompts[0]
    want = []
    for device in (False, True):
        root = engine.add_prompt(ids[:-2])
        a, b = engine.cache.fork(root, 2)
        if device:
            values = torch.tensor([5, ids[-2], 7], dtype=torch.int64)
            rows = engine.extend([(a, [0]), (b, ids[-2:])], device_tokens=(values, [1, -1]))
        else:
            rows = engine.extend([(a, ids[-2:-1]), (b, ids[-2:])])
        want.append(rows)
        engine.cache.prune(root)
    for x, y in zip(*want):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    root = engine.add_prompt(ids[:-1])
    good = torch.zeros(2, dtype=torch.int64)
    for bad, match in (((good, [0, 1]), "one source per item"),
                       ((good, [2]), r"sources\[0\]: expected -1 or an index in \[0, 2\)"),
                       ((good.float(), [0]), "1-D int64 tensor"),
                       ((good, [0]), "exactly one")):
        items = [(root, ids[-1:] * (2 if match == "exactly one" else 1))]
        with pytest.raises(ValueError, match=match):
            engine.extend(items, device_tokens=bad)
    assert engine.cache.num_tokens(root) == len(ids) - 1  # nothing changed


def test_a_step_short_of_pages_lands_its_drawn_tokens_first():
    """Three samples whose pages fit only because one ends early on a stop token: with the
    tokens drawn on the device, the step that needs a fresh page per branch lands them
    first (the stopped branch's pages come back), as the batch that waits for its tokens
    does, instead of raising ``CacheFullError``."""
    model, tok = load_random("random:tiny")
    prompt = list(range(40, 54))  # 14 tokens: two pages of 8, the second shared part-full
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=11)

    def sample(pages: int, overlap: bool, params: SamplingParams) -> Request:
        engine = TreeEngine(model, tok, num_pages=pages, page_size=8, prefill_chunk=64)
        req = Request(prompt, 3, params)
        batch = Batch(engine, overlap=overlap)
        batch.add(req)
        run(batch)
        assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == pages
        return req

    free = sample(64, False, params)
    # Branch 2 stops on its 11th token: its tokens need no third page of their own.
    stop = dataclasses.replace(params, stop_token_ids=frozenset([free.branches[2].tokens[10]]))
    with pytest.raises(CacheFullError):  # without the stop, the three do not fit in 9 pages
        sample(9, False, params)
    want = [(b.tokens, b.finish_reason) for b in sample(9, False, stop).branches]
    assert [len(t) for t, _ in want] == [12, 12, 11] and want[2][1] == "stop"
    assert [(b.tokens, b.finish_reason) for b in sample(9, True, stop).branches] == want
