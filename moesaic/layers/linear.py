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


def operand(w) -> tuple | None:
    """A weight as the compiled CPU kernels take it: a dense bf16 tensor or a packed one (its own
    `kernel_operand`); None for anything else (a tensor-parallel piece, a streamed stack, fp32)."""
    if type(w) is torch.Tensor:
        return cpu.bf16_operand(w) if w.dtype == torch.bfloat16 else None
    return w.kernel_operand() if hasattr(w, "kernel_operand") else None


SMALL_PRODUCT = 1 << 18  # operand elements up to which a half-precision CPU product runs in fp32 (matmul)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul of two activations (attention scores and mixes, MLA's absorbed heads). On the CPU a
    bf16 / fp16 product of small operands runs in fp32 and is rounded once: the products are exact in
    fp32 and the half-precision GEMM sums them in fp32 too, but oneDNN builds a primitive for each new
    shape, and a decode step's context length is new every step (0.5-0.9 ms a call at a new shape, ~25 us
    at a known one, against 10-17 us for the fp32 product and its casts; docs/perf.md)."""
    if small_product(a, b):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


def small_product(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `matmul` runs a @ b in fp32 (a half-precision product of small operands on the CPU)."""
    return a.is_cpu and a.dtype in (torch.bfloat16, torch.float16) and a.numel() + b.numel() <= SMALL_PRODUCT


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows `ids` of an embedding table: a dense [vocab, d] tensor, or a table split over ranks (its
    own `lookup`)."""
    return F.embedding(ids, w) if isinstance(w, torch.Tensor) else w.lookup(ids)
