"""Graph-safe attention (``TreeAttention(capacity=...)``, triton backend): every plan writes
into the reserved buffers and every run launches with the same arguments, so one CUDA graph
replays every later plan that fits. Interpreted on CPU (launch arguments compared plan to
plan, outputs against the reference), captured and replayed on a GPU under ``-m gpu``."""

import dataclasses

import numpy as np
import pytest
import torch

from conftest import assert_close, assert_lse_close, prefer_cuts
from deft import Capacity, TreeAttention, TreeLayout
from deft.ops.reference import reference_attention

pytest.importorskip("triton")
from deft.ops.triton import configs, launch  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
H_Q, H_KV, D = 4, 2, 32


def random_tree(rng: np.random.Generator, num_queries: int, max_tokens: int) -> TreeLayout:
    """A random forest of ``num_queries`` queries, at most ``max_tokens`` tokens in slots of a
    ``max_tokens`` cache, queries with partial ``query_kv_len`` on random nodes; a third of
    the forests have nodes of up to 150 tokens (plans that may cut tiles at long nodes)."""
    n = int(rng.integers(1, 40))
    parents = [-1] + [int(rng.integers(-1, i)) if rng.random() < 0.1 else int(rng.integers(0, i))
                      for i in range(1, n)]
    lens = rng.integers(0, 150 if rng.random() < 0.3 else 30, n)
    if lens.sum() > max_tokens:
        lens = lens * max_tokens // lens.sum()
    qn = rng.integers(0, n, num_queries)
    qlen = np.where(rng.random(num_queries) < 0.5, lens[qn], (rng.random(num_queries) * (lens[qn] + 1)).astype(int))
    slots = rng.permutation(max_tokens)[:int(lens.sum())]
    if rng.random() < 0.3:  # consecutive slots (TMA tiles on a GPU)
        slots = np.arange(int(lens.sum()))
    return TreeLayout.from_node_lengths(parents, lens, qn, qlen, slots=slots)


def _key(x):
    """What a launch argument tells the kernel: a tensor's or pointer's address and layout."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, launch.Pointer):
        return ("pointer", x.address, x.dtype)
    if hasattr(x, "base"):  # a TMA descriptor
        return ("descriptor", x.base.data_ptr(), tuple(x.shape), tuple(x.block_shape))
    return x


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch's grid, arguments and options, as plain values (Triton launches
    all: a CUDA plan records no driver launches to repeat past the recorder)."""
    from deft.ops.triton import backend

    monkeypatch.setattr(backend, "driver_launch", lambda: None)
    seen = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.append((self.kernel.fn.__name__, grid, tuple(_key(a) for a in args),
                             tuple(sorted(kw.items()))))
                return self.kernel[grid](*args, **kw)
            return run

        def warmup(self, *args, **kw):
            return self.kernel.warmup(*args, **kw)

    monkeypatch.setattr(launch, "tree_partial_kernel", Recorder(launch.tree_partial_kernel))
    monkeypatch.setattr(launch, "merge_kernel", Recorder(launch.merge_kernel))
    return seen


def small_grid(monkeypatch) -> None:
    """Graph-safe grids of 4 programs (one per SM of a device taken to have 4, as the
    interpreter does): fewer than the plans' (work item, KV head) pairs, so programs loop
    over several work items."""
    from deft.ops.triton import backend

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key,
                            dataclasses.replace(cfg, graph_waves=1, programs_per_sm=1))
    monkeypatch.setattr(backend, "_num_sms", lambda device: 4)


def reservation(nq: int, cache: int, seed: int):
    """A graph-safe attention reserved for ``nq`` queries over a ``cache``-slot K/V cache, and
    random fp16 q, K and V for it."""
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device=DEV, block_kv=None if CUDA else 8,
                         capacity=Capacity(queries=nq, tokens=cache))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, H_Q, D, generator=g).half().to(DEV)
    k, v = (torch.randn(cache, H_KV, D, generator=g).half().to(DEV) for _ in range(2))
    return attn, q, k, v


