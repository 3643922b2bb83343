"""Fused CPU GEMV for packed FP4 weights (mxfp4, nvfp4) at small batch.

`y = x @ W.T` straight from the packed codes: each output row's bytes are decoded in registers
(16 nibbles -> 16 fp32 through a 16-entry table permute on AVX-512, a 256-entry byte -> pair table
elsewhere), multiplied by the group's fp32 scale (the same fp32 product the plain path's
`dequantize_rows` forms), and accumulated against an fp32 copy of x, OpenMP over output rows. The
weight is read once at its packed size, never written back as a dequantized tile.

Strictly optional. The C++ is compiled on first use with torch.utils.cpp_extension.load_inline
(-O3 -march=native -fopenmp; cached by torch under TORCH_EXTENSIONS_DIR or
~/.cache/torch_extensions, in a directory named after the source and this CPU's feature flags, so a
cache shared between different CPUs does not run foreign instructions). If the build fails (no
compiler, no ninja, ...) one RuntimeWarning is issued and every call returns False, leaving the
caller on its plain-torch path. MOESAIC_CPU_KERNELS=0 disables the kernel (read at each call).

Numerics: the dequantized weight value is the reference's fp32 value bit for bit; only the
summation order of the dot products differs (fp32 accumulation), so results match the fp32
reference to fp32 rounding; the output is cast to x's dtype once.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch

__all__ = ["MAX_ROWS", "enabled", "available", "load", "fp4_matmul", "try_matmul_2d", "stats"]

MAX_ROWS = 16  # the kernel serves x with at most this many rows (decode); larger M -> dense GEMM path
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

stats = {"kernel_calls": 0, "fallback_calls": 0}  # counters (tests, benchmarks)
_state: dict = {"tried": False, "mod": None, "error": None}
_TABLES: dict = {}

_CPP = r"""
#include <torch/extension.h>
#include <omp.h>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static const float E2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

#if defined(__AVX512F__)
// 16 elements (8 packed bytes, low nibble first) -> 16 fp32 values times scale s
static inline __m512 dec16(const uint8_t* p, __m512 lut, __m128i mask, float s) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    __m128i lo = _mm_and_si128(b, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    return _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), _mm512_set1_ps(s));
}

// MB rows of x (row stride K) against packed row `crow`; y[m * N] += nothing: writes the dots.
template <int MB>
static inline void row_avx512(const float* x, int64_t K, const uint8_t* crow, const uint8_t* srow,
                              const float* stab, int64_t G, float* y, int64_t N) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const int sh = G == 16 ? 4 : 5;  // k / G without a division
    __m512 a0[MB], a1[MB];
    for (int m = 0; m < MB; ++m) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 w0 = dec16(crow + k / 2, lut, mask, stab[srow[k >> sh]]);
        __m512 w1 = dec16(crow + k / 2 + 8, lut, mask, stab[srow[(k + 16) >> sh]]);
        for (int m = 0; m < MB; ++m) {
            a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, a0[m]);
            a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), w1, a1[m]);
        }
    }
    if (k < K) {  // K % 32 == 16 (nvfp4)
        __m512 w0 = dec16(crow + k / 2, lut, mask, stab[srow[k >> sh]]);
        for (int m = 0; m < MB; ++m)
            a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, a0[m]);
    }
    for (int m = 0; m < MB; ++m) y[m * N] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}
#endif

// portable path: decode one row to fp32 (pair table), then M dot products (omp simd reduction)
static inline void row_generic(const float* x, int64_t M, int64_t K, const uint8_t* crow,
                               const uint8_t* srow, const float* stab, int64_t G, float* y, int64_t N,
                               float* wbuf) {
    for (int64_t g = 0; g < K / G; ++g) {
        const float s = stab[srow[g]];
        const uint8_t* p = crow + g * G / 2;
        float* w = wbuf + g * G;
        for (int64_t j = 0; j < G / 2; ++j) {
            w[2 * j] = E2M1[p[j] & 15] * s;
            w[2 * j + 1] = E2M1[p[j] >> 4] * s;
        }
    }
    for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += xm[k] * wbuf[k];
        y[m * N] = acc;
    }
}

// x fp32 [M, K] contiguous; codes uint8 [N, K/2] (unit stride in the last dim); scales uint8
// [N, K/G] (idem); stab fp32 [256]: scale byte -> fp32 multiplier. Returns y fp32 [M, N].
torch::Tensor fp4_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor stab,
                       int64_t G, int64_t nthreads, bool generic) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: fp32 [M, K] contiguous");
    TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.stride(1) == 1, "codes: uint8 [N, K/2]");
    TORCH_CHECK(scales.dtype() == torch::kUInt8 && scales.dim() == 2 && scales.stride(1) == 1, "scales: uint8 [N, K/G]");
    TORCH_CHECK(stab.dtype() == torch::kFloat32 && stab.numel() == 256 && stab.is_contiguous(), "stab: fp32 [256]");
    const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
    TORCH_CHECK(G == 16 || G == 32, "group must be 16 or 32");
    TORCH_CHECK(K % G == 0 && codes.size(1) * 2 == K && scales.size(0) == N && scales.size(1) == K / G,
                "shape mismatch");
    auto y = torch::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const uint8_t* sp = scales.data_ptr<uint8_t>();
    const float* tp = stab.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t cs = codes.stride(0), ss = scales.stride(0);
    int nt = nthreads > 0 ? (int)nthreads : 1;
    if (N < 64) nt = 1;
