"""Mamba-2 SSD in Triton: the recurrent step (decode) and the chunked scan (prefill), fp32.
Same signatures and layouts as moesaic/layers/mamba2.py `ssd_step` / `ssd_chunked`.

The decay is one scalar per head and token (a = A dt < 0), so inside a chunk the pairwise decay is
exp(acum_i - acum_j) <= 1 for i >= j (acum the inclusive cumulative sum): every chunk is three tl.dot
products (C Bᵀ, scores x, and the state's contribution) plus the carried state update (Dao and Gu,
"Transformers are SSMs", arXiv:2405.21060, §6). One program per (head, P block) carries its [BP, N]
slice of the state through the chunks; with BP = P the C Bᵀ product is formed once per chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import F32_DOT, check_device, pow2


@triton.jit
def _step_kernel(x, dt, A, B, C, h_in, h_out, y, H, P, N, BP: tl.constexpr, BN: tl.constexpr):
    gh = tl.program_id(0)  # (batch, head) flattened
    head = gh % H
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp, mn = rp < P, rn < N
    m2 = mp[:, None] & mn[None, :]
    off = gh * P * N + rp[:, None] * N + rn[None, :]
    d = tl.load(dt + gh)
    a = tl.load(A + head)
    x_t = tl.load(x + gh * P + rp, mask=mp, other=0.0)
    b_t = tl.load(B + gh * N + rn, mask=mn, other=0.0)
    c_t = tl.load(C + gh * N + rn, mask=mn, other=0.0)
    h = tl.exp(d * a) * tl.load(h_in + off, mask=m2, other=0.0) + (x_t * d)[:, None] * b_t[None, :]
    tl.store(h_out + off, h, mask=m2)
    tl.store(y + gh * P + rp, tl.sum(h * c_t[None, :], axis=1), mask=mp)


def ssd_step(x, dt, A, B, C, h):
    """One recurrent step. x [..., H, P], dt [..., H], A [H], B and C [..., H, N], h [..., H, P, N]
    (leading dims: a batch of sequences). Returns y [..., H, P] without the D skip, and the new state."""
    check_device(x)
    H, P = x.shape[-2:]
    N = B.shape[-1]
    xf, hf = x.float().contiguous(), h.float().contiguous()
    h_out = torch.empty_like(hf)
    y = torch.empty_like(xf)
    G = xf.numel() // P
    BP = min(64, pow2(P))
    _step_kernel[(G, triton.cdiv(P, BP))](
        xf,
        dt.float().contiguous(),
        A.float().contiguous(),
        B.float().contiguous(),
        C.float().contiguous(),
        hf,
        h_out,
        y,
        H,
        P,
        N,
        BP=BP,
        BN=pow2(N),
        num_warps=4,
    )
    return y, h_out


@triton.jit
def _chunk_kernel(
    x, dt, A, B, C, h_in, h_out, y, T, H, P, N,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    ri = tl.arange(0, BT)
    mp, mn = rp < P, rn < N
    hoff = head * P * N + rp[:, None] * N + rn[None, :]
    h = tl.load(h_in + hoff, mask=mp[:, None] & mn[None, :], other=0.0)
    a_h = tl.load(A + head)
    lower = ri[:, None] >= ri[None, :]
    for s in range(0, T, BT):
        t = s + ri
        mt = t < T
        d = tl.load(dt + t * H + head, mask=mt, other=0.0)  # padded tokens: dt 0, so no decay, no input
        acum = tl.cumsum(a_h * d, axis=0)
        a_last = tl.sum(tl.where(ri == BT - 1, acum, 0.0), axis=0)
        bn = (t * H + head)[:, None] * N + rn[None, :]
        Bc = tl.load(B + bn, mask=mt[:, None] & mn[None, :], other=0.0)
        Cc = tl.load(C + bn, mask=mt[:, None] & mn[None, :], other=0.0)
        xoff = (t * H + head)[:, None] * P + rp[None, :]
        xdt = tl.load(x + xoff, mask=mt[:, None] & mp[None, :], other=0.0) * d[:, None]
        decay = tl.exp(tl.where(lower, acum[:, None] - acum[None, :], float("-inf")))
        scores = tl.dot(Cc, tl.trans(Bc), input_precision=F32_DOT) * decay  # [BT, BT]
        y_c = tl.dot(scores, xdt, input_precision=F32_DOT)
        y_c += tl.dot(Cc, tl.trans(h), input_precision=F32_DOT) * tl.exp(acum)[:, None]
        tl.store(y + xoff, y_c, mask=mt[:, None] & mp[None, :])
        to_end = tl.exp(a_last - acum)
        h = tl.exp(a_last) * h + tl.dot(tl.trans(xdt * to_end[:, None]), Bc, input_precision=F32_DOT)
    tl.store(h_out + hoff, h, mask=mp[:, None] & mn[None, :])


def ssd_chunked(x, dt, A, B, C, h0, chunk: int):
    """Chunked SSD scan. x [T, H, P], dt [T, H] (softplus'ed and clamped), A [H], B and C [T, H, N]
    (groups expanded to heads), h0 [H, P, N]. Returns y [T, H, P] without the D skip, and the state
    after the last token. `chunk` is rounded to a power of two in 16..32 (the tiles stay in sm_90's
    registers; the result is the same to fp32 rounding)."""
    check_device(x)
    T, H, P = x.shape
    N = B.shape[-1]
    xf = x.float().contiguous()
    y = torch.empty_like(xf)
    h_out = torch.empty(H, P, N, dtype=torch.float32, device=x.device)
    BP = min(64, pow2(P))
    _chunk_kernel[(H, triton.cdiv(P, BP))](
        xf,
        dt.float().contiguous(),
        A.float().contiguous(),
        B.float().contiguous(),
        C.float().contiguous(),
        h0.float().contiguous(),
        h_out,
        y,
        T,
        H,
        P,
        N,
        BT=min(32, pow2(chunk)),
        BP=BP,
        BN=pow2(N),
        num_warps=8,
        num_stages=1,
    )
    return y, h_out
