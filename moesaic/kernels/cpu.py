"""Compiled CPU decode kernels: `x @ W.T` at small batch straight from bf16, FP8-block or packed FP4
weights, for one matrix or all selected experts of a MoE step in one call.

    linear(x, w, bias=None)                      dense bf16 weight [N, K] (F.linear otherwise)
    grouped_linear(x, w, offs)                   dense bf16 expert stack [E, N, K], x rows grouped
    bf16_matmul / fp8_matmul / fp4_matmul        the raw kernels over plain tensors (codes, scales,
                                                 block or group sizes); `offs` makes them grouped
    rms_norm(x, w, eps, pre, mid, out)           layers/norms.py's RMSNorm orders in one call
    rope(x, cos, sin, layout)                    layers/rope.py's three rotations in one call
    mla_absorbed(q_nope, q_rope, w_uk, w_uv, ..)  layers/mla.py's absorbed attention (bf16) in one call

Grouped form (what `run_experts` builds): x [T, K] holds the rows of expert 0, then expert 1, ...;
`offs` [E] (int32/int64, as for torch's grouped_mm) are the cumulative end rows, so expert e owns rows
offs[e-1]:offs[e]; experts with no rows cost nothing. Threads share (expert, block of rows) items.

Strictly optional; the plain-torch paths (F.linear, QuantizedTensor's tiled dequantize) stay the
reference. The C++ (`kernels/cpu_src.py`, which documents the decoding) is compiled on first use with
torch.utils.cpp_extension.load_inline (-O3 -march=native -fopenmp), cached by torch under
TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions in a directory named after a hash of the source,
the flags and this CPU's feature flags, so a cache shared between different CPUs never runs foreign
instructions. If the build fails (no compiler, no ninja, ...) one RuntimeWarning is issued and
`available()` is False. MOESAIC_CPU_KERNELS=0 (or false/off/no) disables the kernels, read at each call.

Numerics: each weight value is decoded exactly (bf16, E4M3 and E2M1 values are exact in fp32, the
group/block scale is applied in fp32 to each group's partial sum), products accumulate in fp32 (FMA)
and each output is rounded once to the output's dtype. The result matches the fp32 reference
(dequantize in fp32, then matmul) to fp32 rounding; only the summation order differs. One exception:
E4M3 NaN codes (0x7F/0xFF, which no encoder writes) decode as +-480 instead of NaN. On AVX-512 BF16 CPUs
bf16 activations against bf16, E2M1 or E4M3 weights use vdpbf16ps, which adds products in pairs and
flushes subnormal inputs and sums to zero (bf16 subnormals are below 1.2e-38): the same fp32
accumulation to rounding. On CPUs with AMX, bf16 x bf16 products (1 to AMX_ROWS rows) take tdpbf16ps with the
same rules, 32 values of K a step in K order, so each output has the same bits at any row count, alone or
grouped, on any thread count; packed weights against 8 or more bf16 rows are decoded to
bf16 (the group scale folded in where the product is exact, else the block's sums scaled) for the same tiles.
MOESAIC_CPU_AMX=0 keeps them on vdpbf16ps (and the 16-row limit).

The fused norm and rope (inference only: autograd keeps the torch code) give the torch code's bits: the
same float operations and roundings, no FMA contraction, and the norm's mean summed in the order of
torch's own row sum (which depends on the vector width of the kernels its sum runs on: `sum_lanes`).

Thread count: `threads_for` picks it per call from the weight bytes and rows (small matrices run on
one thread: see the oversubscription trap in docs/perf.md), never more than torch.get_num_threads().
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import threading
import time
import warnings

import torch
import torch.nn.functional as F

from . import env, memory
from .cpu_src import CPP

__all__ = [
    "MAX_ROWS",
    "enabled",
    "amx_enabled",
    "has_amx",
    "has_bf16dp",
    "dense_rows",
    "packed_rows",
    "AMX_ROWS",
    "DP_ROWS",
    "PACKED_DP_ROWS",
    "load",
    "available",
    "usable",
    "threads_for",
    "linear",
    "grouped_linear",
    "rows_fit",
    "tiled_linear",
    "tiles_apply",
    "bf16_matmul",
    "fp8_matmul",
    "fp4_matmul",
    "fp8_block_ok",
    "operand_rows",
    "rms_norm",
    "rope",
    "mla_absorbed",
    "stats",
]

MAX_ROWS = 16  # rows of x per matrix the kernels serve (decode); more rows take the GEMM paths
# rows of x the AMX path serves against dense bf16 weights: up to here it streams the weights at memory
# speed, where oneDNN's bf16 GEMM (F.linear) read them at ~5 GB/s (17-32 rows) and ~3.7 GB/s (64) here
AMX_ROWS = 64
# ... and the vdpbf16ps path (AVX-512 BF16 without AMX tiles): below 20 rows the decode tiles, from 20 the
# prompt tiles (6 weight rows x 4 x rows), each output the bits it has at one row. On a Zen 4 core, cold expert
# matrices (1024 x 1024): 1.4x oneDNN's bf16 GEMM at 32 rows, 1.2x at 64, 1.04x at 128, 0.95-1.0x at 256 and
# more (docs/perf.md). Up to 256: a 256-token prompt's experts then take one grouped call per projection
# (DeepSeek-V4's 256-token prefill 1.04x against 128 here, Mistral-4's level). Against wider matrices (K past
# DP_WIDE_K) up to DP_WIDE_ROWS: at K = 4096-7168 the tiles read 0.87-0.9x oneDNN at 128-256 rows, 1.05-1.1x
# at 32-64
DP_ROWS = 256
DP_WIDE_K, DP_WIDE_ROWS = 2048, 64
# ... and against packed (fp8 / fp4) weights on that path: any number (above MAX_ROWS the weights decoded to bf16
# a block of rows at a time and multiplied by the prompt tiles, or by the pair tiles for fp32-scaled E4M3, ~190
# GFLOP/s at 256 rows on a Zen 4 core, where the fp32 tiles on weights dequantized ran ~100: a 2048-token
# Mistral-4 *=mxfp4 prefill 907 -> 1317 tok/s without a cap at 256 rows; docs/perf.md)
PACKED_DP_ROWS = 1 << 40
MIN_THREAD_BYTES = 1 << 18  # weight bytes (per row of x) below which one more thread does not pay
TILE_ELEMS = 1 << 21  # weight elements converted to fp32 at a time by tiled_linear (8 MB)
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BF16, _FP8, _FP4 = 0, 1, 2
_FLAGS = ["-O3", "-march=native", "-fopenmp"]

stats = {"kernel_calls": 0, "fallback_calls": 0}  # counters (tests, benchmarks)
_state: dict = {"tried": False, "mod": None, "error": None}


# enabled(): False when MOESAIC_CPU_KERNELS=0 (or 'false'/'off'/'no'); read at each call in one frame
enabled = env.switch("MOESAIC_CPU_KERNELS")
# amx_enabled(): False when MOESAIC_CPU_AMX=0 (or 'false'/'off'/'no'): bf16 x bf16 products then take vdpbf16ps
# on CPUs with AMX too (read at each call; for A/B runs and tests)
amx_enabled = env.switch("MOESAIC_CPU_AMX")


def _module():
    """The compiled module, built on the first call; None where it cannot be built."""
    return _state["mod"] if _state["tried"] else load()


def has_amx() -> bool:
    """Whether the built kernels multiply bf16 x bf16 by AMX tiles here (compiled for them, and the
    process may use the tile state)."""
    if "amx" not in _state:
        mod = _module()
        _state["amx"] = mod is not None and bool(mod.has_amx())
    return _state["amx"]


def has_bf16dp() -> bool:
    """Whether the built kernels multiply bf16 x bf16 by vdpbf16ps here (AVX-512 BF16 and VBMI)."""
    if "bf16dp" not in _state:
        mod = _module()
        _state["bf16dp"] = mod is not None and bool(mod.has_bf16dp())
    return _state["bf16dp"]


def _amx_rows(amx: bool, k: int = 0) -> int:
    """Rows of x against dense bf16 weights of k columns with MOESAIC_CPU_AMX read as `amx` (kernels enabled)."""
    if amx and has_amx():
        return AMX_ROWS
    if not has_bf16dp():
        return MAX_ROWS
    return DP_ROWS if k <= DP_WIDE_K else DP_WIDE_ROWS


def dense_rows(k: int = 0) -> int:
    """Rows of x per matrix the kernels serve against dense bf16 weights of k columns (K): AMX_ROWS where AMX
    tiles run them, DP_ROWS where vdpbf16ps does (DP_WIDE_ROWS past DP_WIDE_K columns), else MAX_ROWS."""
    return _amx_rows(amx_enabled(), k) if enabled() else MAX_ROWS


def packed_rows(x: torch.Tensor) -> int:
    """Rows of x per matrix the kernels serve against packed (fp8 / fp4) weights: MAX_ROWS through their
    decode paths, and any number (PACKED_DP_ROWS) for bf16 x where vdpbf16ps or AMX tiles run them (above
    MAX_ROWS the weights are decoded to bf16 a block of rows at a time and multiplied by the tiles: prefill,
    large batches)."""
    if x.dtype != torch.bfloat16 or not enabled():
        return MAX_ROWS
    return PACKED_DP_ROWS if has_bf16dp() or (amx_enabled() and has_amx()) else MAX_ROWS


BUILD_NOTICE_S = 3.0  # seconds a load may take before it says that it is building
BUILD_NOTICE = "[moesaic] building the CPU kernels for this CPU (once per machine and environment, ~1 min)"


def _build_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    # torch's location too: two environments (their include paths differ) would rebuild one folder in turn
    key = "\n".join([CPP, " ".join(_FLAGS), flags, torch.__version__, torch.__file__])
    return "moesaic_cpu_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def load(verbose: bool = False):
    """The compiled module (building it on the first call), or None when it cannot be built."""
    if _state["tried"]:
        return _state["mod"]
    _state["tried"] = True
    # a build (a new machine or environment: ~1 min on 2 cores) says so, where a cached one loads in well under
    # BUILD_NOTICE_S: a first prompt that waits a minute in silence looks hung
    notice = threading.Timer(BUILD_NOTICE_S, lambda: print(BUILD_NOTICE, file=sys.stderr, flush=True))
    notice.daemon = True
    notice.start()
    try:
        from torch.utils.cpp_extension import load_inline

        _state["mod"] = load_inline(
            name=_build_name(),
            cpp_sources=CPP,
            functions=[
                "gemm",
                "dequant",
                "read_bytes",
                "has_avx2",
                "has_vnni512",
                "has_amx",
                "has_bf16dp",
                "sinkhorn",
                "rms_norm",
                "add_rms_norm",
                "rope",
                "delta_rule",
                "ssd_steps",
                "mla_absorbed",
                "ffn_rows",
                "glu_rows",
                "combine_rows",
                "moe_rows",
                "mhc_enter",
                "mhc_head",
                "mhc_mean",
                "f32_rows",
                "mhc_update",
                "route",
                "kda_recur",
                "dsa_gathered",
                "mamba2_recur",
                "kda_project",
                "kda_block",
                "mla_project",
                "dsa_project",
                "mla_block",
                "v4_inputs",
                "v4_output",
                "sink_attend",
                "sink_prompt",
                "dsa_gathered_bf16",
                "dsa_block",
                "encode_fp4",
                "encode_fp8",
                "product_seconds",
                "all_finite",
                "argmax_rows",
                "write_rows",
                "v4_attention",
                "compress_rows",
                "causal_attend",
            ],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=verbose,
        )
    except Exception as e:  # no compiler, no ninja, unsupported flags, ...: plain paths
        msg = str(e).strip()
        _state["error"] = f"{type(e).__name__}: {msg.splitlines()[-1] if msg else ''}"
        warnings.warn(
            f"moesaic: the CPU kernels could not be built ({_state['error']}); matmuls use the "
            f"plain-torch paths (set MOESAIC_CPU_KERNELS=0 to skip the build)",
            RuntimeWarning,
            stacklevel=2,
        )
    finally:
        notice.cancel()
    return _state["mod"]


def available() -> bool:
    """Enabled and built (builds on the first call)."""
    return enabled() and load() is not None


def usable(x: torch.Tensor, w: torch.Tensor, rows: int = MAX_ROWS) -> bool:
    """Whether the kernels can serve x against weight storage w: enabled and built, both on the CPU,
    x 2-D fp32/bf16/fp16 with 1..rows rows, w's rows contiguous."""
    return _fits(x, w, rows) and enabled() and _module() is not None


