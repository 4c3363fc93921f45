"""The stepwise :class:`~deft.engine.decoding.Batch` and the prefix cache, without HTTP:
requests joining mid-run, a page budget too small for all at once, cancellation, and
cached prompts that are forked (and split) by later requests; then the scheduler's jobs
driven from an event loop, and request checks through FastAPI's test client."""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("fastapi")
from pydantic import ValidationError  # noqa: E402

from conftest import pages_on_running_paths, run_batch  # noqa: E402
from deft.engine import NgramDrafter, SamplingParams, TreeEngine, beam_search, generate  # noqa: E402
from deft.engine.decoding import Batch, Request, decode  # noqa: E402
from deft.model import Tokenizer, load_random  # noqa: E402
from deft.serve import Metrics, PrefixCache, Scheduler, create_app  # noqa: E402
from deft.serve.app import _Format  # noqa: E402
from deft.serve.jobs import ChoiceText, Delta, End, Job, TokenLogprob  # noqa: E402
from deft.serve.protocol import CompletionRequest  # noqa: E402

run = run_batch


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
    assert len(cache) == 2 and engine.cache.live_nodes  # the prompt and its one answer stay
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
    assert cache.hits == 2 and cache.hit_tokens == shared + len(second) - 1
    # Two prompts and the first's answer; the second's answer only if a token of it was fed.
    assert len(cache) == 3 + (len(b.branches[0].tokens) > 1)
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


def test_cancelling_the_last_running_request_after_a_preemption_admits_the_waiting_one(smol, prompts):
    engine = TreeEngine(*smol, num_pages=5, page_size=16)
    batch = Batch(engine)
    params = SamplingParams(max_new_tokens=24)
    reqs = [Request(p, 1, params) for p in prompts[:2]]
    for r in reqs:
        batch.add(r)
    while not batch.stats["preempted"]:
        assert batch.step()
    batch.cancel(reqs[0])
    run(batch)
    solo = generate(TreeEngine(*smol, num_pages=8), [prompts[1]], params)[0].token_ids
    assert reqs[1].status == "done" and reqs[1].branches[0].tokens == solo
    assert engine.cache.num_free_pages == 5


def test_an_inserted_prompt_is_never_evicted_before_its_fork(smol, prompts, alone):
    """At ``max_entries`` with the only other entry referenced, the new entry stays."""
    engine = TreeEngine(*smol, num_pages=32)
    cache = PrefixCache(engine.cache, max_entries=1)
    batch = Batch(engine, prefixes=cache)
    reqs = [Request(p, 2, SamplingParams(max_new_tokens=3), pin_prompt=True) for p in prompts[:2]]
    for r in reqs:
        batch.add(r)
    run(batch)
    assert [[b.tokens for b in r.branches] for r in reqs] == [[a[:3]] * 2 for a in alone[:2]]


def _system_and_questions(count: int) -> tuple[list[int], list[list[int]]]:
    """A 200-token system prompt of the random tiny model and ``count`` prompts that extend it."""
    system = list(range(3, 203))
    return system, [system + [300 + i, 400 + i, 500 + i] for i in range(count)]


@pytest.mark.parametrize("cached", [True, False])
def test_prompts_sharing_a_prefix_are_admitted_by_their_unshared_pages(cached):
    """8 prompts of 13 pages each that share 12 of them fit a 40-page pool together; none
    is kept waiting for room it would not use, and a cached system prompt is forked, not
    evicted to admit them (only its questions are computed)."""
    model, tok = load_random("random:tiny")
    engine = TreeEngine(model, tok, num_pages=40, page_size=16)
    prefixes = PrefixCache(engine.cache)
    batch = Batch(engine, prefixes=prefixes)
    system, prompts = _system_and_questions(8)
    if cached:
        batch.add(Request(system + [7], 1, SamplingParams(max_new_tokens=1), pin_prompt=True))
        run(batch)
    computed = batch.stats["prefill_tokens"]
    reqs = [Request(p, 1, SamplingParams(max_new_tokens=4), pin_prompt=True) for p in prompts]
    for r in reqs:
        batch.add(r)
    assert batch.step()
    assert len(batch.running) == 8 and not batch.waiting
    run(batch)
    if cached:
        assert prefixes.hits == 8 and batch.stats["prefill_tokens"] - computed == 8 * 3
    else:
        assert batch.stats["prefill_tokens"] == len(system) + 8 * 3
    ref = TreeEngine(model, tok, num_pages=64, page_size=16)
    assert [r.branches[0].tokens for r in reqs] == [
        g.token_ids for g in generate(ref, prompts, SamplingParams(max_new_tokens=4))]


