"""TreeAttention (torch backend) against the float64 dense reference."""

import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import to_paged, assert_close, assert_lse_close, random_forest, random_qkv
from deft import PLAN_KINDS, TreeAttention, TreeLayout, tree_attention
from deft.ops.reference import reference_attention
from benchmarks.trees import few_shot_layout, shuffle_slots

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=["dense", "tiled"])
def torch_path(request, monkeypatch):
    """Run a test through the torch backend's one-tile path and through its tiled path."""
    from deft.ops.torch_backend import TorchBackend

    monkeypatch.setattr(TorchBackend, "dense_limit", 1 << 30 if request.param == "dense" else 0)
    return request.param


def run_and_compare(layout, h_q, h_kv, d, dtype, kind="flatten", block=None, seed=0, paged=0):
    q, k, v = random_qkv(layout, h_q, h_kv, d, dtype, seed)
    scale = 1.0 / d**0.5
    ref_o, ref_lse = reference_attention(q, k, v, layout, scale)
    attn = TreeAttention(h_q, h_kv, d, backend="torch", plan_kind=kind, block_kv=block)
    attn.plan(layout)
    if paged:
        k, v = to_paged(k, paged), to_paged(v, paged)
    o, lse = attn.run(q, k, v, return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert_close(o, ref_o, dtype, f"{kind} o")
    assert_lse_close(lse, ref_lse, f"{kind}")
    return o, lse


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 300), max_len=st.integers(0, 600),
       roots=st.integers(1, 3), gqa=st.sampled_from([1, 4, 8]), d=st.sampled_from([64, 128, 256]),
       dtype=st.sampled_from(DTYPES), kind=st.sampled_from(PLAN_KINDS),
       block=st.sampled_from([None, 1, 7, 64]))
def test_random_forests(seed, nodes, max_len, roots, gqa, d, dtype, kind, block, torch_path):
    rng = np.random.default_rng(seed)
    layout = random_forest(rng, nodes, max_len, max_tokens=1200, num_roots=roots)
    h_kv = 1 if gqa == 8 else 2
    run_and_compare(layout, h_kv * gqa, h_kv, d, dtype, kind, block, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_dtype_and_head_dim(dtype, d, torch_path):
    layout = shuffle_slots(few_shot_layout(150, 5, 23), seed=1, num_slots=400)
    run_and_compare(layout, 8, 2, d, dtype)


@pytest.mark.parametrize(
    "name, layout",
    [
        ("deep chain", TreeLayout.from_node_lengths(np.arange(-1, 299), np.full(300, 2), [299, 150, 0])),
        ("256-leaf fan", few_shot_layout(700, 256, 1)),
        ("single query", TreeLayout([-1], [0, 97], np.arange(97), [0], [54])),
        ("nodes without queries", TreeLayout.from_node_lengths([-1, 0, 0, 1], [40, 9, 30, 3], [3])),
        ("empty nodes", TreeLayout.from_node_lengths([-1, 0, 1, 0], [0, 0, 5, 0], [1, 2, 3])),
        ("query seeing nothing", TreeLayout.from_node_lengths([-1, -1], [0, 4], [0, 1], [0, 0])),
        ("chunked prefill", TreeLayout.from_node_lengths([-1], [33], [0] * 33, np.arange(1, 34))),
    ],
)
@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_special_trees(name, layout, kind, torch_path):
    o, lse = run_and_compare(layout, 4, 1, 64, torch.float32, kind, block=16)
    if name == "query seeing nothing":
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse))


def test_plan_kinds_agree():
    rng = np.random.default_rng(7)
    layout = random_forest(rng, 120, 80)
    q, k, v = random_qkv(layout, 8, 2, 64, torch.float32)
    outs = [tree_attention(q, k, v, layout, backend="torch", plan_kind=kind) for kind in PLAN_KINDS]
    for kind, o in zip(PLAN_KINDS[1:], outs[1:]):
        torch.testing.assert_close(o, outs[0], atol=2e-6, rtol=2e-6, msg=lambda m: f"{kind}: {m}")


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_cache(page_size):
    layout = shuffle_slots(few_shot_layout(100, 3, 17), seed=3, num_slots=300)
    run_and_compare(layout, 4, 2, 64, torch.float16, paged=page_size)


def test_plan_is_reused_across_layers():
    layout = few_shot_layout(90, 4, 10)
    attn = TreeAttention(4, 1, 64, backend="torch")
    attn.plan(layout)
    for layer in range(3):
        q, k, v = random_qkv(layout, 4, 1, 64, torch.float32, seed=layer)
        ref, _ = reference_attention(q, k, v, layout, attn.sm_scale)
        assert_close(attn.run(q, k, v), ref, torch.float32, f"layer {layer}")