def _fits(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    return (
        x.is_cpu
        and w.is_cpu
        and w.stride(-1) == 1
        and x.dtype in _X_DTYPES
        and x.dim() == 2
        and 0 < x.shape[0] <= rows
    )


def threads_for(weight_bytes: int, rows: int = 1) -> int:
    """Threads for one call reading `weight_bytes` of weights against `rows` rows of x: one per
    MIN_THREAD_BYTES of work (compute grows with the rows), at most torch.get_num_threads()."""
    work = weight_bytes + weight_bytes * (rows - 1) // 4 if rows > 1 else weight_bytes
    return max(1, min(torch.get_num_threads(), work // MIN_THREAD_BYTES))


def fp8_block_ok(block, k: int) -> bool:
    """The fp8 kernel applies a block's scale per 32 columns: block columns a multiple of 32, or one
    block spanning all K columns (per-channel, per-tensor)."""
    return block[1] % 32 == 0 or block[1] >= k


def _gemm(op: tuple, x, offs, out, bias, threads, generic, nbytes, amx=None):
    """One kernel call: x against the weight operand `op` (bf16_operand / fp8_operand / fp4_operand)."""
    mod = _module()
    if mod is None:
        raise RuntimeError(f"moesaic CPU kernels unavailable: {_state['error']}")
    kind, w, scales, gscale, divides, group, bn, bk = op
    if threads is None:
        # grouped: at most one expert per row, so rows per expert >= T / min(T, E)
        rows = x.shape[0] if offs is None else -(-x.shape[0] // max(1, min(x.shape[0], w.shape[0])))
        threads = threads_for(nbytes, rows)
    out = mod.gemm(
        kind, x, w, scales, gscale, divides, offs, out, bias, group, bn, bk, threads, _path(generic, amx)
    )
    stats["kernel_calls"] += 1
    return out


# int8_activations(): True when MOESAIC_CPU_INT8_ACTIVATIONS=1 (read at each call; off when unset): E2M1 weights
# (mxfp4, nvfp4) multiply int8 activation rows, llama.cpp's Q8_0 rounding of x (each 32 values scaled by max |x| /
# 127 and rounded to the nearest integer), by integer byte products: ~2x the fp32 tiles' rate from memory on an
# AVX2 core and more by AVX-512 VNNI (docs/perf.md), outputs within x's rounding of the exact ones rather than
# equal to the plain path's. The portable build keeps exact activations, and so does bf16 x on AVX-512 BF16 CPUs
# without VNNI and VBMI (vdpbf16ps); AMX tiles (12 or more bf16 rows an expert) stay exact.
int8_activations = env.switch("MOESAIC_CPU_INT8_ACTIVATIONS", default=False)


Q8_PATH = 4  # gemm's path bit: int8 activations against E2M1 weights
# True: the AVX2 tiles even where the CPU has AVX-512 (no vdpbf16ps, VNNI or AMX): for tests and A/B runs that
# cover the AVX2 code on an AVX-512 machine
AVX2_ONLY = False


def _path(generic: bool = False, amx: bool | None = None) -> int:
    """gemm's path argument: 1 the portable code, 0 the best this CPU has (AMX where enabled), 2 without AMX,
    3 the AVX2 tiles only (AVX2_ONLY); plus Q8_PATH where int8_activations()."""
    path = 1 if generic else 3 if AVX2_ONLY else 0 if (amx_enabled() if amx is None else amx) else 2
    return path | Q8_PATH if not generic and int8_activations() else path


def _active_bytes(w: torch.Tensor, rows: int, grouped: bool) -> int:
    """Bytes of the matrices a call reads: all of w, or (grouped) at most one expert per row of x."""
    if not grouped or w.dim() < 3:
        return w.nbytes
    return w.nbytes // w.shape[0] * min(w.shape[0], rows)


# A weight as the kernels take it: (kind, w or codes, scales, global scale, divides, group, block rows,
# block cols). One builder per encoding, used by the *_matmul entry points and by ffn_rows.
def bf16_operand(w: torch.Tensor) -> tuple:
    """A dense bf16 weight [N, K] (or stack [E, N, K])."""
    return (_BF16, w, None, None, False, 0, 1, 1)


def fp8_operand(codes, scales, block) -> tuple:
    """E4M3 codes [.., N, K] with one scale per `block` (see fp8_matmul)."""
    if scales.element_size() == 1:
        scales = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    elif scales.dtype != torch.float32:
        scales = scales.float()
    return (_FP8, codes.view(torch.uint8), scales.contiguous(), None, False, 0, block[0], block[1])


def fp4_operand(codes, scales, group, global_scale=None, divides=False) -> tuple:
    """Packed E2M1 codes [.., N, K/2] with a scale byte per `group` inputs (see fp4_matmul)."""
    g = global_scale
    if g is not None and (g.dtype != torch.float32 or not g.is_contiguous()):
        g = g.to(torch.float32).contiguous()
    codes = codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)
    scales = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    return (_FP4, codes, scales, g, bool(divides), int(group), 1, 1)


def operand_bytes(op: tuple, rows: int, grouped: bool) -> int:
    """Weight bytes a call over `rows` rows of x reads (threads_for's measure): the active matrices (a
    grouped call: at most one expert a row), plus fp4's scales."""
    return _active_bytes(op[1], rows, grouped) + (op[2].nbytes if op[0] == _FP4 else 0)


def operand_matmul(
    x, op: tuple, bias=None, *, offs=None, out=None, threads=None, generic=False
) -> torch.Tensor:
    """x [M, K] against a weight operand (one matrix, or with offs a stack) -> out [M, N] (default x's
    dtype), plus bias [N]. Raises if the kernels are unavailable."""
    nbytes = operand_bytes(op, x.shape[0], offs is not None)
    return _gemm(op, x, offs, out, bias, threads, generic, nbytes)


def operand_rows(
    op: tuple, r0: int, out: torch.Tensor, threads: int | None = None, generic: bool = False
) -> torch.Tensor:
    """Rows r0 : r0 + len(out) of one packed matrix (fp8_operand / fp4_operand of a 2-D weight) dequantized
    into out [rows, K] fp32: QuantizedTensor.dequantize_rows' values, bit for bit (the plain tiles of a
    prefill multiply them; `generic`: the portable loops). Raises if the kernels are unavailable."""
    mod = _module()
    if mod is None:
        raise RuntimeError(f"moesaic CPU kernels unavailable: {_state['error']}")
    kind, w, scales, gscale, divides, group, bn, bk = op
    if threads is None:
        threads = threads_for(out.numel() * 4)  # what it writes
    mod.dequant(kind, w, scales, gscale, divides, group, bn, bk, r0, out, threads, generic)
    return out


def bf16_matmul(x, w, bias=None, *, offs=None, out=None, threads=None, generic=False) -> torch.Tensor:
    """x [M, K] @ w.T for w bf16 [N, K] (or, with offs, [E, N, K]) -> out [M, N] (default x's dtype),
    plus bias [N]. Raises if the kernels are unavailable."""
    return operand_matmul(x, bf16_operand(w), bias, offs=offs, out=out, threads=threads, generic=generic)


def fp8_matmul(x, codes, scales, block, *, offs=None, out=None, threads=None, generic=False) -> torch.Tensor:
    """x [M, K] @ W.T for E4M3 codes [N, K] (float8_e4m3fn or bytes; with offs [E, N, K]) and one scale
    per `block` = (rows, cols) block: scales [.., ceil(N/rows), ceil(K/cols)] fp32 multipliers or E8M0
    bytes (uint8 / float8_e8m0fnu). Per-tensor fp8 is the block (N, K) with scales [.., 1, 1]."""
    op = fp8_operand(codes, scales, block)
    return operand_matmul(x, op, offs=offs, out=out, threads=threads, generic=generic)


def fp4_matmul(
    x,
    codes,
    scales,
    group,
    global_scale=None,
    divides=False,
    *,
    offs=None,
    out=None,
    threads=None,
    generic=False,
) -> torch.Tensor:
    """x [M, K] @ W.T for packed E2M1 codes [N, K/2] (uint8/int8, low nibble = even element; with offs
    [E, N, K/2]) and one scale byte per `group` inputs, scales [.., N, K/group]: group 32 = E8M0
    (mxfp4), group 16 = E4M3 (nvfp4) with the fp32 global scale (one per matrix) applied as
    `scale / global` when `divides` (compressed-tensors) else `scale * global` (ModelOpt)."""
    op = fp4_operand(codes, scales, group, global_scale, divides)
    return operand_matmul(x, op, offs=offs, out=out, threads=threads, generic=generic)


def _dense_ok(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    return w.dtype == torch.bfloat16 and x.dtype == w.dtype and usable(x, w, rows)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T (+ bias)` for a dense [N, K] weight, as `layers/linear.py` computes it (x cast to w's
    dtype, the result cast back): through the bf16 kernel for bf16 weights and at most `dense_rows()` rows
    of x, through fp32 tiles (`tiled_linear`) for half-precision weights at more rows on a CPU without
    a native bf16 GEMM, else F.linear. The one rule every dense product of the model follows (experts
    one by one, grouped or streamed, included)."""
    if x.dtype != w.dtype:
        b = None if bias is None else bias.to(w.dtype)
        return linear(x.to(w.dtype), w, b).to(x.dtype)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    amx = _dense_kernel(x2, w)
    if amx is not None:
        y = _gemm(bf16_operand(w), x2, None, None, bias, None, False, w.nbytes, amx)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])
    if tiles_apply(x2, w):
        return tiled_linear(x, w, bias)
    return F.linear(x, w, bias)


def _dense_kernel(x2: torch.Tensor, w: torch.Tensor) -> bool | None:
    """`linear`'s first branch for x2 [M, K] of w's dtype: MOESAIC_CPU_AMX as read (the `amx` its kernel call
    takes) where the bf16 kernel serves x2 against w, else None. dense_rows() and _dense_ok's checks with each
    environment flag read once: a decode step makes ~100 of these calls, and each read costs ~0.7 us."""
    if not (w.dtype == torch.bfloat16 and enabled() and _module() is not None):
        return None
    amx = amx_enabled()
    return amx if _fits(x2, w, _amx_rows(amx, w.shape[-1])) else None


def serves_dense(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear(x, w)` runs the bf16 kernel (its first branch): each output row of that kernel is its
    own sum, the same bits whatever weight rows share the call (layers/linear.py RowStack relies on it)."""
    return type(w) is torch.Tensor and x.dtype == w.dtype and x.dim() == 2 and _dense_kernel(x, w) is not None


FP4_ENCODINGS = {"mxfp4": 0, "nvfp4": 1, "nvfp4-modelopt": 2}


def _encoder(w: torch.Tensor):
    """The compiled module when an encoder serves w (a 2-D fp32 / bf16 / fp16 weight on the CPU, unit stride in
    its last dim, the kernels on and built), else None."""
    if not (w.is_cpu and w.dim() == 2 and w.stride(-1) == 1 and w.dtype in _X_DTYPES and enabled()):
        return None
    return _module()


def encode_fp4(encoding: str, w: torch.Tensor, gs: float, packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """weights/quant.py's quantize_mxfp4 / quantize_nvfp4 (`encoding` in FP4_ENCODINGS; gs the NVFP4 global scale
    as that code makes it) of w [N, K] into packed [N, K/2] and scales [N, K/G] (uint8 views), the same bytes,
    in one pass with torch's threads (the torch code takes ~13 elementwise passes for the codes alone). False
    where it does not apply (kernels off or unbuilt, w elsewhere than the CPU, a value not finite): the caller
    runs the torch code."""
    mod = _encoder(w)
    threads = torch.get_num_threads()
    return mod is not None and bool(
        mod.encode_fp4(FP4_ENCODINGS[encoding], w, float(gs), packed, scales, threads)
    )


def encode_fp8(w: torch.Tensor, block, ue8m0: bool, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """weights/quant.py's quantize_fp8_block of w [N, K] with `block` (rows, cols) into codes [N, K] (uint8 view)
    and scales [ceil(N/rows), ceil(K/cols)] (fp32, or E8M0 bytes with ue8m0), the same bytes, one block row at a
    time with torch's threads. False where it does not apply (as encode_fp4)."""
    mod = _encoder(w)
    bn, bk, threads = int(block[0]), int(block[1]), torch.get_num_threads()
    return mod is not None and bool(mod.encode_fp8(w, bn, bk, ue8m0, codes, scales, threads))


def sinkhorn_(c: torch.Tensor, iters: int, eps: float) -> bool:
    """mHC's Sinkhorn rounds in place on c [..., n, n] (fp32, contiguous, on the CPU), bit for bit the
    torch loop of layers/mhc.py; False (c untouched) where the kernel does not apply. Up to n = 4 streams
    (the releases' hc_mult): torch sums 5 or more floats in another order than index order, so a wider
    matrix keeps the torch loop (tests/test_cpu_perf.py checks both)."""
    if not (c.is_cpu and c.dtype == torch.float32 and c.is_contiguous() and c.shape[-1] <= 4):
        return False
    if not (enabled() and load() is not None) or torch.is_grad_enabled() and c.requires_grad:
        return False
    _state["mod"].sinkhorn(c, iters, eps)
    return True


# Widths that cross the sum's vector (8 / 16 lanes), its 4-vector items and its cascade steps.
_PROBE_WIDTHS = (*range(1, 80), 127, 129, 513, 1000, 2049, 4099)


def sum_lanes() -> int:
    """Lanes of the vectors torch's fp32 row sum runs on here (8 or 16), found once by trying the fused
    norm with each against torch's own `mean` on rows that tell them apart; 0 (the fused norm off) where
    neither reproduces torch's bits. Found, not read off torch.backends.cpu: a build that dispatches AVX-512
    kernels still runs its sum on the AVX2 ones (8 lanes; seen on an AVX-512 Zen 4 with torch 2.13)."""
    if "lanes" not in _state:
        _state["lanes"] = 0
        mod = _module()
        if mod is not None and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "AVX512"):
            g = torch.Generator().manual_seed(0)
            rows = [torch.randn(3, d, generator=g) * 8 for d in _PROBE_WIDTHS]
            with torch.inference_mode():
                refs = [x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) for x in rows]
                for lanes in (8, 16):
                    got = (mod.rms_norm(x, torch.ones(x.shape[1]), 1e-6, 0, 0, 0, lanes, 1, 0) for x in rows)
                    if all(torch.equal(a, b) for a, b in zip(got, refs)):
                        _state["lanes"] = lanes
                        break
    return _state["lanes"]


_TY = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_NORM_WIDTH = 16384  # wider rows: torch may split one row's sum between threads (a 32768-value grain)
FUSED_PARALLEL = 1 << 15  # elements from which the fused norm / rope use torch's threads
ATTEND_PARALLEL = FUSED_PARALLEL * 32  # multiply-adds from which the fused attention calls do


def _fused_threads(work: int, grain: int = FUSED_PARALLEL) -> int:
    """A fused call's threads: one below `grain` units of work, else torch's."""
    return 1 if work < grain else torch.get_num_threads()


def _fused_mod(*ts):
    """The compiled module when the fused norm / rope serve these tensors (CPU, fp32/bf16/fp16, no
    autograd), else None."""
    for t in ts:
        if not (t.is_cpu and t.dtype in _TY):
            return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return None
    if not enabled():
        return None
    return _module()


def rms_norm(x, w, eps: float, pre, mid, out, factor=None):
    """`rnd_out(w * rnd_mid(x' * rnd_factor(rsqrt(mean(x'^2) + eps))))` with x' = rnd_pre(x), each rnd a
    rounding to that dtype (None or fp32: none), over the last dim of x (w [d], or [G, d] for x [..., G, d]:
    each group its own row of the weight), in one call: the float operations of
    layers/norms.py's torch code in its order, the mean's sum in torch's order (`sum_lanes`), so the
    same bits. None (nothing done) where it does not apply: the caller runs the torch code."""
    d = x.shape[-1] if x.dim() else 0
    grouped = w.dim() == 2 and x.dim() >= 2 and w.shape == x.shape[-2:]  # row r of x's groups takes w[r % G]
    if not (0 < d <= MAX_NORM_WIDTH and x.stride(-1) == 1 and (w.shape == (d,) or grouped)):
        return None
    mod = _fused_mod(x, w)
    if mod is None or not (lanes := sum_lanes()):
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, d)
    threads = _fused_threads(x.numel())
    pre, mid = _TY.get(pre, 0), _TY.get(mid, 0)
    y = mod.rms_norm(x2, w.contiguous(), eps, pre, mid, _TY[out], lanes, threads, _TY.get(factor, 0))
    return y if x.dim() == 2 else y.view(x.shape)


