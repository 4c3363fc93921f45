"""Beam searches in the stepwise :class:`~deft.engine.decoding.Batch`: each step's beam
tokens share the forward with sampled branches and prompt chunks. Every search must
return what :func:`~deft.engine.beam_search` returns alone (the same hypotheses and
finish reasons; scores up to the float32 rounding of a larger forward), whether it joins
mid-run, is preempted and restarted, or shares overlapped steps; a cancel releases it.
"""

from __future__ import annotations

from functools import partial

import pytest

from conftest import run_batch
from deft import CacheFullError
from deft.engine import SamplingParams, TreeEngine, beam_search, generate
from deft.engine.decoding import Batch, Request
from deft.engine.beams import BeamParams

BEAMS = [BeamParams(3, 6, 0.5, True, 2), BeamParams(2, 8, 1.0, "never", 2)]
run = partial(run_batch, limit=400)


def hypotheses(results) -> list[tuple[list[int], str]]:
    return [(r.token_ids, r.stats["finish_reason"]) for r in results]


def assert_alone(got, want) -> None:
    assert hypotheses(got) == hypotheses(want)
    assert [r.score for r in got] == pytest.approx([r.score for r in want], abs=1e-4)
    assert [r.stats["sum_logprob"] for r in got] == pytest.approx(
        [r.stats["sum_logprob"] for r in want], abs=1e-4)


def beam_request(prompt: list[int], params: BeamParams) -> Request:
    return Request(prompt, params.num_beams, SamplingParams(max_new_tokens=params.max_new_tokens),
                   strategy=params)


def results(engine: TreeEngine, req: Request):
    return req.search.results(engine.tokenizer, {})


@pytest.fixture(scope="module")
def alone(smol, prompts):
    """Each ``BEAMS`` search on its prompt, run alone by ``beam_search``."""
    engine = TreeEngine(*smol, num_pages=64)
    return [beam_search(engine, prompts[2 + i], p.num_beams, p.max_new_tokens, p.length_penalty,
                        p.early_stopping, p.num_return_sequences)[0] for i, p in enumerate(BEAMS)]


def sampled(prompts) -> list[Request]:
    return [Request(prompts[0], 2, SamplingParams(temperature=1.0, seed=3, max_new_tokens=9)),
            Request(prompts[1], 1, SamplingParams(max_new_tokens=5))]


@pytest.fixture(scope="module")
def sampled_alone(smol, prompts):
    out = []
    for r in sampled(prompts):
        batch = Batch(TreeEngine(*smol, num_pages=64), overlap=False)
        batch.add(r)
        run(batch)
        out.append([(b.tokens, b.finish_reason) for b in r.branches])
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_beams_joining_a_running_batch_equal_beam_search_alone(smol, prompts, alone, sampled_alone,
                                                               overlap):
    """Two searches join two sampled requests at step 2; with ``overlap`` the sampled tokens
    are drawn on the device and land a step later, next to the beams' synchronous steps."""
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine, overlap=overlap)
    first = sampled(prompts)
    beams = [beam_request(prompts[2 + i], p) for i, p in enumerate(BEAMS)]
    for r in first:
        batch.add(r)
    run(batch, join=beams)
    for req, want in zip(beams, alone):
        assert_alone(results(engine, req), want)
    assert [[(b.tokens, b.finish_reason) for b in r.branches] for r in first] == sampled_alone
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


@pytest.mark.parametrize("beam_first", [False, True])
def test_a_tight_page_budget_preempts_and_restarts_beams_or_samples(smol, prompts, alone, beam_first):
    """7 pages: a search and a 40-token request outgrow them side by side; the younger is
    preempted, restarts from its prompt once the older is done, and both equal their solo runs."""
    params = SamplingParams(max_new_tokens=40)
    solo = beam_search(TreeEngine(*smol, num_pages=64), prompts[1], 3, 6, 0.5, True, 2)[0]
    (greedy,) = generate(TreeEngine(*smol, num_pages=64), [prompts[0]], params)
    engine = TreeEngine(*smol, num_pages=7, page_size=16)
    batch = Batch(engine)
    beam, sample = beam_request(prompts[1], BEAMS[0]), Request(prompts[0], 1, params)
    for r in (beam, sample) if beam_first else (sample, beam):
        batch.add(r)
    run(batch)
    assert batch.stats["preempted"] >= 1 and (sample if beam_first else beam).restarts >= 1
    assert_alone(results(engine, beam), solo)
    assert sample.branches[0].tokens == greedy.token_ids
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 7


def test_a_beam_request_is_admitted_only_when_it_fits(smol, prompts):
    engine = TreeEngine(*smol, num_pages=7, page_size=16)
    batch = Batch(engine)
    sample = Request(prompts[0], 4, SamplingParams(temperature=1.0, seed=1, max_new_tokens=3))
    beam = beam_request(prompts[1], BEAMS[0])
    batch.add(sample)
    batch.add(beam)
    batch.step()
    assert sample.status == "running" and beam.status == "waiting"  # 1 + 1 + 4 + 3 > 7 pages
    run(batch)
    assert beam.status == "done" and beam.restarts == 0 and len(results(engine, beam)) == 2
    assert engine.cache.num_free_pages == 7


def test_cancelling_a_search_releases_all_its_nodes(smol, prompts, sampled_alone):
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine)
    first = sampled(prompts)
    beam = beam_request(prompts[2], BEAMS[0])
    for r in first + [beam]:
        batch.add(r)
    while not (beam.search is not None and beam.search.running and len(beam.search.running[0].tokens) >= 2):
        assert batch.step()
    beams = set(beam.search.nodes)
    batch.cancel(beam)
    assert beam.status == "done" and beam.search.running == []
    live = set(engine.cache.live_nodes)
    assert not live & beams
    assert live == {n for r in first for b in r.branches if not b.done
                    for n in [b.node, *ancestors(engine, b.node)]}  # only the others' paths
    run(batch)
    assert [[(b.tokens, b.finish_reason) for b in r.branches] for r in first] == sampled_alone
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


def test_a_step_that_raises_leaves_the_beam_tokens_to_feed_again(smol, prompts, alone, monkeypatch):
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine)
    beam = beam_request(prompts[2], BEAMS[0])
    batch.add(beam)
    forward, calls = engine.forward, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:  # a beam step's forward
            raise CacheFullError(1, 0)
        return forward(*args, **kw)

    monkeypatch.setattr(engine, "forward", flaky)
    with pytest.raises(CacheFullError):
        run(batch)
    run(batch)
    assert_alone(results(engine, beam), alone[0])
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


def ancestors(engine: TreeEngine, node: int) -> list[int]:
    out = []
    while (node := engine.cache.parent(node)) >= 0:
        out.append(node)
    return out
