"""Triton kernels behind the same signatures as the plain-torch references (issue 19).

Each module mirrors one family of reference functions; a caller switches by device
(`use_triton(t)`), the reference stays the definition of the math:

    kda.py         delta_rule_recurrent / delta_rule_chunked / kda_gate      layers/kda.py
    mamba2.py      ssd_step / ssd_chunked                                    layers/mamba2.py
    mla.py         latent_attention, sparse_mla_attend, and their paged forms over the paged
                   latent cache (pages of 64 rows, block tables, varlen, many sequences per
                   launch, split-KV)                                         layers/mla.py, dsa.py
    indexer.py     index_scores, kpool_select (+ select), indexer_select     layers/dsa.py, csa.py
    compressor.py  pool_windows, pool_keys, compressor_update                layers/csa.py, dsa.py
    mhc.py         sinkhorn, site_maps (projection + RMS + maps + Sinkhorn fused)  layers/mhc.py
    quant.py       dequantize, matmul, grouped_matmul, run_experts: MXFP4, NVFP4 (divisor and
                   multiplier global scales), DeepSeek fp4, FP8 block (any block, fp32 or UE8M0
                   scales), FP8 per tensor, dense; weights decoded in registers   weights/quant.py,
                                                                                  layers/moe.py
    router.py      route_sigmoid / route_softmax / route_sqrtsoftplus (fused scores + bias +
                   group limit + top-k + renormalise)                        layers/moe.py

The kernels are written for sm_90 (H200): tiles were sized from ahead-of-time sm_90 builds
(`benchmarks/gpu_check.py --compile-only` reports registers, spills and shared memory without a GPU).
The layers choose them with `kernels(name, t)`, one line at the top of each reference function; the
environment variable MOESAIC_TRITON, read at every call, says where they serve:
    auto (default)  CUDA tensors, where triton is installed (the torch references everywhere else)
    off             nowhere: the torch references on every device (to compare on a GPU)
    interpret       CPU tensors, through Triton's interpreter (slow: whole-model tests on small demos)

They are tested on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, which must be set before
triton itself is first imported: tests/test_triton_kernels.py runs them in a child process). The
interpreter has no bf16 arithmetic, so kernels widen loads to fp32 and multiply 16-bit operands
natively only on a GPU (common.native_dot); it also rounds fp32 -> bf16 by truncation, so bf16 results
are checked there to a bf16 rounding step (the device check runs the native paths).

They import nothing from moesaic: the packed-format bit tricks live in quant.py until
moesaic.kernels.codecs lands. Importing this package does not import triton.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import warnings

import torch

from .. import env


def interpreting() -> bool:
    """Whether Triton's interpreter was requested (TRITON_INTERPRET=1): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available() -> bool:
    """Whether the Triton kernels can run here: triton is installed and either a CUDA GPU is present or
    the interpreter is requested."""
    return triton_importable() and (interpreting() or torch.cuda.is_available())


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel should serve tensors like `t`: CUDA tensors on a machine with triton, or CPU
    tensors under the interpreter."""
    if not triton_importable():
        return False
    return t.is_cuda if not interpreting() else t.device.type == "cpu"


MODES = ("auto", "off", "interpret")
_modules: dict = {}
_warned: set = set()


def _warn_once(message: str) -> None:
    # kernels sit below moesaic.errors: a wrong switch warns (once) and the torch references serve
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _switch() -> str:
    return env.get("MOESAIC_TRITON") or ""  # read at every call, cheaply (kernels/env.py)


_switch_set = env.is_set("MOESAIC_TRITON")  # _switch() != "", in one frame (kernels' CPU default)


def mode() -> str:
    """MOESAIC_TRITON (auto, off or interpret), read now; an unknown value warns and means auto."""
    m = _switch().strip().lower() or "auto"
    if m not in MODES:
        _warn_once(f"MOESAIC_TRITON={m!r} is not one of {', '.join(MODES)}: using auto")
        return "auto"
    return m


def _interpreter() -> bool:
    """Requests Triton's interpreter before triton is first imported (it decorates its language then).
    False (with a warning) when triton was already imported without it: the kernels cannot run on CPU."""
    if interpreting():
        return True
    if "triton" in sys.modules:
        _warn_once(
            "MOESAIC_TRITON=interpret: triton was imported before the interpreter was requested, so the "
            "torch references serve; set TRITON_INTERPRET=1 (or MOESAIC_TRITON) before triton is imported"
        )
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


if mode() == "interpret":  # set at start: request the interpreter now, before anything imports triton
    _interpreter()


def kernels(name: str, t: torch.Tensor):
    """The kernel module `name` (kda, mamba2, mla, indexer, compressor, mhc, router, quant) when its
    kernels should serve tensors like `t` (see MOESAIC_TRITON above), else None: the caller runs its
    torch reference. Cheap on the reference path: an environment read and a device test."""
    if not t.is_cuda and not _switch_set():  # the CPU default first
        return None
    m = mode()
    if m == "off" or not (t.is_cuda if m == "auto" else t.device.type == "cpu"):
        return None
    if not triton_importable():
        if m == "interpret":
            _warn_once("MOESAIC_TRITON=interpret: triton is not installed, so the torch references serve")
        return None
    if not (_interpreter() if m == "interpret" else not interpreting()):  # the interpreter takes no CUDA
        return None
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(f"{__name__}.{name}")
    return module
