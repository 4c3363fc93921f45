"""The partial kernel's sm_90 builds, compiled on this machine without a GPU
(``tools/kernel_registers.py``: Triton for sm_90, then ``ptxas -v``), and the rows of the work
items its H200 plans hand it (``tools/work_rows.py``)."""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas")
def test_graph_safe_builds_compile_for_sm90_within_their_register_caps(tmp_path):
    """The graph-safe builds (TMA, plan header) of steps under 2,048 rows compile for sm_90:
    the 64-row ones uncapped with their wgmma instructions asynchronous, over bf16 and FP8 K/V,
    and FP8's few-row build within its 168-register cap. ``--dump`` writes each build's
    TTGIR (its K/V loads by TMA) and SASS (wgmma products for 64 rows, mma.sync for 16)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "kernel_registers.py"), "--rows", "0", "--launch",
         "graph-safe", "--block-m", "shipped,few", "--dump", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    for name, product in (("rows0-bf16-graph-safe-m64-capnone", "HGMMA."),
                          ("rows0-fp8-graph-safe-m64-capnone", "HGMMA."),
                          ("rows0-fp8-graph-safe-m16-cap168", "HMMA.")):
        assert "async_tma_copy_global_to_local" in (tmp_path / f"{name}.ttgir").read_text()
        assert product in (tmp_path / f"{name}.sass").read_text(), name
    rows = {}
    for line in out.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[1], cells[3]] = cells[4:]
    assert set(rows) == {("bf16", "64"), ("fp8", "64"), ("fp8", "16")}, out
    for kv in ("bf16", "fp8"):
        cap, variant, registers, _, _, _, serialised, *_ = rows[kv, "64"]
        assert cap == "none" and variant == "shipped", out
        assert 0 < int(registers) <= 255 and serialised == "no", out
    cap, _, registers, *_ = rows["fp8", "16"]
    assert cap == "168" and 0 < int(registers) <= 168, out


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas")
def test_kernel_variants_compile_for_sm90():
    """The kernel variants of the graph-safe build compile for sm_90, uncapped, with their
    wgmma instructions asynchronous: the masked tiles' (``aligned_mask`` and
    ``ranges_first``), deferred V checks, whose masked block loops are the shorter by a
    quarter at least (no V values loaded, checked and stored back) and whose unmasked ones
    stay as they were, and finite e4m3 scores, whose FP8 loops lose the -inf select; the
    -inf check by an FMA (``inf_by_fma``, against ``per-value``) shortens the bf16 unmasked
    loops alone."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "kernel_registers.py"), "--rows", "0", "--kv",
         "bf16,fp8", "--launch", "graph-safe", "--variants",
         "checked,both,deferred,finite,fma,per-value"],
        capture_output=True, text=True, timeout=600, check=True, cwd=ROOT).stdout
    loops, header = {}, [c.strip() for c in out.splitlines()[0].strip("|").split("|")]
    for line in out.splitlines()[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        assert cells["cap"] == "none", out
        assert 0 < int(cells["registers"]) <= 255 and cells["wgmma serialised"] == "no", out
        loops[cells["K/V"], cells["variant"]] = {k: int(cells[k].split()[0]) for k in header[-4:]}
    assert len(loops) == 12, out
    for kv in ("bf16", "fp8"):
        shipped, deferred = loops[kv, "checked"], loops[kv, "deferred"]
        for kind in ("TMA masked", "gathered masked"):
            assert deferred[kind] < 0.75 * shipped[kind], out
        for kind in ("TMA", "gathered"):
            assert abs(deferred[kind] - shipped[kind]) <= 0.05 * shipped[kind], out
    assert loops["bf16", "finite"] == loops["bf16", "checked"], out  # a 16-bit K keeps it
    for kind in ("TMA", "gathered"):  # 32 fewer per block (the masked ones vary more)
        assert loops["fp8", "finite"][kind] < loops["fp8", "checked"][kind], out
        assert loops["bf16", "fma"][kind] < loops["bf16", "per-value"][kind], out
    for kind in ("TMA masked", "gathered masked"):
        assert loops["bf16", "fma"][kind] == loops["bf16", "per-value"][kind], out
    assert loops["fp8", "fma"] == loops["fp8", "finite"], out  # e4m3 K: no -inf check at all


def test_work_rows_finds_the_small_items_of_a_few_shot_tree_and_none_of_a_long_prompt():
    """``tools/work_rows.py`` on the CPU: few-shot b=20's branches (one query's 4 rows each)
    are small items holding much of its token work, and over FP8 K/V its tiles pick the
    few-row build; a 32k prompt seen by 16 queries has neither; the 64 leaves of speculative
    t=64 (200 programs) ask for the light build, and some of its masked items end their
    unmasked part inside a K/V block, where none of few-shot b=20's do; only the prompt seen
    by 16 queries reads each K/V block once."""
    for kv, few_cols in (("auto", ["-", "default"]), ("fp8_e4m3", ["0.33", "few_rows"])):
        out = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "work_rows.py"), "--kv-dtype", kv,
             "few-shot b=20", "long prompt 32k x16", "speculative t=64"],
            capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
        rows = {}
        for line in out.splitlines()[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        few, long = rows["few-shot b=20"], rows["long prompt 32k x16"]
        assert int(few[1]) > int(few[0]) // 2 and 0.3 < float(few[2]) < 1, out
        assert few[4:6] == few_cols, out
        assert long[1:6] == ["0", "0.00", "0%", "-" if kv == "auto" else "0.00", "default"], out
        # Each tile's K/V read once per row chunk: the 32k prompt's 64 rows are one chunk,
        # few-shot b=20's prompt has more rows than one.
        assert long[9] == "1.00" and float(few[9]) > 1, out
        assert rows["speculative t=64"][5] == "light", out
        # Masked items: the branches' (their unmasked part a whole number of blocks), and
        # the draft tree's (most of them ending their prompt part inside a block).
        assert int(few[6]) > 0 and few[7] == "0", out
        spec = rows["speculative t=64"]
        assert 0 < int(spec[7]) <= int(spec[6]), out


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas")
def test_the_warp_specialised_gluon_experiment_compiles_for_sm90_without_spills():
    """``tools/ws_partial_gluon.py --compile-only``: each build of the experiment (16-bit:
    six, FP8: nine) compiles for sm_90a within its register cap, spilling nothing."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "ws_partial_gluon.py"), "--compile-only"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    builds = re.findall(r"^torch\.(\w+) (\{.*\}) Usage\(registers=(\d+), stack=(\d+), "
                        r"spill_stores=(\d+), spill_loads=(\d+)", out, re.M)
    assert [b[0] for b in builds] == ["float16"] * 6 + ["float8_e4m3fn"] * 9, out
    for _, cfg, registers, *spills in builds:
        cap = 128 if "'maxnreg': 128" in cfg else 255
        assert 0 < int(registers) <= cap and spills == ["0", "0", "0"], out


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas")
def test_the_persistent_gluon_experiment_compiles_for_sm90_spilling_only_where_known():
    """``tools/persistent_gluon.py --compile-only``: each of its 22 builds compiles for sm_90a
    (one program per SM, 168 registers at most), and all but the two with a 16-row consumer
    for small pairs, the two-consumer one with isolation and the overlapped one with the lean
    checks (its pair loop's values, beside the cold path) spill nothing."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "persistent_gluon.py"), "--compile-only"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    builds = re.findall(r"^(\{.*\}) Usage\(registers=(\d+), stack=(\d+), spill_stores=(\d+), "
                        r"spill_loads=(\d+)", out, re.M)
    assert len(builds) == 22, out
    for cfg, registers, *spills in builds:
        assert 0 < int(registers) <= 168, out
        spilling = ("'small': True" in cfg or "'check': 2, 'consumers': 2" in cfg
                    or "'overlap': True, 'check': 5" in cfg)
        assert spilling or spills == ["0", "0", "0"], out


def test_program_timeline_summary_fits_pair_durations_and_replays_their_order(tmp_path):
    """``tools/program_timeline.py --from-json`` on pairs whose durations follow an exact
    law (3 µs + 30 µs per 1k tokens + 5 if masked + 1 if gathered), run in program order
    on one SM's two slots: it recovers the law, names the pair that ends last, and list
    scheduling reproduces the recorded span (34.0 µs) and the longest-first one (31.1)."""
    pairs = [(512, 0, False), (64, 64, True), (128, 0, True), (256, 10, False), (64, 0, False)]
    free, rows = [0.0, 0.0], []
    for program, (tokens, masked, gathered) in enumerate(pairs):
        dur = 3 + 0.03 * tokens + 5 * (masked > 0) + 1 * gathered
        slot = free.index(min(free))
        start, free[slot] = free[slot], free[slot] + dur
        rows += [{"tree": "t", "variant": "shipped", "layer": layer, "sm": 0, "start_us": start,
                  "end_us": start + dur, "tokens": tokens, "group_rows": 4, "masked": masked,
                  "gathered": gathered, "program": program} for layer in range(4)]
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(rows))
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "program_timeline.py"), "--from-json", str(path)],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    assert "span 34.0 µs (median of 2 layers), 5 pairs" in out, out
    assert ("pair µs = 3.00 + 30.0 per 1k tokens + 5.00 if any token is masked + 1.00 if "
            "gathered (rms residual 0.00)") in out, out
    assert "ends late: 256 tokens, 4 group rows, 10 masked, TMA: 1 pairs, µs median 15.7 " \
           "from 18.4 to 34.0" in out, out
    assert "on 2 slots: in the recorded order 34.0 µs, longest first 31.1 µs" in out, out


