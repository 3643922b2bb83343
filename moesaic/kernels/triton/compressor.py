"""Softmax-gated pooling of token windows into compressed entries: DeepSeek-V4's CSA / HCA compressors
(layers/csa.py `pool_windows`, `compressor_update`) and GLM-5.3's k-pool of indexer keys (layers/dsa.py
`pool_keys`, the same law without overlap).

Entry e pools its slots channel by channel: p = softmax over the slots of (gate + ape) in fp32, entry =
Σ p ⊙ kv in fp32, rounded once to the rows' dtype (the reference rounds p and each product to a 16-bit
dtype first: bf16 rows agree to a bf16 rounding step). With overlap (CSA) an entry has 2m slots: window e-1's first
series (channels [0, C)) and window e's second series (channels [C, 2C)); without a predecessor the
first half weighs 0. One program per (entry, channel block); the slots are one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_device, pow2

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _pool_kernel(
    kv, gate, ape, out, W, G, m, C, s_kv, s_g, s_ape, s_out,
    OVERLAP: tl.constexpr, HAS_PREV: tl.constexpr, ROUND_LOGITS: tl.constexpr, LOGIT_TY: tl.constexpr,
    BS: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    e, cb = tl.program_id(0), tl.program_id(1)
    rs = tl.arange(0, BS)
    rc = cb * BC + tl.arange(0, BC)
    mc = rc < C
    if OVERLAP:
        wi = e + (W - G)  # the window whose second series fills slots m..2m-1
        first = rs < m
        win = tl.where(first, wi - 1, wi)
        slot = tl.where(first, rs, rs - m)
        col = tl.where(first, 0, C)
        ok = (rs < 2 * m) & (win >= 0)
    else:
        win = e
        slot = rs
        col = rs * 0
        ok = rs < m
    row = win * m + slot
    m2 = ok[:, None] & mc[None, :]
    ch = col[:, None] + rc[None, :]
    k = tl.load(kv + row[:, None] * s_kv + ch, mask=m2, other=0.0).to(tl.float32)
    z = tl.load(gate + row[:, None] * s_g + ch, mask=m2, other=0.0).to(tl.float32)
    a = tl.load(ape + slot[:, None] * s_ape + ch, mask=m2, other=0.0).to(tl.float32)
    logits = z + a
    if ROUND_LOGITS:  # gate and ape both 16-bit: the reference adds them in that dtype
        logits = logits.to(LOGIT_TY).to(tl.float32)
    logits = tl.where(m2, logits, float("-inf"))
    mx = tl.max(logits, axis=0)
    p = tl.exp(logits - tl.where(mx == float("-inf"), 0.0, mx)[None, :])
    tot = tl.sum(p, axis=0)
    p = p / tl.where(tot > 0, tot, 1.0)[None, :]
    y = tl.sum(p * k, axis=0)
    tl.store(out + e * s_out + rc, y.to(out.dtype.element_ty), mask=mc)


def _pool(kv, gate, ape, m, C, overlap, has_prev, logit_dtype):
    check_device(kv)
    kv, gate, ape = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, gate, ape))
    W = kv.shape[0] // m
    G = W - 1 if (overlap and has_prev) else W
    out = torch.empty(G, C, dtype=kv.dtype, device=kv.device)
    if G <= 0:
        return out[:0]
    slots = 2 * m if overlap else m
    BS = pow2(slots, 2)
    BC = max(16, min(128, 4096 // BS))
    _pool_kernel[(G, triton.cdiv(C, BC))](
        kv, gate, ape, out, W, G, m, C, kv.stride(0), gate.stride(0), ape.stride(0), out.stride(0),
        OVERLAP=overlap, HAS_PREV=has_prev, ROUND_LOGITS=logit_dtype != torch.float32,
        LOGIT_TY=_TL[logit_dtype], BS=BS, BC=BC, num_warps=4,
    )  # fmt: skip
    return out


def pool_windows(kv, gate, ape, dims, has_prev: bool):
    """layers/csa.py `pool_windows`: kv/gate [rows, proj_width] of whole windows, ape [ratio, proj_width],
    dims with `ratio`, `width`, `overlap` (a CompressorDims). Returns [entries, width] (before the norm)."""
    logit = torch.promote_types(gate.dtype, ape.dtype)
    return _pool(kv, gate, ape, dims.ratio, dims.width, dims.overlap, bool(has_prev), logit)


def pool_keys(k, z, ape):
    """layers/dsa.py `pool_keys`: the pooled keys [T // P, c_I] of the complete pools of k, z [T, c_I]."""
    P, c = ape.shape
    n = k.shape[0] // P
    return _pool(k[: n * P], z[: n * P], ape, P, c, False, False, torch.float32)


@triton.jit
def _rms_kernel(x, w, out, C, eps, s_x, s_out, BC: tl.constexpr):
    r = tl.program_id(0)
    rc = tl.arange(0, BC)
    mc = rc < C
    v = tl.load(x + r * s_x + rc, mask=mc, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / C + eps)
    y = tl.load(w + rc, mask=mc, other=0.0).to(tl.float32) * (v * inv)
    tl.store(out + r * s_out + rc, y.to(out.dtype.element_ty), mask=mc)


def rms_norm_cast_once(x, weight, eps: float):
    """layers/norms.py `rms_norm_cast_once` over rows x [R, C]: normalise in fp32, times the weight in
    fp32, cast to x's dtype once."""
    check_device(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_kernel[(x.shape[0],)](
            x, weight, out, x.shape[1], float(eps), x.stride(0), out.stride(0), BC=pow2(x.shape[1])
        )
    return out


def compressor_update(state, kv, gate, w, eps: float, rope):
    """layers/csa.py `compressor_update` with the pooling and the entry norm in Triton: appends n new
    tokens' raw rows to `state` (a CompressorState), closes the windows they complete into entries
    (pooled, RMS-normed, roped at their first token by the `rope` callable). Returns (all entries so
    far [E, width], the new entries before rope [E1 - E0, width], E0 = the index of the first new one)."""
    d, m = state.dims, state.dims.ratio
    T0, n = state.raw.length, kv.shape[0]
    held = state.raw.held
    raw = state.raw.append(kv=kv, gate=gate)
    E0, E1 = T0 // m, (T0 + n) // m
    if E1 == E0:
        return state.held_entries(), kv.new_empty(0, d.width), E0
    has_prev = d.overlap and E0 > 0
    first = (E0 - 1 if has_prev else E0) * m
    a, b = first - (T0 - held), E1 * m - (T0 - held)
    pooled = pool_windows(raw["kv"][a:b], raw["gate"][a:b], w.ape, d, has_prev)
    latent = rms_norm_cast_once(pooled.to(kv.dtype), w.norm, eps)
    new = rope(latent, torch.arange(E0, E1, device=kv.device) * m)
    return state.entries.append(entry=new)["entry"], latent, E0
