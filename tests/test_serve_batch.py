"""The stepwise :class:`~deft.engine.decoding.Batch` and the prefix cache, without HTTP:
requests joining mid-run, a page budget too small for all at once, cancellation, and
cached prompts that are forked (and split) by later requests."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from deft.engine import SamplingParams, TreeEngine, generate  # noqa: E402
from deft.engine.decoding import Batch, Request  # noqa: E402
from deft.serve import PrefixCache  # noqa: E402


def run(batch: Batch, limit: int = 500) -> int:
    steps = 0
    while batch.step():
        steps += 1
        assert steps < limit
    return steps


@pytest.fixture(scope="module")
def prompts(smol):
    _, tok = smol
    return [tok.encode(f"Item {i}: the colour of the sky at dusk is") for i in range(4)]


@pytest.fixture(scope="module")
def alone(smol, prompts):
    """Each prompt's greedy continuation, one at a time in a roomy engine."""
    engine = TreeEngine(*smol, num_pages=64)
    return [generate(engine, [p], SamplingParams(max_new_tokens=10))[0].token_ids for p in prompts]


def test_requests_join_at_any_step_and_equal_their_solo_runs(smol, prompts, alone):
    engine = TreeEngine(*smol, num_pages=64)
    batch = Batch(engine)
    reqs = [Request(p, 1, SamplingParams(max_new_tokens=10)) for p in prompts]
    batch.add(reqs[0])
    for r in reqs[1:]:  # one more request joins every step
        assert batch.step()
        batch.add(r)
    run(batch)
    assert [r.branches[0].tokens for r in reqs] == alone
    assert all(r.status == "done" for r in reqs) and engine.cache.live_nodes == []


def test_a_tiny_page_budget_makes_requests_wait_never_fail(smol, prompts, alone):
    """4 requests needing 2 pages each in 4 pages: they wait or are preempted, all finish right."""
    engine = TreeEngine(*smol, num_pages=4, page_size=16)
    batch = Batch(engine)
    reqs = [Request(p, 1, SamplingParams(max_new_tokens=10)) for p in prompts]
    for r in reqs:
        batch.add(r)
    run(batch)
    assert [r.branches[0].tokens for r in reqs] == alone
    assert engine.cache.num_free_pages == 4 and engine.cache.live_nodes == []


def test_preempted_requests_restart_with_the_same_tokens(smol, prompts):
    """Two requests admitted side by side outgrow 5 pages: the younger is preempted,
    restarts once the older is done, and both equal their solo runs."""
    params = SamplingParams(max_new_tokens=24)
    solo = [generate(TreeEngine(*smol, num_pages=8), [p], params)[0].token_ids for p in prompts[:2]]
    engine = TreeEngine(*smol, num_pages=5, page_size=16)
    batch = Batch(engine)
    reqs = [Request(p, 1, params) for p in prompts[:2]]
    for r in reqs:
        batch.add(r)
    run(batch)
    assert batch.stats["preempted"] >= 1 and reqs[1].restarts >= 1
    assert [r.branches[0].tokens for r in reqs] == solo and engine.cache.num_free_pages == 5


def test_cancel_releases_pages_within_the_step(smol, prompts):
    engine = TreeEngine(*smol, num_pages=32)
    batch = Batch(engine)
    keep, gone = (Request(p, 3, SamplingParams(temperature=1.0, seed=1, max_new_tokens=12)) for p in prompts[:2])
    batch.add(keep)
    batch.add(gone)
    for _ in range(3):
        batch.step()
    assert engine.cache.num_free_pages < 32
    batch.cancel(gone)
    assert all(b.done and b.finish_reason == "cancelled" for b in gone.branches)
    run(batch)
    assert engine.cache.num_free_pages == 32 and keep.status == gone.status == "done"


def test_cancel_mid_prefill(smol, prompts):
    engine = TreeEngine(*smol, num_pages=32, prefill_chunk=4)
    batch = Batch(engine)
    req = Request(prompts[0], 2, SamplingParams(max_new_tokens=5))
    batch.add(req)
    batch.step()
    assert req.root.feed  # still prefilling
    batch.cancel(req)
    assert not batch.step() and engine.cache.live_nodes == []


def test_prefix_cache_forks_from_the_longest_shared_path(smol):
    """A second prompt sharing the first's first 20 tokens forks from them (a split of the
    cached node), computes only its own rest, and decodes exactly as without the cache."""
    model, tok = smol
    engine = TreeEngine(model, tok, num_pages=64)
    cache = PrefixCache(engine.cache)
    batch = Batch(engine, prefixes=cache)
    base = tok.encode("A long shared preamble about the weather, the sea and the mountains of the north")
    first, second = base + tok.encode(" and then rain."), base + tok.encode(" or snow today?")
    params = SamplingParams(max_new_tokens=6)
    a = Request(first, 1, params, pin_prompt=True)
    batch.add(a)
    run(batch)
    assert len(cache) == 1 and engine.cache.live_nodes  # the prompt stays
    computed = batch.stats["prefill_tokens"]
    b = Request(second, 1, params, pin_prompt=True)
    batch.add(b)
    run(batch)
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert cache.hits == 1 and cache.hit_tokens == shared
    assert batch.stats["prefill_tokens"] - computed == len(second) - shared
    ref = TreeEngine(model, tok, num_pages=64)
    assert [a.branches[0].tokens, b.branches[0].tokens] == [
        r.token_ids for r in generate(ref, [first, second], params, max_batch=1)]
    again = Request(second, 2, SamplingParams(temperature=0.8, seed=3, max_new_tokens=4), pin_prompt=True)
    batch.add(again)
    run(batch)
    assert cache.hits == 2 and cache.hit_tokens == shared + len(second) - 1 and len(cache) == 2
    cache.clear()
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


def test_prefix_cache_evicts_unreferenced_entries_when_pages_run_out(smol, prompts, alone):
    engine = TreeEngine(*smol, num_pages=4, page_size=16)
    cache = PrefixCache(engine.cache)
    batch = Batch(engine, prefixes=cache)
    reqs = [Request(p, 1, SamplingParams(max_new_tokens=10), pin_prompt=True) for p in prompts]
    for r in reqs:
        batch.add(r)
    run(batch)
    assert [r.branches[0].tokens for r in reqs] == alone
    assert 0 < len(cache) < len(prompts)  # the oldest prompts made room for the newer ones
    cache.clear()
    assert engine.cache.num_free_pages == 4
