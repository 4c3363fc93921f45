"""The torch backend's step planning: the compiled planner's flatten tiles and visibility
masks against the Python specification, and whole steps planned either way against the
float64 dense reference."""

import dataclasses
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from benchmarks.trees import fan_layout, few_shot_layout, shuffle_slots
from conftest import assert_close, assert_lse_close, random_forest, random_qkv
from deft import PLAN_KINDS, TreeLayout, make_plan
from deft.ops import Heads
from deft.ops.reference import reference_attention
from deft.ops.torch_backend import TorchBackend, _Dense
from deft.plan import TreePlan, compiled, visible
from deft.plan.packing import mask_from

needs_lib = pytest.mark.skipif(compiled.load_library() is None,
                               reason="the compiled planner was not built")

LAYOUTS = {
    "fan": shuffle_slots(fan_layout(300, 40), seed=1, num_slots=500),
    "few-shot": few_shot_layout(100, 6, 17),
    "partial lens, several per node": TreeLayout.from_node_lengths(
        [-1, 0, 0, 1], [20, 7, 0, 5], [0, 1, 2, 3, 3, 0, 3], [20, 3, 0, 2, 5, 0, 1]),
    "chunked prefill": TreeLayout.from_node_lengths([-1], [40], [0] * 40, np.arange(1, 41)),
    "unseen tiles": TreeLayout.from_node_lengths([-1, 0, 0, 0], [100, 300, 50, 200], [2]),
    "empty nodes": TreeLayout.from_node_lengths([-1, 0, 1, 1, 0, 4], [0, 0, 5, 0, 0, 3],
                                                [3, 4, 2, 5]),
    "no queries": TreeLayout.from_node_lengths([-1, 0], [10, 5], []),
    "no nodes": TreeLayout([], [0], [], []),
}


def random_layout(seed: int) -> TreeLayout:
    rng = np.random.default_rng(seed)
    return random_forest(rng, int(rng.integers(1, 120)), int(rng.integers(0, 200)),
                         max_tokens=2500, num_roots=int(rng.integers(1, 4)))


def numpy_masks(plan: TreePlan, tok0, tok_len, q0, group, rows, cols) -> np.ndarray:
    """The specification: the visibility predicate on every (query row, token column)."""
    mask = np.zeros((tok0.shape[0], rows, cols), bool)
    for t in range(tok0.shape[0]):
        q = np.arange(q0[t], q0[t] + group[t])[:, None]
        j = np.arange(tok0[t], tok0[t] + tok_len[t])[None, :]
        mask[t, :group[t], :tok_len[t]] = visible(
            plan.query_pre[q], plan.query_len[q], plan.token_lo[j], plan.token_hi[j],
            plan.token_off[j])
    return mask


@needs_lib
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_flatten_tiles_are_the_python_plan(name, block):
    check_flatten_tiles(LAYOUTS[name], block)


@needs_lib
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), block=st.sampled_from([1, 5, 64, 256]))
def test_flatten_tiles_random(seed, block):
    check_flatten_tiles(random_layout(seed), block)


def check_flatten_tiles(layout: TreeLayout, block: int) -> None:
    plan, first = compiled.flatten_tiles(layout, block)
    ref = make_plan(layout, "flatten", block)
    for f in [f.name for f in dataclasses.fields(TreePlan)] + ["merge_indptr", "merge_partials"]:
        a, b = getattr(ref, f), getattr(plan, f)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(b, a, err_msg=f)
        else:
            assert a == b, f
    np.testing.assert_array_equal(first, mask_from(ref))


@needs_lib
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), kind=st.sampled_from(PLAN_KINDS),
       block=st.sampled_from([1, 5, 64]), pad=st.integers(0, 3))
