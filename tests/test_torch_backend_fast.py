"""The torch backend's one-tile path (``run`` without lse and with it) against the
float64 dense reference."""

import numpy as np
import pytest
import torch

from conftest import assert_close, assert_lse_close, random_forest, random_qkv, to_paged
from deft import PLAN_KINDS, TreeAttention, TreeLayout
from deft.ops.reference import reference_attention
from deft.ops.torch_backend import TorchBackend, _Dense

SMOLLM = (9, 3, 64)  # query heads, KV heads, head dim: GQA ratio 3


def planned(layout: TreeLayout, h_q: int, h_kv: int, d: int, kind: str = "flatten") -> TreeAttention:
    attn = TreeAttention(h_q, h_kv, d, backend="torch", plan_kind=kind)
    attn.plan(layout)
    assert isinstance(attn._prepared, _Dense), "expected the one-tile path"
    return attn


def check(layout: TreeLayout, h_q: int, h_kv: int, d: int, dtype: torch.dtype, kind: str = "flatten",
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ``run`` modes against the reference; the output without lse is the one with it."""
    q, k, v = random_qkv(layout, h_q, h_kv, d, dtype, seed)
    attn = planned(layout, h_q, h_kv, d, kind)
    ref_o, ref_lse = reference_attention(q, k, v, layout, attn.sm_scale)
    o_fast = attn.run(q, k, v)
    o, lse = attn.run(q, k, v, return_lse=True)
    for got in (o_fast, o):
        assert got.dtype == dtype and got.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert_close(o_fast, ref_o, dtype, f"{kind} o without lse")
    assert_close(o, ref_o, dtype, f"{kind} o with lse")
    assert_lse_close(lse, ref_lse, kind)
    assert torch.equal(o_fast, o)
    return o_fast, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_random_forests(seed, dtype):
    rng = np.random.default_rng(seed)
    layout = random_forest(rng, int(rng.integers(1, 40)), int(rng.integers(0, 80)),
                           num_roots=int(rng.integers(1, 4)), empty_frac=0.3)
    check(layout, *SMOLLM, dtype, kind=PLAN_KINDS[seed % 3], seed=seed)


@pytest.mark.parametrize("h_q, h_kv", [(9, 3), (4, 4), (8, 1)])
def test_gqa_ratios(h_q, h_kv):
    layout = random_forest(np.random.default_rng(3), 30, 50)
    check(layout, h_q, h_kv, 64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_seeing_nothing(dtype):
    # Query 0 is on an empty root; query 2 on a 7-token root, with kv length 0.
    layout = TreeLayout.from_node_lengths([-1, -1, 1], [0, 7, 5], [0, 2, 1, 1], [0, 5, 0, 7])
    o, lse = check(layout, *SMOLLM, dtype)
    for blind in (0, 2):
        assert torch.all(o[blind] == 0) and torch.all(torch.isneginf(lse[blind]))
    assert torch.all(torch.isfinite(lse[[1, 3]]))


def test_partial_kv_lengths():
    """Chunked prefill: query i sees the first i + 1 tokens of one node."""
    layout = TreeLayout.from_node_lengths([-1], [40], [0] * 40, np.arange(1, 41),
                                          slots=np.arange(99, 59, -1))
    check(layout, *SMOLLM, torch.float32)


def test_float64_stays_exact():
    layout = random_forest(np.random.default_rng(5), 20, 30)
    # Not float32-representable, so any float32 rounding shows.
    q, k, v = (t + 1e-6 * torch.rand_like(t) for t in random_qkv(layout, *SMOLLM, torch.float64))
    attn = planned(layout, *SMOLLM)
    ref_o, ref_lse = reference_attention(q, k, v, layout, attn.sm_scale)
    o, lse = attn.run(q, k, v, return_lse=True)
    assert attn.run(q, k, v).dtype == torch.float64
    torch.testing.assert_close(attn.run(q, k, v), ref_o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(o, ref_o, atol=1e-12, rtol=1e-12)
    assert_lse_close(lse, ref_lse, "float64")


def test_paged_cache_and_strided_query():
    """The engine's inputs: a paged cache and (here) a query sliced out of a wider tensor."""
    layout = random_forest(np.random.default_rng(9), 10, 40)
    q, k, v = random_qkv(layout, *SMOLLM, torch.float32)
    attn = planned(layout, *SMOLLM)
    ref_o, _ = reference_attention(q, k, v, layout, attn.sm_scale)
    wide = torch.cat([q, torch.randn(q.shape[0], 3, q.shape[2])], dim=1)[:, :9]
    assert not wide.is_contiguous()
    assert_close(attn.run(wide, to_paged(k, 16), to_paged(v, 16)), ref_o, torch.float32, "paged")


def test_tiled_steps_without_lse(monkeypatch):
    """Above ``dense_limit`` the output without lse comes from the tiled path, equally exact."""
    monkeypatch.setattr(TorchBackend, "dense_limit", 0)
    layout = random_forest(np.random.default_rng(11), 30, 60)
    q, k, v = random_qkv(layout, *SMOLLM, torch.bfloat16)
    attn = TreeAttention(*SMOLLM, backend="torch")
    attn.plan(layout)
    assert not isinstance(attn._prepared, _Dense)
    ref_o, _ = reference_attention(q, k, v, layout, attn.sm_scale)
    o = attn.run(q, k, v)
    assert_close(o, ref_o, torch.bfloat16, "tiled o without lse")
    assert torch.equal(o, attn.run(q, k, v, return_lse=True)[0])


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_bad_key_reaches_only_the_queries_that_see_it(bad):
    """Two independent sequences in one step: an inf/NaN key of one must not touch the other
    (the mask is applied after the matmul, as in the reference)."""
    layout = TreeLayout.from_node_lengths([-1, -1], [4, 4], [0, 1])
    q, k, v = random_qkv(layout, 4, 2, 16, torch.float16, 3)
    k[5] = bad  # a token of the second sequence
    attn = planned(layout, 4, 2, 16)
    ref_o, ref_lse = reference_attention(q, k, v, layout, attn.sm_scale)
    o, lse = attn.run(q, k, v, return_lse=True)
    assert torch.isfinite(o[0]).all() and torch.isfinite(lse[0]).all()
    assert_close(o[:1], ref_o[:1], torch.float16, "first sequence")
    assert_lse_close(lse[:1], ref_lse[:1], "first sequence")