@pytest.mark.parametrize("paged", [False, True])
def test_repeated_runs_still_see_what_changed(paged, monkeypatch):
    """A run with the tensors of an earlier run skips their checks: what may have changed
    since (q, the plan, the caches' storage, shape, strides and dtype, out) is still checked
    and read, and the attention keeps no cache alive."""
    import gc

    layout = shuffle_slots(few_shot_layout(30, 2, 5), seed=1, num_slots=64)
    q, k, v = random_qkv(layout, 4, 2, 16, torch.float32, seed=0)
    k = torch.cat([k, torch.zeros(64 - k.shape[0], 2, 16)])
    v = torch.cat([v, torch.zeros(64 - v.shape[0], 2, 16)])
    wrap = (lambda t: to_paged(t, 8)) if paged else (lambda t: t.clone())
    kc, vc = wrap(k), wrap(v)
    attn = TreeAttention(4, 2, 16, backend="torch")
    full = []
    check = attn._check_inputs
    monkeypatch.setattr(attn, "_check_inputs", lambda *a: full.append(1) or check(*a))
    attn.plan(layout)
    ref, _ = reference_attention(q, k, v, layout, attn.sm_scale)
    out = torch.empty_like(q)
    for _ in range(3):
        assert_close(attn.run(q, kc, vc, out=out), ref, torch.float32, "repeated run")
    assert len(full) == 1  # the later runs took the short path
    with pytest.raises(TypeError, match="q: expected dtype"):
        attn.run(q.to(torch.int32), kc, vc)
    with pytest.raises(TypeError, match="v_cache: expected dtype"):
        attn.run(q, kc, vc.double())
    with pytest.raises(ValueError, match="q: expected shape"):
        attn.run(q[:1], kc, vc)
    with pytest.raises(ValueError, match="out: expected a contiguous tensor"):
        attn.run(q, kc, vc, out=out.as_strided_(out.shape, (64, 1, 4)))
    with pytest.raises(ValueError, match="out: expected a torch.float32 tensor of shape"):
        attn.run(q, kc, vc, out=out.resize_(1, 4, 16))
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    kc.set_(wrap(k2))  # new storage, same shape
    vc.set_(wrap(v2))
    ref2, _ = reference_attention(q, k2, v2, layout, attn.sm_scale)
    assert_close(attn.run(q, kc, vc), ref2, torch.float32, "after set_")
    if paged:  # [8, 8, 2, 16]: the same shape and address, other strides
        kc.transpose_(0, 1)
        ref3, _ = reference_attention(q, kc.reshape(64, 2, 16), v2, layout, attn.sm_scale)
        assert_close(attn.run(q, kc, vc), ref3, torch.float32, "after transpose_")
    kc.data = kc.data.view(torch.int32)  # the same tensor, shape and address, another dtype
    with pytest.raises(TypeError, match="k_cache: expected dtype"):
        attn.run(q, kc, vc)
    wide = TreeLayout(layout.parents, layout.node_kv_indptr, layout.kv_indices + 64,
                      layout.query_nodes, layout.query_kv_lens)
    attn.plan(wide)
    kc.data = kc.data.view(torch.float32)
    with pytest.raises(ValueError, match="the cache holds 64 slots"):
        attn.run(q, kc, vc)
    refs = weakref.ref(kc), weakref.ref(vc)
    del kc, vc
    gc.collect()
    assert refs[0]() is None and refs[1]() is None and not attn._checked  # entries went along


def test_reference_backend_through_registry():
    layout = few_shot_layout(30, 2, 5)
    q, k, v = random_qkv(layout, 2, 1, 64, torch.float32)
    o = tree_attention(q, k, v, layout, backend="reference")
    ref, _ = reference_attention(q, k, v, layout, 1 / 8)
    torch.testing.assert_close(o, ref.float())


def test_custom_sm_scale():
    layout = few_shot_layout(30, 2, 5)
    q, k, v = random_qkv(layout, 2, 1, 64, torch.float32)
    o = tree_attention(q, k, v, layout, sm_scale=0.3, backend="torch")
    ref, _ = reference_attention(q, k, v, layout, 0.3)
    assert_close(o, ref, torch.float32, "sm_scale=0.3")


