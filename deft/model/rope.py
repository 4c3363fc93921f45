"""Rotate-half rotary position embedding with Llama 3 / linear / LongRoPE frequency scaling; a
config with ``local_rope_layers`` has a second table for them (Gemma 3's sliding-window layers)."""

from __future__ import annotations

import math

import torch

from .config import LlamaConfig, RopeScaling

__all__ = ["rope_inv_freq", "rope_table", "identity_table", "apply_rope"]


def _rope(config: LlamaConfig, local: bool) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` of the config's RoPE, or of its ``local_rope_layers``'."""
    return ((config.local_rope_theta, config.local_rope_scaling) if local
            else (config.rope_theta, config.rope_scaling))


def rope_inv_freq(config: LlamaConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` float32 on the CPU, scaled as the config says
    (``local``: those of the ``local_rope_layers``)."""
    d = config.rope_dim
    theta, s = _rope(config, local)
    arange = torch.arange(0, d, 2, dtype=torch.int64, device="cpu")
    powers = theta ** (arange.float() / d)
    if s is not None and s.kind == "longrope":  # one division, rounded as transformers rounds it
        powers = torch.tensor(s.short_factor, dtype=torch.float32, device="cpu") * powers
    inv = 1.0 / powers
    if s is not None and s.kind == "linear":
        inv = inv / s.factor
    elif s is not None and s.kind == "llama3":
        old_len = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / s.low_freq_factor, inv / s.factor, inv)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= old_len / s.high_freq_factor) & (wavelen <= old_len / s.low_freq_factor)
        inv = torch.where(medium, smoothed, scaled)
    if config.rope_freq_factors is not None and not local:
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
    return inv


def rope_table(
    config: LlamaConfig, dtype: torch.dtype, device: str | torch.device = "cpu", local: bool = False
) -> torch.Tensor:
    """``[max_position_embeddings, rope_dim]``: cos of every angle, then sin, each times the
    scaling's ``attention_factor``, in ``dtype`` (``local``: of the ``local_rope_layers``' RoPE).

    Angles are computed in float32 (like the reference implementation) and only then
    rounded, so a bf16/fp16 table loses no positional precision.
    """
    inv_freq = rope_inv_freq(config, local)
    if torch.device(device).type == "meta":  # a model built before its weights: shape only
        return torch.empty(config.max_position_embeddings, 2 * inv_freq.numel(), dtype=dtype,
                           device="meta")
    # Built on the CPU whatever the default device, then moved.
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
    angles = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    s = _rope(config, local)[1]
    scale = 1.0 if s is None else s.attention_factor
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * scale).to(device=device, dtype=dtype)


def identity_table(config: LlamaConfig, dtype: torch.dtype,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """A table like :func:`rope_table`'s whose rotation is the identity (cos 1, sin 0): the
    fused RoPE write of ``nope_layers`` (exact for finite q and k)."""
    half = config.rope_dim // 2
    row = torch.cat([torch.ones(half), torch.zeros(half)]).to(dtype)
    return row.expand(config.max_position_embeddings, -1).to(device).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, H, D]`` by per-token ``cos, sin [N, 1, R/2]`` (rotate-half pairing over
    the leading ``R <= D`` dims; the rest pass through: partial rotary)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return torch.cat(rotated if 2 * half == x.shape[-1] else [*rotated, x[..., 2 * half:]], dim=-1)
