"""RMSNorm in the orders the released references use. On the CPU, for inference, each is one call of the
compiled kernels (kernels/cpu.py `rms_norm`: the same float operations, roundings and sum order, so the
same bits) instead of eight small torch ops; on a GPU one Triton launch (kernels/triton/norm.py: the same
roundings, its own sum order). The torch code below is the reference and what runs elsewhere, under autograd
and with MOESAIC_CPU_KERNELS=0 / MOESAIC_TRITON=off."""

import torch

from ..kernels import cpu
from ..kernels.triton import kernels


def fused_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, pre, mid, out, factor=None):
    """cpu.rms_norm's contract in one call where one serves x: the Triton kernel on a GPU, the compiled
    kernel on the CPU; None: the caller runs its torch code."""
    if tk := kernels("norm", x):
        return tk.rms_norm(x, w, eps, pre, mid, out, factor)
    return cpu.rms_norm(x, w, eps, pre, mid, out, factor)


def _rms_norm_roundings(x: torch.dtype, w: torch.dtype) -> tuple:
    return None, x, x if w == x else torch.promote_types(w, x)


def _fp32_weight_roundings(x: torch.dtype, w: torch.dtype) -> tuple:
    return w, None, w


def _cast_once_roundings(x: torch.dtype, w: torch.dtype) -> tuple:
    return None, None, x


def roundings(order, x: torch.dtype, w: torch.dtype) -> tuple | None:
    """cpu.rms_norm's (pre, mid, out) roundings of the norm `order` (one of the functions below) on an x and a
    weight of these dtypes, for a compiled call that runs it inside another; None for any other function."""
    f = _ROUNDINGS.get(order)
    return None if f is None else f(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * (x / rms(x))`: normalise in fp32, round to the input dtype, then scale by the weight
    (the order of the Llama/DeepSeek/Mistral references; the weight is never `1 + w`)."""
    y = fused_rms_norm(x, weight, eps, *_rms_norm_roundings(x.dtype, weight.dtype))
    if y is not None:
        return y
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta, weight, eps)): a residual add and the norm after it in one call (vLLM's
    fused_add_rms_norm: the Triton kernel on a GPU, the compiled one on the CPU), else the two ops."""
    fused = kernels("norm", h) or cpu
    if (
        got := fused.add_rms_norm(h, delta, weight, eps, *_rms_norm_roundings(h.dtype, weight.dtype))
    ) is not None:
        return got
    h = h + delta
    return h, rms_norm(h, weight, eps)


def pre_norm_layers(h: torch.Tensor, layers, eps: float, after=None) -> torch.Tensor:
    """h through pre-norm residual blocks, layer by layer: layers [[(norm weight, block), ...]], h = h +
    block(rms_norm(h, weight)) for each block in turn, each residual add and the next block's norm in one call
    (add_rms_norm). after(L, h) sees h after layer L (a draft head's taps)."""
    blocks = [(L, *b) for L, layer in enumerate(layers) for b in layer]
    x = rms_norm(h, blocks[0][1], eps)
    for i, (L, _, block) in enumerate(blocks):
        y = block(x)
        if i + 1 < len(blocks):
            h, x = add_rms_norm(h, y, blocks[i + 1][1], eps)
        else:
            h = h + y
        if after is not None and (i + 1 == len(blocks) or blocks[i + 1][0] != L):
            after(L, h)
    return h


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Nemotron-H's order: cast to the weight dtype, normalise and multiply by the weight in fp32,
    then cast back."""
    y = fused_rms_norm(x, weight, eps, *_fp32_weight_roundings(x.dtype, weight.dtype))
    if y is not None:
        return y
    dtype = weight.dtype
    xf = x.to(dtype).float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(dtype)


def rms_norm_cast_once(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's order: normalise in fp32, multiply by the (fp32) weight in fp32, cast to the
    input dtype once."""
    y = fused_rms_norm(x, weight, eps, *_cast_once_roundings(x.dtype, weight.dtype))
    if y is not None:
        return y
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


_ROUNDINGS = {
    rms_norm: _rms_norm_roundings,
    rms_norm_fp32_weight: _fp32_weight_roundings,
    rms_norm_cast_once: _cast_once_roundings,
}


def head_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The unweighted RMS norm over the last dim with its factor rounded to x's dtype first: `x * rsqrt(mean(x²)
    + eps).to(x.dtype)` (DeepSeek-V4's second query norm, per head)."""
    y = fused_rms_norm(x, unit_weight(x.shape[-1], x.device), eps, None, x.dtype, x.dtype, factor=x.dtype)
    if y is not None:  # the weight of ones: 1 * v is exact
        return y
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


_UNIT: dict = {}


def unit_weight(n: int, device: torch.device) -> torch.Tensor:
    """A weight of n ones (fp32), made once per size and device: the compiled norm's weight for a norm
    without one."""
    key = (n, device)
    w = _UNIT.get(key)
    if w is None:
        w = _UNIT[key] = torch.ones(n, device=device)
    return w
