"""Random mixes of requests through one :class:`~deft.engine.decoding.Batch` on tiny page
budgets: samples (greedy and seeded), beams and speculative decoding, joining at random
steps, some cancelled, with or without a prefix cache (prompts pinned in it, as the server
pins them), overlapped or waiting steps. Each request that is not cancelled equals its run
alone in a roomy cache (the same page size and prefill chunk, so the same arithmetic), and
every page comes back. A step that cannot fit even one request raises
:class:`~deft.CacheFullError`; then, without a prefix cache, some request must fail alone
too (with one, a prompt that forks mid-page from an entry takes a page more than alone).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from conftest import run_batch
from deft import CacheFullError
from deft.engine import NgramDrafter, SamplingParams, TreeEngine
from deft.engine.beams import BeamParams
from deft.engine.decoding import Batch, Request
from deft.engine.speculation import SpecParams
from deft.model import load_random

pytest.importorskip("fastapi")
from deft.serve import PrefixCache  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_random("random:tiny")


def random_spec(rng: random.Random, shared: list[int]) -> tuple:
    """``(kind, prompt, n, params, beam)`` of a random request; prompts may share a prefix."""
    kind = rng.choice(["sample", "sample", "beam", "speculative"])
    prompt = shared[:rng.randint(0, len(shared))] + [rng.randrange(3, 2000) for _ in range(rng.randint(1, 40))]
    new = rng.randint(1, 12)
    if kind == "sample":
        temp = rng.choice([0.0, 0.8])
        params = SamplingParams(max_new_tokens=new, temperature=temp, seed=rng.randrange(1 << 30) if temp else None)
        return kind, prompt, rng.randint(1, 3), params, None
    if kind == "beam":
        k = rng.randint(2, 3)
        beam = BeamParams(k, new, rng.choice([0.5, 1.0]), rng.choice([True, False]), rng.randint(1, k), None)
        return kind, prompt, k, SamplingParams(max_new_tokens=new), beam
    return kind, prompt, 1, SamplingParams(max_new_tokens=new), None


def request(spec: tuple, pin: bool = False) -> Request:
    kind, prompt, n, params, beam = spec
    strategy = SpecParams(NgramDrafter(), None) if kind == "speculative" else beam
    return Request(list(prompt), n, params, strategy=strategy, pin_prompt=pin)


def outcome(spec: tuple, req: Request, tokenizer) -> list:  # noqa: ANN001
    """What must be equal: tokens and finish reasons; a beam's hypotheses and scores."""
    if spec[0] == "sample":
        return [(b.tokens, b.finish_reason) for b in req.branches]
    if spec[0] == "beam":
        return [(h.token_ids, h.score) for h in req.search.results(tokenizer, {"seconds": 1.0, "steps": 1})]
    return [(req.search.tokens, None)]


def assert_same(got: list, want: list, what: str) -> None:
    """Equal, but for a beam score's last bits (its rows sit in other batches)."""
    assert [g[0] for g in got] == [w[0] for w in want], what
    for (_, a), (_, b) in zip(got, want):
        assert a == b if isinstance(a, (str, type(None))) else abs(a - b) < 1e-3, what


def run_alone(model, spec: tuple, pages: int, page: int, chunk: int) -> list:  # noqa: ANN001
    engine = TreeEngine(*model, num_pages=pages, page_size=page, prefill_chunk=chunk)
    batch, req = Batch(engine), request(spec)
    batch.add(req)
    run_batch(batch)
    return outcome(spec, req, model[1])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_random_requests_equal_their_solo_runs_and_free_every_page(tiny, seed):
    rng = random.Random(seed)
    page, pages, chunk = rng.choice([4, 8, 16]), rng.randint(6, 40), rng.choice([4, 16, 64])
    engine = TreeEngine(*tiny, num_pages=pages, page_size=page, prefill_chunk=chunk)
    prefixes = PrefixCache(engine.cache) if rng.random() < 0.5 else None
    batch = Batch(engine, max_running=rng.choice([None, 1, 2]), prefixes=prefixes,
                  overlap=rng.random() < 0.5)
    shared = [rng.randrange(3, 2000) for _ in range(rng.randint(0, 30))]
    specs = [random_spec(rng, shared) for _ in range(rng.randint(1, 5))]
    joins = sorted(rng.randint(0, 6) for _ in specs)
    cancels = {i: rng.randint(0, 8) for i in range(len(specs)) if rng.random() < 0.2}
    reqs: list[Request | None] = [None] * len(specs)
    cancelled, step = set(), 0
    try:
        while True:
            for i, at in enumerate(joins):
                if at == step:
                    reqs[i] = request(specs[i], prefixes is not None)
                    batch.add(reqs[i])
            for i, at in cancels.items():
                if at == step and reqs[i] is not None and reqs[i].status != "done":
                    batch.cancel(reqs[i])
                    cancelled.add(i)
            step += 1
            if not batch.step() and step > joins[-1]:
                break
            assert step < 1000
    except CacheFullError:
        batch.close()
        if prefixes is None:  # (a prompt forked mid-page from an entry takes a page more)
            fits = []
            for spec in specs:
                try:
                    run_alone(tiny, spec, pages, page, chunk)
                    fits.append(True)
                except CacheFullError:
                    fits.append(False)
            assert not all(fits), "the batch ran out of pages though every request fits alone"
    else:
        for i, (spec, req) in enumerate(zip(specs, reqs)):
            if i not in cancelled:
                assert_same(outcome(spec, req, tiny[1]), run_alone(tiny, spec, 256, page, chunk),
                            f"request {i} ({spec[0]})")
    if prefixes is not None:
        prefixes.clear()
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == pages
