"""The engine's seams on CPU: a toy model family registered and loaded through
``load_model`` runs through the real engine without being a ``LlamaModel``; a toy K/V
format (float16, per-layer scales) runs through the real engine on a toy backend; a
step is a value that a second runner computes alike; a host plan uploads to several
attentions; ``EngineConfig`` checks its fields in one place."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import Letters, random_forest, random_qkv
from deft import KVSpec, TreeAttention, register_backend
from deft.engine import EngineConfig, SamplingParams, TreeEngine, generate
from deft.engine.runner import ModelRunner
from deft.model import (Family, LlamaConfig, LlamaModel, families, load_model, register_family,
                        unregister_family)
from deft.ops import _FACTORIES, _INSTANCES, Backend
from deft.ops.reference import reference_attention
from deft.plan import make_plan

VOCAB, HIDDEN, HEADS, KV_HEADS, DIM, LAYERS = 40, 32, 4, 2, 8, 2


class AttentionOnly:
    """A decoder of attention-only layers without positions: not a ``LlamaModel``, not
    even an ``nn.Module``; it keeps the contract the engine asks for and nothing more."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        w = lambda *shape: torch.randn(*shape, generator=g) / math.sqrt(shape[0])  # noqa: E731
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=512,
                                      num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                      head_dim=DIM)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        self.layers = [(w(HIDDEN, HEADS * DIM), w(HIDDEN, KV_HEADS * DIM),
                        w(HIDDEN, KV_HEADS * DIM), w(HEADS * DIM, HIDDEN)) for _ in range(LAYERS)]
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.kv_shape = (LAYERS, KV_HEADS, DIM)

    def attention(self, device=None, backend="auto", **kwargs) -> TreeAttention:  # noqa: ANN001
        return TreeAttention(HEADS, KV_HEADS, DIM, backend=backend,
                             device=self.device if device is None else device, **kwargs)

    def __call__(self, input_ids, positions, write_slots, attn, pool, logits_rows=None,
                 captured=False):  # noqa: ANN001
        n, x = input_ids.shape[0], self.embed[input_ids]
        for i, (wq, wk, wv, wo) in enumerate(self.layers):
            pool.write(i, write_slots, (x @ wk).view(n, KV_HEADS, DIM),
                       (x @ wv).view(n, KV_HEADS, DIM))
            o = attn.run((x @ wq).view(n, HEADS, DIM), pool.k_slots[i], pool.v_slots[i])
            x = x + o.reshape(n, -1) @ wo
        if logits_rows is not None:
            x = x[logits_rows]
        return x @ self.embed.T

    def dense_logits(self, ids: list[int]) -> torch.Tensor:
        """Float64 logits of every prefix of ``ids``, by causal attention over the sequence."""
        d = lambda t: t.double()  # noqa: E731
        n, x = len(ids), d(self.embed[torch.tensor(ids)])
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for wq, wk, wv, wo in self.layers:
            q = (x @ d(wq)).view(n, HEADS, DIM)
            k = (x @ d(wk)).view(n, KV_HEADS, DIM).repeat_interleave(HEADS // KV_HEADS, 1)
            v = (x @ d(wv)).view(n, KV_HEADS, DIM).repeat_interleave(HEADS // KV_HEADS, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
            p = s.masked_fill(~causal, -math.inf).softmax(-1)
            x = x + torch.einsum("hqk,khd->qhd", p, v).reshape(n, -1) @ d(wo)
        return x @ d(self.embed).T


@pytest.fixture
def toy_family():
    def load_hf(folder, device, dtype):  # noqa: ANN001
        with open(f"{folder}/config.json") as f:
            seed = json.load(f)["seed"]
        return AttentionOnly(seed), Letters(VOCAB)

    register_family(Family("attention-only", hf_model_types=("attention-only",), load_hf=load_hf))
    yield
    unregister_family("attention-only")


def test_a_family_is_listed_while_registered():
    before = [f.name for f in families()]
    register_family(Family("listed", hf_model_types=("listed",), load_hf=lambda *args: None))
    try:
        assert [f.name for f in families()] == [*before, "listed"]
    finally:
        unregister_family("listed")
    assert [f.name for f in families()] == before and "llama" in before


def test_a_registered_toy_family_loads_and_decodes_through_the_engine(toy_family, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "attention-only", "seed": 3}))
    model, tok = load_model(tmp_path)
    assert isinstance(model, AttentionOnly) and not isinstance(model, torch.nn.Module)
    engine = TreeEngine(model, tok, num_pages=32, page_size=4, backend="torch")
    prompt = [5, 17, 2, 33, 8, 8, 21]
    (result,) = generate(engine, [prompt], SamplingParams(max_new_tokens=10,
                                                         stop_token_ids=frozenset()))
    assert len(result.token_ids) == 10
    ref = model.dense_logits(prompt + result.token_ids)
    for i, t in enumerate(result.token_ids):  # each greedy pick is the reference's argmax
        row = ref[len(prompt) - 1 + i]
        assert row[t] >= row.max() - 1e-4, (i, t, int(row.argmax()))
    # One forward's logits against the reference, rows of a fork included.
    root = engine.add_prompt(prompt[:-1])
    a, b = engine.cache.fork(root, 2)
    la, lb = engine.extend([(a, prompt[-1:]), (b, [9, 4])], logits="all")
    torch.testing.assert_close(la.double(), ref[len(prompt) - 1:len(prompt)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lb.double(), model.dense_logits(prompt[:-1] + [9, 4])[-2:],
                               atol=1e-4, rtol=1e-4)


def test_families_name_what_they_support(toy_family, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    with pytest.raises(ValueError, match="model_type: expected one of llama, mistral, .*"
                                         "attention-only, got 'gemma'"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="family 'other': llama already claimed by family 'llama'"):
        register_family(Family("other", hf_model_types=("llama",), load_hf=lambda *a: None))
    with pytest.raises(TypeError, match="hf_model_types: given, but its loader is None"):
        Family("broken", hf_model_types=("x",))


def test_the_engine_refuses_what_is_not_a_decoder():
    with pytest.raises(TypeError, match="model: expected a decoder model .* without kv_shape"):
        TreeEngine(SimpleNamespace(config=AttentionOnly(0).config, device=torch.device("cpu"),
                                   dtype=torch.float32, attention=None), Letters(VOCAB))


# ----------------------------------------------------------- a toy K/V format


class ScaledKV(Backend):
    """Float16 K/V with per-layer scales, dequantised before the reference attention."""

    name = "scaled-kv"
    dtypes = (torch.float32,)
    kv_dtypes = (torch.float16,)
    kv_scales = True
    seen: list[tuple[float, float]] = []

    def plan(self, layout, plan_kind, block_kv, heads, device, previous=None, kv_dtype=None):  # noqa: ANN001
        assert kv_dtype == torch.float16
        return SimpleNamespace(plan=make_plan(layout, plan_kind, block_kv), layout=layout)

    def run(self, prepared, q, k_cache, v_cache, sm_scale, *, out=None, lse_out=None,  # noqa: ANN001
            want_lse=True, k_scale=None, v_scale=None, captured=False):
        ScaledKV.seen.append((float(k_scale), float(v_scale)))
        o, lse = reference_attention(q, k_cache.float() * k_scale, v_cache.float() * v_scale,
                                     prepared.layout, sm_scale)
        return o.float(), lse.float()


@pytest.fixture
def scaled_kv():
    register_backend("scaled-kv", ScaledKV)
    ScaledKV.seen = []
    yield
    _FACTORIES.pop("scaled-kv", None)
    _INSTANCES.pop("scaled-kv", None)


def tiny_llama() -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=256)
    return LlamaModel(config).eval().requires_grad_(False)


def test_a_scaled_float16_kv_format_runs_through_the_engine(scaled_kv):
    model, tok = tiny_llama(), Letters(VOCAB)
    plain = TreeEngine(model, tok, num_pages=16, page_size=4, backend="torch")
    scaled = TreeEngine(model, tok, EngineConfig(num_pages=16, page_size=4, backend="scaled-kv",
                                                 kv=KVSpec(torch.float16, "per_layer")))
    pool = scaled.pool
    assert pool.spec == KVSpec(torch.float16, "per_layer") and pool.k[0].dtype == torch.float16
    assert not pool.calibrated
    pool.set_scales(torch.tensor([[0.25], [2.0]]), torch.tensor([[4.0], [0.5]]))
    assert pool.calibrated
    prompt = [3, 14, 15, 9, 26, 5, 35]
    got, want = [], []
    for engine, out in ((scaled, got), (plain, want)):
        root = engine.add_prompt(prompt[:-1])
        kids = engine.cache.fork(root, 2)
        out += engine.extend([(kids[0], prompt[-1:]), (kids[1], [7, 7, 1])], logits="all")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=3e-3, rtol=3e-3)  # float16 K/V against float32
    assert sorted(set(ScaledKV.seen)) == [(0.25, 4.0), (2.0, 0.5)]
    # The pool holds K / k_scale in float16: layer 0's K is the plain pool's, times 4.
    slots = torch.as_tensor(scaled.cache.slots(0))
    torch.testing.assert_close(pool.k_slots[0][slots].float() * 0.25,
                               plain.pool.k_slots[0][slots], atol=2e-3, rtol=2e-3)


