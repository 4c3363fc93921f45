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
