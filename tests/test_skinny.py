"""The few-row matmul kernel (:mod:`deft.model.skinny`) against float64 products: its kernel
interpreted on CPU (fp32, fp16), the dispatching functions compiled on a GPU (also bf16)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from deft.model import skinny  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# A float32 accumulation over K = 128..1024 terms, rounded once to the dtype.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), w.double())


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# float32 only interpreted: compiled, tl.dot multiplies float32 in TF32 (the model never
# takes the kernel in float32).
KERNEL_DTYPES = [torch.float32, torch.float16] if DEV == "cpu" else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5, 17])
@pytest.mark.parametrize("outputs", [32, 40])  # whole blocks, and the last block ragged
def test_kernel_on_ragged_shapes(dtype, rows, outputs):
    torch.manual_seed(rows)
    x = torch.randn(rows, 128, device=DEV).to(dtype)
    w = (torch.randn(outputs, 128, device=DEV) / 8).to(dtype)
    cfg = (16, 64, 2, 4)
    y = skinny._launch(x, w, dtype, cfg)
    assert y.shape == (rows, outputs) and y.dtype == dtype
    close(y, want(x, w), dtype)
    logits = skinny._launch(x, w, torch.float32, cfg)
    assert logits.dtype == torch.float32
    if dtype != torch.float32:
        assert torch.equal(logits, logits.to(dtype).float())  # rounded to the dtype, then widened
    close(logits, want(x, w), dtype)


def want_gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = want(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5, 17])
@pytest.mark.parametrize("outputs", [32, 40])
def test_gated_kernel_on_ragged_shapes(dtype, rows, outputs):
    """SiLU of the first half's product times the second's, each half ``outputs`` wide."""
    torch.manual_seed(rows + outputs)
    x = torch.randn(rows, 128, device=DEV).to(dtype)
    w = (torch.randn(2 * outputs, 128, device=DEV) / 8).to(dtype)
    y = skinny._launch(x, w, dtype, (16, 64, 2, 4), skinny._gated_kernel)
    assert y.shape == (rows, outputs) and y.dtype == dtype
    # three roundings (gate, up, SiLU) of values up to ~10 before the product's own
    tol = 8 * TOL[dtype]
    torch.testing.assert_close(y.double(), want_gated(x, w), atol=tol, rtol=tol)


def test_the_wide_kernels_take_the_rows_they_were_measured_at(monkeypatch):
    """qkv takes the kernel up to ``_WIDE_ROWS`` rows and only for a weight wider than its
    input (a tensor-parallel shard may be narrower), gate/up with SiLU·mul from
    ``_GATED_ROWS`` to ``_GATED_MAX`` with halves of at least ``_GATED_HALF``; o and down keep
    the narrow rule (a wide shard of them: cuBLAS), in other blocks beyond 32 rows."""
    taken = []
    monkeypatch.setattr(skinny, "_takes_kernel", lambda *a: True)
    monkeypatch.setattr(skinny, "_launch", lambda x, w, dt, cfg, *kernel: taken.append(
        (x.shape[0], cfg, bool(kernel))) or torch.empty(0))
    monkeypatch.setattr(skinny, "silu_mul", lambda gate_up: gate_up)  # CPU tensors on a GPU host
    wide, narrow = torch.zeros(96, 64), torch.zeros(48, 64)
    for rows in (skinny._WIDE_ROWS, skinny._WIDE_ROWS + 1):
        x = torch.zeros(rows, 64)
        skinny.qkv(x, wide)
        skinny.qkv(x, narrow)
        skinny.qkv(x, wide, torch.zeros(96))
        skinny.linear(x, wide)
        skinny.linear(x, narrow)
    assert taken == [(16, skinny._WIDE, False), (16, skinny._NARROW, False),
                     (17, skinny._NARROW, False)]
    taken.clear()
    monkeypatch.setattr(skinny, "_GATED_HALF", 48)
    for rows in (skinny._GATED_ROWS - 1, skinny._GATED_ROWS, skinny._GATED_MAX,
                 skinny._GATED_MAX + 1):
        skinny.gated(torch.zeros(rows, 64), wide)
        skinny.gated(torch.zeros(rows, 64), torch.zeros(94, 64))  # halves of 47: cuBLAS
    assert taken == [(17, skinny._GATED, True), (32, skinny._GATED, True)]
    taken.clear()
    for rows in (32, 33, skinny.MAX_ROWS):  # o and down in 64-row blocks take a lighter ring
        skinny.linear(torch.zeros(rows, 64), narrow)
    assert taken == [(32, skinny._NARROW, False), (33, skinny._NARROW_TALL, False),
                     (64, skinny._NARROW_TALL, False)]


def test_off_gpu_and_beyond_the_rows_cublas_computes_it():
    from deft.model.fused import silu_mul

    x = torch.randn(skinny.MAX_ROWS + 1, 256, device=DEV).to(torch.float16)
    w = torch.randn(256, 256, device=DEV).to(torch.float16)
    assert torch.equal(skinny.linear(x, w), F.linear(x, w))
    if DEV == "cpu":
        few = x[:2]
        assert torch.equal(skinny.linear(few, w), F.linear(few, w))
        assert torch.equal(skinny.head_proj(few, w), F.linear(few, w).float())
        assert torch.equal(skinny.gated(few, w), silu_mul(F.linear(few, w)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 7, 20, 32, 50, 64])
def test_projections_on_the_gpu(rows, monkeypatch):
    """The kernels' projections as a graph capture launches them (outside one, cuBLAS's), at
    every row count (the model takes the wide ones at some)."""
    from deft.model.fused import silu_mul

    monkeypatch.setattr(skinny, "_WIDE_ROWS", skinny.MAX_ROWS)
    monkeypatch.setattr(skinny, "_GATED_ROWS", 1)
    monkeypatch.setattr(skinny, "_GATED_HALF", 1)
    monkeypatch.setattr(skinny, "_GATED_MAX", skinny.MAX_ROWS)
    kernels = []
    launch = skinny._launch
    monkeypatch.setattr(skinny, "_launch",
                        lambda *a: kernels.append("gated" if len(a) > 4 else "plain") or launch(*a))

    torch.manual_seed(rows)
    dt = torch.bfloat16
    x = torch.randn(rows, 512, device="cuda", dtype=dt)
    w_o = (torch.randn(512, 512, device="cuda") / 16).to(dt)
    assert torch.equal(skinny.linear(x, w_o), F.linear(x, w_o))  # launched eagerly
    linear = functools.partial(skinny.linear, captured=True)
    head_proj = functools.partial(skinny.head_proj, captured=True)
    close(linear(x, w_o), want(x, w_o), dt)
    qkv = functools.partial(skinny.qkv, captured=True)
    w_qkv = (torch.randn(768, 512, device="cuda") / 16).to(dt)  # wider than its input
    close(qkv(x, w_qkv), want(x, w_qkv), dt)
    bias = torch.ones(768, device="cuda", dtype=dt)
    assert torch.equal(qkv(x, w_qkv, bias), F.linear(x, w_qkv, bias))  # a bias: cuBLAS
    w_gate_up = (torch.randn(2 * 608, 512, device="cuda") / 16).to(dt)  # the last block ragged
    act = skinny.gated(x, w_gate_up, captured=True)
    torch.testing.assert_close(act.double(), want_gated(x, w_gate_up), atol=0.05, rtol=0.05)
    assert torch.equal(skinny.gated(x, w_gate_up), silu_mul(F.linear(x, w_gate_up)))  # eager
    act = skinny.gated(x, (torch.randn(2 * 512, 512, device="cuda") / 16).to(dt), captured=True)
    w_down = (torch.randn(256, 512, device="cuda") / 16).to(dt)
    close(linear(act, w_down), want(act, w_down), dt)
    assert kernels == ["plain", "plain", "gated", "gated", "plain"]  # o, qkv, gate/up twice, down
    head = (torch.randn(1000, 512, device="cuda") / 16).to(dt)  # 1,000 rows: the last block ragged
    logits = head_proj(x, head)
    assert len(kernels) == 6
    assert logits.dtype == torch.float32
    close(logits, want(x, head), dt)
    with pytest.raises(RuntimeError):  # a wrong inner size is cuBLAS's error, not a product
        linear(x[:, :256], w_o)
    x33 = torch.randn(skinny.MAX_ROWS + 1, 512, device="cuda", dtype=dt)
    assert torch.equal(linear(x33, w_o), F.linear(x33, w_o))


def _tree_step(layers: int, seed: int):
    """A small random Llama on the GPU (float32) and ``step(model, captured, pool)``: its
    logits for a 6-token prompt with two one-token branches (``pool``: a fresh one if None)."""
    from deft import TreeKVCache
    from deft.model import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                         num_layers=layers, num_heads=4, num_kv_heads=2,
                         max_position_embeddings=64)
    model = LlamaModel(config).eval().requires_grad_(False).to("cuda")
    cache = TreeKVCache(4, 4)
    root = cache.add_root(0)
    slots = list(cache.append(root, 6))
    kids = cache.fork(root, 2)
    slots += [int(cache.append(k, 1)[0]) for k in kids]
    layout = cache.layout([(root, j + 1) for j in range(6)] + kids)
    t = lambda a: torch.tensor(a, dtype=torch.int64, device="cuda")  # noqa: E731
    args = t([1, 5, 9, 3, 2, 8, 4, 6]), t([0, 1, 2, 3, 4, 5, 6, 6]), t(slots)

    def step(m: torch.nn.Module, captured: bool = False, pool=None) -> torch.Tensor:
        attn = m.attention(backend="torch")
        attn.plan(layout)
        return m(*args, attn, m.new_pool(4, 4) if pool is None else pool, t([5, 6, 7]),
                 captured=captured)

    return model, step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_step_through_the_kernel_is_as_close_to_float64_as_through_cublas(monkeypatch):
    """A bf16 step whose projections and LM head take the kernels, against the float64
    model: no further from it than the same step with cuBLAS for every projection."""
    model, step = _tree_step(layers=2, seed=5)
    model.to(torch.float64)
    ref = step(model).double()
    model.to(torch.bfloat16)
    monkeypatch.setattr(skinny, "_GATED_ROWS", 1)  # the step's 8 rows take every kernel
    monkeypatch.setattr(skinny, "_GATED_HALF", 1)
    calls = []
    launch = skinny._launch
    monkeypatch.setattr(skinny, "_launch", lambda *a: calls.append(a[2]) or launch(*a))
    step(model)
    assert not calls  # launched eagerly, every projection is cuBLAS's
    err = (step(model, captured=True).double() - ref).abs().max().item()
    assert len(calls) == 2 * 4 + 1  # qkv, o, gate/up with SiLU·mul and down per layer, the head
    monkeypatch.setattr(skinny, "MAX_ROWS", 0)
    err_blas = (step(model, captured=True).double() - ref).abs().max().item()
    assert len(calls) == 9
    assert err <= 1.5 * err_blas + 1e-3, (err, err_blas)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90+")
def test_a_step_chained_by_pdl_equals_the_unchained_one(monkeypatch):
    """The launch chain (``fused.chained``) moves when a launch starts, never a value: a bf16
    step through the fused kernels and the few-row matmuls gives the same logits, bit for bit,
    with the chain on and off, over repeated steps (a launch that read its input
    before the previous one ended would differ)."""
    from deft.model import fused

    model, step = _tree_step(layers=3, seed=6)
    model.to(torch.bfloat16)
    monkeypatch.setattr(skinny, "_GATED_ROWS", 1)  # the step's 8 rows take every kernel
    monkeypatch.setattr(skinny, "_GATED_HALF", 1)

    def steps(chain: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(fused, "_chain", chain)
        assert fused.chained(torch.device("cuda")) == chain
        pool = model.new_pool(4, 4)
        return [step(model, captured=True, pool=pool) for _ in range(5)]

    off, on = steps(False), steps(True)
    assert all(torch.equal(a, off[0]) for a in off)
    assert all(torch.equal(b, off[0]) for b in on)
