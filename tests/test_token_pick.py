"""Fused token picks from logits rows (:mod:`deft.engine.token_pick`) against
``torch.argmax`` and float64 ``logsumexp``: interpreted on CPU (fp32, fp16), compiled on a
GPU (also bf16), on rows split into one or many chunks, with ties and ``-inf`` entries;
temperature samples against the softmax distribution on a GPU (too many draws for the
interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from deft.engine import Sampler, SamplingParams, probabilities  # noqa: E402
from deft.engine.token_pick import pick  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def check(x: torch.Tensor, programs: int | None, temperature: float = 0.0) -> torch.Tensor:
    tokens, logp, lse = pick(x, temperature, 7, programs)
    ref = x.double()
    assert tokens.dtype == torch.int64 and logp.dtype == lse.dtype == torch.float32
    if temperature == 0:
        assert torch.equal(tokens.cpu(), ref.argmax(-1).cpu())  # the first maximal index
    torch.testing.assert_close(lse.double(), torch.logsumexp(ref, -1), atol=1e-5, rtol=1e-5)
    want_logp = torch.log_softmax(ref, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), want_logp, atol=1e-5, rtol=1e-5)
    return tokens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, programs", [(1, 1, None), (1, 3000, 1), (1, 5000, 64),
                                                   (3, 4099, None), (7, 1024, 16)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_picks_match_torch(dtype, rows, vocab, programs, temperature):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(DEV)
    check(x, programs, temperature)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_ties_go_to_the_first_index_across_chunks(programs):
    x = torch.zeros(5, 5000)
    x[0, [4999, 17, 3000]] = 2.0  # the first, in index order, is 17
    x[1, [2048, 1024]] = 5.0
    x[2, :] = -1.0  # all tied: index 0
    x[3, [4095, 4096]] = 1.0  # on both sides of a chunk boundary
    x[4, 1:] = float("-inf")  # index 0 is the one finite entry; other chunks are all -inf
    tokens, _, _ = pick(x.to(DEV), 0.0, 0, programs)
    assert tokens.tolist() == [17, 1024, 0, 4095, 0]
    check(x.to(DEV), programs)


def test_minus_infinity_entries_and_strided_rows():
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(3, 6000, generator=gen)
    big[0, :5400] = float("-inf")  # what top-k filtering leaves: a few finite entries
    big[1, 1000:] = float("-inf")  # whole chunks of -inf
    x = big[:, 500:5500]  # rows with a stride larger than their length
    assert x.stride(0) == 6000
    check(x.to(DEV), 8)
    sampled = check(x.to(DEV), 8, 1.0)
    assert torch.isfinite(x[torch.arange(3), sampled.cpu()]).all()  # never an -inf entry
    tokens, _, lse = pick(torch.full((1, 3000), float("-inf"), device=DEV), programs=4)
    assert tokens.item() == 0 and lse.item() == float("-inf")


def test_sampled_noise_is_keyed_by_the_seed_not_the_chunking():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3000, generator=gen).to(DEV)
    tokens = pick(x, 1.0, 12345, programs=6)[0]
    assert torch.equal(tokens, pick(x, 1.0, 12345, programs=18)[0])
    assert not torch.equal(tokens, pick(x, 1.0, 54321, programs=6)[0])


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30, 1e-12])
def test_a_tiny_temperature_picks_the_argmax(temperature):
    """``logit / T`` overflows float32 for a tiny ``T`` (every positive logit at inf: the
    first of them won); the draw must tend to the argmax, as ``softmax(x / T)`` does."""
    gen = torch.Generator().manual_seed(3)
    x = (30 * torch.randn(4, 3000, generator=gen)).to(DEV)
    x[:, 0] = 1.0  # a positive logit that is not the maximum, first in every row
    tokens = check(x, 8, temperature)
    assert torch.equal(tokens.cpu(), x.argmax(-1).cpu())
    probs = probabilities(x, SamplingParams(temperature=temperature))
    assert torch.equal(probs, torch.zeros_like(probs).scatter_(-1, x.argmax(-1, keepdim=True), 1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_temperature_samples_follow_the_softmax():
    """Many rows of the same logits, one draw each: the counts match ``softmax(x / T)``
    (a chi-square bound far in the tail)."""
    rows, temperature = 100_000, 0.8
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, -0.5] * 400)[None]  # 3200
    logits[0, 8:] = float("-inf")  # 8 live tokens, the rest over several chunks
    x = logits.expand(rows, -1).contiguous().to(DEV)
    tokens = pick(x, temperature, 12345)[0].cpu()
    p = torch.softmax(logits[0, :8].double() / temperature, 0)
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[8:].sum() == 0
    chi2 = float(((counts[:8] - rows * p) ** 2 / (rows * p)).sum())
    assert chi2 < 30.0, f"chi-square {chi2:.1f} with 7 degrees of freedom"  # p ~ 1e-4


def test_rejects_what_it_cannot_pick_from():
    with pytest.raises(ValueError, match="rows, vocab"):
        pick(torch.zeros(3, 0, device=DEV))
    with pytest.raises(ValueError, match="rows, vocab"):
        pick(torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="temperature"):
        pick(torch.zeros(3, 4, device=DEV), -1.0)
    tokens, logp, lse = pick(torch.zeros(0, 10, device=DEV))
    assert tokens.shape == logp.shape == lse.shape == (0,)


def test_rows_picked_alone_do_not_depend_on_the_others():
    """``alone``: each row chunked as in a call of its own (30 chunks here, where sharing 30
    programs among 6 rows gives 5: the last row's figures then differ in their last bits),
    so its token, log-probability and logsumexp are bitwise those of picking it alone."""
    x = (4 * torch.randn(6, 30000, generator=torch.Generator().manual_seed(0))).to(DEV)
    got = pick(x, programs=30, alone=True)
    for i in range(6):
        for a, b in zip(got, pick(x[i:i + 1], programs=30)):
            assert torch.equal(a[i:i + 1], b)


def test_per_row_draws_equal_each_requests_call_alone():
    """Per-row temperatures, seeds and noise rows: each request's rows (two sampled requests,
    a greedy row, a tiny temperature) draw bitwise what a call of their own draws."""
    x = (3 * torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))).to(DEV)
    got = pick(x, [0.7, 1.5, 0.7, 0.0, 1e-3], [11, 5, 11, 0, 9], programs=6, alone=True,
               noise_rows=[0, 0, 1, 0, 0])
    for rows, temperature, seed in [([0, 2], 0.7, 11), ([1], 1.5, 5), ([3], 0.0, 0),
                                    ([4], 1e-3, 9)]:
        alone = pick(x[rows], temperature, seed, programs=6, alone=True)
        for a, b in zip(got, alone):
            assert torch.equal(a[rows], b)
    assert got[0][3].item() == x[3].argmax().item()
    with pytest.raises(ValueError, match="per-row"):
        pick(x, [0.7] * 5, 3)
    with pytest.raises(ValueError, match="per-row"):
        pick(x, [0.7] * 5, [3] * 4)
    with pytest.raises(ValueError, match="temperature"):
        pick(x, [0.7, -1.0, 0.7, 0.7, 0.7], [3] * 5)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        pick(x, [0.7] * 5, [3, 3, 2**31, 3, 3])
    with pytest.raises(ValueError, match="2\\*\\*31"):
        pick(x, [0.7] * 5, [3] * 5, noise_rows=[0, 1, -1, 2, 3])
    with pytest.raises(ValueError, match="noise_rows"):
        pick(x, 0.7, 3, noise_rows=[0] * 5)


def sampled_requests(monkeypatch, vocab: int) -> tuple[list[Sampler], torch.Tensor, list]:
    """Rows of three sampled requests (one of two rows; one with top-k, one with top-p) and two
    greedy ones, interleaved, with ``draw_rows``' calls recorded; fused picks on any device
    (the interpreter on CPU)."""
    from deft.engine import inflight, sampling

    monkeypatch.setattr(sampling, "_fused", lambda device: True)
    calls = []
    monkeypatch.setattr(inflight, "draw_rows",
                        lambda s, x: calls.append(len(x)) or sampling.draw_rows(s, x))
    hot = [SamplingParams(temperature=0.9, seed=4), SamplingParams(temperature=1.3, top_k=50, seed=5),
           SamplingParams(temperature=0.5, top_p=0.8, seed=6)]
    a, b, c = [Sampler(p, DEV) for p in hot]
    samplers = [a, Sampler(SamplingParams(), DEV), b, a, c, Sampler(SamplingParams(), DEV)]
    rows = (3 * torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))).to(DEV)
    return samplers, rows, calls


def test_sampled_rows_of_several_requests_are_drawn_in_one_call(monkeypatch):
    """Sampled requests, with or without top-k and top-p, share one fused call a step (and
    greedy ones another); each request draws bitwise what it draws alone, step after step (its
    seeds in order)."""
    from types import SimpleNamespace

    from deft.engine.inflight import draw

    samplers, rows, calls = sampled_requests(monkeypatch, 3000)
    fresh = {id(s): Sampler(s.params, DEV) for s in samplers}
    for _ in range(2):
        got = draw([SimpleNamespace(sampler=s, logits=r, top_logprobs=0)
                    for s, r in zip(samplers, rows)], [False] * 6).results()
        assert [r[0].sampler for r in got] == samplers
        for s in dict.fromkeys(samplers):
            mine = [i for i, t in enumerate(samplers) if t is s]
            t, lp = fresh[id(s)].draw(rows[mine])
            assert [got[i][1:3] for i in mine] == list(zip(t.tolist(), lp.tolist()))
    assert calls == [4, 2] * 2


def test_filtered_rows_each_follow_their_own_parameters():
    """``filtered`` with a row's parameters each gives every row bitwise what it gives the
    row alone (``probabilities``, which ``tests/test_engine.py`` checks against
    ``transformers``' warpers): rows with top-p (a full sort) and rows with top-k alone (a
    partial one), each beside rows without filters."""
    from deft.engine.sampling import filtered

    x = (3 * torch.randn(5, 300, generator=torch.Generator().manual_seed(2))).to(DEV)
    with_p = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.6),
              SamplingParams(temperature=2.0, top_k=300)]
    k_alone = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20),
               SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=2.0, top_k=300),
               SamplingParams(temperature=0.5, top_k=299)]
    for params in (with_p, k_alone):
        got = torch.softmax(filtered(x.float(), params), -1)
        for i, p in enumerate(params):
            assert torch.equal(got[i:i + 1], probabilities(x[i:i + 1], p))
    assert torch.equal(probabilities(x[0], with_p[3]), probabilities(x[:1], with_p[3])[0])


def test_filtered_draws_follow_the_filtered_softmax(monkeypatch):
    """Fused draws of top-k and top-p rows (interpreted on CPU): the counts of many rows of
    the same logits match ``probabilities`` (a chi-square bound far in the tail), and nothing
    is drawn that the filters drop."""
    from deft.engine import sampling

    monkeypatch.setattr(sampling, "_fused", lambda device: True)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, -0.5] * 4)[None]
    logits[0, 8:] = float("-inf")
    rows = 100_000 if DEV == "cuda" else 300  # the interpreter: two programs a row, slow
    for params in [SamplingParams(temperature=0.8, top_k=5, seed=1),
                   SamplingParams(temperature=1.2, top_p=0.7, seed=2)]:
        p = probabilities(logits, params)[0].double()
        tokens, _ = Sampler(params, DEV).draw(logits.expand(rows, -1).contiguous().to(DEV))
        counts = torch.bincount(tokens.cpu(), minlength=32).double()
        live = p > 0
        assert counts[~live].sum() == 0 and 2 < live.sum() < 8  # the filters dropped some
        chi2 = float(((counts[live] - rows * p[live]) ** 2 / (rows * p[live])).sum())
        assert chi2 < 30.0, f"{params}: chi-square {chi2:.1f}"


def test_greedy_rows_of_several_samplers_are_drawn_in_one_call(monkeypatch):
    """Rows of different greedy samplers (several requests) share one draw, each as if drawn
    alone; a sampled request's rows take another call, the same draws as alone; the results
    come back in the batch's order. Samplers of different keys are refused in one call."""
    from types import SimpleNamespace

    from deft.engine import inflight, sampling
    from deft.engine.inflight import draw

    calls = []
    monkeypatch.setattr(inflight, "draw_rows",
                        lambda s, x: calls.append(len(x)) or sampling.draw_rows(s, x))
    real = Sampler.draw
    rows = (3 * torch.randn(5, 3000, generator=torch.Generator().manual_seed(1))).to(DEV)
    hot = SamplingParams(temperature=0.9, seed=4)
    greedy, sampled = [Sampler(SamplingParams(), DEV) for _ in range(3)], Sampler(hot, DEV)
    samplers = [greedy[0], sampled, greedy[1], sampled, greedy[2]]
    got = draw([SimpleNamespace(sampler=s, logits=r, top_logprobs=0)
                for s, r in zip(samplers, rows)], [False] * 5).results()
    assert calls == [3, 2]
    assert [r[0].sampler for r in got] == samplers
    for i in (0, 2, 4):
        t, lp = real(Sampler(SamplingParams(), DEV), rows[i:i + 1])
        assert got[i][1:3] == (t.item(), lp.item())
    t, lp = real(Sampler(hot, DEV), rows[[1, 3]])
    assert [got[i][1:3] for i in (1, 3)] == list(zip(t.tolist(), lp.tolist()))
    with pytest.raises(ValueError, match="batch_key"):
        sampling.draw_rows([greedy[0], sampled], rows[:2])


