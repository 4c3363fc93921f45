"""The deft command, the demo, and the benchmark baselines (checked against the reference)."""

import re

import pytest
import torch

from benchmarks.baselines import flex_tree_attention, sdpa_per_query
from benchmarks.report import markdown_table
from benchmarks.trees import few_shot_layout, medusa_layout, shuffle_slots
from conftest import assert_close, random_qkv
from deft.cli import main
from deft.ops.reference import reference_attention


def test_demo_shows_exactness_and_io(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    err = float(re.search(r"max \|o - o_ref\| = (\S+),", out).group(1))
    assert err < 1e-5
    ratio = float(re.search(r"DeFT reads (\S+)x less KV", out).group(1))
    assert ratio == pytest.approx(20 * 4200 / 8000, abs=0.05)  # per-query reads 20 whole paths


def test_bench_plan_table(capsys):
    assert main(["bench", "plan", "--workload", "few-shot b=20", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "| few-shot b=20 | 21" in out.replace("  ", " ").replace("  ", " ")
    # The torch step, then the triton step columns: numpy and compiled planner both timed (CI
    # has triton and cc).
    row = [r for r in out.splitlines() if r.startswith("| few-shot")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 13 and all(float(c) > 0 for c in cells[-3:])


def test_bench_attention_cpu(capsys):
    assert main(["bench", "attention", "--device", "cpu", "--workload", "few-shot b=20",
                 "--no-flex", "--reps", "1"]) == 0
    row = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| few-shot")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[-1]) < 1e-4  # max |diff| between DeFT and the peers


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention", "--device", "tpu"])
    assert exc.value.code == 2
    assert main(["bench", "plan", "--workloads", "/no/such/dir"]) == 2
    assert "recorded workloads not found" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "attention", "--device", "cuda"]) == 2


@pytest.mark.parametrize("shuffled", [False, True])
def test_baselines_match_reference(shuffled):
    layout = medusa_layout([[0], [1], [0, 0], [0, 1], [1, 0]], 70)
    if shuffled:
        layout = shuffle_slots(layout, seed=2, num_slots=100)
    q, k, v = random_qkv(layout, 4, 2, 64, torch.float32)
    ref, _ = reference_attention(q, k, v, layout, 0.125)
    assert_close(sdpa_per_query(layout, q, k, v, 0.125)(), ref, torch.float32, "sdpa")
    assert_close(flex_tree_attention(layout, q, [k], [v], 0.125)(0), ref, torch.float32, "flex")


def test_markdown_table():
    table = markdown_table(["a", "bb"], [["x", 1.23456], ["yy", 12345.6]])
    assert table.splitlines() == ["| a  | bb     |", "| -- | ------ |", "| x  | 1.23   |", "| yy | 12,346 |"]


def test_few_shot_layout_shape():
    layout = few_shot_layout(40, 3, 5)
    assert layout.node_lens.tolist() == [40, 5, 5, 5] and layout.query_nodes.tolist() == [1, 2, 3]


class _FakeEngine:
    """What the e2e harness reads of an engine: no graphs to replay, its step counters and a
    runner whose ``run`` starts each step."""

    graphs = None

    def __init__(self):
        self.reset_stats()
        self.runner = _FakeRunner()

    def reset_stats(self):
        self.stats = dict(steps=0, plan_tokens=0, tokens=0, plan_s=0.0, graph_steps=0)


class _FakeRunner:
    def run(self, step):
        return step


def _e2e_runs(monkeypatch, engine, compiles_at, prefill_s=(0.0,), first_decode_s=0.0):
    """``run_workload`` stand-ins: a step per token, each of 20 ms, the first the prefill's;
    the runs' prefills take ``prefill_s`` more in turn (the prefill-only runs too), a full
    run's first decode step ``first_decode_s`` more, and the ``full`` runs whose (0-based)
    numbers are in ``compiles_at`` compile a kernel, as Triton reports one to its
    post-compile hook."""
    import time

    import triton

    import benchmarks.e2e_gpu as e2e

    calls = {"full": 0, "runs": 0}

    def run_workload(engine_, w, prompts, new_tokens, parents, trace):
        def run():
            if new_tokens > 1:
                if calls["full"] in compiles_at:
                    triton.knobs.runtime.jit_post_compile_hook(repr=f"k{calls['full']}")
                calls["full"] += 1
            prefill = prefill_s[calls["runs"] % len(prefill_s)]
            calls["runs"] += 1
            for i in range(new_tokens):
                # A step's layout is counted before its run, as the engine does; the runner
                # counts a graph step in it. A prefill plans longer and runs eagerly.
                engine_.stats["plan_s"] += 5.0 if i == 0 else 0.001
                engine_.runner.run(None)
                engine_.stats["graph_steps"] += i > 0
                time.sleep(0.02 + (prefill if i == 0 else first_decode_s if i == 1 else 0))
                engine_.stats["steps"] += 1
                engine_.stats["tokens"] += 1
            return new_tokens
        return run

    monkeypatch.setattr(e2e, "run_workload", run_workload)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return e2e, calls


def test_e2e_warm_up_repeats_until_nothing_compiles_and_times_again_after_a_compile(monkeypatch):
    import triton

    engine = _FakeEngine()
    e2e, calls = _e2e_runs(monkeypatch, engine, compiles_at={0, 2})
    said = []
    w = e2e.GpuWorkload("fake", "sample", 0, 1, 8)
    got = e2e._measure(engine, w, [[1]], None, None, said.append)
    # Warm rounds 1 (compiles) and 2 (quiet); timed full run 3 compiles, so it runs again.
    assert calls["full"] == 4
    assert len(said) == 1 and "compiled ['k2']" in said[0] and "timing again" in said[0]
    assert got["steps"] == 7 and got["ms_step"] > 0
    assert triton.knobs.runtime.jit_post_compile_hook is None  # the hook is given back


def test_e2e_refuses_timings_that_keep_compiling(monkeypatch):
    engine = _FakeEngine()
    e2e, _ = _e2e_runs(monkeypatch, engine, compiles_at=set(range(10)))
    with pytest.raises(RuntimeError, match="kept capturing graphs, compiling kernels"):
        e2e._measure(engine, e2e.GpuWorkload("fake", "sample", 0, 1, 8), [[1]], None, None)


def test_e2e_clocks_the_decode_steps_alone(monkeypatch):
    # The timed run's prefill takes 0.6 s more than the others' (its third run, after the
    # warm-up round's two), and its first decode step 0.2 s more than the other six: 46 ms a
    # step. A clock that subtracted the prefill-only run's time or started at the prefill
    # would take 0.6 s more (134 ms a step); one that started a step late, 17.
    engine = _FakeEngine()
    own = engine.runner.run = lambda step: step  # a runner's own ``run`` is given back
    e2e, calls = _e2e_runs(monkeypatch, engine, compiles_at=set(), prefill_s=(0, 0, 0.6),
                           first_decode_s=0.2)
    got = e2e._measure(engine, e2e.GpuWorkload("fake", "sample", 0, 1, 8), [[1]], None, None)
    assert got["steps"] == 7 and 45 <= got["ms_step"] < 100
    # The plan time and eager share of the decode steps alone, not the prefill's.
    assert got["plan_ms"] == pytest.approx(1.0) and got["host"] == 0
    assert calls["runs"] == 3  # one warm-up round of both runs, then the timed run
    assert vars(engine.runner)["run"] is own


@pytest.mark.parametrize("kind, width, parents, steps, queries, new", [
    ("sample", 2, None, 3, 2, 8),  # the first of 4 tokens comes from the prefill
    ("verify", 4, [-1, 0, 0, 1], 3, 4, 4),  # 4 verifications, the one-token run's first
    ("beam", 3, None, 3, 3, 4),
    ("greedy", 2, None, 3, 2, 8),  # two prompts
])
def test_e2e_measures_a_real_engine(monkeypatch, kind, width, parents, steps, queries, new):
    """The harness on a real (CPU) engine, 4 new tokens (verifications) after a 300-token
    prompt (two prefill steps of 256): the decode steps are those past a one-token run's,
    and a step's queries are theirs alone."""
    import benchmarks.e2e_gpu as e2e
    from deft.engine import TreeEngine
    from deft.model.synthetic import load_random

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    model, tok = load_random("random:tiny")
    engine = TreeEngine(model, tok, num_pages=128)
    w = e2e.GpuWorkload(kind, kind, 300, width, 4)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (2, 300), generator=gen).tolist()
    got = e2e._measure(engine, w, prompts, parents, None)
    assert (got["steps"], got["queries"], got["new"]) == (steps, queries, new)
    assert got["ms_step"] > 0 and "run" not in vars(engine.runner)
