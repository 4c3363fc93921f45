"""Triton backend against the float64 reference: interpreted on CPU (fp16/fp32, tiny trees),
and on a GPU under ``pytest -m gpu`` (bf16/fp16, every head_dim, GQA, real workloads, CUDA graphs)."""

import numpy as np
import pytest
import torch

from conftest import (CHECK_VARIANTS, TAIL_VARIANTS, to_paged, assert_close, assert_lse_close,
                      prefer_cuts, random_forest, random_qkv)
from deft import TreeAttention, TreeLayout, merge_states
from deft.ops.reference import reference_attention
from benchmarks.trees import few_shot_layout, medusa_layout, shuffle_slots

pytest.importorskip("triton")
from deft.ops.triton import configs, launch  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# Kernel variants (deft.ops.triton.configs.KernelConfig): the masked tiles'
# (``TAIL_VARIANTS``) and the isolation checks' (``CHECK_VARIANTS``; the interpreter's config
# keeps V checked and values tested, and the GPU runs that kernel in test_isolation's
# "checked-v").
VARIANTS = {**TAIL_VARIANTS, **CHECK_VARIANTS}


def check(layout, h_q, h_kv, d, dtype, kind="flatten", seed=0, paged=0):
    q, k, v = random_qkv(layout, h_q, h_kv, d, dtype, seed, device=DEV)
    ref_o, ref_lse = reference_attention(q, k, v, layout, d**-0.5)
    # Interpreted: small tiles, so even tiny trees have many tiles, partials and merges.
    attn = TreeAttention(h_q, h_kv, d, backend="triton", plan_kind=kind, device=DEV,
                         block_kv=None if CUDA else 8)
    plan = attn.plan(layout)
    assert CUDA or layout.num_tokens < 24 or plan.num_tiles > 1
    if paged:
        k, v = to_paged(k, paged), to_paged(v, paged)
    o, lse = attn.run(q, k, v, return_lse=True)
    assert o.dtype == dtype and not torch.isnan(o).any()
    assert_close(o.cpu(), ref_o.cpu(), dtype, f"triton {kind}")
    assert_lse_close(lse.cpu(), ref_lse.cpu(), f"triton {kind}")


TINY = {
    "fan": few_shot_layout(37, 5, 1),
    "branches": shuffle_slots(few_shot_layout(40, 3, 9), seed=1, num_slots=90),
    "partial lens": TreeLayout.from_node_lengths([-1, 0, 0, 1], [20, 7, 0, 5], [0, 1, 2, 3, 3], [20, 3, 0, 2, 5]),
    "seeing nothing": TreeLayout.from_node_lengths([-1, -1], [0, 6], [0, 1], [0, 0]),
}


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tiny_trees(name, dtype):
    check(TINY[name], 4, 2, 64, dtype)


@pytest.mark.parametrize("kind", ["node", "node_chunk", "per_query"])
def test_other_plan_kinds(kind):
    check(TINY["branches"], 3, 1, 32, torch.float16, kind)


def test_gqa_three_and_paged():
    check(TINY["partial lens"], 6, 2, 32, torch.float16, paged=8)


def test_random_forest_interpreted():
    layout = random_forest(np.random.default_rng(3), 12, 20, max_tokens=120)
    check(layout, 2, 1, 16, torch.float32)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_merge_states_triton_path(heads):
    """The merge kernel, one to four heads per program, on 3 heads (a partial last block)."""
    from deft.ops.triton.launch import launch_merge

    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 4, 3, 16, generator=g).to(DEV)
    s = torch.randn(3, 4, 3, generator=g).to(DEV)
    s[1, :2] = float("-inf")
    s[2, :, 1] = float("-inf")  # a (query, head) row without any state
    o = torch.empty(3, 3, 16, device=DEV)
    lse = torch.empty(3, 3, device=DEV)
    indptr = torch.arange(0, 13, 4, dtype=torch.int32, device=DEV)
    launch_merge(v.view(12, 3, 16), s.view(12, 3), o, lse, indptr,
                 torch.arange(12, dtype=torch.int32, device=DEV), heads=heads)
    ref_o, ref_lse = merge_states(v, s)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("d", [8, 24, 48, 96])  # 96: Phi-3-mini's heads, in blocks of 128
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_head_dims_that_are_not_powers_of_two(d, dtype):
    """Blocks span the head dim rounded up to a power of two (at least 16); the padding
    loads as 0 and is never stored, so q, K/V and o keep their own shapes."""
    assert configs.block_head_dim(d) == {8: 16, 24: 32, 48: 64, 96: 128}[d]
    check(TINY["branches"], 4, 2, d, dtype, paged=8 if d == 24 else 0)


@pytest.mark.skipif(CUDA, reason="interpreted: the GPU's is test_gpu_padded_head_dim_in_a_graph")
def test_graph_safe_plans_of_a_padded_head_dim():
    """Two plans into one reservation (the engine's replayed mode), heads of 24: exact, and
    without TMA (a box would take the next head's columns)."""
    from deft.ops import Capacity

    attn = TreeAttention(4, 2, 24, backend="triton", block_kv=8, capacity=Capacity(3, 128))
    for seed, layout in enumerate((TINY["branches"], few_shot_layout(30, 3, 9))):
        q, k, v = random_qkv(layout, 4, 2, 24, torch.float16, seed)
        attn.plan(layout)
        assert attn._prepared.reserved is not None and not attn._prepared.tma
        assert_close(attn.run(q, k, v), reference_attention(q, k, v, layout, 24**-0.5)[0],
                     torch.float16, f"graph-safe plan {seed}")


@pytest.mark.parametrize("d", [24, 96])
def test_merge_states_triton_path_of_a_padded_head_dim(d):
    """The merge kernel over heads padded to a power of two: exact, and it stores only the
    head's columns."""
    from deft.ops.triton.launch import launch_merge

    g = torch.Generator().manual_seed(d)
    v, s = torch.randn(2, 3, 2, d, generator=g).to(DEV), torch.randn(2, 3, 2, generator=g).to(DEV)
    wide = torch.full((2, 2, d + 8), 7.0, device=DEV)
    o = wide[..., :d]  # rows wider than the head: the columns past it stay untouched
    lse = torch.empty(2, 2, device=DEV)
    launch_merge(v.view(6, 2, d), s.view(6, 2), o, lse,
                 torch.arange(0, 7, 3, dtype=torch.int32, device=DEV),
                 torch.arange(6, dtype=torch.int32, device=DEV))
    ref_o, ref_lse = merge_states(v, s)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_lse)
    assert bool((wide[..., d:] == 7).all())