@pytest.mark.parametrize("seed", range(4))
def test_admission_counts_at_least_the_pages_a_shared_prefill_takes(seed, monkeypatch):
    """Prompts admitted together share a common prefix only as far as all the prompts of a
    first page agree (a late, shorter one shrinks it): the pages admission counts for them
    are never fewer than their prefill takes."""
    rng = random.Random(seed)
    model, tok = load_random("random:tiny")
    engine = TreeEngine(model, tok, num_pages=256, page_size=16)
    batch = Batch(engine)
    system = [rng.randrange(3, 2000) for _ in range(200)]
    prompts = [system[:rng.choice([20, 100, 200])] + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 40))]
               for _ in range(6)] + [[rng.randrange(3, 2000) for _ in range(rng.randrange(2, 30))]]
    counted = []
    room = type(batch.scheduler)._room
    monkeypatch.setattr(type(batch.scheduler), "_room",
                        lambda self, want, spare: counted.append(want) or room(self, want, spare))
    reqs = [Request(p, 1, SamplingParams(max_new_tokens=8)) for p in prompts]
    for r in reqs:
        batch.add(r)
    free = engine.cache.num_free_pages
    while not all(r.branches and (r.branches[0].logits is not None or r.branches[0].tokens) for r in reqs):
        assert batch.step()
    assert len(counted) == len(prompts) - 1  # the first one is admitted unchecked
    assert counted[-1] >= free - engine.cache.num_free_pages


# ------------------------------------------------ the scheduler, its jobs driven without HTTP


def serve(scheduler: Scheduler, specs: list[dict]) -> list[list]:
    """Run one job per ``specs`` entry (``Job`` keyword arguments) on a started ``scheduler``;
    each job's events, up to its ``End``."""
    return serve_groups(scheduler, [specs])


def serve_groups(scheduler: Scheduler, groups: list[list[dict]]) -> list[list]:
    """:func:`serve` for each group in turn, a group submitted once the last one has ended;
    every job's events, in order."""

    async def main() -> list[list]:
        queue, loop = asyncio.Queue(), asyncio.get_running_loop()
        out = []
        for specs in groups:
            jobs = [Job(events=queue, loop=loop, **{"stop": [], **spec}) for spec in specs]
            assert scheduler.submit(jobs)
            events: dict[int, list] = {id(j): [] for j in jobs}
            while not all(evs and isinstance(evs[-1], End) for evs in events.values()):
                job, ev = await asyncio.wait_for(queue.get(), 60)
                events[id(job)].append(ev)
            out += [events[id(j)] for j in jobs]
        return out

    scheduler.start()
    try:
        return asyncio.run(main())
    finally:
        scheduler.stop()


def sample(prompt: list[int], tokens: int = 4) -> dict:
    return {"prompt": prompt, "n": 1, "params": SamplingParams(max_new_tokens=tokens)}


class _Boom(NgramDrafter):
    def draft(self, jobs, params, generator):  # noqa: ANN001
        raise RuntimeError("boom")


def test_speculative_jobs_stream_in_the_batch_and_a_failing_drafter_fails_alone(smol, prompts):
    """A speculative job streams its accepted tokens next to a sampling job; a job whose
    drafter raises fails (500) alone: the job decoding next to it gets its whole answer,
    the pages come back, and the scheduler goes on with the next job."""
    engine = TreeEngine(*smol, num_pages=32)
    scheduler = Scheduler(engine, 4, 8, Metrics(), drafters={"ngram": NgramDrafter, "boom": _Boom})
    greedy = SamplingParams(max_new_tokens=12)

    def spec(drafter: str) -> dict:
        return {"prompt": prompts[0], "n": 1, "params": greedy, "kind": "speculative",
                "options": {"drafter": drafter, "tree": None}}

    streamed, ok, failed, beside, after = serve_groups(scheduler, [
        [spec("ngram"), sample(prompts[1])], [spec("boom"), sample(prompts[3], 8)], [sample(prompts[2])]])
    (want,) = generate(TreeEngine(*smol, num_pages=64), [prompts[0]], greedy)
    assert "".join(e.text for e in streamed[:-1]) == want.text and len(streamed) > 3  # as it comes
    assert streamed[-1].completion_tokens == len(want.token_ids) and streamed[-2].finish_reason == "length"
    assert ok[-1].error is None and ok[-1].completion_tokens == 4
    assert failed[-1].error == (500, "internal error: RuntimeError: boom")
    (solo,) = generate(TreeEngine(*smol, num_pages=64), [prompts[3]], SamplingParams(max_new_tokens=8))
    assert beside[-1].error is None and "".join(e.text for e in beside[:-1]) == solo.text
    assert after[-1].error is None and after[-1].completion_tokens == 4
    scheduler.prefixes.clear()
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 32


