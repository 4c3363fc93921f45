"""Speculative requests in the stepwise :class:`~deft.engine.decoding.Batch`: each step's
draft trees are verified in the forward that carries the other requests' tokens. Every
speculative request must give what it gives alone (greedy: plain greedy decoding's
tokens; seeded sampling: the same tokens run to run), next to sampled requests and beam
searches, on overlapped steps, when preempted; a cancel releases it, and a request that
joins is not held back while one runs. Also :meth:`TreeEngine.forward`, which computes
items and draft trees in one forward.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from conftest import run_batch
from deft.engine import (ModelDrafter, NgramDrafter, SamplingParams, TopKShape, TreeEngine, beam_search,
                         generate, speculative_generate)
from deft.engine.beams import BeamParams
from deft.engine.decoding import Batch, Request
from deft.engine.speculation import SpecParams

run = partial(run_batch, limit=400)
GREEDY = SamplingParams(max_new_tokens=12)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_new_tokens=10)


def spec_request(prompt: list[int], params: SamplingParams, drafter=None, tree=None) -> Request:
    return Request(prompt, 1, params, strategy=SpecParams(drafter or NgramDrafter(), tree))


def outcome(req: Request) -> tuple[list[int], str]:
    return req.search.tokens, req.search.finish_reason


def samples(req: Request) -> list[tuple[list[int], str]]:
    return [(b.tokens, b.finish_reason) for b in req.branches]


def alone(smol, req: Request) -> Request:
    """``req`` run by itself in a roomy engine, on steps that wait."""
    batch = Batch(TreeEngine(*smol, num_pages=64), overlap=False)
    batch.add(req)
    run(batch)
    return req


@pytest.fixture(scope="module")
def repeat(smol):
    """A prompt that prompt lookup drafts well for."""
    return smol[1].encode("one two three four, one two three four, one two three four, one two")


@pytest.fixture(scope="module")
def greedy(smol, repeat):
    """Plain greedy decoding of ``repeat``."""
    (r,) = generate(TreeEngine(*smol, num_pages=64), [repeat], GREEDY)
    return r.token_ids, r.stats["finish_reason"]


@pytest.fixture(scope="module")
def seeded(smol, prompts):
    """The seeded speculative request on ``prompts[3]``, alone."""
    return outcome(alone(smol, spec_request(prompts[3], SEEDED)))


def test_alone_greedy_equals_plain_greedy_and_seeded_repeats(smol, prompts, repeat, greedy, seeded):
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine)
    again = spec_request(prompts[3], SEEDED)
    batch.add(again)
    run(batch)
    assert outcome(again) == seeded and len(seeded[0]) == 10
    spec = spec_request(repeat, GREEDY)
    batch.add(spec)
    steps = run(batch)
    assert outcome(spec) == greedy
    assert sum(spec.search.accepted) > 0 and steps < len(greedy[0])  # drafts were accepted
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


@pytest.mark.parametrize("overlap", [False, True])
def test_next_to_samples_and_beams_each_gives_what_it_gives_alone(smol, prompts, repeat, greedy,
                                                                   seeded, overlap):
    """Two speculative requests, two sampled ones and a beam search share every forward;
    with ``overlap`` the sampled tokens are drawn on the device and land a step later."""
    def sampled() -> list[Request]:
        return [Request(prompts[0], 2, SamplingParams(temperature=1.0, seed=3, max_new_tokens=9)),
                Request(prompts[1], 1, SamplingParams(max_new_tokens=7))]

    solo = [samples(alone(smol, r)) for r in sampled()]
    beam_want = beam_search(TreeEngine(*smol, num_pages=64), prompts[2], 2, 6)[0]
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine, overlap=overlap)
    first = sampled()
    beam = Request(prompts[2], 2, SamplingParams(max_new_tokens=6), strategy=BeamParams(2, 6))
    specs = [spec_request(repeat, GREEDY), spec_request(prompts[3], SEEDED)]
    for r in [*first, beam, *specs]:
        batch.add(r)
    run(batch)
    assert [outcome(r) for r in specs] == [greedy, seeded]
    assert [samples(r) for r in first] == solo
    got = beam.search.results(engine.tokenizer, {})
    assert [h.token_ids for h in got] == [h.token_ids for h in beam_want]
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


def test_a_request_joining_gets_tokens_while_a_speculative_one_runs(smol, prompts, repeat):
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine)
    spec = spec_request(repeat, SamplingParams(max_new_tokens=40, stop_token_ids=frozenset()))
    later = Request(prompts[0], 1, SamplingParams(max_new_tokens=4))
    batch.add(spec)
    for _ in range(2):
        batch.step()
    batch.add(later)
    for _ in range(6):  # its prompt, then a token per step in the speculative request's forwards
        batch.step()
    assert later.status == "done" and not spec.search.done
    run(batch)
    assert later.branches[0].tokens == generate(TreeEngine(*smol, num_pages=64), [prompts[0]],
                                                SamplingParams(max_new_tokens=4))[0].token_ids
    assert len(spec.search.tokens) == 40 and engine.cache.num_free_pages == 64


def test_cancel_mid_run_releases_its_nodes_and_drafter_state(smol, prompts, repeat):
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine)
    other = Request(prompts[0], 1, SamplingParams(max_new_tokens=8))
    drafter = NgramDrafter()
    spec = spec_request(repeat, SamplingParams(max_new_tokens=30), drafter)
    for r in (other, spec):
        batch.add(r)
    while not (spec.search is not None and len(spec.search.tokens) >= 3):
        assert batch.step()
    held = spec.search.nodes
    assert held and drafter._index  # a leaf in the cache, an n-gram index in the drafter
    batch.cancel(spec)
    assert spec.status == "done" and spec.search.nodes == [] and not drafter._index
    assert not set(held) & set(engine.cache.live_nodes)
    run(batch)
    assert samples(other) == samples(alone(smol, Request(prompts[0], 1, SamplingParams(max_new_tokens=8))))
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


@pytest.mark.parametrize("spec_first", [False, True])
def test_a_tight_page_budget_preempts_and_restarts_speculation(smol, prompts, repeat, spec_first):
    """7 pages of 16: a 40-token speculative request (5-token trees) and a 40-token
    sampled one are admitted side by side and outgrow them; the younger is preempted,
    restarts from its prompt, and both equal their runs alone."""
    long = SamplingParams(max_new_tokens=40, stop_token_ids=frozenset())
    seeded = SamplingParams(temperature=1.0, seed=5, max_new_tokens=40, stop_token_ids=frozenset())
    chain = TopKShape(k=1, depth=4, width=1)
    want_spec = outcome(alone(smol, spec_request(repeat, seeded, tree=chain)))
    want_sample = samples(alone(smol, Request(prompts[0], 1, long)))
    engine = TreeEngine(*smol, num_pages=7, page_size=16)
    batch = Batch(engine)
    spec, sample = spec_request(repeat, seeded, tree=chain), Request(prompts[0], 1, long)
    for r in (spec, sample) if spec_first else (sample, spec):
        batch.add(r)
    run(batch)
    assert batch.stats["preempted"] >= 1 and (sample if spec_first else spec).restarts >= 1
    assert outcome(spec) == want_spec and samples(sample) == want_sample
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 7


def test_a_draft_model_out_of_pages_drafts_nothing_and_the_tokens_stay(smol, repeat, greedy):
    """The target as its own drafter, in a draft cache too small for the prompt: every
    step verifies its root alone, and the tokens are still greedy decoding's."""
    tiny = ModelDrafter(TreeEngine(*smol, num_pages=1, page_size=16))
    req = alone(smol, spec_request(repeat, GREEDY, tiny))
    assert outcome(req) == greedy and req.search.drafted == 0
    roomy = ModelDrafter(TreeEngine(*smol, num_pages=16))
    req = alone(smol, spec_request(repeat, GREEDY, roomy))
    assert outcome(req) == greedy and sum(req.search.accepted) > 0
    assert tiny.engine.cache.num_free_pages == 1 and roomy.engine.cache.num_free_pages == 16


