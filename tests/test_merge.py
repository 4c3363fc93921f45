"""Merge-state API: exactness against attention over the union, algebra, empty states."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deft import merge_state, merge_state_in_place, merge_states

NEG_INF = float("-inf")


def attention_state(q, k, v):
    """(o [H, D], lse [H]) of q [H, D] over k, v [T, H, D] in float64."""
    s = torch.einsum("hd,thd->ht", q, k)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("ht,thd->hd", torch.exp(s - lse[:, None]), v)
    return o, lse


def random_states(n, h=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(h, d, generator=g, dtype=torch.float64),
             (torch.randn(h, generator=g, dtype=torch.float64) * 5)) for _ in range(n)]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), t_a=st.integers(1, 40), t_b=st.integers(1, 40))
def test_merge_equals_attention_over_union(seed, t_a, t_b):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(t_a + t_b, 4, 16, generator=g, dtype=torch.float64) * 3
    v = torch.randn(t_a + t_b, 4, 16, generator=g, dtype=torch.float64)
    o_a, s_a = attention_state(q, k[:t_a], v[:t_a])
    o_b, s_b = attention_state(q, k[t_a:], v[t_a:])
    o, s = merge_state(o_a, s_a, o_b, s_b)
    o_ref, s_ref = attention_state(q, k, v)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(s, s_ref)


def test_commutative_and_associative():
    (a, sa), (b, sb), (c, sc) = random_states(3)
    ab = merge_state(a, sa, b, sb)
    ba = merge_state(b, sb, a, sa)
    torch.testing.assert_close(ab, ba)
    left = merge_state(*ab, c, sc)
    right = merge_state(a, sa, *merge_state(b, sb, c, sc))
    torch.testing.assert_close(left, right)


def test_merge_states_matches_pairwise_fold():
    states = random_states(5, seed=1)
    v = torch.stack([s[0] for s in states])[None]  # [1, 5, H, D]
    s = torch.stack([s[1] for s in states])[None]
    o, lse = merge_states(v, s)
    acc = states[0]
    for st_ in states[1:]:
        acc = merge_state(*acc, *st_)
    torch.testing.assert_close(o[0], acc[0])
    torch.testing.assert_close(lse[0], acc[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_empty_states_merge_without_nan(dtype):
    v = torch.randn(2, 3, 8).to(dtype)
    s = torch.randn(2, 3)
    empty_s = torch.full((2, 3), NEG_INF)
    o, lse = merge_state(v, s, torch.full_like(v, float("nan")), empty_s)
    torch.testing.assert_close(o, v)
    torch.testing.assert_close(lse, s)
    o, lse = merge_state(v, empty_s, v, empty_s)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse)) and o.dtype == dtype
    vs = torch.stack([v, v], dim=1)
    o, lse = merge_states(vs, torch.stack([empty_s, empty_s], dim=1))
    assert not torch.isnan(o).any() and torch.all(torch.isneginf(lse))


def test_merge_states_of_zero_states_is_empty():
    for dtype in (torch.float32, torch.float64):
        o, lse = merge_states(torch.randn(3, 0, 2, 8, dtype=dtype), torch.zeros(3, 0, 2, dtype=dtype))
        assert o.shape == (3, 2, 8) and lse.shape == (3, 2) and o.dtype == dtype
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_invalid_lse_propagates_nan(bad):
    """An lse of +inf or NaN is not a state: the merge gives NaN, never an invented value."""
    v, s = torch.randn(2, 3, 8), torch.randn(2, 3)
    s_bad = s.clone()
    s_bad[0, 1] = bad
    for o, lse in (merge_state(v, s_bad, v, s), merge_state(v, s, v, s_bad), merge_state(v, s_bad, v, s_bad),
                   merge_states(torch.stack([v, v], dim=1), torch.stack([s, s_bad], dim=1))):
        assert torch.isnan(o[0, 1]).all() and torch.isnan(lse[0, 1]), (o[0, 1], lse[0, 1])
        finite = torch.ones(2, 3, dtype=torch.bool)
        finite[0, 1] = False
        assert torch.isfinite(o[finite]).all() and torch.isfinite(lse[finite]).all()
    a, sa = v.clone(), s_bad.clone()
    merge_state_in_place(a, sa, v, s)
    assert torch.isnan(a[0, 1]).all() and torch.isnan(sa[0, 1])


def test_in_place():
    (a, sa), (b, sb) = random_states(2, seed=2)
    expect = merge_state(a, sa, b, sb)
    merge_state_in_place(a, sa, b, sb)
    torch.testing.assert_close((a, sa), expect)


def test_low_precision_outputs_keep_dtype():
    v = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    s = torch.randn(4, 2)
    o, lse = merge_state(v, s, v, s)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(lse, s + torch.log(torch.tensor(2.0)))


def test_errors():
    v, s = torch.randn(2, 3, 8), torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"s_a: expected shape \(2, 3\)"):
        merge_state(v, s[:1], v, s)
    with pytest.raises(ValueError, match=r"v_b: expected shape \(2, 3, 8\) like v_a"):
        merge_state(v, s, v[:1], s[:1])
    with pytest.raises(TypeError, match="expected float tensors"):
        merge_state(v.int(), s, v, s)
    with pytest.raises(ValueError, match=r"v: expected 4 dimensions \[N, S, H, D\]"):
        merge_states(v, s)
