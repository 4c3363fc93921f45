"""Whole decode steps replayed as CUDA graphs, one per bucket of query counts.

A step of ``n`` queries runs in the smallest bucket ``Q >= n``. Its layout is padded with
``Q - n`` queries on a one-token scratch node (a slot of the pool's extra page, which the
cache never hands out), so every step of a bucket has ``Q`` queries: it plans into the
fixed buffers of the bucket's graph-safe :class:`~deft.TreeAttention` (``capacity``),
writes its token ids, positions, slots and logits rows into static device buffers, and
replays the forward captured once per count of logits rows (embedding, every layer, final
norm, LM head on the wanted rows, their count rounded up to a power of two). The padding queries write their K/V to the scratch slot and see only it, so
they touch nothing a real query reads.

A step that outgrows a bucket's reserved plan tokens or partial states rebuilds the bucket
with room to spare and captures again (a few times per generation: the capacities grow
geometrically). On a device without CUDA graphs the same padded steps run eagerly, which
is how the CPU tests check everything but the capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..attention import TreeAttention
from ..cache.pool import KVPool
from ..layout import TreeLayout, trusted_layout
from ..model.contract import DecoderModel
from ..ops import Capacity, CapacityError
from .config import DEFAULT_BUCKETS
from .step import Step

__all__ = ["StepGraphs", "put_device_ids"]

_HEADROOM = 1.25  # capacities reserved beyond a step's needs, before rounding up to 2^k
_MIN_TOKENS = 2048
_I = np.int64


def _room(n: int, floor: int) -> int:
    """The power of two at least ``_HEADROOM * n`` and ``floor``."""
    return 1 << (max(int(n * _HEADROOM), floor) - 1).bit_length()


@dataclass
class _Bucket:
    """The fixed state of one query count: attention buffers, static inputs, graphs."""

    queries: int
    attn: TreeAttention
    inputs: torch.Tensor  # [4, Q] int64: token ids, positions, slots, logits rows
    # The same capacity reserved for the backend's other builds (``Capacity.build``), each
    # made when a step first asks for it, and the build the last step runs.
    builds: dict[str, TreeAttention] = field(default_factory=dict)
    use: str = "default"
    graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = (
        field(default_factory=dict))  # by (logits rows computed, use): (graph, its output)

    @property
    def step_attn(self) -> TreeAttention:
        """The attention the last step planned into."""
        return self.attn if self.use == "default" else self.builds[self.use]


class StepGraphs:
    """The engine's graph-replayed steps: :meth:`plan` a step into its bucket, :meth:`replay` it.

    ``model`` and ``pool`` are the engine's; ``scratch_slot`` is a pool slot no cache node
    uses; ``buckets`` the query counts that get graphs (steps beyond the largest run
    eagerly). ``backend`` must be graph-safe; ``plan_kind`` is the attention's.
    ``captures`` counts the graphs captured, ``rebuilds`` the buckets a step outgrew.
    """

    def __init__(self, model: DecoderModel, pool: KVPool, scratch_slot: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, backend: str = "triton",
                 plan_kind: str = "flatten", device: torch.device | None = None) -> None:
        self.model, self.pool, self.backend, self.plan_kind = model, pool, backend, plan_kind
        self.scratch_slot = int(scratch_slot)
        self.device = model.device if device is None else torch.device(device)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets: expected positive query counts, got {tuple(buckets)}")
        self.capture = self.device.type == "cuda"
        self._buckets: dict[int, _Bucket] = {}
        self._bound = model.attention(device=self.device, backend=backend, plan_kind=plan_kind)
        self.captures = self.rebuilds = 0
        self.last_graph: torch.cuda.CUDAGraph | None = None  # the last replayed (benchmarks time it)

    def bucket(self, n: int) -> int | None:
        """The query count of the bucket a step of ``n`` queries runs in, or ``None``."""
        for q in self.buckets:
            if q >= n:
                return q
        return None

    def plan(self, layout: TreeLayout) -> _Bucket | None:
        """Plan a step of ``layout``'s queries into its bucket (padded); ``None`` when it has
        more queries than the largest bucket (plan and run it eagerly instead)."""
        n = layout.num_queries
        q = self.bucket(n)
        if q is None:
            return None
        padded = _pad(layout, q - n, self.scratch_slot)
        b = self._buckets.get(q)
        if b is not None:
            try:
                self._plan_into(b, padded)
                return b
            except CapacityError:
                self.rebuilds += 1
        b = self._buckets[q] = self._new_bucket(q, padded, b.attn.capacity if b else None)
        return b

    def _plan_into(self, b: _Bucket, padded: TreeLayout) -> None:
        """Plan ``padded`` into ``b.attn``, then into the bucket's attention of another build
        when its tree asks for one (``TreeAttention.build``, read from the default build's
        plan: which kernels a step runs depends on its tree alone; the eager engine picks
        alike). :class:`CapacityError` if either plan outgrows the bucket."""
        b.use = "default"
        b.attn.plan(padded, self.pool.dtype)
        build = b.attn.build
        if build == "default":
            return
        attn = b.builds.get(build)
        if attn is None:
            attn = b.builds[build] = self.model.attention(
                device=self.device, backend=self.backend, plan_kind=self.plan_kind,
                capacity=b.attn.capacity._replace(build=build))
        attn.plan(padded, self.pool.dtype)
        b.use = build

    def replay(self, b: _Bucket, step: Step) -> torch.Tensor:
        """Logits ``[len(step.logits_rows), vocab]`` of ``step``, planned into ``b`` by
        :meth:`plan`."""
        n, rows = step.num_queries, step.logits_rows
        host = np.zeros((4, b.queries), _I)
        host[0, :n], host[1, :n], host[2, :n] = step.token_ids, step.positions, step.write_slots
        host[2, n:] = self.scratch_slot
        host[3, :len(rows)] = rows
        b.inputs.copy_(torch.from_numpy(host), non_blocking=True)
        if step.device_tokens is not None:
            put_device_ids(b.inputs[0], *step.device_tokens)
        r = len(rows)
        out = self._forward(b, 0 if r == 0 else min(1 << (r - 1).bit_length(), b.queries))
        return out[:r].clone()

    def _new_bucket(self, q: int, layout: TreeLayout, old: Capacity | None) -> _Bucket:
        """A bucket of ``q`` queries with room for ``layout`` (planned into it) and more, and
        at least the ``old`` bucket's capacity (so rebuilds only ever grow it)."""
        m = self.model
        bound = self._bound.make_plan(layout)
        # The uncoarsened plan's partials bound the coarsened plan's.
        tokens, partials = bound.num_plan_tokens, bound.num_partials
        if old is not None:
            tokens, partials = max(tokens, old.tokens), max(partials, old.partials)
        inputs = torch.zeros((4, q), dtype=torch.int64, device=self.device)
        while True:
            b = _Bucket(q, m.attention(device=self.device, backend=self.backend,
                                       plan_kind=self.plan_kind, capacity=Capacity(
                q, _room(tokens, _MIN_TOKENS), _room(partials, 4 * q))), inputs)
            try:
                self._plan_into(b, layout)
                return b
            except CapacityError as exc:  # a count derived from both: grow both
                tokens, partials = 2 * tokens, 2 * partials
                if exc.what == "plan tokens":
                    tokens = max(tokens, exc.needed)

    def _forward(self, b: _Bucket, logits: int) -> torch.Tensor:
        """Replay (capturing first if needed) the bucket's forward with ``logits`` rows of
        logits; its output buffer."""
        key = (logits, b.use)
        graph, out = b.graphs.get(key, (None, None))
        if not self.capture:
            return self._model_step(b, logits, captured=False)
        if graph is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # A warm-up launching what the capture launches: every kernel it needs is
            # compiled and loaded outside the capture.
            with torch.cuda.stream(stream):
                self._model_step(b, logits, captured=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # a private pool: a rebuilt bucket frees its graphs
                out = self._model_step(b, logits, captured=True)
            b.graphs[key] = (graph, out)
            self.captures += 1
        graph.replay()
        self.last_graph = graph
        return out

    def _model_step(self, b: _Bucket, logits: int, captured: bool) -> torch.Tensor:
        ids, pos, slots, rows = b.inputs
        return self.model(ids, pos, slots, b.step_attn, self.pool, rows[:logits],
                          captured=captured)


def put_device_ids(ids: torch.Tensor, values: torch.Tensor, moved: np.ndarray) -> None:
    """``ids[moved[0]] = values[moved[1]]`` on the device, in the stream's order (no sync)."""
    index = torch.from_numpy(moved).to(ids.device, non_blocking=True)
    ids[index[0]] = values[index[1]]


def _pad(layout: TreeLayout, extra: int, scratch_slot: int) -> TreeLayout:
    """``layout`` with one more root holding ``scratch_slot`` and ``extra`` queries on it."""
    if extra == 0:
        return layout
    nodes, indptr = layout.parents.shape[0], layout.node_kv_indptr
    return trusted_layout(  # a valid layout and one more root: valid
        np.append(layout.parents, -1), np.append(indptr, indptr[-1] + 1),
        np.append(layout.kv_indices, scratch_slot),
        np.concatenate([layout.query_nodes, np.full(extra, nodes, _I)]),
        np.concatenate([layout.query_kv_lens, np.ones(extra, _I)]))
