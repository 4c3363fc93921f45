"""Isolation of non-finite K/V on every backend: a query's output depends only on the K/V it
sees. A NaN or ±inf in a row of one node leaves every query that cannot see that row bitwise
equal to the clean run; a (query, head) whose KV head has a non-finite value in a row it sees
gets NaN ``o`` and NaN ``lse`` (the other KV heads' heads of that query stay exact)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import CHECK_VARIANTS, PER_VALUE, TAIL_VARIANTS, random_forest
from deft import PLAN_KINDS, TreeAttention, TreeLayout, merge_states
from deft.ops.reference import reference_attention, visibility_mask
from deft.ops.torch_backend import TorchBackend, _Dense
from benchmarks.trees import few_shot_layout

# NaN arithmetic is the point here: numpy (the Triton interpreter) need not warn about it.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# The torch backend's one-tile and tiled paths, the reference, and triton (interpreted on
# CPU with tiny blocks, compiled on a GPU), also with V's checks deferred (a work item
# computed again with them where its state comes out non-finite).
BACKENDS = ["torch-dense", "torch-tiled", "reference", "triton", "triton-deferred"]
H_Q, H_KV, D = 4, 2, 16  # GQA 2: heads 0-1 read KV head 0, heads 2-3 KV head 1
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def planned(backend: str, layout: TreeLayout, kind: str = "flatten", h_q: int = H_Q,
            h_kv: int = H_KV, d: int = D, device: str = "cpu", block: int = 8) -> TreeAttention:
    """``TreeAttention`` planned for ``layout``; tiles of ``block`` tokens (many partial
    states to merge on tiny trees), except for triton on a GPU: its shipped configs."""
    name = backend.split("-")[0]
    shipped = name == "triton" and device == "cuda"
    attn = TreeAttention(h_q, h_kv, d, backend=name, plan_kind=kind, device=device,
                         block_kv=None if shipped else block)
    with pytest.MonkeyPatch.context() as mp:
        if backend == "torch-tiled":
            mp.setattr(TorchBackend, "dense_limit", 0)
        if backend == "triton-deferred":  # the plan keeps the config it was made with
            from deft.ops.triton import configs

            for key, cfg in list(configs.CONFIGS.items()):
                mp.setitem(configs.CONFIGS, key,
                           dataclasses.replace(cfg, deferred_v_checks=True))
        attn.plan(layout)
    if backend.startswith("torch") and kind != "per_query" and attn.current_plan.num_plan_tokens:
        assert isinstance(attn._prepared, _Dense) == (backend == "torch-dense")
    return attn


def clean_inputs(layout: TreeLayout, dtype: torch.dtype, spare: int = 8, seed: int = 0,
                 h_q: int = H_Q, h_kv: int = H_KV, d: int = D, device: str = "cpu"):
    """Random q, k, v; the caches hold ``spare`` slots past the layout's that no query sees."""
    g = torch.Generator().manual_seed(seed)
    slots = int(layout.kv_indices.max(initial=-1)) + 1 + spare
    q, k, v = (torch.randn(n, h, d, generator=g) for n, h in
               ((layout.num_queries, h_q), (slots, h_kv), (slots, h_kv)))
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))


def expected_nan(layout: TreeLayout, poison: list[tuple[int, int]], h_q: int = H_Q,
                 h_kv: int = H_KV) -> torch.Tensor:
    """``[Q, H_q]`` bool: the (query, head) pairs that see a poisoned ``(slot, kv head)``."""
    vis = visibility_mask(layout)
    out = np.zeros((layout.num_queries, h_q), dtype=bool)
    g = h_q // h_kv
    for slot, kvh in poison:
        sees = vis[:, layout.kv_indices == slot].any(axis=1)
        out[:, kvh * g:(kvh + 1) * g] |= sees[:, None]
    return torch.as_tensor(out)


