"""mHC mixing maps in Triton (layers/mhc.py `sinkhorn`, `site_maps`), fp32.

`collapse` (Σ_j pre[j] h[j]) and `update` (h'[k] = post[k] y + Σ_j comb[j, k] h[j]) are one launch each, the
references' float operations in their order (fp32 sums from 0, j in order; the update's product by post and
the sum rounded to the streams' dtype as its torch ops round them), where those take ~10 and ~20 kernels.

`site_maps` streams the flattened n·d streams once, accumulating their sum of squares and the two
projections (the 2n pre/post rows, and the n·n comb rows laid out as an [NP, NP] tile) with tl.dot, then
forms pre = sigmoid(.) + eps, post = 2 sigmoid(.) and the Sinkhorn normalisation of comb in registers.
A program takes a tile of 16 tokens and a slice of n·d: at decode (one tile) the slices spread fn's read
over the machine, and a second kernel adds their partial sums in order and forms the maps. The 1/RMS factor is applied to the product instead of the input
(the same math; the reference's order only changes rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import F32_DOT, ROUND, check_device, num_sms, pow2, round_to, sigmoid


@triton.jit
def _sinkhorn(logits, valid, iters, eps):
    """[BM, NP, NP] fp32 -> doubly stochastic over the valid entries (0 elsewhere): row softmax + eps, one
    column normalisation, then iters - 1 rounds of (row, column), each dividing by (sum + eps)."""
    x = tl.where(valid, logits, float("-inf"))
    mx = tl.max(x, axis=2)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    p = tl.exp(x - mx[:, :, None])
    rs = tl.sum(p, axis=2)
    c = tl.where(valid, p / tl.where(rs > 0, rs, 1.0)[:, :, None] + eps, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    return c


@triton.jit
def _sinkhorn_kernel(x, out, M, n, iters, eps, BM: tl.constexpr, NP: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    ri = tl.arange(0, NP)
    valid = (rm < M)[:, None, None] & (ri < n)[None, :, None] & (ri < n)[None, None, :]
    off = rm[:, None, None] * n * n + ri[None, :, None] * n + ri[None, None, :]
    c = _sinkhorn(tl.load(x + off, mask=valid, other=0.0).to(tl.float32), valid, iters, eps)
    tl.store(out + off, c, mask=valid)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] -> doubly stochastic (to eps), fp32."""
    check_device(logits)
    n = logits.shape[-1]
    x = logits.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    M = x.numel() // (n * n)
    if M:
        BM = 16
        _sinkhorn_kernel[(triton.cdiv(M, BM),)](x, out, M, n, int(iters), float(eps), BM=BM, NP=pow2(n, 2))
    return out