def test_a_head_dim_past_the_largest_block_is_rejected():
    attn = TreeAttention(2, 1, 320, backend="triton", device=DEV)
    with pytest.raises(ValueError, match="head_dim: the triton backend takes 1 to 256, got 320"):
        attn.plan(TINY["fan"])


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_gpu_random_forests(dtype, d, gqa):
    rng = np.random.default_rng(d * gqa)
    for _ in range(4):
        layout = random_forest(rng, int(rng.integers(1, 300)), 600, max_tokens=20_000,
                               num_roots=int(rng.integers(1, 4)))
        check(layout, 2 * gqa, 2, d, dtype, seed=int(rng.integers(1000)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", [
    few_shot_layout(3000, 1000, 1),
    TreeLayout.from_node_lengths(np.arange(-1, 499), np.full(500, 7), [499, 250, 3]),
    TreeLayout([-1], [0, 777], np.arange(777), [0], [500]),
    medusa_layout([[i] for i in range(8)] + [[0, i] for i in range(8)], 2000),
], ids=["1000-leaf fan", "deep chain", "one node", "medusa"])
@pytest.mark.parametrize("kind", ["flatten", "node", "node_chunk", "per_query"])
def test_gpu_special_trees(layout, kind):
    check(layout, 32, 8, 128, torch.bfloat16, kind)


@pytest.mark.gpu
@gpu
def test_gpu_recorded_workloads(workloads):
    from benchmarks.trees import build

    for name in ("reasoning sorting128ToT", "medusa APPS-256"):
        check(build(name, workloads), 32, 8, 128, torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_merge_states_public_api(dtype):
    v = torch.randn(50, 7, 8, 128).to(dtype)
    s = torch.randn(50, 7, 8) * 4
    s[3, :] = float("-inf")
    s[5, 2:] = float("-inf")
    ref_o, ref_lse = merge_states(v, s)  # CPU path
    o, lse = merge_states(v.cuda(), s.cuda())
    assert o.dtype == dtype
    assert_close(o.cpu(), ref_o, dtype, "merge_states on cuda")
    assert_lse_close(lse.cpu(), ref_lse, "merge_states on cuda")


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay():
    layout = shuffle_slots(few_shot_layout(3000, 30, 100), seed=4, num_slots=8000)
    q, k, v = random_qkv(layout, 32, 8, 128, torch.bfloat16, device="cuda")
    attn = TreeAttention(32, 8, 128, backend="triton", device="cuda")
    attn.plan(layout)
    static_o, static_lse = attn.run(q, k, v, return_lse=True)  # warm-up compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o, static_lse = attn.run(q, k, v, return_lse=True)
    for seed in (1, 2):
        q2, k2, v2 = random_qkv(layout, 32, 8, 128, torch.bfloat16, seed=seed, device="cuda")
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        ref_o, ref_lse = reference_attention(q, k, v, layout, 128**-0.5)
        assert_close(static_o.cpu(), ref_o.cpu(), torch.bfloat16, f"graph replay {seed}")
        assert_lse_close(static_lse.cpu(), ref_lse.cpu(), "graph replay")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("return_lse", [False, True])
def test_gpu_run_into_out_allocates_nothing(return_lse):
    """With ``out`` (and ``lse_out``) a layer's run makes no device allocation, and a
    4-layer step of such runs replays from a CUDA graph with the right results."""
    layout = shuffle_slots(few_shot_layout(2000, 20, 50), seed=6, num_slots=5000)
    q, k, v = random_qkv(layout, 32, 8, 128, torch.bfloat16, device="cuda")
    attn = TreeAttention(32, 8, 128, backend="triton", device="cuda")
    attn.plan(layout)
    outs = torch.empty(4, *q.shape, dtype=q.dtype, device="cuda")
    lses = torch.empty(4, *q.shape[:2], device="cuda")

    def step():
        for layer in range(4):
            attn.run(q, k, v, return_lse=return_lse, out=outs[layer],
                     lse_out=lses[layer] if return_lse else None)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]  # allocations ever made
    step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(random_qkv(layout, 32, 8, 128, torch.bfloat16, seed=9, device="cuda")[0])
    outs.zero_()
    graph.replay()
    ref_o, ref_lse = reference_attention(q, k, v, layout, 128**-0.5)
    for layer in range(4):
        assert_close(outs[layer].cpu(), ref_o.cpu(), torch.bfloat16, f"out, layer {layer}")
        if return_lse:
            assert_lse_close(lses[layer].cpu(), ref_lse.cpu(), "lse_out")


def test_mask_from_is_sound_and_tight():
    """Every group query sees every token of a tile before its ``mask_from``; the token at
    ``mask_from`` is missed by a query of the group or by one on its node with the smallest
    ``query_kv_len`` (the conservative check); prompt tiles need no mask at all."""
    from deft import make_plan
    from deft.plan import packing

    rng = np.random.default_rng(11)
    for _ in range(20):
        plan = make_plan(random_forest(rng, int(rng.integers(1, 80)), 100, max_tokens=2000), "flatten", 8)
        mask_from = packing.mask_from(plan)
        for t in range(plan.num_tiles):
            t0, t1 = plan.tile_indptr[t], plan.tile_indptr[t + 1]
            assert t0 <= mask_from[t] <= t1
            toks = np.arange(t0, t1)
            pre = plan.query_pre[plan.tile_q_start[t]:plan.tile_q_end[t], None]
            qlen = plan.query_len[plan.tile_q_start[t]:plan.tile_q_end[t], None]
            lo, hi, off = plan.token_lo[toks], plan.token_hi[toks], plan.token_off[toks]
            seen = ((lo <= pre) & (pre < hi) & ((pre != lo) | (off < qlen))).all(axis=0)
            assert seen[:mask_from[t] - t0].all()
            if mask_from[t] < t1:
                j = mask_from[t] - t0
                on_node = plan.query_pre == lo[j]
                assert not seen[j] or off[j] >= plan.query_len[on_node].min()
    fan = make_plan(few_shot_layout(640, 20, 64), "flatten", 64)
    assert (packing.mask_from(fan)[:10] == fan.tile_indptr[1:11]).all()


def test_tile_slot0_marks_exactly_the_consecutive_tiles():
    """``tile_slot0`` is a tile's first slot iff its slots are consecutive, else -1."""
    from deft import make_plan
    from deft.plan import packing

    rng = np.random.default_rng(5)
    for seed in range(10):
        layout = random_forest(rng, int(rng.integers(1, 40)), 50, max_tokens=600)
        if seed % 2:
            layout = shuffle_slots(layout, seed=seed, num_slots=layout.num_tokens + 50)
        plan = make_plan(layout, "flatten", 8)
        slot0 = packing.tile_slot0(plan)
        for t in range(plan.num_tiles):
            s = plan.token_slots[plan.tile_indptr[t]:plan.tile_indptr[t + 1]]
            consecutive = bool(np.all(np.diff(s) == 1))
            assert slot0[t] == (s[0] if consecutive else -1)
    assert (packing.tile_slot0(make_plan(few_shot_layout(64, 4, 16), "flatten", 16)) >= 0).all()


@pytest.fixture(params=[False, True], ids=["merge-launch", "fused-merge"])
def merge_mode(request, monkeypatch):
    """Run a test with the merge as its own launch and fused into the partial kernel."""
    import dataclasses

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, fuse_merge=request.param))
    return request.param


