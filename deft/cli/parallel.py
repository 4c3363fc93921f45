"""``--tensor-parallel-size N`` (:func:`common.model_flags`) for the model commands: join
the ``torchrun`` job, load this rank's shard, and on ranks other than 0 run rank 0's steps
until it is done.

Every rank runs the same command line. Rank 0 does everything a one-device run does (and
alone prints); the others load their shard, build the same engine and follow rank 0's
steps, then exit 0 when rank 0's engine closes (at its exit).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import signal
import sys
from typing import Any

from . import common
from .common import CliError

__all__ = ["engine", "join", "leads", "load"]


def join(args: argparse.Namespace) -> Any:
    """This process's :class:`~deft.distributed.TPGroup` (``None`` on one device, outside
    ``torchrun``); ranks other than 0 print nothing on stdout from here on."""
    if "tp_group" in vars(args):
        return args.tp_group
    size = getattr(args, "tensor_parallel_size", 1)
    group = None
    if size != 1 or "WORLD_SIZE" in os.environ:
        from ..distributed import init_tensor_parallel

        try:
            group = init_tensor_parallel(size, args.device)
        except ValueError as exc:
            raise CliError(f"--tensor-parallel-size: {exc}") from exc
        atexit.register(group.close)  # after the engine's close (registered later, run first)
        if not group.leader:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    args.tp_group = group
    return group


def leads(args: argparse.Namespace) -> bool:
    """Whether this process decides: rank 0, or the only process."""
    tp = join(args)
    return tp is None or tp.leader


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model of ``--model`` and its tokenizer (:func:`common.load`); under tensor
    parallelism, this rank's shard of it."""
    tp = join(args)
    return common.load(args) if tp is None else common.load(args, tp)


def engine(args: argparse.Namespace, model: Any, tokenizer: Any, config: Any) -> Any:
    """The command's :class:`~deft.engine.TreeEngine` of ``config``. Under tensor
    parallelism, rank 0 gets it (its pages: the fewest any rank's memory allows) and the
    other ranks never return: they follow rank 0's steps, then exit 0 (a lost peer is a
    ``TensorParallelError``, which ``deft`` prints as one line, exit code 1)."""
    from ..engine import TreeEngine

    tp = join(args)
    if tp is None:
        return TreeEngine(model, tokenizer, config)
    config = dataclasses.replace(config, num_pages=tp.agree(config.num_pages, "agreeing on pages"))
    built = TreeEngine(model, tokenizer, config, tp_group=tp)
    if tp.leader:
        atexit.register(built.close)
        return built
    # Rank 0 decides when the job ends (a server drains first): a signal to the whole job
    # (Ctrl-C, torchrun passing on SIGTERM) must not end a follower before rank 0's stop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    built.follow()
    raise SystemExit(0)
