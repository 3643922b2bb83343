"""Matrix products against weights that may be dense tensors or packed quantized tensors (or a tensor-parallel
rank's piece of one: moesaic/parallel/comm.py), and embedding lookups."""

import torch
import torch.nn.functional as F

from ..kernels import cpu


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T (+ bias)` for a dense [out, in] tensor, or through a quantized tensor's own matmul.
    A weight kept in another dtype by the precision schedule computes in its own dtype and
    returns the activation's. Dense bf16 weights on the CPU go through the compiled kernel at decode
    sizes (up to cpu.dense_rows() rows of x: 16, or 64 by AMX tiles) and through fp32 tiles at prefill sizes where the CPU has
    no native bf16 GEMM (kernels/cpu.py); everything else is F.linear."""
    if isinstance(w, torch.Tensor):
        b = None if bias is None else bias.to(w.dtype)
        return cpu.linear(x, w, b)
    y = w.matmul(x)
    return y if bias is None else y + bias.to(y.dtype)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows `ids` of an embedding table: a dense [vocab, d] tensor, or a table split over ranks (its
    own `lookup`)."""
    return F.embedding(ids, w) if isinstance(w, torch.Tensor) else w.lookup(ids)
