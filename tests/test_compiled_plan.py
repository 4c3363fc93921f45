"""The compiled DeFT-Flatten planner (deft.plan.compiled, built at install) gives exactly
the Python planner's plan, packed device buffer and flags; without it (opted out, not
built) planning falls back."""

import contextlib
import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from benchmarks.trees import WORKLOADS, build, fan_layout, few_shot_layout, shuffle_slots
from conftest import assert_close, random_forest, random_qkv
from deft import TreeAttention, TreeLayout, make_plan
from deft.ops import Heads
from deft.ops.reference import reference_attention
from deft.plan import Coarsening, TreePlan, compiled
from deft.plan.packing import SEGMENTS

pytest.importorskip("triton")
from deft.ops.triton import backend as tb, configs, launch  # noqa: E402
from deft.ops.triton.upload import staging  # noqa: E402

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None or not os.path.exists(
        os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    reason="no C compiler or no Python headers")


def act_as(mp, gpu):
    """Plan as for an H200-like GPU (132 SMs, its config table) or as interpreted (4 SMs,
    no coarsening floor, small blocks)."""
    mp.setattr(configs, "arch_of", lambda device: "sm90" if gpu else "interpreter")
    mp.setattr(tb, "interpreting", lambda: not gpu)
    mp.setattr(tb, "_num_sms", lambda device: 132 if gpu else 4)


@pytest.fixture(params=["interpreting", "gpu-like"])
def setting(request, monkeypatch):
    act_as(monkeypatch, request.param == "gpu-like")
    return request.param


def spy(monkeypatch):
    """Record what every compiled flatten_plan call returns (None: the numpy path ran)."""
    from deft.plan import step

    results, real = [], step.flatten_plan

    def recorded(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(step, "flatten_plan", recorded)
    return results


@contextlib.contextmanager
def python_planner():
    """Plan with the Python specification (the compiled planner opted out)."""
    old = os.environ.get("DEFT_FASTPLAN")
    os.environ["DEFT_FASTPLAN"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["DEFT_FASTPLAN"]
        else:
            os.environ["DEFT_FASTPLAN"] = old


def fast_plan(layout, block_kv, h_q, h_kv, d, kind="flatten"):
    prep = tb.TritonBackend().plan(layout, kind, block_kv, Heads(h_q, h_kv, d), CPU)
    return prep.plan, prep


def numpy_plan(layout, block_kv, h_q, h_kv, d):
    with python_planner():
        return fast_plan(layout, block_kv, h_q, h_kv, d)


def kernel_reads(prep, num_tokens):
    """``[n]`` bool over the packed buffer: the entries the kernels read, which is all of
    them but token lo, hi and off before each tile's mask_from (the compiled planner leaves
    those as the buffer held them)."""
    read = torch.ones(prep.offsets[-1], dtype=torch.bool)
    masked = torch.zeros(num_tokens, dtype=torch.bool)
    for row in prep.segment("work").view(-1, 8)[:prep.num_work].tolist():
        masked[row[5]:row[1]] = True  # from mask_from to the tile's end
    for seg in (1, 2, 3):  # token lo, hi, off
        read[prep.offsets[seg]:prep.offsets[seg] + num_tokens] = masked
    return read


def assert_same(layout, block_kv=64, h_q=32, h_kv=8, d=128):
    """The fast path's plan, reduction map, packed buffer and flags equal the numpy path's."""
    ref_plan, ref = numpy_plan(layout, block_kv, h_q, h_kv, d)
    plan, prep = fast_plan(layout, block_kv, h_q, h_kv, d)
    assert isinstance(plan, TreePlan) and "token_slots" not in vars(plan)
    # The sizes come without the arrays; the arrays then come on first access.
    for f in ("num_tiles", "num_queries", "num_partials", "num_plan_tokens"):
        assert getattr(plan, f) == getattr(ref_plan, f), f
    assert "token_slots" not in vars(plan)
    for f in [f.name for f in dataclasses.fields(TreePlan)] + ["merge_indptr", "merge_partials"]:
        a, b = getattr(ref_plan, f), getattr(plan, f)
        if isinstance(a, np.ndarray):
            assert b.dtype == np.int64 and not b.flags.writeable, f
            np.testing.assert_array_equal(b, a, err_msg=f)
        else:
            assert a == b, f
    assert prep.offsets == ref.offsets and all(o % 16 == 0 for o in prep.offsets)
    read = kernel_reads(ref, plan.num_plan_tokens)
    n = ref.offsets[-1]
    assert torch.equal(prep.plan_buffer[:n][read], ref.plan_buffer[:n][read]), "packed buffer"
    for name in SEGMENTS:
        a, b = ref.offsets[SEGMENTS.index(name)], ref.offsets[SEGMENTS.index(name) + 1]
        assert torch.equal(prep.segment(name)[read[a:b]], ref.segment(name)[read[a:b]]), name
    for f in ("config", "num_work", "num_queries", "num_partials", "plse_off", "lse_off",
              "needs_mask", "contiguous", "tma", "sorted_queries"):
        assert getattr(prep, f) == getattr(ref, f), f
    assert (prep.counts is None) == (ref.counts is None)
    for f in ("partial_o", "partial_lse", "lse"):
        assert getattr(prep, f).shape == getattr(ref, f).shape, f
    return plan


@needs_cc
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 300), max_len=st.integers(0, 400),
       roots=st.integers(1, 4), block=st.sampled_from([1, 5, 16, 64]),
       heads=st.sampled_from([(1, 1), (6, 2), (32, 8), (32, 4)]), d=st.sampled_from([64, 256]),
       shuffle=st.booleans(), gpu=st.booleans())
