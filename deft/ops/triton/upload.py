"""Host-to-device upload of the triton backend's packed plans, cheap on the host.

Every decode step packs its plan into an int32 host buffer and copies it to the device.
Allocating a pinned buffer, ``Tensor.copy_`` and a torch event per step cost more host
time than the step's plan; here each device keeps two host buffers that plans take in turns, and the copy
and its event are two calls into torch's CUDA runtime library. A buffer is refilled only
after its last copy ran (an event per buffer; on an idle GPU that costs no wait). The
buffers live as long as the process: torch's pinned allocator does not see these copies, so
it must never get a buffer back while one may be pending. Without the runtime library, for
a device other than the current one, or if a call fails, the copy falls back to
``Tensor.copy_`` with a torch event.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

__all__ = ["Staging", "staging"]

_DISABLE_TIMING = 2  # cudaEventDisableTiming
_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_REGISTRY: dict[torch.device, Staging] = {}
_REGISTRY_LOCK = threading.Lock()


class _Runtime(NamedTuple):
    """What plan uploads call of the CUDA runtime."""

    memcpy_async: Callable[..., int]  # cudaMemcpyAsync
    event_record: Callable[..., int]  # cudaEventRecord
    synchronize: Callable[[int], int]  # cudaEventSynchronize
    create_event: Callable[..., int]  # cudaEventCreateWithFlags
    clear_error: Callable[[], int]  # cudaGetLastError

    def copy(self, dst: int, src: int, nbytes: int, stream: int, event: int) -> bool:
        """An asynchronous host-to-device copy on ``stream``, then ``event`` recorded there;
        ``False`` (with the runtime's error cleared, so torch does not report it later) if
        either fails."""
        ok = (self.memcpy_async(dst, src, nbytes, _HOST_TO_DEVICE, stream) == 0
              and self.event_record(event, stream) == 0)
        if not ok:
            self.clear_error()
        return ok


@functools.cache
def _cudart() -> _Runtime | None:
    """torch's CUDA runtime library (``None`` for a CPU build or if it does not load)."""
    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        return None
    try:
        rt = ctypes.CDLL(f"libcudart.so.{major}")  # the copy torch has loaded
    except OSError:
        return None
    ptr = ctypes.c_void_p
    rt.cudaMemcpyAsync.argtypes = [ptr, ptr, ctypes.c_size_t, ctypes.c_int, ptr]
    rt.cudaEventRecord.argtypes = [ptr, ptr]
    rt.cudaEventSynchronize.argtypes = [ptr]
    rt.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ptr), ctypes.c_uint]
    return _Runtime(rt.cudaMemcpyAsync, rt.cudaEventRecord, rt.cudaEventSynchronize,
                    rt.cudaEventCreateWithFlags, rt.cudaGetLastError)


class Staging:
    """Two host buffers of one device that plans are packed into, in turns, and uploaded
    from (pinned for CUDA, so copies are asynchronous). Callers hold ``lock`` from
    :meth:`next` to :meth:`upload`. ``raw``: copy through the CUDA runtime (buffers that
    live as long as the process); otherwise through torch, whose pinned allocator then
    keeps a buffer until its copies ran (a host plan's own buffer, dropped with it)."""

    def __init__(self, device: torch.device, raw: bool = True) -> None:
        self.device, self.raw = device, raw
        self.lock = threading.Lock()
        self.turn = 0
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.pending: list[Any] = [None, None]  # event of each buffer's last copy, or None
        self.handles: list[int | None] = [None, None]  # a runtime event per buffer
        self.runtime: _Runtime | None = None  # what recorded the runtime events

    def next(self) -> torch.Tensor | None:
        """The next buffer in turn (``None`` before its first use), once its last copy ran."""
        self.turn ^= 1
        event, self.pending[self.turn] = self.pending[self.turn], None
        if isinstance(event, torch.cuda.Event):
            event.synchronize()
        elif event is not None:
            self.runtime.synchronize(event)
        return self.buffers[self.turn]

    def new(self, n: int) -> torch.Tensor:
        """A buffer of ``n`` elements and a quarter to spare, in place of the current one
        (whose last copy :meth:`next` waited for)."""
        buf = torch.empty(n + n // 4, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.buffers[self.turn] = buf
        return buf

    def header(self) -> np.ndarray:
        """The first ints of the current buffer, writable (a graph-safe plan's header)."""
        return self.buffers[self.turn][:16].numpy()

    def upload(self, dst: torch.Tensor, n: int, start: int = 0) -> None:
        """Copy ``n`` elements of the current buffer from ``start`` to ``dst``, ordered on
        the current stream of ``dst``'s device (asynchronous for CUDA)."""
        src = self.buffers[self.turn]
        assert src is not None, "upload() before next()/new()"
        if start:
            src = src[start:]
        if self.device.type != "cuda":
            dst[:n].copy_(src[:n])
            return
        rt = _cudart()
        # The runtime's calls act on the current device: its events are made there too.
        if (rt is not None and self.raw and self.device.index == torch.cuda.current_device()
                and dst.device == self.device):
            event = self._handle(rt)
            if event is not None and rt.copy(dst.data_ptr(), src.data_ptr(), 4 * n,
                                             torch._C._cuda_getCurrentRawStream(
                                                 self.device.index), event):
                self.pending[self.turn] = event
                self.runtime = rt
                return
        dst[:n].copy_(src[:n], non_blocking=True)  # on the current stream of dst's device
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dst.device))
        self.pending[self.turn] = event

    def _handle(self, rt: _Runtime) -> int | None:
        """This turn's runtime event, created on first use (``None`` if that fails)."""
        if self.handles[self.turn] is None:
            event = ctypes.c_void_p()
            if rt.create_event(ctypes.byref(event), _DISABLE_TIMING) != 0:
                rt.clear_error()  # else torch would report it at its next launch check
                return None
            self.handles[self.turn] = event.value
        return self.handles[self.turn]


def staging(device: torch.device) -> Staging:
    """The process's staging buffers of ``device`` (with its index for CUDA)."""
    found = _REGISTRY.get(device)
    if found is None:
        with _REGISTRY_LOCK:
            found = _REGISTRY.setdefault(device, Staging(device))
    return found
