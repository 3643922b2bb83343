"""Small pieces every kernel module shares: tile sizes, the fp32 dot precision, stable elementwise math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting


def pow2(n: int, lo: int = 16) -> int:
    """The tile width that covers n: the next power of two, at least `lo` (tl.dot needs >= 16)."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (1 under the interpreter): sizes split-K grids."""
    if interpreting() or device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_device(*tensors: torch.Tensor) -> None:
    """A kernel launch needs CUDA tensors, or CPU tensors under the interpreter."""
    for t in tensors:
        if t is None:
            continue
        if interpreting() and t.device.type != "cpu":
            raise ValueError("TRITON_INTERPRET=1 runs the kernels on CPU tensors only")
        if not interpreting() and not t.is_cuda:
            raise ValueError(
                f"a Triton kernel needs CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 to run on CPU"
            )


# fp32 operands: three TF32 tensor-core products (hi*hi + hi*lo + lo*hi), about fp32's accuracy. The
# references keep recurrent states, routers and mixing maps in fp32, which one TF32 product (10-bit
# mantissa) would move by ~1e-3; "ieee" (FMA) keeps large tiles in local memory on sm_90.
F32_DOT: tl.constexpr = tl.constexpr("tf32x3")


def native_dot(dtype: torch.dtype) -> bool:
    """Whether tl.dot may take operands of `dtype` as they are: 16-bit floats on a GPU's tensor cores.
    Under the interpreter 16-bit operands are widened first (it multiplies bf16 as raw integers)."""
    return dtype in (torch.bfloat16, torch.float16) and not interpreting()


@triton.jit
def mma(a, b, acc, NATIVE: tl.constexpr, TY: tl.constexpr):
    """acc + a @ b: in TY on tensor cores when NATIVE, else from fp32 operands (F32_DOT)."""
    if NATIVE:
        return tl.dot(a.to(TY), b.to(TY), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=F32_DOT)


# Elementwise math always runs in fp32 (loads are widened first): the interpreter has no bf16 arithmetic.

ROUND = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # round_to's codes by dtype


@triton.jit
def round_to(v, TO: tl.constexpr):
    """v (fp32) rounded to bf16 (TO 1) or fp16 (2) and widened back, as a torch op in that dtype rounds its
    fp32 result; 0: as it is."""
    if TO == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif TO == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def softplus(u):
    """log(1 + e^u) with torch's threshold 20 (u above it is returned as is), accurate for u << 0."""
    y = tl.exp(-tl.abs(u))
    log1p_y = tl.where(y < 1e-4, y * (1.0 - 0.5 * y), tl.log(1.0 + y))
    return tl.where(u > 20.0, u, tl.maximum(u, 0.0) + log1p_y)


@triton.jit
def sigmoid(u):
    e = tl.exp(-tl.abs(u))  # never overflows
    return tl.where(u >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