def assert_isolated(got: tuple[torch.Tensor, torch.Tensor],
                    clean: tuple[torch.Tensor, torch.Tensor], nan: torch.Tensor, what: str) -> None:
    """NaN ``o`` and ``lse`` exactly at ``nan``; elsewhere bitwise the clean run's."""
    (o, lse), (o0, lse0) = (tuple(t.cpu() for t in pair) for pair in (got, clean))
    assert not torch.isnan(o0).any() and not torch.isnan(lse0).any(), f"{what}: clean run has NaN"
    o_nan = torch.isnan(o).all(-1)
    assert torch.equal(o_nan, nan), (
        f"{what}: NaN o at (query, head) {o_nan.nonzero().tolist()}, expected {nan.nonzero().tolist()}")
    assert torch.equal(torch.isnan(lse), nan), (
        f"{what}: NaN lse at {torch.isnan(lse).nonzero().tolist()}, expected {nan.nonzero().tolist()}")
    same = (o == o0).all(-1) & (lse == lse0)
    assert same[~nan].all(), f"{what}: (query, head) {(~same & ~nan).nonzero().tolist()} changed"


def run_poisoned(attn: TreeAttention, q, k, v, poison: list[tuple[int, int, int, float, str]]):
    """``attn.run`` with ``(slot, kv head, element, value, "k"|"v")`` written into copies of K/V."""
    k, v = k.clone(), v.clone()
    for slot, kvh, elem, value, which in poison:
        (k if which == "k" else v)[slot, kvh, elem] = value
    return attn.run(q, k, v, return_lse=True)


# Each scenario: a layout, and the poisoned slots (layout token positions, or "spare" for a
# cache slot the layout does not use).
SCENARIOS = {
    # A prompt and three branches; the middle branch's row 2 is poisoned: its own query sees
    # it, the sibling branches' queries do not.
    "sibling branch": (TreeLayout.from_node_lengths(
        [-1, 0, 0, 0], [20, 6, 5, 7], [1, 2, 3, 3, 0], [6, 5, 7, 3, 11],
        slots=np.random.default_rng(0).permutation(50)[:38]), [28]),
    # Two trees; the second tree's root is poisoned: only its queries see it.
    "another tree": (TreeLayout.from_node_lengths(
        [-1, 0, -1, 2], [9, 4, 12, 3], [1, 3, 2, 0], [4, 3, 12, 9]), [17]),
    # Rows no query sees: a cache slot outside the layout, a live leaf without a query, and
    # tokens of a query's own node past its query_kv_len.
    "unseen slots": (TreeLayout.from_node_lengths(
        [-1, 0, 0], [10, 6, 4], [1, 0], [3, 10]), ["spare", 17, 14, 15]),
}


