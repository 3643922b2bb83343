"""Matrix products against weights that may be dense tensors or packed quantized tensors."""

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """`x @ w.T` for a dense [out, in] tensor, or through a quantized tensor's own matmul.
    A weight kept in another dtype by the precision schedule computes in its own dtype and
    returns the activation's."""
    if isinstance(w, torch.Tensor):
        if w.dtype != x.dtype:
            return F.linear(x.to(w.dtype), w).to(x.dtype)
        return F.linear(x, w)
    return w.matmul(x)
