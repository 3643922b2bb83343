"""RMSNorm in the two numerics the released references use."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * (x / rms(x))`: normalise in fp32, round to the input dtype, then scale by the weight
    (the order of the Llama/DeepSeek/Mistral references; the weight is never `1 + w`)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Nemotron-H's order: cast to the weight dtype, normalise and multiply by the weight in fp32,
    then cast back."""
    dtype = weight.dtype
    xf = x.to(dtype).float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(dtype)


def rms_norm_cast_once(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's order: normalise in fp32, multiply by the (fp32) weight in fp32, cast to the
    input dtype once."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)