def test_steps_that_wait_draw_every_greedy_request_in_one_call(monkeypatch):
    """``decoding._sample`` (steps that wait for their tokens) groups rows as ``draw`` does:
    three greedy requests and a sampled one take two calls a step, not four."""
    from conftest import run_batch
    from deft.engine import TreeEngine
    from deft.engine.decoding import Batch, Request
    from deft.model import load_random

    engine = TreeEngine(*load_random("random:tiny"), num_pages=64)
    calls = []
    real = Sampler.draw
    monkeypatch.setattr(Sampler, "draw", lambda self, x: calls.append(len(x)) or real(self, x))
    batch = Batch(engine, overlap=False)
    for r in [Request([5 + i, 9, 14], 1, SamplingParams(max_new_tokens=3)) for i in range(3)]:
        batch.add(r)
    batch.add(Request([7, 7], 2, SamplingParams(max_new_tokens=3, temperature=1.0, seed=2)))
    run_batch(batch)
    assert sorted(calls) == [2] * 3 + [3] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_greedy_row_draws_the_same_beside_any_other_rows():
    """On CUDA a greedy draw picks each row as if alone: 32 requests' rows in one call give
    each the token and log-probability, bitwise, that it gets alone."""
    logits = (3 * torch.randn(32, 128256, device="cuda")).to(torch.bfloat16)
    tokens, logp = Sampler(SamplingParams(), "cuda").draw(logits)
    for i in range(32):
        t, lp = Sampler(SamplingParams(), "cuda").draw(logits[i:i + 1])
        assert torch.equal(tokens[i:i + 1], t) and torch.equal(logp[i:i + 1], lp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampled_requests_draw_the_same_in_one_call_on_a_gpu():
    """Eight sampled requests of one to four rows, with and without top-k and top-p, at Llama
    3's vocab in bf16: one call that never waits for the GPU (an overlapped step draws while
    the forward before runs), and each request's tokens and log-probabilities bitwise those
    of its own call."""
    from deft.engine.sampling import draw_rows

    sizes = [1, 4, 2, 1, 3, 1, 2, 1]
    params = [SamplingParams(temperature=0.3 + 0.2 * i, seed=i, top_k=[0, 40][i % 2],
                             top_p=[1.0, 1.0, 0.9, 0.6][i % 4]) for i in range(8)]
    samplers = [Sampler(p, "cuda") for p in params]
    owner = [i for i, n in enumerate(sizes) for _ in range(n)]
    logits = (3 * torch.randn(len(owner), 128256, device="cuda")).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # raises at a call that waits for the GPU
    try:
        tokens, logp = draw_rows([samplers[i] for i in owner], logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, p in enumerate(params):
        mine = [r for r, o in enumerate(owner) if o == i]
        t, lp = Sampler(p, "cuda").draw(logits[mine])
        assert torch.equal(tokens[mine], t) and torch.equal(logp[mine], lp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3),
                                    SamplingParams(temperature=0.8, top_k=50, seed=3),
                                    SamplingParams(temperature=1.2, top_p=0.5, seed=3)])
def test_draws_on_cuda(params):
    """Greedy: the argmax; sampled: fused draws, reproducible with a seed, never outside what
    top-k and top-p keep. Every log-probability is ``log_softmax``'s."""
    logits = (3 * torch.randn(6, 128256, device="cuda")).to(torch.bfloat16)
    tokens, logp = Sampler(params, "cuda").draw(logits)
    if params.greedy:
        assert torch.equal(tokens, logits.argmax(-1))
    else:
        assert torch.equal(tokens, Sampler(params, "cuda").draw(logits)[0])
        assert (probabilities(logits, params).gather(-1, tokens[:, None]) > 0).all()
    ref = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, ref, atol=1e-4, rtol=1e-5)