@pytest.mark.parametrize("name", ["branches", "partial lens", "seeing nothing"])
def test_merge_modes_agree_and_reset_counts(merge_mode, name):
    """Both merge modes match the reference on repeated runs; fused counts return to zero."""
    layout = TINY[name]
    q, k, v = random_qkv(layout, 6, 2, 32, torch.float16, 4, device=DEV)
    ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
    attn = TreeAttention(6, 2, 32, backend="triton", device=DEV, block_kv=None if CUDA else 8)
    attn.plan(layout)
    counts = attn._prepared.counts
    assert (counts is not None) == (merge_mode and name != "seeing nothing")
    for _ in range(2):
        o, lse = attn.run(q, k, v, return_lse=True)
        assert_close(o.cpu(), ref_o.cpu(), torch.float16, f"merge mode {merge_mode}")
        assert_lse_close(lse.cpu(), ref_lse.cpu(), "merge mode")
        assert counts is None or int(counts.abs().sum()) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seed", range(6))
def test_gpu_merge_modes_on_random_forests(merge_mode, seed):
    """Shuffled slots, and (odd seeds) slots in node order, some tiles consecutive."""
    layout = random_forest(np.random.default_rng(100 + seed), 60, 400, max_tokens=20000,
                           shuffle=seed % 2 == 0)
    check(layout, 32, 8, 128, torch.bfloat16, seed=seed)


@pytest.mark.gpu
@gpu
def test_gpu_merge_modes_on_consecutive_slots(merge_mode):
    """A fan whose tiles all have consecutive slots: the kernel skips the slot loads."""
    layout = few_shot_layout(3000, 40, 70)
    attn = TreeAttention(32, 8, 128, backend="triton", device="cuda")
    attn.plan(layout)
    assert attn._prepared.contiguous
    check(layout, 32, 8, 128, torch.bfloat16)


def test_work_descriptors_describe_every_tile_chunk():
    """Each program's row: its tile's token range, group, first partial, mask start, slot0, first row."""
    from deft import make_plan
    from deft.plan import packing

    plan = make_plan(shuffle_slots(few_shot_layout(64, 5, 20), seed=2, num_slots=200), "flatten", 16)
    g, block_m = 3, 4
    work = packing.work_items(plan, g, block_m)
    mask_from, slot0 = packing.mask_from(plan), packing.tile_slot0(plan)
    seen = set()
    for tok0, tok1, qs, qe, p0, m, s0, row0 in work:
        (t,) = np.flatnonzero(plan.tile_indptr[:-1] == tok0)
        assert (tok1, qs, qe, p0, m, s0) == (plan.tile_indptr[t + 1], plan.tile_q_start[t],
                                             plan.tile_q_end[t], plan.partial_indptr[t], mask_from[t], slot0[t])
        assert row0 % block_m == 0 and row0 < (qe - qs) * g
        seen.add((t, row0))
    rows = (plan.tile_q_end - plan.tile_q_start) * g
    assert len(seen) == len(work) == int((-(-rows // block_m)).sum())


@pytest.mark.parametrize("reverse", [False, True])
def test_query_order_flag(reverse):
    """Queries already in plan order skip the q_order load; reversed ones use it. Both exact."""
    base = few_shot_layout(30, 4, 5)
    queries = base.query_nodes[::-1] if reverse else base.query_nodes
    layout = TreeLayout(base.parents, base.node_kv_indptr, base.kv_indices, queries)
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=None if CUDA else 8)
    attn.plan(layout)
    assert attn._prepared.sorted_queries == (not reverse)
    check(layout, 4, 2, 32, torch.float16)


def _mixed_slots_layout() -> TreeLayout:
    """A prompt and 3 branches with the last branch's slots reversed: TMA and gather tiles."""
    base = few_shot_layout(70, 3, 21)
    slots = base.kv_indices.copy()
    slots[-21:] = slots[-21:][::-1]
    return TreeLayout(base.parents, base.node_kv_indptr, slots, base.query_nodes, base.query_kv_lens)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["fan", "partial lens", "prompt and branches", "mixed slots"])
def test_tma_path_matches_reference(monkeypatch, name, dtype):
    """Consecutive slots with ``tma``: every block by tensor descriptor, the last one masked
    (NaN past it, or past the cache end), masked (branch) and unmasked (prompt) tiles, tiles
    of consecutive and scattered slots in one launch; a cache ``_tma_ok`` rejects gathers."""
    import dataclasses

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, tma=True))
    layout = {**TINY, "prompt and branches": few_shot_layout(70, 3, 21),
              "mixed slots": _mixed_slots_layout()}[name]
    q, k, v = random_qkv(layout, 4, 2, 32, dtype, 5, device=DEV)
    ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
    # NaN in the slots past the layout: a tail block's box reads them, and must not use them.
    k, v = (torch.cat([x, torch.full_like(x[:40], float("nan"))]) for x in (k, v))
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=None if CUDA else 32)
    attn.plan(layout)
    assert attn._prepared.contiguous == (name != "mixed slots") and attn._prepared.tma
    calls = []
    monkeypatch.setattr(launch, "_kv_descriptor", lambda *a, f=launch._kv_descriptor: calls.append(1) or f(*a))
    o, lse = attn.run(q, k, v, return_lse=True)
    assert calls, "the TMA path was not taken"
    assert_close(o.cpu(), ref_o.cpu(), dtype, "tma")
    assert_lse_close(lse.cpu(), ref_lse.cpu(), "tma")
    # A cache of exactly the layout's slots: the last box reads past its end (zero fill).
    exact = layout.num_tokens
    assert_close(attn.run(q, k[:exact], v[:exact]).cpu(), ref_o.cpu(), dtype, "tma, exact cache")
    # A cache whose KV heads are not adjacent rows cannot be one 2-D TMA tensor: gather path.
    k2, v2 = (torch.stack([x, x], 2)[:, :, 0] for x in (k, v))
    assert not launch._tma_ok(k2, k2.stride())
    calls.clear()
    assert_close(attn.run(q, k2, v2).cpu(), ref_o.cpu(), dtype, "tma fallback")
    assert not calls
    # K and V with different strides (the kernels address both with K's): still exact.
    assert_close(attn.run(q, k, v2).cpu(), ref_o.cpu(), dtype, "k and v strides differ")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d,gqa", [(64, 1), (128, 4), (256, 8)])
