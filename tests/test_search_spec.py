"""A search strategy is one value on a :class:`~deft.engine.requests.Request`: the toy one
defined here (a :class:`~deft.engine.requests.SearchSpec` and the Search it builds) runs in
a :class:`~deft.engine.decoding.Batch` and through ``decode`` with nothing else to change,
next to sampled requests, in overlapped steps and through a preemption, and gives the
tokens an independent computation gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import pytest
import torch

from conftest import run_batch
from deft.engine import SamplingParams, TreeEngine, generate
from deft.engine.decoding import Batch, Request, decode
from deft.engine.requests import SearchSpec


@dataclass(frozen=True)
class Ranked:
    """Each step takes the ``rank``-th most likely token (0: greedy), fed as one search item,
    until a stop token (kept) or ``max_new_tokens``."""

    rank: int
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()

    def build(self, engine: TreeEngine, request: Request) -> RankedSearch:
        return RankedSearch(engine, self)

    def pages_per_step(self, page_size: int) -> int:
        return 1


class RankedSearch:
    trees: Sequence[tuple[int, list[int], list[int]]] = ()

    def __init__(self, engine: TreeEngine, spec: Ranked) -> None:
        self.cache, self.spec = engine.cache, spec
        self.node, self.tokens, self.done = -1, [], False
        self.logits: torch.Tensor | None = None
        self.feed: list[tuple[int, list[int]]] = []

    @property
    def nodes(self) -> list[int]:
        return [self.node] if self.node >= 0 and not self.done else []

    def start(self, node: int, logits: torch.Tensor) -> None:
        self.node, self.logits = node, logits

    def step(self, keep: Collection[int] = ()) -> int:
        token = int(torch.topk(self.logits, self.spec.rank + 1).indices[-1])
        self.tokens.append(token)
        self.logits = None
        if token in self.spec.stop_token_ids or len(self.tokens) >= self.spec.max_new_tokens:
            self.release(keep)
        else:
            self.feed = [(self.node, [token])]
        return 1

    def take(self, rows: Sequence[torch.Tensor], verified: Sequence[tuple[list[int], torch.Tensor]]) -> None:
        (self.logits,) = rows
        self.feed = []

    def release(self, keep: Collection[int] = ()) -> None:
        if self.cache.is_live(self.node):
            self.cache.prune(self.node, release_unused_ancestors=True, keep=keep)
        self.feed, self.logits, self.done = [], None, True


def ranked_alone(engine: TreeEngine, prompt: list[int], rank: int, steps: int) -> list[int]:
    """The reference: one ``engine.extend`` per token on a chain of its own, no batch."""
    root = engine.add_prompt([])
    (row,) = engine.extend([(root, prompt)], logits="last")
    out = []
    for _ in range(steps):
        out.append(int(torch.topk(row, rank + 1).indices[-1]))
        (row,) = engine.extend([(root, out[-1:])], logits="last")
    engine.cache.prune(root)
    return out


def sampled(prompts: list[list[int]]) -> list[Request]:
    return [Request(prompts[1], 2, SamplingParams(temperature=1.0, seed=3, max_new_tokens=9)),
            Request(prompts[2], 1, SamplingParams(max_new_tokens=5))]


def tokens(requests: list[Request]) -> list[list[list[int]]]:
    return [[b.tokens for b in r.branches] for r in requests]


@pytest.fixture(scope="module")
def sampled_alone(smol, prompts):
    out = []
    for r in sampled(prompts):
        decode(TreeEngine(*smol, num_pages=64), requests=[r])
        out += tokens([r])
    return out


def test_a_strategy_is_a_search_spec_value(prompts):
    assert isinstance(Ranked(0, 4), SearchSpec)
    with pytest.raises(TypeError, match="strategy: expected a SearchSpec"):
        Request(prompts[0], 1, SamplingParams(), strategy="greedy")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_greedy_toy_search_joining_a_batch_equals_generate(smol, prompts, sampled_alone, overlap):
    """Greedy picks up to a stop id that greedy decoding meets at its 5th token: the same
    tokens as ``generate`` with that stop id; the sampled requests are unchanged."""
    engine = TreeEngine(*smol, num_pages=64)
    (free,) = generate(engine, [prompts[0]], SamplingParams(max_new_tokens=12, stop_token_ids=frozenset()))
    stop = frozenset({free.token_ids[4]})
    (want,) = generate(engine, [prompts[0]], SamplingParams(max_new_tokens=12, stop_token_ids=stop))
    assert len(want.token_ids) <= 5
    toy = Request(prompts[0], 1, SamplingParams(), strategy=Ranked(0, 12, stop))
    batch, first = Batch(engine, overlap=overlap), sampled(prompts)
    for r in first:
        batch.add(r)
    run_batch(batch, join=[toy])
    assert toy.status == "done" and toy.search.tokens == want.token_ids
    assert tokens(first) == sampled_alone
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


def test_a_runner_up_toy_search_equals_its_step_by_step_reference(smol, prompts):
    engine = TreeEngine(*smol, num_pages=64)
    want = ranked_alone(engine, prompts[3], 1, 8)
    (greedy,) = generate(engine, [prompts[3]], SamplingParams(max_new_tokens=8, stop_token_ids=frozenset()))
    assert want != greedy.token_ids
    toy = Request(prompts[3], 1, SamplingParams(), strategy=Ranked(1, 8))
    decode(engine, requests=[toy, *sampled(prompts)])
    assert toy.search.tokens == want
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


@pytest.mark.parametrize("toy_first", [False, True])
def test_a_toy_search_is_preempted_and_built_anew(smol, prompts, toy_first):
    """10 pages of 4: a 16-token toy search and a 16-token greedy request outgrow them side
    by side; the younger is preempted and restarts from its prompt (the toy with a search its
    spec builds again); both equal greedy decoding alone."""
    long = SamplingParams(max_new_tokens=16, stop_token_ids=frozenset())
    want = [r.token_ids for r in generate(TreeEngine(*smol, num_pages=64), prompts[:2], long)]
    engine = TreeEngine(*smol, num_pages=10, page_size=4)
    batch = Batch(engine)
    toy, plain = Request(prompts[0], 1, long, strategy=Ranked(0, 16)), Request(prompts[1], 1, long)
    for r in (toy, plain) if toy_first else (plain, toy):
        batch.add(r)
    run_batch(batch)
    assert batch.stats["preempted"] >= 1 and (plain if toy_first else toy).restarts >= 1
    assert [toy.search.tokens, plain.branches[0].tokens] == want
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 10
