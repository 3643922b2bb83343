"""Fused MoE routers (layers/moe.py `route_sigmoid`, `route_softmax`, `route_sqrtsoftplus`): one program
per token computes the scores of all its experts, adds the selection-only bias, applies DeepSeek's group
limit (the topk_group groups whose top-2 scores sum highest), picks the top-k and renormalises.

Top-k in registers: each expert's choice value becomes a distinct 64-bit key (the fp32 bits mapped to a
monotone integer, then the expert id inverted in the low 32 bits, so equal values prefer the lower id)
and k block-wide max reductions pick the largest (k <= 32 here: cheaper than a bitonic sort of all E). The ids come out sorted by choice, largest first; the
references return them unsorted (sorted=False): as a set they are the same.

Scores are computed in fp32 (the sigmoid router is fp32 in the reference; the softmax and sqrt-softplus
routers work in the logits' dtype there, so 16-bit logits agree to that dtype's rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_device, pow2, sigmoid, softplus

SOFTMAX, SIGMOID, SQRTSOFTPLUS = 0, 1, 2


@triton.jit
def _score(x, SCORE: tl.constexpr, mx, denom):
    if SCORE == 0:
        return tl.exp(x - mx) / denom
    elif SCORE == 1:
        return sigmoid(x)
    else:
        return tl.sqrt(softplus(x))


@triton.jit
def _route_kernel(
    logits, bias, ids_in, w_out, ids_out, E, k, gsize, s_l, s_i, scale,
    SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_IDS: tl.constexpr, NORMALIZE: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, FILL: tl.constexpr,
    BE: tl.constexpr, BG: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    re = tl.arange(0, BE)
    me = re < E
    x = tl.load(logits + t * s_l + re, mask=me, other=float("-inf")).to(tl.float32)
    mx = 0.0
    denom = 1.0
    if SCORE == 0:
        mx = tl.max(x, axis=0)
        denom = tl.sum(tl.where(me, tl.exp(x - mx), 0.0), axis=0)
    rk = tl.arange(0, BK)
    mk = rk < k
    if HAS_IDS:  # a hash layer: the experts are given
        ids = tl.load(ids_in + t * s_i + rk, mask=mk, other=0).to(tl.int32)
    else:
        s = _score(x, SCORE, mx, denom)
        choice = s
        if HAS_BIAS:
            choice = choice + tl.load(bias + re, mask=me, other=0.0).to(tl.float32)
        choice = tl.where(me, choice, float("-inf"))
        if N_GROUP > 1:
            # one group at a time over 1-D vectors (the block-wide reductions the top-k below uses): a
            # [groups, experts] form of this gave other groups than the reference on an H200 (2026-12-04)
            # while the interpreter agreed
            rg = tl.arange(0, BG)
            gscore = tl.full([BG], float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                cg = tl.where(re // gsize == g, choice, float("-inf"))
                top1 = tl.max(cg, axis=0)
                first = tl.min(tl.where(cg == top1, re, BE), axis=0)
                top2 = tl.max(tl.where(re == first, float("-inf"), cg), axis=0)
                gscore = tl.where(rg == g, top1 + top2, gscore)
            kept = re < 0
            for g in tl.static_range(N_GROUP):
                mine = tl.max(tl.where(rg == g, gscore, float("-inf")), axis=0)
                # groups ranked ahead of g: a greater sum, or an equal one at a lower index
                ahead = tl.sum(((gscore > mine) | ((gscore == mine) & (rg < g))).to(tl.int32), axis=0)
                kept = kept | ((re // gsize == g) & (ahead < TOPK_GROUP))
            choice = tl.where(kept | ~me, choice, FILL)
        bits = choice.to(tl.int32, bitcast=True)
        mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving int view of the floats
        key = (mono.to(tl.int64) << 32) | (BE - 1 - re).to(tl.int64)  # distinct keys
        ids = tl.zeros([BK], dtype=tl.int32)
        for j in range(k):  # k block-wide max reductions (k <= 32: cheaper than sorting BE keys)
            top = tl.max(key, axis=0)
            ids = tl.where(rk == j, (BE - 1 - (top & 0xFFFFFFFF)).to(tl.int32), ids)
            key = tl.where(key == top, -0x7FFFFFFFFFFFFFFF, key)
    xs = tl.load(logits + t * s_l + ids, mask=mk, other=0.0).to(tl.float32)
    w = tl.where(mk, _score(xs, SCORE, mx, denom), 0.0)
    if NORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(w_out + t * k + rk, (w * scale).to(w_out.dtype.element_ty), mask=mk)
    tl.store(ids_out + t * k + rk, ids.to(tl.int64), mask=mk)


def _route(
    logits,
    top_k,
    score,
    bias=None,
    n_group=1,
    topk_group=1,
    normalize=True,
    scale=1.0,
    ids=None,
    fill=0.0,
    out_dtype=None,
):
    check_device(logits)
    N, E = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    dev = logits.device
    w = torch.empty(N, top_k, dtype=out_dtype or torch.float32, device=dev)  # the store rounds to it
    out_ids = torch.empty(N, top_k, dtype=torch.long, device=dev)
    if N:
        ids_t = ids.to(dev).contiguous() if ids is not None else out_ids
        _route_kernel[(N,)](
            logits, bias if bias is not None else logits, ids_t, w, out_ids, E, top_k, max(1, E // n_group),
            logits.stride(0), ids_t.stride(0), float(scale),
            SCORE=score, HAS_BIAS=bias is not None, HAS_IDS=ids is not None, NORMALIZE=bool(normalize),
            N_GROUP=int(n_group), TOPK_GROUP=int(topk_group), FILL=float(fill),
            BE=pow2(E), BG=pow2(n_group, 2), BK=pow2(top_k, 1), num_warps=4,
        )  # fmt: skip
    return w, (ids.to(dev).long() if ids is not None else out_ids)


def route_softmax(logits, top_k, n_group=1, topk_group=1, normalize=True, scale=1.0):
    """Softmax router. Returns (weights in the logits' dtype, ids) [N, k]."""
    return _route(
        logits, top_k, SOFTMAX, None, n_group, topk_group, normalize, scale, fill=0.0, out_dtype=logits.dtype
    )


def route_sigmoid(logits, top_k, bias=None, n_group=1, topk_group=1, normalize=True, scale=1.0):
    """Sigmoid router with a selection-only correction bias, fp32. Returns (weights, ids) [N, k]."""
    return _route(logits, top_k, SIGMOID, bias, n_group, topk_group, normalize, scale, fill=float("-inf"))


def route_sqrtsoftplus(logits, top_k, bias=None, scale=1.0, ids=None):
    """DeepSeek-V4's router: scores sqrt(softplus(logits)), experts topk(scores + bias) or the static
    `ids` [N, k] of a hash layer; weights renormalised and scaled. Returns (weights in the logits' dtype, ids)."""
    return _route(logits, top_k, SQRTSOFTPLUS, bias, 1, 1, True, scale, ids=ids, out_dtype=logits.dtype)
