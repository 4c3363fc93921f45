"""Exact merging of attention states ``(o, lse)`` over disjoint KV sets.

``lse = log(e^lse_a + e^lse_b)`` and ``o = (o_a e^lse_a + o_b e^lse_b) / e^lse``, computed
with the maximum subtracted. A state over an empty KV set has ``lse = -inf`` (and any
``o``); merging it changes nothing, and merging two empty states gives ``o = 0``,
``lse = -inf``. An ``lse`` of ``+inf`` or NaN is no state: the merge propagates NaN into
``o`` and ``lse``. Shapes: ``v [..., H, D]`` in any float dtype, ``s [..., H]`` float32.
"""

from __future__ import annotations

import torch

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


def _check_pair(v: torch.Tensor, s: torch.Tensor, vname: str, sname: str) -> None:
    if not isinstance(v, torch.Tensor) or not isinstance(s, torch.Tensor):
        raise TypeError(f"{vname}, {sname}: expected torch tensors")
    if v.dim() < 2 or tuple(v.shape[:-1]) != tuple(s.shape):
        raise ValueError(
            f"{sname}: expected shape {tuple(v.shape[:-1])} (the shape of {vname} without its "
            f"last dimension), got {tuple(s.shape)}"
        )
    if not v.is_floating_point() or not s.is_floating_point():
        raise TypeError(f"{vname}, {sname}: expected float tensors, got {v.dtype} and {s.dtype}")
    if v.device != s.device:
        raise ValueError(f"{sname}: expected device {v.device} like {vname}, got {s.device}")


def _check_same(a: torch.Tensor, b: torch.Tensor, aname: str, bname: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{bname}: expected shape {tuple(a.shape)} like {aname}, got {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{bname}: expected device {a.device} like {aname}, got {b.device}")


def _merge(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.float64 if torch.float64 in (v_a.dtype, s_a.dtype) else torch.float32
    s_a, s_b = s_a.to(acc), s_b.to(acc)
    m = torch.maximum(s_a, s_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)
    tot = w_a + w_b
    v = (_weighted(v_a, w_a, acc) + _weighted(v_b, w_b, acc)) / torch.where(
        tot == 0, torch.ones_like(tot), tot
    ).unsqueeze(-1)
    return v, m + torch.log(tot)


def _weighted(v: torch.Tensor, w: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``v * w`` with rows of weight 0 (empty states) contributing exactly 0, even if NaN.

    A NaN weight (from an lse of +inf or NaN) is not selected away: it makes the result NaN.
    """
    w = w.unsqueeze(-1)
    return torch.where(w == 0, torch.zeros((), dtype=acc, device=v.device), v.to(acc) * w)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states; returns ``(v, s)`` with ``v`` in ``v_a``'s dtype, ``s`` float32."""
    _check_pair(v_a, s_a, "v_a", "s_a")
    _check_pair(v_b, s_b, "v_b", "s_b")
    _check_same(v_a, v_b, "v_a", "v_b")
    v, s = _merge(v_a, s_a, v_b, s_b)
    return v.to(v_a.dtype), s.to(torch.float32 if s_a.dtype != torch.float64 else s_a.dtype)


def merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)``, overwriting ``v`` and ``s``."""
    _check_pair(v, s, "v", "s")
    _check_pair(v_other, s_other, "v_other", "s_other")
    _check_same(v, v_other, "v", "v_other")
    v_new, s_new = _merge(v, s, v_other, s_other)
    v.copy_(v_new)
    s.copy_(s_new)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` states per row: ``v [N, S, H, D]``, ``s [N, S, H]`` → ``[N, H, D]``, ``[N, H]``.

    On CUDA (head_dim up to 256) this runs the Triton merge kernel.
    """
    _check_pair(v, s, "v", "s")
    if v.dim() != 4:
        raise ValueError(f"v: expected 4 dimensions [N, S, H, D], got shape {tuple(v.shape)}")
    if v.is_cuda and v.dtype != torch.float64:
        from .ops.triton.backend import MAX_HEAD_DIM

        if v.shape[-1] <= MAX_HEAD_DIM:
            return _merge_states_triton(v, s)
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    s32 = s.to(acc)
    m = s32.amax(dim=1) if s.shape[1] else s32.new_full((s.shape[0], s.shape[2]), float("-inf"))
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(s32 - m.unsqueeze(1))  # [N, S, H]
    tot = w.sum(dim=1)
    num = _weighted(v, w, acc).sum(dim=1)
    out = num / torch.where(tot == 0, torch.ones_like(tot), tot).unsqueeze(-1)
    lse = m + torch.log(tot)
    return out.to(v.dtype), lse.to(torch.float32 if acc == torch.float32 else acc)


def _merge_states_triton(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU path of :func:`merge_states`: the triton backend's merge kernel over a dense CSR."""
    from .ops.triton.launch import launch_merge

    n, k, h, d = v.shape
    o = torch.empty(n, h, d, dtype=v.dtype, device=v.device)
    lse = torch.empty(n, h, dtype=torch.float32, device=v.device)
    indptr = torch.arange(0, n * k + 1, k, dtype=torch.int32, device=v.device)
    indices = torch.arange(n * k, dtype=torch.int32, device=v.device)
    launch_merge(v.reshape(n * k, h, d).contiguous(), s.reshape(n * k, h).float().contiguous(),
                 o, lse, indptr, indices)
    return o, lse