def test_gpu_tma_path(monkeypatch, dtype, d, gqa):
    """The shipped configs load consecutive-slot tiles by TMA inside CUDA-graph capture
    (every head_dim, GQA, dtype, branch tails that end mid-block), and by gathered loads
    when launched eagerly, building no descriptors after the first launch."""
    layout = few_shot_layout(1500, 7, 77)
    q, k, v = random_qkv(layout, 2 * gqa, 2, d, dtype, 1, device="cuda")
    ref_o, _ = reference_attention(q, k, v, layout, d**-0.5)
    attn = TreeAttention(2 * gqa, 2, d, backend="triton", device="cuda")
    attn.plan(layout)
    assert attn._prepared.contiguous and attn._prepared.tma
    out = torch.empty_like(q)
    attn.run(q, k, v, out=out)  # eager: gathered loads; compiles the TMA variant once
    assert_close(out.cpu(), ref_o.cpu(), dtype, "eager")
    calls = []
    monkeypatch.setattr(launch, "_kv_descriptor", lambda *a, f=launch._kv_descriptor: calls.append(1) or f(*a))
    attn.run(q, k, v, out=out)
    assert not calls, "an eager launch built tensor descriptors"
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out)
    assert calls, "the captured launch did not take the TMA path"
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out.cpu(), ref_o.cpu(), dtype, "tma in a CUDA graph")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_padded_head_dim_in_a_graph(dtype):
    """Phi-3's heads of 96 (blocks of 128) load gathered, in a CUDA graph too: a TMA box
    would span the next head's columns."""
    layout = few_shot_layout(1500, 7, 77)
    q, k, v = random_qkv(layout, 32, 8, 96, dtype, 2, device="cuda")
    ref_o, _ = reference_attention(q, k, v, layout, 96**-0.5)
    attn = TreeAttention(32, 8, 96, backend="triton", device="cuda")
    attn.plan(layout)
    assert attn._prepared.contiguous and not attn._prepared.tma
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out.cpu(), ref_o.cpu(), dtype, "head_dim 96 in a CUDA graph")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_kernel_variants(monkeypatch, variant):
    """The kernel variants on the shipped configs, eager (gathered) and in a CUDA graph
    (TMA), bf16 on the Llama-3-8B attention shape, against the float64 reference."""
    import dataclasses

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, **VARIANTS[variant]))
    layout = few_shot_layout(1500, 7, 77)
    q, k, v = random_qkv(layout, 32, 8, 128, torch.bfloat16, 2, device="cuda")
    ref_o, ref_lse = reference_attention(q, k, v, layout, 128**-0.5)
    attn = TreeAttention(32, 8, 128, backend="triton", device="cuda")
    attn.plan(layout)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    attn.run(q, k, v, out=out, lse_out=lse, return_lse=True)
    assert_close(out.cpu(), ref_o.cpu(), torch.bfloat16, f"{variant} eager")
    assert_lse_close(lse.cpu(), ref_lse.cpu(), f"{variant} eager")
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out, lse_out=lse, return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out.cpu(), ref_o.cpu(), torch.bfloat16, f"{variant} in a CUDA graph")
    assert_lse_close(lse.cpu(), ref_lse.cpu(), f"{variant} in a CUDA graph")


def test_slots_beyond_int32_are_rejected_at_plan():
    """The triton backend's plan arrays are int32: a larger slot is an error, not a wrap."""
    layout = TreeLayout.from_node_lengths([-1], [3], [0], slots=[0, 1, 2**31])
    attn = TreeAttention(2, 1, 16, backend="triton", device=DEV)
    with pytest.raises(ValueError, match="slot 2147483648 is beyond"):
        attn.plan(layout)
    attn.plan(TreeLayout.from_node_lengths([-1], [3], [0], slots=[0, 1, 2**31 - 1]))


def test_replanning_reuses_device_buffers():
    """A plan reuses the last plan's device buffers when they are large enough, and
    allocates larger ones when not; every step stays exact."""
    from deft.plan import Coarsening, compiled

    if compiled.flatten_plan(TINY["fan"], 8, Coarsening(1, 16, 1, 4, 2.0, 0, 8, 12, 128),
                             lambda n: torch.zeros(n, dtype=torch.int32)) is None:
        pytest.skip("no compiled planner (reuse is its path's)")
    big, small = TINY["fan"], TINY["partial lens"]
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=None if CUDA else 8)
    ptrs = []
    for layout in (big, small, big, few_shot_layout(800, 12, 60)):
        attn.plan(layout)
        prep = attn._prepared
        ptrs.append((prep.plan_buffer.data_ptr(), prep.scratch.data_ptr()))
        q, k, v = random_qkv(layout, 4, 2, 32, torch.float16, 7, device=DEV)
        ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
        o, lse = attn.run(q, k, v, return_lse=True)
        assert_close(o.cpu(), ref_o.cpu(), torch.float16, "replanned")
        assert_lse_close(lse.cpu(), ref_lse.cpu(), "replanned")
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert ptrs[3][0] != ptrs[0][0] and ptrs[3][1] != ptrs[0][1]


@pytest.fixture
def fixed_coarsening(monkeypatch):
    """``fixed_coarsening(u)``: the triton backend coarsens every plan by ``u`` (numpy
    planner; the compiled one coarsens its own way)."""
    from deft.plan import coarsen_plan, step

    def use(u: int) -> None:
        monkeypatch.setattr(step, "refine", lambda plan, params: coarsen_plan(plan, u))
        monkeypatch.setenv("DEFT_FASTPLAN", "0")

    return use


def test_tile_split_into_unmasked_and_masked_parts(monkeypatch, fixed_coarsening):
    """A coarsened prompt tile that ends in tokens shared with a branch runs its prompt part
    without the mask and the rest with it: still exact, also with slot loads and TMA."""
    import dataclasses

    layout = few_shot_layout(70, 3, 21)
    q, k, v = random_qkv(layout, 4, 2, 32, torch.float16, 3, device=DEV)
    ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
    fixed_coarsening(4)
    base = configs.CONFIGS["interpreter", 0, 0]
    for tma in (False, True):
        key = ("interpreter", 0, 0)
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(base, tma=tma))
        attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=8)
        attn.plan(layout)
        work = attn._prepared.segment("work").view(-1, 8).cpu().numpy()
        assert ((work[:, 0] < work[:, 5]) & (work[:, 5] < work[:, 1])).any()
        o, lse = attn.run(q, k, v, return_lse=True)
        assert_close(o.cpu(), ref_o.cpu(), torch.float16, f"split tile, tma={tma}")
        assert_lse_close(lse.cpu(), ref_lse.cpu(), "split tile")