def add_rms_norm(x, delta, w, eps: float, pre, mid, out, factor=None):
    """(x + delta rounded to x's dtype, rms_norm of that sum): a residual add and the norm after it in one call,
    the same bits as torch's add and `rms_norm` above; None where it does not apply."""
    d = x.shape[-1] if x.dim() else 0
    if not (
        delta.shape == x.shape and delta.dtype == x.dtype and x.is_contiguous() and delta.is_contiguous()
    ):
        return None
    if not (0 < d <= MAX_NORM_WIDTH and w.shape == (d,)):
        return None
    mod = _fused_mod(x, delta, w)
    if mod is None or not (lanes := sum_lanes()):
        return None
    flat = x.dim() == 2  # (decode's rows: no reshape and view, ~7 us of Python a call)
    x2, d2 = (x, delta) if flat else (x.reshape(-1, d), delta.reshape(-1, d))
    pre, mid = _TY.get(pre, 0), _TY.get(mid, 0)
    h, y = mod.add_rms_norm(x2, d2, w.contiguous(), eps, pre, mid, _TY[out], lanes, _fused_threads(x.numel()),
                            _TY.get(factor, 0))  # fmt: skip
    return (h, y) if flat else (h.view(x.shape), y.view(x.shape))


def rope(x, cos, sin, layout: int, keep: int = 0):
    """layers/rope.py's rotations in one call (layout 0 rope_interleaved, 1 rope_half, 2 rope_pairs): x [n,
    ..., keep + dim] (last dim contiguous), cos/sin [n, dim/2] rounded to x's dtype first, the same roundings
    as the torch code; the first `keep` channels of each row copied as they are. None where it does not
    apply."""
    if not (
        x.dim() >= 2
        and x.stride(-1) == 1
        and cos.dim() == 2
        and cos.shape == sin.shape
        and cos.shape[0] == x.shape[0]
        and 2 * cos.shape[1] + keep == x.shape[-1]
    ):
        return None
    mod = _fused_mod(x, cos, sin)
    if mod is None:
        return None
    x3 = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
    threads = _fused_threads(x.numel())
    y = mod.rope(x3, cos.contiguous(), sin.contiguous(), layout, threads, keep)
    return y if x.dim() == 3 else y.view(x.shape)


def mhc_enter(streams, waiting, fn, columns, base, norm_eps: float, hc_eps: float, iters: int, norm=None):
    """layers/mhc.py's Streams.enter in one call, the same bits: where `waiting` = (y, post, comb) is given, the
    update of streams [N, n, d] by it first (update's operations), then the site's input of the result
    (site_input's: fn, per-column scale `columns`, base fp32) and, where `norm` = (weight [d], eps, pre, mid,
    out) is given, the block's RMSNorm of it (rms_norm's roundings, dtypes or None). (h, x [N, d], post [N, n],
    comb [N, n, n]): h is streams itself without an update. None where it does not apply (n <= 4, the fused
    Sinkhorn's rule; the caller runs the torch code). mhc_plan and mhc_run in turn."""
    plan = mhc_plan(streams, waiting, fn, columns, base, norm_eps, hc_eps, iters, norm)
    return None if plan is None else mhc_run(plan, streams, waiting)


