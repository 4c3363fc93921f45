"""Small host tables sent to the device mid-step without waiting for it: a plain
host-to-CUDA copy synchronises the stream, so the host would wait for the forward in flight
(and an overlapped step would lose its overlap); a copy from pinned memory does not."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``: through pinned memory, asynchronously, on CUDA; ``t``
    itself elsewhere."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
