"""Rotary position embedding: inverse frequencies (plain and YaRN) and the interleaved rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import declared, positive
from ..kernels import cpu
from ..kernels.triton import kernels


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """One rope set. `kind` is "default" or "yarn"; the YaRN fields are ignored for "default". The
    declarations read a config's rope section (`rope_parameters` / `rope_scaling`) by their names there."""

    dim: int
    kind: str = "default"
    theta: float = declared(10000.0, key="rope_theta", check=positive)
    factor: float = declared(1.0, check=positive)
    original_max_position_embeddings: int = declared(4096, check=positive)
    beta_fast: float = declared(32.0)
    beta_slow: float = declared(1.0)
    mscale: float = declared(1.0)
    mscale_all_dim: float = declared(0.0)
    truncate: bool = declared(True)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term `0.1 * mscale * ln(scale) + 1` (1 when not scaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(rope: RopeConfig) -> torch.Tensor:
    """Per-pair angular frequencies [dim/2] in fp32.

    YaRN (arXiv 2309.00071): frequencies whose wavelength fits `beta_fast` or more rotations into the
    original context keep their value (extrapolation), those with fewer than `beta_slow` are divided by
    `factor` (interpolation), with a linear ramp between the two correction dimensions."""
    d = rope.dim
    base = rope.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extra = 1.0 / base
    if rope.kind == "default":
        return extra
    inter = 1.0 / (rope.factor * base)

    def corr_dim(rotations: float) -> float:
        return (
            d
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the frequency is extrapolated
    return inter * (1 - keep) + extra * keep


def cos_sin_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN applies to cos/sin (1 when mscale == mscale_all_dim)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: int, keep: int = 0):
    """cpu.rope's contract in one call where one serves x: the Triton kernel on a GPU (kernels/triton/norm.py),
    the compiled kernel on the CPU; None: the caller runs its torch code."""
    if tk := kernels("norm", x):
        return tk.rope(x, cos, sin, layout, keep)
    return cpu.rope(x, cos, sin, layout, keep)


def cos_sin(
    freqs: torch.Tensor, positions: torch.Tensor, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, dim/2] in fp32 for integer positions [n]."""
    ang = positions.to(torch.float32)[:, None] * freqs[None, :]
    if factor == 1.0:  # a product by 1 changes no value: two small ops fewer a call (DeepSeek-V4's ropes)
        return ang.cos(), ang.sin()
    return ang.cos() * factor, ang.sin() * factor


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[2i], x[2i+1]) by the pair's angle and writes the result de-interleaved
    as [rotated evens | rotated odds]. x: [n, ..., dim]; cos/sin: [n, dim/2]. The three rotations are one
    compiled call each on the CPU for inference (kernels/cpu.py `rope`, the same roundings)."""
    y = fused_rope(x, cos, sin, 0)
    if y is not None:
        return y
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c = cos.view(shape).to(x.dtype)
    s = sin.view(shape).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The GPT-NeoX layout: rotates (x[i], x[i + dim/2]) pairs."""
    y = fused_rope(x, cos, sin, 1)
    if y is not None:
        return y
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c = cos.view(shape).to(x.dtype)
    s = sin.view(shape).to(x.dtype)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """Rotates pairs (x[2i], x[2i+1]) by the pair's angle and keeps them in place (DeepSeek-V4's
    layout; `rope_interleaved` writes [evens | odds] instead). Computed in fp32 with cos/sin rounded
    to x's dtype first (as transformers does), returned in x's dtype. x: [n, ..., keep + dim]; cos/sin:
    [n, dim/2]; the first `keep` channels are returned unrotated (V4's [nope | rope] heads). Pass -sin for
    the inverse rotation."""
    y = fused_rope(x, cos, sin, 2, keep)
    if y is not None:
        return y
    if keep:
        return torch.cat([x[..., :keep], rope_pairs(x[..., keep:], cos, sin)], dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1] * 2,)
    c = cos.to(x.dtype).float().repeat_interleave(2, dim=-1).view(shape)
    s = sin.to(x.dtype).float().repeat_interleave(2, dim=-1).view(shape)
    xf = x.float()
    turned = torch.stack((-xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)
    return (xf * c + turned * s).to(x.dtype)