def fan_and_tree(prompt: int, branches: int, branch_len: int, root: int, child: int) -> TreeLayout:
    """Two trees in consecutive slots: a prompt with ``branches`` branches (a query at each
    end), then a root with one child, queries on all of the child, on its first half and on
    the root."""
    fan = few_shot_layout(prompt, branches, branch_len)
    n, m = fan.num_tokens, fan.num_nodes
    other = TreeLayout.from_node_lengths([-1, 0], [root, child], [1, 1, 0],
                                         [child, child // 2, root])
    return TreeLayout(
        np.concatenate([fan.parents, np.where(other.parents < 0, -1, other.parents + m)]),
        np.concatenate([fan.node_kv_indptr, other.node_kv_indptr[1:] + n]),
        np.arange(n + root + child), np.concatenate([fan.query_nodes, other.query_nodes + m]),
        np.concatenate([fan.query_kv_lens, other.query_kv_lens]))


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param.startswith("triton"):
        pytest.importorskip("triton")
    return request.param


@functools.lru_cache(maxsize=None)
def scenario_run(backend: str, scenario: str):
    """The scenario's planned attention, clean inputs and clean result (computed once: the
    interpreted kernels are slow)."""
    layout, _ = SCENARIOS[scenario]
    triton = backend.startswith("triton")
    dtype = torch.float16 if triton else torch.float32
    device = DEV if triton else "cpu"
    q, k, v = clean_inputs(layout, dtype, device=device)
    attn = planned(backend, layout, device=device)
    return attn, (q, k, v), attn.run(q, k, v, return_lse=True)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_poisoned_rows_reach_only_the_queries_that_see_them(backend, scenario, value, which):
    layout, tokens = SCENARIOS[scenario]
    attn, (q, k, v), clean = scenario_run(backend, scenario)
    spare = k.shape[0] - 1
    slots = [spare if t == "spare" else int(layout.kv_indices[t]) for t in tokens]
    poison = [(s, 1, 3, VALUES[value], which) for s in slots]  # KV head 1, element 3
    nan = expected_nan(layout, [(s, 1) for s in slots])
    assert nan.any() == (scenario != "unseen slots")
    assert_isolated(run_poisoned(attn, q, k, v, poison), clean, nan,
                    f"{backend} {scenario} {value} in {which}")


@pytest.mark.parametrize("backend", ["torch-dense", "torch-tiled", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_every_dtype(backend, dtype):
    """Poison in K and V of both KV heads, in a sibling branch and a spare slot."""
    layout, _ = SCENARIOS["sibling branch"]
    q, k, v = clean_inputs(layout, dtype)
    tok = int(layout.kv_indices[28])
    poison = [(tok, 0, 0, float("nan"), "v"), (tok, 1, 15, float("inf"), "k"),
              (k.shape[0] - 1, 0, 2, float("-inf"), "v")]
    attn = planned(backend, layout)
    assert_isolated(run_poisoned(attn, q, k, v, poison), attn.run(q, k, v, return_lse=True),
                    expected_nan(layout, [(tok, 0), (tok, 1)]), f"{backend} {dtype}")


def test_output_without_lse_follows_the_rule():
    """The one-tile path skips the log-sum-exp when not asked for it: same NaN rows."""
    layout, tokens = SCENARIOS["sibling branch"]
    q, k, v = clean_inputs(layout, torch.float32)
    attn = planned("torch-dense", layout)
    clean = attn.run(q, k, v)
    v[int(layout.kv_indices[tokens[0]]), 0, 5] = float("nan")
    o = attn.run(q, k, v)
    nan = expected_nan(layout, [(int(layout.kv_indices[tokens[0]]), 0)])
    assert torch.equal(torch.isnan(o).all(-1), nan) and torch.equal(o[~nan], clean[~nan])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 40), max_len=st.integers(0, 30),
       roots=st.integers(1, 3), num_poison=st.integers(1, 6),
       backend=st.sampled_from(["torch-dense", "torch-tiled", "reference"]),
       kind=st.sampled_from(PLAN_KINDS), block=st.sampled_from([1, 5, 16, 256]))
def test_random_layouts_with_poisoned_rows(seed, nodes, max_len, roots, num_poison, backend, kind,
                                           block):
    """Random forests, random poisoned (slot, KV head, element, value, K or V), any slot of
    the cache (used or not): NaN exactly where a query's head sees one, elsewhere exact."""
    rng = np.random.default_rng(seed)
    layout = random_forest(rng, nodes, max_len, max_tokens=300, num_roots=roots)
    q, k, v = clean_inputs(layout, torch.float32, seed=seed % 1000)
    poison = [(int(rng.integers(k.shape[0])), int(rng.integers(H_KV)), int(rng.integers(D)),
               list(VALUES.values())[rng.integers(3)], "kv"[rng.integers(2)])
              for _ in range(num_poison)]
    attn = planned(backend, layout, kind, block=block)
    assert_isolated(run_poisoned(attn, q, k, v, poison), attn.run(q, k, v, return_lse=True),
                    expected_nan(layout, [p[:2] for p in poison]), f"{backend} {kind} {block}")


@pytest.mark.parametrize("backend", ["triton", "triton-deferred"])
def test_random_layouts_with_poisoned_rows_triton(backend):
    """The property above on triton (interpreted on CPU: a few small forests)."""
    pytest.importorskip("triton")
    rng = np.random.default_rng(7)
    for kind in ("flatten", "flatten", "node_chunk"):
        layout = random_forest(rng, 12, 12, max_tokens=80, num_roots=2)
        q, k, v = clean_inputs(layout, torch.float32, device=DEV)
        poison = [(int(rng.integers(k.shape[0])), int(rng.integers(H_KV)), int(rng.integers(D)),
                   list(VALUES.values())[rng.integers(3)], "kv"[rng.integers(2)])
                  for _ in range(4)]
        attn = planned(backend, layout, kind, device=DEV)
        assert_isolated(run_poisoned(attn, q, k, v, poison), attn.run(q, k, v, return_lse=True),
                        expected_nan(layout, [p[:2] for p in poison]), f"{backend} {kind}")


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
def test_triton_merge_modes(monkeypatch, fused):
    """Both merge modes carry a poisoned partial state into its own (query, head) only."""
    pytest.importorskip("triton")

    from deft.ops.triton import configs

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, fuse_merge=fused))
    layout = few_shot_layout(30, 3, 9)  # queries see several tiles: partial states to merge
    q, k, v = clean_inputs(layout, torch.float16, device=DEV)
    attn = planned("triton", layout, device=DEV)
    assert (attn._prepared.counts is not None) == fused
    poison = [(int(layout.kv_indices[3]), 0, 1, float("nan"), "v"),  # the prompt: every query
              (int(layout.kv_indices[35]), 1, 0, float("-inf"), "k")]  # the first branch
    assert_isolated(run_poisoned(attn, q, k, v, poison), attn.run(q, k, v, return_lse=True),
                    expected_nan(layout, [p[:2] for p in poison]), f"fused={fused}")


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
def test_triton_padded_head_dim(monkeypatch, fused):
    """Heads of 24 in blocks of 32: poison at either end of a head (its last element, the
    next head's first, which sits right after it in memory) reaches only the queries that
    see it; the padding never loads a neighbour's value."""
    pytest.importorskip("triton")

    from deft.ops.triton import configs

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, fuse_merge=fused))
    d = 24
    layout = few_shot_layout(30, 3, 9)
    q, k, v = clean_inputs(layout, torch.float32, device=DEV, d=d)
    attn = planned("triton", layout, device=DEV, d=d)
    poison = [(int(layout.kv_indices[35]), 0, d - 1, float("nan"), "k"),  # the first branch
              (int(layout.kv_indices[52]), 1, 0, float("inf"), "v")]  # the third branch
    ref = reference_attention(q.double(), k.double(), v.double(), layout, d**-0.5)
    clean = attn.run(q, k, v, return_lse=True)
    torch.testing.assert_close(clean[0].double().cpu(), ref[0].cpu(), atol=1e-5, rtol=1e-5)
    assert_isolated(run_poisoned(attn, q, k, v, poison), clean,
                    expected_nan(layout, [p[:2] for p in poison]), f"fused={fused}")