def mhc_plan(streams, waiting, fn, columns, base, norm_eps: float, hc_eps: float, iters: int, norm=None):
    """mhc_enter's checks and the arguments of its compiled call but the streams and the update's tensors (a
    tuple for mhc_run), or None where it declines. The answer holds for other streams and updates of the same
    mhc_key while torch's grad mode is off (a caller may keep it: the ~5 us of checks a call, ~2 % of a
    DeepSeek-V4 decode step in place)."""
    if not (streams.dim() == 3 and streams.is_contiguous() and streams.shape[1] <= 4 and iters >= 1):
        return None
    N, n, d = streams.shape
    if not (
        0 < n * d <= MAX_NORM_WIDTH and columns is not None and columns.dtype == base.dtype == torch.float32
    ):
        return None
    y = weight = None
    eps, pre, mid, out = 0.0, 0, 0, 0
    if waiting is not None:
        y, post, comb = waiting
        if not post.dtype == comb.dtype == torch.float32:
            return None
    if norm is not None:
        weight, eps, pre, mid, out = norm
        if weight.shape != (d,) or not all(
            t in _TY for t in (weight.dtype, out, *(r for r in (pre, mid) if r))
        ):
            return None  # (a float64 model, say: the torch code)
        pre, mid, out = _TY.get(pre, 0), _TY.get(mid, 0), _TY[out]
    mod = _fused_mod(streams, fn, *(t for t in (y, weight) if t is not None))
    if mod is None or not (lanes := sum_lanes()):
        return None
    kernel_fn = fn.dtype in (torch.bfloat16, torch.float32) and fn.stride(-1) == 1
    threads, fn_threads = _fused_threads(streams.numel()), threads_for(fn.nbytes, N)
    return (fn, columns, base, norm_eps, hc_eps, iters, lanes, kernel_fn, threads, fn_threads, weight,
            eps, pre, mid, out)  # fmt: skip


def mhc_key(streams, waiting) -> tuple:
    """What mhc_plan's answer depends on besides its site and norm: the streams' and the update's shapes,
    dtypes and layout, torch's thread count and whether the kernels are on (with grad mode off)."""
    return (
        streams.shape,
        streams.dtype,
        streams.is_contiguous(),
        mhc_update_key(waiting),
        torch.get_num_threads(),
        enabled(),
    )


def mhc_update_key(waiting) -> tuple | None:
    """mhc_key's part of the update (y, post, comb), None without one."""
    if waiting is None:
        return None
    y, post, comb = waiting
    return y.shape, y.dtype, y.is_cpu, post.dtype, comb.dtype


def mhc_run(plan: tuple, streams, waiting):
    """mhc_enter's compiled call with mhc_plan's arguments: (h, x, post, comb)."""
    y, post, comb = (None, None, None) if waiting is None else waiting
    stats["kernel_calls"] += plan[7]
    return tuple(_module().mhc_enter(streams, y, post, comb, *plan))


def all_finite(x) -> bool | None:
    """Whether every value of x is finite, for a CPU fp32 tensor (a step's logits) in one small compiled loop;
    None elsewhere (the caller uses torch)."""
    if not (x.is_cpu and x.dtype == torch.float32 and x.is_contiguous()) or _fused_mod(x) is None:
        return None
    return _module().all_finite(x)


def argmax_rows(x) -> list[int] | None:
    """torch.argmax(x, -1).tolist() of a CPU fp32 x [n, V] (a step's logits rows) in one small compiled loop: the
    first of equal largest values, a NaN counted largest, as torch's. None elsewhere (the caller uses torch)."""
    if not (x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] and x.is_contiguous()):
        return None
    if _fused_mod(x) is None:
        return None
    return _module().argmax_rows(x)


def write_rows(dsts: list, at: int, srcs: list) -> bool:
    """dst[at : at + n] = src for each pair of CPU tensors [.., w] of one dtype, rows of unit stride (a ring's
    buffers and its new rows: cache/state.py TailRows) in one call; False, nothing written, where a pair does not
    fit or the kernels are off (the caller writes them by torch)."""
    mod = _module() if srcs and srcs[0].is_cpu and enabled() else None  # (a GPU's rings: no build, no call)
    return mod is not None and mod.write_rows(dsts, at, srcs)


def product_seconds(on: bool) -> float:
    """Seconds spent so far in the weight products inside compiled calls that also do other work (mhc_enter's
    site product, dsa_gathered's W_k and W_v on bf16), for a benchmark's split of a step; `on` switches the
    counting on or off from now (off by default). 0.0 without the compiled module."""
    mod = _module()
    return 0.0 if mod is None else mod.product_seconds(on)


def f32_rows(x, w):
    """x [M, K] fp32 @ w.T for fp32 or bf16 w [N, K] (rows contiguous; bf16 read as its fp32 values): each output
    the sum of 16 partial sums in k order, its own bits whatever the rows around it, so a prompt's rows and a
    decode row agree (not torch's: for the products that both the fused mHC call and layers/mhc.py's project
    take; without AVX-512, more than MAX_ROWS rows take torch's GEMM). None where it does not apply."""
    if not (x.dim() == w.dim() == 2 and x.dtype == torch.float32 and x.shape[0] > 0):
        return None
    if w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not (x.shape[1] == w.shape[1] and w.stride(-1) == 1) or (mod := _fused_mod(x, w)) is None:
        return None
    return mod.f32_rows(x, w, threads_for(w.nbytes, x.shape[0]))


def mhc_head(streams, fn, base, scale, norm_eps: float, hc_eps: float):
    """layers/mhc.py's head_weighted in one call, the same float operations (mhc_enter's projection and collapse):
    streams [N, n, d] contiguous, fn [n, n d] fp32 or bf16, base [n], scale [1]. None where it does not apply (the
    caller runs the torch code)."""
    if not (streams.dim() == 3 and streams.is_contiguous() and 0 < streams.shape[0] <= MAX_ROWS):
        return None
    N, n, d = streams.shape
    if not (0 < n * d <= MAX_NORM_WIDTH and fn.shape == (n, n * d) and fn.stride(-1) == 1):
        return None
    if fn.dtype not in (torch.float32, torch.bfloat16) or base.numel() != n or scale.numel() != 1:
        return None
    mod = _fused_mod(streams, fn, base, scale)
    if mod is None or not (lanes := sum_lanes()):
        return None
    return mod.mhc_head(streams, fn, base.contiguous(), scale.contiguous(), norm_eps, hc_eps, lanes,
                        _fused_threads(streams.numel()), threads_for(fn.nbytes, N))  # fmt: skip


def mhc_mean(streams):
    """layers/mhc.py's head_mean (streams.mean(-2)) in one call, the same bits: bf16 or fp32 streams [N, n, d]
    contiguous with n a power of two (the 1 / n weights exact; bf16's range is fp32's, so scaling by them commutes
    with the rounding). None where it does not apply (the caller runs torch's mean)."""
    if not (streams.dim() == 3 and streams.is_contiguous() and streams.numel()):
        return None
    if streams.dtype not in (torch.bfloat16, torch.float32):  # fp16: torch rounds the sum, then divides
        return None
    n = streams.shape[1]
    if n & (n - 1) or (mod := _fused_mod(streams)) is None:
        return None
    return mod.mhc_mean(streams, _fused_threads(streams.numel()))


def mhc_update(streams, y, post, comb):
    """layers/mhc.py's update in one call (the same float operations in the same order, the same bits):
    streams [N, n, d] contiguous, y [N, d], post [N, n] and comb [N, n, n] fp32. None where it does not
    apply (the caller runs the torch code)."""
    if not (streams.dim() == 3 and streams.is_contiguous() and post.dtype == comb.dtype == torch.float32):
        return None
    mod = _fused_mod(streams, y, post, comb)
    if mod is None:
        return None
    threads = _fused_threads(streams.numel())
    y = y.to(streams.dtype).contiguous()  # y.to(dt): the torch code's rounding
    return mod.mhc_update(streams, y, post.contiguous(), comb.contiguous(), threads)


ROUTER_SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def route(logits, score: str, top_k: int, bias=None, ids=None, normalize: bool = True, scale: float = 1.0):
    """layers/moe.py's router `score` (one expert group) in one call: the same torch ops, the same bits.
    (weights, ids), or None where it does not apply."""
    mod = _fused_mod(logits) if logits.dim() == 2 else None
    return (
        None
        if mod is None
        else tuple(mod.route(logits, ROUTER_SCORES[score], top_k, bias, ids, normalize, scale, sum_lanes()))
    )


def dsa_gathered(
    q, latent, w_kv_b, dv: int, scale: float, selection, block_elems: int, small: int, pages=None
):
    """layers/dsa.py's attend_gathered in one call; None where it does not apply. bf16 operands: the torch
    code's roundings, its products exact and summed in the kernels' order (equal to rounding), the weight
    read as stored. Others: the same torch ops (layers/linear.py's matmul rule with `small` its
    SMALL_PRODUCT), the same bits. `pages` (bf16 only): (block ids, length), the ids a list as mla_absorbed
    takes them: latent is then a page pool's view [num_blocks, block rows, kvr] whose rows are read in place
    (no gathered copy of the cache)."""
    mod = _fused_mod(q, latent, w_kv_b) if q.dim() == 3 and selection.dtype == torch.int64 else None
    if mod is None:
        return None
    bf = torch.bfloat16
    if q.dtype == latent.dtype == w_kv_b.dtype == bf and latent.stride(-1) == 1 and w_kv_b.is_contiguous():
        n, H, dn = q.shape
        work = n * H * latent.shape[-1] * (dn + dv + selection.shape[1])
        threads = _fused_threads(work, ATTEND_PARALLEL)
        blocks, length = pages if pages is not None else (None, 0)
        return mod.dsa_gathered_bf16(q, latent, w_kv_b, dv, scale, selection, threads, blocks, length)
    if pages is not None:
        return None
    return mod.dsa_gathered(q, latent, w_kv_b, dv, scale, selection, block_elems, small)


def sink_attention(
    q,
    positions,
    first: int,
    win,
    win_start: int,
    window: int,
    sink,
    scale: float,
    comp,
    comp_sel,
    ratio: int,
    step: int,
):
    """layers/csa.py's sink_attention for bf16 q [n, H, D], window rows win [L, D] and entries comp [E, D] in
    one call, by the torch code's blocks of `step` queries: its logits' roundings, torch's own softmax, its
    value sums' roundings, the dots and sums added in another order (equal to rounding). None where it does not
    apply (the caller runs the torch code)."""
    if positions.dtype != torch.int64 or (call := _sink_call(q, win, window, sink, comp, comp_sel)) is None:
        return None
    mod, threads, sel = call
    return mod.sink_attend(
        q, positions.contiguous(), first, win, win_start, window, sink, scale, comp, sel, ratio, step, threads
    )


