"""The fused argmax and log-normaliser of logits rows (:mod:`deft.engine.row_stats`) against
``torch.argmax`` and float64 ``logsumexp``: interpreted on CPU (fp32, fp16), compiled on a
GPU (also bf16), on rows split into one or many chunks, with ties and ``-inf`` entries."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from deft.engine import Sampler, SamplingParams, probabilities  # noqa: E402
from deft.engine.row_stats import row_stats  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def check(x: torch.Tensor, programs: int | None) -> None:
    tokens, logp, lse = row_stats(x, programs)
    ref = x.double()
    want_lse = torch.logsumexp(ref, -1)
    assert tokens.dtype == torch.int64 and logp.dtype == lse.dtype == torch.float32
    assert torch.equal(tokens.cpu(), ref.argmax(-1).cpu())  # the first maximal index
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    want_logp = torch.log_softmax(ref, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), want_logp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, programs", [(1, 1, None), (1, 3000, 1), (1, 5000, 64),
                                                   (3, 4099, None), (7, 1024, 16)])
def test_row_stats_match_torch(dtype, rows, vocab, programs):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(DEV)
    check(x, programs)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_ties_go_to_the_first_index_across_chunks(programs):
    x = torch.zeros(4, 5000)
    x[0, [4999, 17, 3000]] = 2.0  # the first, in index order, is 17
    x[1, [2048, 1024]] = 5.0
    x[2, :] = -1.0  # all tied: index 0
    x[3, [4095, 4096]] = 1.0  # on both sides of a chunk boundary
    tokens, _, _ = row_stats(x.to(DEV), programs)
    assert tokens.tolist() == [17, 1024, 0, 4095]
    check(x.to(DEV), programs)


def test_minus_infinity_entries_and_strided_rows():
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(3, 6000, generator=gen)
    big[0, :5400] = float("-inf")  # what top-k filtering leaves: a few finite entries
    big[1, 1000:] = float("-inf")  # whole chunks of -inf
    x = big[:, 500:5500]  # rows with a stride larger than their length
    assert x.stride(0) == 6000
    check(x.to(DEV), 8)
    tokens, _, lse = row_stats(torch.full((1, 3000), float("-inf"), device=DEV), 4)
    assert tokens.item() == 0 and lse.item() == float("-inf")


def test_rejects_what_it_cannot_reduce():
    with pytest.raises(ValueError, match="rows, vocab"):
        row_stats(torch.zeros(3, 0, device=DEV))
    with pytest.raises(ValueError, match="rows, vocab"):
        row_stats(torch.zeros(3, device=DEV))
    tokens, logp, lse = row_stats(torch.zeros(0, 10, device=DEV))
    assert tokens.shape == logp.shape == lse.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=50, seed=3)])
def test_draws_on_cuda_match_the_torch_formulas(params):
    logits = (3 * torch.randn(6, 128256, device="cuda")).to(torch.bfloat16)
    tokens, logp = Sampler(params, "cuda").draw(logits)
    if params.greedy:
        assert torch.equal(tokens, logits.argmax(-1))
    else:  # the same generator state: the same draws as PyTorch's path
        probs = probabilities(logits, params)
        want = torch.multinomial(probs, 1, generator=Sampler(params, "cuda").generator).squeeze(-1)
        assert torch.equal(tokens, want)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, ref, atol=1e-4, rtol=1e-5)
