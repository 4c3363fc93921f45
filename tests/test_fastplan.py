"""The compiled DeFT-Flatten planner (deft.fastplan) gives exactly the numpy planner's plan,
packed device buffer and flags; without it (opted out, no compiler) planning falls back."""

import dataclasses
import os
import shutil
import sysconfig
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import assert_close, random_forest, random_qkv
from deft import TreeAttention, TreeLayout, fastplan, make_plan
from deft.bench.trees import WORKLOADS, build
from deft.ops.reference import reference_attention
from deft.plan import TreePlan
from deft.workloads import fan_layout, few_shot_layout, shuffle_slots

pytest.importorskip("triton")
from deft.ops import triton_backend as tb  # noqa: E402

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None or not os.path.exists(
        os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    reason="no C compiler or no Python headers")


@pytest.fixture(params=["interpreting", "gpu-like"])
def setting(request, monkeypatch):
    """Interpreted (4 SMs, no coarsening floor, small blocks) or an H200-like GPU (132 SMs)."""
    if request.param == "gpu-like":
        monkeypatch.setattr(tb, "interpreting", lambda: False)
        monkeypatch.setattr(tb, "_num_sms", lambda device: 132)
    else:
        monkeypatch.setattr(tb, "interpreting", lambda: True)
        monkeypatch.setattr(tb, "_num_sms", lambda device: 4)
    return request.param


