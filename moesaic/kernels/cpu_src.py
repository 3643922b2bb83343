"""C++ source of the CPU decode kernels (compiled by `kernels/cpu.py`); see that module for the API.

One routine serves three weight encodings, a single matrix or a stack of experts:

    y[t, n] = sum_k x[t, k] * W_e[n, k]      for the rows t of expert e (offs: end offsets per expert)

  bf16   W bf16 [E, N, K]: 8 values -> fp32 by a 16-bit shift (vpmovzxwd + vpslld).
  fp8    W E4M3 [E, N, K] + a scale per [bn, bk] block (fp32, or E8M0 bytes): 16 bytes -> sign-extended
         words, `<< 7` and a mask give the fp16 bits of value * 2^-8 (E4M3 subnormals become fp16
         subnormals, converted exactly by vcvtph2ps) where rows are dequantized; the products take 8 bytes
         sign-extended to dwords, `<< 20` and a mask (value * 2^-120; x pre-multiplied by 2^64, the block
         scales by 2^56), the block scale applied to each 32-value partial sum.
  fp4    E2M1 packed [E, N, K/2] + a scale byte per group of 16 (E4M3, times or over the matrix's
         global scale: nvfp4) or 32 (E8M0: mxfp4). 32 bytes (64 values) per step: the two nibble
         planes index two 16-entry byte tables (vpshufb) giving the upper 16 bits of each value's fp32
         encoding, interleaved (vpunpck*bw) and split into dwords by a shift / a mask: 64 values from
         one load, no per-16 shuffle. Products are summed per group lane and scaled once per group.
         Where asked (gemm's Q8_PATH: MOESAIC_CPU_INT8_ACTIVATIONS=1), x rounded to int8 a block of 32
         (prep_x_q8) instead: the nibbles index a table of 2 x value + 12 for vpmaddubsw against the codes,
         one int32 per 8 values (vpmaddwd), the offset taken off, each group's and block's scales applied
         to the converted sums (the MXQ / NVQ tiles; not the reference's bits, an opt-in). With AVX-512
         VNNI and VBMI the same records meet 128 values a load (q8z_tile: vpermb lookups, vpdpbusd),
         bf16 and fp32 x alike.

Decoded vectors come out in a fixed order inside each 64-value chunk; x is permuted once per call to
match (prep_x), so the inner loop has no shuffles on x. Accumulation is fp32 (FMA); each output is
rounded once to the output dtype (fp32, bf16 or fp16, round to nearest even).

Register tiles: R weight rows x MB <= 4 activation rows per pass (R * MB <= 8 accumulators). Up to 4
activation rows, and up to 16 whose x fits in 256 KB, stream every weight row whole, front to back (4 weight
rows at a time, each block of 4 activation rows in turn); more go by blocks of K and of 32 weight rows, so
that a block of x stays in L1 and the weights' block in L2 while each block of 4 activation rows passes over
them (run_item). Work items (expert, block of weight rows) are shared out
by OpenMP with the thread count the caller chooses.

Also small fused routines that replace chains of small torch ops with the same float operations (the
per-step overhead of a decode step): mHC's Sinkhorn rounds, RMSNorm (one pass per row; the mean of the
squares summed in the order of torch's cascade sum) and rope.

Built with -march=native: the AVX2 + FMA + F16C path is compiled where the compiler targets them
(`__AVX2__`, `__FMA__`, `__F16C__`), the portable scalar path (same math, row decoded to fp32 first)
everywhere and on request (`generic`). On CPUs with AVX-512 BF16 and VBMI (`__AVX512BF16__`: Zen 4, Sapphire
Rapids; not Cooper Lake, whose build takes the AVX2 tiles) bf16 activations take vdpbf16ps instead
(run_item_dp), against bf16 weights (32 a load, used as stored), E2M1 (128 a load, decoded to bf16 by one
32-word table, vpermw) and E4M3 (64 a load, by two 128-entry byte tables): 16 fp32 lanes of pair sums, tiles of 4 weight rows x 4 activation rows;
a prompt's E2M1 and E8M0-scaled E4M3 rows (more than MAX_ROWS x rows) are decoded to exact bf16 a block at a time
for the bf16 prompt tiles (run_item_decoded; past PAIR_WIDE_K columns for the pair tiles instead), and its
fp32-scaled E4M3 rows (PAIR_ROWS or more) decoded without their scales for the pair tiles (run_item_pairs: x packed
by value pairs, 16 x rows a vector, each k-block's sums scaled once). fp32 / fp16 activations keep the AVX2 path. On CPUs with AMX (`__AMX_BF16__`: Sapphire Rapids and later, Linux) bf16 x
bf16 products take AMX tiles at every row count instead (amx_item: the weights as the A operand in place,
x packed once a call as B, 16 weight rows x up to 32 activation rows a tile pass), and packed weights
against 8 or more bf16 rows (AMX_PACKED_ROWS) are decoded to bf16 a block of rows at a time (decode_bf16_row; group
scales folded where the product is exact in bf16, fp32 block scales applied to each k-block's sums) and
multiplied by the same tiles.
"""

CPP = r"""
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Float8_e4m3fn.h>
#include <omp.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <array>
#include <atomic>
#include <chrono>
#include <optional>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MOESAIC_AVX2 1
#include <immintrin.h>
#endif
// (VBMI too: the fp8 decode's byte tables are vpermi2b; a BF16 CPU without it, Cooper Lake, takes the AVX2 tiles)
#if defined(MOESAIC_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AVX512VBMI__)
#define MOESAIC_AVX512BF16 1
#endif
#if defined(MOESAIC_AVX512BF16) && defined(__AVX512VNNI__)
#define MOESAIC_VNNI512 1
#endif
#if defined(MOESAIC_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MOESAIC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// The Python side passes BF16, FP8 or FP4; FP4 becomes MX (groups of 32) or NV (16) here. MXQ / NVQ: the
// AVX2 tiles of MX / NV against int8 activation rows (gemm's path bit Q8_PATH; the call's Ctx keeps MX / NV).
enum Kind { BF16 = 0, FP8 = 1, FP4 = 2, MX = 2, NV = 3, MXQ = 4, NVQ = 5 };
constexpr int64_t Q8_PATH = 4;

// f(std::integral_constant<int, V>{}) for the first V of Vs equal to v, else for the last: a runtime choice (a
// weight kind, a group of heads) made a template argument once.
template <int V, int... Vs, class F>
inline void with_value(int64_t v, F&& f) {
    if constexpr (sizeof...(Vs) == 0) f(std::integral_constant<int, V>{});
    else if (v == V) f(std::integral_constant<int, V>{});
    else with_value<Vs...>(v, std::forward<F>(f));
}
constexpr int64_t CH = 64;                                 // K values per chunk
constexpr int64_t QREC = 64;                               // floats of one 128-value int8 x record (prep_x_q8)
// rows of x from which packed weights take AMX tiles (decoded to bf16 a block at a time) where the CPU has
// them: below, the in-register decode of the vdpbf16ps path is faster (one thread, 1024 x 1024, AMX over it:
// E2M1 0.4-0.5x at 1-2 rows, 0.7-0.8x at 4, 1.2-1.4x at 8, 2.2-2.5x at 16; E4M3 0.7x at 4, 1.1x at 8, 1.5x at 12)
constexpr int64_t AMX_PACKED_ROWS[4] = {0, 8, 8, 8};
// ... and E2M1 weights against int8 activation rows on VNNI (q8z_tile): AMX from 12 rows (one thread, 4096 x
// 4096 from memory, VNNI over AMX: 1.3-1.7x at 8 rows, 1.0-1.2x at 12, 0.8-1.0x at 16)
constexpr int64_t AMX_Q8_ROWS = 12;
constexpr int64_t CHUNK_BYTES[6] = {128, 64, 32, 32, 32, 32};  // bytes of one chunk of one row

float E8M0[256], E4M3[256];
const float E2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
// fp32 bits 31..24 and 23..16 of each E2M1 value (the lower 16 bits are zero)
alignas(16) const uint8_t E2M1_B3[16] = {0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                         0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0};
alignas(16) const uint8_t E2M1_B2[16] = {0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                         0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0};
// 2 x each E2M1 value + 12: an unsigned byte for vpmaddubsw (the int8 x record carries the -12 x sum)
alignas(16) const uint8_t E2M1_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
int FP4_PERM[CH];  // position in the decoded chunk -> element of the chunk
// bf16 bytes (high, low) of the E4M3 values of the magnitude codes 0..127 (exact: <= 4 significant bits);
// the NaN code decodes as 480, as on the AVX2 path
alignas(64) uint8_t E4M3_BF16_HI[128], E4M3_BF16_LO[128];

// the bf16 bits of each E2M1 value (a 32-word vpermw table: codes 0-15, twice); the word order that
// interleaves 16 low and 16 high nibbles (vpermt2w: 2j <- low j, 2j + 1 <- high j)
alignas(64) uint16_t E2M1_BF16W[32], NIB_ORDER[32];

float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

bool init_tables() {
    for (int e = 0; e < 256; ++e)  // OCP E8M0: 2^(e-127), e = 0 -> 2^-127 (subnormal), 255 -> NaN
        E8M0[e] = bits_to_float(e == 0 ? 0x00400000u : e == 255 ? 0x7FC00000u : (uint32_t)e << 23);
    for (int b = 0; b < 256; ++b) {  // E4M3 "fn": bias 7, no inf, S.1111.111 NaN
        int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
        float v = (e == 15 && m == 7) ? NAN : (e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.f + m / 8.f, e - 7));
        E4M3[b] = s ? -v : v;
    }
    for (int i = 0; i < 32; ++i) {
        uint32_t u;
        std::memcpy(&u, &E2M1[i % 16], 4);
        E2M1_BF16W[i] = (uint16_t)(u >> 16);
        NIB_ORDER[i] = (uint16_t)(i % 2 ? 32 + i / 2 : i / 2);
    }
    for (int b = 0; b < 128; ++b) {
        uint32_t u;
        const float v = b == 0x7F ? 480.f : E4M3[b];
        std::memcpy(&u, &v, 4);
        E4M3_BF16_HI[b] = (uint8_t)(u >> 24);
        E4M3_BF16_LO[b] = (uint8_t)(u >> 16);
    }
    // fp4 chunk: vector j (0..7) slot i (0..7). Lane = i / 4 covers bytes 16*lane..+15; vectors 0-3 come
    // from the low 8 bytes of each lane, 4-7 from the high 8; even j the even words, odd j the odd.
    for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 8; ++i) {
            int lane = i / 4, t = i % 4, src = j / 2, odd = j & 1;  // src: 0 lo-nibbles/bytes 0-7, 1 hi/0-7,
            int half = src >= 2, hi = src & 1;                        // 2 lo/8-15, 3 hi/8-15
            int byte = 16 * lane + 8 * half + 2 * t + odd;
            FP4_PERM[8 * j + i] = 2 * byte + hi;
        }
    return true;
}
const bool tables_ready = init_tables();

// One call's shape, shared by every work item.
struct Ctx {
    int kind;
    int64_t K, nfull, tail_bytes;  // full chunks; bytes of the partial last chunk (0: none)
    int group;                     // fp4 group (16 / 32)
    int64_t ngroups;               // fp4 groups per row
    const int32_t* sub2blk;        // fp8: 32-value sub-chunk -> k-block (-1 beyond K)
};

// The bytes of one weight row and its scales.
struct Row {
    const uint8_t* w;
    const uint8_t* s8;  // fp4: the row's scale bytes; fp8: the row-block's E8M0 bytes
    const float* sf;    // fp8: the row-block's fp32 scales
    const float* stab;  // fp4: scale byte -> fp32 multiplier
};

inline float fp4_scale(const Ctx& C, const Row& r, int64_t g) { return g < C.ngroups ? r.stab[r.s8[g]] : 0.f; }
inline float fp8_scale(const Row& r, int32_t b) { return b < 0 ? 0.f : (r.sf ? r.sf[b] : E8M0[r.s8[b]]); }

#if defined(MOESAIC_AVX2)
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256 lanes(float lo, float hi) { return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)); }

// 8 bf16 values at p -> fp32 (exact: the bits shifted into the high half)
inline __m256 widen_bf16(const void* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void dec_fp8(const uint8_t* p, __m256 w[8]) {
    const __m256i keep = _mm256_set1_epi16((short)0xBFFF);  // clears the sign-extension bit 14
    for (int q = 0; q < 4; ++q) {
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q)));
        h = _mm256_and_si256(_mm256_slli_epi16(h, 7), keep);  // s.0.eeee.mmm.0000000 = fp16 of v * 2^-8
        w[2 * q] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        w[2 * q + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
}

inline void dec_fp4(const uint8_t* p, __m256 w[8]) {
    const __m256i t3 = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_B3)));
    const __m256i t2 = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_B2)));
    const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
    const __m256i l3 = _mm256_shuffle_epi8(t3, lo), l2 = _mm256_shuffle_epi8(t2, lo);
    const __m256i h3 = _mm256_shuffle_epi8(t3, hi), h2 = _mm256_shuffle_epi8(t2, hi);
    const __m256i src[4] = {_mm256_unpacklo_epi8(l2, l3), _mm256_unpacklo_epi8(h2, h3),
                            _mm256_unpackhi_epi8(l2, l3), _mm256_unpackhi_epi8(h2, h3)};
    for (int s = 0; s < 4; ++s) {
        w[2 * s] = _mm256_castsi256_ps(_mm256_slli_epi32(src[s], 16));
        w[2 * s + 1] = _mm256_castsi256_ps(_mm256_and_si256(src[s], top));
    }
}

// E4M3 for the products: 8 bytes sign-extended to dwords, `<< 20` and a mask put sign, exponent and mantissa
// where fp32 keeps them, so each value comes out times 2^-120 (E4M3 subnormals as fp32 subnormals, exact);
// x is pre-multiplied by 2^64 (FP8_X) and each block scale by 2^56 (FP8_SUM). Three integer ops per 8
// values: on a Zen 3 core 1.3-1.5x the fp16 trick's rate (docs/perf.md), which stays for dequantizing rows.
constexpr float FP8_X = 0x1p64f, FP8_SUM = 0x1p56f;
inline void dec_fp8_scaled(const uint8_t* p, __m256 w[8]) {
    const __m256i keep = _mm256_set1_epi32((int)0x87F00000u);
    for (int v = 0; v < 8; ++v) {
        const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
        w[v] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), keep));
    }
}

inline void dec(int kind, const uint8_t* p, __m256 w[8]) {  // the packed kinds (bf16 is widened in step)
    if (kind == FP8) dec_fp8_scaled(p, w);
    else dec_fp4(p, w);
}

// Scales of chunk c of row r for vectors 0-3 (sA) and 4-7 (sB; MX: sA for all 8). FULL: a chunk
// inside K (the partial last chunk has zero scales beyond K).
template <int KIND, bool FULL>
inline void scales(const Ctx& C, const Row& r, int64_t c, __m256& sA, __m256& sB) {
    if constexpr (KIND == FP8) {  // times FP8_SUM: the products' 2^-56 (gemm checks that no scale overflows)
        sA = _mm256_set1_ps(fp8_scale(r, C.sub2blk[2 * c]) * FP8_SUM);
        sB = _mm256_set1_ps(fp8_scale(r, C.sub2blk[2 * c + 1]) * FP8_SUM);
    } else if constexpr (KIND == MX) {  // lane 0 = group 2c, lane 1 = group 2c + 1
        const int64_t g = 2 * c;
        sA = FULL ? lanes(r.stab[r.s8[g]], r.stab[r.s8[g + 1]]) : lanes(fp4_scale(C, r, g), fp4_scale(C, r, g + 1));
    } else if constexpr (KIND == NV) {  // vectors 0-3: groups 4c (lane 0), 4c + 2 (lane 1); 4-7: 4c + 1, 4c + 3
        const int64_t g = 4 * c;
        if (FULL) {
            const uint8_t* s = r.s8 + g;
            sA = lanes(r.stab[s[0]], r.stab[s[2]]);
            sB = lanes(r.stab[s[1]], r.stab[s[3]]);
        } else {
            sA = lanes(fp4_scale(C, r, g), fp4_scale(C, r, g + 2));
            sB = lanes(fp4_scale(C, r, g + 1), fp4_scale(C, r, g + 3));
        }
    }
}

// The int8 tiles' weight scales of chunk c, one per dword of the chunk's sums: MXQ groups 2c (dwords 0-3) and
// 2c + 1 (4-7); NVQ groups 4c, 4c + 1 (dwords 0-1, 2-3), 4c + 2, 4c + 3 (4-5, 6-7).
// Built by broadcasts from the table (load ports) and blends: shuffles would queue behind the nibble lookups.
template <int KIND, bool FULL>
inline __m256 scales_q8(const Ctx& C, const Row& r, int64_t c) {
    static const float zero = 0.f;
    auto at = [&](int64_t g) { return _mm256_broadcast_ss(FULL || g < C.ngroups ? &r.stab[r.s8[g]] : &zero); };
    if constexpr (KIND == MXQ) {
        return _mm256_blend_ps(at(2 * c), at(2 * c + 1), 0xF0);
    } else {
        const int64_t g = 4 * c;
        return _mm256_blend_ps(_mm256_blend_ps(at(g), at(g + 1), 0xCC), _mm256_blend_ps(at(g + 2), at(g + 3), 0xCC), 0xF0);
    }
}

// acc[r][m] += chunk c of weight rows r (bytes at p[r]) . x rows m
template <int KIND, int R, int MB, bool FULL>
inline void step(const Ctx& C, const Row* rows, const uint8_t* const* p, int64_t c, const float* x, int64_t xs,
                 __m256 (&acc)[R][MB]) {
    if constexpr (KIND == BF16) {  // by quarters of the chunk: each x vector loaded once for the R rows
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            __m256 w[R][2];
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
                for (int j = 0; j < 2; ++j) w[r][j] = widen_bf16(p[r] + 32 * q + 16 * j);
#pragma GCC unroll 4
            for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
                for (int j = 0; j < 2; ++j) {
                    const __m256 xv = _mm256_loadu_ps(x + m * xs + c * CH + 16 * q + 8 * j);
#pragma GCC unroll 4
                    for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(w[r][j], xv, acc[r][m]);
                }
        }
        return;
    }
    if constexpr (KIND == MXQ || KIND == NVQ) {  // x: int8 records (prep_x_q8)
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_U)));
        const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[r]));
            const __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(b, nib));  // the even values' bytes
            const __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(b, 4), nib));
            const __m256 ws = scales_q8<KIND, FULL>(C, rows[r], c);
#pragma GCC unroll 4
            for (int m = 0; m < MB; ++m) {
                // chunk c is half c % 2 of record c / 2: each field's 32 bytes at 32 (c % 2) in it
                const auto* rec = reinterpret_cast<const __m256i*>(x + m * xs + (c >> 1) * QREC + (c & 1) * 8);
                // byte pairs <= 2 x 24 x 127 and two of them summed: no int16 saturation
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(rec)),
                                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256(rec + 2)));
                const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_loadu_si256(rec + 4));
                const __m256 sc = _mm256_mul_ps(ws, _mm256_castsi256_ps(_mm256_loadu_si256(rec + 6)));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[r][m]);
            }
        }
        return;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        __m256 w[8], sA, sB;
        dec(KIND, p[r], w);
        scales<KIND, FULL>(C, rows[r], c, sA, sB);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
            const float* xm = x + m * xs + c * CH;
            if constexpr (KIND == BF16) {
#pragma GCC unroll 8
                for (int j = 0; j < 8; ++j) acc[r][m] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xm + 8 * j), acc[r][m]);
            } else {
                __m256 pA = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
                __m256 pB = _mm256_mul_ps(w[4], _mm256_loadu_ps(xm + 32));
#pragma GCC unroll 4
                for (int j = 1; j < 4; ++j) {
                    pA = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xm + 8 * j), pA);
                    pB = _mm256_fmadd_ps(w[j + 4], _mm256_loadu_ps(xm + 32 + 8 * j), pB);
                }
                if constexpr (KIND == MX) acc[r][m] = _mm256_fmadd_ps(_mm256_add_ps(pA, pB), sA, acc[r][m]);
                else acc[r][m] = _mm256_fmadd_ps(pB, sB, _mm256_fmadd_ps(pA, sA, acc[r][m]));
            }
        }
    }
}

bool amd_cpu() {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
}
const bool NTA_AHEAD = amd_cpu();  // tile's prefetch hint (below)

// res[m * R + r] = dot over chunks [c0, c1) (+ the partial last chunk if `tail`) of x row m and weight
// row r, for R weight rows and MB activation rows. The partial chunk is read through zero-padded
// copies of the rows' tails.
template <int KIND, int R, int MB>
void tile(const Ctx& C, const Row* rows, const float* x, int64_t xs, int64_t c0, int64_t c1, bool tail, float* res) {
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    const uint8_t* p[R];
    for (int64_t c = c0; c < c1; ++c) {
        // 8 chunks ahead: the first pass over a K block at M > 1 is not streamed by the hardware prefetcher
        // (measured). Non-temporal on AMD, as a weight is read once a step: on a Zen 3 core the NTA hint made
        // one row against 8 MB of weights 6-7 % faster (a 67 MB head 6 %), whole decode steps 2-4 %, 2-16 rows
        // level. Into L1 elsewhere: on a Sapphire Rapids-class Xeon the NTA hint made fp32 x against 196 KB of
        // cold bf16 rows 3.4x slower than T0 or no hint (31 vs 9 us; docs/perf.md).
        for (int r = 0; r < R; ++r) {
            p[r] = rows[r].w + c * CHUNK_BYTES[KIND];
            const char* ahead = reinterpret_cast<const char*>(p[r]) + 8 * CHUNK_BYTES[KIND];
            if (NTA_AHEAD) {
                _mm_prefetch(ahead, _MM_HINT_NTA);
                if (KIND == BF16) _mm_prefetch(ahead + 64, _MM_HINT_NTA);
            } else {
                _mm_prefetch(ahead, _MM_HINT_T0);
                if (KIND == BF16) _mm_prefetch(ahead + 64, _MM_HINT_T0);
            }
        }
        step<KIND, R, MB, true>(C, rows, p, c, x, xs, acc);
    }
    if (tail) {
        alignas(32) uint8_t pad[R][128];
        std::memset(pad, 0, sizeof(pad));
        for (int r = 0; r < R; ++r) {
            std::memcpy(pad[r], rows[r].w + C.nfull * CHUNK_BYTES[KIND], C.tail_bytes);
            p[r] = pad[r];
        }
        step<KIND, R, MB, false>(C, rows, p, C.nfull, x, xs, acc);
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) res[m * R + r] = hsum(acc[r][m]);
}

template <int KIND, int R>
void tile_mb(int mb, const Ctx& C, const Row* rows, const float* x, int64_t xs, int64_t c0, int64_t c1, bool tail,
             float* res) {
    if constexpr (R == 4) {  // R * MB <= 8 accumulators
        if (mb == 1) tile<KIND, 4, 1>(C, rows, x, xs, c0, c1, tail, res);
        else tile<KIND, 4, 2>(C, rows, x, xs, c0, c1, tail, res);
    } else {
        switch (mb) {
            case 1: tile<KIND, R, 1>(C, rows, x, xs, c0, c1, tail, res); break;
            case 2: tile<KIND, R, 2>(C, rows, x, xs, c0, c1, tail, res); break;
            case 3: tile<KIND, R, 3>(C, rows, x, xs, c0, c1, tail, res); break;
            default: tile<KIND, R, 4>(C, rows, x, xs, c0, c1, tail, res); break;
        }
    }
}

// acc[pos[n] * M + m] += x rows [0, M) . weight rows [n0, n1) (rows[n - n0]) over chunks [c0, c1) (+ tail).
// Activation blocks of up to 4 rows; weight rows in groups of 4 (bf16 and the int8 tiles, memory-bound: four streams)
// or 1-2 (fp8 / fp4, decode-bound: one row at a time streams best, measured).
template <int KIND>
void rows_pass(const Ctx& C, const Row* rows, int64_t n0, int64_t n1, const float* x, int64_t xs, int64_t M,
               int64_t c0, int64_t c1, bool tail, const int64_t* pos, float* acc) {
    float res[16];
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mb = (int)std::min<int64_t>(4, M - m0);
        const float* xm = x + m0 * xs;
        for (int64_t n = n0; n < n1; n += 4) {
            const int64_t nr = std::min<int64_t>(4, n1 - n);
            const Row* rg = rows + (n - n0);
            auto add = [&](int64_t r0, int R) {
                for (int m = 0; m < mb; ++m)
                    for (int r = 0; r < R; ++r) acc[pos[n + r0 + r] * M + m0 + m] += res[m * R + r];
            };
            int64_t r = 0;
            constexpr bool streams = KIND == BF16 || KIND == MXQ || KIND == NVQ;  // memory-bound: 4 streams
            if (streams && nr == 4 && mb <= 2) {
                tile_mb<KIND, 4>(mb, C, rg, xm, xs, c0, c1, tail, res);
                add(0, 4);
                r = 4;
            }
            if (streams || mb > 2)
                for (; r + 2 <= nr; r += 2) {
                    tile_mb<KIND, 2>(mb, C, rg + r, xm, xs, c0, c1, tail, res);
                    add(r, 2);
                }
            for (; r < nr; ++r) {
                tile_mb<KIND, 1>(mb, C, rg + r, xm, xs, c0, c1, tail, res);
                add(r, 1);
            }
        }
    }
}
#endif  // MOESAIC_AVX2

// Portable path: the row decoded to fp32 (the reference's per-element products), then dot products
// with the unpermuted x.
void decode_row_generic(const Ctx& C, const Row& r, float* w) {
    const int64_t K = C.K;
    if (C.kind == BF16) {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(r.w);
        for (int64_t k = 0; k < K; ++k) w[k] = bits_to_float((uint32_t)p[k] << 16);
    } else if (C.kind == FP8) {
        for (int64_t k = 0; k < K; ++k) w[k] = E4M3[r.w[k]] * fp8_scale(r, C.sub2blk[k / 32]);
    } else {
        for (int64_t k = 0; k < K; k += 2) {
            const uint8_t b = r.w[k / 2];
            const float s = r.stab[r.s8[k / C.group]];
            w[k] = E2M1[b & 15] * s;
            w[k + 1] = E2M1[b >> 4] * s;
        }
    }
}

struct Out {
    void* p;
    int dtype;  // 0 fp32, 1 bf16, 2 fp16
    int64_t ld;
    const float* bias;
};

inline void put(const Out& O, int64_t t, int64_t n, float v) {
    if (O.bias) v += O.bias[n];
    const int64_t i = t * O.ld + n;
    if (O.dtype == 0) static_cast<float*>(O.p)[i] = v;
    else if (O.dtype == 1) static_cast<c10::BFloat16*>(O.p)[i] = c10::BFloat16(v);
    else static_cast<c10::Half*>(O.p)[i] = c10::Half(v);
}

// Everything a work item needs to find expert e's row n.
struct Weights {
    const uint8_t* w;
    int64_t w_e, w_n;   // byte strides
    const uint8_t* s;   // scales (bytes or fp32)
    int64_t s_e, s_n;   // byte strides (fp8: per row-block)
    bool s_f32;
    int64_t bn;         // fp8 row block
    int bn_shift;       // log2(bn) where bn is a power of two (row_of's block without a division), else -1
    const float* stab;  // fp4: one 256-entry table per active expert (nvfp4) or the E8M0 table
    bool stab_per_expert;
    const float* gsc;   // nvfp4: the global scale of each matrix (null: none)
    bool divides;       // nvfp4: scale / global (else scale * global)
};

inline Row row_of(const Ctx& C, const Weights& W, int64_t e, int64_t slot, int64_t n) {
    Row r{W.w + e * W.w_e + n * W.w_n, nullptr, nullptr, nullptr};
    if (C.kind == MX || C.kind == NV) {
        r.s8 = W.s + e * W.s_e + n * W.s_n;
        r.stab = W.stab_per_expert ? W.stab + 256 * slot : W.stab;
    } else if (C.kind == FP8) {
        const uint8_t* s = W.s + e * W.s_e + (W.bn_shift >= 0 ? n >> W.bn_shift : n / W.bn) * W.s_n;
        if (W.s_f32) r.sf = reinterpret_cast<const float*>(s);
        else r.s8 = s;
    }
    return r;
}

// The order the tiles take an item's `count` rows in: four contiguous sections, side-by-side rows one from
// each, so the weights are read as four long streams (rows of 1-2 KB read four neighbours at a time restart
// the hardware prefetcher's streams every row: half the bandwidth, docs/perf.md). Which rows share a tile
// changes no output's arithmetic.
// A thread's buffers for gemm's items, kept between calls (one TLS lookup a call, no allocation an item): an
// item's sums, its rows' descriptions, and the orders of the last few counts asked (a step's products repeat a
// few counts; a 32768-row head's order built at every call cost ~1.5 % of a packed decode step, and a
// thread_local order and two vectors made per item ~1.5 % of a 48-layer fp8 step).
template <typename T>
inline T* align64(T* p) {  // the first 64-byte boundary at or after p (its buffer 64 bytes longer)
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

struct Scratch {
    std::vector<float> wbuf, tmp;  // an item's sums ([rows][x rows]), one x row's of them gathered
    std::vector<uint32_t> pairs;   // a prompt's x rows packed by value pairs (run_item_pairs)
    std::vector<Row> rows;
    std::array<std::pair<int64_t, std::vector<int64_t>>, 8> orders;  // (count, its order), -1: none yet
    size_t next = 0;  // the entry a new count replaces
    Scratch() {
        for (auto& o : orders) o.first = -1;
    }
};
Scratch& thread_scratch() {  // looked up once a call (a reference to a thread_local costs a TLS call a use)
    thread_local Scratch s;
    return s;
}
const std::vector<int64_t>& section_order(Scratch& s, int64_t count) {
    for (const auto& o : s.orders)
        if (o.first == count) return o.second;
    auto& [made, pos] = s.orders[s.next];
    s.next = (s.next + 1) % s.orders.size();
    const int64_t S = (count + 3) / 4;
    pos.clear();
    pos.reserve(count);
    for (int64_t i = 0; i < S; ++i)
        for (int64_t k = i; k < count; k += S) pos.push_back(k);
    made = count;
    return pos;
}

// The row loops' blocking (run_item, run_item_dp): whether M activation rows of x_bytes each stream every weight
// row whole (up to 4 rows, or more whose x fits in 256 KB beside the weights in L2), and the block of weight
// rows described and passed over at a time (a multiple of 4: the same tiles).
inline bool whole_rows(int64_t M, int64_t x_bytes) { return M <= 4 || M * x_bytes <= (256 << 10); }
inline int64_t row_block(int64_t M, bool whole) { return M <= 4 ? 256 : whole ? 4 : 32; }

// The item's sums (wbuf [count rows][M], in row order: the tiles add each to its row's place) to the output, a row
// of x at a time: plus the bias, stored by store_row's conversion (one x row: wbuf is that row; more: gathered
// into tmp first, a contiguous loop, not a scattered one a value).
void store_row(int t, const float* y, void* p, int64_t n);
void put_rows(const Out& O, int64_t t0, int64_t n0, int64_t M, int64_t n, Scratch& sc) {
    const int64_t elem = O.dtype == 0 ? 4 : 2;
    if (M > 1) sc.tmp.resize(n);
    for (int64_t m = 0; m < M; ++m) {
        float* tmp = M == 1 ? sc.wbuf.data() : sc.tmp.data();
        if (M > 1) {
            const float* w = sc.wbuf.data() + m;
            for (int64_t i = 0; i < n; ++i) tmp[i] = w[i * M];
        }
        if (O.bias)
            for (int64_t i = 0; i < n; ++i) tmp[i] += O.bias[n0 + i];
        store_row((int)O.dtype, tmp, static_cast<char*>(O.p) + ((t0 + m) * O.ld + n0) * elem, n);
    }
}

// Rows [n0, n1) of expert e against its x rows [t0, t0 + M) (x prepared: row stride xs).
template <int KIND>
void run_item(const Ctx& C, const Weights& W, int64_t e, int64_t slot, int64_t n0, int64_t n1, const float* x,
              int64_t xs, int64_t t0, int64_t M, const Out& O, bool generic, Scratch& sc) {
    std::vector<float>& wbuf = sc.wbuf;
    if (generic) {
        wbuf.resize(C.K);
        for (int64_t n = n0; n < n1; ++n) {
            decode_row_generic(C, row_of(C, W, e, slot, n), wbuf.data());
            for (int64_t m = 0; m < M; ++m) {
                const float* xm = x + (t0 + m) * xs;
                float acc = 0.f;
                for (int64_t k = 0; k < C.K; ++k) acc += xm[k] * wbuf[k];
                put(O, t0 + m, n, acc);
            }
        }
        return;
    }
#if defined(MOESAIC_AVX2)
    // Up to 4 activation rows (one block of them): stream each weight row once, front to back, x read
    // from L1 / L2 (4 fp32 rows over K = 4096: 64 KB); blocks of K would restart the prefetcher's streams
    // every block for no reuse. More rows whose x fits L2 beside the weights (M x xs floats <= 256 KB: 16
    // fp32 rows of K = 4096): whole rows too, 4 weight rows at a time, each block of 4 activation rows passing
    // over them in turn (their bytes in L1 / L2 after the first). One Zen 3 core, 4096 x 4096 from memory,
    // against blocks of K: 1.2-1.5x at 2 and 4 rows, 1.15-1.5x at 8, 1.03-1.25x at 16, every kind; and each
    // output is the same sum at any such row count. Larger x: blocks of KB chunks, so that a block of x
    // stays in L1 while every weight row of the item passes over it (x of 16 rows over the whole of a long K
    // would be re-read from L3 for each group of weight rows).
    const int64_t nchunks = C.nfull + (C.tail_bytes ? 1 : 0);
    const bool whole = whole_rows(M, xs * 4);
    const int64_t KB = whole ? nchunks : std::max<int64_t>(8, 64 / std::min<int64_t>(M, 4));
    // ... and blocks of RB weight rows, so that their bytes of a K block stay in L2 while the blocks of
    // activation rows pass over them (whole rows: blocks of 256, whose rows are described as they come: an
    // item of 32768 rows described at once wrote and read back 1 MB). RB is a multiple of 4: the same tiles.
    const int64_t RB = row_block(M, whole);
    // The tiles' side-by-side rows (and the RB blocks) come from the four sections (section_order).
    const int64_t count = n1 - n0;
    const std::vector<int64_t>& pos = section_order(sc, count);
    std::vector<Row>& rows = sc.rows;
    rows.resize(std::min(count, RB));
    wbuf.assign(count * M, 0.f);
    for (int64_t r0 = 0; r0 < count; r0 += RB) {
        const int64_t r1 = std::min(count, r0 + RB);
        for (int64_t i = r0; i < r1; ++i) rows[i - r0] = row_of(C, W, e, slot, n0 + pos[i]);
        for (int64_t c0 = 0; c0 < nchunks; c0 += KB) {
            const int64_t c1 = std::min(c0 + KB, nchunks);
            const bool tail = C.tail_bytes && c1 == nchunks;
            rows_pass<KIND>(C, rows.data(), r0, r1, x + t0 * xs, xs, M, c0, tail ? c1 - 1 : c1, tail, pos.data(),
                            wbuf.data());
        }
    }
    put_rows(O, t0, n0, M, count, sc);
#endif
}

// x rows [t0, t0 + M) (row stride K) as value pairs by column, a transpose of x's pairs ([M, K / 2] -> [K / 2,
// cols]): out[q * cols + m] is the dword (x[t0 + m][2q], x[t0 + m][2q + 1]) for q below K rounded up to 32 values,
// zero past K and in columns M .. cols. AMX's B tiles (cols = M) and pair_tile's x vectors (16 columns).
void pack_x_pairs(const uint16_t* x, int64_t K, int64_t t0, int64_t M, int64_t cols, uint32_t* out) {
    const int64_t pairs = (K + 31) / 32 * 16, whole = K / 2;  // pair rows (padded); pairs inside K
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = x + (t0 + m) * K;
        for (int64_t q = 0; q < whole; ++q) {
            uint32_t v;
            std::memcpy(&v, xr + 2 * q, 4);
            out[q * cols + m] = v;
        }
        for (int64_t q = whole; q < pairs; ++q) out[q * cols + m] = 2 * q < K ? xr[2 * q] : 0;  // odd K; padding
    }
    for (int64_t q = 0; q < pairs; ++q)
        for (int64_t m = M; m < cols; ++m) out[q * cols + m] = 0;
}

#if defined(MOESAIC_AVX512BF16)
// A vector's 16 lanes summed as pairs 8 lanes apart, then 4, 2 and 1 (GCC's _mm512_reduce_add_ps, spelled out:
// tree_sums16 adds the same pairs, and the two must agree whatever the compiler).
inline float lane_tree_sum(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                                   _mm512_castps512_ps256(v));
    const __m128 b = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    const __m128 c = _mm_add_ps(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// lane_tree_sum of 16 vectors at once, transposed: lane 4 b + c of the result is the sum of a[4 c + b]. Each
// level adds the pairs lane_tree_sum adds (8, 4, 2, 1 lanes apart) for every vector: 30 shuffles and 15 adds
// for 16 sums (16 reductions apart: ~64 and ~64).
inline __m512 tree_sums16(const __m512 (&a)[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i]'s j + j + 8; lanes 8-15: a[2i + 1]'s
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // 128-bit block q: a[4i + q]'s j + j + 4
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) {  // block q, lanes 0-1: a[8i + q]'s j + j + 2; lanes 2-3: a[8i + 4 + q]'s
        const __m512d u = _mm512_castps_pd(c[2 * i]), v = _mm512_castps_pd(c[2 * i + 1]);
        d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// lane_tree_sum of each of acc[0, n) (n <= 16) in one vector, natural order: lane l is lane_tree_sum(acc[l]) (its
// bits), 0 past n. (The attention's lane_sums16 below adds in another order: other bits.)
__attribute__((always_inline)) inline __m512 lane_tree_sums(const __m512* acc, int n) {
    __m512 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {  // tree_sums16's lane 4 b + c sums a[4 c + b]
        const int j = 4 * (i % 4) + i / 4;
        a[i] = j < n ? acc[j] : _mm512_setzero_ps();
    }
    return tree_sums16(a);
}

// bf16 weights against bf16 activations on AVX-512 BF16 CPUs: vdpbf16ps takes 32 weights of a row and the
// same 32 values of an x row as they are stored (no widening, no permutation) and adds the 16 pair sums to
// fp32 lanes: each bf16 x bf16 product exact, each addition rounded to nearest even, subnormal inputs and
// results flushed to zero (the instruction's rules). The K tail is read through masked loads (zeros).
// acc[m * R + r] += the lanes of x row m against weight row r over [k0, k1). PF: the decode tiles' prefetch
// (0: none, the caller fetches; 1: each row 4 lines ahead, or `next`'s rows where given). Every loop over acc is
// unrolled, so that the caller's acc stays in registers (a loop left rolled puts it on the stack).
template <int R, int MB, int PF>
__attribute__((always_inline)) inline void dp_sums(const uint16_t* const* w, const uint16_t* x, int64_t xs, int64_t k0,
                                                   int64_t k1, __m512* acc, const uint16_t* const* next) {
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
        __m512bh wv[R];
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            // 4 lines ahead (best of 128-2048 here). A pass over rows already in L1 fetches the next tile's rows
            // instead (`next`: the passes of 4 x rows at 8-16 rows), so that memory streams while it computes; into
            // L2 (T1: one core's T0 prefetches stalled near 15 GB/s; at 8 rows a cold 2 MB matrix 163 -> 133 us)
            if (PF && next) _mm_prefetch(reinterpret_cast<const char*>(next[r] + k), _MM_HINT_T1);
            else if (PF) _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + 256, _MM_HINT_T0);
            wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + k);
        }
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * xs + k);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], wv[r], xv);
        }
    }
    if (k < k1) {
        const __mmask32 mask = (__mmask32)((1ull << (k1 - k)) - 1);
        __m512bh wv[R];
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[r] + k);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + k);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], wv[r], xv);
        }
    }
}

// The decode tiles: res[m * R + r] = the dot of x row m with weight row r over [k0, k1).
template <int R, int MB>
void dp_tile(const uint16_t* const* w, const uint16_t* x, int64_t xs, int64_t k0, int64_t k1, float* res,
             const uint16_t* const* next = nullptr) {
    __m512 acc[R * MB];
#pragma GCC unroll 16
    for (int i = 0; i < R * MB; ++i) acc[i] = _mm512_setzero_ps();
    dp_sums<R, MB, 1>(w, x, xs, k0, k1, acc, next);
    if constexpr (R * MB == 16) {  // 4 x 4: the 16 sums in one transposed tree (the same bits, ~1/4 the shuffles)
        _mm512_storeu_ps(res, lane_tree_sums(acc, 16));
    } else {
#pragma GCC unroll 16
        for (int i = 0; i < R * MB; ++i) res[i] = lane_tree_sum(acc[i]);
    }
}

// Prompts' bf16 products (GEMM_ROWS or more x rows against a matrix): tiles of 6 weight rows x 4 x rows, 24
// accumulators over K (in blocks, their lanes carried: run_item_gemm), each added as dp_tile adds it (the same
// lanes, loads and tail), and the 24 outputs' lane sums taken 16 at a time, transposed (tree_sums16): an output
// has the bits it has at one row, whatever M. Against dp_tile's 4 x 4 tiles with one reduction each: 10 loads a
// 24 products (not 8 a 16) and a third of the reductions' shuffles; cold 1024 x 1024 matrices on a Zen 4 core at
// 32 rows 146-155 -> 175-190 GFLOP/s (oneDNN's bf16 GEMM 134-138), level with oneDNN at 256 (docs/perf.md).
constexpr int64_t GEMM_ROWS = 20;
constexpr int GR = 6, GM = 4;  // a tile's weight rows, x rows

// One tile over K values [k0, k1): its accumulators start at zero (`first`) or from `keep` (the last K block's
// lanes, R * MB vectors), and go back to `keep` unless `last`, where they are summed into out. Lanes carried whole
// from block to block: the same sums as one pass over K.
template <int R, int MB>
__attribute__((noinline)) void gemm_tile(const uint16_t* const* w, const uint16_t* x, int64_t xs, int64_t k0,
                                         int64_t k1, float* keep, bool first, bool last, float* out, int64_t os) {
    constexpr int NA = R * MB, G = (NA + 15) / 16;
    __m512 acc[NA];
#pragma GCC unroll 24
    for (int i = 0; i < NA; ++i) acc[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(keep + 16 * i);
    dp_sums<R, MB, 0>(w, x, xs, k0, k1, acc, nullptr);
    if (!last) {
#pragma GCC unroll 24
        for (int i = 0; i < NA; ++i) _mm512_storeu_ps(keep + 16 * i, acc[i]);
        return;
    }
    // (the sums gathered first and stored after: ~10 % faster than a group's stores between the two)
    alignas(64) float s[16 * G];
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) _mm512_store_ps(s + 16 * g, lane_tree_sums(acc + 16 * g, NA - 16 * g));
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < R; ++r) out[m * os + r] = s[m * R + r];
}

// Rows [n0, n1) of bf16 expert e against its x rows [t0, t0 + M) by gemm_tile: x in blocks of ~192 KB of
// GEMM_K-value pieces (L2, beside the weight rows), the weight rows 6 at a time and GEMM_K values at a time (L1
// after the first x rows; each tile's lanes kept between K blocks: at K = 4096, 256 rows, one pass over the whole
// of K read 162 GFLOP/s, oneDNN 218), the next 6 rows' (or K block's) weights fetched to L2 a slice per pass
// meanwhile (cold weights: the passes over one block take ~1 us, long enough for 12 KB). The outputs are stored a
// block of x rows at a time.
constexpr int64_t GEMM_K = 1024;
// Sums y [M, count] of outputs n0 .. n0 + count for x rows t0 .. t0 + M: each times `factor` (divided by it with
// `divides`), plus the bias, stored a row at a time in the output's dtype.
void put_sums(const Out& O, float* y, int64_t count, int64_t n0, int64_t t0, int64_t M, float factor, bool divides) {
    const int64_t elem = O.dtype == 0 ? 4 : 2;
    for (int64_t m = 0; m < M; ++m) {
        float* row = y + m * count;
        if (factor != 1.f)
            for (int64_t i = 0; i < count; ++i) row[i] = divides ? row[i] / factor : row[i] * factor;
        if (O.bias)
            for (int64_t i = 0; i < count; ++i) row[i] += O.bias[n0 + i];
        store_row((int)O.dtype, row, static_cast<char*>(O.p) + ((t0 + m) * O.ld + n0) * elem, count);
    }
}
// The weight rows: count rows of K values from w0, ws values apart, the item's outputs n0 .. n0 + count; each sum
// times `factor` (divided by it with `divides`) before the bias: nvfp4's global scale (run_item_decoded).
void gemm_rows(const uint16_t* w0, int64_t ws, int64_t count, int64_t K, int64_t n0, const uint16_t* x, int64_t xs,
               int64_t t0, int64_t M, const Out& O, Scratch& sc, float factor = 1.f, bool divides = false) {
    const int64_t KC = std::min(K, GEMM_K), nkb = (K + KC - 1) / KC;
    const int64_t MBLK = std::max<int64_t>(GM, (192 << 10) / (2 * KC) / GM * GM);
    sc.wbuf.resize(std::min(M, MBLK) * count);
    sc.tmp.resize(nkb > 1 ? (MBLK / GM) * GR * GM * 16 : 0);
    float* y = sc.wbuf.data();  // [x rows of the block, count]
    // x rows 4 KB apart or a multiple of it (K = 2048, 4096, ...) share their L1 sets with each other and with the
    // weight rows: such a block of x is copied once to rows 64 bytes longer
    const bool pad = nkb > 1 && (xs * 2) % 4096 == 0;
    const int64_t ps = pad ? xs + 32 : xs;
    std::vector<uint16_t> xpad(pad ? std::min(M, MBLK) * ps : 0);
    for (int64_t mb0 = 0; mb0 < M; mb0 += MBLK) {
        const int64_t mb1 = std::min(M, mb0 + MBLK), passes = (mb1 - mb0 + GM - 1) / GM;
        if (pad)
            for (int64_t m = mb0; m < mb1; ++m) std::memcpy(xpad.data() + (m - mb0) * ps, x + (t0 + m) * xs, 2 * K);
        const uint16_t* xb = pad ? xpad.data() - mb0 * ps : x + t0 * xs;  // row m of the item: xb + m * ps
        for (int64_t r0 = 0; r0 < count; r0 += GR) {
            const int nr = (int)std::min<int64_t>(GR, count - r0);
            const uint16_t* w = w0 + r0 * ws;
            const uint16_t* wr[GR];  // (row pointers: ~10 % faster in the loop than w + r * ws)
            for (int r = 0; r < GR; ++r) wr[r] = w + std::min(r, nr - 1) * ws;
            for (int64_t kb = 0; kb < nkb; ++kb) {
                const int64_t k0 = kb * KC, k1 = std::min(K, k0 + KC);
                // what comes next: these rows' next K block, else the next rows' first
                const bool same = kb + 1 < nkb;
                const uint16_t* nw = same ? w + k1 : w + GR * ws;
                const int nnext = same ? nr : (int)std::min<int64_t>(GR, count - r0 - nr);
                const int64_t lines = ((same ? std::min(K, k1 + KC) - k1 : KC) + 31) / 32;  // (KC <= K)
                for (int64_t m0 = mb0, i = 0; m0 < mb1; m0 += GM, ++i) {
                    for (int64_t l = i * lines / passes; l < (i + 1) * lines / passes; ++l)
                        for (int r = 0; r < nnext; ++r)
                            _mm_prefetch(reinterpret_cast<const char*>(nw + r * ws + 32 * l), _MM_HINT_T1);
                    const int mb = (int)std::min<int64_t>(GM, mb1 - m0);
                    float* keep = nkb > 1 ? sc.tmp.data() + i * GR * GM * 16 : nullptr;
                    with_value<1, 2, 3, 4, 5, 6>(nr, [&](auto Rc) {
                        with_value<1, 2, 3, 4>(mb, [&](auto Mc) {
                            gemm_tile<decltype(Rc)::value, decltype(Mc)::value>(
                                wr, xb + m0 * ps, ps, k0, k1, keep, kb == 0, kb + 1 == nkb,
                                y + (m0 - mb0) * count + r0, count);
                        });
                    });
                }
            }
        }
        put_sums(O, y, count, n0, t0 + mb0, mb1 - mb0, factor, divides);
    }
}
void run_item_gemm(const Ctx& C, const Weights& W, int64_t e, int64_t n0, int64_t n1, const uint16_t* x, int64_t xs,
                   int64_t t0, int64_t M, const Out& O, Scratch& sc) {
    gemm_rows(reinterpret_cast<const uint16_t*>(W.w + e * W.w_e + n0 * W.w_n), W.w_n / 2, n1 - n0, C.K, n0, x, xs, t0,
              M, O, sc);
}

// Packed E2M1 (mxfp4 / nvfp4) against bf16 activations: a 64-byte load is 128 values, four 32-value groups
// (one a 128-bit lane) or eight 16-value ones (two a lane). vpermw looks each 16-bit word's low 5 bits up in a
// 32-word table of bf16 values (E2M1 values are exact in bf16; entries i and i + 16 are both code i's), so the
// loaded words shifted right by 0, 4, 8 and 12 bits decode their four nibbles: one shuffle per 32 values.
// vdpbf16ps adds them against x permuted once per call to the decoded order (prep_x_fp4dp): word i of lane l
// of vector v is element 32 l + 4 i + v of the chunk, so each lane holds its own 32 values (a mxfp4 group;
// nvfp4's two groups in its fp32 halves 0-1 and 2-3). A group's pair sums are scaled once, as on the AVX2
// path; the scales are computed in registers (fp4_scales16).
constexpr int64_t FC = 128;  // values per chunk

// A load of 64 code bytes: plain where the whole load is inside K (`whole`), else masked (zeros past K). On
// Zen 4 a masked byte load costs ~4.5 cycles more than a plain one in these loops (a 128-value E2M1 chunk of
// one row: 8.9 -> 13.4 cycles standalone), so only the K tail takes one.
inline __m512i load_codes(const uint8_t* p, bool whole, __mmask64 mask) {
    return whole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(mask, p);
}

inline void dec_fp4_bf16(__m512i b, __m512i v[4]) {  // b: a load's 64 code bytes
    const __m512i t = _mm512_load_si512(E2M1_BF16W);
    v[0] = _mm512_permutexvar_epi16(b, t);
    v[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), t);
    v[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 8), t);
    v[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 12), t);
}

// The scales of 16 groups g0.. (ng of them inside K; the others 0) as fp32: the tables' values computed in
// registers. E8M0 (mxfp4): the exponent bits (0 -> 2^-127, 255 -> NaN); E4M3 (nvfp4): its value exactly (the
// fp8 decode's fp16 trick), then the table's one fp32 op with the global scale; NaN codes stay NaN. A plain load
// where 16 groups remain (a masked one cost ~8 % of a one-row nvfp4 product, ~3 % of mxfp4's, here).
template <int KIND>
inline __m512 fp4_scales16(const uint8_t* s, int64_t ng, __m512 ge, bool divides) {
    const __m128i b = ng >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(s))
                               : _mm_maskz_loadu_epi8((__mmask16)((1u << std::max<int64_t>(ng, 0)) - 1), s);
    if constexpr (KIND == MX) {
        const __m512i e = _mm512_cvtepu8_epi32(b);
        __m512i bits = _mm512_slli_epi32(e, 23);
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
        return _mm512_castsi512_ps(bits);
    } else {
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xBFFF));
        __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
        v = divides ? _mm512_div_ps(v, ge) : _mm512_mul_ps(v, ge);
        const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN));
    }
}

// A decoded chunk's pair sums against x's prepared chunk xm: the four vectors' products in one fp32 vector.
inline __m512 chunk_dot(const __m512i v[4], const uint16_t* xm) {
    __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)v[0], (__m512bh)_mm512_loadu_si512(xm));
    t = _mm512_dpbf16_ps(t, (__m512bh)v[1], (__m512bh)_mm512_loadu_si512(xm + 32));
    t = _mm512_dpbf16_ps(t, (__m512bh)v[2], (__m512bh)_mm512_loadu_si512(xm + 64));
    return _mm512_dpbf16_ps(t, (__m512bh)v[3], (__m512bh)_mm512_loadu_si512(xm + 96));
}

// The loop of the E2M1 tiles on this path: res[m * R + r] = the dot of x rows m and weight rows r over loads
// [c0, c1), where body(b, S, c, acc[r]) adds load c of a row (its 64 code bytes b, zeros past K) times the x
// rows to acc[r][0, MB), S holding each fp32 lane's group scale: a row's scales read 16 groups at a time (SPAN
// loads) and a load's lanes given theirs by one permute (lane i of load j: group GC j + i / (16 / GC)).
template <int KIND, int R, int MB, typename Body>
void fp4_loads(const Ctx& C, const Row* rows, int64_t c0, int64_t c1, float ge, bool divides, float* res, Body body) {
    constexpr int SPAN = KIND == MX ? 4 : 2, GC = 16 / SPAN;  // loads a scale vector covers; groups a load
    const __m512 gev = _mm512_set1_ps(ge);
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    __m512i pick[SPAN];
    for (int j = 0; j < SPAN; ++j)
        pick[j] = _mm512_add_epi32(_mm512_set1_epi32(GC * j), _mm512_srli_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), KIND == MX ? 2 : 1));
    const int64_t full = C.K / FC;
    for (int64_t cs = c0; cs < c1; cs += SPAN) {
        const int64_t g0 = cs * GC;
        __m512 Z[R];
        for (int r = 0; r < R; ++r) Z[r] = fp4_scales16<KIND>(rows[r].s8 + g0, C.ngroups - g0, gev, divides);
        const int nj = (int)std::min<int64_t>(SPAN, c1 - cs);
        for (int j = 0; j < nj; ++j) {
            const int64_t c = cs + j;
            const __mmask64 mask = c < full ? ~0ull : (1ull << ((C.K - c * FC) / 2)) - 1;
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const uint8_t* p = rows[r].w + c * (FC / 2);
                _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
                body(load_codes(p, c < full, mask), _mm512_permutexvar_ps(pick[j], Z[r]), c, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) res[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Packed E2M1 against bf16 activations prepared in the decoded order (stride xs): each load decoded to bf16
// and its pair sums against each x row scaled once.
template <int KIND, int R, int MB>
void fp4dp_tile(const Ctx& C, const Row* rows, const uint16_t* x, int64_t xs, int64_t c0, int64_t c1, float ge,
                bool divides, float* res) {
    fp4_loads<KIND, R, MB>(C, rows, c0, c1, ge, divides, res, [=](__m512i b, __m512 S, int64_t c, __m512 (&acc)[MB]) {
        __m512i v[4];
        dec_fp4_bf16(b, v);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(chunk_dot(v, x + m * xs + c * FC), S, acc[m]);
    });
}

#if defined(MOESAIC_VNNI512)
// E2M1 against int8 activation records (prep_x_q8; MOESAIC_CPU_INT8_ACTIVATIONS=1) on AVX-512 VNNI: a 64-byte
// load is 128 values; vpermb looks each byte's low 6 bits up in E2M1_U four times over (2 x value + 12, an
// unsigned byte), so the low nibbles need no mask and the high ones one 16-bit shift; vpdpbusd adds the even
// values' and the odd values' byte products to dword l (values 8 l .. 8 l + 7), starting from the record's
// -12 x sum; each dword's sum converted and scaled by its group's weight scale (the exact path's) times its
// block's d / 2. One int32 product per 4 values where the AVX2 tiles take two steps.
template <int KIND, int R, int MB>
void q8z_tile(const Ctx& C, const Row* rows, const float* x, int64_t xs, int64_t c0, int64_t c1, float ge,
              bool divides, float* res) {
    const __m512i tab = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_U)));
    fp4_loads<KIND, R, MB>(C, rows, c0, c1, ge, divides, res, [=](__m512i b, __m512 S, int64_t c, __m512 (&acc)[MB]) {
        const __m512i lo = _mm512_permutexvar_epi8(b, tab);
        const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 4), tab);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
            const float* rec = x + m * xs + c * QREC;
            __m512i d = _mm512_loadu_si512(rec + 32);
            d = _mm512_dpbusd_epi32(d, lo, _mm512_loadu_si512(rec));
            d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(rec + 16));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(S, _mm512_loadu_ps(rec + 48)), acc[m]);
        }
    });
}
#endif  // MOESAIC_VNNI512

struct Fp8Tables {  // each code's bf16 bytes (two 128-entry tables a byte) and the sign bit
    __m512i ha, hb, la, lb, sign;
    Fp8Tables()
        : ha(_mm512_load_si512(E4M3_BF16_HI)), hb(_mm512_load_si512(E4M3_BF16_HI + 64)),
          la(_mm512_load_si512(E4M3_BF16_LO)), lb(_mm512_load_si512(E4M3_BF16_LO + 64)),
          sign(_mm512_set1_epi8((char)0x80)) {}
};

// fma(chunk . x, S, acc) for one x row (x at the chunk): the chunk's two pair sums from zero, then scaled once (the
// one order every E4M3 path here keeps, so the same bits)
__attribute__((always_inline)) inline __m512 fp8_chunk_dot(__m512i va, __m512i vb, __m512 S, const uint16_t* x,
                                                            __m512 acc) {
    __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)va, (__m512bh)_mm512_loadu_si512(x));
    t = _mm512_dpbf16_ps(t, (__m512bh)vb, (__m512bh)_mm512_loadu_si512(x + 32));
    return _mm512_fmadd_ps(t, S, acc);
}

// E4M3 (fp8 blocks) against bf16 activations: 64 values a load; two 128-entry byte tables (vpermi2b) give
// each code's bf16 bytes, the sign bit copied; x permuted once per call (prep_x_fp8dp): word i of lane l of
// vector v is element 16 l + 8 v + i of the chunk, so lanes 0-1 hold the first 32 values (one scale block's
// columns) and lanes 2-3 the next 32: each block's pair sums are scaled once, as on the AVX2 path.
template <int R, int MB>
void fp8dp_tile(const Ctx& C, const Row* rows, const uint16_t* x, int64_t xs, int64_t c0, int64_t c1, float* res) {
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    // the tables held apart: through an Fp8Tables and a helper (the mask a row) one x row read ~12 % slower
    const __m512i ha = _mm512_load_si512(E4M3_BF16_HI), hb = _mm512_load_si512(E4M3_BF16_HI + 64);
    const __m512i la = _mm512_load_si512(E4M3_BF16_LO), lb = _mm512_load_si512(E4M3_BF16_LO + 64);
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    const int64_t full = C.K / CH;
    for (int64_t c = c0; c < c1; ++c) {
        const __mmask64 mask = c < full ? ~0ull : (1ull << (C.K - c * CH)) - 1;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const uint8_t* p = rows[r].w + c * CH;
            _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
            const __m512i b = load_codes(p, c < full, mask);
            const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(ha, b, hb), _mm512_and_si512(b, sign));
            const __m512i lo = _mm512_permutex2var_epi8(la, b, lb);
            const __m512i va = _mm512_unpacklo_epi8(lo, hi), vb = _mm512_unpackhi_epi8(lo, hi);
            const int32_t b0 = C.sub2blk[2 * c], b1 = C.sub2blk[2 * c + 1];
            const float s0 = fp8_scale(rows[r], b0);  // one scale for both halves where one block holds them
            const __m512 S = b0 == b1 ? _mm512_set1_ps(s0)
                                      : _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(fp8_scale(rows[r], b1)), 1);
#pragma GCC unroll 4
            for (int m = 0; m < MB; ++m) acc[r][m] = fp8_chunk_dot(va, vb, S, x + m * xs + c * CH, acc[r][m]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) res[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// One tile of R weight rows x mb activation rows on this path over its loads [c0, c1): the bf16, fp8 or
// E2M1 one (a bf16 load is 32 values, the K tail inside the last); R * mb <= 16 accumulators (of 32 registers).
template <int KIND, int R, typename X>
void dp_kind_tile(int mb, const Ctx& C, const Row* rows, const X* x, int64_t xs, int64_t c0, int64_t c1,
                  float ge, bool divides, float* res, const Row* next = nullptr) {
    with_value<1, 2, 3, 4>(mb, [&](auto MBc) {
        constexpr int MB = decltype(MBc)::value;
        if constexpr (KIND == MXQ || KIND == NVQ) {
#if defined(MOESAIC_VNNI512)
            q8z_tile<KIND - (MXQ - MX), R, MB>(C, rows, x, xs, c0, c1, ge, divides, res);
#endif
        } else if constexpr (KIND == BF16) {
            const uint16_t *w[R], *ahead[R];
            for (int r = 0; r < R; ++r) w[r] = reinterpret_cast<const uint16_t*>(rows[r].w);
            if (next)
                for (int r = 0; r < R; ++r) ahead[r] = reinterpret_cast<const uint16_t*>(next[r].w);
            dp_tile<R, MB>(w, x, xs, 32 * c0, std::min(C.K, 32 * c1), res, next ? ahead : nullptr);
        } else if constexpr (KIND == FP8) {
            fp8dp_tile<R, MB>(C, rows, x, xs, c0, c1, res);
        } else {
            fp4dp_tile<KIND, R, MB>(C, rows, x, xs, c0, c1, ge, divides, res);
        }
    });
}

// run_item for bf16 x bf16 and packed weights (E2M1, E4M3) x bf16, and E2M1 x int8 records (VNNI), on this
// path: the four sections, each weight row streamed whole where x is small (whole_rows), else K blocks of
// ~1024 values (bf16; 8 loads packed) and row blocks of 32 (as run_item). Tiles of 4 weight rows x 4 activation
// rows; packed rows at M > 1 go 2 a tile (each row decoded once for its 4 x rows; int8 at 2 rows 4). x is the
// caller's bf16 rows for bf16 weights, else prepared in the decoded order (prep_x_dp) or as int8 records
// (prep_x_q8); row stride xs.
template <int KIND, typename X>
void run_item_dp(const Ctx& C, const Weights& W, int64_t e, int64_t slot, int64_t n0, int64_t n1,
                 const X* x, int64_t xs, int64_t t0, int64_t M, const Out& O, Scratch& sc) {
    std::vector<float>& wbuf = sc.wbuf;
    const int64_t width = KIND == BF16 ? 32 : KIND == FP8 ? CH : FC;  // values a load
    const int64_t nchunks = (C.K + width - 1) / width;
    const bool whole = whole_rows(M, xs * (int64_t)sizeof(X));  // as run_item; larger x by blocks of K
    const int64_t KB = whole ? nchunks : KIND == BF16 ? 32 : 8, RB = row_block(M, whole);
    const int64_t count = n1 - n0;
    const std::vector<int64_t>& pos = section_order(sc, count);
    std::vector<Row>& rows = sc.rows;
    rows.resize(std::min(count, RB));
    wbuf.assign(count * M, 0.f);
    float res[16];
    const X* xm0 = x + t0 * xs;
    constexpr bool q8 = KIND == MXQ || KIND == NVQ;
    const int RT = KIND == BF16 || M == 1 || (q8 && M <= 2) ? 4 : 2;
    const float ge = W.gsc ? W.gsc[e] : 1.f;  // nvfp4's global scale for this matrix
    for (int64_t r0 = 0; r0 < count; r0 += RB) {
        const int64_t r1 = std::min(count, r0 + RB);
        for (int64_t i = r0; i < r1; ++i) rows[i - r0] = row_of(C, W, e, slot, n0 + pos[i]);
        const Row* rb = rows.data() - r0;  // rb[n]: row n of the item (n in [r0, r1))
        Row next[4];
        const bool has_next = KIND == BF16 && whole && RB == 4 && M > 4 && r1 + 4 <= count;
        if (has_next)
            for (int64_t i = 0; i < 4; ++i) next[i] = row_of(C, W, e, slot, n0 + pos[r1 + i]);
        for (int64_t c0 = 0; c0 < nchunks; c0 += KB) {
            const int64_t c1 = std::min(nchunks, c0 + KB);
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int mb = (int)std::min<int64_t>(4, M - m0);
                for (int64_t n = r0; n < r1; n += RT) {
                    const int nr = (int)std::min<int64_t>(RT, r1 - n);
                    auto add = [&](int64_t at, int R) {
                        for (int m = 0; m < mb; ++m)
                            for (int r = 0; r < R; ++r) wbuf[pos[at + r] * M + m0 + m] += res[m * R + r];
                    };
                    // bf16 rows whole at 8-16 x rows: the second pass of 4 fetches the next block's 4 rows
                    const Row* nx = has_next && m0 == 4 && nr == 4 ? next : nullptr;
                    if (nr == 4) { dp_kind_tile<KIND, 4>(mb, C, rb + n, xm0 + m0 * xs, xs, c0, c1, ge, W.divides, res, nx); add(n, 4); }
                    else if (nr == 2) { dp_kind_tile<KIND, 2>(mb, C, rb + n, xm0 + m0 * xs, xs, c0, c1, ge, W.divides, res); add(n, 2); }
                    else for (int r = 0; r < nr; ++r) { dp_kind_tile<KIND, 1>(mb, C, rb + n + r, xm0 + m0 * xs, xs, c0, c1, ge, W.divides, res); add(n + r, 1); }
                }
            }
        }
    }
    put_rows(O, t0, n0, M, count, sc);
}

// bf16 x [T, K] -> [T, Kc] bf16 words in each `width`-value load's decoded order, zero padded (Kc: whole loads),
// from align64(out.data()) (the vector 32 words longer): word w of a load (vector w / 32, lane w / 8 % 4, word
// w % 8) is the load's value elem(v, l, i). Each 32-word vector is one vpermt2w of the load's 64 values (width 64)
// or two blended (width 128: lanes taking values 64-127 from the second pair); the index tables are made once per
// elem (per instantiation).
template <typename Elem>
std::vector<uint16_t> prep_x_dp(const torch::Tensor& x, int64_t Kc, int64_t width, Elem elem) {
    struct Tables {
        alignas(64) uint16_t idx[4][32];
        __mmask32 upper[4];  // words whose value is one of 64-127
    };
    static const Tables tab = [&] {  // all four vectors: a width-64 load reads the first two
        Tables t{};
        for (int v = 0; v < 4; ++v)
            for (int w = 0; w < 32; ++w) {
                const int e = elem(v, w / 8, w % 8);
                t.idx[v][w] = (uint16_t)(e & 63);
                if (e >= 64) t.upper[v] |= 1u << w;
            }
        return t;
    }();
    const int64_t T = x.size(0), K = x.size(1), nv = width / 32;
    std::vector<uint16_t> out((size_t)(T * Kc + 32));
    uint16_t* dst = align64(out.data());  // (the rows from a 64-byte boundary: no load splits two lines)
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < Kc; c += width) {
            __m512i in[4];
            for (int64_t j = 0; j < nv; ++j) {  // values c + 32 j ..: zero past K
                const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - c - 32 * j));
                in[j] = _mm512_maskz_loadu_epi16(n == 32 ? ~0u : (1u << n) - 1, src + t * K + c + 32 * j);
            }
            for (int v = 0; v < nv; ++v) {
                const __m512i iv = _mm512_load_si512(tab.idx[v]);
                __m512i r = _mm512_permutex2var_epi16(in[0], iv, in[1]);
                if (nv == 4) r = _mm512_mask_blend_epi16(tab.upper[v], r, _mm512_permutex2var_epi16(in[2], iv, in[3]));
                _mm512_storeu_si512(dst + t * Kc + c + 32 * v, r);
            }
        }
    return out;
}
std::vector<uint16_t> prep_x_fp4dp(const torch::Tensor& x, int64_t Kc) {  // fp4dp_tile's order
    return prep_x_dp(x, Kc, FC, [](int v, int l, int i) { return 32 * l + 4 * i + v; });
}
std::vector<uint16_t> prep_x_fp8dp(const torch::Tensor& x, int64_t Kc) {  // fp8dp_tile's order
    return prep_x_dp(x, Kc, CH, [](int v, int l, int i) { return 16 * l + 8 * v + i; });
}
// bf16 values v times 2^(e - 127) (an E8M0 scale byte e), by adding to the exponents of the non-zero ones:
// exact while every product stays a normal bf16, which values of bf16 exponents [lo_exp, hi_exp] do for
// e in [128 - lo_exp, 381 - hi_exp]. False (v unchanged) outside that range.
inline bool times_pow2(__m512i& v, int e, int lo_exp, int hi_exp) {
    if (e < 128 - lo_exp || e > 381 - hi_exp) return false;
    v = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF)), v,
                              _mm512_set1_epi16((int16_t)((e - 127) << 7)));
    return true;
}

// One packed row decoded to bf16 words dst[0, Kp) (zero past K): E2M1 times its group's scale (raw_e4m3,
// nvfp4 with a global scale: the E4M3 byte's own value, the global scale goes on the sums), E4M3 times its E8M0 block scale (fold8),
// or E4M3 alone (fp32 block scales go on each k-block's sums). False when a scaled value is not exact in bf16
// (a scale at the ends of the exponent range: subnormal, rounded or overflowing products).
bool decode_bf16_row(const Ctx& C, const Row& r, bool fold8, bool raw_e4m3, uint16_t* dst, int64_t Kp) {
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF), expo = _mm512_set1_epi32(0x7F800000);
    const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF), zero = _mm512_setzero_si512();
    __mmask16 bad = 0;
    auto put16 = [&](__m512 v, uint16_t* o) {
        const __m512i b = _mm512_castps_si512(v), m = _mm512_and_si512(b, mag);
        bad |= _mm512_test_epi32_mask(b, lo16);                                                                // rounded
        bad |= _mm512_mask_cmpeq_epi32_mask(_mm512_test_epi32_mask(m, mag), _mm512_and_si512(m, expo), zero);  // subnormal
        bad |= _mm512_cmpeq_epi32_mask(m, expo);                                                               // overflow
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
    };
    int64_t k = 0;
    if (C.kind == MX || (C.kind == NV && raw_e4m3)) {
        // 32 values a step: 16 bytes widened to words, the nibbles interleaved in K order (vpermt2w), their
        // bf16 bits looked up (vpermw); mxfp4's power-of-two scale added to the exponents (times_pow2:
        // exact while the scale byte is in [2, 252]), nvfp4's E4M3 scales (one per 16 values)
        // multiplied in fp32: E2M1 x E4M3 has at most 6 significant bits, always exact in bf16
        const __m512i tab = _mm512_loadu_si512(E2M1_BF16W), nib = _mm512_loadu_si512(NIB_ORDER);
        for (; k + 32 <= C.K; k += 32) {
            const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.w + k / 2)));
            const __m512i lo = _mm512_castsi256_si512(_mm256_and_si256(w, _mm256_set1_epi16(15)));
            const __m512i hi = _mm512_castsi256_si512(_mm256_srli_epi16(w, 4));
            __m512i v = _mm512_permutexvar_epi16(_mm512_permutex2var_epi16(lo, nib, hi), tab);
            if (C.kind == MX) {
                if (!times_pow2(v, r.s8[k / 32], 126, 129)) return false;  // E2M1: 0.5 .. 6
            } else {
                // in place as dwords (no widening shuffles): the even words shifted up and the odd ones masked are
                // their fp32 values; times the group's scale (dwords 0-7 the first 16 values), the exact products'
                // upper halves are their bf16 bits
                const __m512 S = _mm512_insertf32x8(_mm512_set1_ps(E4M3[r.s8[k / 16]]),
                                                    _mm256_set1_ps(E4M3[r.s8[k / 16 + 1]]), 1);
                const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), S);
                const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000))), S);
                v = _mm512_ternarylogic_epi32(_mm512_castps_si512(odd), _mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                              _mm512_set1_epi32(0xFFFF0000), 0xE4);  // odd where the mask, else even
            }
            _mm512_storeu_si512(dst + k, v);
        }
    }
    if (C.kind == MX || C.kind == NV) {
        const __m512 tab = _mm512_loadu_ps(E2M1);
        for (; k < C.K; k += 16) {  // K is a multiple of the group (16 / 32): nvfp4's last 16, or every 16
            const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.w + k / 2)));
            const __m128i lo = _mm_and_si128(w, _mm_set1_epi16(15)), hi = _mm_srli_epi16(w, 4);
            const __m512i idx = _mm512_cvtepu16_epi32(_mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi)));
            const uint8_t sb = r.s8[k / C.group];
            const float sc = raw_e4m3 ? E4M3[sb] : r.stab[sb];
            put16(_mm512_mul_ps(_mm512_permutexvar_ps(idx, tab), _mm512_set1_ps(sc)), dst + k);
        }
    } else {
        // 64 codes a step, fp8dp_tile's decode (each code's bf16 bytes from two 128-entry tables, the sign copied),
        // the codes' qwords first put in the order that makes its byte unpacks give the values in K order (zeros
        // past K; the NaN code decodes as 480, as on the AVX2 path). An E8M0 block scale is added to the exponents
        // (fold8: exact for scale bytes in [10, 246]); fp32 block scales go on the k-blocks' sums.
        const Fp8Tables T;
        const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
        for (; k < C.K; k += 64) {
            const int64_t n = std::min<int64_t>(64, C.K - k);
            const __m512i c = _mm512_permutexvar_epi64(order, load_codes(r.w + k, n == 64, (~0ull) >> (64 - n)));
            const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(T.ha, c, T.hb), _mm512_and_si512(c, T.sign));
            const __m512i lo = _mm512_permutex2var_epi8(T.la, c, T.lb);
            __m512i v[2] = {_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi)};
            for (int h = 0; h < 2 && k + 32 * h < Kp; ++h) {
                if (fold8 && !times_pow2(v[h], r.s8[C.sub2blk[(k + 32 * h) / 32]], 118, 135)) return false;  // 2^-9 .. 448
                _mm512_storeu_si512(dst + k + 32 * h, v[h]);
            }
        }
    }
    for (; k < Kp; k += 16) std::memset(dst + k, 0, 32);
    return bad == 0;
}

// A prompt's packed rows [n0, n1) of expert e (E2M1; E4M3 with E8M0 block scales) against DECODED_ROWS or more x
// rows (bf16, natural order, stride K): decoded to exact bf16 a block of ~256 KB at a time (decode_bf16_row: the
// scales folded, nvfp4's global scale on the sums) and multiplied by the bf16 prompt tiles (gemm_rows), where the
// packed tiles scaled each chunk's sums (a decode row's bits; 1024 x 1024 mxfp4 at 17 / 32 / 64 / 256 rows 115 /
// 133 / 136 / 137 GFLOP/s, decoded 141 / 167 / 186 / 203). A row then has the bits of its bf16 product with the
// decoded weights (whatever M), not its decode row's, as on AMX. False where a scale does not fold exactly
// (outputs of earlier blocks written: the caller computes the item again).
constexpr int64_t DECODED_ROWS = 17;  // more than MAX_ROWS (kernels/cpu.py): decode batches and verify blocks keep
                                      // the decode tiles and their bits
bool run_item_decoded(const Ctx& C, const Weights& W, int64_t e, int64_t slot, int64_t n0, int64_t n1,
                      const uint16_t* x, int64_t t0, int64_t M, const Out& O, Scratch& sc, std::vector<uint16_t>& dbuf) {
    const int64_t K = C.K, Kp = (K + 31) / 32 * 32;
    const int64_t block = std::max<int64_t>(GR, (256 << 10) / (2 * Kp) / GR * GR);
    const bool raw = C.kind == NV && W.gsc;
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
        const int64_t b1 = std::min(n1, b0 + block);
        dbuf.resize((size_t)((b1 - b0) * Kp));
        for (int64_t n = b0; n < b1; ++n)
            if (!decode_bf16_row(C, row_of(C, W, e, slot, n), C.kind == FP8, raw, dbuf.data() + (n - b0) * Kp, Kp))
                return false;
        gemm_rows(dbuf.data(), Kp, b1 - b0, K, b0, x, K, t0, M, O, sc, raw ? W.gsc[e] : 1.f, W.divides);
    }
    return true;
}

// A prompt's E4M3 rows (fp32 block scales: DeepSeek's and GLM's 128 x 128, `*=fp8`; or E8M0 ones that do not fold)
// against PAIR_ROWS or more x rows: the rows decoded to exact bf16 without their scales (decode_bf16_row) a ~256 KB
// block at a time, x packed by value pairs (pack_x_pairs, 16 x rows a vector), and vdpbf16ps adds a weight pair,
// broadcast, times 16 x rows' pairs to 16 lanes: each lane one output, summed along K. A k-block's pair steps (64 at
// 128 values) go to sums from zero, then times the row's block scale into the output's fp32 sum: one FMA a block,
// where lanes along K (the decode tiles, and the panels this replaced: ~110-120 GFLOP/s from 32 rows) take one a
// 64-value chunk. An output has the same bits at any M from PAIR_ROWS (its lane's arithmetic is its own row's and
// column's); decode batches and verify blocks keep the decode tiles' bits. From 20 rows two groups' 32 lanes beat
// the decode tiles (1024 x 1024 at 17 / 32 / 64 / 256 rows: 88 / 162 / 182 / 196 GFLOP/s, decode tiles ~95 at 17).
constexpr int64_t PAIR_ROWS = 20;
// ... and past PAIR_WIDE_K columns, E2M1 and E8M0-scaled E4M3 prompt rows too (their scales folded into the decoded
// bf16, nvfp4's global scale on the sums), where the prompt tiles' K blocks cost more (bf16 rows at 256: 1.05-1.12x
// them at K = 2816-4096, level at 1024)
constexpr int64_t PAIR_WIDE_K = 2048;
// Whether an expert's M prompt rows against kind-K weights take the pair tiles (gemm packs their x once a call):
// fp32-scaled E4M3 from PAIR_ROWS rows, E2M1 and E8M0-scaled E4M3 past PAIR_WIDE_K columns from DECODED_ROWS (an
// E8M0 row whose scale does not fold takes them too, packing its own x)
inline bool takes_pairs(int kind, bool s_f32, int64_t K, int64_t M) {
    return kind == FP8 && s_f32 ? M >= PAIR_ROWS : kind != BF16 && K > PAIR_WIDE_K && M >= DECODED_ROWS;
}

// R weight rows (w: decoded, natural order; rows: their scales) x V groups of 16 x rows (group v's pair q
// at xg[v * gs + 16 q]) over `steps` 32-value steps (k-block sub2blk[s]; null: the scales are in the decoded values,
// K one k-block of scale 1): out[m * os + r] for x rows m < mv, rows r < nr. Every loop over acc is unrolled (a
// rolled one puts acc on the stack).
template <int R, int V>
__attribute__((noinline)) void pair_tile(const uint16_t* const* w, const Row* rows, const uint32_t* xg,
                                         int64_t gs, const int32_t* sub2blk, int64_t steps, float* out, int64_t os,
                                         int nr, int mv) {
    alignas(64) float tot[R * V * 16] = {};
    for (int64_t s0 = 0; s0 < steps;) {
        const int32_t b = sub2blk ? sub2blk[s0] : 0;
        int64_t s1 = sub2blk ? s0 + 1 : steps;
        while (s1 < steps && sub2blk[s1] == b) ++s1;
        __m512 acc[R * V];
#pragma GCC unroll 24
        for (int i = 0; i < R * V; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t q = 16 * s0; q < 16 * s1; ++q) {
            __m512bh xv[V];
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) xv[v] = (__m512bh)_mm512_load_si512(xg + v * gs + 16 * q);
#pragma GCC unroll 12
            for (int r = 0; r < R; ++r) {
                int32_t pr;
                std::memcpy(&pr, w[r] + 2 * q, 4);
                const __m512bh wb = (__m512bh)_mm512_set1_epi32(pr);
#pragma GCC unroll 4
                for (int v = 0; v < V; ++v) acc[r * V + v] = _mm512_dpbf16_ps(acc[r * V + v], wb, xv[v]);
            }
        }
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            const __m512 S = _mm512_set1_ps(sub2blk ? fp8_scale(rows[r], b) : 1.f);
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) {
                float* t = tot + 16 * (r * V + v);
                _mm512_store_ps(t, _mm512_fmadd_ps(acc[r * V + v], S, _mm512_load_ps(t)));
            }
        }
        s0 = s1;
    }
    for (int m = 0; m < mv; ++m)
        for (int r = 0; r < nr; ++r) out[m * os + r] = tot[16 * (r * V + m / 16) + m % 16];
}

// Rows [n0, n1) of packed expert e against its x rows [t0, t0 + M) (bf16, natural order, stride K) by pair_tile: x
// packed by the caller (packed: its groups of 16 rows, 64-byte aligned) or here, the rows decoded a block at a time,
// x rows 64 at a time (4 groups: 6 weight rows a tile; fewer groups, more rows, 24 sums a tile). E4M3 rows decoded
// alone, their block scales on the k-blocks' sums; `folded`: E2M1 / E8M0-scaled E4M3 rows with their scales in the
// decoded bf16 (one k-block; nvfp4's global scale on the sums), false (outputs of earlier blocks written) where a
// scale does not fold exactly.
bool run_item_pairs(const Ctx& C, const Weights& W, int64_t e, int64_t slot, int64_t n0, int64_t n1, const uint16_t* x,
                    int64_t t0, int64_t M, const Out& O, Scratch& sc, std::vector<uint16_t>& dbuf, const uint32_t* packed,
                    bool folded) {
    const int64_t K = C.K, Kp = (K + 31) / 32 * 32, steps = Kp / 32, gs = 8 * Kp, groups = (M + 15) / 16;
    const bool raw = C.kind == NV && W.gsc;  // nvfp4's global scale on the sums
    const uint32_t* xa = packed;
    if (!xa) {
        sc.pairs.resize((size_t)(groups * gs + 16));
        uint32_t* xp = align64(sc.pairs.data());
        for (int64_t g = 0; g < groups; ++g)
            pack_x_pairs(x, K, t0 + 16 * g, std::min<int64_t>(16, M - 16 * g), 16, xp + g * gs);
        xa = xp;
    }
    const int64_t block = std::max<int64_t>(24, (256 << 10) / (2 * Kp) / 24 * 24);
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
        const int64_t b1 = std::min(n1, b0 + block), count = b1 - b0;
        dbuf.resize((size_t)(count * Kp));
        for (int64_t n = b0; n < b1; ++n)  // (unscaled E4M3 values are always exact in bf16; folded ones may not be)
            if (!decode_bf16_row(C, row_of(C, W, e, slot, n), folded && C.kind == FP8, raw, dbuf.data() + (n - b0) * Kp, Kp))
                return false;
        sc.wbuf.resize((size_t)(M * count));
        float* y = sc.wbuf.data();
        for (int64_t m0 = 0; m0 < M; m0 += 64) {
            with_value<1, 2, 3, 4>(std::min<int64_t>(4, (M - m0 + 15) / 16), [&](auto Vc) {
                constexpr int V = decltype(Vc)::value, R = V <= 2 ? 12 : V == 3 ? 8 : 6;
                for (int64_t r0 = 0; r0 < count; r0 += R) {
                    const int nr = (int)std::min<int64_t>(R, count - r0);
                    const uint16_t* wr[R];
                    Row rows[R];
                    for (int r = 0; r < R; ++r) {  // a last tile's missing rows repeat its last one
                        const int64_t n = r0 + std::min(r, nr - 1);
                        wr[r] = dbuf.data() + n * Kp;
                        rows[r] = row_of(C, W, e, slot, b0 + n);
                    }
                    pair_tile<R, V>(wr, rows, xa + (m0 / 16) * gs, gs, folded ? nullptr : C.sub2blk, steps,
                                    y + m0 * count + r0, count, nr, (int)std::min<int64_t>(64, M - m0));
                }
            });
        }
        put_sums(O, y, count, b0, t0, M, raw ? W.gsc[e] : 1.f, W.divides);
    }
    return true;
}
#endif  // MOESAIC_AVX512BF16

#if defined(MOESAIC_AMX)
// bf16 weights against bf16 activations by AMX tiles (Sapphire Rapids and later), at every M <= 16: the
// weights are the A operand as stored (16 rows x 32 values a tile, row stride K), x the B operand packed once
// per call (pack_x_pairs: per 32 values of K, 16 rows of value pairs x M columns), C = 16 weight rows x M
// activation rows in fp32. tdpbf16ps adds each pair's products to C with the instruction's rules (exact
// products, round to nearest even, subnormals flushed, as vdpbf16ps), 32 values of K a step in K order, so an
// output's arithmetic depends on its own row and column only: the same bits at any M, alone or grouped.
bool amx_permitted() {  // Linux lends the tile state to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

struct alignas(64) TileCfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// A stored C tile (c: nr weight rows x M activation rows) to outputs [t0, t0 + M) x columns n0 + r * rs:
// put's arithmetic, its dtype switch taken once a tile.
template <typename T>
void put_tile_as(const Out& O, int64_t t0, int64_t M, int64_t n0, int64_t rs, int64_t nr, const float* c) {
    for (int64_t m = 0; m < M; ++m) {
        T* o = static_cast<T*>(O.p) + (t0 + m) * O.ld + n0;
        for (int64_t r = 0; r < nr; ++r) {
            const float v = O.bias ? c[r * M + m] + O.bias[n0 + r * rs] : c[r * M + m];
            o[r * rs] = T(v);
        }
    }
}
void put_tile(const Out& O, int64_t t0, int64_t M, int64_t n0, int64_t rs, int64_t nr, const float* c) {
    if (O.dtype == 0) put_tile_as<float>(O, t0, M, n0, rs, nr, c);
    else if (O.dtype == 1) put_tile_as<c10::BFloat16>(O, t0, M, n0, rs, nr, c);
    else put_tile_as<c10::Half>(O, t0, M, n0, rs, nr, c);
}

// Where a block of weight rows [b0, b1) is read from, as bf16 rows: row b0 at base, row stride ws bytes,
// steps [0, full) in place (past them, and in a partial tile, through zero-padded scratch); sect: the block
// may be read as 32 sections.
struct AmxBlock {
    const uint8_t* base;
    int64_t ws, full;
    bool sect;
};

// Rows [n0, n1) of one matrix against its packed x (xb: M columns, packed by 16), the weights' rows given block
// by block by src (bf16 in place, or packed rows decoded to bf16). A pass takes two tiles of 16 weight rows
// against up to 32 activation rows (two B tiles): four C tiles, so consecutive tdpbf16ps do not wait on each
// other. A block whose rows split into 32 sections gives each tile's rows one from each section (row stride:
// a section), so in-place weights are read as 32 streams of up to 16 rows (16 neighbouring rows a tile read
// 1-2 KB rows side by side: shorter streams, ~5-10 % slower) and the block's outputs stay in L1; more than
// 32 activation rows pass over the block again from L2. Else a tile is 16 neighbouring rows. src's k-blocks
// (fp32 block scales) are summed in their own C tiles and added to fp32 sums times their scale; its global
// factor multiplies (or divides) every sum. False (outputs of this call's earlier blocks written) when src
// cannot give a block.
template <typename Src>
bool amx_item(Src& src, int64_t K, int64_t n0, int64_t n1, const uint32_t* xb, int64_t t0, int64_t M, const Out& O) {
    const int64_t steps = (K + 31) / 32, pairs = steps * 16;
    alignas(64) uint16_t scratch[2][16 * 32];
    alignas(64) float c[16 * 16];
    alignas(64) float acc[4][16 * 16];
    float rs_scale[2][16];
    TileCfg cfg;
    int64_t shape = -1;  // the configured column split
    for (int64_t b0 = n0; b0 < n1; b0 += src.block_rows) {
        const int64_t b1 = std::min(n1, b0 + src.block_rows), count = b1 - b0;
        AmxBlock B;
        if (!src.block(b0, b1, B)) { _tile_release(); return false; }
        const bool sect = B.sect && count % 32 == 0;
        const int64_t S = sect ? count / 32 : 1;  // rows a section; the row stride of a tile
        // A operand of a tile of nr rows from `row` (its first) for step s, through scratch t: zero padded
        // (steps in place are read without this call: full tiles' steps before B.full)
        auto padded = [&](const uint8_t* row, int64_t nr, int64_t s, int t) -> const void* {
            const int64_t kk = std::min<int64_t>(32, K - 32 * s);
            std::memset(scratch[t], 0, sizeof(scratch[t]));
            for (int64_t r = 0; r < nr; ++r) std::memcpy(scratch[t] + 32 * r, row + 64 * s + r * S * B.ws, 2 * kk);
            return scratch[t];
        };
        const int64_t stride = B.ws * S;  // a tile's row stride in place
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const int64_t ma = std::min<int64_t>(16, M - m0), mb = std::min<int64_t>(16, std::max<int64_t>(0, M - m0 - 16));
            if (shape != ma * 17 + mb) {  // tiles: C00 C01 C10 C11 (row tile x column block), A0 A1, B0 B1
                shape = ma * 17 + mb;
                cfg = TileCfg{};
                cfg.palette = 1;
                const int64_t cols[8] = {ma, mb, ma, mb, 16, 16, ma, mb};
                for (int t = 0; t < 8; ++t)
                    if (cols[t]) { cfg.rows[t] = 16; cfg.colsb[t] = (uint16_t)(4 * cols[t]); }
                _tile_loadconfig(&cfg);
            }
            const uint32_t* xa = xb + m0 * pairs;  // column block 0; block 1 follows 16 rows on
            const uint32_t* xc = xa + 16 * pairs;
            for (int64_t j = 0; j < (sect ? S : (count + 31) / 32); ++j) {
                const int64_t r0 = sect ? b0 + j : b0 + 32 * j, r1 = sect ? r0 + 16 * S : r0 + 16;
                const bool two = r1 < b1;
                const int64_t na = std::min<int64_t>(16, (b1 - r0 + S - 1) / S);
                const int64_t nb = two ? std::min<int64_t>(16, (b1 - r1 + S - 1) / S) : 0;
                const int64_t cm[4] = {ma, mb, two ? ma : 0, two ? mb : 0};  // columns of each C tile
                const uint8_t* rowa = B.base + (r0 - b0) * B.ws;
                const uint8_t* rowb = B.base + (r1 - b0) * B.ws;
                const int64_t fa = na == 16 ? B.full : 0, fb = nb == 16 ? B.full : 0;  // steps read in place
                auto zero = [&]() {
                    _tile_zero(0);
                    _tile_zero(2);
                    if (mb) { _tile_zero(1); _tile_zero(3); }
                };
                auto store = [&](int t, float* dst) {  // C tile t to dst (row stride: its columns)
                    switch (t) {
                        case 0: _tile_stored(0, dst, 4 * cm[0]); break;
                        case 1: _tile_stored(1, dst, 4 * cm[1]); break;
                        case 2: _tile_stored(2, dst, 4 * cm[2]); break;
                        default: _tile_stored(3, dst, 4 * cm[3]); break;
                    }
                };
                zero();
                if (src.blocked)
                    for (int t = 0; t < 4; ++t) std::fill(acc[t], acc[t] + 16 * cm[t], 0.f);
                for (int64_t s = 0; s < steps; ++s) {
                    _tile_loadd(6, xa + s * 16 * ma, 4 * ma);
                    if (mb) _tile_loadd(7, xc + s * 16 * mb, 4 * mb);
                    if (s < fa) _tile_loadd(4, rowa + 64 * s, stride);
                    else _tile_loadd(4, padded(rowa, na, s, 0), 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (mb) _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        if (s < fb) _tile_loadd(5, rowb + 64 * s, stride);
                        else _tile_loadd(5, padded(rowb, nb, s, 1), 64);
                        _tile_dpbf16ps(2, 5, 6);
                        if (mb) _tile_dpbf16ps(3, 5, 7);
                    }
                    if (src.blocked && src.block_ends(s)) {  // this k-block's sums, times each row's scale
                        for (int h = 0; h < 2; ++h)
                            for (int64_t r = 0; r < (h ? nb : na); ++r) rs_scale[h][r] = src.scale((h ? r1 : r0) + r * S, s);
                        for (int t = 0; t < 4; ++t) {
                            if (!cm[t]) continue;
                            store(t, c);
                            const int64_t nr = t < 2 ? na : nb;
                            for (int64_t r = 0; r < nr; ++r) {
                                const float sc = rs_scale[t / 2][r];
                                for (int64_t m = 0; m < cm[t]; ++m) acc[t][r * cm[t] + m] += sc * c[r * cm[t] + m];
                            }
                        }
                        zero();
                    }
                }
                for (int t = 0; t < 4; ++t) {
                    if (!cm[t]) continue;
                    float* v = src.blocked ? acc[t] : c;
                    if (!src.blocked) store(t, c);
                    const int64_t nr = t < 2 ? na : nb;
                    if (src.factor != 1.f)
                        for (int64_t i = 0; i < nr * cm[t]; ++i) v[i] = src.divides ? v[i] / src.factor : v[i] * src.factor;
                    put_tile(O, t0 + m0 + 16 * (t & 1), cm[t], t < 2 ? r0 : r1, S, nr, v);
                }
            }
        }
    }
    _tile_release();
    return true;
}

// bf16 weights, read in place.
struct AmxBf16 {
    const uint8_t* w;  // the matrix's row 0
    int64_t ws, full, block_rows;
    bool blocked = false, divides = false;
    float factor = 1.f;
    bool block(int64_t b0, int64_t, AmxBlock& B) const { B = {w + b0 * ws, ws, full, true}; return true; }
    bool block_ends(int64_t) const { return false; }
    float scale(int64_t, int64_t) const { return 1.f; }
};

// Packed weights (E2M1, E4M3) decoded to bf16 a block of rows at a time (into buf, kept in L2).
struct AmxPacked {
    const Ctx& C;
    const Weights& W;
    int64_t e, slot, Kp, block_rows;
    bool blocked, divides;  // blocked: fp8 with fp32 block scales
    float factor;           // nvfp4's global scale
    std::vector<uint16_t>& buf;
    bool block(int64_t b0, int64_t b1, AmxBlock& B) {
        buf.resize((size_t)((b1 - b0) * Kp));
        for (int64_t n = b0; n < b1; ++n)
            if (!decode_bf16_row(C, row_of(C, W, e, slot, n), C.kind == FP8 && !blocked, C.kind == NV && W.gsc,
                                 buf.data() + (n - b0) * Kp, Kp))
                return false;
        B = {reinterpret_cast<const uint8_t*>(buf.data()), 2 * Kp, Kp / 32, false};
        return true;
    }
    bool block_ends(int64_t s) const { return s + 1 == Kp / 32 || C.sub2blk[s + 1] != C.sub2blk[s]; }
    float scale(int64_t n, int64_t s) const { return fp8_scale(row_of(C, W, e, slot, n), C.sub2blk[s]); }
};
#endif  // MOESAIC_AMX

// Whether every block scale of the active matrices times FP8_SUM stays finite (|scale| < 2^72; NaN fails): the
// AVX2 fp8 tiles fold FP8_SUM into the scales. Reads nb x kb scales a matrix (the codes' 1 / (bn bk)).
bool fp8_scales_fit(const Weights& W, const std::vector<int64_t>& active, int64_t nb, int64_t kb) {
    bool fit = true;
    for (int64_t e : active)
        for (int64_t i = 0; i < nb; ++i) {
            const uint8_t* row = W.s + e * W.s_e + i * W.s_n;
            if (W.s_f32) {
                const float* f = reinterpret_cast<const float*>(row);
                for (int64_t j = 0; j < kb; ++j) fit &= std::abs(f[j]) < 0x1p72f;
            } else {
                for (int64_t j = 0; j < kb; ++j) fit &= row[j] < 127 + 72;  // E8M0: 2^(b - 127); 255 is NaN
            }
        }
    return fit;
}

// x [T, K] (fp32 / bf16 / fp16) as the tiles read it: fp32 [T, Kp], zero padded; on the AVX2 tiles (not generic)
// fp4's chunks permuted to the decoded order and fp8's values times FP8_X. `scaled` (fp8 only) comes back false where the scaling cannot serve: a value of
// magnitude 2^63 or more (or not finite), or subnormals read as zero (DAZ); the caller then takes the portable loops.
std::vector<float> prep_x(const torch::Tensor& x, int kind, int64_t Kp, bool generic, bool& scaled) {
    const int64_t T = x.size(0), K = x.size(1);
    std::vector<float> out((size_t)(T * Kp), 0.f);
    const bool fp8 = kind == FP8 && !generic;
#if defined(MOESAIC_AVX2)
    const float factor = fp8 ? FP8_X : 1.f;
    scaled = !fp8 || !(_mm_getcsr() & 0x40);
#else
    const float factor = 1.f;
    scaled = true;
#endif
    const bool perm = (kind == MX || kind == NV) && !generic;
    auto fill = [&](auto* src) {
        for (int64_t t = 0; t < T; ++t) {
            const auto* xr = src + t * K;
            float* o = out.data() + t * Kp;
            if (fp8) {
                bool bad = false;
                for (int64_t k = 0; k < K; ++k) {
                    const float v = (float)xr[k];
                    bad |= !(std::abs(v) < 0x1p63f);  // NaN included
                    o[k] = v * factor;
                }
                scaled = scaled && !bad;
                continue;
            }
            if (!perm) {
                for (int64_t k = 0; k < K; ++k) o[k] = (float)xr[k];
                continue;
            }
            const int64_t full = K / CH * CH;
            for (int64_t c = 0; c < full; c += CH)
                for (int p = 0; p < CH; ++p) o[c + p] = (float)xr[c + FP4_PERM[p]];
            if (full < K)
                for (int p = 0; p < CH; ++p) {
                    const int64_t k = full + FP4_PERM[p];
                    o[full + p] = k < K ? (float)xr[k] : 0.f;
                }
        }
    };
    if (x.scalar_type() == torch::kFloat32) fill(x.data_ptr<float>());
    else if (x.scalar_type() == torch::kBFloat16) fill(x.data_ptr<c10::BFloat16>());
    else fill(x.data_ptr<c10::Half>());
    return out;
}

// One 32-value block b of a record: its codes (the even values' to qe[0, 16), the odd values' to qo[0, 16)),
// -12 x each dword's sum of 8 codes to corr[0, 4), d / 2 to half_d[0, 4). False where b holds an inf or a NaN.
inline bool q8_block(const float* b, int8_t* qe, int8_t* qo, int32_t* corr, float* half_d) {
    float amax = 0.f;
    bool fin = true;
#if defined(MOESAIC_AVX2)
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), big = _mm256_set1_ps(FLT_MAX);
    __m256 v[4], mx = _mm256_setzero_ps();
    int ok = 0xFF;
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(b + 8 * i);
        const __m256 a = _mm256_and_ps(v[i], mag);
        mx = _mm256_max_ps(mx, a);
        ok &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for inf and NaN
    }
    fin = ok == 0xFF;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)  // nearest, ties to even (nearbyint's rounding), clamped
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
    // int32 -> int8 in value order (the packs interleave the lanes' dwords), then evens | odds per lane
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    p = _mm256_shuffle_epi8(p, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    p = _mm256_permute4x64_epi64(p, 0xD8);  // qwords 0, 2, 1, 3: the 16 even codes, then the 16 odd
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qe), _mm256_castsi256_si128(p));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qo), _mm256_extracti128_si256(p, 1));
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
    const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(corr), _mm_mullo_epi32(sums, _mm_set1_epi32(-12)));
#else
    for (int i = 0; i < 32; ++i) {
        const float m = std::abs(b[i]);
        amax = std::max(amax, m);
        fin &= m <= FLT_MAX;  // false for inf and NaN (which std::max would skip)
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t qb[32];
    for (int i = 0; i < 32; ++i) qb[i] = (int8_t)std::clamp(std::nearbyint(b[i] * inv), -127.f, 127.f);
    for (int i = 0; i < 16; ++i) {
        qe[i] = qb[2 * i];
        qo[i] = qb[2 * i + 1];
    }
    for (int d = 0; d < 4; ++d) {
        int32_t sum = 0;
        for (int i = 0; i < 8; ++i) sum += qb[8 * d + i];
        corr[d] = -12 * sum;
    }
#endif
    const float hd = amax / 127.f * 0.5f;
    for (int d = 0; d < 4; ++d) half_d[d] = hd;
    return fin;
}

// x [T, K] as int8 records for the int8 tiles (llama.cpp's Q8_0 rows, in the nibble planes' order): each 32
// values scaled by d = max |x| / 127 and rounded to the nearest code q (ties to even), one QREC-float record
// per 128 values (a VNNI load of packed codes; an AVX2 chunk is half of one): the q of its even values (bytes
// 0-63: the low nibbles' order), of its odd values (64-127), minus 12 x the sum of each dword's 8 codes (int32
// 32-47, the E2M1_U offset: the sums start from it) and d / 2 for each dword (floats 48-63: E2M1_U holds
// twice each value). Dword l of a record's sums covers values 8 l .. 8 l + 7. Zeros beyond K. False where x
// has a value that is not finite (the exact tiles then).
bool prep_x_q8(const torch::Tensor& x, int64_t nrec, std::vector<float>& out) {
    const int64_t T = x.size(0), K = x.size(1);
    out.assign((size_t)(T * nrec * QREC), 0.f);
    bool finite = true;
    auto fill = [&](auto* src) {
        float v[128];
        for (int64_t t = 0; t < T; ++t)
            for (int64_t c = 0; c < nrec; ++c) {
                const int64_t k0 = c * 128, n = std::min<int64_t>(128, K - k0);
                for (int64_t i = 0; i < 128; ++i) v[i] = i < n ? (float)src[t * K + k0 + i] : 0.f;
                float* rec = out.data() + (t * nrec + c) * QREC;
                int8_t* q = reinterpret_cast<int8_t*>(rec);
                int32_t* corr = reinterpret_cast<int32_t*>(rec + 32);
                for (int h = 0; h < 4; ++h)  // the four 32-value blocks
                    finite &= q8_block(v + 32 * h, q + 16 * h, q + 64 + 16 * h, corr + 4 * h, rec + 48 + 4 * h);
            }
    };
    if (x.scalar_type() == torch::kFloat32) fill(x.data_ptr<float>());
    else if (x.scalar_type() == torch::kBFloat16) fill(x.data_ptr<c10::BFloat16>());
    else fill(x.data_ptr<c10::Half>());
    return finite;
}

}  // namespace

// A gemm / dequant operand (see cpu.py) as the kernels read it: the call's shape C and the weights' layout W
// (fp4 becomes MX or NV in `kind`); C and W point into sub2blk and tabs, which the caller keeps.
void describe(int64_t& kind, const torch::Tensor& w, const std::optional<torch::Tensor>& scales,
              const std::optional<torch::Tensor>& gscale, bool divides, int64_t group, int64_t bn, int64_t bk,
              int64_t K, const std::vector<int64_t>& active, Ctx& C, Weights& W, std::vector<int32_t>& sub2blk,
              std::vector<float>& tabs) {
    const bool stacked = w.dim() == 3;
    const int64_t E = stacked ? w.size(0) : 1, N = w.size(-2);
    C.K = K;
    C.nfull = K / CH;
    C.tail_bytes = (K % CH) * CHUNK_BYTES[kind] / CH;
    C.group = (int)group;
    W.w = reinterpret_cast<const uint8_t*>(w.data_ptr());
    W.w_n = w.stride(-2) * w.element_size();
    W.w_e = stacked ? w.stride(0) * w.element_size() : 0;
    if (kind == BF16) {
        TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "w: bf16");
    } else {
        TORCH_CHECK(w.element_size() == 1, "w: byte codes");
        TORCH_CHECK(scales && scales->dim() == w.dim() && scales->stride(-1) == 1, "scales: one dim per w dim");
        const auto& S = *scales;
        W.s = reinterpret_cast<const uint8_t*>(S.data_ptr());
        W.s_n = S.stride(-2) * S.element_size();
        W.s_e = stacked ? S.stride(0) * S.element_size() : 0;
        if (kind == FP8) {
            TORCH_CHECK(bn > 0 && bk > 0, "fp8 block");
            const int64_t kb = (K + bk - 1) / bk;
            TORCH_CHECK(bk % 32 == 0 || kb == 1, "fp8: block columns must be a multiple of 32 (or span K)");
            TORCH_CHECK(S.size(-2) == (N + bn - 1) / bn && S.size(-1) == kb, "fp8: scale shape vs block");
            TORCH_CHECK(S.scalar_type() == torch::kFloat32 || S.element_size() == 1, "fp8 scales: fp32 or E8M0 bytes");
            W.s_f32 = S.scalar_type() == torch::kFloat32;
            W.bn = bn;
            W.bn_shift = (bn & (bn - 1)) == 0 ? __builtin_ctzll((unsigned long long)bn) : -1;
            const int64_t nsub = (K + CH - 1) / CH * 2;
            sub2blk.resize(nsub);
            for (int64_t i = 0; i < nsub; ++i) sub2blk[i] = 32 * i < K ? (int32_t)(32 * i / bk) : -1;
            C.sub2blk = sub2blk.data();
        } else {
            TORCH_CHECK(group == 16 || group == 32, "fp4 group 16 or 32");
            kind = group == 32 ? MX : NV;
            TORCH_CHECK(K % group == 0 && S.size(-2) == N && S.size(-1) == K / group && S.element_size() == 1,
                        "fp4 scales: [.., N, K / group] bytes");
            C.ngroups = K / group;
            if (gscale) {  // nvfp4: E4M3 byte -> its fp32 value over / times the matrix's global scale
                TORCH_CHECK(gscale->scalar_type() == torch::kFloat32 && gscale->is_contiguous() &&
                            gscale->numel() == E, "global scale: fp32, one per matrix (contiguous)");
                const float* g = gscale->data_ptr<float>();
                tabs.resize(256 * active.size());
                for (size_t a = 0; a < active.size(); ++a) {
                    const float ge = g[active[a]];
                    float* t = tabs.data() + 256 * a;
                    if (divides) for (int b = 0; b < 256; ++b) t[b] = E4M3[b] / ge;  // the reference's fp32 op
                    else for (int b = 0; b < 256; ++b) t[b] = E4M3[b] * ge;
                }
                W.stab = tabs.data();
                W.stab_per_expert = true;
                W.gsc = g;
                W.divides = divides;
            } else {  // mxfp4
                W.stab = E8M0;
            }
        }
    }
}

// out[t, n] (+)= x[t] . W_e[n] for the rows t of each expert e. See cpu.py for the argument contract.
torch::Tensor gemm(int64_t kind, torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> scales,
                   std::optional<torch::Tensor> gscale, bool divides, std::optional<torch::Tensor> offs,
                   std::optional<torch::Tensor> out_, std::optional<torch::Tensor> bias, int64_t group, int64_t bn,
                   int64_t bk, int64_t nthreads, int64_t path) {
    TORCH_CHECK(kind == BF16 || kind == FP8 || kind == FP4, "kind");
    TORCH_CHECK(path >= 0 && path <= (3 | Q8_PATH), "path: 0 best, 1 generic, 2 no AMX, 3 AVX2 (| Q8_PATH: int8 x)");
    const bool q8_asked = path & Q8_PATH;
    path &= ~Q8_PATH;
    bool generic = path == 1;
    const bool avx2_only = path == 3;  // no AVX-512 paths (vdpbf16ps, VNNI, AMX): the AVX2 tiles
    TORCH_CHECK(x.dim() == 2, "x: [T, K]");
    x = x.contiguous();
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                x.scalar_type() == torch::kHalf, "x: fp32, bf16 or fp16");
    const int64_t T = x.size(0), K = x.size(1);
    const bool stacked = w.dim() == 3;
    TORCH_CHECK(w.dim() == 2 || stacked, "w: [N, K'] or [E, N, K']");
    TORCH_CHECK(w.stride(-1) == 1, "w: unit stride in the last dim");
    const int64_t E = stacked ? w.size(0) : 1, N = w.size(-2);
    TORCH_CHECK(w.size(-1) == (kind == FP4 ? K / 2 : K) && (kind != FP4 || K % 2 == 0), "w: last dim vs K");
    torch::Tensor out = out_ ? *out_ : torch::empty({T, N}, x.options());
    TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == N && out.stride(1) == 1, "out: [T, N], unit stride");
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16 ||
                out.scalar_type() == torch::kHalf, "out: fp32, bf16 or fp16");
    std::vector<int64_t> ends(E, T);
    if (offs) {
        TORCH_CHECK(offs->dim() == 1 && offs->size(0) == E && offs->is_contiguous(), "offs: [E]");
        auto o = offs->to(torch::kInt64);
        const int64_t* op = o.data_ptr<int64_t>();
        for (int64_t e = 0; e < E; ++e) {
            ends[e] = op[e];
            TORCH_CHECK(ends[e] >= (e ? ends[e - 1] : 0) && ends[e] <= T, "offs: non-decreasing ends <= T");
        }
        TORCH_CHECK(ends[E - 1] == T, "offs: the last end must be T");
    } else {
        TORCH_CHECK(E == 1, "a stacked w needs offs");
    }

    Ctx C{};
    Weights W{};
    std::vector<int32_t> sub2blk;
    std::vector<float> tabs;
    std::vector<int64_t> slot_of(E, -1), active;
    for (int64_t e = 0; e < E; ++e)
        if (ends[e] > (e ? ends[e - 1] : 0)) {
            slot_of[e] = (int64_t)active.size();
            active.push_back(e);
        }
    describe(kind, w, scales, gscale, divides, group, bn, bk, K, active, C, W, sub2blk, tabs);
    const float* bp = nullptr;
    torch::Tensor bias32;
    if (bias) {
        bias32 = bias->to(torch::kFloat32).contiguous();
        TORCH_CHECK(bias32.numel() == N, "bias: [N]");
        bp = bias32.data_ptr<float>();
    }
    Out O{out.data_ptr(), out.scalar_type() == torch::kFloat32 ? 0 : out.scalar_type() == torch::kBFloat16 ? 1 : 2,
          out.stride(0), bp};
#if !defined(MOESAIC_AVX2)
    generic = true;
#endif
    C.kind = (int)kind;
#if defined(MOESAIC_AVX512BF16)
    const bool dp = !generic && !avx2_only && x.scalar_type() == torch::kBFloat16;  // vdpbf16ps
#else
    const bool dp = false;
#endif
#if defined(MOESAIC_AVX2)
    if (kind == FP8 && !generic && !dp && !fp8_scales_fit(W, active, (N + bn - 1) / bn, (K + bk - 1) / bk))
        generic = true;  // a scale of 2^72 or more (or NaN): the portable loops
#endif
    int64_t Kp = generic ? K : (K + CH - 1) / CH * CH;
    bool scaled = true;
    // int8 activations where asked, against E2M1 weights: VNNI where the CPU has it (any x dtype), else the AVX2
    // tiles (bf16 x on AVX-512 BF16 CPUs without VNNI / VBMI keeps vdpbf16ps); x with a value that is not
    // finite keeps the exact tiles
#if defined(MOESAIC_VNNI512)
    const bool vnni = !avx2_only;
#else
    const bool vnni = false;
#endif
    std::vector<float> xq;
    const int64_t nrec = (K + 127) / 128;
    const bool q8 = q8_asked && (kind == MX || kind == NV) && !generic && (vnni || !dp) && prep_x_q8(x, nrec, xq);
    if (q8) Kp = nrec * QREC;  // xp's row stride: the records
    std::vector<float> xp = dp || q8 ? std::move(xq) : prep_x(x, (int)kind, Kp, generic, scaled);
    if (!scaled) {  // fp8 against an x the scaled decode cannot take: the portable loops
        generic = true;
        Kp = K;
        xp = prep_x(x, (int)kind, Kp, generic, scaled);
    }
    std::vector<uint16_t> x4;
    const int64_t Kc = kind == FP8 ? (K + CH - 1) / CH * CH : (K + 127) / 128 * 128;  // whole loads
    std::vector<uint32_t> xpairs;           // the pair tiles' x (fp32-scaled E4M3): packed once a call, shared by
    std::vector<int64_t> pair_group(E, -1);  // an expert's items; its first group of 16 rows (-1: not packed)
    const int64_t pair_gs = (K + 31) / 32 * 256;  // dwords of a group
    (void)pair_gs;
#if defined(MOESAIC_AVX512BF16)
    if (dp && kind == FP8) x4 = prep_x_fp8dp(x, Kc);
    else if (dp && kind != BF16 && !(q8 && vnni)) x4 = prep_x_fp4dp(x, Kc);
    if (dp) {
        int64_t groups = 0;
        for (int64_t e : active) {
            const int64_t rows = ends[e] - (e ? ends[e - 1] : 0);
            if (takes_pairs(kind, W.s_f32, K, rows)) pair_group[e] = groups, groups += (rows + 15) / 16;
        }
        xpairs.resize(groups ? (size_t)(groups * pair_gs + 16) : 0);
        uint32_t* xq = align64(xpairs.data());
        for (int64_t e : active)
            for (int64_t g = 0, t0 = e ? ends[e - 1] : 0; pair_group[e] >= 0 && t0 + 16 * g < ends[e]; ++g)
                pack_x_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr()), K, t0 + 16 * g,
                             std::min<int64_t>(16, ends[e] - t0 - 16 * g), 16, xq + (pair_group[e] + g) * pair_gs);
    }
#endif
    const uint16_t* xb = !dp ? nullptr : kind == BF16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : align64(x4.data());
    (void)xb;  // used by the AVX-512 BF16 paths only
    bool amx = false;
#if defined(MOESAIC_AMX)
    // AMX for bf16 x at every M against bf16 weights, from AMX_PACKED_ROWS against packed ones (decoded to
    // bf16 a block of rows at a time), wherever the process may use the tiles: every expert's rows packed once
    int64_t most = 0;
    for (int64_t e : active) most = std::max(most, ends[e] - (e ? ends[e - 1] : 0));
    const int64_t amx_rows = q8 && vnni ? AMX_Q8_ROWS : AMX_PACKED_ROWS[kind];
    amx = dp && most >= amx_rows && path == 0 && amx_permitted();
    const int64_t pairs = (K + 31) / 32 * 16;  // dwords of one packed x row
    std::vector<uint32_t> xa(amx ? (size_t)(T * pairs) : 0);
    if (amx)
        for (int64_t e : active)  // by 16 rows: one B tile's columns
            for (int64_t t = e ? ends[e - 1] : 0; t < ends[e]; t += 16)
                pack_x_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr()), K, t, std::min<int64_t>(16, ends[e] - t),
                             std::min<int64_t>(16, ends[e] - t), xa.data() + t * pairs);
#endif

    // work items: (expert, block of rows); enough of them to balance the threads
    const int nt = (int)std::max<int64_t>(1, nthreads);
    const int64_t n_act = std::max<int64_t>(1, (int64_t)active.size());
    const int64_t per_expert = nt == 1 ? 1 : std::max<int64_t>(1, (4 * nt + n_act - 1) / n_act);
    const int64_t rb = amx ? 32 : 8;  // rows a block (AMX: two tiles)
    const int64_t rows = std::max<int64_t>(rb, ((N + per_expert - 1) / per_expert + rb - 1) / rb * rb);
    std::vector<std::array<int64_t, 3>> items;  // expert, n0, n1
    for (int64_t e : active)
        for (int64_t n0 = 0; n0 < N; n0 += rows) items.push_back({e, n0, std::min(N, n0 + rows)});
    const int64_t n_items = (int64_t)items.size();
    // one item (AMX: packed rows decoded to bf16 in dbuf)
    auto run = [&](int64_t i, Scratch& sc, std::vector<uint16_t>& dbuf) {
        (void)dbuf;
        const int64_t e = items[i][0];
        const int64_t t0 = e ? ends[e - 1] : 0;
        const int64_t slot = slot_of[e];
#if defined(MOESAIC_AMX)
        const int64_t M = ends[e] - t0;
        if (amx && M >= amx_rows) {
            const uint32_t* xe = xa.data() + t0 * pairs;
            if (kind == BF16) {
                // blocks of at most 1 MB (512 rows of K = 1024): more than 32 activation rows read a
                // block again, from L2
                AmxBf16 src{W.w + e * W.w_e, W.w_n, K / 32, std::max<int64_t>(32, std::min<int64_t>(512, (1 << 19) / std::max<int64_t>(K, 1) / 32 * 32))};
                amx_item(src, K, items[i][1], items[i][2], xe, t0, M, O);
                return;
            }
            const int64_t Kp = (K + 31) / 32 * 32, block = std::max<int64_t>(32, std::min<int64_t>(512, (1 << 18) / Kp / 32 * 32));
            AmxPacked src{C, W, e, slot, Kp, block, kind == FP8 && W.s_f32, W.divides,
                          kind == NV && W.gsc ? W.gsc[e] : 1.f, dbuf};
            if (amx_item(src, K, items[i][1], items[i][2], xe, t0, M, O)) return;
            // a scale the fold cannot take exactly: this item by vdpbf16ps below
        }
#endif
#if defined(MOESAIC_VNNI512)
        if (q8 && vnni) {  // (MXQ / NVQ: MX / NV + 2)
            with_value<MXQ, NVQ>(kind + (MXQ - MX), [&](auto K) {
                run_item_dp<decltype(K)::value>(C, W, e, slot, items[i][1], items[i][2], xp.data(), Kp, t0,
                                                ends[e] - t0, O, sc);
            });
            return;
        }
#endif
#if defined(MOESAIC_AVX512BF16)
        if (dp) {
            const uint16_t* xn = reinterpret_cast<const uint16_t*>(x.data_ptr());  // x rows in natural order
            const int64_t M = ends[e] - t0;
            const uint32_t* xq = pair_group[e] >= 0 ? align64(xpairs.data()) + pair_group[e] * pair_gs : nullptr;
            const bool folds = kind != BF16 && !(kind == FP8 && W.s_f32) && M >= DECODED_ROWS;
            const bool pairs = takes_pairs(kind, W.s_f32, K, M);
            if (kind == BF16 && M >= GEMM_ROWS) run_item_gemm(C, W, e, items[i][1], items[i][2], xb, K, t0, M, O, sc);
            else if (folds && pairs &&
                     run_item_pairs(C, W, e, slot, items[i][1], items[i][2], xn, t0, M, O, sc, dbuf, xq, true))
                return;
            else if (folds && !pairs && run_item_decoded(C, W, e, slot, items[i][1], items[i][2], xn, t0, M, O, sc, dbuf))
                return;
            else if (kind == FP8 && M >= PAIR_ROWS)  // fp32 block scales, or E8M0 ones that do not fold
                run_item_pairs(C, W, e, slot, items[i][1], items[i][2], xn, t0, M, O, sc, dbuf, xq, false);
            else if (kind == BF16) run_item_dp<BF16>(C, W, e, slot, items[i][1], items[i][2], xb, K, t0, M, O, sc);
            else if (kind == FP8) run_item_dp<FP8>(C, W, e, slot, items[i][1], items[i][2], xb, Kc, t0, M, O, sc);
            else if (kind == MX) run_item_dp<MX>(C, W, e, slot, items[i][1], items[i][2], xb, Kc, t0, M, O, sc);
            else run_item_dp<NV>(C, W, e, slot, items[i][1], items[i][2], xb, Kc, t0, M, O, sc);
            return;
        }
#endif
        // the int8 tiles where q8 (MXQ / NVQ: MX / NV + 2; generic is false there)
        with_value<BF16, FP8, MX, NV, MXQ, NVQ>(q8 ? kind + (MXQ - MX) : kind, [&](auto K) {
            run_item<decltype(K)::value>(C, W, e, slot, items[i][1], items[i][2], xp.data(), Kp, t0, ends[e] - t0,
                                         O, generic, sc);
        });
    };
    auto trim = [](Scratch& sc) {  // keep at most 4 MB a buffer a thread (a long prompt's sums and packed x)
        if (sc.wbuf.capacity() > (1 << 20)) std::vector<float>().swap(sc.wbuf);
        if (sc.pairs.capacity() > (1 << 20)) std::vector<uint32_t>().swap(sc.pairs);
    };
    pybind11::gil_scoped_release no_gil;
    if (nt > 1 && n_items > 1) {
#pragma omp parallel num_threads(nt)
        {
            Scratch& sc = thread_scratch();
            std::vector<uint16_t> dbuf;
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_items; ++i) run(i, sc, dbuf);
            trim(sc);
        }
    } else {  // here, without a parallel region (its setup is a measurable part of a one-row call)
        Scratch& sc = thread_scratch();
        std::vector<uint16_t> dbuf;
        for (int64_t i = 0; i < n_items; ++i) run(i, sc, dbuf);
        trim(sc);
    }
    return out;
}

// Row n of a packed matrix as fp32 values w[0, K): each the one fp32 product of the code's value and its
// scale that QuantizedTensor.dequantize_rows computes (NaN codes NaN), for the tiles a prefill multiplies.
void dequant_row(const Ctx& C, const Row& r, float* w, bool generic) {
    if (C.kind == FP8) {
        int64_t c = 0;
#if defined(MOESAIC_AVX2)
        // 64 values a load by the fp16 trick (times 2^8 exact), the sub-block's scale once; from a load with
        // a NaN code (the trick decodes it as 480) on, by the table
        const __m256 two8 = _mm256_set1_ps(256.f);
        const __m256i mag = _mm256_set1_epi8(0x7F);
        for (; !generic && c < C.nfull; ++c) {
            const uint8_t* p = r.w + c * CH;
            const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mag);
            const __m256i b = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), mag);
            if (_mm256_movemask_epi8(_mm256_or_si256(_mm256_cmpeq_epi8(a, mag), _mm256_cmpeq_epi8(b, mag)))) break;
            __m256 v[8];
            dec_fp8(p, v);
            const __m256 sA = _mm256_set1_ps(fp8_scale(r, C.sub2blk[2 * c]));
            const __m256 sB = _mm256_set1_ps(fp8_scale(r, C.sub2blk[2 * c + 1]));
            for (int j = 0; j < 8; ++j)
                _mm256_storeu_ps(w + c * CH + 8 * j, _mm256_mul_ps(_mm256_mul_ps(v[j], two8), j < 4 ? sA : sB));
        }
#endif
        for (int64_t k = c * CH; k < C.K; ++k) w[k] = E4M3[r.w[k]] * fp8_scale(r, C.sub2blk[k / 32]);
        return;
    }
    // E2M1 (K a multiple of the group, 16 or 32): a group's scale once, two values a byte
#if defined(MOESAIC_AVX2)
    if (!generic) {  // 8 bytes (16 values) at a time: the magnitudes by vpermps, the sign bit or-ed in
        const __m256 mags = _mm256_loadu_ps(E2M1);
        const __m256i nib = _mm256_set1_epi32(15), sign = _mm256_set1_epi32(8);
        for (int64_t q = 0; q < C.K / 16; ++q) {
            const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.w + 8 * q)));
            const __m256i lo = _mm256_and_si256(d, nib), hi = _mm256_srli_epi32(d, 4);
            const __m256 vl = _mm256_or_ps(_mm256_permutevar8x32_ps(mags, lo),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(lo, sign), 28)));
            const __m256 vh = _mm256_or_ps(_mm256_permutevar8x32_ps(mags, hi),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(hi, sign), 28)));
            const __m256 a = _mm256_unpacklo_ps(vl, vh), b = _mm256_unpackhi_ps(vl, vh);  // pairs 0,1,4,5 / 2,3,6,7
            const __m256 s = _mm256_set1_ps(r.stab[r.s8[16 * q / C.group]]);
            _mm256_storeu_ps(w + 16 * q, _mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x20), s));
            _mm256_storeu_ps(w + 16 * q + 8, _mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x31), s));
        }
        return;
    }
#endif
    for (int64_t g = 0; g < C.ngroups; ++g) {
        const float s = r.stab[r.s8[g]];
        const uint8_t* p = r.w + g * C.group / 2;
        float* o = w + g * C.group;
        for (int j = 0; j < C.group / 2; ++j) {
            o[2 * j] = E2M1[p[j] & 15] * s;
            o[2 * j + 1] = E2M1[p[j] >> 4] * s;
        }
    }
}

// out [R, K] fp32 = rows [r0, r0 + R) of one packed matrix (a gemm operand: w [N, K'] codes, its scales,
// global scale), dequantized (dequant_row; `generic`: the portable loops), by `nthreads` threads over rows.
void dequant(int64_t kind, torch::Tensor w, torch::Tensor scales, std::optional<torch::Tensor> gscale, bool divides,
             int64_t group, int64_t bn, int64_t bk, int64_t r0, torch::Tensor out, int64_t nthreads, bool generic) {
    TORCH_CHECK(kind == FP8 || kind == FP4, "kind: packed (fp8 or fp4)");
    TORCH_CHECK(w.dim() == 2 && w.stride(-1) == 1, "w: [N, K'], unit stride in the last dim");
    TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat32 && out.stride(1) == 1, "out: fp32 [R, K]");
    const int64_t R = out.size(0), K = out.size(1), N = w.size(0);
    TORCH_CHECK(w.size(1) == (kind == FP4 ? K / 2 : K) && (kind != FP4 || K % 2 == 0), "w: last dim vs K");
    TORCH_CHECK(r0 >= 0 && r0 + R <= N, "rows out of range");
    Ctx C{};
    Weights W{};
    std::vector<int32_t> sub2blk;
    std::vector<float> tabs;
    const std::vector<int64_t> active{0};
    describe(kind, w, scales, gscale, divides, group, bn, bk, K, active, C, W, sub2blk, tabs);
    C.kind = (int)kind;
    float* o = out.data_ptr<float>();
    const int64_t ld = out.stride(0);
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel for num_threads((int)std::max<int64_t>(1, nthreads)) schedule(static)
    for (int64_t i = 0; i < R; ++i) dequant_row(C, row_of(C, W, 0, 0, r0 + i), o + i * ld, generic);
}

// Streaming read of a buffer by `nthreads` threads, 4 rows of `row` bytes side by side (the weight
// access pattern of the kernels): the benchmark's read-bandwidth ceiling. Returns a checksum.
double read_bytes(torch::Tensor buf, int64_t row, int64_t nthreads) {
    TORCH_CHECK(buf.is_contiguous() && row % 128 == 0 && buf.nbytes() % (4 * row) == 0, "buf: 4*row | nbytes");
    const uint8_t* p = reinterpret_cast<const uint8_t*>(buf.data_ptr());
    const int64_t groups = buf.nbytes() / (4 * row);
    double total = 0;
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel for num_threads((int)nthreads) reduction(+ : total) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* q = p + g * 4 * row;
#if defined(MOESAIC_AVX2)
        __m256i a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_si256();
        for (int64_t i = 0; i < row; i += 64)
            for (int r = 0; r < 4; ++r) {
                const __m256i* v = reinterpret_cast<const __m256i*>(q + r * row + i);
                a[2 * r] = _mm256_add_epi64(a[2 * r], _mm256_loadu_si256(v));
                a[2 * r + 1] = _mm256_add_epi64(a[2 * r + 1], _mm256_loadu_si256(v + 1));
            }
        for (int j = 1; j < 8; ++j) a[0] = _mm256_add_epi64(a[0], a[j]);
        alignas(32) int64_t s[4];
        _mm256_store_si256(reinterpret_cast<__m256i*>(s), a[0]);
        total += (double)(s[0] + s[1] + s[2] + s[3]);
#else
        int64_t a = 0;
        for (int64_t i = 0; i < row; i += 8)
            for (int r = 0; r < 4; ++r) a += *reinterpret_cast<const int64_t*>(q + r * row + i);
        total += (double)a;
#endif
    }
    return total;
}

// mHC's Sinkhorn normalisation in place on c [M, n, n] fp32 (contiguous), after its row softmax + eps:
// one column normalisation, then iters - 1 rounds of rows then columns, x / (sum + eps) with every sum
// taken in index order: the same float operations, in the same order, as the torch loop of
// layers/mhc.py (which spends ~120 small ops per call on what is a few hundred flops here).
void sinkhorn(torch::Tensor c, int64_t iters, double eps_d) {
    TORCH_CHECK(c.dtype() == torch::kFloat32 && c.is_contiguous() && c.dim() >= 2, "sinkhorn: fp32 [.., n, n]");
    const int64_t n = c.size(-1);
    TORCH_CHECK(c.size(-2) == n && n <= 64, "sinkhorn: square matrices of at most 64");
    const int64_t M = c.numel() / (n * n);
    const float eps = (float)eps_d;
    float* base = c.data_ptr<float>();
    // 16 matrices at a time where n <= 8, lane l one matrix: the loop below's operations in each lane, so the same
    // bits (a prompt's 256 rows took ~1 us a matrix one at a time, the divisions' latency in a chain)
    const int64_t M16 = n <= 8 ? M / 16 * 16 : 0, nn = n * n;
    for (int64_t m0 = 0; m0 < M16; m0 += 16) {
        alignas(64) float v[64][16], t[8][16];
        for (int l = 0; l < 16; ++l)
            for (int64_t e = 0; e < nn; ++e) v[e][l] = base[(m0 + l) * nn + e];
        for (int64_t it = 0; it < iters; ++it) {
            if (it > 0) {  // rows
                for (int64_t i = 0; i < n; ++i) {
                    for (int l = 0; l < 16; ++l) t[0][l] = 0.f;
                    for (int64_t j = 0; j < n; ++j)
                        for (int l = 0; l < 16; ++l) t[0][l] += v[i * n + j][l];
                    for (int l = 0; l < 16; ++l) t[0][l] += eps;
                    for (int64_t j = 0; j < n; ++j)
                        for (int l = 0; l < 16; ++l) v[i * n + j][l] /= t[0][l];
                }
            }
            for (int64_t j = 0; j < n; ++j)  // columns
                for (int l = 0; l < 16; ++l) t[j][l] = 0.f;
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j)
                    for (int l = 0; l < 16; ++l) t[j][l] += v[i * n + j][l];
            for (int64_t j = 0; j < n; ++j)
                for (int l = 0; l < 16; ++l) t[j][l] += eps;
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j)
                    for (int l = 0; l < 16; ++l) v[i * n + j][l] /= t[j][l];
        }
        for (int l = 0; l < 16; ++l)
            for (int64_t e = 0; e < nn; ++e) base[(m0 + l) * nn + e] = v[e][l];
    }
    float s[64];
    for (int64_t m = M16; m < M; ++m) {
        float* x = base + m * n * n;
        for (int64_t it = 0; it < iters; ++it) {
            if (it > 0) {  // rows
                for (int64_t i = 0; i < n; ++i) {
                    float t = 0.f;
                    for (int64_t j = 0; j < n; ++j) t += x[i * n + j];
                    t += eps;
                    for (int64_t j = 0; j < n; ++j) x[i * n + j] /= t;
                }
            }
            for (int64_t j = 0; j < n; ++j) s[j] = 0.f;  // columns
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j) s[j] += x[i * n + j];
            for (int64_t j = 0; j < n; ++j) s[j] += eps;
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j) x[i * n + j] /= s[j];
        }
    }
}

// ---- Fused RMSNorm and rope for inference on the CPU: the float operations of layers/norms.py and
// layers/rope.py, in their order, with their roundings, in one pass (torch spends 8-13 small ops on each).
// No FMA contraction here: torch rounds every product.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace {
// The seconds spent in the weight products inside calls that also do other work (mhc_enter's site product,
// dsa_gathered_bf16's W_k and W_v, kda_block's kda_project and o's product), for a benchmark's split of a step
// into products and the rest (thread seconds: wall seconds on one thread). Counted only while switched on
// (product_seconds).
std::atomic<bool> product_clock_on{false};
std::atomic<int64_t> product_clock_ns{0};
struct ProductClock {  // times its scope where the clock is on
    const bool on = product_clock_on.load(std::memory_order_relaxed);
    const std::chrono::steady_clock::time_point t0 = on ? std::chrono::steady_clock::now()
                                                         : std::chrono::steady_clock::time_point{};
    ~ProductClock() {
        if (on)
            product_clock_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now() - t0).count();
    }
};

enum Ty { F32 = 0, BF16T = 1, F16T = 2 };  // a storage / rounding type

// always_inline: GCC does not inline across the optimize attributes of these regions otherwise (mla_absorbed,
// outside them, called both per value: 13 % of its time at 4096 cached rows)
__attribute__((always_inline)) inline float bf16_bits_to_f32(uint16_t h) { return bits_to_float((uint32_t)h << 16); }
__attribute__((always_inline)) inline uint16_t f32_to_bf16_bits(float f) {  // nearest even, NaN kept quiet (c10's)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__attribute__((always_inline)) inline float round_bf16(float x) {  // x to bf16 and back
    return bf16_bits_to_f32(f32_to_bf16_bits(x));
}
// A row of n values of type t <-> fp32, and an fp32 row rounded to t in place: one loop per type, so
// that each vectorises.
void load_row(int t, const void* p, float* y, int64_t n) {
    if (t == BF16T) {
        const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
        for (int64_t k = 0; k < n; ++k) y[k] = bf16_bits_to_f32(q[k]);
    } else if (t == F16T) {
        const c10::Half* q = reinterpret_cast<const c10::Half*>(p);
        for (int64_t k = 0; k < n; ++k) y[k] = (float)q[k];
    } else {
        std::memcpy(y, p, n * sizeof(float));
    }
}
void store_row(int t, const float* y, void* p, int64_t n) {
    if (t == BF16T) {
        uint16_t* q = reinterpret_cast<uint16_t*>(p);
        for (int64_t k = 0; k < n; ++k) q[k] = f32_to_bf16_bits(y[k]);
    } else if (t == F16T) {
        c10::Half* q = reinterpret_cast<c10::Half*>(p);
        for (int64_t k = 0; k < n; ++k) q[k] = c10::Half(y[k]);
    } else {
        std::memcpy(p, y, n * sizeof(float));
    }
}
void round_row(int t, float* y, int64_t n) {
    if (t == BF16T)
        for (int64_t k = 0; k < n; ++k) y[k] = round_bf16(y[k]);
    else if (t == F16T)
        for (int64_t k = 0; k < n; ++k) y[k] = (float)c10::Half(y[k]);
}
int ty_of(const torch::Tensor& t) {
    auto d = t.scalar_type();
    TORCH_CHECK(d == torch::kFloat32 || d == torch::kBFloat16 || d == torch::kHalf, "fp32/bf16/fp16 only");
    return d == torch::kBFloat16 ? BF16T : d == torch::kHalf ? F16T : F32;
}
torch::ScalarType st_of(int64_t t) { return t == BF16T ? torch::kBFloat16 : t == F16T ? torch::kHalf : torch::kFloat32; }

// torch's sum of a contiguous fp32 row (cascade_sum in aten/src/ATen/native/cpu/SumKernel.cpp): items of L
// lanes (vectors, or L = 1 scalars) taken 4 at a time into 4 accumulators, which spill every 2^p items
// into a 4-level cascade (p = max(4, ceil_log2(items / 4) / 4)); leftover items go to the first; the
// four are folded in order.
template <int L>
void row_sum(const float* s, int64_t items, float out[L]) {
    const int64_t size = items / 4;
    int64_t cl = 1;  // CeilLog2(size) as torch's utils::CeilLog2 (1 for size <= 2)
    if (size > 2) { cl = 0; while ((int64_t(1) << cl) < size) ++cl; }
    const int64_t lp = std::max<int64_t>(4, cl / 4), step = int64_t(1) << lp, mask = step - 1;
    float acc[4][4][L];
    std::fill_n(&acc[0][0][0], 16 * L, 0.f);
    int64_t i = 0;
    auto add_item = [&](int64_t item, float* a) { for (int l = 0; l < L; ++l) a[l] += s[item * L + l]; };
    for (; i + step <= size;) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; ++k) add_item(i * 4 + k, acc[0][k]);
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < L; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.f; }
            if ((i & (mask << (j * lp))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < 4; ++k) add_item(i * 4 + k, acc[0][k]);
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
    for (int64_t it = size * 4; it < items; ++it) add_item(it, acc[0][0]);
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
    for (int l = 0; l < L; ++l) out[l] = acc[0][0][l];
}

// The whole row as torch sums it: rows of at least W values as vectors of W lanes (W = the lanes of
// torch's Vectorized<float> in the build it dispatches to), then the scalar tail from 0, then the lanes
// in order; shorter rows as scalars.
template <int W>
float torch_sum(const float* s, int64_t n) {
    if (n < W) { float r[1]; row_sum<1>(s, n, r); return r[0]; }
    const int64_t nv = n / W;
    float lanes[W];
    row_sum<W>(s, nv, lanes);
    float acc = 0.f;
    for (int64_t k = nv * W; k < n; ++k) acc += s[k];
    for (int l = 0; l < W; ++l) acc += lanes[l];
    return acc;
}

// sum(v * v) of D values in torch's order (`lanes`: its vectors' lanes, torch_sum); sq [D] is scratch.
inline float sum_squares(const float* v, float* sq, int64_t D, int64_t lanes) {
    for (int64_t k = 0; k < D; ++k) sq[k] = v[k] * v[k];
    return lanes == 8 ? torch_sum<8>(sq, D) : torch_sum<16>(sq, D);
}

// One row of rms_norm below, in place: v [D] (the row as loaded, fp32) becomes rnd_mid(x' *
// rnd_factor(rsqrt(mean(x'^2) + eps))) times w (none where w is null: 1 * v is v), x' = rnd_pre(v); sq [D]
// is scratch.
inline void norm_row(float* v, float* sq, const float* w, int64_t D, float eps, int pre, int mid, int factor,
                     int64_t lanes) {
    round_row(pre, v, D);
    float inv = 1.f / std::sqrt(sum_squares(v, sq, D, lanes) / (float)D + eps);
    round_row(factor, &inv, 1);
    for (int64_t k = 0; k < D; ++k) v[k] = v[k] * inv;
    round_row(mid, v, D);
    if (w)
        for (int64_t k = 0; k < D; ++k) v[k] = w[k] * v[k];
}
}  // namespace

// y = rnd_out(w * rnd_mid(x' * rnd_factor(rsqrt(mean(x'^2) + eps)))), x' = rnd_pre(x), per row of x [R, D]
// (rows strided, values contiguous): layers/norms.py's orders are choices of pre / mid / out / factor. w [G, D]:
// row r takes w[r % G] (a norm over G groups of each row, as Mamba-2's, with its full-width weight).
// rms_norm and add_rms_norm below: with `delta` [R, D] (x's dtype, contiguous rows), each row is x + delta
// rounded to x's dtype (torch's add), written to `sum`, then normed.
torch::Tensor norm_rows(const torch::Tensor& x, const torch::Tensor* delta, torch::Tensor* sum, const torch::Tensor& w,
                        double eps_d, int64_t pre, int64_t mid, int64_t out_ty, int64_t lanes, int64_t nthreads,
                        int64_t factor) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (w.dim() == 1 || w.dim() == 2) && w.is_contiguous() &&
                    w.size(-1) == x.size(1),
                "rms_norm: x [R, D] with contiguous rows, w [D] or [G, D] (row r takes w[r % G])");
    TORCH_CHECK(lanes == 8 || lanes == 16, "rms_norm: 8 or 16 lanes");
    const int64_t R = x.size(0), D = x.size(1), xs = x.stride(0);
    const int tx = ty_of(x);
    auto out = torch::empty({R, D}, x.options().dtype(st_of(out_ty)));
    const char* xp = reinterpret_cast<const char*>(x.data_ptr());
    char* op = reinterpret_cast<char*>(out.data_ptr());
    const int64_t xe = x.element_size(), oe = out.element_size();
    const char* dp = nullptr;
    char* sp = nullptr;
    int64_t ds = 0;
    if (delta) {
        TORCH_CHECK(delta->dim() == 2 && delta->size(0) == R && delta->size(1) == D && delta->stride(1) == 1 &&
                        delta->scalar_type() == x.scalar_type(), "add_rms_norm: delta [R, D] in x's dtype, rows contiguous");
        *sum = torch::empty({R, D}, x.options());
        dp = reinterpret_cast<const char*>(delta->data_ptr());
        sp = reinterpret_cast<char*>(sum->data_ptr());
        ds = delta->stride(0);
    }
    const float eps = (float)eps_d;
    const int64_t G = w.dim() == 2 ? w.size(0) : 1;
    std::vector<float> wf(G * D);
    load_row(ty_of(w), w.data_ptr(), wf.data(), G * D);
    auto rows = [&](int64_t r0, int64_t r1) {  // rows r0..r1-1 with their own buffers
        std::vector<float> xv(D), sq(D);
        float* v = xv.data();
        for (int64_t r = r0; r < r1; ++r) {
            load_row(tx, xp + r * xs * xe, v, D);
            if (dp) {
                load_row(tx, dp + r * ds * xe, sq.data(), D);
                for (int64_t k = 0; k < D; ++k) v[k] = v[k] + sq[k];
                round_row(tx, v, D);
                store_row(tx, v, sp + r * D * xe, D);
            }
            norm_row(v, sq.data(), wf.data() + (r % G) * D, D, eps, (int)pre, (int)mid, (int)factor, lanes);
            store_row((int)out_ty, v, op + r * D * oe, D);
        }
    };
    if (nthreads > 1 && R > 1) {
#pragma omp parallel num_threads((int)nthreads)
        {
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            rows(R * id / nt, R * (id + 1) / nt);
        }
    } else {
        rows(0, R);
    }
    return out;
}
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, int64_t pre, int64_t mid, int64_t out_ty,
                       int64_t lanes, int64_t nthreads, int64_t factor) {
    return norm_rows(x, nullptr, nullptr, w, eps, pre, mid, out_ty, lanes, nthreads, factor);
}
// A residual add and the norm after it: {x + delta, rms_norm of it} (vLLM's fused_add_rms_norm), one call.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps, int64_t pre,
                                        int64_t mid, int64_t out_ty, int64_t lanes, int64_t nthreads, int64_t factor) {
    torch::Tensor sum;
    auto out = norm_rows(x, &delta, &sum, w, eps, pre, mid, out_ty, lanes, nthreads, factor);
    return {sum, out};
}

// Rotary embedding of x [n, M, dim] (values contiguous) by cos/sin [n, dim/2] (contiguous, rounded to x's
// dtype first), into a new contiguous tensor. layout 0: pairs (x[2i], x[2i+1]) out as [evens | odds]
// (rope_interleaved); 1: pairs (x[i], x[i + dim/2]) (rope_half); both compute a*c - b*s and b*c + a*s in
// x's dtype, every product and sum rounded to it. 2: pairs (x[2i], x[2i+1]) kept in place, in fp32, one
// rounding at the end (rope_pairs). `keep` > 0: x's rows are [keep channels | dim rotated ones], the first
// `keep` copied to the output as they are (V4's [nope | rope] heads in one call, without a concatenation).
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t layout, int64_t nthreads,
                   int64_t keep) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && keep >= 0 && x.size(2) > keep && (x.size(2) - keep) % 2 == 0,
                "rope: x [n, M, keep + dim], dim even");
    const int64_t n = x.size(0), M = x.size(1), width = x.size(2), dim = width - keep, h = dim / 2;
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == n &&
                cos.size(1) == h && sin.sizes() == cos.sizes(), "rope: cos/sin [n, dim/2] contiguous");
    const int t = ty_of(x), tc = ty_of(cos), ts = ty_of(sin);
    auto out = torch::empty({n, M, width}, x.options());
    const char* xp = reinterpret_cast<const char*>(x.data_ptr());
    char* op = reinterpret_cast<char*>(out.data_ptr());
    const int64_t xe = x.element_size(), s0 = x.stride(0), s1 = x.stride(1);
    const int64_t ce = cos.element_size(), se = sin.element_size();
    const char* cp = reinterpret_cast<const char*>(cos.data_ptr());
    const char* sp = reinterpret_cast<const char*>(sin.data_ptr());
    auto rows = [&](int64_t i0, int64_t i1) {  // rows i0..i1-1 of [n * M] with their own buffers
        std::vector<float> c(h), s(h), xv(dim), a(h), b(h), as(h), bs(h), y(dim);
        int64_t last = -1;
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t p = i / M, m = i % M;
            if (p != last) {  // this position's cos/sin, rounded to x's dtype
                load_row(tc, cp + p * h * ce, c.data(), h);
                load_row(ts, sp + p * h * se, s.data(), h);
                round_row(t, c.data(), h);
                round_row(t, s.data(), h);
                last = p;
            }
            const char* src = xp + (p * s0 + m * s1) * xe;
            char* dst = op + i * width * xe;
            if (keep) {
                std::memcpy(dst, src, keep * xe);
                src += keep * xe;
                dst += keep * xe;
            }
            load_row(t, src, xv.data(), dim);
            for (int64_t j = 0; j < h; ++j) {  // the pair (a, b)
                a[j] = xv[layout == 1 ? j : 2 * j];
                b[j] = xv[layout == 1 ? j + h : 2 * j + 1];
            }
            float* y0 = y.data();
            float* y1 = y.data() + h;
            for (int64_t j = 0; j < h; ++j) {
                y0[j] = a[j] * c[j];
                y1[j] = b[j] * c[j];
                as[j] = a[j] * s[j];
                bs[j] = b[j] * s[j];
            }
            if (layout == 2) {  // in place, fp32 sums, one rounding
                for (int64_t j = 0; j < h; ++j) {
                    xv[2 * j] = y0[j] + (-bs[j]);
                    xv[2 * j + 1] = y1[j] + as[j];
                }
                store_row(t, xv.data(), dst, dim);
                continue;
            }
            round_row(t, y.data(), dim);  // every product in x's dtype, then the sums
            round_row(t, as.data(), h);
            round_row(t, bs.data(), h);
            for (int64_t j = 0; j < h; ++j) {
                y0[j] = y0[j] - bs[j];
                y1[j] = y1[j] + as[j];
            }
            store_row(t, y.data(), dst, dim);
        }
    };
    const int64_t N = n * M;
    if (nthreads > 1 && N > 1) {
#pragma omp parallel num_threads((int)nthreads)
        {
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            rows(N * id / nt, N * (id + 1) / nt);
        }
    } else {
        rows(0, N);
    }
    return out;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// Runs heads(h0, h1) over [0, H), split between up to `nthreads` OpenMP threads (the recurrences' heads are
// independent, so any split gives the same bits).
template <class F>
void over_heads(int64_t H, int64_t nthreads, F&& heads) {
    if (nthreads > 1 && H > 1) {
#pragma omp parallel num_threads((int)std::min<int64_t>(nthreads, H))
        {
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            heads(H * id / nt, H * (id + 1) / nt);
        }
    } else {
        heads(0, H);
    }
}

// One token of one head of the delta rule below: s [Dk, Dv] = from * e[:, None] (from may be s), u = b (v - kᵀs),
// s += k uᵀ, out = qᵀs; u and acc [Dv] scratch. Two passes over the state, the sums over Dk in index order, each
// product added by a fused multiply-add where the compiler contracts (the vector form always does).
#if defined(__AVX512F__)
// delta_token's operations for 16 NV columns of the state at a time, kᵀs and qᵀs kept in registers across the
// rows (the plain loops below store and reload them every row: 2-3x the time of a decode row's 16 heads)
template <int NV>
inline void delta_columns(const float* from, float* s, const float* q, const float* k, const float* e, const float* v,
                          float b, float* out, int64_t Dk, int64_t Dv) {
    for (int64_t jb = 0; jb < Dv; jb += 16 * NV) {  // the columns of one block depend on no other column
        __m512 u[NV], a[NV];
        for (int c = 0; c < NV; ++c) u[c] = a[c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dk; ++i) {
            const __m512 ei = _mm512_set1_ps(e[i]), ki = _mm512_set1_ps(k[i]);
            for (int c = 0; c < NV; ++c) {
                const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(from + i * Dv + jb + 16 * c), ei);
                _mm512_storeu_ps(s + i * Dv + jb + 16 * c, r);
                u[c] = _mm512_fmadd_ps(ki, r, u[c]);
            }
        }
        const __m512 bb = _mm512_set1_ps(b);
        for (int c = 0; c < NV; ++c) u[c] = _mm512_mul_ps(bb, _mm512_sub_ps(_mm512_loadu_ps(v + jb + 16 * c), u[c]));
        for (int64_t i = 0; i < Dk; ++i) {
            const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
            for (int c = 0; c < NV; ++c) {
                float* p = s + i * Dv + jb + 16 * c;
                const __m512 r = _mm512_fmadd_ps(ki, u[c], _mm512_loadu_ps(p));
                _mm512_storeu_ps(p, r);
                a[c] = _mm512_fmadd_ps(qi, r, a[c]);
            }
        }
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + jb + 16 * c, a[c]);
    }
}
#endif

inline void delta_token(const float* from, float* __restrict s, const float* q, const float* k, const float* e,
                        const float* v, float b, float* __restrict u, float* __restrict acc, float* out, int64_t Dk,
                        int64_t Dv) {
#if defined(__AVX512F__)
    if (Dv % 64 == 0) return delta_columns<4>(from, s, q, k, e, v, b, out, Dk, Dv);
    if (Dv % 16 == 0) return delta_columns<1>(from, s, q, k, e, v, b, out, Dk, Dv);
#endif
    for (int64_t j = 0; j < Dv; ++j) u[j] = 0.f;
    for (int64_t i = 0; i < Dk; ++i) {
        const float ei = e[i], ki = k[i];
        float* row = s + i * Dv;
        const float* old = from + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
            row[j] = old[j] * ei;
            u[j] += ki * row[j];
        }
    }
    for (int64_t j = 0; j < Dv; ++j) {
        u[j] = b * (v[j] - u[j]);
        acc[j] = 0.f;
    }
    for (int64_t i = 0; i < Dk; ++i) {
        const float ki = k[i], qi = q[i];
        float* __restrict row = s + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
            row[j] += ki * u[j];
            acc[j] += qi * row[j];
        }
    }
    for (int64_t j = 0; j < Dv; ++j) out[j] = acc[j];
}

// KDA's delta rule, token by token, for H independent heads (layers/kda.py's delta_rule_recurrent):
//     S = S * E_t[:, None];  u = beta_t (v_t - k_tᵀ S);  S = S + k_t u_tᵀ;  o_t = q_tᵀ S
// with E = exp(g) computed by torch beforehand. q, k, E [H, n, Dk], v [H, n, Dv], beta [H, n] (any strides,
// fp32), S0 [H, Dk, Dv]. Two passes over each head's state per token (decay + kᵀS, then the update + qᵀS),
// summed over Dk in index order: the same bits for any n and any H, so a verify block and decode steps
// agree, and heads folded from several sequences equal each sequence alone. Threads over heads.
std::vector<torch::Tensor> delta_rule(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor E,
                                      torch::Tensor beta, torch::Tensor S0, bool keep, int64_t nthreads) {
    for (const auto& t : {q, k, v, E, beta, S0})
        TORCH_CHECK(t.dtype() == torch::kFloat32 && t.device().is_cpu(), "delta_rule: fp32 CPU tensors");
    TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && E.sizes() == q.sizes() && v.dim() == 3 &&
                    v.size(0) == q.size(0) && v.size(1) == q.size(1) && beta.dim() == 2 &&
                    S0.dim() == 3 && S0.size(0) == q.size(0) && S0.size(1) == q.size(2) && S0.size(2) == v.size(2),
                "delta_rule: q, k, E [H, n, Dk], v [H, n, Dv], beta [H, n], S [H, Dk, Dv]");
    const int64_t H = q.size(0), n = q.size(1), Dk = q.size(2), Dv = v.size(2);
    // the first row's decay reads S0 and writes S (a separate clone was one more pass over a cold state:
    // 38 of ~68 us a decode row of 16 x 64 x 64 heads in place)
    const auto S0c = S0.contiguous();
    auto S = n ? torch::empty_like(S0c) : S0c.clone();
    const float* s0p = S0c.data_ptr<float>();
    auto o = torch::empty({H, n, Dv}, v.options());
    auto states = torch::empty({keep ? n : 0, H, Dk, Dv}, v.options());
    const auto qa = q.accessor<float, 3>(), ka = k.accessor<float, 3>(), va = v.accessor<float, 3>(),
               ea = E.accessor<float, 3>();
    const auto ba = beta.accessor<float, 2>();
    float* sp = S.data_ptr<float>();
    float* op = o.data_ptr<float>();
    float* stp = keep ? states.data_ptr<float>() : nullptr;
    auto heads = [&](int64_t h0, int64_t h1) {
        std::vector<float> ub(Dv), accb(Dv), qb(Dk), kb(Dk), eb(Dk), vb(Dv);
        for (int64_t h = h0; h < h1; ++h) {
            float* __restrict s = sp + h * Dk * Dv;
            for (int64_t t = 0; t < n; ++t) {
                for (int64_t i = 0; i < Dk; ++i) qb[i] = qa[h][t][i], kb[i] = ka[h][t][i], eb[i] = ea[h][t][i];
                for (int64_t j = 0; j < Dv; ++j) vb[j] = va[h][t][j];
                // the state the decay reads: s itself after row 0
                delta_token(t ? s : s0p + h * Dk * Dv, s, qb.data(), kb.data(), eb.data(), vb.data(), ba[h][t],
                            ub.data(), accb.data(), op + (h * n + t) * Dv, Dk, Dv);
                if (stp) std::copy(s, s + Dk * Dv, stp + (t * H + h) * Dk * Dv);
            }
        }
    };
    over_heads(H, nthreads, heads);
    return {o, S, states};
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
// The short causal convs of KDA and Mamba-2 (layers' causal_conv): out [n, C] = x[0:n] * w[:, 0] (+ b), then
// + x[k:k+n] * w[:, k] for k = 1.., each product rounded and then added, in torch's order; x [K-1+n, C], w
// [C, K] and b [C] fp32, contiguous. One loop for torch's ~2K + 1 small ops.
void conv_taps(const float* x, const float* w, const float* b, float* out, int64_t n, int64_t c, int64_t K) {
    for (int64_t t = 0; t < n; ++t)
        for (int64_t ch = 0; ch < c; ++ch) {
            float acc = x[t * c + ch] * w[ch * K];
            if (b) acc = acc + b[ch];
            for (int64_t k = 1; k < K; ++k) {
                const float term = x[(t + k) * c + ch] * w[ch * K + k];
                acc = acc + term;
            }
            out[t * c + ch] = acc;
        }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// kda_recur's inputs of n rows: full [K - 1 + n, C] (fp32, written) = the conv tail's rows, then qkv's; ys [n, C]
// (written) = the short conv's taps over full, then torch's SiLU in place; pp [3, H, n, D] (written) = q | k | v
// of each row rounded to qkv's dtype, q and k divided by sqrt(sum(x * x) + eps) (norms [2, H, n]: scratch, the
// sqrt torch's), q scaled. The Python code's float operations in its order.
void kda_inputs(const torch::Tensor& tail, const torch::Tensor& qkv, const torch::Tensor& conv_w, int64_t H,
                int64_t D, double eps, double qscale, int64_t lanes, float* fp, float* ys, float* pp, float* norms) {
    const int64_t n = qkv.size(0), K = conv_w.size(-1), C = qkv.size(1);
    const auto tc = tail.contiguous(), xc = qkv.contiguous(), wc = conv_w.contiguous();
    load_row(ty_of(tc), tc.data_ptr(), fp, (K - 1) * C);
    load_row(ty_of(xc), xc.data_ptr(), fp + (K - 1) * C, n * C);
    std::vector<float> wf(C * K), sq(D);
    load_row(ty_of(wc), wc.data_ptr(), wf.data(), C * K);
    conv_taps(fp, wf.data(), nullptr, ys, n, C, K);
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    auto yt = torch::from_blob(ys, {n, C}, f32);
    at::silu_(yt);
    const int tq = ty_of(qkv);
    const float epsf = (float)eps, qs = (float)qscale;
    for (int64_t t = 0; t < n; ++t)
        for (int64_t part = 0; part < 3; ++part)
            for (int64_t h = 0; h < H; ++h) {
                float* x = pp + ((part * H + h) * n + t) * D;
                std::copy_n(ys + t * C + (part * H + h) * D, D, x);
                round_row(tq, x, D);
                if (part == 2) continue;
                norms[(part * H + h) * n + t] = sum_squares(x, sq.data(), D, lanes) + epsf;
            }
    auto nt = torch::from_blob(norms, {2, H, n}, f32);
    at::sqrt_(nt);  // torch's sqrt (MKL's where torch has it: not always the nearest float)
    for (int64_t part = 0; part < 2; ++part)
        for (int64_t r = 0; r < H * n; ++r) {
            float* x = pp + (part * H * n + r) * D;
            const float root = norms[part * H * n + r];
            for (int64_t i = 0; i < D; ++i) x[i] = x[i] / root;
            if (part == 0)
                for (int64_t i = 0; i < D; ++i) x[i] = x[i] * qs;
        }
}

// kda_recur below for one decode row without snapshots: the same operations, the same bits, with three
// allocations and torch's SiLU, sqrt and exp in place on scratch rows instead of ~25 tensor ops (after a
// step's weight stream each op's code is cold: ~100 us a call in place against ~40 us hot). The state S0
// [H, D, D] fp32 contiguous (or none: zeros). Returns {o [1, H, D], the new state, undefined (no snapshots),
// the conv's padded input [K, C]}.
std::vector<torch::Tensor> kda_step(const torch::Tensor& qkv, const torch::Tensor& g, const torch::Tensor& beta,
                                    const torch::Tensor& tail, const torch::Tensor& conv_w,
                                    const std::optional<torch::Tensor>& state, int64_t H, int64_t D, double eps,
                                    double qscale, int64_t threads, int64_t lanes) {
    const auto f32 = torch::kFloat32;
    const int64_t K = conv_w.size(-1), C = qkv.size(1);
    auto full = torch::empty({K, C}, qkv.options().dtype(f32));
    auto S = torch::empty({H, D, D}, full.options());
    auto o = torch::empty({1, H, D}, full.options());
    // scratch: y [C], q | k | v [3, H, D], the norms [2, H], exp(g) [H, D]
    std::vector<float> y(C), parts(3 * H * D), norms(2 * H), e(H * D);
    kda_inputs(tail, qkv, conv_w, H, D, eps, qscale, lanes, full.data_ptr<float>(), y.data(), parts.data(),
               norms.data());
    std::copy_n(g.data_ptr<float>(), H * D, e.data());
    auto et = torch::from_blob(e.data(), {H, 1, D}, torch::TensorOptions().dtype(f32));
    at::exp_(et);
    const float* bp = beta.data_ptr<float>();
    float* sp = S.data_ptr<float>();
    float* op = o.data_ptr<float>();
    if (!state) S.zero_();
    const float* s0p = state ? state->data_ptr<float>() : sp;
    const float* pp = parts.data();
    over_heads(H, threads, [&](int64_t h0, int64_t h1) {
        std::vector<float> u(D), acc(D);
        for (int64_t h = h0; h < h1; ++h)
            delta_token(s0p + h * D * D, sp + h * D * D, pp + h * D, pp + (H + h) * D, e.data() + h * D,
                        pp + (2 * H + h) * D, bp[h], u.data(), acc.data(), op + h * D, D, D);
    });
    return {o, S, torch::Tensor(), full};
}

// layers/kda.py's kda_recur on the CPU, any rows (decode rows, verify blocks, prompts: token by token): the short
// conv and SiLU from the tail, q, k and v as the rows' dtype, the l2 norms (q scaled) (kda_inputs), then
// delta_rule above (exp(g) by torch), its threads passed for the rows before the snapshots and for the snapshot
// rows. The Python code's float operations in its order: the conv's taps, the roundings, x * x summed in torch's
// order (`lanes`, torch_sum), the division and the scale are loops here; the SiLU, the sqrt (one call over every
// row's sum) and the exp stay torch's (their exp and sqrt decide their bits: torch's sqrt is MKL's, not always the
// nearest float). So the same bits. Returns {o [n, H, Dv], the final state, the snapshots [snapshot_last,
// H, Dk, Dv], the conv's padded input [K - 1 + n, C]}.
std::vector<torch::Tensor> kda_recur(torch::Tensor qkv, torch::Tensor g, torch::Tensor beta, torch::Tensor tail,
                                     torch::Tensor conv_w, std::optional<torch::Tensor> state, int64_t H, int64_t D,
                                     int64_t snapshot_last, double eps, double qscale, int64_t threads_first,
                                     int64_t threads_snap, int64_t lanes) {
    const auto f32 = torch::kFloat32;
    const int64_t n = qkv.size(0), K = conv_w.size(-1), m = n - snapshot_last, C = qkv.size(1);
    TORCH_CHECK(n > 0 && m >= 0, "kda_recur: 0 <= snapshot_last <= rows");
    TORCH_CHECK(qkv.dim() == 2 && C == 3 * H * D && tail.dim() == 2 && tail.size(0) == K - 1 && tail.size(1) == C &&
                    conv_w.numel() == C * K, "kda_recur: qkv [n, 3 H D], tail [K - 1, 3 H D], conv_w [3 H D, (1,) K]");
    TORCH_CHECK(lanes == 8 || lanes == 16, "kda_recur: 8 or 16 lanes");
    if (n == 1 && snapshot_last == 0 && (!state || (state->dtype() == f32 && state->is_contiguous())) &&
        g.is_contiguous() && beta.is_contiguous() && tail.is_contiguous() && qkv.is_contiguous())
        return kda_step(qkv, g, beta, tail, conv_w, state, H, D, eps, qscale, threads_first, lanes);
    auto full = torch::empty({K - 1 + n, C}, qkv.options().dtype(f32));
    auto y = torch::empty({n, C}, full.options());
    auto parts = torch::empty({3, H, n, D}, full.options());  // q | k | v
    std::vector<float> norms(2 * H * n);
    kda_inputs(tail, qkv, conv_w, H, D, eps, qscale, lanes, full.data_ptr<float>(), y.data_ptr<float>(),
               parts.data_ptr<float>(), norms.data());
    const auto q = parts.select(0, 0), k = parts.select(0, 1), v = parts.select(0, 2);
    const auto gt = g.to(f32).transpose(0, 1), bt = beta.to(f32).transpose(0, 1);
    auto S = state ? state->to(f32) : torch::zeros({H, D, D}, full.options());
    std::vector<torch::Tensor> outs;
    auto snaps = S.new_empty({0, S.size(0), S.size(1), S.size(2)});
    auto run = [&](int64_t a, int64_t b, bool keep, int64_t threads) {
        // rows [a, b) of each (the whole tensor where that is all of it: no slice to dispatch)
        auto cut = [&](const torch::Tensor& t) { return a == 0 && b == n ? t : t.slice(1, a, b); };
        auto r = delta_rule(cut(q), cut(k), cut(v), at::exp(cut(gt)), cut(bt), S, keep, threads);
        outs.push_back(r[0]);
        S = r[1];
        if (keep) snaps = r[2];
    };
    if (m) run(0, m, false, threads_first);
    if (snapshot_last) run(m, n, true, threads_snap);
    auto o = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
    return {o.transpose(0, 1).contiguous(), S, snaps, full};
}

// Mamba-2's recurrent step over m tokens for H independent heads (layers/mamba2.py's ssd_step, token by
// token): h = dA_t h + (x_t dt_t) B_tᵀ;  y_t = h C_t, with dA = exp(dt A) computed by torch beforehand.
// x [m, H, P], dt and dA [m, H], B and C [m, H, N] (any strides, fp32), h0 [H, P, N]. The state update is
// the torch step's float operations in its order (no contraction); y sums over N in index order. The same
// bits for any m and any H (a verify block = its tokens one call at a time; folded heads = each alone).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
// one native vector's lanes: GCC splits a wider vector type into several and moves them through memory
// (16 lanes on an AVX2 core took 4.5x as long as 8: one decode row of 32 heads x 64 x 64, 161 -> 36 us)
#if defined(__AVX512F__)
constexpr int64_t SSD_LANES = 16;
#else
constexpr int64_t SSD_LANES = 8;
#endif
typedef float SsdLanes __attribute__((vector_size(SSD_LANES * sizeof(float))));

std::vector<torch::Tensor> ssd_steps(torch::Tensor x, torch::Tensor dt, torch::Tensor dA, torch::Tensor B,
                                     torch::Tensor C, torch::Tensor h0, bool keep, int64_t nthreads) {
    for (const auto& t : {x, dt, dA, B, C, h0})
        TORCH_CHECK(t.dtype() == torch::kFloat32 && t.device().is_cpu(), "ssd_steps: fp32 CPU tensors");
    TORCH_CHECK(x.dim() == 3 && dt.dim() == 2 && dA.sizes() == dt.sizes() && B.dim() == 3 && C.sizes() == B.sizes() &&
                    h0.dim() == 3 && dt.size(0) == x.size(0) && dt.size(1) == x.size(1) && B.size(0) == x.size(0) &&
                    B.size(1) == x.size(1) && h0.size(0) == x.size(1) && h0.size(1) == x.size(2) &&
                    h0.size(2) == B.size(2),
                "ssd_steps: x [m, H, P], dt / dA [m, H], B / C [m, H, N], h [H, P, N]");
    const int64_t m = x.size(0), H = x.size(1), P = x.size(2), N = B.size(2);
    const auto h_in = h0.contiguous();
    auto h = torch::empty_like(h_in);  // the first step reads h_in and writes h: no copy made first
    auto y = torch::empty({m, H, P}, x.options());
    auto states = torch::empty({keep ? m : 0, H, P, N}, x.options());
    const auto xa = x.accessor<float, 3>(), Ba = B.accessor<float, 3>(), Ca = C.accessor<float, 3>();
    const auto da = dt.accessor<float, 2>(), ea = dA.accessor<float, 2>();
    float* hp = h.data_ptr<float>();
    const float* hin = h_in.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* stp = keep ? states.data_ptr<float>() : nullptr;
    auto heads = [&](int64_t h0_, int64_t h1_) {
        std::vector<float> bb(N), cb(N);
        for (int64_t hd = h0_; hd < h1_; ++hd) {
            float* s = hp + hd * P * N;
            const float* s_in = hin + hd * P * N;
            for (int64_t t = 0; t < m; ++t) {
                const float e = ea[t][hd], d = da[t][hd];
                for (int64_t j = 0; j < N; ++j) {
                    bb[j] = Ba[t][hd][j];
                    cb[j] = Ca[t][hd][j];
                }
                for (int64_t i = 0; i < P; ++i) {
                    const float xd = xa[t][hd][i] * d;
                    float* row = s + i * N;
                    const float* from = (t == 0 ? s_in : s) + i * N;  // row itself after the first step
                    // y's sum over N in SSD_LANES partial sums, then those in order: one sum in index order
                    // was a chain of dependent adds, ~1/4 of a Nemotron-H layer's decode step (y is compared
                    // to rounding; the state, torch's own float operations, to the bit)
                    SsdLanes lanes = {};
                    int64_t j = 0;
                    for (; j + SSD_LANES <= N; j += SSD_LANES) {
                        SsdLanes r, bv, cv;
                        std::memcpy(&r, from + j, sizeof r);
                        std::memcpy(&bv, bb.data() + j, sizeof bv);
                        std::memcpy(&cv, cb.data() + j, sizeof cv);
                        r = e * r + xd * bv;
                        std::memcpy(row + j, &r, sizeof r);
                        lanes += r * cv;
                    }
                    float acc = 0.f;
                    for (; j < N; ++j) {
                        const float a = e * from[j], b = xd * bb[j];
                        row[j] = a + b;
                        acc += row[j] * cb[j];
                    }
                    for (int64_t l = 0; l < SSD_LANES; ++l) acc += lanes[l];
                    yp[(t * H + hd) * P + i] = acc;
                }
                if (stp) std::copy(s, s + P * N, stp + (t * H + hd) * P * N);
            }
        }
    };
    over_heads(H, nthreads, heads);
    return {y, h, states};
}

// layers/mamba2.py's mamba2_recur for rows the recurrent step takes whole (one row, or a block whose every row
// leaves a snapshot): the causal conv (causal_conv's shifted products) and SiLU from the tail, the conv's
// output as the rows' dtype, the x | B | C split with B and C repeated over their heads, ssd_steps above (exp(dt A) by torch, its
// threads passed), the D skip. The same torch ops in the same order on the same views as the Python code, so
// the same bits. Returns {y [n, H P] fp32, the final state, the state after every row [n, H, P, N] (when
// keep), the conv's inputs [K - 1 + n, C] fp32}.
std::vector<torch::Tensor> mamba2_recur(torch::Tensor xbc, torch::Tensor dt, torch::Tensor tail, torch::Tensor conv_w,
                                        std::optional<torch::Tensor> conv_b, torch::Tensor A_log, torch::Tensor D,
                                        torch::Tensor ssm, int64_t H, int64_t P, int64_t G, int64_t N, bool keep,
                                        int64_t threads) {
    const auto f32 = torch::kFloat32;
    const int64_t n = xbc.size(0), c = xbc.size(1), inner = H * P;
    const auto w = conv_w.reshape({c, -1}).to(f32).contiguous();  // [C, K]
    const int64_t K = w.size(1);
    auto seq = at::cat({tail.to(f32).t(), xbc.to(f32)}, 0);  // [K-1+n, C], contiguous
    auto out = torch::empty({n, c}, seq.options());
    const auto b32 = conv_b ? conv_b->to(f32).contiguous() : torch::Tensor();
    conv_taps(seq.data_ptr<float>(), w.data_ptr<float>(), conv_b ? b32.data_ptr<float>() : nullptr,
              out.data_ptr<float>(), n, c, K);
    auto conv = at::silu(out).to(xbc.scalar_type()).to(f32);
    auto parts = conv.split_with_sizes({inner, G * N, G * N}, -1);
    auto xs = parts[0].reshape({n, H, P});
    auto B = parts[1].reshape({n, G, N}).repeat_interleave(H / G, 1);
    auto C = parts[2].reshape({n, G, N}).repeat_interleave(H / G, 1);
    auto A = -at::exp(A_log.to(f32));
    auto r = ssd_steps(xs, dt, at::exp(dt * A), B, C, ssm.to(f32), keep, threads);
    // y + D xs (the product rounded, then added), in place on ssd_steps' fresh y
    auto y = r[0];
    {
        const auto d32 = D.to(f32).contiguous();
        const float* dp = d32.data_ptr<float>();
        const auto xa = xs.accessor<float, 3>();
        float* yp = y.data_ptr<float>();
        for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t i = 0; i < P; ++i) {
                    const float skip = dp[h] * xa[t][h][i];
                    yp[(t * H + h) * P + i] = yp[(t * H + h) * P + i] + skip;
                }
    }
    return {y.reshape({n, inner}), r[1], r[2], seq};
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// a . b and y += s * b over n values, a / y fp32, b bf16 (8 lanes at a time where AVX2 is on)
inline float dot_bf16(const float* a, const uint16_t* b, int64_t n) {
    int64_t k = 0;
    float tail = 0.f;
#if defined(MOESAIC_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), widen_bf16(b + k), acc);
    }
    tail = hsum(acc);
#endif
    for (; k < n; ++k) tail += a[k] * bf16_bits_to_f32(b[k]);
    return tail;
}

// R dots a . b_r (rows b + r * bs), each summed exactly as dot_bf16 sums it (8 lanes in k order, hsum, the
// tail in order): the same bits, R independent chains of FMAs instead of one chain at a time.
template <int R>
inline void dot_bf16_rows(const float* a, const uint16_t* b, int64_t bs, int64_t n, float* out) {
    int64_t k = 0;
#if defined(MOESAIC_AVX2)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const __m256 av = _mm256_loadu_ps(a + k);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(av, widen_bf16(b + r * bs + k), acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
#else
    for (int r = 0; r < R; ++r) out[r] = 0.f;
#endif
    for (int r = 0; r < R; ++r)
        for (int64_t j = k; j < n; ++j) out[r] += a[j] * bf16_bits_to_f32(b[r * bs + j]);
}

// The cache lines of rows b + i * bs, i < m, each n values, asked for ahead of their use: weights read once a
// step come from memory, and rows of a few lines each are too short for the hardware prefetcher's streams.
inline void prefetch_rows(const uint16_t* b, int64_t bs, int64_t m, int64_t n) {
    for (int64_t i = 0; i < m; ++i) {
        const char* r = reinterpret_cast<const char*>(b + i * bs);
        for (int64_t o = 0; o < n * 2; o += 64) __builtin_prefetch(r + o, 0, 3);
    }
}

// bytes [p, p + bytes) asked for into L2 ahead of their use
inline void prefetch_lines(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

// out[i] = a . b_i for m rows b_i = b + i * bs: dot_bf16's bits, eight rows at a time (the next eight asked for
// ahead).
inline void dot_bf16_many(const float* a, const uint16_t* b, int64_t bs, int64_t n, int64_t m, float* out) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        prefetch_rows(b + (i + 8) * bs, bs, std::min<int64_t>(8, m - i - 8), n);
        dot_bf16_rows<8>(a, b + i * bs, bs, n, out + i);
    }
    for (; i < m; ++i) out[i] = dot_bf16(a, b + i * bs, n);
}

// y[c] += s[i] * b_i[c] for the m rows b_i = b + i * bs in order: each y[c] one chain of FMAs over the rows
// (8 lanes of y at a time, the tail in scalar code), a block of y held in registers over all the rows.
inline void axpy_bf16_many(const float* s, const uint16_t* b, int64_t bs, int64_t m, float* y, int64_t n) {
    int64_t c = 0;
#if defined(MOESAIC_AVX2)
    for (; c + 64 <= n; c += 64) {
        __m256 o[8];
        for (int j = 0; j < 8; ++j) o[j] = _mm256_loadu_ps(y + c + 8 * j);
        for (int64_t i = 0; i < m; ++i) {
            if (c == 0 && i + 4 < m) prefetch_rows(b + (i + 4) * bs, bs, 1, n);  // the first pass: the rows whole
            const __m256 sv = _mm256_set1_ps(s[i]);
            const uint16_t* row = b + i * bs + c;
            for (int j = 0; j < 8; ++j) o[j] = _mm256_fmadd_ps(sv, widen_bf16(row + 8 * j), o[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(y + c + 8 * j, o[j]);
    }
    for (; c + 8 <= n; c += 8) {
        __m256 o = _mm256_loadu_ps(y + c);
        for (int64_t i = 0; i < m; ++i) o = _mm256_fmadd_ps(_mm256_set1_ps(s[i]), widen_bf16(b + i * bs + c), o);
        _mm256_storeu_ps(y + c, o);
    }
#endif
    for (int64_t i = 0; i < m; ++i)
        for (int64_t k = c; k < n; ++k) y[k] += s[i] * bf16_bits_to_f32(b[i * bs + k]);
}

// dot_bf16_many for G queries a_h = a + h * as at once: out[h * os + i] = a_h . b_i, each summed exactly as
// dot_bf16 sums it (the same bits), a row's bf16 values widened once for all G instead of once a query (the
// widening, not the FMAs, bounds the one-query loop on AVX2: MLA's long-context decode is these products).
template <int G>
inline void dot_bf16_group_row(const float* a, int64_t as, const uint16_t* row, int64_t n, float* out, int64_t os) {
    int64_t k = 0;
    float v[G] = {};
#if defined(MOESAIC_AVX2)
    __m256 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const __m256 w = widen_bf16(row + k);
        for (int h = 0; h < G; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(a + h * as + k), w, acc[h]);
    }
    for (int h = 0; h < G; ++h) v[h] = hsum(acc[h]);
#endif
    for (int h = 0; h < G; ++h) {
        for (int64_t j = k; j < n; ++j) v[h] += a[h * as + j] * bf16_bits_to_f32(row[j]);
        out[h * os] = v[h];
    }
}

template <int G>
inline void dot_bf16_group(const float* a, int64_t as, const uint16_t* b, int64_t bs, int64_t n, int64_t m,
                           float* out, int64_t os) {
    for (int64_t i = 0; i < m; ++i) dot_bf16_group_row<G>(a, as, b + i * bs, n, out + i, os);
}

// axpy_bf16_many for G weight rows s_h = s + h * ss into y_h = y + h * ys at once: each y_h[c] the same chain of
// FMAs over the rows in order (the same bits), a row's bf16 values widened once for all G. row(i): the i-th of the
// m rows, or null for none.
template <int G, class Row>
inline void axpy_bf16_group(const float* s, int64_t ss, Row row, int64_t m, float* y, int64_t ys, int64_t n) {
    int64_t c = 0;
#if defined(MOESAIC_AVX2)
    for (; c + 8 <= n; c += 8) {
        __m256 o[G];
        for (int h = 0; h < G; ++h) o[h] = _mm256_loadu_ps(y + h * ys + c);
        for (int64_t i = 0; i < m; ++i) {
            const uint16_t* r = row(i);
            if (!r) continue;
            const __m256 w = widen_bf16(r + c);
            for (int h = 0; h < G; ++h) o[h] = _mm256_fmadd_ps(_mm256_set1_ps(s[h * ss + i]), w, o[h]);
        }
        for (int h = 0; h < G; ++h) _mm256_storeu_ps(y + h * ys + c, o[h]);
    }
#endif
    for (int h = 0; h < G; ++h)
        for (int64_t i = 0; i < m; ++i)
            if (const uint16_t* r = row(i))
                for (int64_t k = c; k < n; ++k) y[h * ys + k] += s[h * ss + i] * bf16_bits_to_f32(r[k]);
}

// nq queries / weight rows by groups of 8 and 4 where AVX2 is on, the rest one at a time (the same bits).
inline void dot_bf16_queries(const float* a, int64_t as, int64_t nq, const uint16_t* b, int64_t bs, int64_t n,
                             int64_t m, float* out, int64_t os) {
    int64_t h = 0;
#if defined(MOESAIC_AVX2)
    for (; h + 8 <= nq; h += 8) dot_bf16_group<8>(a + h * as, as, b, bs, n, m, out + h * os, os);
    for (; h + 4 <= nq; h += 4) dot_bf16_group<4>(a + h * as, as, b, bs, n, m, out + h * os, os);
#endif
    for (; h < nq; ++h) dot_bf16_many(a + h * as, b, bs, n, m, out + h * os);
}

inline void axpy_bf16_queries(const float* s, int64_t ss, int64_t nq, const uint16_t* b, int64_t bs, int64_t m,
                              float* y, int64_t ys, int64_t n) {
    int64_t h = 0;
#if defined(MOESAIC_AVX2)
    const auto row = [&](int64_t i) { return b + i * bs; };
    for (; h + 8 <= nq; h += 8) axpy_bf16_group<8>(s + h * ss, ss, row, m, y + h * ys, ys, n);
    for (; h + 4 <= nq; h += 4) axpy_bf16_group<4>(s + h * ss, ss, row, m, y + h * ys, ys, n);
#endif
    for (; h < nq; ++h) axpy_bf16_many(s + h * ss, b, bs, m, y + h * ys, n);
}

#if defined(MOESAIC_AVX512BF16)
// e^x on 16 lanes x <= 0 (a softmax's shifted logits): 2^n e^r, n = round(x / ln 2), r = x - n ln 2 by two
// constants, e^r by its degree-7 Taylor sum (|r| <= ln 2 / 2: within ~2 ulp of expf); x below -87.3 (-inf
// too) gives 0, a NaN stays NaN.
inline __m512 exp_le0(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(lo, x);  // max returns its second operand where one is NaN
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_scalef_ps(p, n));
}

// 16 fp32 lanes rounded to bf16 (nearest even), as bits and as fp32
inline __m256i bf16_of(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
inline __m512 f32_of(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }
// the first min(n, 16) lanes (none for n <= 0)
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

// The 16 lane sums of a[0..15] as one vector (lane r: the sum of a[r]'s lanes), by one fixed tree for every
// row (within each 128-bit lane (e0 + e2) + (e1 + e3), then (L0 + L1) + (L2 + L3)): 45 operations for 16 sums,
// where a reduce_add each takes ~8.
inline __m512 lane_sums16(const __m512 (&a)[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d u = _mm512_castps_pd(b[2 * i]), w = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
    }
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

// vdpbf16ps forms of the two products over the cached rows (a long context's decode is these): q and the rows
// are bf16 (q_lat and the probabilities are rounded to bf16 where the torch code rounds them), so every
// product is exact and only the order of the fp32 sums differs from dot_bf16 / axpy_bf16_many (equal to rounding;
// subnormal bf16 inputs count as zero). qb: q's bf16 bits zero-padded to a multiple of 32.
// out[h * os + t] = q_h . b_t for the nh queries q_h = qb + h * qs (n values, zero-padded to whole vectors) and
// the m rows b_t = b + t * bs: 16 rows a pass (a last pass of fewer repeats its last row) for every query, so
// each row is read from memory once; each sum by the same operations wherever its row falls. The next 16 rows
// (past m: the first of `next`, the caller's next block of rows, where given) are fetched to L2 meanwhile: a
// long context's cache comes from memory, a block of 64 rows at a time (L1 hints: ~25 % slower cold).
inline void dp_rows(const uint16_t* qb, int64_t qs, int64_t nh, const uint16_t* b, int64_t bs, int64_t n, int64_t m,
                    float* out, int64_t os, const uint16_t* next = nullptr) {
    const int64_t nc = (n + 31) / 32;
    const __mmask32 tail = n % 32 ? (__mmask32)((1ull << (n % 32)) - 1) : ~0u;
    for (int64_t t = 0; t < m; t += 16) {
        const int64_t k = std::min<int64_t>(16, m - t);
        const uint16_t* ahead = t + 16 < m ? b + (t + 16) * bs : next;
        if (ahead)
            for (int r = 0; r < 16; ++r)
                for (int64_t c = 0; c < 2 * n; c += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(ahead + r * bs) + c, _MM_HINT_T1);
        const uint16_t* rp[16];
        for (int r = 0; r < 16; ++r) rp[r] = b + (t + std::min<int64_t>(r, k - 1)) * bs;
        for (int64_t h = 0; h < nh; ++h) {
            __m512 acc[16];
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
            for (int64_t j = 0; j < nc; ++j) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + h * qs + 32 * j);
                const __mmask32 mk = j + 1 < nc ? ~0u : tail;
#pragma GCC unroll 16
                for (int r = 0; r < 16; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], qv, (__m512bh)_mm512_maskz_loadu_epi16(mk, rp[r] + 32 * j));
            }
            _mm512_mask_storeu_ps(out + h * os + t, first_lanes(k), lane_sums16(acc));
        }
    }
}

// acc += sum_t p[t] * b_t[c] over the m rows b_t = b + t * bs of n <= 32 C values, p as bf16 bits: two rows
// a step, their values interleaved into pairs (vpunpck*wd: within each 128-bit lane, so accumulator lane
// 4i + k holds value 8i + k of the low half and 8i + 4 + k of the high half) once for both heads where two
// are given (p2, acc2: a second head's probabilities and sums). acc: 2 C x 16 floats (chunk j's low then high
// lanes), carried between calls, so the rows can come in blocks (of an even count: the same pairs, the same
// sums); mix_out writes the values. C a constant: the accumulators stay in registers.
template <int C, bool TWO>
inline void dp_mix(const uint16_t* p, const uint16_t* p2, const uint16_t* b, int64_t bs, int64_t m, int64_t n,
                   float* acc, float* acc2) {
    const __mmask32 tail = (__mmask32)((n % 32) ? ((1ull << (n % 32)) - 1) : ~0ull);
    __m512 lo[C], hi[C], lo2[C], hi2[C];
    for (int j = 0; j < C; ++j) {
        lo[j] = _mm512_loadu_ps(acc + 32 * j);
        hi[j] = _mm512_loadu_ps(acc + 32 * j + 16);
        if constexpr (TWO) {
            lo2[j] = _mm512_loadu_ps(acc2 + 32 * j);
            hi2[j] = _mm512_loadu_ps(acc2 + 32 * j + 16);
        }
    }
    auto load = [&](const uint16_t* row, int j) {
        return j + 1 < C ? _mm512_loadu_si512(row + 32 * j) : _mm512_maskz_loadu_epi16(tail, row + 32 * j);
    };
    auto pair = [](const uint16_t* q, int64_t t, bool two) {
        return (__m512bh)_mm512_set1_epi32((int)((uint32_t)q[t] | ((uint32_t)(two ? q[t + 1] : 0) << 16)));
    };
    for (int64_t t = 0; t < m; t += 2) {
        const bool two = t + 1 < m;
        const __m512bh pv = pair(p, t, two), pv2 = TWO ? pair(p2, t, two) : pv;
        const uint16_t* r0 = b + t * bs;
        for (int j = 0; j < C; ++j) {  // a lone last row pairs with zeros (not itself times 0: inf * 0)
            const __m512i v0 = load(r0, j), v1 = two ? load(r0 + bs, j) : _mm512_setzero_si512();
            const __m512bh u = (__m512bh)_mm512_unpacklo_epi16(v0, v1), w = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
            lo[j] = _mm512_dpbf16_ps(lo[j], u, pv);
            hi[j] = _mm512_dpbf16_ps(hi[j], w, pv);
            if constexpr (TWO) {
                lo2[j] = _mm512_dpbf16_ps(lo2[j], u, pv2);
                hi2[j] = _mm512_dpbf16_ps(hi2[j], w, pv2);
            }
        }
    }
    for (int j = 0; j < C; ++j) {
        _mm512_storeu_ps(acc + 32 * j, lo[j]);
        _mm512_storeu_ps(acc + 32 * j + 16, hi[j]);
        if constexpr (TWO) {
            _mm512_storeu_ps(acc2 + 32 * j, lo2[j]);
            _mm512_storeu_ps(acc2 + 32 * j + 16, hi2[j]);
        }
    }
}

// dp_mix for the nh heads p + h * ps, acc + h * as, two at a time (the rows read and interleaved once for both),
// n <= 128 values (the latent widths of the MLA models here: 128; DeepSeek's 512 takes axpy)
inline void dp_mix_heads(const uint16_t* p, int64_t ps, int64_t nh, const uint16_t* b, int64_t bs, int64_t m,
                         int64_t n, float* acc, int64_t as) {
    with_value<1, 2, 3, 4>((n + 31) / 32, [&](auto Cc) {
        constexpr int C = decltype(Cc)::value;
        int64_t h = 0;
        for (; h + 2 <= nh; h += 2)
            dp_mix<C, true>(p + h * ps, p + (h + 1) * ps, b, bs, m, n, acc + h * as, acc + (h + 1) * as);
        if (h < nh) dp_mix<C, false>(p + h * ps, nullptr, b, bs, m, n, acc + h * as, nullptr);
    });
}

// the n values of dp_mix's accumulators, in order
inline void mix_out(const float* acc, int64_t n, float* y) {
    for (int64_t j = 0; 32 * j < n; ++j)
        for (int i = 0; i < 4; ++i)
            for (int k = 0; k < 4; ++k) {
                const int64_t c = 32 * j + 8 * i + k;
                if (c < n) y[c] = acc[32 * j + 4 * i + k];
                if (c + 4 < n) y[c + 4] = acc[32 * j + 16 + 4 * i + k];
            }
}
#endif

#if defined(MOESAIC_AVX512BF16)
// A softmax's numerators over n logits s, in place: each v = s (rounded to bf16 where `round`; plus r's value
// rounded, the sum rounded again, where r is given) times scale, then e^(v - max v) (exp_le0). Their sum.
inline float softmax_exps(float* s, const float* r, int64_t n, bool round, float scale) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = first_lanes(n - t);
        __m512 v = _mm512_maskz_loadu_ps(m, s + t);
        if (round) v = f32_of(bf16_of(v));
        if (r) v = f32_of(bf16_of(_mm512_add_ps(v, f32_of(bf16_of(_mm512_maskz_loadu_ps(m, r + t))))));
        v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(s + t, m, v);
        mx = _mm512_mask_max_ps(mx, m, mx, v);
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = first_lanes(n - t);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mv)));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(s + t, m, e);
    }
    return _mm512_reduce_add_ps(sum);
}

// mla_absorbed's softmax of one head's n scores s (plus the rope part's r where given), 16 lanes at a time: each
// part rounded to bf16 and their sum rounded (the torch code's two bf16 matmuls and their sum), softmax_exps,
// the probabilities rounded to bf16 into s (fp32) and pb (bits).
inline void softmax_row(float* s, const float* r, int64_t n, float scale, uint16_t* pb) {
    const __m512 inv = _mm512_set1_ps(1.f / softmax_exps(s, r, n, true, scale));
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = first_lanes(n - t);
        const __m256i p = bf16_of(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
        _mm512_mask_storeu_ps(s + t, m, f32_of(p));
        _mm256_mask_storeu_epi16(pb + t, m, p);
    }
}
#endif

// MLA's absorbed attention (layers/mla.py: absorb_queries, latent_attention, absorb_output) for the
// sequences of a step in one call, bf16: q_nope [N, H, dn] and q_rope [N, H, dr] hold every sequence's
// rows in order (lens[s] rows each), w_uk [H, dn, kvr] and w_uv [H, dv, kvr] are views of kv_b, and
// sequence s attends to its latent[s] [T, kvr] / k_rope[s] [T, dr] (row i of n sees T - n + i + 1 of
// them). fp32 sums, rounded to bf16 where the torch code's bf16 products round: q_lat, the two score
// products and their sum, the probabilities, o_lat and the output (torch's bf16 matmuls here run at
// 35-85 us each on an AVX2 CPU, five per layer; this is a few us). The sums' order differs from
// torch's matmuls, so it matches the torch code to rounding, not to the bit. Threads over heads.
// Paged caches (`blocks` given): latents[s] / k_ropes[s] are a pool's views [num_blocks, block rows, width],
// and sequence s holds rows 0..lengths[s] in its blocks[s], in order: read in place, not gathered.
torch::Tensor mla_absorbed(torch::Tensor q_nope, torch::Tensor q_rope, torch::Tensor w_uk, torch::Tensor w_uv,
                           std::vector<torch::Tensor> latents, std::vector<torch::Tensor> k_ropes,
                           std::vector<int64_t> lens, double scale_d, int64_t nthreads,
                           std::optional<std::vector<std::vector<int64_t>>> blocks,
                           std::optional<std::vector<int64_t>> lengths) {
    TORCH_CHECK(q_nope.dim() == 3 && q_rope.dim() == 3 && w_uk.dim() == 3 && w_uv.dim() == 3, "mla_absorbed: ranks");
    const int64_t N = q_nope.size(0), H = q_nope.size(1), dn = q_nope.size(2), dr = q_rope.size(2);
    const int64_t kvr = w_uk.size(2), dv = w_uv.size(1);
    TORCH_CHECK(q_rope.size(0) == N && q_rope.size(1) == H && w_uk.size(0) == H && w_uk.size(1) == dn &&
                    w_uv.size(0) == H && w_uv.size(2) == kvr, "mla_absorbed: shapes");
    TORCH_CHECK(latents.size() == lens.size() && k_ropes.size() == lens.size(), "mla_absorbed: one cache per sequence");
    for (const auto& t : {q_nope, q_rope, w_uk, w_uv})
        TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.device().is_cpu() && t.stride(-1) == 1,
                    "mla_absorbed: bf16 CPU tensors, unit last stride");
    const bool paged = blocks.has_value();
    TORCH_CHECK(!paged || (lengths && blocks->size() == lens.size() && lengths->size() == lens.size()),
                "mla_absorbed: one block list and length per sequence");
    // each sequence's cached rows as segments of contiguous rows: pages, or blocks of ROWS rows of one
    // tensor (an even count: dp_mix's pairs never straddle two segments but where the rows end)
    constexpr int64_t ROWS = 256;
    struct Seg {
        const uint16_t *lat, *rope;
        int64_t t0, rows;
    };
    const auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
    std::vector<std::vector<Seg>> segs(lens.size());
    std::vector<int64_t> Ts(lens.size()), lss(lens.size()), kss(lens.size());
    int64_t total = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
        const auto& L = latents[s];
        const auto& R = k_ropes[s];
        const int64_t d = paged ? 3 : 2;
        TORCH_CHECK(L.scalar_type() == torch::kBFloat16 && L.dim() == d && L.size(-1) == kvr && L.stride(-1) == 1 &&
                        R.scalar_type() == torch::kBFloat16 && R.dim() == d && R.size(-1) == dr &&
                        (dr == 0 || R.stride(-1) == 1) && R.size(0) == L.size(0) && R.size(d - 2) == L.size(d - 2),
                    "mla_absorbed: latent [T, kvr] / k_rope [T, dr] bf16 (paged: [blocks, rows, width])");
        const int64_t T = paged ? (*lengths)[s] : L.size(0);
        TORCH_CHECK(lens[s] <= T, "mla_absorbed: at least as many cached rows as queries");
        Ts[s] = T;
        lss[s] = L.stride(-2);
        kss[s] = R.stride(-2);
        if (paged) {
            const int64_t per = L.size(1);
            const auto& ids = (*blocks)[s];
            TORCH_CHECK((int64_t)ids.size() * per >= T && per % 2 == 0, "mla_absorbed: blocks for every row, even rows a block");
            for (int64_t b = 0; b * per < T; ++b) {
                TORCH_CHECK(ids[b] >= 0 && ids[b] < L.size(0), "mla_absorbed: block id out of range");
                segs[s].push_back({u16(L) + ids[b] * L.stride(0), u16(R) + ids[b] * R.stride(0), b * per,
                                   std::min(per, T - b * per)});
            }
        } else {
            for (int64_t t0 = 0; t0 < T; t0 += ROWS)
                segs[s].push_back({u16(L) + t0 * lss[s], u16(R) + t0 * kss[s], t0, std::min(ROWS, T - t0)});
        }
        total += lens[s];
    }
    TORCH_CHECK(total == N, "mla_absorbed: lens must sum to the query rows");
    auto out = torch::empty({N, H, dv}, q_nope.options());
    const float scale = (float)scale_d;
    const uint16_t *qn = u16(q_nope), *qr = u16(q_rope), *wk = u16(w_uk), *wv = u16(w_uv);
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    // A thread's heads go through the cached rows together, a segment of rows at a time, so that each is read
    // from memory once for all of them (past ~8k rows the cache outgrows L2). The same sums in the same order
    // as one head at a time: each score is its own dot, and the mix's pairs / chains run in row order.
    constexpr int64_t MIX_ACC = 4 * 32;  // floats of one dp_mix accumulator set (up to 128 values)
#if defined(MOESAIC_AVX512BF16)
    const bool mix = kvr <= 128;  // dp_mix's widths
#else
    const bool mix = false;
#endif
    auto heads = [&](int64_t h0, int64_t h1) {
        const int64_t nh = h1 - h0, kp = (kvr + 31) / 32 * 32, rpad = (dr + 31) / 32 * 32;
        std::vector<float> ql(nh * kvr), ol(nh * kvr), rrow(nh * dr), qv(dn), acc(nh * MIX_ACC), sc, sr, ov(dv);
        std::vector<uint16_t> qb(nh * kp, 0), rb(nh * rpad, 0), pb;  // bf16 bits
        int64_t row0 = 0;
        for (size_t s = 0; s < lens.size(); ++s) {
            const int64_t n = lens[s], T = Ts[s], ls = lss[s], ks = kss[s];
            sc.resize(nh * T);
            sr.resize(nh * T);
            pb.resize(nh * T);
            for (int64_t i = 0; i < n; ++i) {
                const int64_t r = row0 + i, seen = T - n + i + 1;
                for (int64_t hh = 0; hh < nh; ++hh) {  // q_lat = q_nope . w_uk[h], rounded to bf16
                    const int64_t h = h0 + hh;
                    const uint16_t* qp = qn + r * q_nope.stride(0) + h * q_nope.stride(1);
                    const uint16_t* rp = qr + r * q_rope.stride(0) + h * q_rope.stride(1);
                    float* q = ql.data() + hh * kvr;
                    for (int64_t d = 0; d < dn; ++d) qv[d] = bf16_bits_to_f32(qp[d]);
                    std::fill(q, q + kvr, 0.f);
                    axpy_bf16_many(qv.data(), wk + h * w_uk.stride(0), w_uk.stride(1), dn, q, kvr);
                    for (int64_t c = 0; c < kvr; ++c) {
                        q[c] = round_bf16(q[c]);
                        qb[hh * kp + c] = f32_to_bf16_bits(q[c]);  // exact: q is rounded
                    }
                    for (int64_t d = 0; d < dr; ++d) {
                        rrow[hh * dr + d] = bf16_bits_to_f32(rp[d]);
                        rb[hh * rpad + d] = rp[d];
                    }
                }
                for (size_t gi = 0; gi < segs[s].size(); ++gi) {  // the scores, a segment of rows for every head
                    const Seg& g = segs[s][gi];
                    if (g.t0 >= seen) break;
                    const int64_t t0 = g.t0, m = std::min(g.rows, seen - t0);
#if defined(MOESAIC_AVX512BF16)
                    const Seg* nx = gi + 1 < segs[s].size() && segs[s][gi + 1].t0 < seen ? &segs[s][gi + 1] : nullptr;
                    dp_rows(qb.data(), kp, nh, g.lat, ls, kvr, m, sc.data() + t0, T, nx ? nx->lat : nullptr);
                    if (dr) dp_rows(rb.data(), rpad, nh, g.rope, ks, dr, m, sr.data() + t0, T);
#else
                    dot_bf16_queries(ql.data(), kvr, nh, g.lat, ls, kvr, m, sc.data() + t0, T);
                    if (dr) dot_bf16_queries(rrow.data(), dr, nh, g.rope, ks, dr, m, sr.data() + t0, T);
#endif
                }
                for (int64_t hh = 0; hh < nh; ++hh) {  // the softmax, head by head
                    float* sh = sc.data() + hh * T;
                    const float* rh = sr.data() + hh * T;
#if defined(MOESAIC_AVX512BF16)
                    softmax_row(sh, dr ? rh : nullptr, seen, scale, pb.data() + hh * T);
                    continue;
#endif
                    float mx = -INFINITY;
                    for (int64_t t = 0; t < seen; ++t) {
                        float v = round_bf16(sh[t]);
                        if (dr) v = round_bf16(v + round_bf16(rh[t]));
                        sh[t] = v * scale;
                        mx = std::max(mx, sh[t]);
                    }
                    float sum = 0.f;
                    for (int64_t t = 0; t < seen; ++t) {
                        sh[t] = std::exp(sh[t] - mx);
                        sum += sh[t];
                    }
                    const float inv = 1.f / sum;
                    for (int64_t t = 0; t < seen; ++t) {
                        sh[t] = round_bf16(sh[t] * inv);
                        pb[hh * T + t] = f32_to_bf16_bits(sh[t]);
                    }
                }
                std::fill(acc.begin(), acc.end(), 0.f);  // o_lat = p . latent, a block of rows for every head
                std::fill(ol.begin(), ol.end(), 0.f);
                for (const Seg& g : segs[s]) {
                    if (g.t0 >= seen) break;
                    const int64_t t0 = g.t0, m = std::min(g.rows, seen - t0);
#if defined(MOESAIC_AVX512BF16)
                    if (mix) {
                        dp_mix_heads(pb.data() + t0, T, nh, g.lat, ls, m, kvr, acc.data(), MIX_ACC);
                        continue;
                    }
#endif
                    axpy_bf16_queries(sc.data() + t0, T, nh, g.lat, ls, m, ol.data(), kvr, kvr);
                }
                for (int64_t hh = 0; hh < nh; ++hh) {  // out = o_lat . w_uv[h]ᵀ
                    const int64_t h = h0 + hh;
                    float* o = ol.data() + hh * kvr;
#if defined(MOESAIC_AVX512BF16)
                    if (mix) mix_out(acc.data() + hh * MIX_ACC, kvr, o);
#endif
                    for (int64_t c = 0; c < kvr; ++c) o[c] = round_bf16(o[c]);
                    dot_bf16_many(o, wv + h * w_uv.stride(0), w_uv.stride(1), kvr, dv, ov.data());
                    for (int64_t v = 0; v < dv; ++v) op[(r * H + h) * dv + v] = f32_to_bf16_bits(ov[v]);
                }
            }
            row0 += n;
        }
    };
    over_heads(H, nthreads, heads);
    return out;
}

#if defined(MOESAIC_AVX512BF16)
// acc[r][j] += a_r[i] . B_i[16 j .. 16 j + 16) over i < count, a_r[i] = a[r * as + i] a pair of bf16 (broadcast) and
// B_i = B + i * bs 16 pairs a vector (nv of the 4 vectors; the rest zero): causal_attend's two products, the
// logits (pairs of dims, 16 keys a vector) and the value sums (pairs of keys, 16 values a vector).
template <int QB>
inline void pair_block(const uint32_t* a, int64_t as, const uint32_t* B, int64_t bs, int64_t count, int nv,
                       __m512 (&acc)[QB][4]) {
    for (int r = 0; r < QB; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; ++i) {
        __m512i b[4];
        for (int j = 0; j < 4; ++j) b[j] = j < nv ? _mm512_loadu_si512(B + i * bs + 16 * j) : _mm512_setzero_si512();
        for (int r = 0; r < QB; ++r) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[r * as + i]);
            for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, (__m512bh)b[j]);
        }
    }
}

// One pass of causal_attend: QB query rows (i0..) of one head against its packed keys Kp [P2][Ts] (pairs of
// dims of 16 keys a vector) and values Vp [Tp / 2][Vc] (pairs of keys of each value), scores S [QB][Tp] and bf16
// probabilities Pb [QB][Tp / 2] (pairs) as scratch.
template <int QB>
void attend_rows(const uint32_t* qp, int64_t P2, const uint32_t* Kp, int64_t Ts, const uint32_t* Vp, int64_t Tp,
                 int64_t Vc, int64_t Dv, int64_t lim0, float scale, bool round_scores, bool normalize_first, float* S,
                 uint32_t* Pb, uint16_t* out, int64_t out_stride) {
    const int64_t kmax = lim0 + QB - 1;  // keys the last row sees; row r sees lim0 + r
    __m512 acc[QB][4];
    for (int64_t c = 0; c < kmax; c += 64) {  // the scores, 64 keys x QB rows a pass
        pair_block<QB>(qp, P2, Kp + c, Ts, P2, 4, acc);
        for (int r = 0; r < QB; ++r)
            for (int j = 0; j < 4; ++j) _mm512_storeu_ps(S + r * Tp + c + 16 * j, acc[r][j]);
    }
    const int64_t pairs = (kmax + 1) / 2;
    float inv[QB];
    for (int r = 0; r < QB; ++r) {  // the softmax of each row over the keys it sees
        float* s = S + r * Tp;
        uint16_t* p = reinterpret_cast<uint16_t*>(Pb + r * Tp / 2);
        const int64_t lim = lim0 + r;
        inv[r] = 1.f / softmax_exps(s, nullptr, lim, round_scores, scale);
        const __m512 f = _mm512_set1_ps(normalize_first ? inv[r] : 1.f);
        for (int64_t t = 0; t < 2 * pairs; t += 16) {  // zeros past lim (the pairs' last key too)
            const __m512 e = _mm512_maskz_loadu_ps(first_lanes(lim - t), s + t);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), bf16_of(_mm512_mul_ps(e, f)));
        }
    }
    for (int64_t g = 0; g < Vc; g += 64) {  // out = p . v, 64 values x QB rows a pass
        const int nv = (int)std::min<int64_t>(4, (Vc - g) / 16);
        pair_block<QB>(Pb, Tp / 2, Vp + g, Vc, pairs, nv, acc);
        for (int r = 0; r < QB; ++r) {
            const __m512 f = _mm512_set1_ps(normalize_first ? 1.f : inv[r]);
            for (int j = 0; j < nv && g + 16 * j < Dv; ++j)
                _mm256_mask_storeu_epi16(out + r * out_stride + g + 16 * j, first_lanes(Dv - g - 16 * j),
                                         bf16_of(_mm512_mul_ps(acc[r][j], f)));
        }
    }
}
#endif

#if defined(MOESAIC_AVX512BF16)
// Keys as vdpbf16ps reads them against a query's broadcast pair of dims: Kp[d * Ts + t] for t < Tp (16 keys a
// vector) holds dims 2d, 2d + 1 of key t, whose row starts at base + row(t) elements; zeros where row(t) < 0 or t
// >= T. P2 pairs of dims; row offsets below 2^30 elements (the gather's 32-bit byte offsets).
template <class Row>
void pack_key_pairs(const uint16_t* base, Row row, int64_t T, int64_t Tp, int64_t P2, uint32_t* Kp, int64_t Ts) {
    alignas(64) int32_t off[16];
    for (int64_t t = 0; t < Tp; t += 16) {
        __mmask16 m = 0;
        for (int l = 0; l < 16; ++l) {
            const int64_t r = t + l < T ? row(t + l) : -1;
            off[l] = r < 0 ? 0 : (int32_t)(2 * r);
            if (r >= 0) m |= (__mmask16)(1u << l);
        }
        const __m512i idx = _mm512_load_si512(off);
        for (int64_t d = 0; d < P2; ++d)
            _mm512_storeu_si512(Kp + d * Ts + t,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + 2 * d, 1));
    }
}

// Values as vdpbf16ps reads them against a broadcast pair of probabilities: Vp[p * Vc + c] for p < Tp / 2 and c <
// Vc (D rounded up to 32) holds value c of keys 2p and 2p + 1, rows as pack_key_pairs' (zeros past D, for absent
// keys and past T).
template <class Row>
void pack_value_pairs(const uint16_t* base, Row row, int64_t T, int64_t Tp, int64_t D, uint32_t* Vp, int64_t Vc) {
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t t = 0; t < Tp; t += 2) {
        const int64_t r0 = t < T ? row(t) : -1, r1 = t + 1 < T ? row(t + 1) : -1;
        for (int64_t c = 0; c < Vc; c += 32) {
            const __mmask32 m = D - c >= 32 ? ~0u : (1u << (D - c)) - 1;
            const __m512i a = r0 >= 0 ? _mm512_maskz_loadu_epi16(m, base + r0 + c) : _mm512_setzero_si512();
            const __m512i b = r1 >= 0 ? _mm512_maskz_loadu_epi16(m, base + r1 + c) : _mm512_setzero_si512();
            uint32_t* dst = Vp + t / 2 * Vc + c;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_idx, b));
            _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
        }
    }
}
#endif

// Causal attention of one sequence's n new queries over its T keys (query i sees keys 0 .. T - n + i), bf16:
// q1 [n, H, D1] against k1 [T, Hk, D1], plus (q2, k2) [n, H, D2] / [T, Hk, D2] (MLA's rope part: a k2 head
// stride of 0 shares one key between heads), values v [T, Hk, Dv]; head h reads key / value head h / (H / Hk).
// Logits scale * (q . k) in fp32 (first rounded to bf16 where round_scores: a bf16 matmul's), the softmax in
// fp32; normalize_first: p = bf16(e / sum), out = p . v (layers/attention.py's order), else p = bf16(e), out =
// (p . v) / sum (SDPA's CPU kernel). -> [n, H, Dv] bf16, equal to those to rounding (the sums run in another
// order). By vdpbf16ps on pair-interleaved copies of a head's keys (transposed: 16 keys a vector) and values,
// 4 query rows a pass; threads over heads. D1, D2 even.
torch::Tensor causal_attend(torch::Tensor q1, torch::Tensor k1, std::optional<torch::Tensor> q2,
                            std::optional<torch::Tensor> k2, torch::Tensor v, double scale_d, bool round_scores,
                            bool normalize_first, int64_t nthreads) {
#if defined(MOESAIC_AVX512BF16)
    const bool two = q2.has_value();
    TORCH_CHECK(two == k2.has_value(), "causal_attend: q2 and k2 together");
    const auto ok = [](const torch::Tensor& t) {
        return t.scalar_type() == torch::kBFloat16 && t.device().is_cpu() && t.dim() == 3 && t.stride(-1) == 1;
    };
    TORCH_CHECK(ok(q1) && ok(k1) && ok(v) && (!two || (ok(*q2) && ok(*k2))),
                "causal_attend: bf16 CPU tensors [rows, heads, dim], unit last stride");
    const int64_t n = q1.size(0), H = q1.size(1), D1 = q1.size(2), T = k1.size(0), Hk = k1.size(1);
    const int64_t D2 = two ? q2->size(2) : 0, Dv = v.size(2);
    TORCH_CHECK(k1.size(2) == D1 && v.size(0) == T && v.size(1) == Hk && Hk > 0 && H % Hk == 0 && n >= 1 && n <= T,
                "causal_attend: shapes");
    TORCH_CHECK(!two || (q2->size(0) == n && q2->size(1) == H && k2->size(0) == T && k2->size(1) == Hk &&
                         k2->size(2) == D2), "causal_attend: q2 / k2 shapes");
    TORCH_CHECK(D1 % 2 == 0 && D2 % 2 == 0 && D1 + D2 > 0 && Dv > 0, "causal_attend: even head dims");
    TORCH_CHECK(k1.stride(0) < (1 << 25) && (!two || k2->stride(0) < (1 << 25)), "causal_attend: key row stride");
    // Ts: Kp's row stride, off a multiple of 1 KB (rows a power of two apart would share a few L1 sets)
    const int64_t P2 = (D1 + D2) / 2, Tp = (T + 63) / 64 * 64, Ts = Tp + 16, Vc = (Dv + 31) / 32 * 32, group = H / Hk;
    const int64_t qr1 = q1.stride(0), qs1 = q1.stride(1), kr1 = k1.stride(0), ks1 = k1.stride(1);
    const int64_t qr2 = two ? q2->stride(0) : 0, qs2 = two ? q2->stride(1) : 0;
    const int64_t kr2 = two ? k2->stride(0) : 0, ks2 = two ? k2->stride(1) : 0, vr = v.stride(0), vs1 = v.stride(1);
    auto out = torch::empty({n, H, Dv}, q1.options());
    const auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
    const uint16_t *q1p = u16(q1), *k1p = u16(k1), *vp = u16(v);
    const uint16_t *q2p = two ? u16(*q2) : nullptr, *k2p = two ? u16(*k2) : nullptr;
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float scale = (float)scale_d;
    auto heads = [&](int64_t h0, int64_t h1) {
        std::vector<uint32_t> Kp(P2 * Ts), Vp(Tp / 2 * Vc), qp(4 * P2), Pb(4 * Tp / 2);
        std::vector<float> S(4 * Tp);
        int64_t packed = -1;
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i idx1 = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)(2 * kr1)));  // bytes between keys
        const __m512i idx2 = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)(2 * kr2)));
        for (int64_t h = h0; h < h1; ++h) {
            const int64_t g = h / group;
            if (g != packed) {  // this key / value head's copies
                // Kp[d][t]: dims 2d, 2d + 1 of key t, gathered 16 keys at a time (each block of 16 keys' rows
                // read for all its dims while they are in L1)
                const uint16_t* b1 = k1p + g * ks1;
                const uint16_t* b2 = two ? k2p + g * ks2 : nullptr;
                for (int64_t t = 0; t < Tp; t += 16) {
                    const __mmask16 m = first_lanes(T - t);
                    for (int64_t d = 0; d < P2; ++d) {
                        const bool first = 2 * d < D1;
                        const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, first ? idx1 : idx2,
                                                                      first ? b1 + t * kr1 + 2 * d : b2 + t * kr2 + (2 * d - D1), 1);
                        _mm512_storeu_si512(Kp.data() + d * Ts + t, w);
                    }
                }
                pack_value_pairs(vp + g * vs1, [&](int64_t t) { return t * vr; }, T, Tp, Dv, Vp.data(), Vc);
                packed = g;
            }
            for (int64_t i0 = 0; i0 < n; i0 += 4) {
                const int qb = (int)std::min<int64_t>(4, n - i0);
                for (int r = 0; r < qb; ++r) {  // the rows' dims as pairs (q1's, then q2's)
                    std::memcpy(&qp[r * P2], q1p + (i0 + r) * qr1 + h * qs1, 2 * D1);
                    if (two) std::memcpy(&qp[r * P2 + D1 / 2], q2p + (i0 + r) * qr2 + h * qs2, 2 * D2);
                }
                with_value<1, 2, 3, 4>(qb, [&](auto QBc) {
                    attend_rows<decltype(QBc)::value>(qp.data(), P2, Kp.data(), Ts, Vp.data(), Tp, Vc, Dv, T - n + i0 + 1,
                                                      scale, round_scores, normalize_first, S.data(), Pb.data(),
                                                      op + (i0 * H + h) * Dv, H * Dv);
                });
            }
        }
    };
    over_heads(H, nthreads, heads);
    return out;
#else
    TORCH_CHECK(false, "causal_attend: needs AVX-512 BF16 (cpu.has_bf16dp())");
    return q1;
#endif
}

// A weight as kernels/cpu.py's *_operand builders give it: (kind, w or codes, scales, global scale, divides,
// group, block rows, block cols), gemm's arguments.
using Operand = std::tuple<int64_t, torch::Tensor, std::optional<torch::Tensor>, std::optional<torch::Tensor>, bool,
                           int64_t, int64_t, int64_t>;

// a against the operand m (with offs: the grouped form over its stack), into a new tensor of a's dtype.
torch::Tensor operand_gemm(const torch::Tensor& a, const Operand& m, std::optional<torch::Tensor> offs,
                           int64_t threads, int64_t path) {
    const auto& [kind, w, scales, gscale, divides, group, bn, bk] = m;
    return gemm(kind, a, w, scales, gscale, divides, offs, std::nullopt, std::nullopt, group, bn, bk, threads, path);
}

// layers/kda.py's kda_project for a few rows: the q | k | v, f_a -> f_b, b and output-gate products (ops in that
// order: q, k, v, f_a, f_b, b, then g or g_a, g_b; each through gemm with the threads its own call would take),
// the log-decay (kda_gate: -exp(A_log) softplus(z + dt_bias), or lower_bound sigmoid(exp(A_log) (z + dt_bias)))
// and beta = sigmoid(b x) in fp32: the same products and torch ops in the same order, so the same bits.
// `stacked` (the sizes of its parts): ops[0] is the six products of x stacked by rows (q | k | v | f_a | b |
// g or g_a: layers/kda.py stack_inputs), then f_b and g_b where the gate is low-rank; each output row of gemm
// is its own sum, so the parts have the bits of the separate products. Returns {qkv, g, beta, gate}.
std::vector<torch::Tensor> kda_project(torch::Tensor x, std::vector<Operand> ops, std::vector<int64_t> threads,
                                       torch::Tensor A_log, torch::Tensor dt_bias, int64_t head_dim,
                                       std::optional<double> lower_bound, int64_t path, std::vector<int64_t> stacked) {
    const bool st = !stacked.empty();
    TORCH_CHECK(threads.size() == ops.size() && (st ? stacked.size() == 6 && (ops.size() == 2 || ops.size() == 3)
                                                    : ops.size() == 7 || ops.size() == 8),
                "kda_project: 7 or 8 products, or a stack of six and 1 or 2");
    const auto f32 = torch::kFloat32;
    auto lin = [&](const torch::Tensor& a, size_t i) { return operand_gemm(a, ops[i], std::nullopt, threads[i], path); };
    torch::Tensor qkv, fa, bx, gx;  // x's products: q | k | v, f_a, b, g or g_a
    if (st) {
        auto parts = lin(x, 0).split_with_sizes(stacked, -1);
        qkv = at::cat({parts[0], parts[1], parts[2]}, -1);
        fa = parts[3].contiguous(), bx = parts[4], gx = parts[5];
    } else {
        qkv = at::cat({lin(x, 0), lin(x, 1), lin(x, 2)}, -1);
        fa = lin(x, 3), bx = lin(x, 5);
    }
    const size_t fb = st ? 1 : 4;  // f_b, then (low-rank gate) g_b
    auto z = lin(fa, fb);
    // the log-decay and beta: the torch code's float operations as loops, its exp, softplus and sigmoid on
    // scratch rows (a dozen fewer tensor ops, each slow to start after the weight stream)
    const int64_t n = z.size(0), HD = z.size(1), H = HD / head_dim, nb = bx.size(1);
    TORCH_CHECK(H * head_dim == HD && A_log.numel() == H && dt_bias.numel() == HD, "kda_project: A_log [H], dt_bias [H Dk]");
    const auto cpu = torch::TensorOptions().dtype(f32);
    std::vector<float> u(n * HD), rate(H), db(HD);
    const auto zc = z.contiguous(), ac = A_log.contiguous(), dc = dt_bias.contiguous();
    load_row(ty_of(zc), zc.data_ptr(), u.data(), n * HD);
    load_row(ty_of(ac), ac.data_ptr(), rate.data(), H);
    load_row(ty_of(dc), dc.data_ptr(), db.data(), HD);
    auto rt = torch::from_blob(rate.data(), {H}, cpu);
    at::exp_(rt);
    for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < HD; ++c) u[r * HD + c] = u[r * HD + c] + db[c];
    auto g = torch::empty({n, H, head_dim}, cpu);
    float* gp = g.data_ptr<float>();
    if (lower_bound) {  // lb * sigmoid(rate * u)
        for (int64_t i = 0; i < n * HD; ++i) gp[i] = rate[i % HD / head_dim] * u[i];
        at::sigmoid_(g);
        const float lb = (float)*lower_bound;
        for (int64_t i = 0; i < n * HD; ++i) gp[i] = gp[i] * lb;
    } else {  // -rate * softplus(u)
        at::softplus_out(g, torch::from_blob(u.data(), {n, H, head_dim}, cpu), 1.0, 20.0);
        for (int64_t i = 0; i < n * HD; ++i) gp[i] = -rate[i % HD / head_dim] * gp[i];
    }
    auto beta = torch::empty({n, nb}, cpu);
    TORCH_CHECK(bx.stride(1) == 1, "kda_project: b's rows contiguous");
    for (int64_t r = 0; r < n; ++r)
        load_row(ty_of(bx), (const char*)bx.data_ptr() + r * bx.stride(0) * bx.element_size(), beta.data_ptr<float>() + r * nb, nb);
    at::sigmoid_(beta);
    torch::Tensor gate;
    if (st) gate = ops.size() == 2 ? gx.contiguous() : lin(gx.contiguous(), 2);
    else gate = ops.size() == 7 ? lin(x, 6) : lin(lin(x, 6), 7);
    return {qkv, g, beta, gate};
}

// layers/kda.py's kda_row: the whole KDA mixer for one decode row of one sequence (no snapshots) in one call,
// the calls its three phases make in their order: kda_project (its operands and threads), kda_step (the
// recurrence from the conv tail and state S), the gated head norm (rms_norm of each head's o in fp32 with
// o_norm, times sigmoid(gate) in fp32, rounded to the gate's dtype) and o's product. The same bits; one
// crossing from Python instead of ~10. Returns {y [1, d], the new state, the conv's padded input [K, C]}.
std::vector<torch::Tensor> kda_block(torch::Tensor x, std::vector<Operand> ops, std::vector<int64_t> threads,
                                     torch::Tensor A_log, torch::Tensor dt_bias, int64_t head_dim,
                                     std::optional<double> lower_bound, int64_t path, std::vector<int64_t> stacked,
                                     torch::Tensor tail, torch::Tensor conv_w, torch::Tensor S, double eps,
                                     int64_t rec_threads, int64_t lanes, torch::Tensor o_norm, double norm_eps,
                                     int64_t norm_threads, std::vector<Operand> o_op, int64_t o_threads) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && o_op.size() == 1, "kda_block: one row, one output operand");
    std::vector<torch::Tensor> p;
    {
        ProductClock clock;
        p = kda_project(x, ops, threads, A_log, dt_bias, head_dim, lower_bound, path, stacked);
    }
    const auto &qkv = p[0], &g = p[1], &beta = p[2], &gate = p[3];
    const int64_t H = g.size(1), D = head_dim, HD = H * D;
    TORCH_CHECK(qkv.is_contiguous() && tail.is_contiguous() && S.scalar_type() == torch::kFloat32 && S.is_contiguous() &&
                    gate.numel() == HD, "kda_block: contiguous rows and an fp32 state");
    const auto r = kda_step(qkv, g, beta, tail, conv_w, S, H, D, eps, std::pow((double)D, -0.5), rec_threads, lanes);
    const auto normed = rms_norm(r[0].view({H, D}), o_norm, norm_eps, 0, 0, F32, lanes, norm_threads, 0);
    std::vector<float> sg(HD);
    const auto gc = gate.contiguous();
    load_row(ty_of(gc), gc.data_ptr(), sg.data(), HD);
    auto sgt = torch::from_blob(sg.data(), {1, H, D}, torch::TensorOptions().dtype(torch::kFloat32));
    at::sigmoid_(sgt);
    const float* np_ = normed.data_ptr<float>();
    for (int64_t i = 0; i < HD; ++i) sg[i] = np_[i] * sg[i];
    auto o = torch::empty({1, HD}, gate.options());
    store_row(ty_of(gate), sg.data(), o.data_ptr(), HD);
    ProductClock clock;
    return {operand_gemm(o, o_op[0], std::nullopt, o_threads, path), r[1], r[3]};
}

// layers/mla.py's mla_project for a few rows: ops (q, kv_a) or (q_a, q_b, kv_a), each through gemm with the
// threads its own `linear` call would take; norms (kv_a_norm) or (q_a_norm, kv_a_norm), each as layers/norms.py's
// rms_norm with weights of x's dtype (the fused norm: the mean in torch's order, rounded to x's dtype, times the
// weight): the same bits as the separate calls, one crossing from Python instead of five. Returns {q, kv,
// latent}, and with q_a qr (q_a's normed rows, q_b's input: GLM-5.3's indexer queries take it): latent the norm of
// kv's first kvr columns.
std::vector<torch::Tensor> mla_project(torch::Tensor x, std::vector<Operand> ops, std::vector<int64_t> threads,
                                       std::vector<torch::Tensor> norms, double eps, int64_t kvr, int64_t lanes,
                                       int64_t path) {
    TORCH_CHECK((ops.size() == 2 || ops.size() == 3) && norms.size() == ops.size() - 1 &&
                    threads.size() == ops.size(), "mla_project: (q, kv_a) or (q_a, q_b, kv_a) and their norms");
    const int64_t ty = x.scalar_type() == torch::kBFloat16 ? 1 : x.scalar_type() == torch::kHalf ? 2 : 0;
    auto lin = [&](const torch::Tensor& a, size_t i) { return operand_gemm(a, ops[i], std::nullopt, threads[i], path); };
    auto norm = [&](const torch::Tensor& a, const torch::Tensor& w) { return rms_norm(a, w, eps, 0, ty, ty, lanes, 1, 0); };
    const torch::Tensor qr = ops.size() == 2 ? torch::Tensor() : norm(lin(x, 0), norms[0]);
    const torch::Tensor q = ops.size() == 2 ? lin(x, 0) : lin(qr, 1);
    torch::Tensor kv = lin(x, ops.size() - 1);
    TORCH_CHECK(kvr > 0 && kvr <= kv.size(1), "mla_project: kvr within kv_a's rows");
    std::vector<torch::Tensor> out{q, kv, norm(kv.slice(1, 0, kvr), norms.back())};
    if (qr.defined()) out.push_back(qr);
    return out;
}

// GLM-5.3's DSA projections of x for a few rows (layers/dsa.py project_rows_and_keys): mla_project's (ops q_a,
// q_b, kv_a and their norms), then the indexer's keys of the same rows, k = layer_norm(x W_kᵀ) with its weight
// and bias (torch's layer_norm) and z = x W_gateᵀ (ops 3 and 4): the same bits as the separate calls. Returns
// {q, kv, latent, qr, k, z}.
std::vector<torch::Tensor> dsa_project(torch::Tensor x, std::vector<Operand> ops, std::vector<int64_t> threads,
                                       std::vector<torch::Tensor> norms, double eps, int64_t kvr, int64_t lanes,
                                       int64_t path, torch::Tensor k_norm, torch::Tensor k_bias, double k_eps) {
    TORCH_CHECK(ops.size() == 5 && threads.size() == 5 && norms.size() == 2,
                "dsa_project: q_a, q_b, kv_a, the indexer's wk and gate; two norms");
    auto out = mla_project(x, {ops[0], ops[1], ops[2]}, {threads[0], threads[1], threads[2]}, norms, eps, kvr, lanes,
                           path);
    const auto k = operand_gemm(x, ops[3], std::nullopt, threads[3], path);
    out.push_back(at::layer_norm(k, {k.size(-1)}, k_norm, k_bias, k_eps));
    out.push_back(operand_gemm(x, ops[4], std::nullopt, threads[4], path));
    return out;
}

// cache/state.py TailRows.append's in-place writes: dsts[i][at : at + n] = srcs[i] for each pair (CPU tensors of
// one dtype, 2-D, unit column stride, one width; no autograd) in one call, where the torch code made a slice and
// a copy for each. False, nothing written, where a pair does not fit: the caller writes them by torch.
bool write_rows(std::vector<torch::Tensor> dsts, int64_t at, std::vector<torch::Tensor> srcs) {
    if (dsts.size() != srcs.size() || srcs.empty()) return false;
    const int64_t n = srcs[0].dim() == 2 ? srcs[0].size(0) : -1;
    for (size_t i = 0; i < dsts.size(); ++i) {
        const auto &d = dsts[i], &s = srcs[i];
        if (!(d.device().is_cpu() && s.device().is_cpu() && d.scalar_type() == s.scalar_type() && d.dim() == 2 &&
              s.dim() == 2 && s.size(0) == n && d.size(1) == s.size(1) && d.stride(1) == 1 && s.stride(1) == 1 &&
              at >= 0 && at + n <= d.size(0) && !s.requires_grad() && !d.requires_grad()))
            return false;
    }
    for (size_t i = 0; i < dsts.size(); ++i) {
        const auto &d = dsts[i], &s = srcs[i];
        const int64_t es = d.element_size(), width = d.size(1) * es;
        char* dp = static_cast<char*>(d.data_ptr()) + at * d.stride(0) * es;
        const char* sp = static_cast<const char*>(s.data_ptr());
        for (int64_t r = 0; r < n; ++r) std::memmove(dp + r * d.stride(0) * es, sp + r * s.stride(0) * es, width);
    }
    return true;
}

// PagedRows.write's copy of bf16 rows [n, width] (unit column stride) to their pages of pool [blocks, rows, width]:
// row i to block place[2 i], row place[2 i + 1].
void write_pages(const torch::Tensor& pool, const torch::Tensor& rows, const std::vector<int64_t>& place) {
    const int64_t n = rows.size(0);
    TORCH_CHECK(pool.dim() == 3 && pool.scalar_type() == torch::kBFloat16 && pool.stride(2) == 1 &&
                    rows.scalar_type() == torch::kBFloat16 && rows.dim() == 2 && rows.stride(1) == 1 &&
                    pool.size(2) == rows.size(1), "write_pages: bf16 rows and pages [blocks, rows, width] of one width");
    TORCH_CHECK((int64_t)place.size() == 2 * n, "write_pages: a block and a row for each row");
    for (int64_t i = 0; i < n; ++i) {
        const int64_t b = place[2 * i], r = place[2 * i + 1];
        TORCH_CHECK(b >= 0 && b < pool.size(0) && r >= 0 && r < pool.size(1), "write_pages: page out of range");
        auto* dst = reinterpret_cast<uint16_t*>(pool.data_ptr()) + b * pool.stride(0) + r * pool.stride(1);
        const auto* src = reinterpret_cast<const uint16_t*>(rows.data_ptr()) + i * rows.stride(0);
        std::memcpy(dst, src, rows.size(1) * sizeof(uint16_t));
    }
}

// layers/mla.py's mla_block: an MLA module for rows whose sequences all take the absorbed path over one pool's
// pages (decode rows, verify blocks), in one call where Python made ~40 small calls and ops a layer (~100 us
// there from memory, docs/perf.md): mla_project (ops: its operands, then o's), q viewed as [n, H, dn + dr], the
// rope parts rotated by rope() (layout as rope's; < 0: none), each row's latent and key slice written to its
// page (place: block and row of each query row), mla_absorbed over the pages (blocks / lengths as it takes
// them) and o's product of its [n, H * dv] output. The calls the Python code makes, in its order, with the
// thread counts it would give them: the same bits. Returns o's product [n, d].
torch::Tensor mla_block(torch::Tensor x, std::vector<Operand> ops, std::vector<int64_t> threads,
                        std::vector<torch::Tensor> norms, double eps, int64_t kvr, int64_t lanes, int64_t path,
                        int64_t H, int64_t dn, std::optional<torch::Tensor> cos, std::optional<torch::Tensor> sin,
                        int64_t layout, int64_t rope_threads, torch::Tensor latent_pool, torch::Tensor rope_pool,
                        std::vector<int64_t> place, torch::Tensor w_uk, torch::Tensor w_uv, std::vector<int64_t> lens,
                        double scale, int64_t attn_threads, std::vector<std::vector<int64_t>> blocks,
                        std::vector<int64_t> lengths, std::optional<torch::Tensor> qscale) {
    TORCH_CHECK(ops.size() >= 3 && threads.size() == ops.size(), "mla_block: mla_project's operands, then o's");
    TORCH_CHECK(layout < 0 || (cos && sin), "mla_block: cos / sin for the rotation");
    const Operand o = ops.back();
    const int64_t o_threads = threads.back();
    ops.pop_back(), threads.pop_back();
    const auto proj = mla_project(x, ops, threads, norms, eps, kvr, lanes, path);
    const int64_t n = x.size(0);
    const auto q = proj[0].view({n, H, -1});
    torch::Tensor q_rope = q.slice(2, dn), k_rope = proj[1].slice(1, kvr);
    if (layout >= 0) {
        k_rope = rope(k_rope.unsqueeze(1), *cos, *sin, layout, rope_threads, 0).select(1, 0);
        q_rope = rope(q_rope, *cos, *sin, layout, rope_threads, 0);
    }
    torch::Tensor q_nope = q.slice(2, 0, dn);
    if (qscale) q_nope = q_nope * *qscale, q_rope = q_rope * *qscale;  // a per-row query scale [n, 1, 1] (llama 4's)
    const auto& latent = proj[2];
    write_pages(latent_pool, latent, place), write_pages(rope_pool, k_rope, place);
    const std::vector<torch::Tensor> latents(lens.size(), latent_pool), k_ropes(lens.size(), rope_pool);
    const auto out = mla_absorbed(q_nope, q_rope, w_uk, w_uv, latents, k_ropes, lens, scale, attn_threads, blocks,
                                  lengths);
    return operand_gemm(out.flatten(1), o, std::nullopt, o_threads, path);
}

// models/deepseek_v4.py's attention_inputs after x's products, for a few rows: qr = the q_a rows' norm (rms_norm's
// roundings pre / mid / out of norm_ty: DeepSeek-V4's cast-once order), q = q_b's product of qr viewed [n, H, D],
// each head's unweighted RMS (head_norm: norms.head_rms, `ones` its unit weight [D]) and the rotation of its last
// channels (rope_pairs: layout 2, cos / sin [n, rope / 2]); kv = the kv rows' norm, rotated the same way. The
// calls layers/norms.py, rope.py and linear.py make, in their order, with their threads: the same bits. Returns
// {qr, q, kv}.
std::vector<torch::Tensor> v4_inputs(torch::Tensor qa, torch::Tensor kv, Operand q_b, int64_t q_b_threads,
                                     torch::Tensor q_a_norm, torch::Tensor kv_norm, double eps, int64_t norm_ty,
                                     int64_t lanes, int64_t path, int64_t H, std::optional<torch::Tensor> ones,
                                     torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(qa.dim() == 2 && kv.dim() == 2 && qa.size(0) == kv.size(0), "v4_inputs: qa [n, q_lora], kv [n, D]");
    const int64_t n = qa.size(0), D = kv.size(1), rope_dim = 2 * cos.size(1), ty = ty_of(qa);
    TORCH_CHECK(rope_dim <= D && cos.size(0) == n, "v4_inputs: cos / sin [n, rope / 2] within the head");
    const auto qr = rms_norm(qa, q_a_norm, eps, 0, 0, norm_ty, lanes, 1, 0);
    auto q = operand_gemm(qr, q_b, std::nullopt, q_b_threads, path);
    TORCH_CHECK(q.size(1) == H * D, "v4_inputs: q_b's rows H x D");
    q = q.view({n, H, D});
    if (ones) q = rms_norm(q.view({n * H, D}), *ones, eps, 0, ty, ty, lanes, 1, ty).view({n, H, D});
    q = rope(q, cos, sin, 2, 1, D - rope_dim);
    auto k = rms_norm(kv.stride(1) == 1 ? kv : kv.contiguous(), kv_norm, eps, 0, 0, norm_ty, lanes, 1, 0);
    k = rope(k.view({n, 1, D}), cos, sin, 2, 1, D - rope_dim).view({n, D});
    return {qr, q, k};
}

// models/deepseek_v4.py's attention_output for a few rows: o [n, H, D] rotated back (rope_pairs: layout 2, the last
// 2 cos.size(1) channels; sin already negated), its heads split into G groups, group g through o_a's rows
// [g r, (g + 1) r) (o_a: the dense stack [G, r, H D / G], one grouped product over the groups), the groups' outputs
// side by side through o_b. The calls layers/rope.py and csa.py's grouped_out make, each output row of gemm its own
// sum: the same bits, without a rope call, G slices made contiguous, G + 1 products' calls and a cat a layer
// (V4: 0.26 ms of a 17.7 ms decode step, docs/perf.md).
torch::Tensor v4_output(torch::Tensor o, torch::Tensor cos, torch::Tensor sin, int64_t rope_threads, Operand o_a,
                        int64_t a_threads, Operand o_b, int64_t b_threads, int64_t path) {
    TORCH_CHECK(o.dim() == 3, "v4_output: o [n, H, D]");
    const int64_t n = o.size(0), H = o.size(1), D = o.size(2);
    const auto& wa = std::get<1>(o_a);
    TORCH_CHECK(wa.dim() == 3 && wa.size(0) > 0 && (H * D) % wa.size(0) == 0 && wa.size(2) == H * D / wa.size(0),
                "v4_output: o_a [G, r, H D / G]");
    const int64_t G = wa.size(0), r = wa.size(1), K = H * D / G;
    const auto x = rope(o, cos, sin, 2, rope_threads, D - 2 * cos.size(1));  // [n, H, D], contiguous
    // row g n + t: token t's group g (the grouped product's rows by group)
    const auto xs = n == 1 ? x.view({G, K}) : x.view({n, G, K}).transpose(0, 1).contiguous().view({G * n, K});
    auto offs = torch::empty({G}, torch::kInt64);
    for (int64_t g = 0; g < G; ++g) offs.data_ptr<int64_t>()[g] = (g + 1) * n;
    auto z = operand_gemm(xs, o_a, offs, a_threads, path);  // [G n, r]
    z = n == 1 ? z.view({1, G * r}) : z.view({G, n, r}).transpose(0, 1).reshape({n, G * r});
    return operand_gemm(z, o_b, std::nullopt, b_threads, path);
}

// a = a * b (mul, 0) or a + b (add, 1) in place for bf16 a [R, C] contiguous and bf16 b [R, C] with unit column
// stride: each result in fp32, rounded once, as torch's bf16 mul_ / add_ (whose dispatch costs more than the
// work at a decode step's sizes); other dtypes or layouts by those ops.
void bf16_rows_(torch::Tensor& a, const torch::Tensor& b, int op) {
    if (!(a.scalar_type() == torch::kBFloat16 && b.scalar_type() == torch::kBFloat16 && a.dim() == 2 &&
          a.is_contiguous() && b.sizes() == a.sizes() && b.stride(1) == 1)) {
        op == 0 ? a.mul_(b) : a.add_(b);
        return;
    }
    const int64_t R = a.size(0), C = a.size(1), ld = b.stride(0);
    uint16_t* ap = reinterpret_cast<uint16_t*>(a.data_ptr());
    const uint16_t* bp = reinterpret_cast<const uint16_t*>(b.data_ptr());
    for (int64_t r = 0; r < R; ++r) {
        uint16_t* ar = ap + r * C;
        const uint16_t* br = bp + r * ld;
        if (op == 0)
            for (int64_t c = 0; c < C; ++c) ar[c] = f32_to_bf16_bits(bf16_bits_to_f32(ar[c]) * bf16_bits_to_f32(br[c]));
        else
            for (int64_t c = 0; c < C; ++c) ar[c] = f32_to_bf16_bits(bf16_bits_to_f32(ar[c]) + bf16_bits_to_f32(br[c]));
    }
}

// The clamps of layers/moe.py's clamped_silu_glu on bf16 rows (2-D, unit column stride): torch rounds the limit to
// bf16 and returns one of each comparison's values, a NaN kept (its min / max keep a NaN input).
bool clamp_fits(const torch::Tensor& gate, const torch::Tensor& up) {
    auto rows = [](const torch::Tensor& t) {
        return t.scalar_type() == torch::kBFloat16 && t.dim() == 2 && t.stride(1) == 1;
    };
    return rows(gate) && rows(up) && gate.sizes() == up.sizes();
}
inline float clamp_to(float v, float lo, float hi) { return v != v ? v : std::min(std::max(v, lo), hi); }

// gate.clamp(max=limit) as a new contiguous tensor
torch::Tensor clamped_bf16(const torch::Tensor& gate, double limit) {
    const int64_t R = gate.size(0), C = gate.size(1), ld = gate.stride(0);
    const float hi = round_bf16((float)limit), lo = -std::numeric_limits<float>::infinity();
    auto out = torch::empty({R, C}, gate.options());
    const uint16_t* g = reinterpret_cast<const uint16_t*>(gate.data_ptr());
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) o[r * C + c] = f32_to_bf16_bits(clamp_to(bf16_bits_to_f32(g[r * ld + c]), lo, hi));
    return out;
}

// h *= up.clamp(-limit, limit) for h [R, C] contiguous: each product rounded to bf16 (bf16_rows_'s mul)
void mul_clamped_bf16(torch::Tensor& h, const torch::Tensor& up, double limit) {
    const int64_t R = h.size(0), C = h.size(1), ld = up.stride(0);
    const float hi = round_bf16((float)limit), lo = -hi;
    uint16_t* hp = reinterpret_cast<uint16_t*>(h.data_ptr());
    const uint16_t* u = reinterpret_cast<const uint16_t*>(up.data_ptr());
    for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
            const float b = clamp_to(bf16_bits_to_f32(u[r * ld + c]), lo, hi);
            hp[r * C + c] = f32_to_bf16_bits(bf16_bits_to_f32(hp[r * C + c]) * b);
        }
}

// layers/moe.py's silu_glu, or clamped_silu_glu with `limit`, by torch's ops on the same views (its clamps as
// loops on bf16 rows: a clamp's value is one of its inputs, so the same bits for two fewer torch ops, and the
// product in place)
torch::Tensor glu_rows(const torch::Tensor& gate, const torch::Tensor& up, std::optional<double> limit) {
    if (!limit) {
        auto h = at::silu(gate);
        bf16_rows_(h, up, 0);
        return h;
    }
    if (!clamp_fits(gate, up)) {
        auto h = at::silu(at::clamp(gate, std::nullopt, *limit));
        bf16_rows_(h, at::clamp(up, -*limit, *limit), 0);
        return h;
    }
    auto h = clamped_bf16(gate, *limit);
    at::silu_(h);
    mul_clamped_bf16(h, up, *limit);
    return h;
}

// No FMA contraction in ffn_rows: torch rounds every product of the weighted sum.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
// One token's weighted sum over its k slots into acc [d], from 0 (the caller rounds it to bf16): row(j) slot j's bf16
// expert row, w(j) its routing weight as fp32. bf16 weights (`narrow`): each product and each partial sum rounded to
// bf16, torch's `out = terms[:, 0] + 0; out += terms[:, j]` (the first sum, 0 + p, turns -0 into +0); fp32 ones:
// the fp32 terms summed in slot order, `terms.sum(1)`. (ffn_rows' combine and combine_rows'.)
template <class RowF, class WF>
__attribute__((always_inline)) inline void slot_sums(int64_t k, int64_t d, bool narrow, RowF row, WF w, float* acc) {
    std::fill(acc, acc + d, 0.f);
    for (int64_t j = 0; j < k; ++j) {
        const uint16_t* r = row(j);
        const float wj = w(j);
        if (narrow)
            for (int64_t c = 0; c < d; ++c) acc[c] = round_bf16(acc[c] + round_bf16(bf16_bits_to_f32(r[c]) * wj));
        else
            for (int64_t c = 0; c < d; ++c) acc[c] = acc[c] + bf16_bits_to_f32(r[c]) * wj;
    }
}

// A few tokens' feed-forward block (layers/moe.py at decode sizes: a batch's decode rows, a verify block) in
// one call, where the block's Python and small torch ops cost as much as its products: the routed experts
// (ids / weights [N, k] from the router; stacks w_in [E, 2I, d] gate|up and w_out [E, d, I], dense bf16 or
// packed) as two grouped gemm calls over the (token, slot) pairs grouped by expert (each token's slots in
// ascending id, the pairs in that order within an expert: run_experts' sort and stable argsort), silu(gate)
// * up (clamped at `limit`: clamped_silu_glu) by torch's own ops on the same views, each token's weighted sum over its slots in ascending id in
// the weights' dtype (bf16: each product and each partial sum rounded, from 0; fp32: summed from 0, rounded
// once to x's dtype); then the dense SwiGLU MLP (gate / up [I', d], down [d, I']: a shared expert) added in
// x's dtype. Either part may be absent. `relu2`: ungated experts and MLP instead (Nemotron-H: w_in [E, I, d],
// no gate, relu(h)^2 by torch's ops: layers/moe.py's relu2). The same products over the same rows, the same float operations in
// the same order as that code: the same bits (tests/test_cpu_kernels.py). `threads`: each product's thread
// count, in order (w_in, w_out, gate, up, down: the parts given), from kernels/cpu.py's threads_for. A token
// choosing an expert twice returns an undefined tensor (None): the caller runs the torch code.
torch::Tensor ffn_rows(torch::Tensor x, std::optional<torch::Tensor> weights, std::optional<torch::Tensor> ids,
                       std::optional<Operand> w_in, std::optional<Operand> w_out, std::optional<Operand> gate,
                       std::optional<Operand> up, std::optional<Operand> down, std::optional<double> limit,
                       bool relu2, std::vector<int64_t> threads, int64_t path) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == torch::kBFloat16, "ffn_rows: x bf16 [N, d]");
    const bool routed = w_in.has_value(), dense = up.has_value();
    TORCH_CHECK(routed == (weights && ids && w_out) && dense == bool(down) && (routed || dense) &&
                    (!dense || gate.has_value() != relu2), "ffn_rows: parts");
    TORCH_CHECK((int64_t)threads.size() == 2 * routed + (3 - relu2) * dense, "ffn_rows: one thread count per product");
    x = x.contiguous();
    const int64_t N = x.size(0), d = x.size(1);
    size_t call = 0;  // the products in order: w_in, w_out, gate, up, down (each part that is given)
    auto product = [&](const torch::Tensor& a, const Operand& m, std::optional<torch::Tensor> offs) {
        return operand_gemm(a, m, offs, threads[call++], path);
    };
    auto out_rows = [](const Operand& m) { return std::get<1>(m).size(-2); };
    auto act = [&](const torch::Tensor& gu, int64_t I) {  // the experts' activation over w_in's rows
        return relu2 ? at::relu(gu).square() : glu_rows(gu.narrow(1, 0, I), gu.narrow(1, I, I), limit);
    };
    torch::Tensor out;
    if (routed) {
        const auto& Wi = std::get<1>(*w_in);
        const int64_t E = Wi.size(0), k = ids->size(1), T = N * k, I = out_rows(*w_in) / (relu2 ? 1 : 2);
        TORCH_CHECK(ids->dim() == 2 && ids->size(0) == N && ids->scalar_type() == torch::kInt64, "ffn_rows: ids [N, k] int64");
        TORCH_CHECK(weights->dim() == 2 && weights->size(0) == N && weights->size(1) == k &&
                        (weights->scalar_type() == torch::kBFloat16 || weights->scalar_type() == torch::kFloat32),
                    "ffn_rows: weights [N, k] bf16 or fp32");
        TORCH_CHECK(Wi.dim() == 3 && std::get<1>(*w_out).dim() == 3 && std::get<1>(*w_out).size(0) == E &&
                        out_rows(*w_out) == d && out_rows(*w_in) == (relu2 ? I : 2 * I),
                    "ffn_rows: w_in [E, 2I, d] (ungated [E, I, d]), w_out [E, d, I]");
        auto idc = ids->contiguous();
        auto wc = weights->contiguous();
        const int64_t* ip = idc.data_ptr<int64_t>();
        std::vector<int64_t> slot(T);  // slot[t * k + j]: token t's j-th slot in ascending expert id
        std::vector<int64_t> count(E, 0);
        for (int64_t t = 0; t < N; ++t) {
            int64_t* sl = slot.data() + t * k;
            const int64_t* id = ip + t * k;
            for (int64_t j = 0; j < k; ++j) {
                TORCH_CHECK(id[j] >= 0 && id[j] < E, "ffn_rows: expert id out of range");
                sl[j] = j;
                ++count[id[j]];
            }
            std::stable_sort(sl, sl + k, [&](int64_t a, int64_t b) { return id[a] < id[b]; });
            for (int64_t j = 1; j < k; ++j)  // torch's sort may order a repeated id's slots either way
                if (id[sl[j]] == id[sl[j - 1]]) return torch::Tensor();
        }
        auto offs = torch::empty({E}, torch::kInt64);
        int64_t* op = offs.data_ptr<int64_t>();
        std::vector<int64_t> next(E);  // the pairs grouped by expert: a stable counting sort of p = t * k + j
        for (int64_t e = 0, end = 0; e < E; ++e) {
            next[e] = end;
            end += count[e];
            op[e] = end;
        }
        std::vector<int64_t> row_of(T);  // pair p's row in the grouped products
        std::vector<int64_t> sp(T);  // the token of each grouped row
        for (int64_t p = 0; p < T; ++p) {
            const int64_t e = ip[(p / k) * k + slot[p]];
            row_of[p] = next[e]++;
            sp[row_of[p]] = p / k;
        }
        auto xs = torch::empty({T, d}, x.options());  // x.index_select(0, sp), as a copy of rows
        for (int64_t p = 0; p < T; ++p)
            std::memcpy(static_cast<char*>(xs.data_ptr()) + p * d * 2, static_cast<const char*>(x.data_ptr()) + sp[p] * d * 2, d * 2);
        auto gu = product(xs, *w_in, offs);
        auto y = product(act(gu, I), *w_out, offs);  // [T, d], grouped by expert
        const uint16_t* yp = reinterpret_cast<const uint16_t*>(y.data_ptr());
        out = torch::empty({N, d}, x.options());
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
        std::vector<float> acc(d);
        const bool narrow = wc.scalar_type() != torch::kFloat32;
        const float* wf = narrow ? nullptr : wc.data_ptr<float>();
        const uint16_t* wb = narrow ? reinterpret_cast<const uint16_t*>(wc.data_ptr()) : nullptr;
        for (int64_t t = 0; t < N; ++t) {
            slot_sums(
                k, d, narrow, [&](int64_t j) { return yp + row_of[t * k + j] * d; },
                [&](int64_t j) {
                    const int64_t i = t * k + slot[t * k + j];
                    return narrow ? bf16_bits_to_f32(wb[i]) : wf[i];
                },
                acc.data());
            for (int64_t c = 0; c < d; ++c) o[t * d + c] = f32_to_bf16_bits(acc[c]);
        }
    }
    if (dense) {
        const int64_t I = out_rows(*up);
        TORCH_CHECK((relu2 || out_rows(*gate) == I) && out_rows(*down) == d, "ffn_rows: gate / up [I, d], down [d, I]");
        torch::Tensor h;
        if (relu2) {
            h = at::relu(product(x, *up, std::nullopt)).square();
        } else {
            auto g = product(x, *gate, std::nullopt);
            h = glu_rows(g, product(x, *up, std::nullopt), limit);
        }
        auto s = product(h, *down, std::nullopt);
        if (!routed) return s;
        bf16_rows_(out, s, 1);  // `y + s` in bf16
    }
    return out;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// mHC's site (layers/mhc.py site_input: site_maps, then collapse) and its update, one call each, with the
// bits of the torch code. Its ~20 small ops' dispatch was the site's time (~90 of ~105 us a site and all
// of an update's ~45 us, one Zen 3 core, 4 streams of 1024): the elementwise steps and the stream sums
// are loops here, in torch's float operations and order (no contraction: torch rounds every product;
// its sum over the streams adds them in order from 0); the sigmoids and the softmax stay torch's (their
// exp, and which of its vector or scalar code runs, decides their bits).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
namespace {

// A thread's buffers for rows_on's bodies, kept between calls (apart from gemm's Scratch): mhc_collapse's 0 (and
// f32_rows_into's, which asks for none), mhc_mix's 1, mhc_enter's 2 and 3, the attention calls' 4; each grown to
// the largest asked.
float* row_buffer(int i, int64_t n) {
    thread_local std::array<std::vector<float>, 5> bufs;
    if ((int64_t)bufs[i].size() < n) bufs[i].resize(n);
    return bufs[i].data();
}

// Runs body(t, buffers) for t in [0, N): on `threads` threads (each its own buffers of `width` floats) where
// asked, else here on the thread's kept buffer (no parallel region: its setup is a measurable part of a
// one-row call after a weight stream).
template <class F>
void rows_on(int64_t N, int64_t threads, int64_t width, int slot, F body) {
    if (threads > 1 && N > 1) {
#pragma omp parallel num_threads(threads)
        {
            std::vector<float> buf(width);
#pragma omp for
            for (int64_t t = 0; t < N; ++t) body(t, buf.data());
        }
    } else {
        float* buf = row_buffer(slot, width);
        for (int64_t t = 0; t < N; ++t) body(t, buf);
    }
}

// x[t] = rnd(sum_j pre[t, j] s[t, j]) (collapse): s [N, n, d] contiguous of type ty, pre [N, n] fp32; with a
// norm (nw: its fp32 weight [d]), the block's RMSNorm of that row (rms_norm's operations, roundings pre / mid)
// stored as out_ty, else the row stored as ty.
void mhc_collapse(int ty, const char* s, const float* pre, char* x, int64_t N, int64_t n, int64_t d,
                  int64_t threads, const float* nw, float eps, int npre, int nmid, int out_ty, int64_t lanes) {
    const int64_t es = ty == F32 ? 4 : 2, xs = (nw ? out_ty : ty) == F32 ? 4 : 2;
    rows_on(N, threads, 2 * d, 0, [&](int64_t t, float* buf) {
        float *acc = buf, *row = buf + d;
        std::fill(acc, acc + d, 0.f);
        for (int64_t j = 0; j < n; ++j) {
            load_row(ty, s + (t * n + j) * d * es, row, d);
            const float p = pre[t * n + j];
            for (int64_t i = 0; i < d; ++i) acc[i] += p * row[i];
        }
        if (nw) {
            round_row(ty, acc, d);  // the collapse's rounding to the streams' dtype
            norm_row(acc, row, nw, d, eps, npre, nmid, F32, lanes);
            store_row(out_ty, acc, x + t * d * xs, d);
        } else {
            store_row(ty, acc, x + t * d * xs, d);
        }
    });
}

// A weight value as fp32: bf16's exactly (its bits, shifted).
inline float weight_f32(const float* w, int64_t i) { return w[i]; }
inline float weight_f32(const uint16_t* w, int64_t i) { return bf16_bits_to_f32(w[i]); }

// out[m, r] = x[m] . w[r] for fp32 x [M, K] and fp32 (or bf16, read as fp32) w rows [r0, r1) (row stride ws): 16
// partial sums (k mod 16) from 0 in k order, added in lane order, then the K % 16 tail from the last; each product
// rounded, then added (no contraction in this region). The same bits for a row whatever M, the rows around it and
// the threads. Weight rows 4 at a time, each x chunk loaded once for them.
template <typename W>
void f32_dot_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t ws, int64_t r0, int64_t r1, float* out,
                  int64_t N) {
    const int64_t K16 = K / 16 * 16;
    for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        for (int64_t r = r0; r < r1; r += 4) {
            // the row count a compile-time constant, so that the partial sums stay in registers (a loop bound
            // known only at run time left them on the stack: a store and a reload per 16 products)
            with_value<4, 3, 2, 1>(std::min<int64_t>(4, r1 - r), [&](auto Rc) {
                constexpr int R = decltype(Rc)::value;
                float acc[R][16] = {};
                for (int64_t k = 0; k < K16; k += 16)
#pragma GCC unroll 4
                    for (int i = 0; i < R; ++i) {
                        const W* wr = w + (r + i) * ws + k;
                        // 8 lines ahead in each row: the rows' streams start cold at every call (mHC's sites)
                        if (m == 0) __builtin_prefetch(reinterpret_cast<const char*>(wr) + 512, 0, 3);
#pragma GCC unroll 16
                        for (int l = 0; l < 16; ++l) acc[i][l] = acc[i][l] + xm[k + l] * weight_f32(wr, l);
                    }
                for (int i = 0; i < R; ++i) {
                    float sum = 0.f;
                    for (int l = 0; l < 16; ++l) sum = sum + acc[i][l];
                    for (int64_t k = K16; k < K; ++k) sum = sum + xm[k] * weight_f32(w, (r + i) * ws + k);
                    out[m * N + r + i] = sum;
                }
            });
        }
    }
}

#if defined(__AVX512F__)
// f32_dot_rows' sums for MB x rows (x [MB, K]) against RB weight rows (w, row stride ws) at once: each pair's 16
// lanes (k mod 16) in k order, added in lane order, then the tail: the same operations, so the same bits, with each
// x and weight vector loaded once for the tile (a prompt's rows: ~2x the row-by-row loop).
template <int MB, int RB, typename W>
void f32_dot_tile(const float* x, int64_t K, const W* w, int64_t ws, float* out, int64_t N) {
    const int64_t K16 = K / 16 * 16;
    __m512 acc[MB][RB];
    for (int i = 0; i < MB; ++i)
        for (int r = 0; r < RB; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
        __m512 xv[MB];
        for (int i = 0; i < MB; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);
        for (int r = 0; r < RB; ++r) {
            __m512 wv;
            if constexpr (std::is_same_v<W, float>) {
                wv = _mm512_loadu_ps(w + r * ws + k);
            } else {
                const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * ws + k));
                wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            }
            for (int i = 0; i < MB; ++i) acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_mul_ps(xv[i], wv));
        }
    }
    for (int i = 0; i < MB; ++i)
        for (int r = 0; r < RB; ++r) {
            alignas(64) float lane[16];
            _mm512_store_ps(lane, acc[i][r]);
            float sum = 0.f;  // f32_dot_rows' sum written out (one function for both: 1.5x f32_dot_rows' one-row time)
            for (int l = 0; l < 16; ++l) sum = sum + lane[l];
            for (int64_t k = K16; k < K; ++k) sum = sum + x[i * K + k] * weight_f32(w, r * ws + k);
            out[i * N + r] = sum;
        }
}
#endif

// torch's sigmoid of n contiguous fp32 values in place, for n < 32: its vector loop (two vectors a round)
// leaves such a count to its scalar code, 1 / (1 + exp(-a)) with the C library's expf (larger counts take
// at::sigmoid_ itself)
void scalar_sigmoid(float* v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) v[i] = 1.f / (1.f + std::exp(-v[i]));
}
constexpr int64_t SCALAR_SIGMOID = 32;

#if defined(MOESAIC_AVX512BF16)
// 16 fp32 lanes to bf16 bits as f32_to_bf16_bits rounds them (nearest even, a NaN 0x7FC0)
inline __m256i bf16_bits_of(__m512 x) {
    return _mm256_mask_mov_epi16(bf16_of(x), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm256_set1_epi16(0x7FC0));
}

// mhc_mix's token t for bf16 rows, NC streams, d a multiple of 16: its operations 16 values at a time in registers
// (no contraction in this region: each product rounded, then added), so the same bits. c, p: comb's and post's
// values rounded to bf16 (row-major [NC][NC], [NC]).
template <int NC>
void mhc_mix_bf16(const uint16_t* s, const uint16_t* y, const float* c, const float* p, uint16_t* out, int64_t d) {
    __m512 ck[NC][NC], pk[NC];
    for (int j = 0; j < NC; ++j)
        for (int k = 0; k < NC; ++k) ck[j][k] = _mm512_set1_ps(c[j * NC + k]);
    for (int k = 0; k < NC; ++k) pk[k] = _mm512_set1_ps(p[k]);
    const auto load = [](const uint16_t* q) { return f32_of(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))); };
    for (int64_t i = 0; i < d; i += 16) {
        __m512 r[NC];
        for (int j = 0; j < NC; ++j) r[j] = load(s + j * d + i);
        const __m512 yv = load(y + i);
        for (int k = 0; k < NC; ++k) {
            __m512 a = _mm512_setzero_ps();
            for (int j = 0; j < NC; ++j) a = _mm512_add_ps(a, _mm512_mul_ps(ck[j][k], r[j]));
            const __m512 spread = f32_of(bf16_bits_of(_mm512_mul_ps(pk[k], yv)));
            const __m512 o = _mm512_add_ps(spread, f32_of(bf16_bits_of(a)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * d + i), bf16_bits_of(o));
        }
    }
}
#endif

// h'[t, k] = rnd(rnd(rnd(post[t, k]) y[t]) + rnd(sum_j rnd(comb[t, j, k]) s[t, j])) (update): the sum in
// fp32 from 0, j in order; rnd rounds to ty. s / out [N, n, d] and y [N, d] of type ty, post [N, n] and
// comb [N, n, n] fp32, all contiguous.
void mhc_mix(int ty, const char* s, const char* y, const float* post, const float* comb, char* out, int64_t N,
             int64_t n, int64_t d, int64_t threads) {
    const int64_t es = ty == F32 ? 4 : 2;
    rows_on(N, threads, (n + 3) * d + n * n + n, 1, [&](int64_t t, float* buf) {
        float *rows = buf, *yrow = rows + n * d, *acc = yrow + d, *spread = acc + d, *c = spread + d, *p = c + n * n;
        std::copy_n(comb + t * n * n, n * n, c);
        round_row(ty, c, n * n);  // comb.to(dt)
        std::copy_n(post + t * n, n, p);
        round_row(ty, p, n);  // post.to(dt)
#if defined(MOESAIC_AVX512BF16)
        if (ty == BF16T && n <= 4 && d % 16 == 0) {  // (a prompt's rows: ~4x the passes below)
            const auto* s16 = reinterpret_cast<const uint16_t*>(s) + t * n * d;
            const auto* y16 = reinterpret_cast<const uint16_t*>(y) + t * d;
            auto* o16 = reinterpret_cast<uint16_t*>(out) + t * n * d;
            with_value<4, 3, 2, 1>(n, [&](auto Nc) { mhc_mix_bf16<decltype(Nc)::value>(s16, y16, c, p, o16, d); });
            return;
        }
#endif
        load_row(ty, s + t * n * d * es, rows, n * d);
        load_row(ty, y + t * d * es, yrow, d);
        for (int64_t k = 0; k < n; ++k) {
            // each sum in a register from 0, j in order; the stream count a constant (j unrolled) where n <= 4
            auto mix = [&](auto Nc) {
                constexpr int NC = decltype(Nc)::value;
                const int64_t M = NC ? NC : n;
                float ck[NC ? NC : 1];  // column k of comb in registers (c shares a buffer with acc)
                for (int j = 0; j < NC; ++j) ck[j] = c[j * NC + k];
                for (int64_t i = 0; i < d; ++i) {
                    float a = 0.f;
                    for (int64_t j = 0; j < M; ++j) a += (NC ? ck[j] : c[j * M + k]) * rows[j * d + i];
                    acc[i] = a;
                }
            };
            if (n <= 4) with_value<4, 3, 2, 1>(n, mix);
            else mix(std::integral_constant<int, 0>{});
            round_row(ty, acc, d);
            for (int64_t i = 0; i < d; ++i) spread[i] = p[k] * yrow[i];
            round_row(ty, spread, d);
            for (int64_t i = 0; i < d; ++i) spread[i] = spread[i] + acc[i];
            store_row(ty, spread, out + (t * n + k) * d * es, d);
        }
    });
}
}  // namespace

// layers/moe.py run_experts' combine for bf16 expert outputs ys [R, d] and fp32 routing weights w [N, k]: out[n] =
// bf16(sum_j fp32(ys[row]) * w[n, j]) with row = inv[n k + j] (inv absent: n k + j), each product rounded, the sum
// from 0 with j in order (torch's product of the cast rows, its sum over the slots, its cast; no contraction in
// this region): the same bits in one pass where torch made four tensors of N k d values. With bf16 routing weights
// (a softmax router in the model's dtype) every product and every partial sum is rounded to bf16, as torch's bf16
// product and in-place adds round them.
torch::Tensor combine_rows(torch::Tensor ys, std::optional<torch::Tensor> inv, torch::Tensor w, int64_t threads) {
    TORCH_CHECK(ys.dim() == 2 && ys.is_contiguous() && ys.scalar_type() == torch::kBFloat16, "combine_rows: ys [R, d] bf16");
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() &&
                    (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
                "combine_rows: w [N, k] fp32 or bf16");
    const int64_t N = w.size(0), k = w.size(1), R = ys.size(0), d = ys.size(1);
    const int64_t* ip = nullptr;
    if (inv) {
        TORCH_CHECK(inv->is_contiguous() && inv->scalar_type() == torch::kInt64 && inv->numel() == N * k,
                    "combine_rows: inv [N k] int64");
        ip = inv->data_ptr<int64_t>();
        for (int64_t i = 0; i < N * k; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < R, "combine_rows: a row past ys");
    } else {
        TORCH_CHECK(R == N * k, "combine_rows: ys [N k, d] without inv");
    }
    auto out = torch::empty({N, d}, ys.options());
    const uint16_t* yp = reinterpret_cast<const uint16_t*>(ys.data_ptr());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const bool narrow = w.scalar_type() == torch::kBFloat16;
    const float* wp = narrow ? nullptr : w.data_ptr<float>();
    const uint16_t* wb = narrow ? reinterpret_cast<const uint16_t*>(w.data_ptr()) : nullptr;
    rows_on(N, threads, d, 0, [&](int64_t n, float* acc) {
        slot_sums(
            k, d, narrow, [&](int64_t j) { return yp + (ip ? ip[n * k + j] : n * k + j) * d; },
            [&](int64_t j) { return narrow ? bf16_bits_to_f32(wb[n * k + j]) : wp[n * k + j]; }, acc);
        store_row(BF16T, acc, op + n * d, d);
    });
    return out;
}

// layers/mhc.py's update: post[k] y + sum_j comb[j, k] h[j] in the streams' dtype (the comb product in fp32
// from 0, j in order, rounded once).
torch::Tensor mhc_update(torch::Tensor streams, torch::Tensor y, torch::Tensor post, torch::Tensor comb,
                         int64_t threads) {
    TORCH_CHECK(streams.dim() == 3 && streams.is_contiguous(), "mhc_update: streams [N, n, d], contiguous");
    const int64_t N = streams.size(0), n = streams.size(1), d = streams.size(2);
    TORCH_CHECK(y.is_contiguous() && y.numel() == N * d && y.scalar_type() == streams.scalar_type(),
                "mhc_update: y [N, d] in the streams' dtype");
    TORCH_CHECK(post.is_contiguous() && post.numel() == N * n && post.scalar_type() == torch::kFloat32 &&
                    comb.is_contiguous() && comb.numel() == N * n * n && comb.scalar_type() == torch::kFloat32,
                "mhc_update: post [N, n] and comb [N, n, n] fp32");
    auto out = at::empty_like(streams);
    mhc_mix(ty_of(streams), static_cast<const char*>(streams.data_ptr()), static_cast<const char*>(y.data_ptr()),
            post.data_ptr<float>(), comb.data_ptr<float>(), static_cast<char*>(out.data_ptr()), N, n, d, threads);
    return out;
}

// out [M, N] = x [M, K] against the fp32 or bf16 rows of w [N, K] (rows contiguous): f32_dot_rows's bits, the weight
// rows shared out to the threads by fours (the same bits under any threads).
void f32_rows_into(const float* x, int64_t M, int64_t K, const torch::Tensor& w, float* out, int64_t nthreads) {
    const bool bf = w.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(w.dim() == 2 && (bf || w.scalar_type() == torch::kFloat32) && w.size(1) == K && w.stride(1) == 1,
                "f32_rows: w [N, K] fp32 or bf16, its rows contiguous");
    const int64_t N = w.size(0), blocks = (N + 3) / 4;
#if defined(__AVX512F__)
    if (M >= 4) {  // tiles of 4 x rows by 6 weight rows, f32_dot_rows for the rest (the same bits)
        const int64_t M4 = M / 4 * 4, tiles = (N + 5) / 6;
        rows_on(tiles, nthreads, 0, 0, [&](int64_t b, float*) {
            const int64_t r0 = 6 * b, r1 = std::min<int64_t>(N, r0 + 6);
            const auto run = [&](const auto* wp) {
                const auto* wr = wp + r0 * w.stride(0);
                for (int64_t m = 0; m < M4 && r1 - r0 == 6; m += 4)
                    f32_dot_tile<4, 6>(x + m * K, K, wr, w.stride(0), out + m * N + r0, N);
                const int64_t m0 = r1 - r0 == 6 ? M4 : 0;
                if (m0 < M) f32_dot_rows(x + m0 * K, M - m0, K, wp, w.stride(0), r0, r1, out + m0 * N, N);
            };
            if (bf) run(reinterpret_cast<const uint16_t*>(w.data_ptr()));
            else run(w.data_ptr<float>());
        });
        return;
    }
#else
    if (M > 16) {  // (MAX_ROWS) a prompt's rows without the tiles: torch's GEMM, its bits (not a decode row's)
        const auto y = at::linear(torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat32), w.to(torch::kFloat32));
        std::copy_n(y.contiguous().data_ptr<float>(), M * N, out);
        return;
    }
#endif
    rows_on(blocks, nthreads, 0, 0, [&](int64_t b, float*) {
        const int64_t r0 = 4 * b, r1 = std::min<int64_t>(N, 4 * b + 4);
        if (bf) f32_dot_rows(x, M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), w.stride(0), r0, r1, out, N);
        else f32_dot_rows(x, M, K, w.data_ptr<float>(), w.stride(0), r0, r1, out, N);
    });
}

// x [M, K] fp32 against fp32 or bf16 w [N, K]: f32_rows_into's products, into a new [M, N].
torch::Tensor f32_rows(torch::Tensor x, torch::Tensor w, int64_t nthreads) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "f32_rows: x [M, K] fp32");
    x = x.contiguous();
    auto out = torch::empty({x.size(0), w.size(0)}, x.options());
    pybind11::gil_scoped_release no_gil;
    f32_rows_into(x.data_ptr<float>(), x.size(0), x.size(1), w, out.data_ptr<float>(), nthreads);
    return out;
}

// The site's product (layers/mhc.py project) of the streams' rows hp [N, nd] of type ty: each flattened row scaled
// by its reciprocal (unweighted) RMS in fp32, then fn's rows, through f32_rows_into (kernel_fn: fp32 or bf16 fn) or
// torch's linear on fn in fp32. m [N, fn rows] in the thread's buffer 3 (the scaled rows in buffer 2).
const float* site_product(int ty, const char* hp, int64_t N, int64_t nd, const torch::Tensor& fn, double norm_eps,
                          int64_t lanes, int64_t threads, bool kernel_fn, int64_t fn_threads) {
    const int64_t W = fn.size(0), es = ty == F32 ? 4 : 2;
    const float neps = (float)norm_eps;
    float *scaled = row_buffer(2, N * nd), *m = row_buffer(3, N * W);
    rows_on(N, threads, nd, 0, [&](int64_t t, float* sq) {
        float* v = scaled + t * nd;
        load_row(ty, hp + t * nd * es, v, nd);
        norm_row(v, sq, nullptr, nd, neps, F32, F32, F32, lanes);
    });
    if (kernel_fn) {
        ProductClock clock;
        f32_rows_into(scaled, N, nd, fn, m, fn_threads);
    } else {
        auto mt = at::linear(torch::from_blob(scaled, {N, nd}, torch::kFloat32), fn.to(torch::kFloat32)).contiguous();
        TORCH_CHECK(mt.scalar_type() == torch::kFloat32, "mhc: the site's product in fp32");
        std::copy_n(mt.data_ptr<float>(), N * W, m);
    }
    return m;
}

// torch's sigmoid of a contiguous fp32 [N, n] in place: its scalar code below SCALAR_SIGMOID values, else its own.
void torch_sigmoid_(float* v, int64_t N, int64_t n) {
    if (N * n < SCALAR_SIGMOID) {
        scalar_sigmoid(v, N * n);
    } else {
        auto t = torch::from_blob(v, {N, n}, torch::kFloat32);
        at::sigmoid_(t);
    }
}

// layers/mhc.py's Streams.enter in one call: where y is given, the waiting update first (h = update(streams, y,
// post0, comb0), mhc_update's operations), then the site's input of h (site_maps, collapse) and, where nw is
// given, the block's RMSNorm of it (rms_norm's operations; pre, mid, out_ty its roundings). streams [N, n, d];
// fn [(2+n) n, n d]; columns / base [(2+n) n] fp32. kernel_fn: fn (fp32 or bf16) through f32_rows_into,
// else torch's linear on fn in fp32. Returns (h, x [N, d], post [N, n], comb [N, n, n]); x in the
// streams' dtype without a norm, else out_ty.
std::vector<torch::Tensor> mhc_enter(torch::Tensor streams, std::optional<torch::Tensor> y,
                                     std::optional<torch::Tensor> post0, std::optional<torch::Tensor> comb0,
                                     torch::Tensor fn, torch::Tensor columns, torch::Tensor base, double norm_eps,
                                     double hc_eps, int64_t iters, int64_t lanes, bool kernel_fn, int64_t threads,
                                     int64_t fn_threads, std::optional<torch::Tensor> nw, double eps,
                                     int64_t npre, int64_t nmid, int64_t out_ty) {
    TORCH_CHECK(streams.dim() == 3 && streams.is_contiguous(), "mhc_enter: streams [N, n, d], contiguous");
    const int64_t N = streams.size(0), n = streams.size(1), d = streams.size(2), W = (2 + n) * n;
    TORCH_CHECK(n <= 4 && iters >= 1 && fn.size(0) == W && fn.size(1) == n * d, "mhc_enter: shapes");
    TORCH_CHECK(columns.is_contiguous() && base.is_contiguous() && columns.numel() == W && base.numel() == W &&
                    columns.scalar_type() == torch::kFloat32 && base.scalar_type() == torch::kFloat32,
                "mhc_enter: columns / base [(2+n) n] fp32");
    TORCH_CHECK(lanes == 8 || lanes == 16, "mhc_enter: 8 or 16 lanes");
    const int ty = ty_of(streams);
    torch::Tensor h = streams;
    if (y) {
        TORCH_CHECK(post0 && comb0, "mhc_enter: an update needs post and comb");
        auto yt = y->scalar_type() == streams.scalar_type() ? *y : y->to(streams.scalar_type());  // y.to(dt)
        h = mhc_update(streams, yt.contiguous(), post0->contiguous(), comb0->contiguous(), threads);
    }
    std::vector<float> nwf;
    if (nw) {
        TORCH_CHECK(nw->is_contiguous() && nw->numel() == d, "mhc_enter: the norm's weight [d]");
        nwf.resize(d);
        load_row(ty_of(*nw), nw->data_ptr(), nwf.data(), d);
    }
    const char* hp = static_cast<const char*>(h.data_ptr());
    const float* m = site_product(ty, hp, N, n * d, fn, norm_eps, lanes, threads, kernel_fn, fn_threads);
    auto f32 = streams.options().dtype(torch::kFloat32);
    // z = m * columns + base, each part in its own contiguous rows (the layout the torch code gives its
    // sigmoids and softmax)
    auto post = at::empty({N, n}, f32);
    std::vector<float> pre(N * n), logits(N * n * n);
    const float *cp = columns.data_ptr<float>(), *bp = base.data_ptr<float>();
    float* qp = post.data_ptr<float>();
    for (int64_t t = 0; t < N; ++t)
        for (int64_t c = 0; c < W; ++c) {
            float z = m[t * W + c] * cp[c];
            z = z + bp[c];
            if (c < n) pre[t * n + c] = z;
            else if (c < 2 * n) qp[t * n + c - n] = z;
            else logits[t * n * n + c - 2 * n] = z;
        }
    torch_sigmoid_(pre.data(), N, n);
    torch_sigmoid_(qp, N, n);
    auto comb = at::softmax(torch::from_blob(logits.data(), {N, n, n}, f32), -1);
    const float heps = (float)hc_eps;
    float* cb = comb.data_ptr<float>();
    for (int64_t i = 0; i < N * n; ++i) {
        pre[i] = pre[i] + heps;
        qp[i] = qp[i] * 2.f;
    }
    for (int64_t i = 0; i < N * n * n; ++i) cb[i] = cb[i] + heps;
    sinkhorn(comb, iters, hc_eps);
    auto x = at::empty({N, d}, streams.options().dtype(nw ? st_of(out_ty) : streams.scalar_type()));
    mhc_collapse(ty, hp, pre.data(), static_cast<char*>(x.data_ptr()), N, n, d, threads,
                 nw ? nwf.data() : nullptr, (float)eps, (int)npre, (int)nmid, (int)out_ty, lanes);
    return {h, x, post, comb};
}

// layers/mhc.py's head_weighted in one call (DeepSeek-V4's final collapse): m = the site projection of each row
// (mhc_enter's: the flattened row scaled by its reciprocal RMS, then fn's rows by f32_rows_into), pre = sigmoid(m
// * scale + base) + hc_eps (torch's sigmoid of a contiguous [N, n], as mhc_enter's), then collapse. streams [N, n,
// d] contiguous; fn [n, n d] fp32 or bf16 (unit column stride); base [n] and scale (its first value) of any float
// type, read as fp32 (the torch code's .float()). Returns x [N, d] in the streams' dtype.
torch::Tensor mhc_head(torch::Tensor streams, torch::Tensor fn, torch::Tensor base, torch::Tensor scale,
                       double norm_eps, double hc_eps, int64_t lanes, int64_t threads, int64_t fn_threads) {
    TORCH_CHECK(streams.dim() == 3 && streams.is_contiguous(), "mhc_head: streams [N, n, d], contiguous");
    const int64_t N = streams.size(0), n = streams.size(1), d = streams.size(2), nd = n * d;
    TORCH_CHECK(fn.dim() == 2 && fn.size(0) == n && fn.size(1) == nd, "mhc_head: fn [n, n d]");
    TORCH_CHECK(base.numel() == n && base.is_contiguous() && scale.numel() >= 1 && scale.is_contiguous(),
                "mhc_head: base [n], scale [1]");
    TORCH_CHECK(lanes == 8 || lanes == 16, "mhc_head: 8 or 16 lanes");
    const int ty = ty_of(streams);
    const char* hp = static_cast<const char*>(streams.data_ptr());
    const float* m = site_product(ty, hp, N, nd, fn, norm_eps, lanes, threads, true, fn_threads);
    std::vector<float> b(n), pre(N * n);
    float sc;
    load_row(ty_of(base), base.data_ptr(), b.data(), n);
    load_row(ty_of(scale), scale.data_ptr(), &sc, 1);
    for (int64_t t = 0; t < N; ++t)
        for (int64_t j = 0; j < n; ++j) {
            float z = m[t * n + j] * sc;
            pre[t * n + j] = z + b[j];
        }
    torch_sigmoid_(pre.data(), N, n);
    const float heps = (float)hc_eps;
    for (int64_t i = 0; i < N * n; ++i) pre[i] = pre[i] + heps;
    auto x = at::empty({N, d}, streams.options());
    mhc_collapse(ty, hp, pre.data(), static_cast<char*>(x.data_ptr()), N, n, d, threads, nullptr, 0.f, 0, 0, 0,
                 lanes);
    return x;
}

// layers/mhc.py's head_mean (GLM-5.3's final collapse, streams.mean(-2)) as collapse with every pre 1 / n: for n a
// power of two the scaling is exact, so the fp32 sum, rounded once, is torch's sum divided by n (its mean).
// streams [N, n, d] contiguous; x [N, d] in the streams' dtype.
torch::Tensor mhc_mean(torch::Tensor streams, int64_t threads) {
    TORCH_CHECK(streams.dim() == 3 && streams.is_contiguous(), "mhc_mean: streams [N, n, d], contiguous");
    const int64_t N = streams.size(0), n = streams.size(1), d = streams.size(2);
    TORCH_CHECK(n > 0 && (n & (n - 1)) == 0, "mhc_mean: a power-of-two stream count");
    std::vector<float> pre(N * n, 1.f / (float)n);
    auto x = at::empty({N, d}, streams.options());
    mhc_collapse(ty_of(streams), static_cast<const char*>(streams.data_ptr()), pre.data(),
                 static_cast<char*>(x.data_ptr()), N, n, d, threads, nullptr, 0.f, 0, 0, 0, 8);  // (no norm: lanes unused)
    return x;
}

// The seconds ProductClock has counted so far; `on` switches the counting on or off from here.
double product_seconds(bool on) {
    product_clock_on = on;
    return product_clock_ns.load() * 1e-9;
}

// The E8M0 exponent byte of pow2_ceil(x) for x > 0 (weights/quant.py's pow2_ceil_e8m0): 2^(e - 127) is the
// smallest power of two >= x, clamped to the bytes 0..254.
inline int e8m0_ceil(float x) {
    int e2;
    const float m = std::frexp(x, &e2);
    return std::min(254, std::max(0, (m == 0.5f ? e2 - 1 : e2) + 127));
}

// weights/quant.py's encoders quantize_mxfp4 (kind 0) and quantize_nvfp4 (1: compressed-tensors' global
// scale gs, a divisor; 2: ModelOpt's, a multiplier) over w [N, K] (fp32 / bf16 / fp16, unit stride in K): the
// torch code's fp32 operations in its order, so the same bytes. Writes packed [N, K/2] (E2M1 pairs, the
// even value in the low nibble) and scales [N, K/G] (E8M0 bytes, or E4M3 for NVFP4; G = 32 or 16). Returns
// false where a value is not finite (the outputs then partly written): the caller runs the torch code, whose
// NaN and infinity rules this does not copy.
bool encode_fp4(int64_t kind, torch::Tensor w, double gs, torch::Tensor packed, torch::Tensor scales,
                int64_t nthreads) {
    TORCH_CHECK(kind >= 0 && kind <= 2, "encode_fp4: kind 0 (mxfp4), 1 or 2 (nvfp4)");
    TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1, "encode_fp4: w [N, K], unit stride in K");
    const int64_t N = w.size(0), K = w.size(1), G = kind == 0 ? 32 : 16;
    TORCH_CHECK(K % G == 0, "encode_fp4: K a multiple of the group");
    TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kUInt8 && packed.size(0) == N &&
                    packed.size(1) == K / 2 && scales.is_contiguous() && scales.scalar_type() == torch::kUInt8 &&
                    scales.size(0) == N && scales.size(1) == K / G,
                "encode_fp4: packed [N, K/2] and scales [N, K/G] uint8, contiguous");
    const int t = ty_of(w);
    const char* wp = static_cast<const char*>(w.data_ptr());
    const int64_t ld = w.stride(0) * w.element_size();
    uint8_t *pp = packed.data_ptr<uint8_t>(), *sp = scales.data_ptr<uint8_t>();
    const float g32 = (float)gs, floor_mx = 6.0f * std::ldexp(1.0f, -126);
    int finite = 1;
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel num_threads((int)std::max<int64_t>(1, nthreads)) reduction(&& : finite)
    {
        std::vector<float> row(K);
        std::array<float, 32> x{};
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; ++i) {
            load_row(t, wp + i * ld, row.data(), K);
            for (int64_t g = 0; g < K / G; ++g) {
                const float* v = row.data() + g * G;
                float amax = 0.f;
                bool ok = true;
                for (int64_t j = 0; j < G; ++j) {
                    const float a = std::fabs(v[j]);
                    ok = ok && a <= FLT_MAX;
                    amax = a > amax ? a : amax;
                }
                if (!ok) {
                    finite = 0;
                    continue;
                }
                if (kind == 0) {  // amax floored, pow2_ceil_e8m0(amax / 6), divided by 2^(e - 127)
                    const int e = e8m0_ceil(std::max(amax, floor_mx) / 6.0f);
                    sp[i * (K / G) + g] = (uint8_t)e;
                    // times 2^(127 - e) is v / 2^(e - 127) exactly (both powers of two are floats: e <= 254)
                    const float inv = std::ldexp(1.0f, 127 - e);
                    for (int64_t j = 0; j < G; ++j) x[j] = v[j] * inv;
                } else {  // the group's E4M3 scale against gs, then values over the effective scale (0 where <= 0)
                    float s = kind == 1 ? amax / 6.0f * g32 : amax / 6.0f / g32;
                    s = std::min(448.0f, std::max(-448.0f, s));
                    const c10::Float8_e4m3fn s8(s);
                    sp[i * (K / G) + g] = s8.x;
                    const float eff = kind == 1 ? (float)s8 / g32 : (float)s8 * g32;
                    if (eff > 0.f)
                        for (int64_t j = 0; j < G; ++j) x[j] = v[j] / eff;
                    else
                        for (int64_t j = 0; j < G; ++j) x[j] = 0.f;
                }
                // nearest E2M1 value, ties to the even code, +-6 at most; the sign bit as the value's (-0 too).
                // Branch-free over the group so that it vectorises.
                std::array<int32_t, 32> c{};
                for (int64_t j = 0; j < G; ++j) {
                    const float a = std::fabs(x[j]);
                    uint32_t bits;
                    std::memcpy(&bits, &x[j], 4);
                    c[j] = (int32_t)(a > 0.25f) + (int32_t)(a >= 0.75f) + (int32_t)(a > 1.25f) +
                           (int32_t)(a >= 1.75f) + (int32_t)(a > 2.5f) + (int32_t)(a >= 3.5f) + (int32_t)(a > 5.0f) +
                           (int32_t)((bits >> 31) << 3);
                }
                uint8_t* out = pp + i * (K / 2) + g * G / 2;
                for (int64_t j = 0; j < G / 2; ++j) out[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
            }
        }
    }
    return finite != 0;
}

// x (finite, |x| <= 448) rounded to the nearest E4M3 value, ties to even: c10::Float8_e4m3fn's bits (torch's
// conversion), without its branches. Below 2^-6 the E4M3 subnormals, multiples of 2^-9 (rounded by adding and
// taking away 1.5 * 2^23: no contraction in this region); above, the float's bits rounded to 3 mantissa bits
// and the exponent rebased from 127 to 7. encode_fp8's loop does the same 8 values at a time.
inline uint8_t e4m3_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t a = u & 0x7FFFFFFFu;
    float af;
    std::memcpy(&af, &a, 4);
    const float sub = (af * 512.0f + 12582912.0f) - 12582912.0f;
    const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    const uint32_t mag = af < 0.015625f ? (uint32_t)sub : normal;
    return (uint8_t)(mag | ((u >> 24) & 0x80u));
}

// One block's row of values [j0, j1) over the scale s, clamped to +-448, to E4M3 bytes (e4m3_bits).
void e4m3_span(const float* v, float s, uint8_t* out, int64_t j0, int64_t j1) {
    int64_t j = j0;
#if defined(MOESAIC_AVX2)
    const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(448.0f), lo = _mm256_set1_ps(-448.0f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 k512 = _mm256_set1_ps(512.0f), magic = _mm256_set1_ps(12582912.0f), minnorm = _mm256_set1_ps(0.015625f);
    const __m256i round = _mm256_set1_epi32(0x7FFFF), one = _mm256_set1_epi32(1), rebase = _mm256_set1_epi32(960),
                  signbit = _mm256_set1_epi32(0x80);
    for (; j + 8 <= j1; j += 8) {
        const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(_mm256_loadu_ps(v + j), vs)));
        const __m256 a = _mm256_and_ps(x, absmask);
        const __m256i sub = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(a, k512), magic), magic));
        const __m256i ai = _mm256_castps_si256(a);
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(ai, round), _mm256_and_si256(_mm256_srli_epi32(ai, 20), one));
        const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(t, 20), rebase);
        const __m256i mag = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(_mm256_cmp_ps(a, minnorm, _CMP_LT_OQ)));
        const __m256i code = _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 24), signbit));
        const __m256i p8 = _mm256_packus_epi16(_mm256_packus_epi32(code, code), _mm256_setzero_si256());
        const int32_t b0 = _mm_cvtsi128_si32(_mm256_castsi256_si128(p8)), b1 = _mm_cvtsi128_si32(_mm256_extracti128_si256(p8, 1));
        std::memcpy(out + j, &b0, 4);
        std::memcpy(out + j + 4, &b1, 4);
    }
#endif
    for (; j < j1; ++j) out[j] = e4m3_bits(std::min(448.0f, std::max(-448.0f, v[j] / s)));
}

// The largest |v| of [j0, j1) into m (max is exact in any order); false where one is not finite.
bool absmax_span(const float* v, int64_t j0, int64_t j1, float& m) {
    int64_t j = j0;
    bool ok = true;
#if defined(MOESAIC_AVX2)
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), big = _mm256_set1_ps(FLT_MAX);
    __m256 vm = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (; j + 8 <= j1; j += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(v + j), absmask);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // NaN or infinity
        vm = _mm256_max_ps(vm, a);
    }
    ok = _mm256_movemask_ps(bad) == 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    for (float l : lanes) m = l > m ? l : m;
#endif
    for (; j < j1; ++j) {
        const float a = std::fabs(v[j]);
        ok = ok && a <= FLT_MAX;
        m = a > m ? a : m;
    }
    return ok;
}

// weights/quant.py's quantize_fp8_block over w [N, K] (fp32 / bf16 / fp16, unit stride in K): per (bn, bk) block
// the amax, the scale (ue8m0: the E8M0 byte of pow2_ceil(max(amax, 1e-4) / 448), else amax / 448, 1 for a zero
// block), each value over its block's scale clamped to +-448 and rounded to E4M3: the torch code's fp32
// operations, so the same bytes, one block row at a time (read twice, from cache the second time). codes [N, K]
// uint8; scales [ceil(N/bn), ceil(K/bk)] fp32, or uint8 (E8M0) with ue8m0. False where a value is not finite
// (outputs partly written): the caller runs the torch code.
bool encode_fp8(torch::Tensor w, int64_t bn, int64_t bk, bool ue8m0, torch::Tensor codes, torch::Tensor scales,
                int64_t nthreads) {
    TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && bn > 0 && bk > 0, "encode_fp8: w [N, K], unit stride in K");
    const int64_t N = w.size(0), K = w.size(1), nb = (N + bn - 1) / bn, kb = (K + bk - 1) / bk;
    TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8 && codes.size(0) == N &&
                    codes.size(1) == K && scales.is_contiguous() && scales.size(0) == nb && scales.size(1) == kb &&
                    scales.scalar_type() == (ue8m0 ? torch::kUInt8 : torch::kFloat32),
                "encode_fp8: codes [N, K] uint8, scales [nb, kb] (fp32, or uint8 with ue8m0), contiguous");
    const int t = ty_of(w);
    const char* wp = static_cast<const char*>(w.data_ptr());
    const int64_t ld = w.stride(0) * w.element_size();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    uint8_t* s8 = ue8m0 ? scales.data_ptr<uint8_t>() : nullptr;
    float* s32 = ue8m0 ? nullptr : scales.data_ptr<float>();
    int finite = 1;
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel num_threads((int)std::max<int64_t>(1, nthreads)) reduction(&& : finite)
    {
        std::vector<float> row(K), amax(kb), sc(kb);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t r0 = b * bn, r1 = std::min(N, r0 + bn);
            std::fill(amax.begin(), amax.end(), 0.f);
            bool ok = true;
            for (int64_t r = r0; r < r1 && ok; ++r) {  // the blocks' amax
                load_row(t, wp + r * ld, row.data(), K);
                for (int64_t c = 0; c < kb; ++c) ok = absmax_span(row.data(), c * bk, std::min(K, (c + 1) * bk), amax[c]) && ok;
            }
            if (!ok) {
                finite = 0;
                continue;
            }
            for (int64_t c = 0; c < kb; ++c) {
                if (ue8m0) {
                    const int e = e8m0_ceil(std::max(amax[c], 1e-4f) / 448.0f);
                    s8[b * kb + c] = (uint8_t)e;
                    sc[c] = std::ldexp(1.0f, e - 127);
                } else {
                    sc[c] = amax[c] > 0.f ? amax[c] / 448.0f : 1.0f;
                    s32[b * kb + c] = sc[c];
                }
            }
            for (int64_t r = r0; r < r1; ++r) {
                load_row(t, wp + r * ld, row.data(), K);
                for (int64_t c = 0; c < kb; ++c) e4m3_span(row.data(), sc[c], cp + r * K, c * bk, std::min(K, (c + 1) * bk));
            }
        }
    }
    return finite != 0;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// route's weights of its chosen experts, `scores.gather(1, chosen)`, normalised (`w / (w.sum(-1) + 1e-20)`)
// where asked and scaled, as loops with the ops' roundings to the scores' dtype (fp32 or bf16; the sum by
// torch_sum's path for rows shorter than its lanes, so k below `lanes`): five small ops that cost ~4 us each in a decode step (their
// code cold after a weight stream). Undefined where that does not apply (the caller runs the ops).
torch::Tensor route_weights(const torch::Tensor& scores, const torch::Tensor& chosen, bool normalize, double scale,
                            int64_t lanes) {
    const int64_t k = chosen.size(-1);
    const bool bf = scores.scalar_type() == torch::kBFloat16;
    if (!(bf || scores.scalar_type() == torch::kFloat32) || scores.dim() != 2 || !scores.is_contiguous() ||
        chosen.dim() != 2 || !chosen.is_contiguous() || chosen.scalar_type() != torch::kInt64 ||
        chosen.size(0) != scores.size(0) || k < 1 || k >= lanes || k > 16)
        return torch::Tensor();
    const int64_t N = scores.size(0), E = scores.size(1);
    const int64_t* cp = chosen.data_ptr<int64_t>();
    for (int64_t i = 0; i < N * k; ++i) TORCH_CHECK(cp[i] >= 0 && cp[i] < E, "route: an expert id out of range");
    auto w = at::empty({N, k}, scores.options());
    const auto rnd = [bf](float v) { return bf ? round_bf16(v) : v; };
    const float sc = (float)scale, tiny = (float)1e-20;
    for (int64_t t = 0; t < N; ++t) {
        float v[16];
        for (int64_t j = 0; j < k; ++j) {
            const int64_t e = t * E + cp[t * k + j];
            v[j] = bf ? bf16_bits_to_f32(reinterpret_cast<const uint16_t*>(scores.data_ptr())[e])
                      : scores.data_ptr<float>()[e];
        }
        if (normalize) {
            float sum[1];
            row_sum<1>(v, k, sum);  // torch_sum's path for rows shorter than its lanes
            const float d = rnd(rnd(sum[0]) + tiny);
            for (int64_t j = 0; j < k; ++j) v[j] = rnd(v[j] / d);
        }
        for (int64_t j = 0; j < k; ++j) v[j] = rnd(v[j] * sc);
        if (bf) store_row(BF16T, v, reinterpret_cast<uint16_t*>(w.data_ptr()) + t * k, k);
        else std::copy_n(v, k, w.data_ptr<float>() + t * k);
    }
    return w;
}

// layers/moe.py's routers without group limiting (score 0 softmax in the logits' dtype, 1 sigmoid in fp32,
// 2 sqrt(softplus)): the same torch ops in the same order, so the same bits (the weights' ops by
// route_weights where it applies: `lanes`, the fused norm's sum lanes, 0 for none); ids given (a hash
// layer's) are used as they are. Returns {weights, ids}.
std::vector<torch::Tensor> route(torch::Tensor logits, int64_t score, int64_t top_k, std::optional<torch::Tensor> bias,
                                 std::optional<torch::Tensor> ids, bool normalize, double scale, int64_t lanes) {
    torch::Tensor scores;
    if (score == 0) scores = logits.softmax(-1);
    else if (score == 1) scores = logits.to(torch::kFloat32).sigmoid();
    else scores = at::softplus(logits, 1, 20).sqrt();
    torch::Tensor chosen;
    if (ids) {
        chosen = *ids;
    } else {
        auto choice = !bias ? scores : score == 1 ? scores + bias->to(torch::kFloat32) : scores + *bias;
        chosen = std::get<1>(choice.topk(top_k, -1, true, false));
    }
    auto w = route_weights(scores, chosen, normalize, scale, lanes);
    if (w.defined()) return {w, chosen};
    w = scores.gather(1, chosen);
    if (normalize) w = w / (w.sum(-1, true) + 1e-20);
    return {w * scale, chosen};
}

// layers/moe.py's moe() for a few tokens in one call where its parts fuse (the Python between the router's
// product, the routing and the feed-forward block cost ~30-50 us a layer): the router's logits by the bf16
// kernel (router: its operand, `router_threads` threads, as layers/linear.py's linear runs it) or in fp32
// (router_f32: at::linear of x in fp32, as a router kept in fp32 is run), route() on them (hash_ids [N, k]: a
// hash layer's experts), then ffn_rows on its weights and ids. The same calls as the torch code makes, so
// the same bits. An empty list where ffn_rows does not apply (a repeated expert): the caller runs the torch
// code.
std::vector<torch::Tensor> moe_rows(torch::Tensor x, std::optional<Operand> router, std::optional<torch::Tensor> router_f32,
                                    int64_t router_threads, int64_t score, int64_t top_k, std::optional<torch::Tensor> bias,
                                    std::optional<torch::Tensor> hash_ids, bool normalize, double scale,
                                    std::optional<Operand> w_in, std::optional<Operand> w_out, std::optional<Operand> gate,
                                    std::optional<Operand> up, std::optional<Operand> down, std::optional<double> limit,
                                    bool relu2, std::vector<int64_t> threads, int64_t path, int64_t lanes) {
    TORCH_CHECK(router.has_value() != router_f32.has_value(), "moe_rows: one router, bf16 operand or fp32");
    const auto logits = router_f32 ? at::linear(x.to(torch::kFloat32), *router_f32)
                                   : operand_gemm(x, *router, std::nullopt, router_threads, path);
    const auto routed = route(logits, score, top_k, bias, hash_ids, normalize, scale, lanes);
    auto y = ffn_rows(x, routed[0], routed[1], w_in, w_out, gate, up, down, limit, relu2, threads, path);
    if (!y.defined()) return {};
    return {y};
}

// Whether every value of fp32 x (contiguous) is finite: the engine's check of a step's logits in one small loop
// (torch's sum over them, its code cold after the step's weight stream, took ~60 us in place for ~3 us of work).
// A value is finite unless its exponent bits are all ones; integer ops, so that the loop vectorises.
bool all_finite(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "all_finite: fp32, contiguous");
    const uint32_t* b = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
    const int64_t n = x.numel();
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= (b[i] & 0x7f800000u) == 0x7f800000u;
    return bad == 0;
}

// The index of each row's largest value of fp32 x [n, V] (contiguous), as torch's argmax on the CPU gives it: the
// first of equal largest values (-0.0 equal to 0.0), a NaN larger than any number (the first NaN). A row's
// largest value first (its order does not matter), then the first index holding it.
std::vector<int64_t> argmax_rows(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
                "argmax_rows: fp32 [n, V], contiguous");
    const int64_t n = x.size(0), V = x.size(1);
    std::vector<int64_t> out(n);
    for (int64_t r = 0; r < n; ++r) {
        const float* p = x.data_ptr<float>() + r * V;
        const uint32_t* b = reinterpret_cast<const uint32_t*>(p);
        uint32_t nan = 0;
        for (int64_t i = 0; i < V; ++i) nan |= (b[i] & 0x7fffffffu) > 0x7f800000u;
        int64_t best = 0;
        if (nan) {
            while ((b[best] & 0x7fffffffu) <= 0x7f800000u) ++best;
        } else {
            float m = p[0];
            int64_t i = 0;
#if defined(MOESAIC_AVX2)
            if (V >= 8) {
                __m256 mv = _mm256_loadu_ps(p);
                for (i = 8; i + 8 <= V; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + i));
                float lanes[8];
                _mm256_storeu_ps(lanes, mv);
                m = lanes[0];
                for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
            }
#endif
            for (; i < V; ++i) m = std::max(m, p[i]);
            while (p[best] != m) ++best;
        }
        out[r] = best;
    }
    return out;
}

// layers/dsa.py's attend_gathered for bf16 operands: the torch code's roundings (q_lat rounded to bf16; each
// score's dot rounded to bf16, then scaled in fp32; torch's own softmax over the selection's order, a row
// with nothing selected 0; the probabilities and o_lat rounded to bf16; the output rounded once), every
// product exact (bf16 x bf16 in fp32) and the sums in the kernels' order (dot_bf16 / axpy_bf16_many), not the
// matmuls': equal to rounding. W_k's product as q[h, d] times W's rows (axpy over dn rows of kvr), W_v's as
// dots with its rows: W is read as stored, where the torch code's small matmuls made fp32 copies of its
// slices at every call (~480 us a decode row on the GLM-5.3 benchmark model, one Zen 3 core).
// With `blocks`, latent is a page pool's view [num_blocks, block rows, kvr] read in place: row t of the
// sequence is row t % block rows of block blocks[t / block rows], rows 0..length - 1 (no gathered copy).
torch::Tensor dsa_gathered_bf16(torch::Tensor q, torch::Tensor latent, torch::Tensor w_kv_b, int64_t dv, double scale,
                                torch::Tensor selection, int64_t threads,
                                std::optional<std::vector<int64_t>> blocks, int64_t length) {
    const bool paged = blocks.has_value();
    TORCH_CHECK(latent.dim() == (paged ? 3 : 2) && latent.stride(-1) == 1, "dsa_gathered: latent's layout");
    const int64_t n = q.size(0), H = q.size(1), dn = q.size(2), kvr = latent.size(-1), W = selection.size(1);
    const int64_t ls = latent.stride(-2), wr = dn + dv, B = paged ? latent.size(1) : 1;
    const int64_t bs = paged ? latent.stride(0) : 0;
    const int64_t* bp = paged ? blocks->data() : nullptr;
    const int64_t T = paged ? length : latent.size(0);
    if (paged) {
        TORCH_CHECK((int64_t)blocks->size() * B >= T, "dsa_gathered: blocks for every row");
        for (int64_t b : *blocks) TORCH_CHECK(b >= 0 && b < latent.size(0), "dsa_gathered: a block id past the pool");
    }
    auto qf = q.to(torch::kFloat32).contiguous();
    auto sel = selection.contiguous();
    auto logits = at::empty({n, H, W}, q.options().dtype(torch::kFloat32));
    auto out = at::empty({n, H, dv}, q.options());
    const float* qp = qf.data_ptr<float>();
    const int64_t* sp = sel.data_ptr<int64_t>();
    const uint16_t* lat = reinterpret_cast<const uint16_t*>(latent.data_ptr());
    auto row_of = [&](int64_t t) { return paged ? lat + bp[t / B] * bs + (t % B) * ls : lat + t * ls; };
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w_kv_b.data_ptr());
    float* lg = logits.data_ptr<float>();
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float sc = (float)scale, ninf = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < n * W; ++e) TORCH_CHECK(sp[e] < T, "dsa_gathered: a selected row past the cache");
    // work items: a query's heads h0 .. h0 + g - 1 (g = 8, 4 or 1, as many items as threads allow), so that a
    // selected row's bf16 values are widened once for the item's heads (dot_bf16_group_row, axpy_bf16_group:
    // each head's sums as one head at a time makes them, the same bits)
    const int64_t g_most = n * (H / 8) >= threads ? 8 : n * (H / 4) >= threads ? 4 : 1;
    std::vector<std::array<int64_t, 3>> items;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h0 = 0; h0 < H;) {
            const int64_t g = H - h0 >= g_most ? g_most : 1;
            items.push_back({i, h0, g});
            h0 += g;
        }
    const int64_t n_items = (int64_t)items.size();
    const auto row_of_sel = [&](int64_t i) {
        return [&, i](int64_t e) -> const uint16_t* { const int64_t t = sp[i * W + e]; return t < 0 ? nullptr : row_of(t); };
    };
    rows_on(n_items, threads, 8 * kvr, 4, [&](int64_t it, float* ql) {
        const int64_t i = items[it][0], h0 = items[it][1], g = items[it][2];
        {
            ProductClock clock;
            for (int64_t hh = 0; hh < g; ++hh) {
                // the next head's W_k rows (W_v's of the first head after the last) on their way while this head's
                // are used: one head's rows are too few for the hardware prefetcher to reach memory's rate
                const int64_t nxt = hh + 1 < g ? (h0 + hh + 1) * wr : h0 * wr + dn;
                prefetch_lines(wp + nxt * kvr, dn * kvr * 2);
                float* q = ql + hh * kvr;
                std::fill(q, q + kvr, 0.f);
                axpy_bf16_many(qp + (i * H + h0 + hh) * dn, wp + (h0 + hh) * wr * kvr, kvr, dn, q, kvr);
                for (int64_t c = 0; c < kvr; ++c) q[c] = round_bf16(q[c]);  // q_lat in bf16
            }
        }
        float* row = lg + (i * H + h0) * W;  // head h0 + hh's scores at row + hh * W
        for (int64_t e = 0; e < W; ++e) {
            const int64_t t = sp[i * W + e];
            if (t >= 0)
                with_value<8, 4, 1>(g, [&](auto G) {
                    dot_bf16_group_row<decltype(G)::value>(ql, kvr, row_of(t), kvr, row + e, W);
                });
            for (int64_t hh = 0; hh < g; ++hh) row[hh * W + e] = t < 0 ? ninf : round_bf16(row[hh * W + e]) * sc;
        }
    });
    auto p = at::softmax(logits, -1);
    const float* pp = p.data_ptr<float>();
    rows_on(n_items, threads, 8 * kvr + dv + 8 * W, 4, [&](int64_t it, float* buf) {
        float *ol = buf, *o = ol + 8 * kvr, *pr = o + dv;
        const int64_t i = items[it][0], h0 = items[it][1], g = items[it][2];
        for (int64_t e = 0; e < g * W; ++e) {
            const float pe = pp[(i * H + h0) * W + e];
            pr[e] = pe != pe ? 0.f : round_bf16(pe);  // nan_to_num: nothing selected
        }
        // o_lat: the selected rows' FMAs in order (a zero probability adds 0, as skipping it would, the rows
        // being finite), 64 rows at a time so that they stay in L1 while every block of o_lat passes over them
        std::fill(ol, ol + g * kvr, 0.f);
        const auto sel_row = row_of_sel(i);
        for (int64_t e0 = 0; e0 < W; e0 += 64) {
            const auto rows = [&](int64_t e) { return sel_row(e0 + e); };
            const int64_t me = std::min<int64_t>(64, W - e0);
            with_value<8, 4, 1>(g, [&](auto G) {
                axpy_bf16_group<decltype(G)::value>(pr + e0, W, rows, me, ol, kvr, kvr);
            });
        }
        ProductClock clock;
        for (int64_t hh = 0; hh < g; ++hh) {
            if (hh + 1 < g) prefetch_lines(wp + ((h0 + hh + 1) * wr + dn) * kvr, dv * kvr * 2);
            const int64_t ih = i * H + h0 + hh;
            float* oh = ol + hh * kvr;
            for (int64_t c = 0; c < kvr; ++c) oh[c] = round_bf16(oh[c]);  // o_lat in bf16
            dot_bf16_many(oh, wp + ((h0 + hh) * wr + dn) * kvr, kvr, kvr, dv, o);
            for (int64_t j = 0; j < dv; ++j) op[ih * dv + j] = f32_to_bf16_bits(o[j]);
        }
    });
    return out;
}

// layers/dsa.py's fused_block: a DSA module for rows whose sequences all attend to every cached token (contexts
// within index_topk: dsa.causal_selection's compact selections, which need no scores) over one pool's pages, in one
// call where Python made ~30 small calls and ops a layer: dsa_project (ops q_a, q_b, kv_a, the indexer's wk and
// gate, then o's; k_norm / k_bias given) or mla_project (q_a, q_b, kv_a, then o's: a layer that shares another's
// selection), the new latent (and indexer k, z) rows written to their pages (pools: latent[, k, z]; place: block
// and row of each query row), each sequence's selection (lens[s] rows, lengths[s] cached with them, kpool, tail:
// always_select_tail and kpool > 1), dsa_gathered_bf16 over its pages (attn_threads[s]) and o's product of the
// [n, H * dv] output. The calls the Python code makes, in its order, with its thread counts: the same bits.
torch::Tensor dsa_block(torch::Tensor x, std::vector<Operand> ops, std::vector<int64_t> threads,
                        std::vector<torch::Tensor> norms, double eps, int64_t kvr, int64_t lanes, int64_t path,
                        std::optional<torch::Tensor> k_norm, std::optional<torch::Tensor> k_bias, double k_eps,
                        int64_t H, int64_t dv, torch::Tensor w_kv_b, double scale, std::vector<torch::Tensor> pools,
                        std::vector<int64_t> place, std::vector<int64_t> lens, std::vector<std::vector<int64_t>> blocks,
                        std::vector<int64_t> lengths, int64_t kpool, bool tail, std::vector<int64_t> attn_threads) {
    const bool indexed = k_norm.has_value();
    TORCH_CHECK(ops.size() == (indexed ? 6u : 4u) && threads.size() == ops.size() && pools.size() == (indexed ? 3u : 1u),
                "dsa_block: (q_a, q_b, kv_a[, wk, gate], o) and the pools of their rows");
    TORCH_CHECK(lens.size() == blocks.size() && lens.size() == lengths.size() && lens.size() == attn_threads.size() &&
                    kpool > 0, "dsa_block: rows, blocks, lengths and threads for each sequence");
    const Operand o = ops.back();
    const int64_t o_threads = threads.back();
    ops.pop_back(), threads.pop_back();
    std::vector<torch::Tensor> proj;
    {
        ProductClock clock;  // (the projections and o's product: a benchmark's count of a step's products)
        proj = indexed ? dsa_project(x, ops, threads, norms, eps, kvr, lanes, path, *k_norm, *k_bias, k_eps)
                       : mla_project(x, ops, threads, norms, eps, kvr, lanes, path);
    }
    const int64_t n = x.size(0);
    const auto q = proj[0].view({n, H, -1});
    write_pages(pools[0], proj[2], place);
    if (indexed) write_pages(pools[1], proj[4], place), write_pages(pools[2], proj[5], place);
    std::vector<torch::Tensor> outs;
    int64_t at = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
        const int64_t m = lens[s], T = lengths[s], full = T / kpool * kpool;
        TORCH_CHECK(m > 0 && m <= T && at + m <= n, "dsa_block: a sequence's rows within x and its cache");
        // causal_selection(newest=True), compact: row i's tokens 0 .. end - 1 in order, -1 after
        const int64_t width = std::max<int64_t>(1, full + (tail ? kpool - 1 : 0));
        auto sel = at::empty({m, width}, torch::kInt64);
        int64_t* sp = sel.data_ptr<int64_t>();
        for (int64_t i = 0; i < m; ++i) {
            const int64_t end = tail ? T - m + 1 + i : (T - m + 1 + i) / kpool * kpool;
            for (int64_t j = 0; j < width; ++j) sp[i * width + j] = j < end ? j : -1;
        }
        outs.push_back(dsa_gathered_bf16(q.slice(0, at, at + m), pools[0], w_kv_b, dv, scale, sel, attn_threads[s],
                                         blocks[s], T));
        at += m;
    }
    TORCH_CHECK(at == n, "dsa_block: every row in a sequence");
    const auto out = outs.size() == 1 ? outs[0] : at::cat(outs);
    ProductClock clock;
    return operand_gemm(out.flatten(1), o, std::nullopt, o_threads, path);
}

// layers/dsa.py's attend_gathered (each query over its selected latents, W_k absorbed into the query, W_v
// after): the same torch ops in the same order, layers/linear.py's matmul rule (`small`: half-precision
// operands of at most that many elements multiply in fp32, rounded once) included, so the same bits.
torch::Tensor dsa_gathered(torch::Tensor q, torch::Tensor latent, torch::Tensor w_kv_b, int64_t dv, double scale,
                           torch::Tensor selection, int64_t block_elems, int64_t small) {
    const auto f32 = torch::kFloat32;
    auto mm = [&](const torch::Tensor& a, const torch::Tensor& b) {
        const bool half = a.scalar_type() == torch::kBFloat16 || a.scalar_type() == torch::kHalf;
        if (half && a.numel() + b.numel() <= small) return at::matmul(a.to(f32), b.to(f32)).to(a.scalar_type());
        return at::matmul(a, b);
    };
    const int64_t n = q.size(0), H = q.size(1), dn = q.size(2), kvr = latent.size(1);
    auto w = w_kv_b.view({H, dn + dv, kvr});
    auto q_lat = mm(q.transpose(0, 1), w.slice(1, 0, dn)).transpose(0, 1);  // [n, H, kvr]
    auto o_lat = q_lat.new_empty({n, H, kvr});
    const int64_t step = std::max<int64_t>(1, block_elems / std::max<int64_t>(1, selection.size(1) * kvr));
    for (int64_t a = 0; a < n; a += step) {
        const int64_t b = std::min(n, a + step);
        auto sel = selection.slice(0, a, b);
        auto valid = sel >= 0;
        auto lat = latent.index({sel.clamp_min(0)});  // [b, W, kvr]
        auto sc = mm(q_lat.slice(0, a, b), lat.transpose(1, 2)).to(f32) * scale;  // [b, H, W]
        sc = sc.masked_fill(valid.unsqueeze(1).bitwise_not(), -INFINITY);
        auto p = at::softmax(sc, -1).nan_to_num(0.0).to(latent.scalar_type());
        o_lat.slice(0, a, b).copy_(mm(p, lat));
    }
    return mm(o_lat.transpose(0, 1), w.slice(1, dn, dn + dv).transpose(1, 2)).transpose(0, 1);  // [n, H, dv]
}

// layers/csa.py's sink_attention for bf16 queries, window keys and compressed entries, the torch code's
// blocks of `step` queries: each block's logits laid out as the torch code lays them (window keys lo.., then
// the entries, then the sink; masked ones -inf), with its roundings (a score's fp32 dot rounded to bf16,
// times the scale and rounded again; the row's max subtracted), then torch's own softmax over them (its exp
// and its sum decide the bits), the probabilities rounded to bf16 and the value sums in fp32, rounded once
// (on CSA layers two sums, the window's and the picked entries', added in bf16). The dots and value sums
// add in 16 lanes, not in torch's matmul order: equal to rounding. What a decode row paid was ~25 small
// torch ops (330-500 us a layer on the DeepSeek-V4 benchmark model, one Zen 3 core) for ~80k MACs.
torch::Tensor sink_attend(torch::Tensor q, torch::Tensor positions, int64_t first, torch::Tensor win,
                          int64_t win_start, int64_t window, torch::Tensor sink, double scale,
                          std::optional<torch::Tensor> comp, std::optional<torch::Tensor> comp_sel, int64_t comp_ratio,
                          int64_t step, int64_t threads) {
    const auto bf = torch::kBFloat16;
    TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == bf, "sink_attend: q [n, H, D] bf16");
    const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
    TORCH_CHECK(win.dim() == 2 && win.size(1) == D && win.stride(1) == 1 && win.scalar_type() == bf,
                "sink_attend: win [L, D] bf16, rows contiguous");
    TORCH_CHECK(positions.is_contiguous() && positions.numel() == n && positions.scalar_type() == torch::kInt64,
                "sink_attend: positions [n] int64");
    TORCH_CHECK(sink.numel() == H && step >= 1, "sink_attend: sink [H]");
    const bool csa = comp.has_value() && comp_sel.has_value(), hca = comp.has_value() && !comp_sel.has_value();
    if (comp) {
        TORCH_CHECK(comp->dim() == 2 && comp->size(1) == D && comp->stride(1) == 1 && comp->scalar_type() == bf,
                    "sink_attend: comp [E, D] bf16, rows contiguous");
        TORCH_CHECK(hca ? comp_ratio >= 1 : comp_sel->dim() == 2 && comp_sel->size(0) == n && comp_sel->is_contiguous() &&
                                                 comp_sel->scalar_type() == torch::kInt64,
                    "sink_attend: comp_sel [n, k] int64 (CSA) or comp_ratio >= 1 (HCA)");
    }
    const int64_t E = csa ? comp_sel->size(1) : hca ? comp->size(0) : 0;
    auto sinks = sink.to(torch::kFloat32).contiguous();
    auto qf = q.to(torch::kFloat32);
    auto out = at::empty_like(q);
    const float* sk = sinks.data_ptr<float>();
    const float* qp = qf.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* sel = csa ? comp_sel->data_ptr<int64_t>() : nullptr;
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(win.data_ptr());
    const uint16_t* cp = comp ? reinterpret_cast<const uint16_t*>(comp->data_ptr()) : nullptr;
    const int64_t ws = win.stride(0), cs = comp ? comp->stride(0) : 0, E0 = comp ? comp->size(0) : 0;
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float sc = (float)scale, ninf = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; csa && e < n * E; ++e)  // checked here: a throw inside the threads' loop would abort
        TORCH_CHECK(sel[e] < E0, "sink_attend: a selected entry past the compressed rows");
    for (int64_t a = 0; a < n; a += step) {
        const int64_t b = std::min(n, a + step), bn = b - a;
        const int64_t lo = std::max(win_start, first + a - window + 1), L = first + b - lo;
        TORCH_CHECK(lo >= win_start && first + b - win_start <= win.size(0), "sink_attend: the window's rows");
        const int64_t Wd = L + E + 1;
        auto logits = at::empty({bn, H, Wd}, q.options().dtype(torch::kFloat32));
        float* lg = logits.data_ptr<float>();
        rows_on(bn * H, threads, 0, 0, [&](int64_t ih, float*) {
            const int64_t i = ih / H, h = ih % H, t = pos[a + i];
            const float* qh = qp + ((a + i) * H + h) * D;
            float* row = lg + ih * Wd;
            dot_bf16_many(qh, wp + (lo - win_start) * ws, ws, D, L, row);  // window keys lo ..
            for (int64_t l = 0; l < L; ++l) {
                const int64_t kp = lo + l;
                row[l] = kp > t || kp <= t - window ? ninf : round_bf16(round_bf16(row[l]) * sc);
            }
            if (hca) dot_bf16_many(qh, cp, cs, D, E, row + L);
            for (int64_t e = 0; e < E; ++e) {
                const int64_t c = csa ? sel[(a + i) * E + e] : e;
                const bool hidden = csa ? c < 0 : e >= (t + 1) / comp_ratio;
                const float dot = hidden ? 0.f : csa ? dot_bf16(qh, cp + c * cs, D) : row[L + e];
                row[L + e] = hidden ? ninf : round_bf16(round_bf16(dot) * sc);
            }
            row[L + E] = sk[h];
            float m = row[0];
            for (int64_t x = 1; x < Wd; ++x) m = std::max(m, row[x]);
            for (int64_t x = 0; x < Wd; ++x) row[x] = row[x] - m;
        });
        auto p = at::softmax(logits, -1);
        const float* pp = p.data_ptr<float>();
        rows_on(bn * H, threads, L + E + 2 * D, 4, [&](int64_t ih, float* buf) {
            float *pr = buf, *acc = buf + L + E, *acc2 = acc + D;
            const int64_t i = ih / H;
            const float* prow = pp + ih * Wd;
            for (int64_t x = 0; x < L + E; ++x) pr[x] = round_bf16(prow[x]);  // p.to(bf16)
            std::fill(acc, acc + D, 0.f);
            axpy_bf16_many(pr, wp + (lo - win_start) * ws, ws, L, acc, D);
            if (csa) {  // matmul(p[.., :L], keys) + matmul(p[.., L:], picked): each rounded, added in bf16
                std::fill(acc2, acc2 + D, 0.f);
                for (int64_t e = 0; e < E; ++e)
                    if (pr[L + e] != 0.f)
                        axpy_bf16_many(&pr[L + e], cp + sel[(a + i) * E + e] * cs, cs, 1, acc2, D);
                for (int64_t j = 0; j < D; ++j) acc[j] = round_bf16(acc[j]) + round_bf16(acc2[j]);
            } else if (hca) {
                axpy_bf16_many(pr + L, cp, cs, E, acc, D);
            }
            uint16_t* o = op + ((a + i) * H + ih % H) * D;
            for (int64_t j = 0; j < D; ++j) o[j] = f32_to_bf16_bits(acc[j]);
        });
    }
    return out;
}

#if defined(MOESAIC_AVX512BF16)
namespace {
// One query's heads h0 .. h0 + QB of sink_prompt: their logits over the Lw window keys from Kw (pair-packed, row
// stride Ts) and the Ev entries from Ke (stride Es; live: which count, CSA's picks of -1 not), the softmax with the
// sink's logits, the value sums over Vw / Ve (value pairs, Vc a pair row) into out (row stride D). wodd: whether
// the window starts at the second key of Vw's first pair. S, Pw and Pe: scratch of QB rows each. With `picks`
// (CSA's distinct picks, each below R): Ke / Ve hold every entry, whose first R logits are taken and the picks'
// read from them, and the picks' probabilities placed at their entries for one value sum over the R (the same
// logits; the sum in entry order).
template <int QB>
void sink_heads(const uint16_t* qrows, int64_t D, const uint32_t* Kw, int64_t Ts, int64_t Lw, const uint32_t* Ke,
                int64_t Es, int64_t Ev, const __mmask16* live, const uint32_t* Vw, bool wodd, const uint32_t* Ve,
                int64_t Vc, const float* sinks, float scale, bool csa, float* S, int64_t Sw, uint32_t* Pw,
                int64_t Pws, uint32_t* Pe, int64_t Pes, uint32_t* qp, uint16_t* out, const int64_t* picks, int64_t R) {
    const int64_t P2 = D / 2;
    for (int r = 0; r < QB; ++r) std::memcpy(qp + r * P2, qrows + r * D, 2 * D);
    __m512 acc[QB][4], acc2[QB][4];
    // the logits, 64 keys a pass: the window keys' at S's rows, the entries' after them (stored after the window's:
    // its last pass's lanes past Lw are overwritten)
    const auto logits = [&](const uint32_t* K, int64_t ks, int64_t count, int64_t at) {
        for (int64_t c = 0; c < count; c += 64) {
            const int nv = (int)std::min<int64_t>(4, (count - c + 15) / 16);
            pair_block<QB>(qp, P2, K + c, ks, P2, nv, acc);
            for (int r = 0; r < QB; ++r)
                for (int j = 0; j < nv; ++j) _mm512_storeu_ps(S + r * Sw + at + c + 16 * j, acc[r][j]);
        }
    };
    logits(Kw, Ts, Lw, 0);
    const int64_t Rat = Lw + Ev + 16;  // (picks: the R entries' logits, after the picks')
    if (picks) {
        logits(Ke, Es, R, Rat);
        for (int r = 0; r < QB; ++r)
            for (int64_t e = 0; e < Ev; ++e) S[r * Sw + Lw + e] = picks[e] < 0 ? 0.f : S[r * Sw + Rat + picks[e]];
    } else {
        logits(Ke, Es, Ev, Lw);
    }
    const __m512 sc = _mm512_set1_ps(scale);
    const int64_t npw = ((int64_t)wodd + Lw + 1) / 2, npe = picks ? (R + 1) / 2 : (Ev + 1) / 2;
    for (int r = 0; r < QB; ++r) {  // the softmax, the sink's logit in its max and sum
        float* s = S + r * Sw;
        // the 16 logits from x: window keys (x < Lw) or entries, never both (a window's last vector stops at Lw,
        // the entries' first starts there); `span` its lanes, `mask` those that count (CSA: not a -1 pick)
        const auto span = [&](int64_t x) { return x < Lw ? first_lanes(Lw - x) : first_lanes(Ev - (x - Lw)); };
        const auto mask = [&](int64_t x) {
            return x < Lw || !csa ? span(x) : (__mmask16)(span(x) & live[(x - Lw) / 16]);
        };
        const auto next = [&](int64_t x) { return x < Lw && x + 16 > Lw ? Lw : x + 16; };
        __m512 mx = _mm512_set1_ps(sinks[r]);
        for (int64_t x = 0; x < Lw + Ev; x = next(x)) {
            // the torch code's bf16 logits: the dot rounded, times the scale rounded
            const __m512 v = f32_of(bf16_of(_mm512_mul_ps(f32_of(bf16_of(_mm512_loadu_ps(s + x))), sc)));
            _mm512_mask_storeu_ps(s + x, span(x), v);
            mx = _mm512_mask_max_ps(mx, mask(x), mx, v);
        }
        const float top = _mm512_reduce_max_ps(mx);
        const __m512 mv = _mm512_set1_ps(top);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t x = 0; x < Lw + Ev; x = next(x)) {
            const __m512 e = _mm512_maskz_mov_ps(mask(x), exp_le0(_mm512_sub_ps(_mm512_loadu_ps(s + x), mv)));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(s + x, span(x), e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / (_mm512_reduce_add_ps(sum) + std::exp(sinks[r] - top)));
        uint32_t *pw = Pw + r * Pws, *pe = Pe + r * Pes;
        std::memset(pw, 0, 4 * npw), std::memset(pe, 0, 4 * npe);
        for (int64_t x = 0; x < Lw + Ev; x = next(x)) {  // p = bf16(e / sum), pairs of keys from Vw's / Ve's first
            const __mmask16 m = mask(x);
            const __m256i p = bf16_of(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + x), inv));
            if (x < Lw) _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(pw) + wodd + x, m, p);
            else if (picks) _mm512_mask_storeu_ps(s + x, m, f32_of(p));  // placed below
            else _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(pe) + (x - Lw), m, p);
        }
        for (int64_t e = 0; picks && e < Ev; ++e)  // (exact: p is a bf16 value)
            if (picks[e] >= 0) reinterpret_cast<uint16_t*>(pe)[picks[e]] = f32_to_bf16_bits(s[Lw + e]);
    }
    for (int64_t g = 0; g < Vc; g += 64) {  // the value sums, 64 values x QB rows a pass
        const int nv = (int)std::min<int64_t>(4, (Vc - g) / 16);
        pair_block<QB>(Pw, Pws, Vw + g, Vc, npw, nv, acc);
        if (Ev) pair_block<QB>(Pe, Pes, Ve + g, Vc, npe, nv, acc2);
        for (int r = 0; r < QB; ++r)
            for (int j = 0; j < nv && g + 16 * j < D; ++j) {
                __m512 o = acc[r][j];
                // CSA: two bf16 products added in bf16; HCA: one product over the window and the entries
                if (Ev) o = csa ? _mm512_add_ps(f32_of(bf16_of(o)), f32_of(bf16_of(acc2[r][j]))) : _mm512_add_ps(o, acc2[r][j]);
                _mm256_mask_storeu_epi16(out + r * D + g + 16 * j, first_lanes(D - g - 16 * j), bf16_of(o));
            }
    }
}
}  // namespace

// layers/csa.py's sink_attention for a prompt's n queries (positions first ..), bf16, by vdpbf16ps: the window's
// keys and values pair-packed once for the prompt (HCA's entries too, CSA's picks for each query), each query's
// heads 4 rows a pass; the torch code's logits (the dot rounded to bf16, times the scale rounded again), the softmax
// in fp32 with the sink's logit in its max and sum (e^x by exp_le0), the probabilities normalised and rounded to
// bf16, the value sums in fp32 and rounded once (CSA: the window's and the picks' each rounded, added in bf16).
// Equal to the torch code to rounding (its blocks of queries change nothing here). Threads over queries.
torch::Tensor sink_prompt(torch::Tensor q, int64_t first, torch::Tensor win, int64_t win_start, int64_t window,
                          torch::Tensor sink, double scale, std::optional<torch::Tensor> comp,
                          std::optional<torch::Tensor> comp_sel, int64_t comp_ratio, int64_t nthreads) {
    const auto bf = torch::kBFloat16;
    TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == bf && q.size(2) % 2 == 0,
                "sink_prompt: q [n, H, D] bf16, D even");
    const int64_t n = q.size(0), H = q.size(1), D = q.size(2), P2 = D / 2, Vc = (D + 31) / 32 * 32;
    TORCH_CHECK(win.dim() == 2 && win.size(1) == D && win.stride(1) == 1 && win.scalar_type() == bf &&
                    win.stride(0) * win.size(0) < (1LL << 30),
                "sink_prompt: win [L, D] bf16, rows contiguous");
    TORCH_CHECK(sink.numel() == H && window >= 1 && first >= win_start && first + n - win_start <= win.size(0),
                "sink_prompt: sink [H], the window's rows");
    const bool csa = comp.has_value() && comp_sel.has_value(), hca = comp.has_value() && !comp_sel.has_value();
    int64_t E0 = 0, cs = 0, k = 0;
    const int64_t* sel = nullptr;
    if (comp) {
        TORCH_CHECK(comp->dim() == 2 && comp->size(1) == D && comp->stride(1) == 1 && comp->scalar_type() == bf &&
                        comp->stride(0) * comp->size(0) < (1LL << 30),
                    "sink_prompt: comp [E, D] bf16, rows contiguous");
        E0 = comp->size(0), cs = comp->stride(0);
        TORCH_CHECK(hca ? comp_ratio >= 1 : comp_sel->dim() == 2 && comp_sel->size(0) == n && comp_sel->is_contiguous() &&
                                                 comp_sel->scalar_type() == torch::kInt64,
                    "sink_prompt: comp_sel [n, k] int64 (CSA) or comp_ratio >= 1 (HCA)");
        if (csa) {
            k = comp_sel->size(1), sel = comp_sel->data_ptr<int64_t>();
            for (int64_t e = 0; e < n * k; ++e)  // checked here: a throw inside the threads' loop would abort
                TORCH_CHECK(sel[e] < E0, "sink_prompt: a selected entry past the compressed rows");
        }
    }
    const auto sinks = sink.to(torch::kFloat32).contiguous();
    const float* sk = sinks.data_ptr<float>();
    const auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
    const uint16_t *qp0 = u16(q), *wp = u16(win), *cp = comp ? u16(*comp) : nullptr;
    const int64_t ws = win.stride(0);
    // the window keys the prompt reads: positions lo0 .. first + n - 1, key x at position lo0 + x; Vw's pairs from
    // an even x
    const int64_t lo0 = std::max(win_start, first - window + 1), T = first + n - lo0, Tp = (T + 15) / 16 * 16 + 16;
    const int64_t Ts = Tp + 16;
    std::vector<uint32_t> Kw(P2 * Ts), Vw(Tp / 2 * Vc);
    const auto win_row = [&](int64_t x) { return (lo0 - win_start + x) * ws; };
    pack_key_pairs(wp, win_row, T, Tp, P2, Kw.data(), Ts);
    pack_value_pairs(wp, win_row, T, Tp, D, Vw.data(), Vc);
    // the entries packed once (HCA's, and CSA's for queries whose picks all lie within the first 2k: their
    // logits and value sums over those entries cost less than packing the picks)
    const int64_t Ek = csa ? k : hca ? E0 : 0, Ep = (Ek + 15) / 16 * 16 + 16, Es = Ep + 16;
    const int64_t Ea = hca ? E0 : csa ? std::min(E0, 2 * k) : 0, Eap = (Ea + 15) / 16 * 16 + 16, Eas = Eap + 16;
    std::vector<uint32_t> Ke, Ve;
    const auto comp_row = [&](int64_t e) { return e * cs; };
    if (Ea) {
        Ke.resize(P2 * Eas), Ve.resize(Eap / 2 * Vc);
        pack_key_pairs(cp, comp_row, Ea, Eap, P2, Ke.data(), Eas);
        pack_value_pairs(cp, comp_row, Ea, Eap, D, Ve.data(), Vc);
    }
    auto out = at::empty_like(q);
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const int64_t Sw = std::min(window, T) + Ek + Ea + 96, Pws = (std::min(window, T) + 2) / 2 + 40;
    const int64_t Pes = std::max(Ep, Eap) / 2 + 40;
    over_heads(n, nthreads, [&](int64_t i0, int64_t i1) {
        std::vector<float> S(4 * Sw);
        std::vector<uint32_t> Pw(4 * Pws), Pe(4 * Pes), qp(4 * P2), Kq, Vq;
        std::vector<__mmask16> live(Ep / 16 + 1, (__mmask16)0xFFFF);
        std::vector<int64_t> seen(csa ? Ea : 0, -1);  // the query that last picked each of the first Ea entries
        if (csa) Kq.resize(P2 * Es), Vq.resize(Ep / 2 * Vc);
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t t = first + i, lo = std::max(win_start, t - window + 1), x0 = lo - lo0, Lw = t - lo + 1;
            int64_t Ev = 0, R = 0;
            const int64_t* si = csa ? sel + i * k : nullptr;
            bool dense = csa;  // (CSA) every pick distinct and below Ea
            for (int64_t e = 0; csa && e < k; ++e) {
                if (si[e] < 0) continue;
                dense = dense && si[e] < Ea && seen[si[e]] != i;
                if (!dense) break;
                seen[si[e]] = i, R = std::max(R, si[e] + 1);
            }
            if (csa && !dense) {  // this query's picks (-1: none) packed
                const auto pick = [&](int64_t e) { return si[e] < 0 ? -1 : si[e] * cs; };
                pack_key_pairs(cp, pick, k, Ep, P2, Kq.data(), Es);
                pack_value_pairs(cp, pick, k, Ep, D, Vq.data(), Vc);
            }
            if (csa) {
                for (int64_t e = 0; e < k; e += 16) {
                    __mmask16 m = 0;
                    for (int l = 0; l < 16 && e + l < k; ++l)
                        if (si[e + l] >= 0) m |= (__mmask16)(1u << l);
                    live[e / 16] = m;
                }
                Ev = k;
            } else if (hca) {
                Ev = std::min(E0, (t + 1) / comp_ratio);
            }
            const bool packed = csa && !dense;
            const uint32_t* Kqe = packed ? Kq.data() : Ke.data();
            const uint32_t* Vqe = packed ? Vq.data() : Ve.data();
            for (int64_t h0 = 0; h0 < H; h0 += 4)
                with_value<4, 3, 2, 1>(std::min<int64_t>(4, H - h0), [&](auto Q) {
                    sink_heads<decltype(Q)::value>(qp0 + (i * H + h0) * D, D, Kw.data() + x0, Ts, Lw, Kqe,
                                                   packed ? Es : Eas, Ev, live.data(), Vw.data() + x0 / 2 * Vc, x0 % 2,
                                                   Vqe, Vc, sk + h0, (float)scale, csa, S.data(), Sw, Pw.data(), Pws,
                                                   Pe.data(), Pes, qp.data(), op + (i * H + h0) * D,
                                                   dense ? si : nullptr, R);
                });
        }
    });
    return out;
}
#else
torch::Tensor sink_prompt(torch::Tensor q, int64_t, torch::Tensor, int64_t, int64_t, torch::Tensor, double,
                          std::optional<torch::Tensor>, std::optional<torch::Tensor>, int64_t, int64_t) {
    TORCH_CHECK(false, "sink_prompt: needs AVX-512 BF16 (cpu.has_bf16dp())");
    return q;
}
#endif

// models/deepseek_v4.py's attention after the layer input's products, for decode rows and verify blocks, in one
// call where Python made ~60 small calls and ops a layer: v4_inputs (qa, kv: views of the stacked product),
// each sequence's new rows written into its rings (writes: buffer, source 0 the roped kv / 1.. comp_rows[i - 1],
// the sequence, the first row; TailRows.claim made the room), the sink attention of each sequence (lens rows,
// firsts its past, its window the rows win_rows[2 s] .. win_rows[2 s + 1] - 1 of the buffer wins[s], positions
// from win_starts[s]; its compressed entries the first counts[s] rows of entries[s]: `mode` 1 CSA with the
// selection visible_entries makes (every entry e < (t + 1) / ratio), 2 HCA, 0 none; steps and attn_threads as
// cpu.sink_attention takes them), then v4_output. The calls the Python code makes, in its order:
// the same bits.
torch::Tensor v4_attention(torch::Tensor qa, torch::Tensor kv, Operand q_b, int64_t q_b_threads, torch::Tensor q_a_norm,
                           torch::Tensor kv_norm, double eps, int64_t norm_ty, int64_t lanes, int64_t path, int64_t H,
                           std::optional<torch::Tensor> ones, torch::Tensor cos, torch::Tensor sin, torch::Tensor nsin,
                           int64_t rope_threads, std::vector<torch::Tensor> comp_rows, std::vector<torch::Tensor> bufs,
                           std::vector<int64_t> srcs, std::vector<int64_t> seqs, std::vector<int64_t> ats,
                           torch::Tensor positions, std::vector<int64_t> lens, std::vector<int64_t> firsts,
                           std::vector<torch::Tensor> wins, std::vector<int64_t> win_rows, std::vector<int64_t> win_starts,
                           int64_t window, torch::Tensor sink, double scale, std::vector<torch::Tensor> entries,
                           std::vector<int64_t> counts, int64_t mode,
                           int64_t ratio, std::vector<int64_t> steps, std::vector<int64_t> attn_threads, Operand o_a,
                           int64_t a_threads, Operand o_b, int64_t b_threads) {
    const size_t S = lens.size();
    TORCH_CHECK(firsts.size() == S && wins.size() == S && win_rows.size() == 2 * S && win_starts.size() == S &&
                    steps.size() == S && attn_threads.size() == S &&
                    (mode == 0 ? entries.empty() : entries.size() == S && counts.size() == S),
                "v4_attention: one of each per sequence");
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "v4_attention: positions int64");
    TORCH_CHECK(bufs.size() == srcs.size() && srcs.size() == seqs.size() && seqs.size() == ats.size(),
                "v4_attention: one buffer, source, sequence and row per write");
    std::vector<torch::Tensor> in;
    {
        ProductClock clock;  // (v4_inputs and v4_output whole, as a benchmark counts their own calls)
        in = v4_inputs(qa, kv, q_b, q_b_threads, q_a_norm, kv_norm, eps, norm_ty, lanes, path, H, ones, cos, sin);
    }
    const auto &q = in[1], &k = in[2];
    std::vector<int64_t> row0(S + 1, 0);
    for (size_t s = 0; s < S; ++s) row0[s + 1] = row0[s] + lens[s];
    TORCH_CHECK(row0[S] == q.size(0) && positions.numel() == q.size(0), "v4_attention: every row in a sequence");
    for (size_t i = 0; i < bufs.size(); ++i) {  // TailRows.append's writes, each [at, at + n) of its buffer
        TORCH_CHECK(srcs[i] >= 0 && srcs[i] <= (int64_t)comp_rows.size() && seqs[i] >= 0 && seqs[i] < (int64_t)S,
                    "v4_attention: a write's source and sequence");
        const auto& src = srcs[i] == 0 ? k : comp_rows[srcs[i] - 1];
        const int64_t s = seqs[i];
        TORCH_CHECK(write_rows({bufs[i]}, ats[i], {src.slice(0, row0[s], row0[s + 1])}), "v4_attention: a ring's rows");
    }
    std::vector<torch::Tensor> outs;
    for (size_t s = 0; s < S; ++s) {
        const int64_t n = lens[s];
        const auto pos = positions.slice(0, row0[s], row0[s + 1]);
        std::optional<torch::Tensor> comp, sel;
        if (mode != 0) comp = entries[s].slice(0, 0, counts[s]);
        if (mode == 1) {  // visible_entries: entry e for query t where e < (t + 1) / ratio, else -1
            const int64_t E = counts[s];
            sel = at::empty({n, E}, torch::kInt64);
            const int64_t* pp = pos.data_ptr<int64_t>();
            int64_t* sp = sel->data_ptr<int64_t>();
            for (int64_t i = 0; i < n; ++i)
                for (int64_t e = 0; e < E; ++e) sp[i * E + e] = e < (pp[i] + 1) / ratio ? e : -1;
        }
        const auto win = wins[s].slice(0, win_rows[2 * s], win_rows[2 * s + 1]);
        outs.push_back(sink_attend(q.slice(0, row0[s], row0[s + 1]), pos, firsts[s], win, win_starts[s], window, sink,
                                   scale, comp, sel, ratio, steps[s], attn_threads[s]));
    }
    const auto o = S == 1 ? outs[0] : at::cat(outs);
    ProductClock clock;
    return v4_output(o, cos, nsin, rope_threads, o_a, a_threads, o_b, b_threads, path);
}

// layers/csa.py's compressor_update where windows close, after its raw rows are appended: pool_windows over the
// whole windows kv / gate [W m, proj_width] (overlap and has_prev as it takes them; ape [m, proj_width] fp32),
// the entry norm (rms_norm_cast_once: norm [C], eps, norm_threads) and the rotation of entries E0 .. E0 + W' - 1
// at their first tokens e m (cos_sin of `freqs` times `factor` unless 1, rope_pairs on the last 2 freqs.size(0)
// channels, rope_threads) by the same torch ops and kernels in the same order: the same bits, without ~25 calls
// from Python. {latent, the rotated entries}.
std::vector<torch::Tensor> compress_rows(torch::Tensor kv, torch::Tensor gate, torch::Tensor ape, int64_t m, int64_t C,
                                         bool overlap, bool has_prev, torch::Tensor norm, double eps, int64_t lanes,
                                         int64_t norm_threads, torch::Tensor freqs, double factor, int64_t E0,
                                         int64_t rope_threads) {
    TORCH_CHECK(m > 0 && kv.dim() == 2 && kv.size(0) % m == 0 && gate.sizes() == kv.sizes() &&
                    kv.size(1) == (overlap ? 2 : 1) * C, "compress_rows: kv / gate [W m, proj_width]");
    const int64_t W = kv.size(0) / m;
    const auto k = kv.view({W, m, -1});
    const auto g = gate.view({W, m, -1}) + ape;  // fp32 once ape is
    torch::Tensor pooled;
    if (!overlap) {
        pooled = (k * g.softmax(1, torch::kFloat32).to(k.scalar_type())).sum(1);
    } else {
        const int64_t G = has_prev ? W - 1 : W;
        auto sk = at::zeros({G, 2 * m, C}, k.options());
        auto sg = at::full({G, 2 * m, C}, -std::numeric_limits<double>::infinity(), g.options());  // no predecessor
        sk.slice(1, m).copy_(k.slice(0, W - G).slice(2, C));
        sg.slice(1, m).copy_(g.slice(0, W - G).slice(2, C));
        if (has_prev) {
            sk.slice(1, 0, m).copy_(k.slice(0, 0, G).slice(2, 0, C));
            sg.slice(1, 0, m).copy_(g.slice(0, 0, G).slice(2, 0, C));
        } else if (G > 1) {
            sk.slice(0, 1).slice(1, 0, m).copy_(k.slice(0, 0, G - 1).slice(2, 0, C));
            sg.slice(0, 1).slice(1, 0, m).copy_(g.slice(0, 0, G - 1).slice(2, 0, C));
        }
        pooled = (sk * sg.softmax(1, torch::kFloat32).to(sk.scalar_type())).sum(1);
    }
    const int64_t ty = ty_of(kv);
    const auto latent = rms_norm(pooled.to(kv.scalar_type()), norm, eps, 0, 0, ty, lanes, norm_threads, 0);
    const int64_t E = latent.size(0);
    const auto ang = (at::arange(E0, E0 + E, torch::kInt64) * m).to(torch::kFloat32).unsqueeze(1) * freqs.unsqueeze(0);
    auto cos = ang.cos(), sin = ang.sin();
    if (factor != 1.0) cos = cos * factor, sin = sin * factor;
    const auto turned = rope(latent.view({E, 1, C}), cos, sin, 2, rope_threads, C - 2 * freqs.size(0)).view({E, C});
    return {latent, turned};
}

bool has_amx() {
#if defined(MOESAIC_AMX)
    return amx_permitted();
#else
    return false;
#endif
}

bool has_bf16dp() {  // bf16 products by vdpbf16ps (run_item_dp: AVX-512 BF16 and VBMI)
#if defined(MOESAIC_AVX512BF16)
    return true;
#else
    return false;
#endif
}

bool has_avx2() {
#if defined(MOESAIC_AVX2)
    return true;
#else
    return false;
#endif
}

bool has_vnni512() {  // int8 activations by vpdpbusd (q8z_tile)
#if defined(MOESAIC_VNNI512)
    return true;
#else
    return false;
#endif
}
"""