@pytest.mark.skipif(CUDA, reason="sets the interpreter's config; on a GPU: the gpu test")
@pytest.mark.parametrize("tma", [False, True], ids=["gathered", "tma"])
# "neither" of the masked tiles' variants is the interpreter's config itself.
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "neither"])
def test_kernel_variants_match_reference(monkeypatch, fixed_coarsening, variant, tma):
    """The kernel variants (``aligned_mask``: the masked loop from the block boundary before
    ``mask_from``, which moves here; ``ranges_first``; ``deferred_v_checks``: V unchecked in
    the masked blocks, while the tail boxes still zero the NaN past their tiles) stay exact,
    gathered and by TMA, with NaN in the cache slots past the layout, and with the token
    ranges before each tile's ``mask_from`` zeroed (the compiled planner need not write
    them)."""
    import dataclasses

    layout = few_shot_layout(70, 3, 21)
    q, k, v = random_qkv(layout, 4, 2, 32, torch.float16, 3, device=DEV)
    ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
    k, v = (torch.cat([x, torch.full_like(x[:40], float("nan"))]) for x in (k, v))
    fixed_coarsening(4)
    key = ("interpreter", 0, 0)
    cfg = dataclasses.replace(configs.CONFIGS[key], tma=tma, **VARIANTS[variant])
    monkeypatch.setitem(configs.CONFIGS, key, cfg)
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=8)
    attn.plan(layout)
    work = attn._prepared.segment("work").view(-1, 8).cpu().numpy()
    inside = (work[:, 5] < work[:, 1]) & ((work[:, 5] - work[:, 0]) % cfg.block_n > 0)
    assert inside.any(), "no masked part starts inside a block"
    for t0, mask_from in work[:, [0, 5]]:
        for name in ("tok_lo", "tok_hi", "tok_off"):
            attn._prepared.segment(name)[t0:mask_from] = 0
    calls = []
    monkeypatch.setattr(launch, "_kv_descriptor",
                        lambda *a, f=launch._kv_descriptor: calls.append(1) or f(*a))
    o, lse = attn.run(q, k, v, return_lse=True)
    assert bool(calls) == tma
    assert_close(o.cpu(), ref_o.cpu(), torch.float16, f"{variant}, tma={tma}")
    assert_lse_close(lse.cpu(), ref_lse.cpu(), f"{variant}, tma={tma}")


def test_failed_replan_leaves_no_plan(monkeypatch):
    """A plan that fails (here: its workspace allocation) leaves no current plan, rather
    than the last plan reading buffers the failed one overwrote."""
    from deft.ops.triton import backend

    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=None if CUDA else 8)
    attn.plan(TINY["branches"])

    def fail(*args):
        raise MemoryError("no room")

    monkeypatch.setattr(backend, "_buffer", fail)
    with pytest.raises(MemoryError):
        attn.plan(TINY["partial lens"])
    q, k, v = random_qkv(TINY["branches"], 4, 2, 32, torch.float16, 1, device=DEV)
    with pytest.raises(RuntimeError, match="must be called before run"):
        attn.run(q, k, v)


@pytest.mark.parametrize("variant", [None, "both", "deferred"],
                         ids=["shipped", "masked-tile-variants", "deferred-v-checks"])
@pytest.mark.parametrize("seed", range(3))
def test_coarsened_random_forests_interpreted(monkeypatch, fixed_coarsening, seed, variant):
    """Random forests coarsened by 3 (tiles that merge node boundaries, split at
    ``mask_from``), shuffled or in-order slots: exact against the reference, with the
    shipped kernel, with its masked tiles' variants and with V's checks deferred (finite
    K/V: no item computed again; in-order slots then by TMA)."""
    import dataclasses

    from deft import make_plan
    from deft.plan import coarsen_plan, packing

    if variant:
        key = ("interpreter", 0, 0)
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(
            configs.CONFIGS[key], tma=True, **VARIANTS[variant]))
    fixed_coarsening(3)
    layout = random_forest(np.random.default_rng(40 + seed), 10, 24, max_tokens=120,
                           shuffle=seed % 2 == 0)
    plan = coarsen_plan(make_plan(layout, "flatten", 8), 3)
    mask_from = packing.mask_from(plan)
    assert ((plan.tile_indptr[:-1] < mask_from) & (mask_from < plan.tile_indptr[1:])).any()
    check(layout, 4, 2, 16, torch.float16, seed=seed)


@pytest.mark.skipif(CUDA, reason="sets the interpreter's config (on a GPU, the recorded "
                                  "workloads of the gpu tests run the wide one)")
def test_wide_steps_store_narrow_partials(monkeypatch, merge_mode):
    """A step of at least a regime's ``rows_from`` rows runs its config: partial o is stored in
    q's dtype (fp16 here; fp32 inputs keep fp32) and merged as exactly as before, by the
    merge launch or fused."""
    import dataclasses

    base = configs.CONFIGS["interpreter", 0, 0]
    layout = few_shot_layout(50, 4, 9)
    rows = layout.num_queries * 4
    for dtype in (torch.float16, torch.float32):
        q, k, v = random_qkv(layout, 4, 2, 32, dtype, 5, device=DEV)
        ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
        partials = {}
        for wide_from in (rows + 1, rows):  # just below the threshold, then at it
            wide = dataclasses.replace(base, narrow_partials=True, merge_block=8)
            monkeypatch.setattr(configs, "CONFIGS", {("interpreter", 0, 0): base,
                                                     ("interpreter", 0, wide_from): wide})
            attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=8)
            attn.plan(layout)
            o, lse = attn.run(q, k, v, return_lse=True)
            assert_close(o.cpu(), ref_o.cpu(), dtype, f"wide_from={wide_from}")
            assert_lse_close(lse.cpu(), ref_lse.cpu(), f"wide_from={wide_from}")
            prep = attn._prepared
            n = prep.num_partials * 4 * 32
            stored = torch.float32 if wide_from > rows or dtype == torch.float32 else dtype
            partials[wide_from] = prep.scratch[:n].view(stored)[:n].float().cpu()
        assert prep.num_partials > layout.num_queries  # the plan has states to merge
        tol = 2e-3 if dtype == torch.float16 else 0.0  # one fp16 rounding, else bit-exact
        torch.testing.assert_close(partials[rows], partials[rows + 1], atol=tol, rtol=tol)