#if !defined(__AVX512F__)
    generic = true;
#endif
#pragma omp parallel num_threads(nt)
    {
        std::vector<float> wbuf(generic ? K : 0);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t* crow = cp + n * cs;
            const uint8_t* srow = sp + n * ss;
            if (generic) {
                row_generic(xp, M, K, crow, srow, tp, G, yp + n, N, wbuf.data());
                continue;
            }
#if defined(__AVX512F__)
            for (int64_t m0 = 0; m0 < M; m0 += 8) {
                const float* xm = xp + m0 * K;
                float* ym = yp + m0 * N + n;
                switch (M - m0 >= 8 ? 8 : M - m0) {
                    case 1: row_avx512<1>(xm, K, crow, srow, tp, G, ym, N); break;
                    case 2: row_avx512<2>(xm, K, crow, srow, tp, G, ym, N); break;
                    case 3: row_avx512<3>(xm, K, crow, srow, tp, G, ym, N); break;
                    case 4: row_avx512<4>(xm, K, crow, srow, tp, G, ym, N); break;
                    case 5: row_avx512<5>(xm, K, crow, srow, tp, G, ym, N); break;
                    case 6: row_avx512<6>(xm, K, crow, srow, tp, G, ym, N); break;
                    case 7: row_avx512<7>(xm, K, crow, srow, tp, G, ym, N); break;
                    default: row_avx512<8>(xm, K, crow, srow, tp, G, ym, N); break;
                }
            }
#endif
        }
    }
    return y;
}

bool has_avx512() {
#if defined(__AVX512F__)
    return true;
#else
    return false;
#endif
}
"""


def enabled() -> bool:
    """False when MOESAIC_CPU_KERNELS=0 (or 'false'/'off'/'no')."""
    return os.environ.get("MOESAIC_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def load(verbose: bool = False):
    """The compiled module (building it on the first call), or None when it cannot be built."""
    if _state["tried"]:
        return _state["mod"]
    _state["tried"] = True
    try:
        from torch.utils.cpp_extension import load_inline

        _state["mod"] = load_inline(
            name=f"moesaic_cpu_fp4_{_cpu_tag()}",
            cpp_sources=_CPP,
            functions=["fp4_gemv", "has_avx512"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=verbose,
        )
    except Exception as e:  # no compiler, no ninja, unsupported flags, ...: plain path
        _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        warnings.warn(
            f"moesaic: the fused CPU fp4 kernel could not be built ({_state['error']}); packed "
            f"fp4 matmuls use the plain-torch path (set MOESAIC_CPU_KERNELS=0 to skip the build)",
            RuntimeWarning,
            stacklevel=2,
        )
    return _state["mod"]


def available() -> bool:
    """Enabled and built (builds on the first call)."""
    return enabled() and load() is not None


def _scale_table(fmt: str, g: torch.Tensor | None, divides: bool) -> torch.Tensor:
    """fp32 [256]: scale byte -> the fp32 multiplier dequantize_rows applies."""
    from ..weights.quant import e4m3_to_float, e8m0_to_float

    if fmt not in _TABLES:
        b = torch.arange(256, dtype=torch.int64).to(torch.uint8)
        _TABLES["mxfp4"] = e8m0_to_float(b).contiguous()
        _TABLES["nvfp4"] = e4m3_to_float(b).contiguous()
    t = _TABLES[fmt]
    if fmt == "nvfp4":  # the same fp32 op as dequantize_rows: s / g or s * g
        g = g.to(torch.float32)
        t = t / g if divides else t * g
    return t


def fp4_matmul(
    x2: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    stab: torch.Tensor,
    group: int,
    *,
    threads: int | None = None,
    generic: bool = False,
) -> torch.Tensor:
    """Raw kernel call: x2 [M, K] (any float dtype), codes uint8 [N, K/2], scale bytes [N, K/group],
    stab fp32 [256] -> fp32 [M, N]. Raises if the kernel is unavailable."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"fused CPU fp4 kernel unavailable: {_state['error']}")
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    if scales.stride(-1) != 1:
        scales = scales.contiguous()
    xf = x2.to(torch.float32).contiguous()
    nt = threads if threads is not None else torch.get_num_threads()
    return mod.fp4_gemv(xf, codes, scales, stab, group, nt, generic)


def try_matmul_2d(qt, x2: torch.Tensor, out: torch.Tensor, b: int) -> bool:
    """out[:] = x2 @ W_b.T with the fused kernel when it applies (fp4 format, CPU tensors, M <=
    MAX_ROWS, x fp32/bf16/fp16, enabled and built); returns False (nothing written) otherwise."""
    if (
        qt.format not in ("mxfp4", "nvfp4")
        or x2.device.type != "cpu"
        or qt.codes.device.type != "cpu"
        or x2.dtype not in _X_DTYPES
        or not 0 < x2.shape[0] <= MAX_ROWS
        or not enabled()
    ):
        stats["fallback_calls"] += 1
        return False
    if load() is None:
        stats["fallback_calls"] += 1
        return False
    codes, scale, g = qt._matrix(b)
    stab = _scale_table(qt.format, g, qt.global_divides)
    group = 32 if qt.format == "mxfp4" else 16
    y = fp4_matmul(x2, codes, scale.view(torch.uint8), stab, group)
    out.copy_(y)
    stats["kernel_calls"] += 1
    return True