def test_overlapped_steps_stream_what_waiting_steps_stream(smol, prompts, alone):
    """The scheduler on overlapped steps (the CUDA default, forced here): the same text,
    finish reasons and token counts per choice as on steps that wait, with a stop string
    that ends a choice while its next token is in flight, and pages back after."""
    stop = smol[1].decode(alone[1][4:6])
    got = []
    for overlap in (False, True):
        engine = TreeEngine(*smol, num_pages=64, overlap=overlap)
        scheduler = Scheduler(engine, 8, 16, Metrics())
        events = serve(scheduler, [
            sample(prompts[0], 8), {**sample(prompts[1], 10), "stop": [stop]},
            {"prompt": prompts[2], "n": 3,
             "params": SamplingParams(max_new_tokens=6, temperature=1.0, seed=4)}])
        per_choice = []
        for evs in events:
            texts: dict[int, str] = {}
            reasons = {}
            for e in evs[:-1]:
                texts[e.index] = texts.get(e.index, "") + e.text
                reasons[e.index] = e.finish_reason or reasons.get(e.index)
            per_choice.append((texts, reasons, evs[-1].completion_tokens, evs[-1].error))
        got.append(per_choice)
        scheduler.prefixes.clear()
        assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64
    assert got[0] == got[1]
    assert got[1][1][1] == {0: "stop"} and got[1][0][1] == {0: "length"}


def test_beam_jobs_join_the_batch_and_equal_the_library(smol, prompts, alone):
    """Beam jobs (``n`` of ``best_of`` beams, a length penalty, early stopping) between
    sampling jobs: all run in one batch, each beam job's choices equal ``beam_search``'s."""
    engine = TreeEngine(*smol, num_pages=64)
    scheduler = Scheduler(engine, 8, 16, Metrics())
    beams = [{"num_beams": 3, "length_penalty": 0.5, "early_stopping": True},
             {"num_beams": 2, "length_penalty": 1.0, "early_stopping": False}]
    specs = [sample(prompts[0])]
    specs += [{"prompt": prompts[1 + i], "n": 2, "params": SamplingParams(max_new_tokens=5),
               "kind": "beam", "options": o} for i, o in enumerate(beams)]
    specs += [sample(prompts[3])]
    steps = engine.stats["steps"]
    events = serve(scheduler, specs)
    ref = TreeEngine(*smol, num_pages=64)
    for evs, o, p in zip(events[1:3], beams, prompts[1:3]):
        want = beam_search(ref, p, o["num_beams"], 5, o["length_penalty"], o["early_stopping"], 2)[0]
        assert [(e.index, e.text, e.finish_reason) for e in evs[:-1]] == [
            (i, h.text, h.stats["finish_reason"]) for i, h in enumerate(want)]
        assert evs[-1].completion_tokens == sum(len(h.token_ids) for h in want)
    for evs, a in ((events[0], alone[0]), (events[3], alone[3])):
        assert "".join(e.text for e in evs[:-1]) == engine.tokenizer.decode(a[:4])
    assert engine.stats["steps"] - steps < 14  # together: one after another takes 22 or more
    scheduler.prefixes.clear()
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 64


def test_a_request_too_big_for_the_cache_fails_alone(smol, prompts, alone):
    """The request that cannot fit even alone is a 400; the one waiting behind it runs."""
    engine = TreeEngine(*smol, num_pages=3, page_size=16)
    scheduler = Scheduler(engine, 1, 8, Metrics(), prefix_cache=False)
    too_big, ok = serve(scheduler, [sample(prompts[0] * 5), sample(prompts[1])])
    assert too_big[-1].error[0] == 400 and "KV cache is full" in too_big[-1].error[1]
    assert ok[-1].error is None and "".join(e.text for e in ok[:-1]) == engine.tokenizer.decode(alone[1][:4])


