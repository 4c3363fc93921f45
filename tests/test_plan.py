"""Planner invariants: each query sees exactly its visible tokens, once; tiles and groups."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import random_forest
from deft import PLAN_KINDS, TreeLayout, make_plan
from deft.ops.reference import visibility_mask
from deft.plan import coarsen_plan, dfs_preorder
from benchmarks.trees import few_shot_layout


def seen_slots(plan):
    """{query: sorted slots it sees across its partials}, and whether any slot repeats."""
    seen: dict[int, list[int]] = {}
    for t in range(plan.num_tiles):
        toks = np.arange(plan.tile_indptr[t], plan.tile_indptr[t + 1])
        for pos in range(plan.tile_q_start[t], plan.tile_q_end[t]):
            pre, qlen = plan.query_pre[pos], plan.query_len[pos]
            lo, hi, off = plan.token_lo[toks], plan.token_hi[toks], plan.token_off[toks]
            vis = (lo <= pre) & (pre < hi) & ((pre != lo) | (off < qlen))
            if not plan.needs_mask:
                assert vis.all(), "a plan without mask loaded a token its query cannot see"
            seen.setdefault(int(plan.query_order[pos]), []).extend(plan.token_slots[toks[vis]].tolist())
    return seen


def check_plan(layout, kind, block, plan=None):
    fresh = plan is None
    plan = plan or make_plan(layout, kind, block)
    mask = visibility_mask(layout)
    seen = seen_slots(plan)
    for qi in range(layout.num_queries):
        expected = sorted(layout.kv_indices[mask[qi]].tolist())
        assert sorted(seen.get(qi, [])) == expected, f"{kind}: query {qi} sees the wrong tokens"
    # Reduction map: every partial exactly once, grouped by query.
    assert sorted(plan.merge_partials.tolist()) == list(range(plan.num_partials))
    assert plan.merge_indptr[-1] == plan.num_partials
    tile_len = np.diff(plan.tile_indptr)
    if kind != "per_query":
        assert len(set(plan.token_slots.tolist())) == plan.num_plan_tokens, "a token loaded twice"
        assert np.all(plan.tile_q_end > plan.tile_q_start), "a tile without queries"
    if kind == "flatten" and fresh:
        assert (tile_len != block).sum() <= 1
    if kind in ("node_chunk", "per_query"):
        assert tile_len.max(initial=0) <= block
    return plan


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 300), max_len=st.integers(0, 600),
       roots=st.integers(1, 4), block=st.sampled_from([1, 5, 16, 64]))
def test_random_forests_every_kind(seed, nodes, max_len, roots, block):
    rng = np.random.default_rng(seed)
    layout = random_forest(rng, nodes, max_len, max_tokens=1500, num_roots=roots)
    for kind in PLAN_KINDS:
        check_plan(layout, kind, block)


@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_special_trees(kind):
    chain = TreeLayout.from_node_lengths(np.arange(-1, 199), np.full(200, 3), [199, 100, 0])
    fan = few_shot_layout(300, 256, 1)
    single = TreeLayout([-1], [0, 7], np.arange(7)[::-1].copy(), [0], [4])
    empties = TreeLayout.from_node_lengths([-1, 0, 1, 1, 0], [0, 0, 5, 0, 0], [3, 4, 2])
    no_queries = TreeLayout.from_node_lengths([-1, 0], [10, 5], [])
    for layout in (chain, fan, single, empties, no_queries):
        check_plan(layout, kind, 16)


def test_dfs_preorder():
    order, size = dfs_preorder(np.array([-1, 0, 0, 1, -1, 4, 1]))
    assert order.tolist() == [0, 1, 3, 6, 2, 4, 5]
    assert size.tolist() == [5, 3, 1, 1, 2, 1, 1]


def test_groups_are_kv_guided():
    # 20 branches under a shared prompt: prompt tiles serve all 20 queries, branch tiles one.
    plan = make_plan(few_shot_layout(640, 20, 64), "flatten", 64)
    group = plan.tile_q_end - plan.tile_q_start
    assert group.tolist() == [20] * 10 + [1] * 20
    assert plan.num_plan_tokens == 640 + 20 * 64


def test_io_accounting_deft_vs_per_query():
    layout = few_shot_layout(4000, 20, 200)
    deft_io = make_plan(layout, "flatten", 64).io_bytes(32, 8, 128)
    pq_io = make_plan(layout, "per_query", 64).io_bytes(32, 8, 128)
    per_token = 2 * 8 * 128 * 2
    assert deft_io["kv"] == (4000 + 20 * 200) * per_token
    assert pq_io["kv"] == 20 * 4200 * per_token
    assert deft_io["total"] < pq_io["total"]


def test_unseen_tiles_are_dropped():
    # Node 1 is a finished branch nobody attends to.
    layout = TreeLayout.from_node_lengths([-1, 0, 0], [8, 100, 4], [2])
    plan = make_plan(layout, "flatten", 8)
    assert plan.num_plan_tokens < 112
    check_plan(layout, "flatten", 8)


def test_plan_argument_errors():
    layout = few_shot_layout(10, 2, 2)
    with pytest.raises(ValueError, match="kind: expected one of flatten, node, node_chunk, per_query, got 'x'"):
        make_plan(layout, "x")
    with pytest.raises(ValueError, match="block_kv: expected a positive integer, got 0"):
        make_plan(layout, "flatten", 0)
    with pytest.raises(TypeError, match="layout: expected a deft.TreeLayout"):
        make_plan([1, 2], "flatten")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 60), max_tiles=st.integers(1, 9),
       kind=st.sampled_from(PLAN_KINDS))
def test_coarsened_plans_stay_exact(seed, nodes, max_tiles, kind):
    layout = random_forest(np.random.default_rng(seed), nodes, 200, max_tokens=1500)
    fine = make_plan(layout, kind, 8)
    coarse = coarsen_plan(fine, max_tiles)
    check_plan(layout, kind, 8 * max_tiles, coarse)
    assert coarse.num_plan_tokens == fine.num_plan_tokens
    assert coarse.num_tiles <= fine.num_tiles
    assert coarse.max_tile_len <= fine.max_tile_len * max_tiles


def test_coarsen_merges_only_equal_groups():
    plan = coarsen_plan(make_plan(few_shot_layout(640, 20, 64), "flatten", 64), 4)
    assert (plan.tile_q_end - plan.tile_q_start).tolist() == [20] * 3 + [1] * 20
    assert np.diff(plan.tile_indptr).tolist() == [256, 256, 128] + [64] * 20
    with pytest.raises(ValueError, match="max_tiles: expected a positive integer, got 0"):
        coarsen_plan(plan, 0)