# Kernel variants (deft.ops.triton.configs.KernelConfig), the same on the interpreter's config
# and on a GPU's but "shipped" (the interpreter's takes neither of the masked tiles'
# variants): the masked tiles' (``TAIL_VARIANTS``: the masked loop from a block boundary
# before mask_from, that with ranges loaded first), every check in place ("checked") and
# the isolation checks' (``CHECK_VARIANTS``: V's checks deferred, a work item recomputed
# with them where its state comes out non-finite, and the flags sm_90 takes).
VARIANTS = {"shipped": {}, "aligned": TAIL_VARIANTS["aligned"], "both": TAIL_VARIANTS["both"],
            "deferred": CHECK_VARIANTS["deferred"],
            "checked": {**PER_VALUE, "deferred_v_checks": False, "kv8_deferred_v_checks": False},
            **CHECK_VARIANTS}


@pytest.mark.skipif(CUDA, reason="on a GPU, TMA runs inside graph capture: the gpu test")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "gathered"])
@pytest.mark.parametrize("value", list(VALUES))
def test_triton_tma_blocks(monkeypatch, value, tma, variant):
    """Tiles of consecutive slots loaded by TMA (interpreted on CPU), or gathered: whole
    blocks, blocks cut at a tile's ``mask_from`` (their box reads on into the tile's masked
    tokens), masked blocks, and the last tile's tail box, which reads the spare slots past
    the layout; with each kernel variant (``VARIANTS``: with the masked tiles' ones a prompt
    token before a tile's ``mask_from`` runs in its masked loop; with V's checks deferred
    the poisoned work items are computed again)."""
    pytest.importorskip("triton")

    from deft.ops.triton import configs, launch

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key,
                            dataclasses.replace(cfg, tma=tma, **VARIANTS[variant]))
    layout = fan_and_tree(40, 3, 11, 20, 9)
    q, k, v = clean_inputs(layout, torch.float32, device=DEV)
    attn = planned("triton", layout, device=DEV, block=32)
    assert attn._prepared.contiguous and attn._prepared.tma == tma
    work = attn._prepared.segment("work").view(-1, 8).numpy()
    assert ((work[:, 5] < work[:, 1]) & ((work[:, 5] - work[:, 0]) % 16 > 0)).any()
    calls = []
    monkeypatch.setattr(launch, "_kv_descriptor",
                        lambda *a, f=launch._kv_descriptor: calls.append(1) or f(*a))
    clean = attn.run(q, k, v, return_lse=True)
    assert bool(calls) == tma, "the TMA path was not taken" if tma else "TMA without tma"
    # A prompt token, a prompt token before the second tile's mask_from (40) but past the
    # block boundary (32), a second-branch token, the second tree's first token (right after
    # the fan), a token of its child past the half-child query's kv length (in V: rows of its
    # work item that do not see it), the first spare slot (in K and in V); KV heads in turns.
    slots = [7, 35, 40 + 11 + 5, 73, 73 + 20 + 6, layout.num_tokens, layout.num_tokens]
    poison = [(s, i % H_KV, i, VALUES[value], which)
              for i, (s, which) in enumerate(zip(slots, "kkvvvkv"))]
    assert_isolated(run_poisoned(attn, q, k, v, poison), clean,
                    expected_nan(layout, [p[:2] for p in poison]),
                    f"{'tma' if tma else 'gathered'} {variant} {value}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_triton_merge_kernel_propagates_invalid_states(bad):
    """The merge kernel (``merge_states`` on CUDA): an lse of NaN or +inf makes its own
    (row, head) NaN, as the CPU ``merge_states``; other rows and heads are untouched."""
    pytest.importorskip("triton")
    from deft.ops.triton.launch import launch_merge

    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 4, 3, 16, generator=g)
    s = torch.randn(3, 4, 3, generator=g)
    s[1, 2, 0] = bad
    s[2, :2] = float("-inf")
    ref_o, ref_lse = merge_states(v, s)
    v, s = v.to(DEV), s.to(DEV)
    o = torch.empty(3, 3, 16, device=DEV)
    lse = torch.empty(3, 3, device=DEV)
    indptr = torch.arange(0, 13, 4, dtype=torch.int32, device=DEV)
    launch_merge(v.view(12, 3, 16), s.view(12, 3), o, lse, indptr,
                 torch.arange(12, dtype=torch.int32, device=DEV), heads=2)
    nan = torch.zeros(3, 3, dtype=torch.bool)
    nan[1, 0] = True
    assert torch.equal(torch.isnan(ref_lse), nan) and torch.isnan(ref_o[1, 0]).all()
    assert torch.equal(torch.isnan(lse.cpu()), nan) and torch.equal(torch.isnan(o.cpu()).all(-1), nan)
    torch.testing.assert_close(o.cpu()[~nan], ref_o[~nan])
    torch.testing.assert_close(lse.cpu()[~nan], ref_lse[~nan])


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize("path", ["torch-dense", "torch-tiled"])
def test_engine_a_poisoned_request_leaves_the_others_exact(monkeypatch, path):
    """Two requests in one engine: NaN in request A's K/V (every layer) leaves request B's
    logits bitwise equal, on a step where only B decodes and on one where both do (their
    tokens share tiles); A's own next logits are NaN."""
    from deft.engine import TreeEngine
    from strategies_on_device import PROMPT, model, tokenizer

    if path == "torch-tiled":
        monkeypatch.setattr(TorchBackend, "dense_limit", 0)
    net, tok = model("cpu", torch.float32, layers=2), tokenizer()
    runs = []
    for poisoned in (False, True):
        engine = TreeEngine(net, tok, num_pages=16, page_size=16, backend="torch")
        a, b = engine.add_prompt(PROMPT[:37]), engine.add_prompt(PROMPT[40:69])
        engine.extend([(a, PROMPT[37:38]), (b, PROMPT[69:70])])
        if poisoned:
            slots = torch.as_tensor(engine.cache.slots(a))
            for layer in range(engine.pool.num_layers):
                engine.pool.k[layer].view(-1, 2, 32)[slots[::3], 0, 1] = float("inf")
                engine.pool.v[layer].view(-1, 2, 32)[slots[1::3]] = float("nan")
        (logits_b,) = engine.extend([(b, [5])])
        (logits_a,) = engine.extend([(a, [5])])
        both_a, both_b = engine.extend([(a, [6]), (b, [6])])
        runs.append((logits_b, logits_a, both_b, both_a))
    (clean_b, clean_a, clean_both_b, clean_both_a), (got_b, got_a, got_both_b, got_both_a) = runs
    for t in (clean_b, clean_a, clean_both_b, clean_both_a):
        assert torch.isfinite(t).all()
    assert torch.equal(got_b, clean_b) and torch.equal(got_both_b, clean_both_b)
    assert torch.isnan(got_a).all() and torch.isnan(got_both_a).all()


