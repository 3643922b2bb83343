"""Matrix products against weights that may be dense tensors or packed quantized tensors."""

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """`x @ w.T` for a dense [out, in] tensor, or through a quantized tensor's own matmul."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w.matmul(x)
