"""The beam step's fused pick (:mod:`deft.engine.beam_pick`) against float64 ``log_softmax``
plus scores, ranked by value then lower flat index: interpreted on CPU (fp32, fp16; rows of
one to three 2,048-entry chunks, the interpreter sorts slowly), compiled on a GPU (also bf16,
Llama 3's vocab); the kernels' limits; beam search with it against beam search with
PyTorch's pick on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from deft.engine.beam_pick import _shape, beam_top, fits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def reference(x: torch.Tensor, scores: torch.Tensor, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``width`` best float64 sums and their flat indices, equal sums by lower index."""
    acc = (torch.log_softmax(x.double(), -1) + scores.double()[:, None]).reshape(-1).cpu().numpy()
    order = np.lexsort((np.arange(acc.shape[0]), -acc))[:width]
    return acc[order], order


def check(x: torch.Tensor, scores: torch.Tensor, width: int) -> np.ndarray:
    out = beam_top(x, scores, width)
    assert out.dtype == torch.float64 and out.shape == (2, width)
    values, indices = out.cpu().numpy()
    want_values, want_indices = reference(x, scores, width)
    assert indices.tolist() == want_indices.tolist()
    np.testing.assert_allclose(values, want_values, atol=2e-5, rtol=1e-6)
    return indices


def random_pick(dtype: torch.dtype, rows: int, vocab: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab + width)
    x = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(DEV)
    scores = (-10 * torch.rand(rows, generator=gen)).to(DEV)
    check(x, scores, width)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, width", [(1, 300, 2), (3, 700, 6), (2, 4500, 8),
                                                (2, 300, 1)])
def test_picks_match_the_reference(dtype, rows, vocab, width):
    random_pick(dtype, rows, vocab, width)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, width", [(4, 128256, 8), (16, 128256, 32),
                                                (16, 128256, 64), (2, 5000, 96)])
def test_picks_match_the_reference_at_llama3_sizes(dtype, rows, vocab, width):
    """Llama 3's vocab (63 chunks a row), widths to 64, and a width that pads to 128;
    bf16 logits hold many ties, ranked by index."""
    random_pick(dtype, rows, vocab, width)


def test_equal_sums_go_to_the_lower_flat_index():
    """Ties in three chunks of a row (4,500 entries), ties across rows, -0.0 beside 0.0, and
    ``-inf`` entries (what top-k filtering leaves) ranked among themselves by index."""
    x = torch.zeros(3, 4500)
    x[0, [4400, 17, 2100]] = 3.0  # three equal logits in three chunks: 17, 2100, 4400
    x[1, 5:] = float("-inf")  # five finite entries: sums -log(5), first of all
    x[2] = x[0]  # the same sums as row 0 (equal scores): row 0's first
    indices = check(x.to(DEV), torch.zeros(3, device=DEV), 11)
    assert indices.tolist() == [4500, 4501, 4502, 4503, 4504, 17, 2100, 4400, 9017, 11100, 13400]
    x = torch.full((1, 4500), float("-inf"))
    x[0, [3000, 10]] = 1.0
    assert check(x.to(DEV), torch.zeros(1, device=DEV), 5).tolist() == [10, 3000, 0, 1, 2]
    x = torch.zeros(1, 300)
    x[0, :2] = -0.0
    x[0, 100] = 5.0
    assert check(x.to(DEV), torch.zeros(1, device=DEV), 4).tolist() == [100, 0, 1, 2]


def test_many_ties_rank_by_index():
    """Integer logits over two chunks a row: every best sum ties with dozens of others."""
    x = torch.randint(-3, 3, (3, 2100), generator=torch.Generator().manual_seed(5))
    check(x.to(torch.float16).to(DEV), torch.tensor([0.0, -0.5, 0.0], device=DEV), 40)


def test_the_kernels_limits():
    """Chunks of 2,048 entries (fewer for a small vocab), each passing on a power of two of
    candidates; at most 4,096 keys a row and in the last launch; flat indices below 2^31."""
    assert _shape(16, 128256, 64) == (2048, 64)  # 63 chunks x 64: 4,032 keys a row
    assert _shape(16, 128256, 65) is None  # x 128: 8,064
    assert _shape(64, 32000, 64) == (2048, 64) and _shape(65, 32000, 64) is None
    assert _shape(3, 300, 6) == (512, 8) and _shape(3, 300, 600) is None  # 1,024 > 512
    assert _shape(2, 300, 500) == (512, 512)  # more than a row holds, fewer than both
    assert _shape(256, 2**22, 1) == (2048, 2) and _shape(512, 2**22, 1) is None  # 2^31 entries
    assert _shape(2, 10, 0) is None and _shape(2, 10, 21) is None
    assert _shape(2, 300, 1) == (512, 2) and _shape(3, 1, 1) is None  # no topk of k=1


def test_what_fits():
    """The fused pick takes CUDA logits whose candidates fit its kernels; PyTorch the rest."""
    assert not fits(torch.zeros(4, 1000), 8)  # on the CPU
    if DEV == "cuda":
        x = torch.zeros(4, 1000, device="cuda")
        assert fits(x, 8) and fits(torch.zeros(16, 128256, device="cuda"), 64)
        assert not fits(x, 5000) and not fits(x[0], 8)  # more than its entries; not 2-D
    with pytest.raises(ValueError, match="do not fit"):
        beam_top(torch.zeros(2, 300, device=DEV), torch.zeros(3, device=DEV), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("beams", [4, 16])
def test_beam_search_picks_as_with_pytorch(monkeypatch, beams):
    """Beam search on a small random Llama on CUDA: the same beams and scores with the fused
    pick as with PyTorch's (the fused one turned off)."""
    from deft.engine import TreeEngine, beam_pick, beam_search
    from deft.model.config import LlamaConfig
    from deft.model.synthetic import byte_tokenizer, random_model

    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
    model = random_model(config, "cuda", dtype=torch.float32)  # few ties for topk to order
    engine = TreeEngine(model, byte_tokenizer(config.vocab_size), num_pages=512)
    prompt = torch.randint(0, config.vocab_size, (40,),
                           generator=torch.Generator().manual_seed(beams)).tolist()

    def run() -> list[tuple[list[int], float]]:
        hyps = beam_search(engine, prompt, beams, 12, num_return_sequences=beams)[0]
        return [(h.token_ids, h.score) for h in hyps]

    calls = []
    monkeypatch.setattr(beam_pick, "beam_top", lambda *a: calls.append(1) or beam_top(*a))
    fused = run()
    ran = len(calls)
    monkeypatch.setattr(beam_pick, "fits", lambda logits, width: False)
    plain = run()
    assert ran and len(calls) == ran  # the fused pick ran, then PyTorch's alone
    assert [t for t, _ in fused] == [t for t, _ in plain]
    np.testing.assert_allclose([s for _, s in fused], [s for _, s in plain], rtol=1e-5)