def test_tile_masks_are_the_predicate(seed, kind, block, pad):
    """Any subset of tiles, padded rows and columns: the compiled masks are the predicate."""
    rng = np.random.default_rng(seed)
    plan = make_plan(random_layout(seed), kind, block)
    tiles = np.flatnonzero(rng.random(plan.num_tiles) < 0.5)
    tok0, q0 = plan.tile_indptr[tiles], plan.tile_q_start[tiles]
    tok_len = plan.tile_indptr[tiles + 1] - tok0
    group = plan.tile_q_end[tiles] - q0
    rows = int(group.max(initial=0)) + pad
    cols = int(tok_len.max(initial=0)) + pad
    got = compiled.tile_masks(plan, tok0, tok_len, q0, group, rows, cols)
    np.testing.assert_array_equal(got, numpy_masks(plan, tok0, tok_len, q0, group, rows, cols))
    # A whole-step mask, as the one-tile path asks for.
    zero = np.zeros(1, np.int64)
    nq, n = plan.num_queries, plan.num_plan_tokens
    np.testing.assert_array_equal(
        compiled.tile_masks(plan, zero, zero + n, zero, zero + nq, nq, n),
        numpy_masks(plan, zero, zero + n, zero, zero + nq, nq, n))


@needs_lib
def test_tile_masks_refuse_tiles_out_of_bounds():
    plan = make_plan(LAYOUTS["few-shot"], "flatten", 8)
    one = np.ones(1, np.int64)
    for tok0, tok_len, q0, group in [(one * plan.num_plan_tokens, one, 0 * one, one),
                                     (0 * one, one * 9, 0 * one, one),
                                     (0 * one, one, one * plan.num_queries, one),
                                     (-one, one, 0 * one, one)]:
        assert compiled.tile_masks(plan, tok0, tok_len, q0, group, 8, 8) is None


def prepared(layout: TreeLayout, dense: bool, kind: str, block: int, numpy_planner: bool):
    be = TorchBackend()
    be.dense_limit = 1 << 30 if dense else 0
    old = os.environ.get("DEFT_FASTPLAN")
    os.environ["DEFT_FASTPLAN"] = "0" if numpy_planner else "1"
    try:
        return be.plan(layout, kind, block, Heads(8, 2, 32), torch.device("cpu"))
    finally:
        if old is None:
            del os.environ["DEFT_FASTPLAN"]
        else:
            os.environ["DEFT_FASTPLAN"] = old


def assert_same_prepared(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, _Dense):
        pairs = [(a.slots, b.slots), (a.bias, b.bias), (a.empty_rows, b.empty_rows)]
    else:
        assert len(a.buckets) == len(b.buckets) and a.num_partials == b.num_partials
        pairs = [(a.merge_idx, b.merge_idx)]
        for x, y in zip(a.buckets, b.buckets):
            assert x.chunk == y.chunk
            pairs += [(x.tok, y.tok), (x.qry, y.qry), (x.mask, y.mask), (x.pid, y.pid)]
    for x, y in pairs:
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


@needs_lib
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), kind=st.sampled_from(PLAN_KINDS),
       block=st.sampled_from([1, 7, 64]), dense=st.booleans())
def test_compiled_and_numpy_planning_agree(seed, kind, block, dense):
    layout = random_layout(seed)
    assert_same_prepared(prepared(layout, dense, kind, block, False),
                         prepared(layout, dense, kind, block, True))


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("numpy_planner", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_steps_planned_either_way_match_the_reference(seed, dense, numpy_planner):
    layout = random_layout(seed) if seed else LAYOUTS["partial lens, several per node"]
    kind = PLAN_KINDS[seed % len(PLAN_KINDS)] if seed % 2 else "flatten"
    prep = prepared(layout, dense, kind, 16, numpy_planner)
    q, k, v = random_qkv(layout, 8, 2, 32, torch.float32, seed)
    scale = 32 ** -0.5
    ref_o, ref_lse = reference_attention(q, k, v, layout, scale)
    o, lse = TorchBackend().run(prep, q, k, v, scale)
    assert_close(o, ref_o, torch.float32, f"{kind} o")
    assert_lse_close(lse, ref_lse, kind)