def test_kv_dtype_and_scales_are_checked_before_any_kernel(scaled_kv):
    layout = random_forest(np.random.default_rng(0), 4, 10, max_tokens=40)
    q, k, v = random_qkv(layout, 2, 1, 16, torch.float32, seed=0)
    attn = TreeAttention(2, 1, 16, backend="torch")
    with pytest.raises(TypeError, match="kv_dtype: expected one of float16, bfloat16, float32, "
                                        "float64, float8_e4m3fn for backend 'torch', got "
                                        "torch.int8"):
        attn.plan(layout, kv_dtype=torch.int8)
    attn.plan(layout, kv_dtype=torch.float64)
    with pytest.raises(TypeError, match="q: expected dtype torch.float64, the planned kv_dtype"):
        attn.run(q, k.double(), v.double())
    ref = TreeAttention(2, 1, 16, backend="reference")
    ref.plan(layout)
    with pytest.raises(ValueError, match="the reference backend reads no K/V scales"):
        ref.run(q, k, v, k_scale=1.0, v_scale=1.0)
    toy = TreeAttention(2, 1, 16, backend="scaled-kv")
    with pytest.raises(TypeError, match="kv_dtype: expected one of float32, float16 for backend"):
        toy.plan(layout, kv_dtype=torch.float64)
    toy.plan(layout, kv_dtype=torch.float16)
    kh, vh = k.half(), v.half()
    with pytest.raises(TypeError, match="k_cache: expected dtype torch.float16 the planned kv_dtype"):
        toy.run(q, k, v, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale: expected a scale, as k_scale is given"):
        toy.run(q, kh, vh, k_scale=1.0)
    with pytest.raises(ValueError, match="k_scale: expected a positive finite number"):
        toy.run(q, kh, vh, k_scale=-2.0, v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale: expected a float32 tensor of shape \[1\] or "
                                         r"\[num_kv_heads=1\]"):
        toy.run(q, kh, vh, k_scale=1.0, v_scale=torch.ones(2))
    o = toy.run(q, kh, vh, k_scale=0.5, v_scale=torch.tensor([2.0]))
    ref, _ = reference_attention(q, kh.float() * 0.5, vh.float() * 2.0, layout, 16**-0.5)
    torch.testing.assert_close(o, ref.float())
    with pytest.raises(TypeError, match="scale: expected one of none, per_layer|dtype"):
        KVSpec(torch.int8)
    with pytest.raises(ValueError, match="scale: expected one of none, per_layer, per_head, got "
                                         "'tensor'"):
        KVSpec(torch.float16, "tensor")


# ------------------------------------------------- steps, runners, host plans


def test_a_step_is_a_value_a_second_runner_computes_alike():
    """Every step the engine builds, mirrored to a second runner of its own pool, gives the
    same logits: the step carries all a device needs (copies of committed paths included)."""
    model, tok = tiny_llama(), Letters(VOCAB)
    engine = TreeEngine(model, tok, num_pages=16, page_size=4, backend="torch")
    mirror = ModelRunner(model, engine.config)
    run, seen = engine.runner.run, []

    def both(step):  # noqa: ANN001
        out = run(step)
        torch.testing.assert_close(mirror.run(step), out, atol=0, rtol=0)
        seen.append(step)
        return out

    engine.runner.run = both
    root = engine.add_prompt([1, 2, 3, 4, 5])
    (leaf,) = engine.cache.fork(root, 1)
    engine.extend([(leaf, [6])])
    ids, _ = engine.extend_tree(leaf, [-1, 0, 0, 1], [7, 8, 9, 10])
    engine.cache.commit_path(leaf, [ids[0], ids[2]])  # draft 2 moves next to draft 0
    engine.extend([(leaf, [11])])
    assert [len(s.copies) for s in seen] == [0, 0, 1] and seen[1].layout.num_queries == 4
    src, dst = seen[2].copies[0]
    assert src.size == dst.size == 1 and src[0] != dst[0]


def test_one_host_plan_uploads_to_several_attentions():
    layout = random_forest(np.random.default_rng(2), 6, 20, max_tokens=120)
    q, k, v = random_qkv(layout, 4, 2, 16, torch.float32, seed=2)
    a, b = TreeAttention(4, 2, 16, backend="torch"), TreeAttention(4, 2, 16, backend="torch")
    host = a.plan_host(layout)
    a.plan(host)
    b.plan(host)
    want = TreeAttention(4, 2, 16, backend="torch")
    want.plan(layout)
    torch.testing.assert_close(a.run(q, k, v), want.run(q, k, v), atol=0, rtol=0)
    torch.testing.assert_close(b.run(q, k, v), want.run(q, k, v), atol=0, rtol=0)
    with pytest.raises(ValueError, match="layout: a host plan of .* expected one of this attention's"):
        TreeAttention(4, 2, 16, backend="reference").plan(host)


def test_one_host_plan_uploads_to_several_triton_attentions():
    pytest.importorskip("triton")
    layout = random_forest(np.random.default_rng(4), 5, 12, max_tokens=60)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = random_qkv(layout, 2, 1, 16, torch.float32, seed=4, device=dev)
    attns = [TreeAttention(2, 1, 16, backend="triton", device=dev) for _ in range(2)]
    host = attns[0].plan_host(layout)
    ref, _ = reference_attention(q, k, v, layout, 16**-0.5)
    for attn in attns:
        attn.plan(host)
        torch.testing.assert_close(attn.run(q, k, v), ref.float(), atol=1e-4, rtol=1e-4)


def test_a_kv_format_the_backend_cannot_read_is_refused_when_the_engine_is_built(scaled_kv):
    model, tok = tiny_llama(), Letters(VOCAB)
    with pytest.raises(TypeError, match="kv: backend 'reference' reads K/V in the queries' "
                                        "dtype torch.float32 only, got torch.float16"):
        TreeEngine(model, tok, num_pages=4, backend="reference", kv=KVSpec(torch.float16))
    with pytest.raises(ValueError, match="kv: the reference backend reads no K/V scales"):
        TreeEngine(model, tok, num_pages=4, backend="reference",
                   kv=KVSpec(torch.float32, "per_layer"))
    with pytest.raises(TypeError, match="kv_dtype: expected one of float32, float16 for backend"):
        TreeEngine(model, tok, num_pages=4, backend="scaled-kv", kv=KVSpec(torch.float64))
    engine = TreeEngine(model, tok, 6, 2, backend="scaled-kv", kv=KVSpec(torch.float16, "per_layer"))
    assert (engine.config.num_pages, engine.config.page_size) == (6, 2)  # positional, as before


def test_a_dropped_engine_frees_its_pool_without_the_cycle_collector():
    import gc
    import weakref

    gc.disable()
    try:
        engine = TreeEngine(tiny_llama(), Letters(VOCAB), num_pages=4, page_size=4, backend="torch")
        root = engine.add_prompt([1, 2, 3])
        engine.extend([(engine.cache.fork(root, 1)[0], [4])])
        pool = weakref.ref(engine.pool.k[0])
        del engine
        assert pool() is None
    finally:
        gc.enable()


def test_engine_config_checks_every_field_in_one_place():
    c = EngineConfig.of(num_pages=8, graph_buckets=[4, 1, 4])
    assert c.num_pages == 8 and c.graph_buckets == (1, 4) and c.cuda_graphs is None
    assert EngineConfig.of(c, page_size=2).num_pages == 8
    with pytest.raises(TypeError, match="num_page: not an engine option"):
        EngineConfig.of(num_page=8)
    with pytest.raises(ValueError, match="plan_kind: expected one of"):
        EngineConfig(plan_kind="dense")
    with pytest.raises(ValueError, match="backend: expected one of auto, "):
        EngineConfig(backend="cudnn")
    with pytest.raises(TypeError, match="kv: expected a deft.KVSpec, a K/V dtype name or None, "
                                        "got dtype"):
        EngineConfig(kv=torch.float16)
    with pytest.raises(ValueError, match="kv: expected one of auto, fp8_e4m3, got 'fp8'"):
        EngineConfig(kv="fp8")
    assert EngineConfig(kv="auto").kv is None
    assert EngineConfig(kv="fp8_e4m3").kv == KVSpec(torch.float8_e4m3fn, "per_head")
    with pytest.raises(ValueError, match="prefill_chunk"):
        TreeEngine(tiny_llama(), Letters(VOCAB), prefill_chunk=0)
    with pytest.raises(TypeError, match="config: expected a deft EngineConfig, got dict"):
        TreeEngine(tiny_llama(), Letters(VOCAB), {"num_pages": 4})
