"""Attention beyond one device, on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

:mod:`.kv_parallel`: KV-sequence parallelism, one tree's K/V spread over the ranks of a
group, each rank reading only its part; partial states merged exactly across ranks.
"""

from .kv_parallel import LayoutShard, partial_attention, shard_layout, tree_attention

__all__ = ["LayoutShard", "partial_attention", "shard_layout", "tree_attention"]
