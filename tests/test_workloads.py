"""Layouts from the recorded workloads (../shared/workloads) against the dense reference, and
finding the workloads from any working directory."""

import json
import re

import numpy as np
import pytest
import torch

from benchmarks.trees import medusa_layout, reasoning_layout, shuffle_slots
from conftest import assert_close, assert_lse_close, random_qkv
import deft.cli.common as cli_common
import deft.recorded as recorded
from deft import PLAN_KINDS, TreeAttention
from deft.cli import main
from deft.cli.demo import reasoning_trace
from deft.ops.reference import reference_attention
from deft.recorded import load_medusa_choices, workloads_dir
from strategies_on_device import write_trace


@pytest.mark.parametrize("task", ["sorting128ToT", "docmergeToT", "keywordToT"])
def test_reasoning_snapshot(workloads, task):
    layout = reasoning_layout(workloads / "deft" / "reasoning" / f"{task}.json")
    assert layout.num_queries > 1 and layout.num_nodes > layout.num_queries
    check(shuffle_slots(layout, seed=5), torch.float16)


@pytest.mark.parametrize("source", ["medusa/mc_sim_7b_63.json", "deft/speculative/APPS_tree_size64.json"])
def test_medusa_tree(workloads, source):
    choices = load_medusa_choices(workloads / source)
    layout = medusa_layout(choices, prompt_len=300)
    assert layout.num_queries == len(choices) + 1
    check(layout, torch.float32)


def test_reasoning_snapshot_shape(workloads):
    # Record 0 of sorting128ToT at iteration 1: the prompt and its 10 first thoughts, 1 token each.
    layout = reasoning_layout(workloads / "deft" / "reasoning" / "sorting128ToT.json", 0, 1)
    assert layout.num_queries == 10
    assert layout.node_lens.tolist() == [1104] + [1] * 10
    assert np.all(layout.parents[1:] == 0)


def check(layout, dtype):
    q, k, v = random_qkv(layout, 8, 2, 64, dtype)
    ref_o, ref_lse = reference_attention(q, k, v, layout, 0.125)
    for kind in PLAN_KINDS:
        attn = TreeAttention(8, 2, 64, backend="torch", plan_kind=kind)
        attn.plan(layout)
        o, lse = attn.run(q, k, v, return_lse=True)
        assert_close(o, ref_o, dtype, kind)
        assert_lse_close(lse, ref_lse, kind)


# ------------------------------------------------ finding them from any working directory


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory with no workloads beside it, and no DEFT_WORKLOADS."""
    monkeypatch.delenv("DEFT_WORKLOADS", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_found_beside_the_checkout_from_any_directory(elsewhere):
    beside = recorded._CHECKOUT.parent / "shared" / "workloads"
    if not beside.is_dir():
        pytest.skip(f"no recorded workloads beside this checkout ({beside})")
    assert workloads_dir() == beside


def test_absent_workloads_name_each_place_once(elsewhere, monkeypatch):
    checkout = elsewhere / "repo"
    checkout.mkdir()
    monkeypatch.setattr(recorded, "_CHECKOUT", checkout)
    monkeypatch.chdir(checkout)  # the checkout and the working directory share ../shared
    with pytest.raises(FileNotFoundError) as exc:
        workloads_dir()
    place = str(elsewhere / "shared" / "workloads")
    assert str(exc.value).count(place) == 1 and "set DEFT_WORKLOADS" in str(exc.value)
    monkeypatch.setenv("DEFT_WORKLOADS", str(elsewhere / "nope"))
    with pytest.raises(FileNotFoundError, match=f"DEFT_WORKLOADS={re.escape(str(elsewhere / 'nope'))} is not a"):
        workloads_dir()


def test_replay_and_demo_say_when_workloads_are_absent(elsewhere, monkeypatch, capsys):
    monkeypatch.setattr(recorded, "_CHECKOUT", elsewhere / "repo")
    assert main(["replay", "keywordToT"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deft replay: error: TRACE 'keywordToT': a task name needs the "
                                                   "recorded workloads, and recorded workloads not found (tried ")
    assert reasoning_trace(None) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: the reasoning-trace replay is skipped: recorded "
                                                   "workloads not found (tried ")


def test_replay_a_task_by_name_from_any_directory(elsewhere, monkeypatch, capsys, smol):
    reasoning = elsewhere / "w" / "deft" / "reasoning"
    reasoning.mkdir(parents=True)
    write_trace(reasoning / "tiny.json")
    monkeypatch.setenv("DEFT_WORKLOADS", str(elsewhere / "w"))
    monkeypatch.setattr(cli_common, "load", lambda args: smol)
    assert main(["replay", "tiny", "--iterations", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iterations"] == 2
    assert main(["replay", "huge"]) == 2
    assert capsys.readouterr().err == f"deft replay: error: TRACE 'huge': no such task in {reasoning} (there: tiny)\n"