def test_plans_change_no_launch_argument_and_stay_exact(launches, monkeypatch):
    """Eight random trees through one reservation of 4 programs, which loop over work items."""
    small_grid(monkeypatch)
    rng = np.random.default_rng(0)
    nq, cache = 5, 160
    attn, q, k, v = reservation(nq, cache, seed=1)
    out, lse_out = torch.empty_like(q), torch.empty(nq, H_Q, device=DEV)
    first = None
    shapes, pairs = set(), 0
    for i in range(8):
        layout = random_tree(rng, nq, cache)
        plan = attn.plan(layout)
        shapes.add((plan.num_tiles, plan.num_partials))
        pairs = max(pairs, attn._prepared.num_work * H_KV)
        launches.clear()
        attn.run(q, k, v, return_lse=True, out=out, lse_out=lse_out)
        if first is None:
            first = list(launches)
        assert launches == first, f"plan {i} changed a launch"
        ref_o, ref_lse = reference_attention(q, k, v, layout, D**-0.5)
        assert_close(out.cpu(), ref_o.cpu(), torch.float16, f"graph-safe plan {i}")
        assert_lse_close(lse_out.cpu(), ref_lse.cpu(), f"graph-safe plan {i}")
    assert len(shapes) > 4  # the trees really differed
    assert pairs > attn._reserved.programs
    assert [name for name, *_ in first] == ["tree_partial_kernel", "merge_kernel"]


def test_plans_cut_at_long_nodes_stay_exact(launches, monkeypatch):
    """Trees whose plans cut tiles at long nodes (``node_cut``; the launch model made to
    prefer the cut, which a step keeps where it holds no more partial states) through one
    reservation of 4 programs: no launch argument changes, outputs exact."""
    from deft.plan.coarsen import masked_tiles

    small_grid(monkeypatch)
    cuts = prefer_cuts(monkeypatch, 4)
    nq, cache = 6, 200
    attn, q, k, v = reservation(nq, cache, seed=2)
    out = torch.empty_like(q)
    layouts = [TreeLayout.from_node_lengths([-1] * 6, [21] * 6, list(range(6))),
               TreeLayout.from_node_lengths([-1] + [0] * 5, [37] + [13] * 5, list(range(6)))]
    rng = np.random.default_rng(3)
    layouts += [random_tree(rng, nq, cache) for _ in range(4)]
    first = None
    for i, layout in enumerate(layouts):
        plan = attn.plan(layout)
        if i == 0:  # the six prompts cut apart: no tile of two prompts, none masked
            assert not masked_tiles(plan).any()
        launches.clear()
        attn.run(q, k, v, out=out)
        if first is None:
            first = list(launches)
        assert launches == first, f"plan {i} changed a launch"
        ref_o, _ = reference_attention(q, k, v, layout, D**-0.5)
        assert_close(out.cpu(), ref_o.cpu(), torch.float16, f"cut plan {i}")
    assert plan.kind == "flatten" and len(cuts) == len(layouts)
    assert [name for name, *_ in first] == ["tree_partial_kernel", "merge_kernel"]


@pytest.mark.parametrize("flags", [dict(header_in_order=True), dict(early_item_loads=True),
                                   dict(early_item_loads=False),
                                   dict(header_in_order=True, early_item_loads=True)],
                         ids=["in-order", "early", "late", "both"])
def test_query_order_flags_stay_exact(monkeypatch, flags):
    """``header_in_order`` (no query-order load where the header says the queries are in
    plan order) and ``early_item_loads``: random trees whose queries are in plan order and
    trees whose are not, through one reservation, against the reference; the header's flag
    is the plan's."""
    from deft.plan.tree_plan import dfs_preorder

    small_grid(monkeypatch)
    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, **flags))
    rng = np.random.default_rng(3)
    nq, cache = 5, 160
    attn, q, k, v = reservation(nq, cache, seed=4)
    seen = set()
    for i in range(6):
        layout = random_tree(rng, nq, cache)
        if i % 2:  # the same tree with its queries in plan (DFS preorder) order
            order, _ = dfs_preorder(layout.parents)
            pre = np.empty_like(order)
            pre[order] = np.arange(order.shape[0])
            by = np.argsort(pre[layout.query_nodes], kind="stable")
            layout = TreeLayout(layout.parents, layout.node_kv_indptr, layout.kv_indices,
                                layout.query_nodes[by], layout.query_kv_lens[by])
        plan = attn.plan(layout)
        in_order = bool((plan.query_order == np.arange(nq)).all())
        assert int(attn._reserved.plan_buffer[10]) == in_order
        seen.add(in_order)
        out, lse = attn.run(q, k, v, return_lse=True)
        ref_o, ref_lse = reference_attention(q, k, v, layout, D**-0.5)
        assert_close(out.cpu(), ref_o.cpu(), torch.float16, f"{flags}, tree {i}")
        assert_lse_close(lse.cpu(), ref_lse.cpu(), f"{flags}, tree {i}")
    assert seen == {False, True}


