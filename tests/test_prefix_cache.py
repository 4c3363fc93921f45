"""The server's prefix cache finds what comparing the prompt with every entry finds, by its
block index, also when the index's hashes collide; it keeps a request's one answer for the
next chat turn; and with its idle pages, the pages on running requests' paths are counted
from the allocator's counts, as a recount over the paths finds."""

import random

import pytest

pytest.importorskip("fastapi")  # deft.serve's package imports its app
from conftest import pages_on_running_paths, run_batch  # noqa: E402
from deft.cache import CacheFullError, TreeKVCache  # noqa: E402
from deft.engine import NgramDrafter, SamplingParams, TreeEngine, generate  # noqa: E402
from deft.engine.beams import BeamParams  # noqa: E402
from deft.engine.speculation import SpecParams  # noqa: E402
from deft.engine.decoding import Batch, Request  # noqa: E402
from deft.model import load_random  # noqa: E402
from deft.serve import PrefixCache  # noqa: E402
from deft.serve.scheduler import pages_on_paths  # noqa: E402


def _scan(entries: list[list[int]], tokens: list[int], min_tokens: int) -> int:
    """The longest prefix of ``tokens[:-1]`` any entry holds (0 below ``min_tokens``)."""
    best = 0
    for path in entries:
        n = 0
        while n < min(len(path), len(tokens) - 1) and path[n] == tokens[n]:
            n += 1
        best = max(best, n)
    return best if best >= min_tokens else 0


