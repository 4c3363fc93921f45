"""Layouts from the recorded workloads (../shared/workloads) against the dense reference."""

import numpy as np
import pytest
import torch

from benchmarks.trees import medusa_layout, reasoning_layout, shuffle_slots
from conftest import assert_close, assert_lse_close, random_qkv
from deft import PLAN_KINDS, TreeAttention
from deft.ops.reference import reference_attention
from deft.recorded import load_medusa_choices


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