@pytest.mark.skipif(CUDA, reason="sets the interpreter's config")
def test_light_steps_run_the_uncapped_build(monkeypatch):
    """A step of a regime with ``light_per_sm`` runs that regime's uncapped build
    (``"light"``) when its programs fit one wave of that many per SM, on the same tiles, and
    the capped default build when they do not; a capacity keeps its own build for every plan.
    Outputs match the reference."""
    import dataclasses

    from deft import Capacity

    base = configs.CONFIGS["interpreter", 0, 0]
    layout = few_shot_layout(50, 4, 9)
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=8)
    attn.plan(layout)
    tiles, programs = attn.current_plan.num_tiles, attn._prepared.programs
    assert programs % 4 == 0  # the backend counts 4 SMs on a CPU
    q, k, v = random_qkv(layout, 4, 2, 32, torch.float16, 6, device=DEV)
    ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
    for per_sm, reserved, want in ((programs // 4, None, "light"),
                                   (programs // 4 - 1, None, "default"),
                                   (programs // 4 - 1, "light", "light")):
        capped = dataclasses.replace(base, maxnreg=64, light_per_sm=per_sm)
        monkeypatch.setitem(configs.CONFIGS, ("interpreter", 0, 0), capped)
        cap = None if reserved is None else Capacity(layout.num_queries, 512, build=reserved)
        attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=8, capacity=cap)
        attn.plan(layout)
        assert attn.build == ("light" if per_sm * 4 >= programs else "default")
        assert attn._prepared.config.maxnreg == (None if want == "light" else 64)
        assert attn.current_plan.num_tiles == tiles
        o, lse = attn.run(q, k, v, return_lse=True)
        assert_close(o.cpu(), ref_o.cpu(), torch.float16, f"{want} build")
        assert_lse_close(lse.cpu(), ref_lse.cpu(), f"{want} build")


@pytest.mark.parametrize("value,expected", [("true", True), ("0", False)])
def test_interpreter_flag_read_as_triton_reads_it(value, expected):
    """The backend picks its interpreter config exactly when Triton interprets, whatever
    spelling of ``TRITON_INTERPRET`` turned it on."""
    import os
    import subprocess
    import sys

    code = "from deft.ops.triton import configs; print(configs.interpreting())"
    env = {**os.environ, "TRITON_INTERPRET": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == str(expected)


def test_lpt_makespan_is_list_scheduling():
    """The grouped-slot model of the launch equals longest-first list scheduling done one
    program at a time, with masked tiles charged and cut off too."""
    from deft.plan import coarsen

    rng = np.random.default_rng(0)
    for _ in range(200):
        runs = [(int(rng.integers(1, 30)), int(rng.integers(1, 4)))
                for _ in range(int(rng.integers(1, 6)))]
        u, heads, slots = (int(rng.integers(1, 12)), int(rng.integers(1, 4)),
                           int(rng.integers(1, 20)))
        lengths = []
        for r, c in runs:
            lengths += [u] * (r // u * c * heads) + [r % u] * (c * heads if r % u else 0)
        loads = [0] * slots
        for n in sorted(lengths, reverse=True):
            loads[loads.index(min(loads))] += n * 8 + 128
        assert coarsen.lpt_makespan(runs, u, heads, 8, slots, 128) == max(loads)
        # A masked run's last plan tile: its tile costs 40 more and starts after the
        # unmasked ones of its length; a cut one is a tile of its own.
        masked = rng.random(len(runs)) < 0.5
        cut = masked & (rng.random(len(runs)) < 0.5) & np.array([r > 1 for r, _ in runs])
        programs = []
        for (r, c), m, x in zip(runs, masked, cut):
            tiles = [u] * ((r - 1) // u) + [(r - 1) % u] + [1] if x else [u] * (r // u) + [r % u]
            tiles = [t for t in tiles if t]
            flags = [False] * (len(tiles) - 1) + [bool(m)]
            programs += [(t, f) for t, f in zip(tiles, flags)] * (c * heads)
        loads = [0] * slots
        for t, f in sorted(programs, key=lambda p: (-p[0], p[1])):
            loads[loads.index(min(loads))] += t * 8 + 128 + 40 * f
        assert coarsen.lpt_makespan(runs, u, heads, 8, slots, 128, (masked, cut), 40) == max(loads)


def test_coarsening_lengthens_tiles_to_cut_a_last_wave():
    """40 plan tiles of one group on 4 slots (program cost 128 tokens, 8 per plan tile): from
    factor 4, 3 waves of 4-tile programs (480) lose to 2 waves of 5-tile ones (336); from
    factor 5, up to 10 tiles, one wave of 10-tile programs (208) wins."""
    from types import SimpleNamespace

    from deft.plan import coarsen

    plan = SimpleNamespace(num_tiles=40, block_kv=8, tile_q_start=np.zeros(40, np.int64),
                           tile_q_end=np.ones(40, np.int64))
    assert coarsen.lpt_factor(plan, 4, 1, 16, 1, 4, 128, 1024) == 5
    assert coarsen.lpt_factor(plan, 5, 1, 16, 1, 4, 128, 1024) == 10
    assert coarsen.lpt_factor(plan, 4, 1, 16, 1, 40, 128, 1024) == 4  # one wave either way: shortest tiles


def test_coarsening_fits_one_wave_of_the_programs_really_resident():
    """512 plan tiles of one group, 8 KV heads, rule factor 6: on the model's 396 slots,
    factor 11 (376 programs) is one wave; a kernel that keeps 2 programs per SM (264 slots)
    runs them as two (modelled 1,664), so the smallest factor within 4x the rule's that fits
    264, 16 (256 programs, 1,152), is taken. Out of reach (rule factor 3: at most 12, 344
    programs), the model's choice on the 264 resident slots stays: 4 (1,024 programs), where
    on 396 slots it chose 6; with as many resident as modelled, the choice stays."""
    from types import SimpleNamespace

    from deft.plan import coarsen

    plan = SimpleNamespace(num_tiles=512, block_kv=64, tile_q_start=np.zeros(512, np.int64),
                           tile_q_end=np.full(512, 16, np.int64))
    assert coarsen.lpt_factor(plan, 6, 4, 64, 8, 396, 128, 1024) == 11
    assert coarsen.lpt_factor(plan, 6, 4, 64, 8, 396, 128, 1024, 264) == 16
    assert coarsen.lpt_makespan([(512, 1)], 16, 8, 64, 264, 128) == 1152
    assert coarsen.lpt_makespan([(512, 1)], 11, 8, 64, 264, 128) == 1664
    assert coarsen.lpt_factor(plan, 6, 4, 64, 8, 396, 128, 1024, 396) == 11
    assert coarsen.lpt_factor(plan, 3, 4, 64, 8, 396, 128, 1024) == 6
    assert coarsen.lpt_factor(plan, 3, 4, 64, 8, 396, 128, 1024, 264) == 4
    # 46 tiles, factor 2 (23 programs) on 15 resident slots: two waves of 2-tile programs tie
    # one wave of 4-tile ones without a program cost (the shorter tiles stay), lose with one.
    plan = SimpleNamespace(num_tiles=46, block_kv=8, tile_q_start=np.zeros(46, np.int64),
                           tile_q_end=np.ones(46, np.int64))
    assert coarsen.lpt_factor(plan, 2, 1, 16, 1, 30, 0, 1024, 15) == 2
    assert coarsen.lpt_factor(plan, 2, 1, 16, 1, 30, 128, 1024, 15) == 4


def test_coarsening_model_tries_at_most_17_factors(monkeypatch):
    """A large rule factor (one long sequence, few SMs) samples 17 factors up to twice it,
    so planning stays cheap; none with one wave of programs or more than 8. The C planner
    samples the same ones (test_compiled_plan compares the plans)."""
    from types import SimpleNamespace

    from deft.plan import coarsen

    tried = []
    real = coarsen.lpt_makespan
    monkeypatch.setattr(coarsen, "lpt_makespan", lambda runs, u, *a: tried.append(u) or real(runs, u, *a))
    plan = SimpleNamespace(num_tiles=5000, block_kv=64, tile_q_start=np.zeros(5000, np.int64),
                           tile_q_end=np.ones(5000, np.int64))
    # 13 tiles of 400 x 8 heads = 104 programs on 40 slots: 2.6 waves.
    coarsen.lpt_factor(plan, 400, 4, 64, 8, 40, 128, 1024)
    assert tried == [400 + i * 25 for i in range(17)]
    tried.clear()
    coarsen.lpt_factor(plan, 700, 4, 64, 8, 40, 128, 1024)  # capped at the largest factor
    assert tried == [u for u in (700 + i * 700 // 16 for i in range(17)) if u <= 1024]
    tried.clear()
    assert coarsen.lpt_factor(plan, 400, 4, 64, 8, 104, 128, 1024) == 400  # one wave
    assert coarsen.lpt_factor(plan, 400, 4, 64, 8, 12, 128, 1024) == 400  # more than 8 waves
    assert tried == []


def _h200_coarsening():
    """The H200's coarsening parameters of an uncapped launch (264 resident of 396 modelled
    slots) and of a capped one, and the flatten plans of four trees."""
    from benchmarks.trees import fan_layout
    from deft.plan import coarsen, make_plan

    uncapped = coarsen.Coarsening(4, 64, 8, 132, 4.0, 384, 1024, 396, 128, 264)
    plans = [make_plan(lay, "flatten", 64) for lay in (
        few_shot_layout(4000, 20, 200), few_shot_layout(4000, 50, 200), fan_layout(2000, 256),
        fan_layout(32 * 1024, 16))]
    return uncapped, uncapped._replace(resident_slots=0), plans


def test_sweep_config_slots_model_is_the_rule_before_resident_slots():
    """``benchmarks.sweep --sweep model``'s "model on config slots": for capped launches
    (no resident slots) the shipped rule on four trees; for uncapped ones (264 resident of
    396 modelled slots, the H200's parameters) the rule before such launches were modelled
    on their resident programs: few-shot b=20 at factor 6, where the shipped rule takes 8."""
    from benchmarks.sweep import config_slots_model
    from deft.plan import coarsen

    uncapped, capped, plans = _h200_coarsening()
    for plan in plans:
        ours = config_slots_model()(plan, capped)
        assert np.array_equal(ours.tile_indptr, coarsen.refine(plan, capped).tile_indptr)
    few_shot = plans[0]
    assert coarsen.coarsen_factor(few_shot, uncapped) == 8
    before = config_slots_model()(few_shot, uncapped)
    assert np.array_equal(before.tile_indptr, coarsen.coarsen_plan(few_shot, 6).tile_indptr)


def test_masked_tiles_charged_in_the_launch_model():
    """``Coarsening.masked_cost``: 128 tokens more per tile with a masked part plan few-shot
    b=50 at factor 6 instead of 9 on a capped launch (its 50 one-query branches end masked)
    and few-shot b=20 at 10 instead of 8 on an uncapped one (the H200's parameters); a
    32k-token prompt with 16 queries, whose tiles have none, stays."""
    from deft.plan import coarsen

    uncapped, capped, plans = _h200_coarsening()
    b20, b50, _, long_prompt = plans
    assert coarsen.coarsen_factor(b50, capped) == 9
    assert coarsen.coarsen_factor(b50, capped._replace(masked_cost=128)) == 6
    assert coarsen.coarsen_factor(b20, uncapped._replace(masked_cost=128)) == 10
    for params in (uncapped, capped):
        assert (coarsen.coarsen_factor(long_prompt, params._replace(masked_cost=128))
                == coarsen.coarsen_factor(long_prompt, params))


@pytest.mark.skipif(CUDA, reason="sets the interpreter's config; on a GPU: the gpu tests")
def test_masked_tile_apart_cuts_only_before_a_masked_run_end(monkeypatch):
    """``Coarsening.masked_apart``: the shipped coarsening of few-shot b=20 with one more cut,
    before the prompt run's last plan tile (its tokens partly seen), the H200's parameters;
    and exact against the reference as a step's coarsening (``KernelConfig.masked_apart``,
    interpreted), with one tile more than without."""
    import dataclasses

    from deft.plan import coarsen, make_plan, packing

    params = coarsen.Coarsening(4, 64, 8, 132, 4.0, 384, 1024, 396, 128, 264)
    plan = make_plan(few_shot_layout(4000, 20, 200), "flatten", 64)
    shipped = coarsen.refine(plan, params)
    apart = coarsen.refine(plan, params._replace(masked_apart=True))
    cuts, extra = set(shipped.tile_indptr.tolist()), set(apart.tile_indptr.tolist())
    assert cuts < extra and len(extra - cuts) == 1
    (cut,) = extra - cuts
    tile = int(np.searchsorted(plan.tile_indptr, cut))  # the plan tile starting there
    assert plan.tile_indptr[tile] == cut and plan.tile_q_end[tile] - plan.tile_q_start[tile] == 20
    mask_from = packing.mask_from(plan)
    assert mask_from[tile] < plan.tile_indptr[tile + 1] and mask_from[tile - 1] == cut
    assert coarsen.group_runs(plan)[tile + 1]  # the run's last tile
    layout = few_shot_layout(70, 3, 21)
    tiles = []
    for on in (False, True):
        key = ("interpreter", 0, 0)
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(
            configs.CONFIGS[key], masked_apart=on))
        check(layout, 4, 2, 16, torch.float16)
        attn = TreeAttention(4, 2, 16, backend="triton", device=DEV, block_kv=8)
        tiles.append(attn.plan(layout).num_tiles)
    assert tiles[1] == tiles[0] + 1


def test_sweep_plans_need_no_gpu(capsys):
    """``python -m benchmarks.sweep --plans`` prints each variant's plan of a tree as an
    H200 makes it, on the CPU: the kernel variants keep the shipped plan; the masked tile
    not cut off, the rule before the masked-tile model and fixed factors change it. Two
    sweeps in one run list the shipped configs once; two that share a label other than that
    are refused, and so is an ``--only`` label of no variant."""
    from benchmarks import sweep

    sweep.main(["--plans", "--sweep", "tails,checks,order,model", "few-shot b=20"])
    sweep.main(["--plans", "--sweep", "factors", "--factors", "2", "few-shot b=20"])
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| few-shot")]
    digests = {r[1]: r[-1] for r in rows}
    kernel = {"shipped", "neither", "aligned mask", "ranges first", "aligned mask + ranges first",
              "checked", "deferred V checks", "finite e4m3 scores",
              "deferred V checks + finite e4m3 scores", "per-value checks",
              "row checks by values", "-inf by select", "checks on the output",
              "row checks by sums over one-byte K/V", "queries in order by header",
              "item loads after the wait", "in order + item loads after the wait"}
    model = {label for label, _, _ in sweep.variants("model")[1:]}
    before = "before: config slots and masked tiles neither apart nor charged"
    assert set(digests) == kernel | model | {"u=2"}
    assert len({digests[v] for v in kernel}) == 1
    assert len({digests[v] for v in ("shipped", "not apart", before, "u=2")}) == 4
    labels = [label for name in sweep.SWEEPS for label, _, _ in sweep.variants(name)]
    assert not [label for label in labels if "," in label]  # --only takes a comma list
    assert all(r[2] == "default" and int(r[3]) > 1 for r in rows)
    tiles = {r[1]: int(r[3]) for r in rows}
    assert tiles["not apart"] == tiles["shipped"] - 1  # the prompt's masked end
    assert [r[1] for r in rows].count("shipped") == 2  # once in each of the two runs
    with pytest.raises(SystemExit):
        sweep.main(["--plans", "--sweep", "pipeline,ring", "few-shot b=20"])  # "n32 s4" twice
    with pytest.raises(SystemExit):  # a label of no variant in the sweep
        sweep.main(["--plans", "--sweep", "tails", "--only", "shipped,aligned", "few-shot b=20"])
    assert "--only: no variant 'aligned' in --sweep tails" in capsys.readouterr().err


def test_flatten_tiles_cut_at_long_nodes_stay_exact(monkeypatch):
    """``make_plan(..., node_cut=n)`` keeps the flatten plan's tokens in order and starts a
    tile at every node of at least ``n`` tokens, so flatten's tiles that straddle two
    branches (one group of both, masked) are gone; such plans, coarsened, run exactly
    through the triton backend (the launch model made to prefer the cut)."""
    from deft.plan import make_plan
    from deft.plan.coarsen import masked_tiles

    layout = few_shot_layout(70, 3, 21)
    plan = make_plan(layout, "flatten", 8)
    cut = make_plan(layout, "flatten", 8, node_cut=8)
    assert np.array_equal(cut.token_slots, plan.token_slots)
    assert np.array_equal(cut.token_off, plan.token_off)
    node_starts = np.flatnonzero(np.append(True, plan.token_lo[1:] != plan.token_lo[:-1]))
    assert set(node_starts.tolist()) <= set(cut.tile_indptr[:-1].tolist())
    assert masked_tiles(plan).sum() == 2 and masked_tiles(cut).sum() == 0  # at 64 and 88
    assert cut.num_tiles == plan.num_tiles + 1  # 9 + 3 x 3 tiles where 133 tokens made 17
    assert np.array_equal(make_plan(layout, "flatten", 8, node_cut=22).tile_indptr,
                          plan.tile_indptr)  # no node that long but the prompt at 0
    with pytest.raises(ValueError, match="node_cut"):
        make_plan(layout, "flatten", 8, node_cut=-1)
    cuts = prefer_cuts(monkeypatch, 4)
    for lay in (layout, *TINY.values()):
        check(lay, 4, 2, 16, torch.float16)
    assert len(cuts) == 1 + len(TINY)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name, only, kv", [
    ("tails", "shipped,neither", "auto"),
    ("tails", "shipped,aligned mask + ranges first", "fp8_e4m3"),
    ("checks", "shipped,checked,deferred V checks + finite e4m3 scores", "fp8_e4m3"),
    ("order", "shipped,in order + item loads after the wait", "auto")])
def test_gpu_sweep_times_the_kernel_variants(capsys, name, only, kv):
    """``python -m benchmarks.sweep --sweep tails|checks|order --graph-safe`` on a small
    tree: each kernel and coarsening variant runs, agrees with the float64 reference, and the
    shipped configs and coarsening are back afterwards."""
    from benchmarks import sweep
    from deft.plan import step

    table, refine = dict(configs.CONFIGS), step.refine
    assert sweep.main(["--sweep", name, "--graph-safe", "--kv-dtype", kv, "--only", only,
                       "speculative t=32"]) == 0
    rows = [[c.strip() for c in line.split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("speculative t=32 |")]
    assert [r[1] for r in rows] == only.split(","), rows
    assert all(float(r[7]) < 2e-2 for r in rows), rows
    assert configs.CONFIGS == table and step.refine is refine


def test_config_table_by_arch_head_dim_and_rows(monkeypatch):
    """``kernel_config`` takes the regime of the largest ``rows_from`` at most the step's
    rows; an architecture or head_dim without rows falls back to the defaults'."""
    import dataclasses

    base = configs.KernelConfig(16, 16, 1, 1, 2.0)
    table = {("sm90", 128, 0): base,
             ("sm90", 128, 10): dataclasses.replace(base, merge_heads=4),
             ("sm90", 128, 100): dataclasses.replace(base, merge_heads=8),
             ("sm90", 64, 0): dataclasses.replace(base, merge_heads=2)}
    monkeypatch.setattr(configs, "CONFIGS", table)
    monkeypatch.setattr(configs, "arch_of", lambda device: "sm90")
    assert [configs.kernel_config(128, r).merge_heads for r in (9, 10, 99, 100, 1000)] == [1, 4, 4, 8, 8]
    assert configs.kernel_config(64, 1000).merge_heads == 2  # no regimes of its own above 0
    assert configs.kernel_config(32, 100).merge_heads == 8  # head_dim 128's table
    assert configs.kernel_config(40, 1000).merge_heads == 2  # blocks of 64: that table
    assert configs.kernel_config(96, 100).merge_heads == 8  # blocks of 128
    monkeypatch.setattr(configs, "arch_of", lambda device: "sm100")
    assert configs.kernel_config(128, 10).merge_heads == 4  # sm90's table


@pytest.mark.skipif(CUDA, reason="sets the interpreter's config; on a GPU: the gpu test")
@pytest.mark.filterwarnings("ignore:overflow encountered in reduce:RuntimeWarning")  # the point
@pytest.mark.parametrize("acc", [False, True], ids=["output", "accumulator"])
@pytest.mark.parametrize("tma", [False, True], ids=["gathered", "tma"])
def test_sum_checks_keep_rows_whose_sums_overflow(monkeypatch, fixed_coarsening, tma, acc):
    """``sum_checks`` (with deferred V checks, on the output's rows or with ``acc_checks``
    the accumulator's): V values of 2e37, finite, whose rows of accumulator and output sum
    past fp32's range: the values are tested one by one (after the deferred V checks' test
    and the epilogue's), and every row stays finite and matches the float64 reference."""
    import dataclasses

    layout = few_shot_layout(6, 2, 3)
    q, k, v = random_qkv(layout, 4, 2, 32, torch.float32, 7)
    v = 2e37 * (1.0 + 0.1 * v.abs())
    q, k, v = (x.to(DEV) for x in (q, k, v))
    ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
    fixed_coarsening(1)
    key = ("interpreter", 0, 0)
    monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(
        configs.CONFIGS[key], tma=tma, sum_checks=True, deferred_v_checks=True,
        acc_checks=acc))
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=8)
    attn.plan(layout)
    o, lse = attn.run(q, k, v, return_lse=True)
    assert torch.isinf(o.float().sum(-1)).all()  # every output row's sum overflows fp32
    assert torch.isfinite(o).all()
    assert_close(o.cpu() / 2e37, ref_o.cpu() / 2e37, torch.float32, f"sum checks, tma={tma}")
    assert_lse_close(lse.cpu(), ref_lse.cpu(), f"sum checks, tma={tma}")