class TestErrors:
    layout = few_shot_layout(10, 2, 3)

    def attn(self, **kw):
        a = TreeAttention(4, 2, 64, backend="torch", **kw)
        a.plan(self.layout)
        return a

    def inputs(self, dtype=torch.float16):
        return random_qkv(self.layout, 4, 2, 64, dtype)

    def test_constructor(self):
        with pytest.raises(ValueError, match="num_qo_heads: expected a multiple of num_kv_heads=3, got 4"):
            TreeAttention(4, 3, 64)
        with pytest.raises(ValueError, match="head_dim: expected a positive integer, got 0"):
            TreeAttention(4, 2, 0)
        with pytest.raises(ValueError, match="backend: expected one of auto, torch, reference"):
            TreeAttention(4, 2, 64, backend="cuda-magic")
        with pytest.raises(ValueError, match="plan_kind: expected one of flatten"):
            TreeAttention(4, 2, 64, plan_kind="radix")
        with pytest.raises(ValueError, match="sm_scale: expected a positive finite number"):
            TreeAttention(4, 2, 64, sm_scale=float("nan"))

    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
    def test_cuda_device_without_cuda(self):
        for backend in ("auto", "torch", "triton"):
            with pytest.raises(ValueError, match="device: cuda requested but no CUDA device is available"):
                TreeAttention(4, 2, 64, backend=backend, device="cuda")

    def test_numpy_scalars(self):
        a = TreeAttention(np.int64(4), np.int32(2), np.int64(64), sm_scale=np.float32(0.125), backend="torch")
        assert (a.num_qo_heads, a.num_kv_heads, a.head_dim, a.sm_scale) == (4, 2, 64, 0.125)
        assert all(type(x) is int for x in (a.num_qo_heads, a.num_kv_heads, a.head_dim))
        assert type(a.sm_scale) is float

    def test_run_before_plan(self):
        q, k, v = self.inputs()
        with pytest.raises(RuntimeError, match="plan"):
            TreeAttention(4, 2, 64, backend="torch").run(q, k, v)

    def test_shapes(self):
        a = self.attn()
        q, k, v = self.inputs()
        with pytest.raises(ValueError, match=r"q: expected shape \(2, 4, 64\) \[num_queries, H_q, D\], got \(1, 4, 64\)"):
            a.run(q[:1], k, v)
        with pytest.raises(ValueError, match=r"k_cache: expected shape \[num_slots, 2, 64\]"):
            a.run(q, k[:, :1], v)
        with pytest.raises(ValueError, match=r"v_cache: expected shape \(16, 2, 64\) like k_cache"):
            a.run(q, k, v[:5])
        with pytest.raises(ValueError, match="the layout uses slot 15 but the cache holds 10 slots"):
            a.run(q, k[:10], v[:10])

    def test_dtypes(self):
        a = self.attn()
        q, k, v = self.inputs()
        with pytest.raises(TypeError, match="k_cache: expected dtype torch.float16 like q, got torch.float32"):
            a.run(q, k.float(), v)
        with pytest.raises(TypeError, match="q: expected dtype"):
            a.run(q.int(), k, v)
        with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
            a.run(q.numpy(), k, v)

    def test_device(self):
        a = TreeAttention(4, 2, 64, backend="torch", device="meta")
        a.plan(self.layout)
        q, k, v = self.inputs()
        with pytest.raises(ValueError, match="q: expected device meta"):
            a.run(q, k, v)

    def test_plan_type(self):
        with pytest.raises(TypeError, match="layout: expected a deft.TreeLayout, got dict"):
            TreeAttention(4, 2, 64).plan({})


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_run_writes_into_out(backend, return_lse):
    """``out``/``lse_out`` receive the result and are what ``run`` returns, for every backend."""
    if backend == "triton":
        pytest.importorskip("triton")
    layout = shuffle_slots(few_shot_layout(40, 3, 6), seed=3, num_slots=80)
    dtype = torch.float16 if backend == "triton" else torch.float32
    # The triton backend runs on the GPU if there is one, else interpreted on the CPU.
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q, k, v = random_qkv(layout, 4, 2, 32, dtype, 1, device=dev)
    ref_o, ref_lse = reference_attention(q, k, v, layout, 32**-0.5)
    attn = TreeAttention(4, 2, 32, backend=backend, device=dev,
                         block_kv=8 if backend == "triton" and dev == "cpu" else None)
    attn.plan(layout)
    out = torch.full_like(q, float("nan"))
    lse_out = torch.full(q.shape[:2], float("nan"), device=dev) if return_lse else None
    got = attn.run(q, k, v, return_lse=return_lse, out=out, lse_out=lse_out)
    o, lse = got if return_lse else (got, None)
    assert o is out
    assert_close(out, ref_o, dtype, f"{backend} out")
    if return_lse:
        assert lse is lse_out
        assert_lse_close(lse_out, ref_lse, f"{backend} lse_out")


def test_out_errors():
    layout = few_shot_layout(10, 2, 3)
    q, k, v = random_qkv(layout, 4, 2, 16, torch.float32, 0)
    attn = TreeAttention(4, 2, 16)
    attn.plan(layout)
    with pytest.raises(ValueError, match=r"out: expected a torch.float32 tensor of shape \(2, 4, 16\)"):
        attn.run(q, k, v, out=torch.empty(2, 4, 8))
    with pytest.raises(ValueError, match="out: expected a torch.float32 tensor"):
        attn.run(q, k, v, out=torch.empty(2, 4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="out: expected a contiguous tensor"):
        attn.run(q, k, v, out=torch.empty(2, 16, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="lse_out: given but return_lse is False"):
        attn.run(q, k, v, lse_out=torch.empty(2, 4))
    with pytest.raises(ValueError, match=r"lse_out: expected a torch.float32 tensor of shape \(2, 4\)"):
        attn.run(q, k, v, return_lse=True, lse_out=torch.empty(2, 5))
    with pytest.raises(TypeError, match="out: expected a torch.Tensor"):
        attn.run(q, k, v, out=[0.0])
