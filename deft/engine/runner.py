"""One device's execution of steps: the only code of the engine that touches device memory.

A :class:`ModelRunner` owns, for one model on one device, the K/V pool (in the format of
its :class:`~deft.KVSpec`), the step's :class:`~deft.TreeAttention` and the CUDA graphs of
:mod:`.graphs`. ``run(step)`` applies the step's slot copies, plans its layout (into a
graph bucket when one holds it), moves its inputs to the device and returns the logits of
its wanted rows. It makes no decoding decision: that is the engine's and the strategies'.

Under tensor parallelism (``tp``, a :class:`~deft.distributed.TPGroup`) each rank has a
runner of its shard of the model: rank 0's broadcasts every step before running it
(:mod:`.lockstep`), the others :meth:`~ModelRunner.follow`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from ..cache.pool import KVPool, KVSpec
from ..distributed.group import TensorParallelError
from ..model.contract import DecoderModel, check_decoder
from .config import EngineConfig
from .graphs import StepGraphs, put_device_ids
from .lockstep import Leader, receive
from .step import Step

__all__ = ["ModelRunner", "STAT_KEYS"]

# The counters of TreeEngine.stats; the runner keeps those of planning and device work.
STAT_KEYS = ("steps", "tokens", "logit_rows", "forward_s", "plan_s", "graph_steps",
             "plan_tokens", "kv_bytes_deft", "kv_bytes_per_branch", "io_s")


class ModelRunner:
    """``model`` on ``config.device`` (the model's by default) as ``config`` says: pool,
    attention and step graphs.

    ``stats`` (a dict of :data:`STAT_KEYS`) gains, per :meth:`run`, ``plan_s``,
    ``graph_steps``, ``plan_tokens`` and, with ``config.count_io``, ``kv_bytes_deft``,
    ``kv_bytes_per_branch`` and ``io_s`` (while ``count_io``, ``config.count_io`` at first).
    ``tp``: the tensor-parallel group ``model`` is this rank's shard for (every rank must
    build its runner with the same ``config``).
    """

    def __init__(self, model: DecoderModel, config: EngineConfig,
                 stats: dict[str, Any] | None = None, tp: Any = None) -> None:
        self.model = check_decoder(model)
        if getattr(model, "tp", None) is not tp:
            raise ValueError("model: not the shard of this tensor-parallel group (load it with "
                             "load_model(..., tp=group) and build the engine with the same group)"
                             if tp is not None else
                             "model: a tensor-parallel shard; build the engine with its group "
                             "(tp_group=...)")
        self.device = model.device if config.device is None else config.device
        if self.device.type != model.device.type:
            raise ValueError(f"device: expected the model's device {model.device}, got {self.device}")
        self.config = config
        self.attn = model.attention(device=self.device, backend=config.backend,
                                    plan_kind=config.plan_kind)
        graph_safe = self.attn.graph_safe
        cuda_graphs = config.cuda_graphs
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and graph_safe and _same_heads(model, tp)
        elif cuda_graphs and (self.device.type != "cuda" or not graph_safe):
            raise ValueError(f"cuda_graphs: needs a CUDA device and a graph-safe backend, got "
                             f"{self.device} and {self.attn.backend_name!r}")
        elif cuda_graphs and not _same_heads(model, tp):
            raise ValueError("cuda_graphs: the tensor-parallel ranks hold different numbers of "
                             "heads (an uneven split), so their plans, and when their graphs "
                             "are captured again, differ; run them eagerly")
        layers, kv_heads, head_dim = model.kv_shape
        spec = config.kv if config.kv is not None else KVSpec(model.dtype)
        self.attn.check_kv(spec.dtype, model.dtype, spec.scaled)  # before any pool memory
        # A graph bucket's padding writes into one more page, which the cache never hands out.
        self.pool = KVPool(layers, config.num_pages + bool(cuda_graphs), config.page_size,
                           kv_heads, head_dim, device=self.device, spec=spec)
        self.graphs = (StepGraphs(model, self.pool, config.num_pages * config.page_size,
                                  config.graph_buckets, self.attn.backend_name,
                                  config.plan_kind, self.device)
                       if cuda_graphs else None)
        self.stats = dict.fromkeys(STAT_KEYS, 0) if stats is None else stats
        self.count_io = config.count_io
        self.tp = tp
        self._leader: Leader | None = None
        if tp is not None and tp.world_size > 1:
            tp.same(repr(dataclasses.replace(config, device=None)), "engine configuration")
            if tp.leader:
                self._leader = Leader(tp)

    @property
    def following(self) -> bool:
        """Whether this runner runs rank 0's steps (a tensor-parallel rank other than 0)."""
        return self.tp is not None and not self.tp.leader

    def bucket_of(self, step: Step) -> int:
        """The query count of the CUDA-graph bucket ``step`` replays in (0: eagerly)."""
        # Scales are calibrated by an eager step's writes; graphs then read them as they are.
        if self.graphs is None or not self.pool.calibrated:
            return 0
        return self.graphs.bucket(step.num_queries) or 0

    def follow(self) -> int:
        """Run rank 0's steps until it stops the job; returns the steps run. Only on a
        tensor-parallel rank other than 0."""
        if not self.following:
            raise RuntimeError("follow: only tensor-parallel ranks other than 0 follow; "
                               "rank 0 runs its steps itself")
        steps = 0
        with torch.no_grad():
            while (got := receive(self.tp, self.device)) is not None:
                step, bucket = got
                mine = self.bucket_of(step)
                if mine != bucket:
                    raise TensorParallelError(
                        f"tensor parallelism: rank {self.tp.rank} would run a step of "
                        f"{step.num_queries} queries in graph bucket {mine} where rank 0 runs "
                        f"bucket {bucket} (0: eager); every rank must replay the same graph")
                self.run(step)
                steps += 1
        return steps

    def close(self) -> None:
        """Rank 0: release the followers (their :meth:`follow` returns); else nothing."""
        if self._leader is not None:
            self._leader.stop()

    def run(self, step: Step) -> torch.Tensor:
        """Float32 logits ``[len(step.logits_rows), vocab]`` of ``step``, queued on the
        device's current stream (nothing waits for them). Rank 0 of a tensor-parallel group
        first sends the step to the other ranks."""
        replayed = self.bucket_of(step)
        if self._leader is not None:
            self._leader.send(step, replayed)
        for src, dst in step.copies:
            self.copy_slots(src, dst)
        t0 = time.perf_counter()
        bucket = self.graphs.plan(step.layout) if replayed else None
        plan = self.attn.plan(step.layout, self.pool.dtype) if bucket is None else None
        self.stats["plan_s"] += time.perf_counter() - t0
        with torch.no_grad():
            if bucket is not None:
                out = self.graphs.replay(bucket, step)
            else:
                # Copies that do not wait for the GPU: a step may be queued behind the last.
                ids, pos, slots, rows = (torch.from_numpy(a).to(self.device, non_blocking=True)
                                         for a in (step.token_ids, step.positions,
                                                   step.write_slots, step.logits_rows))
                if step.device_tokens is not None:
                    put_device_ids(ids, *step.device_tokens)
                out = self.model(ids, pos, slots, self.attn, self.pool, rows)
        st = self.stats
        st["graph_steps"] += bucket is not None
        if bucket is None:
            st["plan_tokens"] += plan.num_plan_tokens
        else:  # without the padding's scratch token
            st["plan_tokens"] += (bucket.step_attn.current_plan.num_plan_tokens
                                  - (bucket.queries > step.num_queries))
        if self.count_io:
            self._count_io(step, plan)
        return out.float()

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy K/V rows ``src`` to ``dst`` in every layer (rows a committed path moved)."""
        self.pool.copy_slots(torch.as_tensor(src, device=self.device),
                             torch.as_tensor(dst, device=self.device))

    def _count_io(self, step: Step, plan: Any) -> None:
        """K/V bytes the step reads under its plan and under per-branch decoding."""
        t0, c = time.perf_counter(), self.model.config
        heads = (c.num_heads, c.num_kv_heads, c.head_dim, self.pool.k[0].element_size())
        if plan is None:  # the graph's plan counts its padding
            plan = self.attn.make_plan(step.layout)
        per_branch = self.attn.make_plan(step.layout, "per_query")
        st = self.stats
        st["kv_bytes_deft"] += plan.io_bytes(*heads)["kv"] * c.num_layers
        st["kv_bytes_per_branch"] += per_branch.io_bytes(*heads)["kv"] * c.num_layers
        st["io_s"] += time.perf_counter() - t0


def _same_heads(model: DecoderModel, tp: Any) -> bool:
    """Whether every tensor-parallel rank's shard has this one's head counts (a collective;
    true on one device). Planning depends on them, and so does when a CUDA graph outgrows
    its plan buffers and is captured again: a capture runs the layers' all-reduces, so the
    ranks must capture together."""
    if tp is None:
        return True
    c = model.config
    return len(set(tp.gather((c.num_heads, c.num_kv_heads), "head counts"))) == 1