def sink_prompt(
    q, first: int, win, win_start: int, window: int, sink, scale: float, comp, comp_sel, ratio: int
):
    """layers/csa.py's sink_attention for a prompt's bf16 queries q [n, H, D] at positions first .. first + n - 1
    in one call by vdpbf16ps tiles: the torch code's bf16 logits, its softmax in fp32 with the sink's logit,
    normalised bf16 probabilities and value sums rounded where it rounds, the sums in another order and e^x by a
    polynomial (so equal to rounding). None where it does not apply (not bf16, odd D, no AVX-512 BF16)."""
    if q.dim() != 3 or q.shape[2] % 2 or not has_bf16dp():
        return None
    q = q.contiguous()
    if (call := _sink_call(q, win, window, sink, comp, comp_sel)) is None:
        return None
    mod, threads, sel = call
    return mod.sink_prompt(q, first, win, win_start, window, sink, scale, comp, sel, ratio, threads)


def _sink_call(q, win, window: int, sink, comp, comp_sel):
    """(module, threads, contiguous selection) for the sink attention calls, None where their dtypes or layouts
    do not apply."""
    bf = torch.bfloat16
    if not (q.dim() == 3 and q.dtype == bf and q.is_contiguous() and win.dtype == bf and win.stride(-1) == 1):
        return None
    if comp is not None and not (comp.dtype == bf and comp.stride(-1) == 1):
        return None
    if comp_sel is not None and comp_sel.dtype != torch.int64:
        return None
    mod = _fused_mod(q, win, sink) if comp is None else _fused_mod(q, win, sink, comp)
    if mod is None:
        return None
    n, H, D = q.shape
    entries = 0 if comp is None else comp_sel.shape[1] if comp_sel is not None else comp.shape[0]
    threads = sink_threads(n, H, D, win.shape[0], window, entries)
    return mod, threads, None if comp_sel is None else comp_sel.contiguous()


def causal_attention(q, k, v, scale: float, q2=None, k2=None, *, round_scores: bool, normalize_first: bool):
    """Causal attention of one sequence's n new queries q [n, H, D] over its T keys k [T, Hk, D] and values v
    [T, Hk, Dv] (query i sees keys 0 .. T - n + i; head h reads key head h // (H // Hk)), plus a second part of
    each logit q2 [n, H, D2] . k2 [T, Hk, D2] (MLA's rope part; k2 may be an expanded view), in one call: fp32
    logits (first rounded to bf16 where `round_scores`: a bf16 matmul's), fp32 softmax, p rounded to bf16 and
    normalized before the value sum (`normalize_first`: the torch code of layers/attention.py) or after it
    (SDPA's CPU kernel) -> [n, H, Dv] bf16, equal to those to rounding. torch's CPU SDPA reads 13-21 GFLOP/s here
    (docs/perf.md). None where it does not apply (not bf16 by vdpbf16ps, odd head dims): the caller's torch code."""
    ts = (q, k, v) if q2 is None else (q, k, v, q2, k2)
    if not all(t.dtype == torch.bfloat16 and t.dim() == 3 and t.stride(-1) == 1 for t in ts):
        return None
    dims = (q.shape[2],) if q2 is None else (q.shape[2], q2.shape[2])
    if any(d % 2 for d in dims) or not 0 < q.shape[0] <= k.shape[0] or q.shape[1] % k.shape[1]:
        return None
    mod = _fused_mod(*ts)
    if mod is None or not has_bf16dp():
        return None
    n, H, T = q.shape[0], q.shape[1], k.shape[0]
    threads = _fused_threads(n * H * T * (sum(dims) + v.shape[2]) // 2, ATTEND_PARALLEL)
    return mod.causal_attend(q, k, q2, k2, v, scale, round_scores, normalize_first, threads)


DELTA_PARALLEL = 1 << 16  # state values x tokens from which the recurrences share their heads out to threads


def mla_absorbed(q_nope, q_rope, w_uk, w_uv, latents, k_ropes, lens, scale: float, blocks=None, lengths=None):
    """layers/mla.py's absorbed attention (absorb_queries, latent_attention per sequence, absorb_output)
    for bf16 tensors in one call: q_nope [N, H, dn] / q_rope [N, H, dr] packed rows of the sequences
    (lens rows each), their caches latents[s] [T, kvr] / k_ropes[s] [T, dr] -> [N, H, dv]; rounded where
    the torch code rounds, summed in another order (so equal to rounding). With `blocks` (and `lengths`)
    the caches are read in place from pages: latents[s] / k_ropes[s] a pool's views [num_blocks, block
    rows, width], sequence s's rows 0..lengths[s] in its blocks[s] in order. None where it does not apply
    (not bf16, autograd, kernels off): the caller runs the torch code."""
    caches = (*latents, *k_ropes)
    dims = 2 if blocks is None else 3
    if q_nope.dtype != torch.bfloat16 or any(t.dtype != torch.bfloat16 or t.dim() != dims for t in caches):
        return None
    if any(t.shape[-1] and t.stride(-1) != 1 for t in (q_nope, q_rope, w_uk, w_uv, *caches)):
        return None
    mod = _fused_mod(q_nope, q_rope, w_uk, w_uv, *latents, *k_ropes)
    if mod is None:
        return None
    rows = sum(t.shape[0] for t in latents) if blocks is None else sum(lengths)
    work = q_nope.shape[1] * rows * w_uk.shape[-1]
    threads = _fused_threads(work, ATTEND_PARALLEL)
    return mod.mla_absorbed(
        q_nope, q_rope, w_uk, w_uv, list(latents), list(k_ropes), list(lens), scale, threads, blocks, lengths
    )


def combine_rows(ys, inv, weights):
    """layers/moe.py run_experts' combine in one call: each token's experts' bf16 rows ys[inv[n k + j]] (inv None:
    row n k + j) times its routing weights [N, k], added over the slots in order from 0 in fp32 and cast to bf16
    (fp32 weights), or with each product and sum rounded to bf16 (bf16 weights: torch's bf16 ops): the bits of the
    torch lines, where they made four tensors of N k d values. None where it does not apply (the caller runs the
    torch code)."""
    if not (
        ys.dtype == torch.bfloat16
        and ys.dim() == 2
        and weights.dtype in (torch.float32, torch.bfloat16)
        and weights.dim() == 2
    ):
        return None
    if inv is not None and inv.dtype != torch.int64 or (mod := _fused_mod(ys, weights)) is None:
        return None
    threads = _fused_threads(weights.numel() * ys.shape[1])
    return mod.combine_rows(ys.contiguous(), inv, weights.contiguous(), threads)


def glu_rows(gate, up, limit: float | None = None):
    """layers/moe.py's silu_glu (clamped_silu_glu with `limit`) of bf16 rows [R, I] (unit column stride: a
    gate|up row's halves) in one call, the same bits: torch's SiLU, the clamps and the product as loops (a
    clamp's value is one of its inputs; the product rounded once), where torch took four ops and three new
    tensors. None where it does not apply (the caller runs the torch code)."""
    if not (gate.dtype == up.dtype == torch.bfloat16 and gate.dim() == 2 and gate.shape == up.shape):
        return None
    if gate.stride(-1) != 1 or up.stride(-1) != 1 or (mod := _fused_mod(gate, up)) is None:
        return None
    return mod.glu_rows(gate, up, limit)


def ffn_rows(x, weights=None, ids=None, w_in=None, w_out=None, dense=(), limit=None, relu2=False, plan=None):
    """A few tokens' SwiGLU feed-forward block in one call (layers/moe.py's torch code at up to MAX_ROWS rows,
    the same bits): the routed experts (weights / ids [N, k], stacks w_in [E, 2I, d] gate|up and w_out [E, d,
    I]), each token's terms summed in ascending expert id, plus `dense` = (gate, up, down) (a shared expert
    or a dense MLP), either part optional (routing weights given: w_in and w_out are needed); the SwiGLU
    clamped at `limit` when given (layers/moe.py's clamped_silu_glu). `relu2`: ungated experts (w_in [E, I, d])
    and dense = (None, up, down), relu(h)^2 (layers/moe.py's relu2, Nemotron-H). Weights are operands
    (bf16_operand, fp8_operand, fp4_operand); x bf16 [N, d]. None where it does not apply (the caller runs
    the torch code). `plan`: ffn_plan's for these operands at x's row count (else made here)."""
    if weights is not None and weights.dtype not in _WEIGHTS:
        return None
    k = 0 if ids is None else ids.shape[1]
    call = _ffn_call(x, k, w_in, w_out, dense, relu2, weights is not None, plan)
    if call is None:
        return None
    mod, products, threads = call
    gate, up, down = dense or (None, None, None)
    y = mod.ffn_rows(
        x, weights, ids, w_in, w_out, gate if dense else None, up, down, limit, relu2, threads, _path()
    )
    if y is not None:
        stats["kernel_calls"] += products
    return y


def moe_rows(
    x,
    router,
    router_f32,
    score: str,
    top_k: int,
    bias,
    hash_ids,
    normalize: bool,
    scale: float,
    w_in,
    w_out,
    dense=(),
    limit=None,
    relu2=False,
    plan=None,
):
    """layers/moe.py's whole MoE block for a few tokens in one call: the router's logits (`router` a bf16 [E, d]
    weight the bf16 kernel serves against x, as `linear` runs it, or None with `router_f32` [E, d]: x in fp32
    against it, F.linear's op), `route` on them (`hash_ids` [N, k]: a hash layer's experts), then `ffn_rows`
    with the routed experts w_in / w_out and `dense`. The same calls as the torch code, the same bits; None
    where it does not apply (the caller runs the torch code). `plan`: as ffn_rows'."""
    if router is not None and not serves_dense(x, router):
        return None
    call = _ffn_call(x, top_k, w_in, w_out, dense, relu2, True, plan)
    if call is None:
        return None
    mod, products, threads = call
    gate, up, down = dense or (None, None, None)
    op = None if router is None else bf16_operand(router)
    router_threads = 1 if router is None else threads_for(router.nbytes, x.shape[0])
    ys = mod.moe_rows(
        x,
        op,
        router_f32,
        router_threads,
        ROUTER_SCORES[score],
        top_k,
        bias,
        hash_ids,
        normalize,
        scale,
        w_in,
        w_out,
        gate if dense else None,
        up,
        down,
        limit,
        relu2,
        threads,
        _path(),
        sum_lanes(),
    )
    if not ys:
        return None
    stats["kernel_calls"] += products + (router is not None)
    return ys[0]


def _ffn_call(x, k: int, w_in, w_out, dense, relu2: bool, routed: bool, plan=None):
    """(module, products, each product's threads) for an ffn_rows call on x [N, d] (k slots a token where
    `routed`), or None where it does not apply."""
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16):
        return None
    plan = plan or ffn_plan(x.shape[0], k, w_in, w_out, dense, relu2, routed)
    mod = _fused_mod(x) if plan is not None else None
    return None if mod is None else (mod, *plan)


