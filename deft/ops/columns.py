"""A Triton helper shared by the attention kernels (:mod:`deft.ops.triton`) and the model's
fused kernels (:mod:`deft.model.fused`): blocks padded past a head's columns. Triton's blocks
span powers of two, so a head dim that is not one (Phi-3's 96) runs in a wider block whose
padding columns are masked at every load and store."""

import triton
import triton.language as tl

__all__ = ["head_cols"]


@triton.jit
def head_cols(mask, d, HEAD_D: tl.constexpr, D: tl.constexpr):
    """``mask`` over a block of head rows of ``D`` columns (``d``: their column offsets,
    broadcast like ``mask``), and where the head dim is padded to the power of two ``D``
    (``HEAD_D < D``) only the head's first ``HEAD_D`` columns: padding loads as 0 and is
    never stored. A head dim that is a power of two adds nothing."""
    if HEAD_D < D:
        return mask & (d < HEAD_D)
    else:
        return mask
