"""Eager launches through the CUDA driver (``deft.ops.triton.native_launch``): the packing of
a compiled kernel's parameters and launch configuration against a stand-in driver (no GPU
needed), and on a GPU (``-m gpu``) outputs bit-identical to Triton's own launches on random
plans, with CUDA-graph capture still launching through Triton."""

import ctypes
import dataclasses
import inspect
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import assert_close, random_forest, random_qkv
from deft import Capacity, TreeAttention

pytest.importorskip("triton")
from deft.ops.triton import configs, launch, native_launch  # noqa: E402
from deft.ops.triton.native_launch import LaunchAttribute, LaunchConfig  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def test_structures_match_cuda_h():
    """Sizes and offsets of ``CUlaunchAttribute`` and ``CUlaunchConfig`` (CUDA 12.8 cuda.h,
    compiled for x86-64 and read with ``sizeof``/``offsetof``)."""
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.shared.offset, LaunchConfig.stream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


def fake_kernel(signature: dict, **meta) -> SimpleNamespace:
    """What ``native_launch`` reads of a Triton ``CompiledKernel``."""
    fields = dict(target=SimpleNamespace(backend="cuda", arch=90, warp_size=32), num_warps=4,
                  num_ctas=1, shared=4096, launch_pdl=True, launch_cooperative_grid=False,
                  tensordesc_meta=None, global_scratch_size=0, profile_scratch_size=0)
    fields.update(meta)
    return SimpleNamespace(metadata=SimpleNamespace(**fields), function=0x5EED,
                           src=SimpleNamespace(fn=SimpleNamespace(arg_names=list(signature)),
                                               signature=signature))


class Driver:
    """Stands in for ``cuLaunchKernelEx``: records each launch's configuration and the 8
    bytes at each of ``params`` parameter addresses; returns ``result``."""

    def __init__(self, params: int, result: int = 0) -> None:
        self.params, self.result, self.calls = params, result, []

    def __call__(self, config: int, function: int, params: int, extra) -> int:
        cfg = LaunchConfig.from_address(config)
        addresses = (ctypes.c_void_p * self.params).from_address(params)
        self.calls.append(dict(
            grid=tuple(cfg.grid), block=tuple(cfg.block), shared=cfg.shared, stream=cfg.stream,
            attrs=[(cfg.attrs[i].id, cfg.attrs[i].value[0]) for i in range(cfg.num_attrs)],
            function=function, extra=extra,
            values=[ctypes.c_uint64.from_address(a).value for a in addresses]))
        return self.result


SIGNATURE = {"X": "*bf16", "Y": "*fp32", "n": "i32", "one": "constexpr", "big": "i64",
             "scale": "fp32", "flag": "u1", "B": "constexpr"}


def packed(x: torch.Tensor, driver: Driver, inputs=None, bound=None, **meta):
    args = [x, launch.Pointer(4096, torch.float32), -3, 1, 2**40 + 5, 0.1, True]
    return native_launch.native_launch(fake_kernel(SIGNATURE, **meta), (7, 2), args,
                                       inputs, bound, launch=driver)


def test_parameters_packed_as_triton_packs_them():
    """Non-constexpr arguments in order (pointers as addresses, integers in their width,
    floats as float32 bits), then the two scratch pointers; the launch configuration from
    the kernel's metadata; arguments bound to ``inputs`` read them at each launch."""
    x = torch.zeros(4, dtype=torch.bfloat16)
    driver = Driver(8)
    inputs = (ctypes.c_uint64 * 2)()
    launch_ = packed(x, driver, inputs, {1: 1})
    assert launch_ is not None
    inputs[1] = 0xDEAD0
    assert launch_(1234)
    inputs[1] = 0xBEEF0
    assert launch_(99)
    first, second = driver.calls
    f32 = struct.unpack("<I", struct.pack("<f", 0.1))[0]
    assert first["values"] == [x.data_ptr(), 0xDEAD0, 2**32 - 3, 2**40 + 5, f32, 1, 0, 0]
    assert second["values"][1] == 0xBEEF0 and second["stream"] == 99
    assert first["grid"] == (7, 2, 1) and first["block"] == (128, 1, 1)
    assert first["shared"] == 4096 and first["stream"] == 1234
    assert first["attrs"] == [(6, 1)]  # programmatic stream serialisation
    assert first["function"] == 0x5EED and first["extra"] is None
    driver = Driver(8)
    assert packed(x, driver, launch_pdl=False)(0) and driver.calls[0]["attrs"] == []


