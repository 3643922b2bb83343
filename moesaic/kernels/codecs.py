"""Bit-level codecs of the packed weight formats: the element types (E2M1, E4M3) and scale types
(E8M0, E4M3) as tables, decoders and encoders over plain tensors.

The one module both `weights/quant.py` (QuantizedTensor, the reference dequantization) and the
compiled kernels rely on, so that neither imports the other's internals. Byte layouts follow the
OCP Microscaling Formats (MX) v1.0 specification (E2M1, E8M0) and the FP8 formats paper
(Micikevicius et al., 2022, E4M3 "fn"); see docs/perf.md for how the kernels decode them.

  * E2M1: 4-bit code, bit 3 the sign, bits 0-2 the magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6};
    two codes per byte, the low nibble holding the even element.
  * E8M0 byte e -> 2^(e-127) for e in 0..254; e = 0 is 2^-127 (OCP; compressed-tensors'
    `2 ** (e - 127)` gives the same); e = 0xFF is NaN (OCP).
  * E4M3 ("fn"): no inf, 0x7F/0xFF NaN, max 448.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MXFP4_GROUP = 32
NVFP4_GROUP = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0

# index = 4-bit code: bit 3 is the sign, bits 0-2 the magnitude (code 8 is -0.0)
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

_PAIR_TABLES: dict = {}
_E8M0_TABLES: dict = {}


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """Byte view (no copy) of a uint8 / int8 / 1-byte float tensor."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype, got {t.dtype}")
    return t.view(torch.uint8)


# --- decoders ---------------------------------------------------------------------------------


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, 0..15) -> float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., C] bytes -> [..., 2C] uint8 codes; element 2j is the low nibble of byte j."""
    p = as_u8(packed)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def _pair_table(dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.dtype]:
    """A [256, 1] table whose entry b holds (value(b & 15), value(b >> 4)) of `dtype` packed into
    one element twice as wide, so that one embedding gather decodes a byte into two values."""
    key = (dtype, str(device))
    if key not in _PAIR_TABLES:
        b = torch.arange(256)
        pair = torch.stack((E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]), dim=1).to(dtype)  # [256, 2]
        wide = {1: torch.int16, 2: torch.int32, 4: torch.float64, 8: None}[dtype.itemsize]
        table = pair.contiguous() if wide is None else pair.contiguous().view(wide)  # [256, 1] or [256, 2]
        _PAIR_TABLES[key] = (table.to(device), wide)
    return _PAIR_TABLES[key]


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., C] packed E2M1 bytes (uint8 or int8) -> [..., 2C] values of `dtype` (exact)."""
    p = as_u8(packed)
    table, wide = _pair_table(dtype, p.device)
    out = F.embedding(p.to(torch.int32), table)  # [..., C, 1] (wide) or [..., C, 2]
    if wide is not None:
        out = out.view(dtype)
    return out.flatten(-2)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes (uint8, int8 or float8_e8m0fnu) -> float32 2^(e-127).
    e = 0 -> 2^-127 (a float32 subnormal), e = 255 -> NaN."""
    key = str(e.device)
    if key not in _E8M0_TABLES:
        t = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256, dtype=torch.float64) - 127)
        t = t.to(torch.float32)
        t[255] = float("nan")
        _E8M0_TABLES[key] = t.to(e.device)
    return _E8M0_TABLES[key][as_u8(e).long()]


def e4m3_to_float(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 ("fn": no inf, 0x7F/0xFF NaN), as float8_e4m3fn or raw bytes -> float32."""
    if x.dtype != torch.float8_e4m3fn:
        x = as_u8(x).view(torch.float8_e4m3fn)
    return x.to(torch.float32)


# --- encoders (checkpoint writers of the tests, runtime quantisation) ---------------------------


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2C] uint8 codes (0..15) -> [..., C] uint8 bytes (low nibble = even element)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (c[..., 0] & 0x0F) | ((c[..., 1] & 0x0F) << 4)


def float_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to the even code, saturating at +-6 -> uint8 codes.
    The sign bit follows the input's sign (so -0.1 -> code 8, -0.0)."""
    a = x.float().abs()
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return mag.to(torch.uint8) | (torch.signbit(x.float()).to(torch.uint8) << 3)


def float_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even E4M3, saturating to +-448 (NaN stays NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def pow2_ceil_e8m0(x: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte of the smallest power of two >= x (x > 0), clamped to 2^-127..2^127."""
    m, e = torch.frexp(x.float())  # x = m * 2^e, m in [0.5, 1)
    exp = torch.where(m == 0.5, e - 1, e)
    return (exp + 127).clamp(0, 254).to(torch.uint8)