def test_an_error_mid_step_releases_every_page(smol, monkeypatch):
    """Two prompts prefilled through a shared root (no request owns it) when a step raises:
    both jobs are a 500 and every page is free again."""
    model, tok = smol
    engine = TreeEngine(model, tok, num_pages=32, prefill_chunk=4)
    scheduler = Scheduler(engine, 4, 8, Metrics())
    base = tok.encode("A long shared preamble about the weather, the sea and the mountains of the north")
    forward, calls = engine.forward, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("flaky")
        return forward(*args, **kw)

    monkeypatch.setattr(engine, "forward", flaky)
    events = serve(scheduler, [sample(base + tok.encode(" and then rain.")),
                               sample(base + tok.encode(" or snow today?"))])
    assert [evs[-1].error for evs in events] == [(500, "internal error: RuntimeError: flaky")] * 2
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 32


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_page_gauges_equal_a_recount_after_every_step(smol, monkeypatch, prefix_cache):
    """``deft_kv_pages_in_use`` and ``deft_kv_pages_requests`` as served, after every step: the
    pages in use, and the pages a recount finds on the running requests' paths, for jobs that
    share a system prompt (cache hits that split entries), with several samples, beams and
    draft trees; none on running paths once all has ended."""
    tok = smol[1]
    engine = TreeEngine(*smol, num_pages=16, page_size=4, prefill_chunk=16)
    scheduler = Scheduler(engine, 3, 16, Metrics(), prefix_cache=prefix_cache,
                          drafters={"ngram": NgramDrafter})
    seen, count, registry = [], scheduler._count, scheduler.metrics.registry

    def count_and_recount() -> None:
        count()
        served = [registry.get_sample_value(f"deft_kv_pages_{m}") for m in ("in_use", "requests")]
        cache = engine.cache
        seen.append((served, [cache.num_pages - cache.num_free_pages, pages_on_running_paths(scheduler.batch)]))

    monkeypatch.setattr(scheduler, "_count", count_and_recount)
    system = tok.encode("You answer in one short sentence. ")
    asks = [system + tok.encode(q) for q in ("Where is Rome?", "Where is Oslo?", "Where is Lima?")]
    greedy, sampled = SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=12, seed=1, temperature=1.0)
    serve_groups(scheduler, [
        [sample(asks[0], 12), {"prompt": asks[1], "n": 2, "params": sampled}],
        [{"prompt": asks[2], "n": 1, "params": greedy, "kind": "beam",
          "options": {"num_beams": 2, "length_penalty": 1.0, "early_stopping": False}},
         {"prompt": asks[0], "n": 1, "params": greedy, "kind": "speculative",
          "options": {"drafter": "ngram", "tree": None}}, sample(asks[1], 8), sample(asks[2], 8)]])
    assert len(seen) > 10 and [s for s in seen if s[0] != s[1]] == []
    assert seen[-1][0][1] == 0
    if prefix_cache:
        assert scheduler.prefixes.hits > 0 and seen[-1][0][0] > 0


# ------------------------------------------------ HTTP shapes, without a running scheduler


@pytest.fixture(scope="module")
def client(smol):
    from fastapi.testclient import TestClient

    engine = TreeEngine(*smol, num_pages=8, page_size=16)
    return TestClient(create_app(Scheduler(engine, 4, 8, Metrics()), "m"))