def ffn_plan(rows: int, k: int, w_in, w_out, dense=(), relu2=False, routed=True):
    """What an ffn_rows call over `rows` bf16 rows needs of its operands, the same from call to call (a caller
    that keeps it spares ~100 Python calls a block): (products, each product's threads as its own call would
    have them at torch's thread count now: a grouped call's rows are the (token, slot) pairs, at most one
    expert a row), or None where the operands do not fit (not on the CPU, rows not contiguous, dense ones not
    bf16)."""
    gate, up, down = dense or (None, None, None)
    dense_ops = () if not dense else (up, down) if relu2 else (gate, up, down)
    ops = ((w_in, w_out) if routed else ()) + dense_ops
    if not ops or not _operands_fit(ops, torch.bfloat16):
        return None
    threads = _own_threads(dense_ops, rows)
    if routed:
        T, E = rows * k, w_in[1].shape[0]
        per = -(-T // max(1, min(T, E)))
        threads = [threads_for(operand_bytes(op, T, True), per) for op in (w_in, w_out)] + threads
    return len(ops), threads


_WEIGHTS = (torch.bfloat16, torch.float32)


def _operands_fit(ops, dtype: torch.dtype) -> bool:
    """Whether a fused call can run every operand of `ops` against x of `dtype` (CPU weights with contiguous
    rows, dense ones of x's dtype)."""
    return all(
        op is not None and op[1].is_cpu and op[1].stride(-1) == 1 and (op[0] != _BF16 or op[1].dtype == dtype)
        for op in ops
    )


def _own_threads(ops, rows: int) -> list[int]:
    """Each operand's threads as its own call over `rows` rows would take them (threads_for)."""
    return [threads_for(operand_bytes(op, rows, False), rows) for op in ops]


def delta_rule(q, k, v, g, beta, S, keep_states: bool):
    """KDA's token-by-token delta rule (layers/kda.py's delta_rule_recurrent) in one call: (o [H, n, Dv], the
    final S, the state after every token [n, H, Dk, Dv] or None); None where it does not apply (the caller
    runs the torch loop). exp(g) is torch's; the sums over Dk go in index order (the torch loop's einsums
    go through a GEMM), so the two agree to rounding, not to the bit."""
    mod = _fused_mod(q, k, v, g, beta, S)
    if mod is None or q.dim() != 3 or not all(t.dtype == torch.float32 for t in (q, k, v, g, beta, S)):
        return None
    H, n, Dk = q.shape
    threads = _delta_threads(n, H, Dk, v.shape[-1])
    o, S, states = mod.delta_rule(q, k, v, torch.exp(g), beta, S, keep_states, threads)
    return o, S, (states if keep_states and n else None)


def _delta_threads(n: int, H: int, Dk: int, Dv: int) -> int:
    """delta_rule's threads over n tokens of H heads: one below DELTA_PARALLEL state values x tokens."""
    return _fused_threads(n * H * Dk * Dv, DELTA_PARALLEL)


def kda_recur(qkv, g, beta, tail, conv_w, S, heads: int, head_dim: int, snapshot_last: int, eps: float):
    """layers/kda.py's kda_recur (the short conv, the l2 norms, the delta rule token by token: any number of
    rows, a prompt's too) in one call: the same torch ops, the same bits. (o [n, H, Dv], the final state, the
    snapshots [snapshot_last, H, Dk, Dv], the conv's padded input), or None where it does not apply (the caller
    runs the torch code)."""
    n = qkv.shape[0]
    if n == 0 or not 0 <= snapshot_last <= n or g.dtype != torch.float32 or beta.dtype != torch.float32:
        return None
    if S is not None and S.dtype != torch.float32:
        return None
    mod = _fused_mod(qkv, g, beta, tail, conv_w, *(() if S is None else (S,)))
    if mod is None or not (lanes := sum_lanes()):
        return None
    first = _delta_threads(n - snapshot_last, heads, head_dim, head_dim)  # the rows before the snapshots
    snap = _delta_threads(snapshot_last, heads, head_dim, head_dim)
    return tuple(
        mod.kda_recur(
            qkv,
            g,
            beta,
            tail,
            conv_w,
            S,
            heads,
            head_dim,
            snapshot_last,
            eps,
            head_dim**-0.5,
            first,
            snap,
            lanes,
        )
    )


def kda_project(x, ops: list, A_log, dt_bias, head_dim: int, lower_bound, stacked: tuple = ()):
    """layers/kda.py's kda_project in one call for up to MAX_ROWS rows: the products of the operands `ops` (q,
    k, v, f_a, f_b, b, then g or g_a, g_b; or, with `stacked` the sizes of its six parts, the stack of x's
    products q | k | v | f_a | b | g or g_a, then f_b and g_b) as `linear` would compute each, the log-decay and
    beta, the same bits. (qkv, g, beta, gate), or None where it does not apply (the caller runs the torch
    code)."""
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16):
        return None
    mod = _fused_mod(x, A_log, dt_bias) if _operands_fit(ops, x.dtype) else None
    if mod is None:
        return None
    threads = _own_threads(ops, x.shape[0])
    lb = None if lower_bound is None else float(lower_bound)
    out = mod.kda_project(x, ops, threads, A_log, dt_bias, head_dim, lb, _path(), list(stacked))
    stats["kernel_calls"] += len(ops)
    return tuple(out)


def kda_block(x, ops: list, A_log, dt_bias, head_dim: int, lower_bound, stacked: tuple, tail, conv_w, S, eps: float,
              o_norm, norm_eps: float, o_op):  # fmt: skip
    """layers/kda.py's kda_row (kda_project, kda_recur and kda_output for one decode row of one sequence, no
    snapshots) in one call, with the threads each phase's own call would take: the same bits. (y [1, d], the new
    state, the conv's padded input [K, C]), or None where it does not apply (the caller runs the phases)."""
    if not (x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and o_op is not None):
        return None
    if not (tail.is_contiguous() and S.dtype == torch.float32 and S.is_contiguous() and S.dim() == 3):
        return None
    mod = (
        _fused_mod(x, A_log, dt_bias, tail, conv_w, S, o_norm)
        if _operands_fit([*ops, o_op], x.dtype)
        else None
    )
    if mod is None or not (lanes := sum_lanes()):
        return None
    H = S.shape[0]
    lb = None if lower_bound is None else float(lower_bound)
    out = mod.kda_block(
        x, ops, _own_threads(ops, 1), A_log, dt_bias, head_dim, lb, _path(), list(stacked), tail, conv_w, S, eps,
        _delta_threads(1, H, head_dim, head_dim), lanes, o_norm, norm_eps, _fused_threads(H * head_dim), [o_op],
        _own_threads([o_op], 1)[0],
    )  # fmt: skip
    stats["kernel_calls"] += len(ops) + 2
    return tuple(out)


def _norms_fit(norms: list, dtype: torch.dtype) -> bool:
    """Whether the fused MLA calls take these norm weights: of x's dtype, one row each, within MAX_NORM_WIDTH."""
    return all(n.dtype == dtype and n.dim() == 1 and n.shape[0] <= MAX_NORM_WIDTH for n in norms)


def mla_project(x, ops: list, norms: list, eps: float, kvr: int):
    """layers/mla.py's mla_project products and norms in one call for up to MAX_ROWS rows: ops (q, kv_a) or (q_a,
    q_b, kv_a) as operands, norms (kv_a_norm,) or (q_a_norm, kv_a_norm) of x's dtype, each product as `linear`
    computes it and each norm as layers/norms.py's rms_norm, the same bits. (q, kv, latent), with (q_a, q_b, kv_a)
    also qr (q_a's normed rows, q_b's input), or None where it does not apply (the caller runs the torch code)."""
    if (args := _project_args(x, ops, norms)) is None:
        return None
    mod, threads, norms, lanes = args
    out = mod.mla_project(x, ops, threads, norms, eps, kvr, lanes, _path())
    stats["kernel_calls"] += len(ops)
    return tuple(out)


def _project_args(x, ops: list, norms: list, *more):
    """mla_project's and dsa_project's checks: (the module, each product's threads, the norms contiguous, the
    sum's lanes), or None where the call does not apply (`more`: further tensors it reads)."""
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16):
        return None
    if not _norms_fit(norms, x.dtype):
        return None
    mod = _fused_mod(x, *norms, *more) if _operands_fit(ops, x.dtype) else None
    if mod is None or not (lanes := sum_lanes()):
        return None
    return mod, _own_threads(ops, x.shape[0]), [n.contiguous() for n in norms], lanes


def dsa_project(x, ops: list, norms: list, eps: float, kvr: int, k_norm, k_bias, k_eps: float):
    """mla_project's (ops q_a, q_b, kv_a; norms q_a_norm, kv_a_norm) and the DSA indexer's keys of the same rows
    (ops wk, gate: k = layer_norm(x wkᵀ) with k_norm and k_bias, z = x gateᵀ) in one call, the same bits as
    the separate calls: (q, kv, latent, qr, k, z), or None where it does not apply."""
    if len(ops) != 5 or not k_norm.dtype == k_bias.dtype == x.dtype:
        return None
    if (args := _project_args(x, ops, norms, k_norm, k_bias)) is None:
        return None
    mod, threads, norms, lanes = args
    out = mod.dsa_project(x, ops, threads, norms, eps, kvr, lanes, _path(), k_norm, k_bias, k_eps)
    stats["kernel_calls"] += len(ops)
    return tuple(out)


def mla_plan(ops: list, norms: list, w_uk, w_uv, rows: int) -> tuple | None:
    """mla_block's weights checked once for a layer at `rows` rows of x: (ops: mla_project's operands then o's,
    each one's threads as its own call would take them, the norms, w_uk, w_uv); None where the call does not
    take them."""
    if not (0 < rows <= MAX_ROWS and _operands_fit(ops, torch.bfloat16)):
        return None
    if not _norms_fit(norms, torch.bfloat16):
        return None
    parts = (*norms, w_uk, w_uv)
    if not all(t.is_cpu and t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in parts):
        return None
    if not (w_uk.dim() == w_uv.dim() == 3):
        return None
    return ops, _own_threads(ops, rows), [n.contiguous() for n in norms], w_uk, w_uv


