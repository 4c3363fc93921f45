"""DeFT beyond one device, on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

:mod:`.group`: a tensor-parallel job's ranks (:func:`init_tensor_parallel`, :class:`TPGroup`):
each rank loads its shard of the weights (``load_model(..., tp=group)``) and runs every
step rank 0 decides (``TreeEngine(..., tp_group=group)``). :mod:`.kv_parallel`:
KV-sequence parallelism, one tree's K/V spread over the ranks of a group, each rank reading
only its part; partial states merged exactly across ranks.
"""

from .group import DEFAULT_TIMEOUT_S, TensorParallelError, TPGroup, init_tensor_parallel
from .kv_parallel import LayoutShard, partial_attention, shard_layout, tree_attention

__all__ = ["DEFAULT_TIMEOUT_S", "LayoutShard", "TPGroup", "TensorParallelError",
           "init_tensor_parallel", "partial_attention", "shard_layout", "tree_attention"]