@pytest.mark.parametrize("collide", [False, True])
def test_prefix_cache_matches_the_longest_entry(monkeypatch, collide):
    if collide:  # every chain of blocks hashes alike: only the token comparison can tell
        monkeypatch.setattr(PrefixCache, "_chain", lambda self, t, limit: [7] * (
            min(limit, len(t)) // self.min_tokens))
    rng = random.Random(0)
    tree = TreeKVCache(num_pages=4096, page_size=4)
    cache = PrefixCache(tree, min_tokens=4)
    stem = [rng.randrange(3) for _ in range(40)]
    entries = []
    for _ in range(30):
        path = stem[:rng.randrange(0, 40)] + [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        if tuple(path) not in map(tuple, entries):
            entries.append(path)
            cache.insert(path, tree.add_root(len(path)))
    assert len(cache) == len(entries)
    for _ in range(200):
        query = stem[:rng.randrange(0, 41)] + [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        want = _scan(entries, query, cache.min_tokens)
        got = cache.match(query)
        assert (0 if got is None else got[1]) == want
        if got is not None:  # the fork point's path holds exactly the shared tokens
            assert len(tree.path_slots(got[0])) == want
    assert cache.hits > 0


def test_prefix_cache_forgets_evicted_entries():
    tree = TreeKVCache(num_pages=64, page_size=4)
    cache = PrefixCache(tree, min_tokens=4)
    a, b = [1] * 12, [1] * 8 + [2] * 4
    cache.insert(a, tree.add_root(len(a)))
    cache.insert(b, tree.add_root(len(b)))
    again = tree.add_root(len(a))
    cache.insert(list(a), again)  # already held: not a second entry
    assert len(cache) == 2 and again not in cache.pinned
    assert cache.match(b[:10] + [3])[1] == 10
    cache.clear()
    assert len(cache) == 0 and cache.match(a + [3]) is None and tree.live_nodes == [again]


def test_a_waiting_prompt_is_hashed_once_until_the_entries_change(monkeypatch):
    """A prompt looked up again (as a blocked one is, at every step) is not hashed again;
    a new entry, or the loss of the entry it matched, makes it look again and find what a
    first lookup finds."""
    tree = TreeKVCache(num_pages=256, page_size=4)
    cache = PrefixCache(tree, min_tokens=4)
    hashed = []
    chain = PrefixCache._chain
    monkeypatch.setattr(PrefixCache, "_chain",
                        lambda self, t, limit: hashed.append(1) or chain(self, t, limit))
    short, prompt = [1] * 8, [1] * 40 + [5]
    cache.insert(short, short_node := tree.add_root(len(short)))
    assert cache.cached(prompt) == (short_node, 8)
    hashed.clear()
    for _ in range(3):
        assert cache.cached(prompt) == (short_node, 8)
    assert not hashed
    cache.insert([1] * 24, long_node := tree.add_root(24))  # a longer entry: found now
    assert cache.cached(prompt) == (long_node, 24)
    tree.prune(long_node)  # the matched entry's node is gone (no entry added): the next best
    hashed.clear()
    assert cache.cached(prompt) == (short_node, 8) and hashed
    assert cache.cached(prompt + [6]) == cache.cached(list(prompt) + [6]) == (short_node, 8)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_single_answer_stays_cached_for_the_next_turn(smol, overlap):
    """A request's one answer stays in the cache with its prompt: a next turn that repeats
    both prefills only what follows them and decodes as it does without the cache."""
    model, tok = smol
    engine = TreeEngine(model, tok, num_pages=64)
    cache = PrefixCache(engine.cache)
    batch = Batch(engine, prefixes=cache, overlap=overlap)
    first = tok.encode("User: name one colour of the sea on a calm morning.\nAssistant:")
    params = SamplingParams(max_new_tokens=6, stop_token_ids=frozenset())
    a = Request(first, 1, params, pin_prompt=True)
    batch.add(a)
    run_batch(batch)
    answer = a.branches[0].tokens
    turn = first + answer + tok.encode("\nUser: and of the sky?\nAssistant:")
    computed = batch.stats["prefill_tokens"]
    b = Request(turn, 1, params, pin_prompt=True)
    batch.add(b)
    run_batch(batch)
    kept = len(first) + len(answer) - 1  # the answer's last token was never fed
    assert cache.hits == 1 and cache.hit_tokens == kept
    assert batch.stats["prefill_tokens"] - computed == len(turn) - kept
    (ref,) = generate(TreeEngine(model, tok, num_pages=64), [turn], params)
    assert b.branches[0].tokens == ref.token_ids
    two = Request(turn, 2, params, pin_prompt=True)  # two answers: only the prompt is kept
    batch.add(two)
    run_batch(batch)
    assert len(cache) == 4
    cache.clear()
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


@pytest.mark.parametrize("seed", range(12))
def test_the_pages_on_running_paths_are_counted_without_walking_them(seed):
    """Requests that share prefixes (cache hits that fork and split entries, answers kept, next
    turns), with several samples, beams or draft trees, join, are cancelled, preempted or fail
    for pages as the server fails them, while entries are evicted, in random geometries: after
    every step the gauge from the allocator's counts equals a recount over the running paths;
    once all has ended every page in use is the cache's, idle."""
    model, tok = load_random("random:tiny")
    rng = random.Random(seed)
    engine = TreeEngine(model, tok, num_pages=rng.choice([10, 16, 32, 64]), page_size=rng.choice([2, 4, 8]),
                        prefill_chunk=rng.choice([4, 8, 64]))
    cache = PrefixCache(engine.cache, min_tokens=rng.choice([None, 2]), max_entries=rng.choice([3, 100]))
    batch = Batch(engine, max_running=rng.choice([1, 3, 6]), prefixes=cache)
    stems = [tok.encode(s) for s in ("Weather:", "A cat story:", "1, 2, 3,")]
    past: list[list[int]] = []
    for step in range(60):
        if rng.random() < 0.5:
            prompt = rng.choice(stems) + [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
            if past and rng.random() < 0.4:  # the same prompt again, or a next turn
                prompt = rng.choice(past) + [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(5))]
            past.append(prompt)
            kind = rng.random()
            params = SamplingParams(max_new_tokens=rng.randrange(1, 9))
            strategy = (BeamParams(rng.choice([2, 3]), 4) if kind < 0.2 else
                        SpecParams(NgramDrafter(), None) if kind < 0.35 else None)
            batch.add(Request(prompt, rng.choice([1, 1, 2, 3]), params, pin_prompt=True,
                              strategy=strategy))
        if batch.running and rng.random() < 0.1:
            batch.cancel(rng.choice(batch.running))
        try:
            batch.step()
        except CacheFullError:  # what the server does: the running requests fail
            for r in list(batch.running):
                batch.cancel(r)
        assert pages_on_paths(batch, cache) == pages_on_running_paths(batch), step
    for r in list(batch.running) + list(batch.waiting):
        batch.cancel(r)
    run_batch(batch)  # a shared prompt prefix still feeding, though its requests are gone
    assert cache.idle_pages() == engine.cache.allocator.num_used
    cache.clear()
    assert cache.idle_pages() == 0 and engine.cache.live_nodes == []


def test_a_preempted_requests_prompt_entry_is_evicted_for_the_step_that_needs_its_pages():
    """Two pinned prompts fill the cache; the next step is short of a page. Preempting the
    younger request unpins its prompt's entry, which the step then evicts, so the older
    request goes on (instead of a ``CacheFullError``); both equal their runs alone."""
    model, tok = load_random("random:tiny")
    specs = [([214], 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)),
             (list(range(100, 131)), 1, SamplingParams(max_new_tokens=4))]

    def run(pages: int, which: list[int]) -> tuple[list, int]:
        engine = TreeEngine(model, tok, num_pages=pages, page_size=4, prefill_chunk=64)
        prefixes = PrefixCache(engine.cache)
        batch = Batch(engine, prefixes=prefixes)
        reqs = [Request(*specs[i], pin_prompt=True) for i in which]
        batch.add(reqs[0])
        batch.step()
        for r in reqs[1:]:  # joins once the first one runs
            batch.add(r)
        run_batch(batch)
        prefixes.clear()
        assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == pages
        return [[b.tokens for b in r.branches] for r in reqs], batch.stats["preempted"]

    alone = [run(64, [i])[0][0] for i in range(2)]
    got, preempted = run(14, [0, 1])
    assert got == alone and preempted == 1
