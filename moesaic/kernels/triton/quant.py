"""Packed-weight GEMMs in Triton, weights decoded in registers: x @ W.T for W in MXFP4, NVFP4, DeepSeek
fp4, FP8 with block scales (any block: 128x128, 32x32, per channel; fp32 or UE8M0 scales), FP8 per tensor,
or dense, and the grouped form the MoE block needs (rows grouped by expert + offsets, all experts of a
step in one launch). Same semantics as moesaic/weights/quant.py `QuantizedTensor.dequantize` / `matmul`
and moesaic/layers/moe.py `run_experts`; a weight is anything with QuantizedTensor's public attributes
(format, codes, scale, global_scale, global_divides, block, shape), a ConcatRows-like object with
`.parts`, or a dense tensor.

Decoding (layouts: weights/quant.py's docstring), exact, with integer ops and one fp16 bitcast:
  E2M1 code s|e1 e0|m  -> fp16 bits s<<15 | (e1 e0 m)<<9, times 2^14 (subnormal e = 0 included)
  E4M3 byte s|eeee|mmm -> fp16 bits s<<15 | (eeee mmm)<<7, times 2^8 (0x7F / 0xFF: NaN)
  E8M0 byte e          -> fp32 bits e<<23 (e = 0: 2^-127, e = 255: NaN)
The scale is applied in fp32 (NVFP4: the group scale divided / multiplied by the global scale first, as
both producers do), so the decoded weight is the reference's fp32 value bit for bit; it is rounded to
the activations' dtype for the tensor-core product, as the reference's dequantize(dtype) is.

Grouped GEMM: the host lays out tiles of BM rows, each inside one expert, from the offsets with device
ops only (no host sync; the grid is the upper bound ceil(M / BM) + min(E, M), spare programs exit), and
one program computes a [BM, BN] output tile over all of K. An expert's weights are read once per tile
of its rows: at decode (a few rows per expert) that is once, the bandwidth bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_device, mma, native_dot, num_sms, pow2

DENSE, MXFP4, NVFP4, FP8_BLOCK, FP8_TENSOR = 0, 1, 2, 3, 4
_FMT = {"mxfp4": MXFP4, "nvfp4": NVFP4, "fp8_block": FP8_BLOCK, "fp8_tensor": FP8_TENSOR}
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _e2m1(c):
    """4-bit E2M1 codes (int32, 0..15) -> fp32."""
    h = ((c & 8) << 12) | ((c & 7) << 9)
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e4m3(b):
    """E4M3 ("fn") bytes (int32, 0..255) -> fp32."""
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    v = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _e8m0(e):
    """E8M0 exponent bytes (int32, 0..255) -> fp32 2^(e-127)."""
    v = (e << 23).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, (e * 0 + 0x00400000).to(tl.float32, bitcast=True), v)
    return tl.where(e == 255, float("nan"), v)


@triton.jit
def _weight_tile(
    w, scale, gscale, e, rn, k0, N, K, s_we, s_wn, s_se, s_sn, bn, bk,
    FMT: tl.constexpr, E8M0: tl.constexpr, GDIV: tl.constexpr, GROUP: tl.constexpr, NKB: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """The weight tile W[e, rn, k0:k0+BK] decoded to fp32, [BN, BK]."""
    mn = rn < N
    wbase = w + e.to(tl.int64) * s_we
    sbase = scale + e.to(tl.int64) * s_se
    if FMT == 0:
        rk = k0 + tl.arange(0, BK)
        out = tl.load(
            wbase + rn[:, None] * s_wn + rk[None, :], mask=mn[:, None] & (rk < K)[None, :], other=0.0
        )
        out = out.to(tl.float32)
    elif FMT == 1 or FMT == 2:
        rc = k0 // 2 + tl.arange(0, BK // 2)
        c = tl.load(
            wbase + rn[:, None] * s_wn + rc[None, :], mask=mn[:, None] & (rc < K // 2)[None, :], other=0
        )
        c = c.to(tl.int32)
        vals = tl.reshape(tl.join(_e2m1(c & 15), _e2m1(c >> 4)), (BN, BK))  # low nibble = even element
        rg = k0 // GROUP + tl.arange(0, BK // GROUP)
        sb = tl.load(
            sbase + rn[:, None] * s_sn + rg[None, :], mask=mn[:, None] & (rg < K // GROUP)[None, :], other=0
        )
        sb = sb.to(tl.int32)
        if FMT == 1:
            s = _e8m0(sb)
        else:
            g = tl.load(gscale + e)
            if GDIV:
                s = tl.math.div_rn(_e4m3(sb), g)
            else:
                s = _e4m3(sb) * g
        out = tl.reshape(tl.reshape(vals, (BN, BK // GROUP, GROUP)) * s[:, :, None], (BN, BK))
    else:
        rk = k0 + tl.arange(0, BK)
        m2 = mn[:, None] & (rk < K)[None, :]
        q = _e4m3(tl.load(wbase + rn[:, None] * s_wn + rk[None, :], mask=m2, other=0).to(tl.int32))
        if FMT == 3 and NKB > 0:  # the tile spans NKB whole scale blocks: one scale per (row, block)
            kb = k0 // bk + tl.arange(0, NKB)
            sp = sbase + (rn // bn)[:, None] * s_sn + kb[None, :]
            ms = mn[:, None] & (kb * bk < K)[None, :]
            if E8M0:
                s = _e8m0(tl.load(sp, mask=ms, other=127).to(tl.int32))
            else:
                s = tl.load(sp, mask=ms, other=1.0).to(tl.float32)
            out = tl.reshape(tl.reshape(q, (BN, NKB, BK // NKB)) * s[:, :, None], (BN, BK))
        elif FMT == 3:  # any other block: one scale per element
            sp = sbase + (rn // bn)[:, None] * s_sn + (rk // bk)[None, :]
            if E8M0:
                s = _e8m0(tl.load(sp, mask=m2, other=127).to(tl.int32))
            else:
                s = tl.load(sp, mask=m2, other=1.0).to(tl.float32)
            out = q * s
        else:
            out = q * tl.load(sbase).to(tl.float32)
    return out


@triton.jit
def _gemm_kernel(
    x, out, w, scale, gscale, offsets, E, N, K, KS, s_xm, s_om, s_op, s_we, s_wn, s_se, s_sn,
    bn, bk,
    FMT: tl.constexpr, E8M0: tl.constexpr, GDIV: tl.constexpr, GROUP: tl.constexpr, NKB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NATIVE: tl.constexpr, TY: tl.constexpr,
    BE: tl.constexpr,
):  # fmt: skip
    """Tile program_id(0) of rows, columns block program_id(1), K slice program_id(2) (KS wide, whole BK
    steps): its partial sum goes to out + slice · s_op (one slice: the output itself).

    Row tiles are laid out from the experts' cumulative row ends `offsets` [E] here, in each program (BE >= E):
    expert e's rows take ceil(rows / BM) consecutive tiles, in expert order; a tile past the last exits. The
    layout costs a program one load of E ints, where computing it apart took ~25 small launches a call."""
    tile, nb, sl = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    re = tl.arange(0, BE)
    ends = tl.load(offsets + re, mask=re < E, other=0)
    starts = tl.load(offsets + re - 1, mask=(re >= 1) & (re < E), other=0)
    tiles = (ends - starts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    e = tl.sum((tile_end <= tile).to(tl.int32), 0)  # the first expert whose tiles reach past this one
    if e >= E:
        return
    mine = re == e
    r0 = tl.sum(tl.where(mine, starts + (tile - tile_end + tiles) * BM, 0), 0)
    r1 = tl.sum(tl.where(mine, ends, 0), 0)
    rm = r0 + tl.arange(0, BM)
    mm = rm < r1
    rn = nb * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(sl * KS, tl.minimum(sl * KS + KS, K), BK):
        rk = k0 + tl.arange(0, BK)
        xt = tl.load(
            x + rm[:, None].to(tl.int64) * s_xm + rk[None, :], mask=mm[:, None] & (rk < K)[None, :], other=0.0
        )
        wt = _weight_tile(
            w,
            scale,
            gscale,
            e,
            rn,
            k0,
            N,
            K,
            s_we,
            s_wn,
            s_se,
            s_sn,
            bn,
            bk,
            FMT,
            E8M0,
            GDIV,
            GROUP,
            NKB,
            BN,
            BK,
        )
        acc = mma(xt, tl.trans(wt), acc, NATIVE, TY)
    optr = out + sl.to(tl.int64) * s_op + rm[:, None].to(tl.int64) * s_om + rn[None, :]
    tl.store(optr, acc.to(out.dtype.element_ty), mask=mm[:, None] & (rn < N)[None, :])


@triton.jit
def _align_kernel(ids, pos, rows, offsets, NK, k, E, BNK: tl.constexpr, BJ: tl.constexpr, BE: tl.constexpr):
    """One program lays a decode step's routed slots out by expert (run_experts' sort, argsort, counts and
    cumulative sum in one launch): slot i (token i // k) of expert ids[i] goes to grouped row pos[i] = the
    slots of lower experts + the earlier slots of its own (a stable sort by expert, tokens in order);
    rows[pos[i]] = i // k, and offsets[e] = the slots of experts <= e."""
    i = tl.arange(0, BNK)
    mi = i < NK
    ei = tl.load(ids + i, mask=mi, other=0).to(tl.int32)
    rank = tl.zeros([BNK], dtype=tl.int32)
    for j0 in range(0, NK, BJ):
        j = j0 + tl.arange(0, BJ)
        ej = tl.load(ids + j, mask=j < NK, other=0).to(tl.int32)
        before = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((before & (j < NK)[None, :]).to(tl.int32), 1)
    tl.store(pos + i, rank, mask=mi)
    tl.store(rows + rank, i // k, mask=mi)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        held = ((ei[None, :] <= e[:, None]) & mi[None, :]).to(tl.int32)
        tl.store(offsets + e, tl.sum(held, 1), mask=e < E)


@triton.jit
def _combine_kernel(y, pos, ids, w, out, d, k, s_in, s_wn, s_on, ACC: tl.constexpr, KP: tl.constexpr,
                    BD: tl.constexpr):  # fmt: skip
    """Token program_id(0), columns block program_id(1): Σ y[pos[token, j]] · w[token, j] over its k slots in
    ascending expert id (ids [N, k]), each product and sum rounded to ACC as torch's `out += y_j * w_j` in
    ACC rounds them."""
    n, cb = tl.program_id(0), tl.program_id(1)
    cols = cb * BD + tl.arange(0, BD)
    m = cols < d
    slots = tl.arange(0, KP)
    mine = tl.load(ids + n.to(tl.int64) * s_in + slots, mask=slots < k, other=2**31 - 1).to(tl.int64)
    acc = tl.zeros([BD], dtype=tl.float32)
    last = tl.full([], -1, tl.int64)
    for _ in range(k):
        cur = tl.min(tl.where(mine > last, mine, 2**31 - 1), 0)  # the next expert id up
        j = tl.sum(tl.where(mine == cur, slots, 0), 0)
        row = tl.load(pos + n * k + j).to(tl.int64)
        yj = tl.load(y + row * d + cols, mask=m, other=0.0).to(tl.float32)
        wj = tl.load(w + n.to(tl.int64) * s_wn + j).to(tl.float32)
        acc = (acc + (yj * wj).to(ACC).to(tl.float32)).to(ACC).to(tl.float32)
        last = cur
    tl.store(out + n.to(tl.int64) * s_on + cols, acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _dequant_kernel(
    out, w, scale, gscale, N, K, s_oe, s_on, s_we, s_wn, s_se, s_sn, bn, bk,
    FMT: tl.constexpr, E8M0: tl.constexpr, GDIV: tl.constexpr, GROUP: tl.constexpr, NKB: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    e, nb, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = nb * BN + tl.arange(0, BN)
    rk = kb * BK + tl.arange(0, BK)
    wt = _weight_tile(
        w,
        scale,
        gscale,
        e,
        rn,
        kb * BK,
        N,
        K,
        s_we,
        s_wn,
        s_se,
        s_sn,
        bn,
        bk,
        FMT,
        E8M0,
        GDIV,
        GROUP,
        NKB,
        BN,
        BK,
    )
    optr = out + e.to(tl.int64) * s_oe + rn[:, None] * s_on + rk[None, :]
    tl.store(optr, wt.to(out.dtype.element_ty), mask=(rn < N)[:, None] & (rk < K)[None, :])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _operands(w):
    """(format id, codes [E, N, *], scale [E, ...], global scale [E], N, K, flags) of a weight seen as a
    stack of E matrices (E = 1 for a single one)."""
    if isinstance(w, torch.Tensor):
        lead = w.shape[:-2]
        codes = w.reshape(-1, *w.shape[-2:])
        codes = codes if codes.stride(-1) == 1 else codes.contiguous()
        return dict(fmt=DENSE, codes=codes, scale=codes, gscale=codes, N=w.shape[-2], K=w.shape[-1], lead=lead,
                    e8m0=False, gdiv=False, group=32, block=(1, 1))  # fmt: skip
    fmt = _FMT[w.format]
    N, K = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    codes = _bytes(w.codes.contiguous()).reshape(-1, *w.codes.shape[-2:])
    E = codes.shape[0]
    if fmt == FP8_TENSOR:
        scale = w.scale.float().reshape(E, 1, 1).contiguous()
    else:
        scale = w.scale.contiguous()
        scale = scale if scale.dtype.is_floating_point and scale.element_size() > 1 else _bytes(scale)
        scale = scale.reshape(E, *w.scale.shape[-2:])
    gscale = w.global_scale.float().reshape(E).contiguous() if w.global_scale is not None else scale
    return dict(
        fmt=fmt, codes=codes, scale=scale, gscale=gscale, N=N, K=K, lead=lead,
        e8m0=fmt == MXFP4 or (fmt == FP8_BLOCK and scale.dtype == torch.uint8), gdiv=bool(w.global_divides),
        group=32 if fmt == MXFP4 else 16, block=tuple(w.block) if w.block else (1, 1),
    )  # fmt: skip


def _scale_blocks(op, BK: int) -> int:
    """fp8 blocks: how many whole scale blocks a BK-wide tile spans (1 when the block is wider and a
    multiple of BK), or 0 when tiles straddle blocks (then one scale is read per element)."""
    bk = op["block"][1]
    if op["fmt"] != FP8_BLOCK:
        return 0
    if BK % bk == 0:
        return BK // bk
    return 1 if bk % BK == 0 else 0


def _strides(op):
    c, s = op["codes"], op["scale"]
    return c.stride(0), c.stride(1), s.stride(0), s.stride(1)


def dequantize(w, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight [..., N, K] in `dtype` (QuantizedTensor.dequantize)."""
    op = _operands(w)
    check_device(op["codes"])
    N, K = op["N"], op["K"]
    E = op["codes"].shape[0]
    out = torch.empty(E, N, K, dtype=dtype, device=op["codes"].device)
    BN, BK = 32, 128
    _dequant_kernel[(E, triton.cdiv(N, BN), triton.cdiv(K, BK))](
        out, op["codes"], op["scale"], op["gscale"], N, K, out.stride(0), out.stride(1), *_strides(op),
        op["block"][0], op["block"][1],
        FMT=op["fmt"], E8M0=op["e8m0"], GDIV=op["gdiv"], GROUP=op["group"], NKB=_scale_blocks(op, BK), BN=BN, BK=BK,
    )  # fmt: skip
    return out.view(*op["lead"], N, K)


def _layout(offsets: torch.Tensor, M: int, E: int, BM: int):
    """(offsets int32 [E], E, T): what `_gemm_kernel` lays its row tiles out from, and T, the row-tile programs
    to launch: an upper bound (each expert's last tile may be partial), the spare ones exit."""
    return offsets.to(torch.int32), E, triton.cdiv(M, BM) + min(E, M)


def _grouped(xs: torch.Tensor, offsets: torch.Tensor, op: dict, out_dtype, splits=None) -> torch.Tensor:
    check_device(xs, op["codes"])
    M, K = xs.shape
    N, E = op["N"], op["codes"].shape[0]
    if K != op["K"]:
        raise ValueError(f"matmul of x {list(xs.shape)} with a weight of {op['K']} inputs: last dims differ")
    out = torch.empty(M, N, dtype=out_dtype, device=xs.device)
    if M == 0:
        return out
    xs = xs if xs.stride(-1) == 1 else xs.contiguous()
    # tiles by rows per expert: decode streams K in wide steps. Free of register spills on sm_90 with
    # triton 3.9; with 3.6 (a device's image) the fp8 fp32-scale decode tile spills (docs/perf.md, GPU)
    per_expert = M / max(1, min(E, M))
    BM, BN, BK, warps = (16, 64, 128, 8) if per_expert <= 16 else (32, 128, 64, 8)
    if per_expert > 32:
        BM = 64
    layout = _layout(offsets.to(xs.device), M, E, BM)
    if splits is None:
        splits = _auto_splits(
            triton.cdiv(M, BM) if E == 1 else layout[2], triton.cdiv(N, BN), K, BK, xs.device
        )
    return _run(xs, op, layout, out, BM, BN, BK, warps, 3, splits)


def _auto_splits(row_tiles: int, col_tiles: int, K: int, BK: int, device) -> int:
    """K slices for a product whose output tiles are fewer than two per multiprocessor (a decode GEMV of one
    matrix): 4, where each slice still spans two BK steps. On an H200 (benchmarks/gpu_gemv.py, 2026-12-04,
    W [8192, 5120], 1 and 8 rows) 4 slices took fp8 62 -> 37 us, MXFP4 51 -> 33, NVFP4 63 -> 37, bf16 31 -> 29;
    a grouped MoE step has programs enough without."""
    if row_tiles * col_tiles >= 2 * num_sms(device) or K < 8 * BK:
        return 1
    return 4


def _run(
    xs, op: dict, layout, out, BM: int, BN: int, BK: int, warps: int, stages: int, splits=None, part=None
):
    """The product into out [M, N] at these tiles over `layout` (_layout's), K in `splits` slices whose fp32
    partial sums (part [>= S, M, N], made here when not given) are added after, in order: the same bits every
    run. Slices give more programs when the output tiles alone are fewer than the multiprocessors (a one-row
    product of one matrix): `_auto_splits` says when."""
    offsets, E, T = layout
    M, N, K = xs.shape[0], op["N"], op["K"]
    KS = triton.cdiv(triton.cdiv(K, splits or 1), BK) * BK
    S = triton.cdiv(K, KS)
    if S > 1 and part is None:
        part = torch.empty(S, M, N, dtype=torch.float32, device=xs.device)
    dst = out if S == 1 else part
    _gemm_kernel[(T, triton.cdiv(N, BN), S)](
        xs, dst, op["codes"], op["scale"], op["gscale"], offsets, E, N, K, KS, xs.stride(0),
        dst.stride(-2), M * N if S > 1 else 0, *_strides(op), op["block"][0], op["block"][1],
        FMT=op["fmt"], E8M0=op["e8m0"], GDIV=op["gdiv"], GROUP=op["group"], NKB=_scale_blocks(op, BK),
        BM=BM, BN=BN, BK=BK,
        NATIVE=native_dot(xs.dtype), TY=_TL[xs.dtype], BE=pow2(E), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out if S == 1 else out.copy_(part[:S].sum(0))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def grouped_matmul(xs: torch.Tensor, offsets: torch.Tensor, w, splits: int | None = None) -> torch.Tensor:
    """Rows xs [M, K] grouped by expert (expert e owns rows offsets[e-1]:offsets[e], offsets int [E]
    cumulative, as F.grouped_mm's `offs`) times their expert of the stack w [E, N, K] -> [M, N]. `splits`:
    K slices per output tile, their partial sums added after (default: `_auto_splits`)."""
    cd = _compute_dtype(xs)
    if hasattr(w, "parts"):  # ConcatRows: the fused gate|up of separately quantized halves
        return torch.cat([grouped_matmul(xs, offsets, p, splits) for p in w.parts], dim=-1)
    return _grouped(xs.to(cd), offsets, _operands(w), cd, splits)


def matmul(w, x: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """QuantizedTensor.matmul: x @ W.T for W [N, K] with x [..., K] -> [..., N] in x's dtype; for a stack
    W [E, N, K], x [E, ..., K] and expert e on x[e]. `splits` as grouped_matmul's."""
    if hasattr(w, "parts"):
        return torch.cat([matmul(p, x, splits) for p in w.parts], dim=-1)
    op = _operands(w)
    cd = _compute_dtype(x)
    E, N, K = op["codes"].shape[0], op["N"], op["K"]
    if op["lead"]:
        rows = x.reshape(E, -1, K)
        m = rows.shape[1]
        offsets = torch.arange(1, E + 1, device=x.device, dtype=torch.int32) * m
        return _grouped(rows.reshape(-1, K).to(cd), offsets, op, cd, splits).view(*x.shape[:-1], N)
    x2 = x.reshape(-1, K).to(cd)
    offsets = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x.device)  # no host copy
    return _grouped(x2, offsets, op, cd, splits).view(*x.shape[:-1], N)


ALIGN_MAX = 256  # routed slots (tokens x k) up to which one program lays them out (_align_kernel)


def run_experts(x, weights, ids, w_in, w_out, act):
    """layers/moe.py `run_experts`: Σ over each token's experts (ascending id) of weight ·
    w_out[e](act(w_in[e] x)), both projections as one grouped launch each, no host sync. A decode step's
    slots are laid out by one launch; larger batches by torch's sorts."""
    N, k = ids.shape
    E = w_in.shape[0]
    ids = ids.contiguous()
    if N * k <= ALIGN_MAX:
        pos, rows, offsets = _align(ids, E)
        xs = x[rows]
    else:
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # slots grouped by expert, tokens in order within one
        counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # (bincount would sync with the host on CUDA)
        pos = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=flat.device))
        xs = x[order // k]
    ys = grouped_matmul(act(grouped_matmul(xs, offsets, w_in)), offsets, w_out)
    return _combine(ys, pos, ids, weights, x.dtype)


def _align(ids: torch.Tensor, E: int):
    """(pos [N·k], rows [N·k], offsets [E]) int32 of _align_kernel for ids [N, k] (contiguous)."""
    NK = ids.numel()
    pos = torch.empty(NK, dtype=torch.int32, device=ids.device)
    rows = torch.empty(NK, dtype=torch.int32, device=ids.device)
    offsets = torch.empty(E, dtype=torch.int32, device=ids.device)
    BNK = pow2(NK)
    _align_kernel[(1,)](
        ids, pos, rows, offsets, NK, ids.shape[1], E, BNK=BNK, BJ=min(BNK, 64), BE=64, num_warps=4
    )
    return pos, rows, offsets


def _combine(ys: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype):
    """Per token, its slots' rows of ys [N·k, d] (grouped: slot (n, j) at row pos[n·k + j]) weighted by
    weights [N, k] and summed in ascending expert id (ids [N, k]), in the dtype torch promotes ys and the
    weights to, then cast to `dtype`: one launch for the 2k + 2 elementwise ops (and the un-permuting copy)
    of the reference."""
    N, k = weights.shape
    d = ys.shape[1]
    acc = torch.promote_types(ys.dtype, weights.dtype)
    out = torch.empty(N, d, dtype=dtype, device=ys.device)
    if N == 0:
        return out
    weights = weights.contiguous()
    BD = min(1024, pow2(d))
    _combine_kernel[(N, triton.cdiv(d, BD))](
        ys, pos, ids, weights, out, d, k, ids.stride(0), weights.stride(0), out.stride(0), ACC=_TL[acc],
        KP=pow2(k, 2), BD=BD, num_warps=4,
    )  # fmt: skip
    return out
