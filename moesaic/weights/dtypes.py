"""The one dtype table: safetensors' dtype codes, and the names users give a model or precision dtype."""

from __future__ import annotations

import torch

from ..errors import ConfigError

# safetensors dtype codes -> torch dtypes (every kind the target releases use).
SAFETENSORS: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
SAFETENSORS_CODE = {v: k for k, v in SAFETENSORS.items()}
FLOAT_CODES = ("F32", "BF16", "F16", "F64")
INTEGER_CODES = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")

# the names a model dtype (LLM(dtype=...), --dtype) and a precision rule's float dtype are given by
NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    """A model's compute dtype from its name or a torch float dtype; anything else is a ConfigError."""
    if isinstance(dtype, torch.dtype):
        if dtype not in NAMES.values():
            raise ConfigError(
                f"dtype {dtype} is not supported: a model computes in float32, bfloat16 or float16"
            )
        return dtype
    if not isinstance(dtype, str) or dtype not in NAMES:
        raise ConfigError(f"dtype {dtype!r} is not supported (one of {', '.join(NAMES)})")
    return NAMES[dtype]