def test_random_forests(seed, nodes, max_len, roots, block, heads, d, shuffle, gpu):
    rng = np.random.default_rng(seed)
    layout = random_forest(rng, nodes, max_len, max_tokens=3000, num_roots=roots, shuffle=shuffle)
    with pytest.MonkeyPatch.context() as mp:
        act_as(mp, gpu)
        assert_same(layout, block, *heads, d)


@needs_cc
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 60), sms=st.integers(1, 8),
       waves=st.sampled_from([1.0, 2.0, 4.0]), per_sm=st.integers(1, 4),
       resident=st.integers(0, 4), cost=st.sampled_from([0, 8, 128]), apart=st.booleans(),
       masked=st.sampled_from([0, 8, 300]), node_cut=st.sampled_from([0, 4, 12, 40]))
def test_random_coarsening_parameters(seed, nodes, sms, waves, per_sm, resident, cost, apart,
                                      masked, node_cut):
    """The compiled coarsening (launch model, resident wave, masked tiles apart and charged,
    tiles cut at long nodes where the model says) cuts the tiles that ``refine`` of
    ``flatten_cut`` cuts, and orders the work items alike, for any parameters."""
    from deft.plan.coarsen import refine
    from deft.plan.packing import pack
    from deft.plan.step import flatten_cut, plan_step

    rng = np.random.default_rng(seed)
    layout = random_forest(rng, nodes, 200, max_tokens=3000)
    params = Coarsening(2, 16, 2, sms, waves, 0, 64, per_sm * sms, cost, resident * sms, apart,
                        masked, node_cut)
    got = compiled.flatten_plan(layout, 8, params, lambda n: torch.zeros(n, dtype=torch.int32))
    want = refine(flatten_cut(layout, 8, params), params)
    np.testing.assert_array_equal(got[0].tile_indptr, want.tile_indptr)
    with python_planner():  # the Python step reuses the refinement its choice made
        stepped = plan_step(layout, "flatten", 8, params, lambda n: torch.zeros(n, dtype=torch.int32))
    np.testing.assert_array_equal(stepped[0].tile_indptr, want.tile_indptr)
    ref = pack(want, 2, 16, lambda n: torch.zeros(n, dtype=torch.int32))
    a, n = got[1].starts[4], 8 * got[1].num_work
    assert n == 8 * ref.num_work
    np.testing.assert_array_equal(got[1].buffer[a:a + n], ref.buffer[ref.starts[4]:][:n])