def test_an_empty_prompt_list_is_a_400_naming_prompt(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_too_many_pages_names_the_server_pages_not_a_flag(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("more than the server's 8 KV pages")


@pytest.mark.parametrize("penalty", [1e20, -33, float("inf")])
def test_length_penalty_is_bounded(penalty):
    with pytest.raises(ValidationError, match="length_penalty"):
        CompletionRequest(model="m", prompt="hi", use_beam_search=True, length_penalty=penalty)


def test_streamed_text_offsets_run_on_across_chunks(smol):
    tok = smol[1]
    fmt = _Format(tok, "text_completion", 0)
    ids = tok.encode("the sky is blue and the sea is green")
    pieces = [tok.decode([t]) for t in ids]
    first, second = (fmt.chunk(Delta(0, "", [TokenLogprob(t, -1.0, []) for t in part]))
                     for part in (ids[:3], ids[3:]))
    assert first["logprobs"]["text_offset"][0] == 0
    assert second["logprobs"]["text_offset"][0] == len("".join(pieces[:3]))
    assert fmt.chunk(Delta(1, "", [TokenLogprob(ids[0], -1.0, [])]))["logprobs"]["text_offset"] == [0]


class _WholeText:
    """The reference for :class:`~deft.serve.jobs.ChoiceText`: every update decodes all the
    tokens again (the text, held back at incomplete UTF-8 and possible starts of stop strings)."""

    def __init__(self, tokenizer, stop: list[str]) -> None:  # noqa: ANN001
        self.tokenizer, self.stop, self.sent, self.seen = tokenizer, stop, "", 0

    def update(self, tokens: list[int], final: bool) -> tuple[str, int, bool]:
        new, self.seen = max(0, len(tokens) - self.seen), max(self.seen, len(tokens))
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=None)
        if cut is not None:
            return text[len(self.sent):cut] if cut > len(self.sent) else "", new, True
        if final:
            return text[len(self.sent):], new, False
        safe = len(text.rstrip("\ufffd"))
        safe -= max((k for s in self.stop for k in range(1, min(len(s) - 1, safe) + 1)
                     if text[safe - k:safe] == s[:k]), default=0)
        delta = text[len(self.sent):safe] if safe > len(self.sent) else ""
        self.sent += delta
        return delta, new, False


def _sentencepiece_like() -> Tokenizer:
    """Whole words with a leading ``▁`` and byte tokens, decoded as Llama 2's tokenizer does:
    the first token's leading space dropped, so a piece decodes differently alone."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    words = ["<unk>", "▁the", "▁sky", "▁na", "ïve", "!", "▁", "▁stop", "\n"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(backend, [])


@pytest.mark.parametrize("which", ["smol", "bytes", "sentencepiece"])
def test_choice_text_decodes_piece_by_piece_what_whole_decoding_gives(smol, which):
    """Random token streams (multi-byte characters split across tokens, invalid bytes, special
    tokens, leading spaces), a few tokens per update, with and without stop strings: each
    update's delta, new-token count and stop equal those of decoding all the tokens again."""
    tok = {"smol": lambda: smol[1], "bytes": lambda: load_random("random:tiny")[1],
           "sentencepiece": _sentencepiece_like}[which]()
    rng = random.Random(0)
    words = ["the", " sky", " é", "🙂", " naïve", "\n", " 東京", "!", " stop", "ß"]
    for _ in range(60):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(1, 30)))
        if which == "sentencepiece":  # words, and characters as their UTF-8 bytes (stray bytes
            ids = []                    # would change the text of the bytes before them)
            for _ in range(rng.randrange(1, 30)):
                ids += ([rng.randrange(1, 9)] if rng.random() < 0.6 else
                        [tok.token_id(f"<0x{b:02X}>") for b in rng.choice("é🙂東ß").encode()])
        else:
            ids = tok.encode(text, add_special_tokens=False)
            for _ in range(rng.randrange(0, 4)):  # arbitrary tokens: stray bytes, special tokens
                ids.insert(rng.randrange(len(ids) + 1), rng.randrange(tok.vocab_size))
        stop = rng.choice([[], ["\n"], ["stop", "🙂"], [text[3:9] or "x"], ["é!"], ["y n"]])
        got, want = ChoiceText(tok, stop), _WholeText(tok, stop)
        seen = 0
        while seen < len(ids):
            seen = min(len(ids), seen + rng.choice([1, 1, 2, 3]))
            final = seen == len(ids) and rng.random() < 0.7
            step = got.update(ids[:seen], final)
            assert step == want.update(ids[:seen], final), (ids, stop, seen)
            if step[2] or final:
                break
        else:
            assert got.update(ids, True) == want.update(ids, True)


def test_preempting_requests_that_share_a_prompt_prefix_leaks_no_pages():
    """Requests admitted together share their system prompt's prefix through one branch;
    when all of them are preempted, that branch is released too (it kept feeding and
    holding pages before), so a tight pool finishes and gives every page back."""
    from benchmarks.serve import TEMPERATURE, WIDTH, request_mix, system_prompt
    from deft.engine.beams import BeamParams

    model, tok = load_random("random:tiny")
    for n, size, pages in ((12, 1000, 200), (16, 2000, 512)):
        engine = TreeEngine(model, tok, num_pages=pages, prefill_chunk=256)
        reqs = []
        for q in request_mix(n, 8, system_prompt(size)):
            ids = tok.apply_chat_template(q.messages)
            greedy = q.kind in ("greedy", "beam")
            params = SamplingParams(temperature=0.0 if greedy else TEMPERATURE,
                                    seed=None if greedy else q.seed, max_new_tokens=8)
            beams = BeamParams(WIDTH, 8) if q.kind == "beam" else None
            reqs.append(Request(ids, WIDTH if q.kind in ("n", "beam") else 1, params,
                                pin_prompt=True, strategy=beams))
        prefixes = PrefixCache(engine.cache)
        decode(engine, requests=reqs, max_batch=8, prefixes=prefixes)
        assert all(r.status == "done" for r in reqs)
        prefixes.evict(pages)
        assert engine.cache.num_free_pages == pages, (n, size, engine.cache.live_nodes)