@triton.jit
def _site_maps_out(
    acc_p, acc_c, ss, rm, mm, base, scale, pre, post, comb, K, n, norm_eps, hc_eps, iters,
    BM: tl.constexpr, PP: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    """The maps of BM tokens from their sums over all of K: the two projections and the sum of squares."""
    rp = tl.arange(0, PP)
    mp = rp < 2 * n
    rc = tl.arange(0, NP * NP)
    ci, cj = rc // NP, rc % NP
    mc = (ci < n) & (cj < n)
    inv = tl.rsqrt(ss / K + norm_eps)
    s0, s1, s2 = (
        tl.load(scale).to(tl.float32),
        tl.load(scale + 1).to(tl.float32),
        tl.load(scale + 2).to(tl.float32),
    )
    b_p = tl.load(base + rp, mask=mp, other=0.0).to(tl.float32)
    z = acc_p * inv[:, None]
    is_pre = rp < n
    z = z * tl.where(is_pre, s0, s1)[None, :] + b_p[None, :]
    sig = sigmoid(z)
    tl.store(pre + rm[:, None] * n + rp[None, :], sig + hc_eps, mask=mm[:, None] & is_pre[None, :])
    tl.store(
        post + rm[:, None] * n + (rp - n)[None, :], 2.0 * sig, mask=mm[:, None] & (mp & ~is_pre)[None, :]
    )
    b_c = tl.load(base + 2 * n + ci * n + cj, mask=mc, other=0.0).to(tl.float32)
    logits = tl.reshape(acc_c * inv[:, None] * s2 + b_c[None, :], (BM, NP, NP))
    ri = tl.arange(0, NP)
    valid = mm[:, None, None] & (ri < n)[None, :, None] & (ri < n)[None, None, :]
    c = _sinkhorn(logits, valid, iters, hc_eps)
    off = rm[:, None, None] * n * n + ri[None, :, None] * n + ri[None, None, :]
    tl.store(comb + off, c, mask=valid)


@triton.jit
def _site_kernel(
    h, fn, base, scale, pre, post, comb, part, M, K, KS, n, s_h, s_fn, norm_eps, hc_eps, iters,
    BM: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Tokens tile program_id(0), K slice program_id(1) (KS wide): the projections' and the sum of squares'
    partial sums. One slice (SPLIT False): the maps themselves; else the sums go to `part` [S, M, W]
    (W = PP + NP·NP + 1) for _site_finish_kernel."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    mm = rm < M
    sl = tl.program_id(1)
    rp = tl.arange(0, PP)  # pre | post rows of fn
    mp = rp < 2 * n
    rc = tl.arange(0, NP * NP)  # comb rows, as an [NP, NP] tile
    ci, cj = rc // NP, rc % NP
    mc = (ci < n) & (cj < n)
    crow = 2 * n + ci * n + cj
    acc_p = tl.zeros([BM, PP], dtype=tl.float32)
    acc_c = tl.zeros([BM, NP * NP], dtype=tl.float32)
    ss = tl.zeros([BM], dtype=tl.float32)
    k_end = tl.minimum(sl * KS + KS, K)
    for k0 in range(sl * KS, k_end, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < k_end
        x = tl.load(h + rm[:, None] * s_h + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0).to(
            tl.float32
        )
        ss += tl.sum(x * x, axis=1)
        fp = tl.load(fn + rp[:, None] * s_fn + rk[None, :], mask=mp[:, None] & mk[None, :], other=0.0)
        fc = tl.load(fn + crow[:, None] * s_fn + rk[None, :], mask=mc[:, None] & mk[None, :], other=0.0)
        acc_p = tl.dot(x, tl.trans(fp.to(tl.float32)), acc_p, input_precision=F32_DOT)
        acc_c = tl.dot(x, tl.trans(fc.to(tl.float32)), acc_c, input_precision=F32_DOT)
    if SPLIT:
        W: tl.constexpr = PP + NP * NP + 1
        row = part + (sl * M + rm[:, None]).to(tl.int64) * W
        tl.store(row + rp[None, :], acc_p, mask=mm[:, None])
        tl.store(row + PP + rc[None, :], acc_c, mask=mm[:, None])
        tl.store(part + (sl * M + rm).to(tl.int64) * W + W - 1, ss, mask=mm)
    else:
        _site_maps_out(
            acc_p, acc_c, ss, rm, mm, base, scale, pre, post, comb, K, n, norm_eps, hc_eps, iters, BM, PP, NP
        )


@triton.jit
def _site_finish_kernel(
    part, base, scale, pre, post, comb, M, K, S, n, norm_eps, hc_eps, iters,
    BM: tl.constexpr, PP: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    """The K slices' partial sums added in slice order (the same bits on every run), then the maps."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    mm = rm < M
    rp = tl.arange(0, PP)
    rc = tl.arange(0, NP * NP)
    W: tl.constexpr = PP + NP * NP + 1
    acc_p = tl.zeros([BM, PP], dtype=tl.float32)
    acc_c = tl.zeros([BM, NP * NP], dtype=tl.float32)
    ss = tl.zeros([BM], dtype=tl.float32)
    for sl in range(S):
        row = part + (sl * M + rm).to(tl.int64) * W
        acc_p += tl.load(row[:, None] + rp[None, :], mask=mm[:, None], other=0.0)
        acc_c += tl.load(row[:, None] + PP + rc[None, :], mask=mm[:, None], other=0.0)
        ss += tl.load(row + W - 1, mask=mm, other=0.0)
    _site_maps_out(
        acc_p, acc_c, ss, rm, mm, base, scale, pre, post, comb, K, n, norm_eps, hc_eps, iters, BM, PP, NP
    )


def site_splits(tiles: int, K: int, BK: int, sms: int) -> int:
    """K slices per tile of tokens: enough programs to give every multiprocessor one (a decode step has one
    tile of tokens, whose single program read fn alone: 7 GB/s on an H200), each slice at least 4 BK
    steps; 1 (one kernel, no partial sums) when the tiles already fill the machine."""
    return max(1, min(sms // max(tiles, 1), triton.cdiv(K, 4 * BK)))


def site_maps(streams: torch.Tensor, site, dims, splits: int | None = None):
    """(pre [N, n], post [N, n], comb [N, n, n]) in fp32 for streams [N, n, d]; `site` has fn, base,
    scale (an MhcSite), `dims` hc_mult, sinkhorn_iters, hc_eps, norm_eps (an MhcDims). `splits`: K slices
    per tile of tokens (default: site_splits from the device's multiprocessors; tests set it)."""
    check_device(streams)
    n = dims.hc_mult
    lead = streams.shape[:-2]
    flat = streams.reshape(-1, streams.shape[-2] * streams.shape[-1])
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    M, K = flat.shape
    dev = streams.device
    pre = torch.empty(M, n, dtype=torch.float32, device=dev)
    post = torch.empty(M, n, dtype=torch.float32, device=dev)
    comb = torch.empty(M, n, n, dtype=torch.float32, device=dev)
    if M:
        fn = site.fn.contiguous()
        BM, BK, PP, NP = 16, 32, pow2(2 * n), max(4, pow2(n, 2))
        tiles = triton.cdiv(M, BM)
        S = splits or site_splits(tiles, K, BK, num_sms(dev))
        KS = triton.cdiv(triton.cdiv(K, S), BK) * BK  # each slice whole BK steps
        S = triton.cdiv(K, KS)
        # the partial sums [S, M, W]; with one slice the kernel never touches it (pre stands in)
        part = torch.empty(S, M, PP + NP * NP + 1, dtype=torch.float32, device=dev) if S > 1 else pre
        args = (site.base.contiguous(), site.scale.contiguous(), pre, post, comb)
        eps = (float(dims.norm_eps), float(dims.hc_eps), int(dims.sinkhorn_iters))
        _site_kernel[(tiles, S)](
            flat, fn, *args, part, M, K, KS, n, flat.stride(0), fn.stride(0), *eps,
            BM=BM, BK=BK, PP=PP, NP=NP, SPLIT=S > 1, num_warps=4,
        )  # fmt: skip
        if S > 1:
            _site_finish_kernel[(tiles,)](part, *args, M, K, S, n, *eps, BM=BM, PP=PP, NP=NP, num_warps=4)
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


@triton.jit
def _collapse_kernel(h, pre, out, n, d, s_ht, NS: tl.constexpr, BD: tl.constexpr):
    t, db = tl.program_id(0), tl.program_id(1)
    rd = db * BD + tl.arange(0, BD)
    md = rd < d
    row = h + t.to(tl.int64) * s_ht
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(NS):
        p = tl.load(pre + t * n + j).to(tl.float32)
        acc += p * tl.load(row + j * d + rd, mask=md, other=0.0).to(tl.float32)
    tl.store(out + t.to(tl.int64) * d + rd, acc.to(out.dtype.element_ty), mask=md)


def _streams(streams: torch.Tensor) -> torch.Tensor:
    """[N, n, d] with each token's n·d values contiguous (the kernels' layout)."""
    ok = streams.stride(-1) == 1 and streams.stride(-2) == streams.shape[-1]
    return streams if ok else streams.contiguous()


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """layers/mhc.py `collapse`: Σ_j pre[j] h[j] in fp32, [..., n, d] -> [..., d] in the streams' dtype."""
    check_device(streams, pre)
    *lead, n, d = streams.shape
    h, pre = _streams(streams.reshape(-1, n, d)), pre.reshape(-1, n).contiguous()
    N = h.shape[0]
    out = torch.empty(N, d, dtype=streams.dtype, device=streams.device)
    if N and d:
        BD = min(1024, triton.next_power_of_2(d))
        _collapse_kernel[(N, triton.cdiv(d, BD))](h, pre, out, n, d, h.stride(0), NS=n, BD=BD, num_warps=4)
    return out.view(*lead, d)


@triton.jit
def _update_kernel(
    h, y, post, comb, out, n, d, s_ht, s_yt,
    RND: tl.constexpr, NS: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t, db = tl.program_id(0), tl.program_id(1)
    rd = db * BD + tl.arange(0, BD)
    md = rd < d
    rk = tl.arange(0, NP)
    mk = rk < n
    row = h + t.to(tl.int64) * s_ht
    mixed = tl.zeros([NP, BD], dtype=tl.float32)
    for j in tl.static_range(NS):  # Σ_j comb[j, k] h[j], comb rounded to the streams' dtype first
        c = round_to(tl.load(comb + (t * n + j) * n + rk, mask=mk, other=0.0).to(tl.float32), RND)
        mixed += c[:, None] * tl.load(row + j * d + rd, mask=md, other=0.0).to(tl.float32)[None, :]
    p = round_to(tl.load(post + t * n + rk, mask=mk, other=0.0).to(tl.float32), RND)
    yv = round_to(tl.load(y + t.to(tl.int64) * s_yt + rd, mask=md, other=0.0).to(tl.float32), RND)
    o = round_to(round_to(p[:, None] * yv[None, :], RND) + round_to(mixed, RND), RND)
    optr = out + (t.to(tl.int64) * n + rk[:, None]) * d + rd[None, :]
    tl.store(optr, o.to(out.dtype.element_ty), mask=mk[:, None] & md[None, :])


def update(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """layers/mhc.py `update`: h'[k] = post[k] · y + Σ_j comb[j, k] h[j] in the streams' dtype. streams
    [..., n, d], y [..., d], post [..., n], comb [..., n, n] -> [..., n, d]."""
    check_device(streams, y, post, comb)
    *lead, n, d = streams.shape
    if streams.dtype not in ROUND:
        raise ValueError(f"mhc update: streams of {streams.dtype}, not a float dtype the kernel rounds to")
    h, post, comb = (
        _streams(streams.reshape(-1, n, d)),
        post.reshape(-1, n).contiguous(),
        comb.reshape(-1, n, n),
    )
    comb, y = comb.contiguous(), y.reshape(-1, d)
    y = y if y.stride(-1) == 1 else y.contiguous()
    N = h.shape[0]
    out = torch.empty(*lead, n, d, dtype=streams.dtype, device=streams.device)
    if N and d:
        BD = min(512, triton.next_power_of_2(d))
        _update_kernel[(N, triton.cdiv(d, BD))](
            h, y, post, comb, out, n, d, h.stride(0), y.stride(0),
            RND=ROUND[streams.dtype], NS=n, NP=pow2(n, 2), BD=BD, num_warps=4,
        )  # fmt: skip
    return out
