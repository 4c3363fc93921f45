"""The ``triton`` backend, split by job: :mod:`.configs` (the tuning table), :mod:`.kernels`
(``@triton.jit`` code only), :mod:`.launch` (per-layer launches), :mod:`.upload` (plan
uploads) and :mod:`.backend` (the :class:`~deft.ops.Backend` that plans and runs)."""

from .backend import TritonBackend
from .configs import KernelConfig, kernel_config
from .launch import launch_merge

__all__ = ["TritonBackend", "KernelConfig", "kernel_config", "launch_merge"]
