"""Checkpoint writers: turn a dense checkpoint (name -> tensor, in any naming) into the quantized
layout a release ships, with the matching `quantization_config`. Used by the tests and the demo
list to load the real formats without downloading a real model.

Formats (the names below are the keys of FORMATS):
  mxfp4          compressed-tensors `mxfp4-pack-quantized` (Kimi K3 routed experts):
                 `.weight_packed` U8 + `.weight_scale` U8 (E8M0, group 32)
  nvfp4          compressed-tensors `nvfp4-pack-quantized` (GLM-5.3 / Mistral Small 4 NVFP4):
                 `.weight_packed` + `.weight_scale` F8_E4M3 (group 16) + `.weight_global_scale` (a divisor)
  nvfp4-modelopt ModelOpt NVFP4 (Nemotron-3 NVFP4): `.weight` U8 + `.weight_scale` + `.weight_scale_2` (a multiplier)
  fp8            transformers FP8 (DeepSeek-V3 style): `.weight` F8_E4M3 + `.weight_scale_inv` fp32, 128x128
  fp8-deepseek   DeepSeek-V4 upstream: `.weight` F8_E4M3 + `.scale` fp32, 128x128
  fp8-ue8m0      DeepSeek-V4.1 upstream: `.weight` F8_E4M3 + `.scale` F8_E8M0, 32x32
  fp4-deepseek   DeepSeek fp4 experts: `.weight` I8 (packed E2M1) + `.scale` F8_E8M0, group 32
  fp8-mistral    Mistral native FP8 (Mistral Small 4): `.weight` F8_E4M3 + `.qscale_weight` fp32 per tensor
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from .quant import quantize_fp8_block, quantize_fp8_tensor, quantize_mxfp4, quantize_nvfp4


def _ct_config(fmt: str, group: int, strategy: str, scale_dtype: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {
                    "num_bits": 4,
                    "group_size": group,
                    "type": "float",
                    "symmetric": True,
                    "strategy": strategy,
                    "scale_dtype": scale_dtype,
                    "dynamic": False,
                },
            }
        },
        "ignore": [],
    }


FORMATS: dict[str, tuple[Callable[[torch.Tensor], dict], dict]] = {
    "mxfp4": (
        lambda w: quantize_mxfp4(w, naming="compressed-tensors"),
        _ct_config("mxfp4-pack-quantized", 32, "group", "torch.uint8"),
    ),
    "nvfp4": (
        lambda w: quantize_nvfp4(w, naming="compressed-tensors"),
        _ct_config("nvfp4-pack-quantized", 16, "tensor_group", "torch.float8_e4m3fn"),
    ),
    "nvfp4-modelopt": (
        lambda w: quantize_nvfp4(w, naming="modelopt"),
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []},
    ),
    "fp8": (
        lambda w: quantize_fp8_block(w, (128, 128), "float", naming="hf"),
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    ),
    "fp8-deepseek": (
        lambda w: quantize_fp8_block(w, (128, 128), "float", naming="deepseek"),
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    ),
    "fp8-ue8m0": (
        lambda w: quantize_fp8_block(w, (32, 32), "ue8m0", naming="deepseek"),
        {
            "quant_method": "fp8",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
        },
    ),
    "fp8-mistral": (
        lambda w: {
            ("qscale_weight" if k == "weight_scale" else k): v for k, v in quantize_fp8_tensor(w).items()
        },
        {"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR"},
    ),
    "fp4-deepseek": (
        lambda w: quantize_mxfp4(w, naming="deepseek"),
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    ),
}


def quantize_checkpoint(
    tensors: dict[str, torch.Tensor], select: str | Callable[[str], bool], fmt: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantizes every 2-D `*.weight` whose name matches `select` (a regex, fully matched, or a
    predicate) into `fmt`; the others pass through. Returns (tensors, quantization_config)."""
    encode, qc = FORMATS[fmt]
    pick = (lambda n: re.fullmatch(select, n) is not None) if isinstance(select, str) else select
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dim() == 2 and pick(name):
            base = name[: -len(".weight")]
            for suffix, v in encode(t.float()).items():
                out[f"{base}.{suffix}"] = v
        else:
            out[name] = t
    return out, dict(qc)