def mla_block(
    x, plan: tuple, pools, eps: float, kvr: int, heads: int, dn: int, rope, scale: float, place, qscale=None
):
    """layers/mla.py's mla_block in one call for the weights of `plan` (mla_plan at x's rows): mla_project, the
    rotation `rope` = (cos, sin, layout as `rope` takes it) of the query's and key's rope parts or None, the new
    rows written to their pages (pools: the pool's latent and key views [blocks, rows, width]), mla_absorbed
    over them (`scale`; the queries first times `qscale` [N, 1, 1] where given), then o's product; the same calls
    in the same order, the same bits. `place()` -> (a (block, row) per query row flat, rows per sequence, each
    sequence's block ids, lengths) is called once the call applies, and only then (it advances the caches). o's
    product [N, d], or None where it does not apply (the caller runs the code)."""
    if not (x.is_cpu and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1):
        return None
    latent, k_rope = pools
    if not all(t.dtype == torch.bfloat16 and t.dim() == 3 and t.stride(-1) == 1 for t in pools):
        return None
    if latent.shape[-1] != kvr:
        return None
    if rope is not None:
        cos, sin, layout = rope
        if not (cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == x.shape[0]):
            return None
        if 2 * cos.shape[1] != k_rope.shape[-1]:
            return None
    mod = _fused_mod(x, *pools, *(() if rope is None else (cos, sin)))
    if mod is None or not (lanes := sum_lanes()):
        return None
    ops, threads, norms, w_uk, w_uv = plan
    rows = x.shape[0]
    if rope is None:
        cos, sin, layout, rope_threads = None, None, -1, 1
    else:
        cos, sin, rope_threads = (
            cos.contiguous(),
            sin.contiguous(),
            _fused_threads(rows * heads * 2 * cos.shape[1]),
        )
    where, lens, blocks, lengths = place()
    attn_threads = _fused_threads(heads * sum(lengths) * w_uk.shape[-1], ATTEND_PARALLEL)
    y = mod.mla_block(
        x, ops, threads, norms, eps, kvr, lanes, _path(), heads, dn, cos, sin, layout, rope_threads,
        latent, k_rope, where, w_uk, w_uv, lens, scale, attn_threads, blocks, lengths, qscale,
    )  # fmt: skip
    stats["kernel_calls"] += len(ops)
    return y


def dsa_plan(ops: list, norms: list, w_kv_b, k_norm, k_bias, rows: int) -> tuple | None:
    """dsa_block's weights checked once for a layer at `rows` rows of x: (ops: q_a, q_b, kv_a[, wk, gate], o, each
    one's threads as its own call would take them, the norms, w_kv_b, the indexer's k_norm and k_bias or None);
    None where the call does not take them."""
    if not (0 < rows <= MAX_ROWS and _operands_fit(ops, torch.bfloat16)):
        return None
    if not _norms_fit(norms, torch.bfloat16):
        return None
    parts = (*norms, w_kv_b, *(() if k_norm is None else (k_norm, k_bias)))
    if not all(t.is_cpu and t.dtype == torch.bfloat16 and t.is_contiguous() for t in parts):
        return None
    return ops, _own_threads(ops, rows), [n.contiguous() for n in norms], w_kv_b, k_norm, k_bias


def dsa_block(x, plan: tuple, pools: list, eps: float, kvr: int, k_eps: float, heads: int, dv: int, scale: float,
              kpool: int, tail: bool, widths: list, place):  # fmt: skip
    """layers/dsa.py's fused_block in one call for the weights of `plan` (dsa_plan at x's rows): the projections
    (and the indexer's keys), the new rows written to their pages (pools: the latent view [blocks, rows, kvr],
    with an indexer also k's and z's), each sequence's compact causal selection (every cached token; kpool,
    tail: always_select_tail and kpool > 1; widths: each one's, dsa.compact_width after this step's rows),
    dsa_gathered over its pages, then o's product: the same calls in the
    same order, the same bits. `place()` -> (a (block, row) per query row flat, rows per sequence, each
    sequence's block ids, lengths) is called once the call applies, and only then (it advances the caches). o's
    product [N, d], or None where it does not apply (the caller runs the code)."""
    if not (x.is_cpu and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1):
        return None
    if not all(t.dtype == torch.bfloat16 and t.dim() == 3 and t.stride(-1) == 1 for t in pools):
        return None
    mod = _fused_mod(x, *pools)
    if mod is None or not (lanes := sum_lanes()) or pools[0].shape[-1] != kvr:
        return None
    ops, threads, norms, w_kv_b, k_norm, k_bias = plan
    where, lens, blocks, lengths = place()
    dn = w_kv_b.shape[0] // heads - dv
    # dsa_gathered's threads for each sequence's call
    attn_threads = [
        _fused_threads(n * heads * kvr * (dn + dv + w), ATTEND_PARALLEL) for n, w in zip(lens, widths)
    ]
    y = mod.dsa_block(
        x, ops, threads, norms, eps, kvr, lanes, _path(), k_norm, k_bias, k_eps, heads, dv, w_kv_b, scale,
        pools, where, lens, blocks, lengths, kpool, tail, attn_threads,
    )  # fmt: skip
    stats["kernel_calls"] += len(ops)
    return y


def v4_inputs(qa, kv, q_b, q_a_norm, kv_norm, eps: float, heads: int, ones, cos, sin):
    """models/deepseek_v4.py's attention_inputs after x's products (qa, kv [n, D]) in one call for up to MAX_ROWS
    rows: the norms in DeepSeek-V4's cast-once order, q_b's product (operand q_b) viewed [n, heads, D], each
    head's unweighted RMS where `ones` (its unit weight [D]) is given, and the rotation of q's and kv's last 2 *
    cos.shape[1] channels by cos / sin (rope_pairs); the same calls, the same bits. (qr, q, kv), or None where it
    does not apply (the caller runs the code)."""
    if not (qa.dim() == kv.dim() == 2 and 0 < qa.shape[0] <= MAX_ROWS and qa.shape[0] == kv.shape[0]):
        return None
    n, D = kv.shape
    if not (qa.dtype == kv.dtype == torch.bfloat16 and qa.stride(-1) == 1 and kv.stride(-1) == 1):
        return None
    if not (
        q_a_norm.shape == (qa.shape[1],) and kv_norm.shape == (D,) and max(D, qa.shape[1]) <= MAX_NORM_WIDTH
    ):
        return None
    if not (cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == n and 2 * cos.shape[1] <= D):
        return None
    if ones is not None and ones.shape != (D,):
        return None
    mod = _fused_mod(qa, kv, q_a_norm, kv_norm, cos, sin) if _operands_fit([q_b], qa.dtype) else None
    if mod is None or not (lanes := sum_lanes()):
        return None
    threads = _own_threads([q_b], n)[0]
    norms = q_a_norm.contiguous(), kv_norm.contiguous()
    out = mod.v4_inputs(
        qa,
        kv,
        q_b,
        threads,
        *norms,
        eps,
        _TY[qa.dtype],
        lanes,
        _path(),
        heads,
        ones,
        cos.contiguous(),
        sin.contiguous(),
    )
    stats["kernel_calls"] += 1
    return tuple(out)