def test_a_plan_beyond_the_capacity_is_refused_and_the_buffers_keep_the_last_plan():
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device=DEV, block_kv=None if CUDA else 8,
                         capacity=Capacity(queries=2, tokens=64))
    small = TreeLayout.from_node_lengths([-1, 0, 0], [20, 5, 7], [1, 2])
    attn.plan(small)
    q, k, v = (torch.randn(*s, dtype=torch.float16).to(DEV) for s in ((2, H_Q, D), (64, H_KV, D), (64, H_KV, D)))
    before = attn.run(q, k, v).clone()
    buffer = attn._reserved.plan_buffer.clone()
    with pytest.raises(ValueError, match=r"layout: this step needs 100 plan tokens, beyond the reserved capacity of 64"):
        attn.plan(TreeLayout.from_node_lengths([-1, 0, 0], [90, 5, 5], [1, 2]))
    assert torch.equal(attn._reserved.plan_buffer, buffer)
    with pytest.raises(ValueError, match="layout: expected 2 queries"):
        attn.plan(TreeLayout.from_node_lengths([-1, 0], [20, 5], [1]))
    attn.plan(small)  # the next plan that fits works again
    assert torch.equal(attn.run(q, k, v), before)
    tight = TreeAttention(H_Q, H_KV, D, backend="triton", device=DEV, block_kv=8,
                          capacity=Capacity(queries=2, tokens=64, partials=2))
    with pytest.raises(ValueError, match="partial states, beyond the reserved capacity of 2"):
        tight.plan(small)


def test_capacity_needs_a_graph_safe_backend():
    with pytest.raises(ValueError, match="capacity: the torch backend is not graph-safe"):
        TreeAttention(H_Q, H_KV, D, backend="torch", capacity=Capacity(2, 64))
    with pytest.raises(ValueError, match="capacity.tokens: expected a positive integer"):
        TreeAttention(H_Q, H_KV, D, backend="triton", capacity=Capacity(2, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid", ["shipped", "4 programs"])
@pytest.mark.parametrize("kv", ["16-bit", "fp8", "fp8 few rows", "16-bit light", "fp8 light"])
def test_one_capture_replays_100_random_trees(dtype, grid, kv, monkeypatch):
    """Capture two layers once; then plan and replay 100 random trees of different shapes,
    with the shipped grid and with 4 programs (which loop over work items), over
    16-bit K/V and FP8 K/V with per-head scales (against the dequantised K/V's reference),
    the latter also reserved for the few-row build (``Capacity(build="few_rows")``), and
    steps of 2,048 rows reserved for the uncapped build (``"light"``)."""
    from deft.cache.pool import FP8, quantize

    if grid == "4 programs":
        small_grid(monkeypatch)
    rng = np.random.default_rng(7)
    light = kv.endswith("light")
    build = "few_rows" if kv == "fp8 few rows" else "light" if light else "default"
    nq, cache, h_q, h_kv, d = 64 if light else 24, 3000, 32, 8, 128
    attn = TreeAttention(h_q, h_kv, d, backend="triton", device="cuda",
                         capacity=Capacity(queries=nq, tokens=cache, build=build))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(nq, h_q, d, device="cuda", dtype=dtype, generator=g)
    ks = [torch.randn(cache, h_kv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2)]
    vs = [torch.randn(cache, h_kv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2)]
    scales: list[dict] = [{}, {}]
    kv_dtype = FP8 if kv.startswith("fp8") else None
    if kv_dtype is not None:
        for i in range(2):
            k_s, v_s = (torch.rand(h_kv, device="cuda", generator=g) * 0.02 + 0.01
                        for _ in range(2))
            ks[i], vs[i] = quantize(ks[i].float(), k_s, FP8), quantize(vs[i].float(), v_s, FP8)
            scales[i] = dict(k_scale=k_s, v_scale=v_s)
    outs = [torch.empty_like(q) for _ in range(2)]
    attn.plan(random_tree(rng, nq, cache), kv_dtype)
    assert attn._prepared.config.block_m == (16 if kv == "fp8 few rows" else 64)
    assert (attn._prepared.config.maxnreg is None) == (light or nq * h_q < 2048)
    for i in range(2):  # compile (the TMA variant too) before capture
        attn.run(q, ks[i], vs[i], out=outs[i], **scales[i])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(2):
            attn.run(q, ks[i], vs[i], out=outs[i], **scales[i])
    pairs = 0
    for t in range(100):
        layout = random_tree(rng, nq, cache)
        attn.plan(layout, kv_dtype)
        pairs = max(pairs, attn._prepared.num_work * h_kv)
        graph.replay()
        for i in range(2):
            k, v = ks[i], vs[i]
            if kv_dtype is not None:
                k, v = (x.float() * scales[i][name][:, None]
                        for x, name in ((k, "k_scale"), (v, "v_scale")))
            ref_o, _ = reference_attention(q, k, v, layout, d**-0.5)
            assert_close(outs[i].cpu(), ref_o.cpu(), dtype, f"replayed tree {t}, layer {i}")
    assert grid == "shipped" or pairs > attn._reserved.programs