def test_forward_computes_items_and_trees_in_one_forward(smol, prompts):
    engine = TreeEngine(*smol, num_pages=16)
    a, b = engine.add_prompt(prompts[0][:-1]), engine.add_prompt(prompts[1][:-1])
    steps = engine.stats["steps"]
    rows, ((ids, logits),) = engine.forward([(a, prompts[0][-1:])], [(b, [-1, 0, 0], prompts[1][-1:] + [5, 6])])
    assert engine.stats["steps"] == steps + 1 and len(ids) == 3 and logits.shape[0] == 3
    ref = TreeEngine(*smol, num_pages=16)
    ra, rb = ref.add_prompt(prompts[0][:-1]), ref.add_prompt(prompts[1][:-1])
    torch.testing.assert_close(rows[0], ref.extend([(ra, prompts[0][-1:])])[0], atol=1e-4, rtol=1e-4)
    _, want = ref.extend_tree(rb, [-1, 0, 0], prompts[1][-1:] + [5, 6])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    free, live = engine.cache.num_free_pages, engine.cache.live_nodes
    with pytest.raises(ValueError, match=r"trees\[0\]: node .* also grows by an item"):
        engine.forward([(a, [1])], [(a, [-1], [2])])
    with pytest.raises(ValueError, match=r"trees\[0\] parents\[1\]"):
        engine.forward([(a, [1])], [(ids[1], [-1, 1], [2, 3])])
    assert engine.cache.num_free_pages == free and engine.cache.live_nodes == live



