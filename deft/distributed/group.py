"""The tensor-parallel group of a job: ranks, devices and the two process groups it uses.

:func:`init_tensor_parallel` joins the job ``torchrun`` started: NCCL for the device
collectives on CUDA (the layers' all-reduces, the device tokens of overlapped steps), gloo on
CPU; host messages (each step's layout and token ids) always go over a gloo group of their
own, so they never wait for the GPU. Every collective has a timeout: a rank that dies or
hangs ends the others with a :class:`TensorParallelError` within it, never a silent hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import positive_int

__all__ = ["DEFAULT_TIMEOUT_S", "TPGroup", "TensorParallelError", "init_tensor_parallel"]

DEFAULT_TIMEOUT_S = 300.0  # a collective waiting longer than this ends the job


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel job failed, hung, or disagrees with rank 0."""


@dataclass(frozen=True, eq=False)
class TPGroup:
    """This process's place in a tensor-parallel job.

    ``rank`` of ``world_size``; ``device`` holds this rank's shard of the weights and K/V;
    ``group`` carries the device collectives and ``host_group`` the host messages (both
    ``None`` when ``world_size == 1`` without a process group).
    """

    rank: int
    world_size: int
    device: torch.device
    group: Any = None
    host_group: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def leader(self) -> bool:
        """Whether this rank decides (rank 0: the scheduler, sampling, drafts, beams)."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place (the row-parallel projections' partial sums)."""
        if self.world_size > 1:
            self.collective(lambda: _dist().all_reduce(t, group=self.group), "summing a layer")
        return t

    def close(self) -> None:
        """Leave the job's process groups; idempotent. Call it before the process exits: one
        that exits with its gloo groups alive may abort in their destructors."""
        if self.world_size > 1 and _dist().is_initialized():
            _dist().destroy_process_group()

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if self.world_size == 1:
            return [value]
        got: list[Any] = [None] * self.world_size
        self.collective(lambda: _dist().all_gather_object(got, value, group=self.host_group),
                        f"gathering {what}")
        return got

    def same(self, value: Any, what: str) -> None:
        """Raise :class:`TensorParallelError` on every rank unless every rank's ``value``
        (picklable) equals rank 0's."""
        got = self.gather(value, what)
        bad = [r for r, v in enumerate(got) if v != got[0]]
        if bad:
            raise TensorParallelError(f"tensor parallelism: rank {bad[0]}'s {what} differs "
                                      f"from rank 0's: {got[bad[0]]!r} != {got[0]!r}")

    def agree(self, value: int, what: str) -> int:
        """The smallest of the ranks' ``value`` (e.g. the pages each device's memory allows)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.collective(lambda: _dist().all_reduce(t, op=_dist().ReduceOp.MIN,
                                                   group=self.host_group), what)
        return int(t.item())

    def collective(self, fn: Any, what: str) -> Any:
        """``fn()``, a collective; a peer's failure or a timeout as a :class:`TensorParallelError`."""
        try:
            return fn()
        except (RuntimeError, ConnectionError) as exc:
            if isinstance(exc, TensorParallelError):
                raise
            raise TensorParallelError(
                f"tensor parallelism: rank {self.rank} of {self.world_size} lost its peers while "
                f"{what} (a rank died, hung past the {self.timeout_s:g} s timeout, or the job "
                f"is being torn down): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from exc


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def init_tensor_parallel(size: int, device: str | torch.device = "auto",
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the tensor-parallel job of ``size`` ranks that ``torchrun --nproc-per-node size``
    started (``size == 1`` also runs without torchrun).

    ``device``: ``"auto"`` (``cuda:LOCAL_RANK`` when CUDA is available, else CPU), ``"cpu"``
    or ``"cuda"`` (this rank's GPU). Raises ``ValueError`` when the job's world size is not
    ``size`` or several ranks are asked for outside ``torchrun``, and ``ValueError`` for a
    CUDA device that is not there.
    """
    size = positive_int(size, "tensor_parallel_size")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        if size > 1:
            raise ValueError(f"tensor_parallel_size: {size} ranks need a launcher: run under "
                             f"torchrun --nproc-per-node {size} (e.g. torchrun --nproc-per-node "
                             f"{size} -m deft generate --tp {size} ...)")
        return TPGroup(0, 1, _device(device, 0), timeout_s=timeout_s)
    if int(world) != size:
        raise ValueError(f"tensor_parallel_size: expected the job's world size, {world} "
                         f"(torchrun --nproc-per-node), got {size}")
    dist = _dist()
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    dev = _device(device, local)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", timeout=timeout, device_id=dev)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    # A group of its own for host messages: a heartbeat may go out while the layers'
    # all-reduces run on the device group.
    host = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(dist.get_rank(), dist.get_world_size(), dev, dist.group.WORLD, host, timeout_s)


def _device(device: str | torch.device, local_rank: int) -> torch.device:
    kind = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                        if device == "auto" else device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: cuda asked for, but no CUDA device is available")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"device: rank {local_rank} needs GPU {local_rank}, but only "
                             f"{torch.cuda.device_count()} are visible")
        return torch.device("cuda", local_rank)
    if kind != "cpu":
        raise ValueError(f"device: expected auto, cpu or cuda, got {device!r}")
    return torch.device("cpu")
