"""The beam step's fused pick (:mod:`deft.engine.beam_pick`) against float64 ``log_softmax``
plus scores, ranked by value then lower flat index: interpreted on CPU (fp32, fp16; tiny
vocabularies, the interpreter sorts slowly), compiled on a GPU (also bf16, Llama 3's vocab);
beam search with it against beam search with PyTorch's pick on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from deft.engine.beam_pick import beam_top, fits  # noqa: E402

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
@pytest.mark.parametrize("rows, vocab, width", [(1, 300, 2), (3, 700, 6)])
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
    """Ties within a chunk, across chunks of one row and across rows, and ``-inf`` entries
    (what top-k filtering leaves) ranked among themselves by index."""
    x = torch.zeros(3, 1500)
    x[0, [1400, 17, 600]] = 3.0  # one row, three equal logits: 17, 600, 1400
    x[1, 5:] = float("-inf")  # five finite entries, then -inf ones by index
    x[2] = x[0]  # the same sums as row 0 (equal scores): row 0's first
    scores = torch.tensor([0.0, -50.0, 0.0])
    indices = check(x.to(DEV), scores.to(DEV), 8)
    assert indices.tolist() == [17, 600, 1400, 3017, 3600, 4400, 0, 1]


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
    from deft.engine import TreeEngine, beam_search
    from deft.engine import beam_pick
    from deft.model.config import LlamaConfig
    from deft.model.synthetic import byte_tokenizer, random_model

    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
    model = random_model(config, "cuda")
    engine = TreeEngine(model, byte_tokenizer(config.vocab_size), num_pages=512)
    prompt = torch.randint(0, config.vocab_size, (40,),
                           generator=torch.Generator().manual_seed(beams)).tolist()

    def run() -> list[tuple[list[int], float]]:
        hyps = beam_search(engine, prompt, beams, 12, num_return_sequences=beams)[0]
        return [(h.token_ids, h.score) for h in hyps]

    fused = run()
    monkeypatch.setattr(beam_pick, "fits", lambda logits, width: False)
    plain = run()
    assert [t for t, _ in fused] == [t for t, _ in plain]
    np.testing.assert_allclose([s for _, s in fused], [s for _, s in plain], rtol=1e-5)