def spy(monkeypatch):
    """Record what every fastplan.flatten_plan call returns (None: the numpy path ran)."""
    results, real = [], fastplan.flatten_plan

    def recorded(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(fastplan, "flatten_plan", recorded)
    return results


def numpy_plan(layout, block_kv, h_q, h_kv, d):
    be = tb.TritonBackend()
    plan = be.refine_plan(make_plan(layout, "flatten", block_kv), h_q, h_kv, d, CPU)
    return plan, be.prepare(plan, layout, CPU, h_q, h_kv, d)


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
    plan, prep = tb.TritonBackend().plan_fast(layout, "flatten", block_kv, h_q, h_kv, d, CPU)
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
    for name in tb._SEGMENTS:
        a, b = ref.offsets[tb._SEGMENTS.index(name)], ref.offsets[tb._SEGMENTS.index(name) + 1]
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
        mp.setattr(tb, "interpreting", lambda: not gpu)
        mp.setattr(tb, "_num_sms", lambda device: 132 if gpu else 4)
        assert_same(layout, block, *heads, d)


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
def test_recorded_workloads(setting, workloads):
    for name in WORKLOADS:
        assert_same(build(name, workloads))


@needs_cc
def test_huge_block_kv(setting):
    """A tile size near 2**63 must not overflow the C planner's tile arithmetic."""
    assert_same(SPECIAL["partial lens, several per node"], 2**63 - 1)


@needs_cc
def test_fused_merge_flag(setting, monkeypatch):
    monkeypatch.setattr(tb, "_INTERPRET_CONFIG", dataclasses.replace(tb._INTERPRET_CONFIG, fuse_merge=True))
    for d, cfg in list(tb._GPU_CONFIGS.items()):
        monkeypatch.setitem(tb._GPU_CONFIGS, d, dataclasses.replace(cfg, fuse_merge=True))
    for layout in (SPECIAL["partial lens, several per node"], SPECIAL["unseen tiles"]):
        assert_same(layout, 8)


@needs_cc
def test_threads_keep_their_own_workspace():
    """Concurrent plans (the C calls release the GIL) in fresh threads, whose workspaces grow."""
    rng = np.random.default_rng(7)
    layouts = [random_forest(rng, int(rng.integers(1, 400)), 300, max_tokens=20000) for _ in range(16)]
    expected = [numpy_plan(lay, 16, 8, 2, 64)[0] for lay in layouts]

    def fast(layout):
        return tb.TritonBackend().plan_fast(layout, "flatten", 16, 8, 2, 64, CPU)[0]

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
    be = tb.TritonBackend()
    plan, _ = be.plan_fast(first, "flatten", 16, 8, 2, 64, CPU)
    be.plan_fast(other, "flatten", 16, 8, 2, 64, CPU)
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
    assert fastplan.flatten_plan(
        _unchecked_layout(parents, dtype), 8, fastplan.PlanParams(1, 16, 1, 4, 2.0, 0, 1024, 12, 128),
        lambda n: torch.zeros(n, dtype=torch.int32)) is None


def test_other_plan_kinds_are_not_fast():
    assert tb.TritonBackend().plan_fast(SPECIAL["one node"], "node", 8, 2, 1, 16, CPU) is None


def test_opt_out_plans_with_numpy(monkeypatch):
    monkeypatch.setenv("DEFT_FASTPLAN", "0")
    calls = spy(monkeypatch)
    layout = SPECIAL["partial lens, several per node"]
    plan = TreeAttention(2, 1, 16, backend="triton", block_kv=8).plan(layout)
    assert calls == [None]
    np.testing.assert_array_equal(plan.merge_partials, numpy_plan(layout, 8, 2, 1, 16)[0].merge_partials)


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """Reload the planner library with an empty cache directory; restore it afterwards."""
    monkeypatch.setenv("DEFT_CACHE_DIR", str(tmp_path / "cache"))
    fastplan.load_library.cache_clear()
    yield tmp_path
    fastplan.load_library.cache_clear()


@pytest.mark.parametrize("cc", ["false", "no-such-compiler-xyz", "'unbalanced quote"])
def test_failing_compiler_falls_back_to_numpy(fresh_library, monkeypatch, cc):
    monkeypatch.setenv("CC", cc)
    layout = SPECIAL["partial lens, several per node"]
    with pytest.warns(RuntimeWarning, match="compiled planner is unavailable"):
        assert tb.TritonBackend().plan_fast(layout, "flatten", 8, 2, 1, 16, CPU) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not per plan
        plan = TreeAttention(2, 1, 16, backend="triton", block_kv=8).plan(layout)
    np.testing.assert_array_equal(plan.token_slots, make_plan(layout, "flatten", 8).token_slots)


@needs_cc
def test_build_is_cached_by_source_hash(fresh_library, monkeypatch):
    cache = fresh_library / "cache"
    assert fastplan.load_library() is not None
    (built,) = cache.glob("flatten_plan-*")
    fastplan.load_library.cache_clear()
    assert fastplan.load_library() is not None
    assert list(cache.glob("flatten_plan-*")) == [built]  # reused, no temporary left
    edited = fresh_library / "flatten_plan.c"
    edited.write_bytes(fastplan._SOURCE.read_bytes() + b"/* edited */\n")
    monkeypatch.setattr(fastplan, "_SOURCE", edited)
    cc = [shutil.which("cc")]
    edited_build = fastplan._compile(cc)
    assert edited_build != built  # an edit rebuilds
    monkeypatch.setattr(fastplan.platform, "machine", lambda: "another-arch")
    assert fastplan._compile(cc) not in (built, edited_build)  # so does another machine


@needs_cc
def test_compiler_command_with_flags(fresh_library, monkeypatch):
    """``CC`` may carry flags (``CC="ccache gcc"``, ``CC="cc -m64"``); they key the build."""
    monkeypatch.setenv("CC", "cc -O1")
    assert fastplan.load_library() is not None
    (built,) = (fresh_library / "cache").glob("flatten_plan-*")
    assert built != fastplan._compile([shutil.which("cc")])


def test_cache_dir_falls_back_to_a_temp_dir(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("DEFT_CACHE_DIR", str(tmp_path / "file"))  # not a directory
    monkeypatch.setenv("HOME", str(tmp_path / "file"))  # nor is ~/.cache/deft possible
    assert fastplan._cache_dir() == tmp_path / f"deft-{os.getuid()}"
    assert (tmp_path / f"deft-{os.getuid()}").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("kind", ["world-writable", "symlink", "file"])
def test_temp_dir_others_could_write_is_not_used(monkeypatch, tmp_path, kind):
    """A predictable temp path another user could have made (and planted a library in) is
    skipped for a fresh private directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"deft-{os.getuid()}"
    if kind == "world-writable":
        shared.mkdir()
        shared.chmod(0o777)
    elif kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        shared.symlink_to(tmp_path / "elsewhere")
    else:
        shared.write_text("")
    got = fastplan._private_temp_dir()
    assert got.parent == tmp_path and got.name.startswith("deft-") and got != shared
    assert got.stat().st_mode & 0o777 == 0o700


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
    """Compiled (not interpreted), the kernels get ``_Pointer`` objects instead of views:
    each must carry the address and dtype of the buffer, segment or workspace it stands
    for."""
    monkeypatch.setattr(tb, "interpreting", lambda: False)
    layout = few_shot_layout(300, 6, 40)
    _, prep = numpy_plan(layout, 16, 8, 2, 64)  # the compiled planner ends in the same _finish
    assert len(prep.arrays) == 3
    for ptr, name in zip(prep.arrays, ("tok_slot", "merge_indptr", "merge_partials")):
        assert isinstance(ptr, tb._Pointer) and ptr.dtype == torch.int32, name
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
    from deft.ops.upload import staging

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