def v4_output(o, cos, sin, o_a, o_b):
    """models/deepseek_v4.py's attention_output in one call for up to MAX_ROWS rows: o [n, H, D] rotated by cos /
    sin (rope_pairs on the last 2 * cos.shape[1] channels; sin negated for the inverse), each of the G groups of
    whole heads through its rows of o_a (the dense bf16 stack [G, r, H * D / G]: csa.grouped_out's views), the
    groups' outputs side by side through o_b (an operand); the same calls, the same bits. [n, d], or None where
    it does not apply (the caller runs the code)."""
    if not (o.dim() == 3 and 0 < o.shape[0] <= MAX_ROWS and o.dtype == o_a.dtype == torch.bfloat16):
        return None
    n, H, D = o.shape
    if not (o_a.dim() == 3 and o_a.shape[0] * o_a.shape[2] == H * D and o_a.is_contiguous()):
        return None
    if not (cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == n and 2 * cos.shape[1] <= D):
        return None
    a = bf16_operand(o_a)
    mod = _fused_mod(o, cos, sin) if _operands_fit([a, o_b], o.dtype) else None
    if mod is None:
        return None
    threads = threads_for(o_a.nbytes // o_a.shape[0], n), *_own_threads([o_b], n)
    turn = cos.contiguous(), sin.contiguous(), _fused_threads(o.numel())
    out = mod.v4_output(o.contiguous(), *turn, a, threads[0], o_b, threads[1], _path())
    stats["kernel_calls"] += 2  # o_a's grouped product and o_b's
    return out


def v4_plan(q_b, q_a_norm, kv_norm, o_a, o_b, rows: int, heads: int, dim: int) -> tuple | None:
    """v4_attention's weights checked once for a layer at `rows` rows (o_a: the dense bf16 stack [G, r, heads *
    dim / G]): (q_b, its threads, the norms, o_a's operand, its threads, o_b, its threads), each product's threads
    as v4_inputs and v4_output take them; None where the call does not take them."""
    if not (0 < rows <= MAX_ROWS and _operands_fit([q_b], torch.bfloat16)):
        return None
    norms = (q_a_norm, kv_norm)
    if not (
        kv_norm.shape == (dim,) and q_a_norm.dim() == 1 and max(dim, q_a_norm.shape[0]) <= MAX_NORM_WIDTH
    ):
        return None
    if not all(t.is_cpu and t.dtype in _TY for t in norms):
        return None
    if not (o_a.dtype == torch.bfloat16 and o_a.dim() == 3 and o_a.shape[0] * o_a.shape[2] == heads * dim):
        return None
    if not o_a.is_contiguous() or not _operands_fit([a := bf16_operand(o_a), o_b], torch.bfloat16):
        return None
    q_threads, b_threads = _own_threads([q_b], rows)[0], _own_threads([o_b], rows)[0]
    a_threads = threads_for(o_a.nbytes // o_a.shape[0], rows)
    return q_b, q_threads, *(t.contiguous() for t in norms), a, a_threads, o_b, b_threads


def v4_attention(qa, kv, comp_rows: list, plan: tuple, eps: float, heads: int, ones, cos, sin, nsin, place):
    """models/deepseek_v4.py's attention after the layer input's products in one call for the weights of `plan`
    (v4_plan at qa's rows): v4_inputs (qa, kv: the products' views; ones: the head RMS's unit weight or None;
    cos / sin the rotation), the rings' writes (comp_rows: the compressors' kv / gate views), sink_attention per
    sequence, v4_output (nsin: -sin); the same calls, the same bits. `place()` -> (bufs, srcs, seqs, ats,
    positions, lens, firsts, wins, win_rows, win_starts, window, sink, scale, entries, counts, mode, ratio, steps,
    threads) (cpu_src.py's v4_attention) is called once the call applies, and only then (it advances the states).
    [n, d], or None where it does not apply (nothing moved: the caller runs the code)."""
    if not (qa.dim() == kv.dim() == 2 and qa.dtype == kv.dtype == torch.bfloat16):
        return None
    n, D = kv.shape
    q_b, q_threads, q_a_norm, kv_norm, a, a_threads, o_b, b_threads = plan
    if not (
        qa.shape == (n, q_a_norm.shape[0]) and D == kv_norm.shape[0] and qa.stride(-1) == kv.stride(-1) == 1
    ):
        return None
    if not (
        cos.dim() == 2
        and cos.shape == sin.shape == nsin.shape
        and cos.shape[0] == n
        and 2 * cos.shape[1] <= D
    ):
        return None
    mod = _fused_mod(qa, kv, cos, sin, nsin)
    if mod is None or not (lanes := sum_lanes()):
        return None
    rope_threads, path = _fused_threads(n * heads * D), _path()
    stats["kernel_calls"] += 3  # q_b's product, o_a's and o_b's
    return mod.v4_attention(
        qa, kv, q_b, q_threads, q_a_norm, kv_norm, eps, _TY[qa.dtype], lanes, path, heads, ones, cos.contiguous(),
        sin.contiguous(), nsin.contiguous(), rope_threads, comp_rows, *place(), a, a_threads, o_b, b_threads,
    )  # fmt: skip


def compress_rows(
    kv,
    gate,
    ape,
    ratio: int,
    width: int,
    overlap: bool,
    has_prev: bool,
    norm,
    eps: float,
    freqs,
    factor: float,
    first: int,
):
    """layers/csa.py's compressor_update where windows close, after the raw rows' append, in one call: pool_windows
    over kv / gate [W ratio, proj_width] (whole windows, bf16 rows of unit stride), rms_norm_cast_once by `norm`,
    and the rotation of entries first .. first + W' - 1 at their first tokens (RopeTail: freqs, factor): the same
    ops and kernels, the same bits. (latent, rotated) [W', width], or None where it does not apply (the caller
    runs the code)."""
    if not (
        kv.dim() == 2
        and kv.dtype == gate.dtype == torch.bfloat16
        and kv.is_contiguous()
        and gate.is_contiguous()
    ):
        return None
    if not (norm.shape == (width,) and width <= MAX_NORM_WIDTH and 2 * freqs.shape[0] <= width):
        return None
    if not (ape.dtype == freqs.dtype == torch.float32 and kv.shape[0] % ratio == 0 and kv.shape[0]):
        return None
    if not (kv.shape == gate.shape and kv.shape[1] == (2 if overlap else 1) * width == ape.shape[-1]):
        return None
    mod = _fused_mod(kv, gate, ape, norm, freqs)
    if mod is None or not (lanes := sum_lanes()):
        return None
    entries = kv.shape[0] // ratio - (1 if overlap and has_prev else 0)
    threads = _fused_threads(entries * width)  # the norm's and the rope's, as their own calls take them
    return tuple(
        mod.compress_rows(
            kv, gate, ape, ratio, width, overlap, has_prev, norm.contiguous(), eps, lanes, threads, freqs, factor,
            first, threads,
        )
    )  # fmt: skip


def sink_threads(n: int, heads: int, dim: int, keys: int, window: int, entries: int) -> int:
    """sink_attention's threads for n queries over `keys` window rows (at most window + n read) and `entries`."""
    return _fused_threads(n * heads * (min(keys, window + n) + entries) * dim, ATTEND_PARALLEL)


def ssd_steps(x, dt, A, B, C, h, keep_states: bool):
    """Mamba-2's recurrent step (layers/mamba2.py's ssd_step) over x [m, H, P] token by token, in one call:
    (y [m, H, P], the final state, the state after every token [m, H, P, N] or None); None where it does not
    apply. exp(dt A) is torch's and the state update its float operations in order; y's sums over N go in
    index order (torch's einsum goes through a GEMM), so y agrees to rounding."""
    mod = _fused_mod(x, dt, A, B, C, h)
    if mod is None or not all(t.dtype == torch.float32 for t in (x, dt, A, B, C, h)):
        return None
    m, H, P = x.shape
    threads = _delta_threads(m, H, P, B.shape[-1])
    y, h, states = mod.ssd_steps(x, dt, torch.exp(dt * A), B, C, h, keep_states, threads)
    return y, h, (states if keep_states and m else None)


def mamba2_recur(xbc, dt, tail, conv_w, conv_b, A_log, D, ssm, dims, snapshot_last: int):
    """layers/mamba2.py's mamba2_recur (the causal conv, the split, the recurrent steps, the D skip) for rows the
    recurrent step takes whole (one row, or every row leaving a snapshot), in one call: the same torch ops, the
    same bits. (y [n, H P], the final state, the states after every row or None, the conv's inputs), or None
    where it does not apply (the caller runs the torch code)."""
    n = xbc.shape[0]
    if not (n == 1 or snapshot_last == n) or dt.dtype != torch.float32 or ssm.dtype != torch.float32:
        return None
    mod = _fused_mod(xbc, dt, tail, conv_w, A_log, D, ssm)
    if mod is None:
        return None
    H, P, G, N = dims.num_heads, dims.head_dim, dims.n_groups, dims.state_size
    keep = snapshot_last > 0
    y, h, states, seq = mod.mamba2_recur(
        xbc, dt, tail, conv_w, conv_b, A_log, D, ssm, H, P, G, N, keep, _delta_threads(n, H, P, N)
    )
    return y, h, (states if keep else None), seq


def rows_fit(offs, limit: int = MAX_ROWS) -> bool:
    """Whether every expert of a grouped call (offs: end rows) has at most `limit` rows (MAX_ROWS for
    packed stacks, `dense_rows()` for dense bf16 ones): then one grouped kernel call computes what one
    call per expert would (the rule a single matrix follows), bit for bit; otherwise the experts go one
    by one, each by that rule."""
    ends = offs.tolist() if isinstance(offs, torch.Tensor) else list(offs)
    return all(b - a <= limit for a, b in zip([0] + ends[:-1], ends))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x [T, K] grouped by expert (offs [E]: end rows) against a dense stack w [E, N, K] ->
    [T, N] in x's dtype, computed in w's dtype like `linear`: one kernel call for bf16 stacks (every
    expert with at most `dense_rows(K)` rows: `rows_fit`), else one `linear` per expert with rows (the same
    numbers either way)."""
    if x.dtype != w.dtype:
        return grouped_linear(x.to(w.dtype), w, offs).to(x.dtype)
    rows = dense_rows(w.shape[-1])
    if _dense_ok(x, w, rows * w.shape[0]) and rows_fit(offs, rows):
        return bf16_matmul(x, w, offs=offs)
    out = torch.empty(x.shape[0], w.shape[-2], dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = linear(x[start:end], w[e])
        start = end
    return out


def _native_bf16_gemm(cpuinfo: str | None = None) -> bool:
    """Whether oneDNN's bf16 GEMM (F.linear) is the fast prefill path on this CPU: with AMX tiles, and on AMD
    CPUs with avx512_bf16 (a Zen 4 core: 2.3-2.9x faster than the fp32 tiles at 32-256 rows). On an Intel Xeon
    with avx512_bf16 and no AMX, and on AVX2, it ran 3.4-12x slower than an fp32 GEMM on the same weights
    (docs/perf.md), so those take the fp32 tiles. `cpuinfo`: /proc/cpuinfo's text (read when None)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    lines = [ln for ln in cpuinfo.splitlines() if ln.startswith(("flags", "vendor_id"))][:2]
    flags = next((ln for ln in lines if ln.startswith("flags")), "").split()
    amd = any("AuthenticAMD" in ln for ln in lines)
    return "amx_bf16" in flags or (amd and "avx512_bf16" in flags)


_NATIVE_BF16 = _native_bf16_gemm()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX tiles; `_native_bf16_gemm`)."""
    return _NATIVE_BF16


def tiles_apply(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `tiled_linear` is the faster path for x [.., K] against the dense weight w: half-precision
    weights on the CPU, more rows than the kernels serve, no native bf16 GEMM. MOESAIC_CPU_KERNELS=0
    turns it off with the kernels (F.linear, the reference)."""
    return (
        w.dtype in (torch.bfloat16, torch.float16)
        and w.dim() == 2
        and x.dtype == w.dtype
        and x.is_cpu
        and w.is_cpu
        and x.numel() > MAX_ROWS * x.shape[-1]
        and not _NATIVE_BF16
        and enabled()
    )


def tiled_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T (+ bias)` for a bf16/fp16 weight [N, K] at prefill sizes: x converted to fp32 once,
    w converted TILE_ELEMS at a time and multiplied by torch's fp32 GEMM, the sum (and bias) in fp32,
    the result rounded once to x's dtype. Products of bf16 values are exact in fp32, so this is the
    kernels' arithmetic (fp32 accumulation, one rounding) in another summation order."""
    k, n = w.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k).float()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)
    rows = max(16, TILE_ELEMS // max(k, 1))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        out[:, r0:r1] = x2 @ w[r0:r1].float().T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def read_bandwidths(
    nbytes: int = 512 << 20, threads: int = 1, slice_bytes: int = 16 << 20, repeats: int = 64
) -> tuple[float, float]:
    """(best, median) GB/s of `repeats` streaming reads (4 rows at a time, like the kernels) of `slice_bytes`
    slices rotating through `nbytes` (more than the last-level cache), in the memory the weights are loaded
    into. The best is the benchmarks' read-bandwidth ceiling; the median is what a matrix read once a step
    meets (8-15 % lower on a VM, docs/perf.md). Raises if the kernels are unavailable."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"moesaic CPU kernels unavailable: {_state['error']}")
    row = 16384  # bytes per row, 4 rows read side by side
    step = max(4 * row, slice_bytes // (4 * row) * 4 * row)
    # huge pages where the system lends them: kernels/memory.py
    buf = memory.empty((max(step, nbytes // step * step),), torch.uint8).fill_(1)
    slices = [buf[i : i + step] for i in range(0, buf.numel(), step)]
    mod.read_bytes(buf, row, threads)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        mod.read_bytes(slices[i % len(slices)], row, threads)
        times.append(time.perf_counter() - t0)
    return step / min(times) / 1e9, step / statistics.median(times) / 1e9


def read_bandwidth(
    nbytes: int = 512 << 20, threads: int = 1, slice_bytes: int = 16 << 20, repeats: int = 64
) -> float:
    """The best of read_bandwidths: the benchmarks' read-bandwidth ceiling, measured in the same run."""
    return read_bandwidths(nbytes, threads, slice_bytes, repeats)[0]