@needs_cc
@pytest.mark.parametrize("planner", ["compiled", "python"])
def test_tiles_cut_at_long_nodes_where_the_model_says(monkeypatch, planner):
    """H200-like, in partial states: 32 separate prompts of 1,000 tokens take one tile each
    (the cut at their starts: 256 programs, one wave, none masked) where flatten alone makes
    120 states; few-shot b=20, whose cut plan the launch model finishes no sooner and which
    would hold more, keeps flatten's 214, and b=50 takes the cut (350, not 486). 8 prompts
    tie in the model; their cut holds fewer states (24, not 38) and is taken."""
    act_as(monkeypatch, True)
    backend, heads = tb.TritonBackend(), Heads(32, 8, 128)
    prompts = TreeLayout.from_node_lengths([-1] * 32, [1000] * 32, list(range(32)))
    eight = TreeLayout.from_node_lengths([-1] * 8, [1000] * 8, list(range(8)))

    def partials(layout):
        with python_planner() if planner == "python" else contextlib.nullcontext():
            return backend.plan(layout, "flatten", 64, heads, CPU).plan.num_partials

    assert partials(prompts) == 32
    assert partials(few_shot_layout(4000, 20, 200)) == 214
    assert partials(few_shot_layout(4000, 50, 200)) == 350
    assert partials(eight) == 24
    key = ("sm90", 128, 0)
    monkeypatch.setitem(configs.CONFIGS, key,
                        dataclasses.replace(configs.CONFIGS[key], node_cut=0))
    assert partials(prompts) == 120
    assert partials(few_shot_layout(4000, 50, 200)) == 486
    assert partials(eight) == 38


_FEW_SHOT = few_shot_layout(64, 5, 20)
SPECIAL = {
    "one node": TreeLayout([-1], [0, 7], np.arange(7)[::-1].copy(), [0], [4]),
    "one token": TreeLayout.from_node_lengths([-1], [1], [0]),
    "deep chain": TreeLayout.from_node_lengths(np.arange(-1, 1999), np.full(2000, 3), [1999, 1000, 0]),
    "1000-leaf fan": shuffle_slots(fan_layout(300, 1000), seed=3, num_slots=2000),
    "empty nodes": TreeLayout.from_node_lengths([-1, 0, 1, 1, 0, 4], [0, 0, 5, 0, 0, 3], [3, 4, 2, 5]),
    "all empty": TreeLayout.from_node_lengths([-1, 0, 0], [0, 0, 0], [1, 2, 0]),
    "partial lens, several per node": TreeLayout.from_node_lengths(
        [-1, 0, 0, 1], [20, 7, 0, 5], [0, 1, 2, 3, 3, 0, 3], [20, 3, 0, 2, 5, 0, 1]),
    "queries on internal nodes": TreeLayout.from_node_lengths(
        [-1, 0, 0, 1, 1], [70, 40, 30, 20, 10], [0, 1, 1, 4, 2], [33, 40, 7, 10, 30]),
    "unseen tiles": TreeLayout.from_node_lengths([-1, 0, 0, 0], [100, 300, 50, 200], [2]),
    "reversed queries (a strided view)": TreeLayout(
        _FEW_SHOT.parents, _FEW_SHOT.node_kv_indptr, _FEW_SHOT.kv_indices, _FEW_SHOT.query_nodes[::-1]),
    "no queries": TreeLayout.from_node_lengths([-1, 0], [10, 5], []),
    "no nodes": TreeLayout([], [0], [], []),
}


@needs_cc
@pytest.mark.parametrize("name", list(SPECIAL))
@pytest.mark.parametrize("block", [1, 8, 64])
def test_special_trees(setting, name, block):
    assert_same(SPECIAL[name], block)
    assert_same(SPECIAL[name], block, 6, 2, 64)


