"""Ranks of a tensor-parallel job running the same steps: rank 0 decides, the others follow.

Rank 0 owns everything that decides (the tree, pages, sampling, drafts, beam choices) and,
before it runs a step, broadcasts it: the :class:`~deft.engine.step.Step` as int64 arrays
over the group's host (gloo) channel, and the step's device tokens, if any, over its device
channel. Every other rank rebuilds the same step, plans its layout itself and runs it on
its heads, so no rank can choose a token, a draft or a beam of its own: the only input a
follower has is rank 0's step. The CUDA-graph bucket rank 0 runs goes with each step, and a
follower that would run another raises instead of replaying a different graph (which would
desynchronise the layers' all-reduces).

While rank 0 has no step to send, a heartbeat goes out every quarter of the collective
timeout, so an idle leader (a server waiting for requests) is never taken for a dead one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from ..distributed.group import TensorParallelError
from ..layout import trusted_layout
from .step import Step

__all__ = ["Leader", "receive"]

_I = np.int64
STOP, STEP, BEAT = 0, 1, 2
# op, bucket, nodes, kv tokens, queries, logits rows, moved tokens, device tokens, copies,
# copied rows in all
_HEADER = 10


def _encode(step: Step, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    lay, moved = step.layout, (np.empty((2, 0), _I) if step.device_tokens is None
                               else step.device_tokens[1])
    values = 0 if step.device_tokens is None else step.device_tokens[0].shape[0]
    copies = step.copies
    lens = np.array([len(s) for s, _ in copies], _I)
    parts = [lay.parents, lay.node_kv_indptr, lay.kv_indices, lay.query_nodes,
             lay.query_kv_lens, step.token_ids, step.positions, step.write_slots,
             step.logits_rows, moved.reshape(-1), lens,
             *(a for pair in copies for a in pair)]
    header = np.array([STEP, bucket, lay.parents.shape[0], lay.kv_indices.shape[0],
                       step.num_queries, step.logits_rows.shape[0], moved.shape[1], values,
                       len(copies), int(lens.sum())], _I)
    payload = np.concatenate([np.asarray(p, _I) for p in parts])
    return torch.from_numpy(header), torch.from_numpy(payload)


def _decode(header: np.ndarray, payload: np.ndarray, values: torch.Tensor | None
            ) -> tuple[Step, int]:
    _, bucket, nodes, kv, n, rows, moved, _, copies, copied = (int(x) for x in header)
    sizes = [nodes, nodes + 1, kv, n, n, n, n, n, rows, 2 * moved, copies]
    cuts = np.cumsum(sizes)
    a = np.split(payload[:cuts[-1]], cuts[:-1])
    pairs, at = [], int(cuts[-1])
    for length in a[10].tolist():
        pairs.append((payload[at:at + length], payload[at + length:at + 2 * length]))
        at += 2 * length
    layout = trusted_layout(*(x.copy() for x in a[:5]))  # rank 0's cache built it valid
    device_tokens = None if values is None else (values, a[9].reshape(2, moved))
    return Step(layout, a[5], a[6], a[7], a[8], device_tokens, tuple(pairs)), bucket


class Leader:
    """Rank 0's side: :meth:`send` each step before running it, :meth:`stop` at the end."""

    def __init__(self, tp: Any) -> None:
        self.tp = tp
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="deft-tp-heartbeat",
                                      daemon=True)
        self._beat.start()

    def send(self, step: Step, bucket: int) -> None:
        """Broadcast ``step`` (run in graph ``bucket``, 0: eagerly) to the other ranks."""
        header, payload = _encode(step, bucket)
        with self._lock:
            if self._stopped.is_set():
                raise TensorParallelError("tensor parallelism: the job was stopped; this "
                                          "engine can run no more steps")
            self._broadcast(header, "sending a step")
            self._broadcast(payload, "sending a step")
            if step.device_tokens is not None:
                values = step.device_tokens[0]
                self.tp.collective(lambda: _dist().broadcast(values, 0, group=self.tp.group),
                                   "sending the device tokens")
            self._last = time.monotonic()

    def stop(self) -> None:
        """Release the followers (they return from :func:`follow`); idempotent. Followers
        that are gone already need no release."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            header = torch.zeros(_HEADER, dtype=torch.int64)
            try:
                self._broadcast(header, "stopping the followers")
            except TensorParallelError:
                pass
        self._beat.join(timeout=self.tp.timeout_s)

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        self.tp.collective(lambda: _dist().broadcast(t, 0, group=self.tp.host_group), what)

    def _heartbeat(self) -> None:
        period = self.tp.timeout_s / 4
        while not self._stopped.wait(period / 4):
            with self._lock:
                if self._stopped.is_set() or time.monotonic() - self._last < period:
                    continue
                header = torch.zeros(_HEADER, dtype=torch.int64)
                header[0] = BEAT
                try:
                    self._broadcast(header, "sending a heartbeat")
                except TensorParallelError:
                    return  # the next step or stop reports it
                self._last = time.monotonic()


def receive(tp: Any, device: torch.device) -> tuple[Step, int] | None:
    """A follower's next step from rank 0 and the graph bucket rank 0 runs it in; ``None``
    when rank 0 stops the job."""
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64)
        tp.collective(lambda: _dist().broadcast(header, 0, group=tp.host_group),
                      "waiting for rank 0's next step")
        h = header.numpy()
        if h[0] == STOP:
            return None
        if h[0] == BEAT:
            continue
        nodes, kv, n, rows, moved, _, copies, copied = (int(x) for x in h[2:])
        size = 2 * nodes + 1 + kv + 5 * n + rows + 2 * moved + copies + 2 * copied
        payload = torch.empty(size, dtype=torch.int64)
        tp.collective(lambda: _dist().broadcast(payload, 0, group=tp.host_group),
                      "receiving a step")
        values = None
        if h[7]:
            values = torch.empty(int(h[7]), dtype=torch.int64, device=device)
            tp.collective(lambda: _dist().broadcast(values, 0, group=tp.group),
                          "receiving the device tokens")
        return _decode(h, payload.numpy(), values)


def _dist() -> Any:
    import torch.distributed as dist

    return dist
