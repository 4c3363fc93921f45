"""Where Triton kernels run, for the attention backend (:mod:`deft.ops.triton`) and the model's
kernels (:mod:`deft.model.fused`, :mod:`deft.model.skinny`): interpreted or compiled, the CUDA
capability, and programmatic dependent launch (PDL, sm_90+), with the step a chained kernel's
programs start with."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["interpreting", "capability", "has_pdl", "pdl_start"]


def _triton_interprets() -> bool:
    """Triton's own reading of ``TRITON_INTERPRET`` (it takes 1, true, on, yes)."""
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4 read only "1"
        return os.environ.get("TRITON_INTERPRET") == "1"
    return bool(knobs.runtime.interpret)


# Triton picks interpreted or compiled kernels when they are decorated (at import), so the
# mode is read once; planning asks for it several times per step.
_INTERPRETING = _triton_interprets()


def interpreting() -> bool:
    return _INTERPRETING


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``, asked once."""
    return torch.cuda.get_device_capability(device)


def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch exists from sm_90; the interpreter lacks ``griddepcontrol``."""
    return not interpreting() and device.type == "cuda" and capability(device)[0] >= 9


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A program's first step under programmatic dependent launch (``PDL``): let the next
    launch start, then wait until the previous launch has ended and its writes are visible.
    Every program waits before it reads or writes anything, so a launch ends after the one
    before it and each launch sees every earlier one's writes."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
