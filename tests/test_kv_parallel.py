"""KV-sequence parallelism (``deft.distributed``): shards cover the tree's tokens once and
their merged partial states equal the dense float64 reference, in one process for many world
sizes and under ``torchrun`` over gloo with 2 and 3 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import random_forest, random_qkv
from deft import merge_states
from deft.distributed import partial_attention, shard_layout
from deft.ops.reference import reference_attention

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_merged_shards_equal_the_reference(world):
    rng = np.random.default_rng(world)
    for trial in range(8):
        layout = random_forest(rng, int(rng.integers(1, 25)), 30, max_tokens=300)
        q, k, v = random_qkv(layout, 4, 2, 16, torch.float32, seed=trial)
        shards = [shard_layout(layout, world, r) for r in range(world)]
        held = np.concatenate([s.slots for s in shards])
        assert sorted(held.tolist()) == sorted(layout.kv_indices.tolist())  # each token once
        sizes = [s.slots.shape[0] for s in shards]
        assert max(sizes) - min(sizes) <= 1  # balanced
        states = [partial_attention(q, k[torch.as_tensor(s.slots)], v[torch.as_tensor(s.slots)],
                                    s, backend="torch") for s in shards]
        o, lse = merge_states(torch.stack([s[0] for s in states], 1),
                              torch.stack([s[1] for s in states], 1))
        ref_o, ref_lse = reference_attention(q.double(), k.double(), v.double(), layout, 16**-0.5)
        torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=2e-5, rtol=2e-5)


def test_bad_shards_are_refused():
    layout = random_forest(np.random.default_rng(0), 3, 5, max_tokens=20)
    with pytest.raises(ValueError, match="rank: expected an integer in \\[0, 1\\], got 2"):
        shard_layout(layout, 2, 2)
    shard = shard_layout(layout, 2, 0)
    q, k, v = random_qkv(layout, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=f"k_shard: expected \\[{shard.slots.shape[0]}, H_kv, D\\]"):
        partial_attention(q, k, v, shard)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        from deft.distributed import tree_attention

        tree_attention(q, k, v, shard)


@pytest.mark.parametrize("ranks", [2, 3])
def test_torchrun_gloo_ranks_equal_the_reference(ranks, tmp_path):
    env = {**os.environ, "DEFT_KVP_OUT": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent),
                                                        os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(ranks), str(TESTS / "kv_parallel_worker.py")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = [(tmp_path / f"rank{r}").read_text() for r in range(ranks)]
    assert [line.split(":")[0] for line in lines] == [f"rank {r} of {ranks}" for r in range(ranks)]