# ---------------------------------------------------------------- GPU


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["torch-dense", "torch-tiled"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_gpu_torch_backend(path, scenario):
    """The torch backend on CUDA tensors (no screening sum there: the exact test always runs)."""
    layout, tokens = SCENARIOS[scenario]
    q, k, v = clean_inputs(layout, torch.bfloat16, device="cuda")
    slots = [k.shape[0] - 1 if t == "spare" else int(layout.kv_indices[t]) for t in tokens]
    poison = [(s, 0, 3, float("-inf"), "k") for s in slots] + [(s, 1, 0, float("nan"), "v")
                                                               for s in slots]
    attn = planned(path, layout, device="cuda")
    assert_isolated(run_poisoned(attn, q, k, v, poison), attn.run(q, k, v, return_lse=True),
                    expected_nan(layout, [(s, h) for s in slots for h in (0, 1)]),
                    f"{path} on cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", [{}, {"fuse_merge": True}, TAIL_VARIANTS["neither"],
                                     VARIANTS["checked"]],
                         ids=["merge-launch", "fused-merge", "masked-tiles-neither",
                              "checked-v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_gpu_triton_isolation(monkeypatch, dtype, graph, variant):
    """The shipped kernel configs (with TMA allowed; the merge fused, the masked tiles'
    variants off, or V's checks in place, in turns) on the Llama-3-8B
    attention shape: a prompt with branches in one tree and a second tree, poison in a
    branch, in the second tree and in a spare slot.
    Eagerly K/V are gathered; inside a CUDA graph consecutive-slot tiles load by TMA on
    sm_90+ (the same graph replays the clean and the poisoned cache, so their results
    compare bitwise)."""

    from deft.ops.triton import configs, launch

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, tma=True, **variant))
    layout = fan_and_tree(1500, 7, 77, 300, 50)
    n = 1500 + 7 * 77
    h_q, h_kv, d = 32, 8, 128
    q, k, v = clean_inputs(layout, dtype, spare=64, h_q=h_q, h_kv=h_kv, d=d, device="cuda")
    branch = 1500 + 77 * 3 + 40  # a token of the fourth branch
    slots = [int(layout.kv_indices[t]) for t in (branch, n + 100, n + 330)] + [k.shape[0] - 5]
    poison = [(slots[0], 3, 7, float("nan"), "v"), (slots[1], 5, 0, float("-inf"), "k"),
              (slots[2], 0, 127, float("inf"), "v"), (slots[3], 2, 2, float("nan"), "k"),
              (n, 1, 1, float("nan"), "v")]  # the second tree's first token, after the fan's last
    nan = expected_nan(layout, [p[:2] for p in poison], h_q, h_kv)
    attn = planned("triton", layout, h_q=h_q, h_kv=h_kv, d=d, device="cuda")
    if not graph:
        assert_isolated(run_poisoned(attn, q, k, v, poison), attn.run(q, k, v, return_lse=True),
                        nan, f"triton {dtype} eager")
        return
    assert attn._prepared.tma == launch.has_tma(q.device)
    kk, vv = k.clone(), v.clone()
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    attn.run(q, kk, vv, return_lse=True, out=out, lse_out=lse)  # compiles outside capture
    calls = []
    monkeypatch.setattr(launch, "_kv_descriptor",
                        lambda *a, f=launch._kv_descriptor: calls.append(1) or f(*a))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q, kk, vv, return_lse=True, out=out, lse_out=lse)
    assert bool(calls) == attn._prepared.tma, "the captured launch did not take the TMA path"
    results = []
    for bad in (False, True):
        kk.copy_(k)
        vv.copy_(v)
        for slot, kvh, elem, value, which in poison if bad else []:
            (kk if which == "k" else vv)[slot, kvh, elem] = value
        g.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), lse.clone()))
    assert_isolated(results[1], results[0], nan, f"triton {dtype} cuda graph")