@needs_cc
@pytest.mark.parametrize("planner", ["compiled", "python"])
def test_a_cut_plan_fits_the_default_capacity(monkeypatch, planner):
    """H200-like: a plan cut at long nodes holds no more partial states than flatten's plan
    before coarsening, so it fits a graph-safe reservation's default room (queries times
    flatten's tiles): here the cut would hold 36 where 25 are reserved, and the plain cut
    stays."""
    from deft import Capacity

    act_as(monkeypatch, True)
    qn = [0, 0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    layout = TreeLayout.from_node_lengths([-1, 0], [21, 34], qn)
    assert make_plan(layout, "flatten", 64, node_cut=32).num_tiles == 2
    attn = TreeAttention(32, 8, 128, backend="triton", device="cpu", block_kv=64,
                         capacity=Capacity(queries=25, tokens=64))
    with python_planner() if planner == "python" else contextlib.nullcontext():
        assert attn.plan(layout).num_partials == 25


@needs_cc
def test_masked_tiles_apart(setting, monkeypatch):
    """``KernelConfig.masked_apart`` and ``masked_cost``: both planners cut a run's masked
    last plan tile off and charge masked tiles alike, and the packed buffers agree, on the
    special trees and few-shot and draft trees, with each on and off; on the H200's configs
    (both on) few-shot b=20 has one tile more than without the cut, and a 32k prompt with
    16 queries keeps its tiles."""
    trees = {**SPECIAL, "few-shot b=20": few_shot_layout(4000, 20, 200),
             "draft tree": fan_layout(2000, 64), "32k x16": fan_layout(32 * 1024, 16)}
    shipped = dict(configs.CONFIGS)
    tiles = {}
    for apart, cost in ((True, 128), (True, 0), (False, 128), (False, 0)):
        for key, cfg in shipped.items():
            monkeypatch.setitem(configs.CONFIGS, key,
                                dataclasses.replace(cfg, masked_apart=apart, masked_cost=cost))
        tiles[apart, cost] = {name: assert_same(layout).num_tiles
                              for name, layout in trees.items()}
    if setting == "gpu-like":
        configs.CONFIGS.update(shipped)
        fast = {name: fast_plan(trees[name], 64, 32, 8, 128)[0].num_tiles
                for name in ("few-shot b=20", "32k x16")}
        assert fast["few-shot b=20"] == tiles[False, 128]["few-shot b=20"] + 1
        assert fast["32k x16"] == tiles[False, 128]["32k x16"] == tiles[False, 0]["32k x16"]


@needs_cc
def test_recorded_workloads(setting, workloads):
    for name in WORKLOADS:
        assert_same(build(name, workloads))


@pytest.mark.parametrize("planner", ["compiled", "python"])
def test_only_flatten_plans_fit_one_wave_of_the_resident_programs(monkeypatch, planner):
    """H200-like: 16 queries on a 32,768-token prompt (512 rows), where the uncapped
    head_dim-128 kernel keeps 2 programs per SM, take 33 tiles (one wave of 264 programs)
    instead of the launch model's 48, over 16-bit or FP8 K/V; per-query plans keep its choice
    (64 tiles), and so does any launch under a register cap (it sets the programs resident)."""
    act_as(monkeypatch, True)
    layout = fan_layout(32768, 16)
    backend, heads = tb.TritonBackend(), Heads(32, 8, 128)

    def tiles(kind, kv_dtype=None):
        with python_planner() if planner == "python" else contextlib.nullcontext():
            return backend.plan(layout, kind, 64, heads, CPU, kv_dtype=kv_dtype).plan.num_tiles

    assert tiles("flatten") == 33
    assert tiles("flatten", torch.float8_e4m3fn) == 33
    assert tiles("per_query") == 64
    key = ("sm90", 128, 0)
    monkeypatch.setitem(configs.CONFIGS, key,
                        dataclasses.replace(configs.CONFIGS[key], maxnreg=168, kv8_maxnreg=168))
    assert tiles("flatten") == 48
    assert tiles("flatten", torch.float8_e4m3fn) == 48
    monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(
        configs.CONFIGS[key], maxnreg=None, resident_per_sm=None))
    assert tiles("flatten") == 48


@needs_cc
def test_huge_block_kv(setting):
    """A tile size near 2**63 must not overflow the C planner's tile arithmetic."""
    assert_same(SPECIAL["partial lens, several per node"], 2**63 - 1)


@needs_cc
def test_fused_merge_flag(setting, monkeypatch):
    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, fuse_merge=True))
    for layout in (SPECIAL["partial lens, several per node"], SPECIAL["unseen tiles"]):
        assert_same(layout, 8)


@needs_cc
def test_threads_keep_their_own_workspace():
    """Concurrent plans (the C calls release the GIL) in fresh threads, whose workspaces grow."""
    rng = np.random.default_rng(7)
    layouts = [random_forest(rng, int(rng.integers(1, 400)), 300, max_tokens=20000) for _ in range(16)]
    expected = [numpy_plan(lay, 16, 8, 2, 64)[0] for lay in layouts]

    def fast(layout):
        return fast_plan(layout, 16, 8, 2, 64)[0]

    with ThreadPoolExecutor(4) as pool:
        for plan, ref in zip(pool.map(fast, layouts), expected):
            np.testing.assert_array_equal(plan.token_slots, ref.token_slots)
            np.testing.assert_array_equal(plan.merge_partials, ref.merge_partials)