def test_the_few_row_orientation_experiment_matches_the_reference_and_compiles():
    """``tools/few_rows_swap.py``: both orientations agree with the float64 reference over
    16-bit and FP8 K/V (interpreted, a tiny shape; the tool asserts it), and
    ``--compile-only`` compiles all its builds for sm_90a without spills."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    for kv in ("bf16", "fp8"):
        out = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "few_rows_swap.py"), "--check", "--tiny",
             "--branches", "3", "--branch-len", "70", "--kv", kv],
            capture_output=True, text=True, timeout=300, check=True, cwd=ROOT, env=env).stdout
        assert out.count("('") == 2, out
    if not PTXAS.exists():
        pytest.skip("this Triton ships no ptxas")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "few_rows_swap.py"), "--compile-only"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    builds = re.findall(r"^(swap|rows16) \S+ \S+ \S+ (bf16|fp8) Usage\(registers=(\d+), "
                        r"stack=\d+, spill_stores=(\d+)", out, re.M)
    assert len(builds) == 12 and all(s == "0" for *_, s in builds), out


def test_program_timeline_kernel_takes_the_partial_kernels_arguments():
    """``tools/program_timeline.py`` stands its instrumented kernel in for the partial kernel
    under the shipped launcher, so it takes every argument that one does (its record buffer
    after the launch arguments) and every compile-time flag."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import program_timeline
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from deft.ops.triton import kernels

    def names(fn, constexpr: bool) -> list[str]:  # a JIT or an interpreted kernel's
        params = inspect.signature(fn.fn).parameters.values()
        return [p.name for p in params if ("constexpr" in str(p.annotation)) == constexpr]

    timed, shipped = program_timeline.timeline_kernel, kernels.tree_partial_kernel
    assert names(timed, False) == [*names(shipped, False), "TL"]
    assert set(names(timed, True)) == set(names(shipped, True))


def test_slot_runs_sees_each_sequence_in_one_run_after_churn_too():
    """``tools/slot_runs.py`` on the CPU: prompts prefilled together take their chunks in
    turns, yet each greedy sequence (prompt, then new tokens) lies in one run of slots, so
    every tile of greedy32 is consecutive, on a fresh pool and after churn; where every take
    pops the free list none is, though most K/V blocks are; 16 samples of one prompt keep
    most tiles consecutive, fewer where every take pops."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "slot_runs.py"), "--steps", "4", "--churn", "16",
         "greedy32", "sample16"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    rows = {}
    for line in out.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0], cells[1]] = [float(c.rstrip("%")) for c in cells[3:]]
    assert rows["greedy32", "fresh"] == [100, 100] == rows["greedy32", "after churn"], out
    popped = rows["greedy32", "after churn, pages popped"]
    assert popped[0] == 0 and popped[1] > 50, out
    assert rows["sample16", "fresh"][0] > 90, out
    assert rows["sample16", "after churn"][0] > 90, out
    assert rows["sample16", "after churn, pages popped"][0] < rows["sample16", "after churn"][0], out
