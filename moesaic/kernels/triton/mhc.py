"""mHC mixing maps in Triton (layers/mhc.py `sinkhorn`, `site_maps`), fp32.

`site_maps` is one kernel per block of tokens: it streams the flattened n·d streams once, accumulating
their sum of squares and the two projections (the 2n pre/post rows, and the n·n comb rows laid out as
an [NP, NP] tile) with tl.dot, then forms pre = sigmoid(.) + eps, post = 2 sigmoid(.) and the Sinkhorn
normalisation of comb in registers. The 1/RMS factor is applied to the product instead of the input
(the same math; the reference's order only changes rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import F32_DOT, check_device, pow2, sigmoid


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
def _site_kernel(
    h, fn, base, scale, pre, post, comb, M, K, n, s_h, s_fn, norm_eps, hc_eps, iters,
    BM: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    mm = rm < M
    rp = tl.arange(0, PP)  # pre | post rows of fn
    mp = rp < 2 * n
    rc = tl.arange(0, NP * NP)  # comb rows, as an [NP, NP] tile
    ci, cj = rc // NP, rc % NP
    mc = (ci < n) & (cj < n)
    crow = 2 * n + ci * n + cj
    acc_p = tl.zeros([BM, PP], dtype=tl.float32)
    acc_c = tl.zeros([BM, NP * NP], dtype=tl.float32)
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        x = tl.load(h + rm[:, None] * s_h + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0).to(
            tl.float32
        )
        ss += tl.sum(x * x, axis=1)
        fp = tl.load(fn + rp[:, None] * s_fn + rk[None, :], mask=mp[:, None] & mk[None, :], other=0.0)
        fc = tl.load(fn + crow[:, None] * s_fn + rk[None, :], mask=mc[:, None] & mk[None, :], other=0.0)
        acc_p = tl.dot(x, tl.trans(fp.to(tl.float32)), acc_p, input_precision=F32_DOT)
        acc_c = tl.dot(x, tl.trans(fc.to(tl.float32)), acc_c, input_precision=F32_DOT)
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
    b_c = tl.load(base + crow, mask=mc, other=0.0).to(tl.float32)
    logits = tl.reshape(acc_c * inv[:, None] * s2 + b_c[None, :], (BM, NP, NP))
    ri = tl.arange(0, NP)
    valid = mm[:, None, None] & (ri < n)[None, :, None] & (ri < n)[None, None, :]
    c = _sinkhorn(logits, valid, iters, hc_eps)
    off = rm[:, None, None] * n * n + ri[None, :, None] * n + ri[None, None, :]
    tl.store(comb + off, c, mask=valid)


def site_maps(streams: torch.Tensor, site, dims):
    """(pre [N, n], post [N, n], comb [N, n, n]) in fp32 for streams [N, n, d]; `site` has fn, base,
    scale (an MhcSite), `dims` hc_mult, sinkhorn_iters, hc_eps, norm_eps (an MhcDims)."""
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
        BM = 16
        _site_kernel[(triton.cdiv(M, BM),)](
            flat, fn, site.base.contiguous(), site.scale.contiguous(), pre, post, comb, M, K, n,
            flat.stride(0), fn.stride(0), float(dims.norm_eps), float(dims.hc_eps), int(dims.sinkhorn_iters),
            BM=BM, BK=32, PP=pow2(2 * n), NP=max(4, pow2(n, 2)), num_warps=4,
        )  # fmt: skip
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)