@needs_cc
def test_plan_arrays_come_later_and_stay_right():
    """A compiled plan's arrays, first read after other plans reused the workspace, are
    still its own layout's (they are planned again on first access)."""
    rng = np.random.default_rng(11)
    first, other = (random_forest(rng, 60, 200, max_tokens=5000) for _ in range(2))
    plan, _ = fast_plan(first, 16, 8, 2, 64)
    fast_plan(other, 16, 8, 2, 64)
    ref = numpy_plan(first, 16, 8, 2, 64)[0]
    assert "tiles=" in repr(plan)  # repr reads an array: the first access
    for f in ("token_slots", "tile_indptr", "query_order", "merge_indptr", "merge_partials"):
        np.testing.assert_array_equal(getattr(plan, f), getattr(ref, f), err_msg=f)
    assert dataclasses.replace(plan).max_tile_len == ref.max_tile_len


def _unchecked_layout(parents, dtype):
    """What TreeLayout would reject: two nodes of 2 tokens, a query on each, as ``dtype``."""
    fields = dict(parents=parents, node_kv_indptr=[0, 2, 4], kv_indices=[0, 1, 2, 3],
                  query_nodes=[0, 1], query_kv_lens=[2, 2])
    return SimpleNamespace(num_tokens=4, **{k: np.asarray(v, dtype) for k, v in fields.items()})


@needs_cc
@pytest.mark.parametrize("parents,dtype", [([1, 0], np.int64), ([-1, 0], np.int32)],
                         ids=["cycle", "int32 arrays"])
def test_malformed_input_returns_none(parents, dtype):
    """The C planner's error codes (malformed forest, arrays not int64) give ``None``."""
    assert compiled.flatten_plan(
        _unchecked_layout(parents, dtype), 8, Coarsening(1, 16, 1, 4, 2.0, 0, 1024, 12, 128),
        lambda n: torch.zeros(n, dtype=torch.int32)) is None


def test_other_plan_kinds_are_not_fast(monkeypatch):
    calls = spy(monkeypatch)
    plan, _ = fast_plan(SPECIAL["one node"], 8, 2, 1, 16, kind="node")
    assert calls == [] and plan.kind == "node"


def test_opt_out_plans_with_numpy(monkeypatch):
    monkeypatch.setenv("DEFT_FASTPLAN", "0")
    calls = spy(monkeypatch)
    layout = SPECIAL["partial lens, several per node"]
    plan = TreeAttention(2, 1, 16, backend="triton", block_kv=8).plan(layout)
    assert calls == [None]
    np.testing.assert_array_equal(plan.merge_partials, numpy_plan(layout, 8, 2, 1, 16)[0].merge_partials)


@needs_cc
def test_built_at_install():
    """``pip install`` (``make run``/``make test``) compiled the planner into the package."""
    assert compiled.load_library() is not None
    assert Path(compiled.load_library().__file__).parent == Path(compiled.__file__).parent


_UNDER_UBSAN = """
import importlib.util, sys
import pytest
spec = importlib.util.spec_from_file_location("deft.plan._flatten_plan", sys.argv[1])
sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[spec.name])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-k", sys.argv[2], __file__]))
"""


@needs_cc
def test_no_undefined_behaviour(tmp_path):
    """Built with ``-fsanitize=undefined`` (every report fatal), the planner runs this file's
    edge cases (huge tiles, malformed input, random forests and coarsening parameters)
    without one: signed overflow and the like stay invisible in the normal build."""
    root = Path(__file__).resolve().parents[1]
    flags = "-fsanitize=undefined -fno-sanitize-recover=all -g -O1"
    env = dict(os.environ, CFLAGS=flags, LDFLAGS="-fsanitize=undefined")
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                            str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)
    lib = list((tmp_path / "lib").rglob("_flatten_plan*"))
    if built.returncode or not lib:
        pytest.skip(f"no UBSan build here: {built.stderr[-300:]}")
    script = tmp_path / "under_ubsan.py"
    script.write_text(_UNDER_UBSAN.replace("__file__", repr(__file__)))
    cases = "huge or malformed or special or random or apart"
    run = subprocess.run([sys.executable, str(script), str(lib[0]), cases], cwd=root,
                         env=dict(os.environ, UBSAN_OPTIONS="print_stacktrace=1"),
                         capture_output=True, text=True, timeout=600)
    assert "runtime error" not in run.stderr, run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout


def test_not_built_falls_back_to_numpy(monkeypatch):
    real = importlib.import_module

    def without_extension(name, *args):
        if name == "deft.plan._flatten_plan":
            raise ImportError("No module named 'deft.plan._flatten_plan'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_extension)
    compiled.load_library.cache_clear()
    try:
        layout = SPECIAL["partial lens, several per node"]
        with pytest.warns(RuntimeWarning, match="compiled planner was not built"):
            assert compiled.flatten_plan(layout, 8, Coarsening(1, 16, 1, 4, 2.0, 0, 1024, 12, 128),
                                         lambda n: torch.zeros(n, dtype=torch.int32)) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per process, not per plan
            plan = TreeAttention(2, 1, 16, backend="triton", block_kv=8).plan(layout)
        np.testing.assert_array_equal(plan.token_slots, make_plan(layout, "flatten", 8).token_slots)
    finally:
        compiled.load_library.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_install_without_a_compiler_still_succeeds(tmp_path):
    """``setup.py build_ext`` with a compiler that fails warns and exits 0."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CC="false", LDSHARED="false")
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                          str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "a compiled helper was not built" in res.stdout + res.stderr
    assert not list((tmp_path / "lib").rglob("_flatten_plan*"))
    assert not list((tmp_path / "lib").rglob("_driver_launch*"))


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_output_matches_numpy_path(monkeypatch, dtype):
    """End to end under the Triton interpreter: same output as the numpy-planned run."""
    layout = shuffle_slots(few_shot_layout(40, 3, 9), seed=1, num_slots=90)
    q, k, v = random_qkv(layout, 4, 2, 32, dtype, seed=2, device=DEV)
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=None if CUDA else 8)
    calls = spy(monkeypatch)
    attn.plan(layout)
    o_fast = attn.run(q, k, v)
    monkeypatch.setenv("DEFT_FASTPLAN", "0")
    attn.plan(layout)
    assert calls[0] is not None and calls[1] is None
    assert torch.equal(attn.run(q, k, v), o_fast)
    assert_close(o_fast, reference_attention(q, k, v, layout, 32**-0.5)[0], dtype, "fast plan")


def test_kernel_pointers_match_the_buffers(monkeypatch):
    """Compiled (not interpreted), the kernels get ``Pointer`` objects instead of views:
    each must carry the address and dtype of the buffer, segment or workspace it stands
    for."""
    monkeypatch.setattr(tb, "interpreting", lambda: False)
    layout = few_shot_layout(300, 6, 40)
    _, prep = numpy_plan(layout, 16, 8, 2, 64)  # the compiled planner ends in the same _upload
    assert len(prep.arrays) == 3
    for ptr, name in zip(prep.arrays, ("tok_slot", "merge_indptr", "merge_partials")):
        assert isinstance(ptr, launch.Pointer) and ptr.dtype == torch.int32, name
        assert ptr.data_ptr() == prep.segment(name).data_ptr(), name
    assert prep.arrays[0].data_ptr() == prep.plan_buffer.data_ptr()  # the others at offsets
    for ptr, view in zip(prep.workspaces, (prep.partial_o, prep.partial_lse, prep.lse)):
        assert ptr.dtype == torch.float32 and ptr.data_ptr() == view.data_ptr()
    assert prep.partial_o.data_ptr() + 4 * prep.partial_o.numel() <= prep.partial_lse.data_ptr()
    assert prep.partial_lse.data_ptr() + 4 * prep.partial_lse.numel() <= prep.lse.data_ptr()


@needs_cc
def test_unread_entries_are_left_as_they_were():
    """The compiled planner skips token lo, hi and off that no kernel reads (before each
    tile's mask_from): with the host buffers full of garbage first, a step stays exact."""
    layout = shuffle_slots(few_shot_layout(45, 3, 11), seed=4, num_slots=100)
    q, k, v = random_qkv(layout, 4, 2, 32, torch.float16, seed=3, device=DEV)
    attn = TreeAttention(4, 2, 32, backend="triton", device=DEV, block_kv=None if CUDA else 8)
    attn.plan(layout)
    attn.plan(layout)  # both host buffers exist now
    host = staging(attn._prepared.plan_buffer.device)
    for buf in host.buffers:
        buf.fill_(1 << 20)
    attn.plan(layout)
    work = attn._prepared.segment("work").view(-1, 8)[:attn._prepared.num_work].cpu()
    assert (work[:, 5] > work[:, 0]).any()  # some tokens are unmasked: their entries unread
    assert_close(attn.run(q, k, v), reference_attention(q, k, v, layout, 32**-0.5)[0],
                 torch.float16, "garbage in unread entries")