class _Failing(NgramDrafter):
    def draft(self, jobs, params, generator):  # noqa: ANN001
        raise RuntimeError("drafter down")


class _OutOfVocabulary(NgramDrafter):
    """Prompt lookup that also proposes a token id no vocabulary has."""

    def draft(self, jobs, params, generator):  # noqa: ANN001
        super().draft(jobs, params, generator)
        for job in jobs:
            job.grower.tree.add(0, 1 << 40, 0.0)


class _Counting(NgramDrafter):
    """Prompt lookup that records how many jobs each call drafts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def draft(self, jobs, params, generator):  # noqa: ANN001
        self.calls.append(len(jobs))
        return super().draft(jobs, params, generator)


@pytest.mark.parametrize("drafter,error", [(_Failing, "drafter down"),
                                           (_OutOfVocabulary, "outside the target's vocabulary")])
def test_a_failing_drafter_ends_its_request_alone(smol, repeat, greedy, drafter, error):
    """A drafter that raises, or proposes a token outside the vocabulary, ends its own
    request (``error``, nodes released); the request beside it gets what it gets alone, and
    ``speculative_generate`` raises the error."""
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine)
    failing, beside = spec_request(repeat, GREEDY, drafter()), spec_request(repeat, GREEDY)
    for r in (failing, beside):
        batch.add(r)
    run(batch)
    assert error in str(failing.error) and failing.status == "done"
    assert beside.error is None and outcome(beside) == greedy
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64
    with pytest.raises((RuntimeError, ValueError), match=error):
        speculative_generate(engine, [repeat], GREEDY, drafter())
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


def test_requests_sharing_a_drafter_draft_in_one_call(smol, repeat, greedy):
    drafter = _Counting()
    results = speculative_generate(TreeEngine(*smol, num_pages=64), [repeat] * 3, GREEDY, drafter)
    assert [r.token_ids for r in results] == [greedy[0]] * 3
    assert drafter.calls and set(drafter.calls) == {3}  # every step drafts all three at once