@pytest.mark.parametrize("change", [
    dict(num_ctas=2), dict(launch_cooperative_grid=True), dict(global_scratch_size=64),
    dict(profile_scratch_size=8), dict(tensordesc_meta=[{}]),
    dict(target=SimpleNamespace(backend="hip", arch=90, warp_size=64)),
], ids=lambda c: next(iter(c)))
def test_what_triton_launches_otherwise_is_not_packed(change):
    assert packed(torch.zeros(4), Driver(8), **change) is None


def test_unpackable_arguments_and_grids_are_refused():
    x = torch.zeros(4)
    kernel = fake_kernel(SIGNATURE)
    args = [x, x, 1, 1, 1, 0.5, False]
    assert native_launch.native_launch(kernel, (0,), args, launch=Driver(8)) is None
    assert native_launch.native_launch(kernel, (1, 1, 1, 1), args, launch=Driver(8)) is None
    # A parameter left to its default (not a constexpr) is not packed.
    assert native_launch.native_launch(kernel, (1,), args[:2], launch=Driver(8)) is None
    desc = fake_kernel({"X": "*fp32", "d": "tensordesc<fp32[16, 16]>"})
    assert native_launch.native_launch(desc, (1,), [x, None], launch=Driver(3)) is None
    half = fake_kernel({"X": "*fp32", "s": "fp16"})
    assert native_launch.native_launch(half, (1,), [x, 0.5], launch=Driver(3)) is None
    # Only pointer arguments can be bound to the inputs.
    assert packed(x, Driver(8), (ctypes.c_uint64 * 1)(), {2: 0}) is None
    assert packed(x, Driver(8), (ctypes.c_uint64 * 1)(), {0: 1}) is None


def test_launch_hooks_are_left_to_triton(monkeypatch):
    from triton import knobs

    hooks = knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hooks, "calls", [lambda metadata: None])
    assert packed(torch.zeros(4), Driver(8)) is None


def test_a_refused_launch_reports_it():
    assert not packed(torch.zeros(4), Driver(8, result=1))(0)


def test_step_records_bind_the_kernels_address_parameters(monkeypatch):
    """The positions ``launch_step`` rewrites per call are the kernels' q, K, V (and their
    descriptor slots), o and lse pointers; every later parameter is a constexpr keyword;
    the two launches of a step share its inputs."""
    from deft.ops.triton.kernels import tree_partial_kernel
    from deft.ops.triton.merge_kernels import merge_kernel

    names = tree_partial_kernel.arg_names
    assert [names[i] for i in launch._PARTIAL_INPUTS] == ["Q", "K", "V", "desc_k", "desc_v",
                                                          "O", "LSE"]
    assert [merge_kernel.arg_names[i] for i in launch._MERGE_INPUTS] == ["O", "LSE"]
    for kernel, positional in ((tree_partial_kernel, 34), (merge_kernel, 12)):
        params = inspect.signature(kernel.fn).parameters.values()
        constexpr = [p.name for p in params if "constexpr" in str(p.annotation)]
        assert kernel.arg_names[positional:] == constexpr
    driver = Driver(4)
    monkeypatch.setattr(native_launch, "driver_launch", lambda: driver)
    kernel = fake_kernel({"PO": "*fp32", "O": "*fp16", "LSE": "*fp32", "D": "constexpr"})
    x = torch.zeros(4)
    record = launch._native([(kernel, (3,), [x, x, x], {1: 3, 2: 4})] * 2)
    assert record(tuple(range(16, 96, 16)), 7) == 2
    assert [c["values"][:3] for c in driver.calls] == [[x.data_ptr(), 64, 80]] * 2
    driver.result = 1
    assert record((0,) * 5, 7) == 0
    assert launch._native([(kernel, (3,), [x, x, x], {}), (None, None, None, {})]) is None


def test_interpreted_plans_launch_through_triton():
    if CUDA:
        pytest.skip("interpreter only")
    attn = TreeAttention(4, 2, 16, backend="triton", device="cpu", block_kv=8)
    attn.plan(random_forest(np.random.default_rng(0), 5, 20))
    assert attn._prepared.native is None


class Counting:
    """Stands in for a Triton kernel: counts launches, then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def warmup(self, *args, **kw):
        return self.kernel.warmup(*args, **kw)


@pytest.fixture
def triton_launches(monkeypatch):
    """Counts the partial and merge kernels' launches through Triton."""
    counts = SimpleNamespace(partial=Counting(launch.tree_partial_kernel),
                             merge=Counting(launch.merge_kernel))
    monkeypatch.setattr(launch, "tree_partial_kernel", counts.partial)
    monkeypatch.setattr(launch, "merge_kernel", counts.merge)
    return lambda: counts.partial.launches + counts.merge.launches


