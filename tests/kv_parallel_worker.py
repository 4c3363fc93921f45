"""One rank of the KV-sequence-parallel check, launched by tests/test_kv_parallel.py under
``torchrun --standalone``: every rank builds the same random forests, holds only its shard of
the K/V, runs ``deft.distributed.tree_attention`` over gloo and compares every query with the
dense float64 reference. Exits 1 on a mismatch; else writes its summary line to the file
``rank<N>`` of ``$DEFT_KVP_OUT``."""

import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from conftest import random_forest, random_qkv
from deft.distributed import shard_layout, tree_attention
from deft.layout import TreeLayout
from deft.ops.reference import reference_attention


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(7)
    layouts = [random_forest(rng, int(rng.integers(1, 30)), 25, max_tokens=400) for _ in range(6)]
    # Queries on nodes with no tokens and roots held by one rank only: some see nothing
    # on some ranks (lse = -inf there).
    layouts.append(TreeLayout.from_node_lengths([-1, -1, 0, -1], [5, 0, 3, 40], [1, 2, 0, 3, 3],
                                                [0, 2, 5, 1, 40]))
    worst = 0.0
    for i, layout in enumerate(layouts):
        q, k, v = random_qkv(layout, 4, 2, 16, torch.float32, seed=i)
        shard = shard_layout(layout, world, rank)
        idx = torch.as_tensor(shard.slots)
        o, lse = tree_attention(q, k[idx], v[idx], shard, return_lse=True, backend="torch")
        ref_o, ref_lse = reference_attention(q.double(), k.double(), v.double(), layout, 16**-0.5)
        seen = torch.isfinite(ref_lse)
        if not torch.equal(torch.isfinite(lse), seen) or (o[~seen] != 0).any():
            print(f"rank {rank}: layout {i}: queries that see nothing differ", file=sys.stderr)
            return 1
        lse_err = (lse.double()[seen] - ref_lse[seen]).abs()
        worst = max(worst, (o.double() - ref_o).abs().max().item(),
                    lse_err.max().item() if lse_err.numel() else 0.0)
    dist.destroy_process_group()
    if worst > 1e-4:
        print(f"rank {rank}: max |error| {worst:.2e}", file=sys.stderr)
        return 1
    with open(os.path.join(os.environ["DEFT_KVP_OUT"], f"rank{rank}"), "w") as f:
        f.write(f"rank {rank} of {world}: {len(layouts)} layouts, max |error| {worst:.2e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
