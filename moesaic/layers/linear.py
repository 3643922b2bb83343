"""Matrix products against weights that may be dense tensors or packed quantized tensors (or a tensor-parallel
rank's piece of one: moesaic/parallel/comm.py), and embedding lookups."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import cpu, memory
from ..kernels.triton import kernels


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T (+ bias)` for a dense [out, in] tensor, or through a quantized tensor's own matmul.
    A weight kept in another dtype by the precision schedule computes in its own dtype and
    returns the activation's. Dense bf16 weights on the CPU go through the compiled kernel at decode
    sizes (up to cpu.dense_rows() rows of x: 16; 64 by AMX tiles, 256 by vdpbf16ps) and through fp32
    tiles at prefill sizes where the CPU has no native bf16 GEMM (kernels/cpu.py); everything else is F.linear."""
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


def kept(plans: dict, key, make):
    """plans[key], made by make() at its first use (a layer's fused operands and plans: they do not change
    from step to step)."""
    if key not in plans:
        plans[key] = make()
    return plans[key]


SMALL_PRODUCT = 1 << 18  # operand elements up to which a half-precision CPU product runs in fp32 (matmul)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul of two activations (attention scores and mixes, MLA's absorbed heads). On the CPU a
    bf16 / fp16 product runs in fp32 and is rounded once (the products are exact in fp32 and the
    half-precision GEMM sums them in fp32 too) where its operands are small, since oneDNN builds a
    primitive for each new shape and a decode step's context length is new every step (0.5-0.9 ms a call at
    a new shape, ~25 us at a known one, against 10-17 us for the fp32 product and its casts), and at any
    size where the CPU has no native bf16 GEMM (`product_limit`; docs/perf.md)."""
    if small_product(a, b):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


def product_limit() -> int:
    """Operand elements up to which `matmul` runs a half-precision CPU product in fp32: SMALL_PRODUCT on a
    CPU with a native bf16 GEMM (AMX), any size elsewhere: there oneDNN's half-precision GEMM runs far
    slower than fp32's (a prefill's attention scores 50x, docs/perf.md), as for linears (kernels/cpu.py
    tiled_linear)."""
    return SMALL_PRODUCT if cpu.native_bf16() else 1 << 62


def small_product(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `matmul` runs a @ b in fp32 (a half-precision product on the CPU, within `product_limit`)."""
    return (
        a.is_cpu and a.dtype in (torch.bfloat16, torch.float16) and a.numel() + b.numel() <= product_limit()
    )


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """Rows `ids` of an embedding table: a dense [vocab, d] tensor, or a table split over ranks (its
    own `lookup`)."""
    return F.embedding(ids, w) if isinstance(w, torch.Tensor) else w.lookup(ids)


@dataclass(frozen=True)
class RowStack:
    """Weights that multiply the same input, their rows stacked into one weight at load (`stack_rows`; the
    layer keeps each weight as a view of its rows, so no memory is added): at decode sizes one kernel call
    serves them all. Inside a decode step each small product costs ~15-30 us of call on top of its bytes,
    most of it the call's code and data read back after the step's weight streams (docs/perf.md)."""

    weight: object  # a dense [sum(sizes), K] tensor or a packed weight (QuantizedTensor.stack_rows)
    sizes: tuple
    parts: tuple  # the weights as views of weight's rows: the layer holds these objects
    of: tuple  # id() of the weights each part replaces

    def products(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """[x @ w_i.T for each part] in one call, column views of one output, where the compiled CPU kernels
        take x (each of their output rows is its own sum: the bits of the separate products) or the Triton
        kernels serve x (a GPU, where no product promises those bits); else None (the caller runs them one
        by one)."""
        w = self.weight
        if kernels("quant", x):  # a GPU: one product for the stack (cuBLAS, or the packed Triton GEMM)
            y = F.linear(x, w) if type(w) is torch.Tensor else w.matmul(x)
        elif type(w) is torch.Tensor:
            y = cpu.linear(x, w) if cpu.serves_dense(x, w) else None
        else:
            y = w.kernel_matmul(x)
        # split_with_sizes, not split(): the latter's Python wrapper costs ~2 us a call
        return None if y is None else list(y.split_with_sizes(self.sizes, -1))


def stack_rows(ws: list) -> tuple[RowStack, ...]:
    """The weights of one input (None entries skipped) in RowStacks of two or more: the dense 2-D bf16 ones of
    one width and device in one, packed ones of one `stack_key` (QuantizedTensor's: one format and scale
    layout) in another. The rest (fp32, tensor-parallel pieces, a packed weight alone of its key) keep their
    own calls. Replace each weight by its part (`replacement`)."""
    groups: dict = {}
    for w in ws:
        if w is None:
            continue
        if type(w) is torch.Tensor:
            key = ("dense", w.shape[1], str(w.device)) if w.dim() == 2 and w.dtype == torch.bfloat16 else None
        else:
            key = getattr(w, "stack_key", None)
            key = None if key is None else (type(w), key)
        if key is not None:
            groups.setdefault(key, []).append(w)
    out = []
    for key, group in groups.items():
        if len(group) < 2:
            continue
        sizes = tuple(w.shape[0] for w in group)
        if key[0] == "dense":
            weight = memory.cat_rows(group)
            parts = tuple(weight.split(sizes))
        else:
            weight, parts = type(group[0]).stack_rows(group)
        out.append(RowStack(weight, sizes, tuple(parts), tuple(map(id, group))))
    return tuple(out)


def replacement(stacks: tuple) -> dict:
    """id() of each stacked weight -> the part that replaces it."""
    return {i: p for s in stacks for i, p in zip(s.of, s.parts)}


def products(x: torch.Tensor, stacks: tuple):
    """`linear(x, w)` for the weights of one input as a function of w: the parts of `stacks` come from one
    call each where the kernels take x (RowStack.products), any other weight (or every one, where they do
    not) from its own."""
    got = {}
    for stack in stacks:
        ys = stack.products(x)
        if ys is not None:
            got.update({id(p): y for p, y in zip(stack.parts, ys)})
    if not got:
        return lambda w: linear(x, w)
    return lambda w: got[id(w)] if id(w) in got else linear(x, w)