def planned(variant: str, layout, h_q: int, h_kv: int, d: int, monkeypatch) -> TreeAttention:
    if variant == "fused-merge":
        for key, cfg in list(configs.CONFIGS.items()):
            monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, fuse_merge=True))
    capacity = (Capacity(queries=layout.num_queries, tokens=layout.num_tokens + 64)
                if variant == "graph-safe" else None)
    attn = TreeAttention(h_q, h_kv, d, backend="triton", device="cuda", capacity=capacity)
    attn.plan(layout)
    return attn


# (variant, dtype, (H_q, H_kv, D), seed): few, as each compiles its own kernels.
CASES = [("shipped", torch.bfloat16, (32, 8, 128), 0), ("shipped", torch.float16, (8, 2, 64), 1),
         ("fused-merge", torch.float32, (4, 4, 64), 2), ("graph-safe", torch.bfloat16, (32, 8, 128), 3)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant,dtype,heads,seed", CASES)
def test_gpu_driver_launches_are_bitwise_triton_launches(triton_launches, monkeypatch, variant,
                                                         dtype, heads, seed):
    """Three layers, each run with and without lse: Triton's launches (the plan's driver
    records off), then the driver's (after one recording call of each kind) give the same
    bits; a misaligned output falls back to Triton, exactly."""
    rng = np.random.default_rng(seed)
    h_q, h_kv, d = heads
    layout = random_forest(rng, int(rng.integers(10, 50)), 300, num_roots=1 + seed,
                           shuffle=seed != 1)
    attn = planned(variant, layout, h_q, h_kv, d, monkeypatch)
    prepared = attn._prepared
    assert prepared.native == {}
    layers = [random_qkv(layout, h_q, h_kv, d, dtype, seed=10 * seed + i, device="cuda")
              for i in range(3)]

    def step(out=None):
        return [(attn.run(q, k, v, out=out), *attn.run(q, k, v, return_lse=True))
                for q, k, v in layers]

    prepared.__dict__["native"] = None
    expected = step()
    prepared.__dict__["native"] = {}
    step()  # the first layer of each kind records, the other two launch through the driver
    assert len(prepared.native) == 2 and all(prepared.native.values())
    before = triton_launches()
    got = step()
    assert triton_launches() == before, "a recorded call launched through Triton"
    for i, (want, have) in enumerate(zip(expected, got)):
        for j, (a, b) in enumerate(zip(want, have)):
            assert torch.equal(a, b), f"{variant} {dtype} layer {i}, output {j} differs"
    if seed:
        return
    # An output 2 bytes off 16-byte alignment specialises differently: Triton launches it.
    q, k, v = layers[0]
    buf = torch.empty(q.numel() + 8, dtype=dtype, device="cuda")
    odd = buf[1:1 + q.numel()].view(q.shape)
    attn.run(q, k, v, out=odd)
    assert triton_launches() > before
    assert torch.equal(odd, expected[0][0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["shipped", "graph-safe"])
def test_gpu_capture_launches_through_triton_and_replays(triton_launches, monkeypatch, variant):
    """With driver records in place, a CUDA-graph capture still launches through Triton; its
    replay matches the eager layers, and eager layers after the capture still launch
    through the driver, bitwise as before."""
    from deft.ops.reference import reference_attention

    rng = np.random.default_rng(5)
    layout = random_forest(rng, 30, 200, shuffle=False)  # consecutive slots: TMA tiles
    dtype = torch.bfloat16
    attn = planned(variant, layout, 32, 8, 128, monkeypatch)
    layers = [random_qkv(layout, 32, 8, 128, dtype, seed=i, device="cuda") for i in range(2)]
    outs = [torch.empty_like(q) for q, _, _ in layers]
    lses = [torch.empty(q.shape[:2], device="cuda") for q, _, _ in layers]

    def step():
        for (q, k, v), o, lse in zip(layers, outs, lses):
            attn.run(q, k, v, return_lse=True, out=o, lse_out=lse)

    step()
    step()
    eager = [t.clone() for t in outs + lses]
    assert any(attn._prepared.native.values())
    before = triton_launches()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    per_layer = 1 if attn._prepared.counts is not None else 2  # fused merge: one launch
    assert triton_launches() - before == 2 * per_layer, "the capture did not launch through Triton"
    for t in outs + lses:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for i, (q, k, v) in enumerate(layers):
        ref_o, _ = reference_attention(q, k, v, layout, 128**-0.5)
        assert_close(outs[i].cpu(), ref_o.cpu(), dtype, f"{variant} replay, layer {i}")
        assert_close(outs[i].cpu(), eager[i].cpu(), dtype, f"{variant} replay vs eager, layer {i}")
    before = triton_launches()
    step()
    assert triton_launches() == before
    for a, b in zip(outs + lses, eager):
        assert torch.equal(a, b), f"{variant}: eager after the capture differs"


@pytest.mark.gpu
@gpu
def test_gpu_plans_that_launch_alike_share_their_records(triton_launches):
    """Graph-safe plans of one reservation pass the kernels the same arguments whatever the
    tree, so each plan keeps the last one's driver records: no Triton launch after the
    first, and outputs bitwise those of Triton's launches."""
    from deft.ops.reference import reference_attention
    from test_graph_safe import random_tree

    rng = np.random.default_rng(3)
    nq, cache, dtype = 12, 2000, torch.bfloat16
    attn = TreeAttention(32, 8, 128, backend="triton", device="cuda",
                         capacity=Capacity(queries=nq, tokens=cache))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(nq, 32, 128, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(cache, 8, 128, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    attn.plan(random_tree(rng, nq, cache))
    attn.run(q, k, v)
    records = attn._prepared.native
    assert records and all(records.values())
    for t in range(5):
        layout = random_tree(rng, nq, cache)
        attn.plan(layout)
        assert attn._prepared.native is records, f"plan {t} dropped the records"
        before = triton_launches()
        o = attn.run(q, k, v)
        assert triton_launches() == before, f"plan {t} launched through Triton"
        attn._prepared.__dict__["native"] = None
        assert torch.equal(o, attn.run(q, k, v)), f"plan {t}: driver and Triton launches differ"
        attn._prepared.__dict__["native"] = records
        ref_o, _ = reference_attention(q, k, v, layout, 128**-0.5)
        assert_close(o.cpu(), ref_o.cpu(), dtype, f"plan {t}")


@pytest.mark.gpu
@gpu
def test_gpu_a_v_cache_strided_unlike_k_is_never_bound_by_a_record():
    """V with other strides than K's is copied for the kernels (which address V with K's
    strides); the copy's address must not become a record's, so every call stays exact."""
    rng = np.random.default_rng(7)
    layout = random_forest(rng, 20, 200, num_roots=1)
    attn = planned("shipped", layout, 8, 2, 64, None)
    q, k, v = random_qkv(layout, 8, 2, 64, torch.float16, seed=70, device="cuda")
    strided = v.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert strided.stride() != k.stride()
    expected = attn.run(q, k, v)
    for _ in range(3):
        assert torch.equal(attn.run(q, k, strided), expected)
    assert None in attn._prepared.native.values()  # that kind launches through Triton


def test_a_layers_launches_run_in_one_call_of_the_compiled_helper(monkeypatch):
    """With the driver a C function (here a ctypes callback standing in for
    ``cuLaunchKernelEx``), a step record launches through ``_driver_launch``: each call
    rebinds the five addresses and the stream, launches in order and stops at a refusal."""
    if native_launch._helper() is None:
        pytest.skip("the compiled helper is not built")
    driver = Driver(4)
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p)
    c_driver = proto(lambda *a: driver(*a))
    monkeypatch.setattr(native_launch, "driver_launch", lambda: c_driver)
    kernel = fake_kernel({"PO": "*fp32", "O": "*fp16", "LSE": "*fp32", "D": "constexpr"})
    x = torch.zeros(4)
    record = launch._native([(kernel, (3,), [x, x, x], {1: 3, 2: 4}),
                             (kernel, (5,), [x, x, x], {0: 0})])
    assert record._batched is not None
    assert record(tuple(range(16, 96, 16)), 7) == 2
    p = x.data_ptr()
    assert [c["values"][:3] for c in driver.calls] == [[p, 64, 80], [16, p, p]]
    assert [(c["grid"][0], c["stream"], c["function"]) for c in driver.calls] == [
        (3, 7, 0x5EED), (5, 7, 0x5EED)]
    assert driver.calls[0]["extra"] is None
    driver.result, driver.calls = 1, []
    assert record((0,) * 5, 9) == 0 and len(driver.calls) == 1  # refused: stops there
    with pytest.raises(TypeError, match="10 integer"):
        native_launch._helper()(1, 2, 3)
    with pytest.raises(ValueError, match="null"):
        native_launch._helper()(0, 1, 1, 1, 0, 0, 0, 0, 0, 0)
