"""RMS norm (alone or after a residual add), the rotary embeddings and SwiGLU's product in Triton
(layers/norms.py, layers/rope.py, layers/moe.py): one launch each where the torch references take 2-8 small
kernels (the norms and ropes were 308 of the 517 torch ops of a Mistral-4-shaped decode step on the CUDA path,
an eager step that is launch-bound on an H200: docs/perf.md, GPU).

Same contracts as kernels/cpu.py `rms_norm` and `rope`, which the references call first on the CPU:

  rms_norm(x, w, eps, pre, mid, out, factor)  rnd_out(w · rnd_mid(x' · rnd_factor(rsqrt(mean(x'²) + eps))))
      with x' = rnd_pre(x); each rnd a rounding to that dtype (None / fp32: none); w [d], or [G, d] for
      x [..., G, d] (row r of the groups takes w[r % G]); every product in fp32, as torch computes a
      product of 16-bit tensors (exact in fp32, then rounded).
  rope(x, cos, sin, layout, keep)  layout 0 interleaved pairs written [evens | odds] (rope_interleaved),
      1 halves (rope_half), both in x's dtype op by op; 2 pairs kept in place (rope_pairs), in fp32 and
      rounded once; cos / sin [n, dim/2] rounded to x's dtype first; the first `keep` channels copied.
  add_rms_norm(x, delta, w, ...)  (x + delta rounded to x's dtype, rms_norm of that sum): vLLM's
      fused_add_rms_norm.
  silu_mul(gate, up)  F.silu(gate) * up: SiLU in fp32 rounded to gate's dtype, then the product rounded
      (tl.exp is not CUDA's expf: the same math, an ulp apart at times).

The mean's sum runs in the tree order of tl.sum, not torch's: the same math, not the same bits (the CPU
kernels keep torch's order; a GPU reduction has its own). None where a shape is not served.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ROUND, check_device, round_to

MAX_WIDTH = 16384


@triton.jit
def _rms_kernel(
    x, w, y, d, G, s_x, eps, res, s_r, h,
    PRE: tl.constexpr, MID: tl.constexpr, FACTOR: tl.constexpr, BD: tl.constexpr, ADD: tl.constexpr,
    XR: tl.constexpr,
):  # fmt: skip
    """Row program_id(0). ADD: x + res, rounded to x's dtype (round_to's code XR), is written to h first and
    normalised (a residual add and the norm after it)."""
    r = tl.program_id(0)
    rd = tl.arange(0, BD)
    m = rd < d
    v = tl.load(x + r.to(tl.int64) * s_x + rd, mask=m, other=0.0).to(tl.float32)
    if ADD:
        v = round_to(v + tl.load(res + r.to(tl.int64) * s_r + rd, mask=m, other=0.0).to(tl.float32), XR)
        tl.store(h + r.to(tl.int64) * d + rd, v.to(h.dtype.element_ty), mask=m)
    v = round_to(v, PRE)
    f = round_to(tl.rsqrt(tl.sum(v * v, axis=0) / d + eps), FACTOR)
    v = round_to(v * f, MID)
    wt = tl.load(w + (r % G) * d + rd, mask=m, other=0.0).to(tl.float32)
    tl.store(y + r.to(tl.int64) * d + rd, (wt * v).to(y.dtype.element_ty), mask=m)


def rms_norm(x, w, eps: float, pre, mid, out, factor=None):
    """kernels/cpu.py `rms_norm`'s contract on CUDA tensors (or CPU ones under the interpreter)."""
    got = _norm(x, None, w, eps, pre, mid, out, factor)
    return None if got is None else got[1]


def add_rms_norm(x, delta, w, eps: float, pre, mid, out, factor=None):
    """(x + delta in x's dtype, rms_norm of that sum) in one launch; None where it does not apply."""
    if delta.shape != x.shape or delta.dtype != x.dtype or x.dtype not in ROUND:
        return None
    return _norm(x, delta, w, eps, pre, mid, out, factor)


def _norm(x, delta, w, eps: float, pre, mid, out, factor):
    d = x.shape[-1] if x.dim() else 0
    grouped = w.dim() == 2 and x.dim() >= 2 and w.shape == x.shape[-2:]
    if not (0 < d <= MAX_WIDTH and (w.shape == (d,) or grouped)) or any(
        t not in ROUND for t in (pre, mid, factor)
    ):
        return None
    check_device(x, w)
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(x2.shape, dtype=out, device=x.device)
    r2 = h = x2  # no residual: unused pointers
    if delta is not None:
        r2 = delta.reshape(-1, d)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        G = w.shape[0] if grouped else 1
        _rms_kernel[(x2.shape[0],)](
            x2, w.contiguous(), y, d, G, x2.stride(0), float(eps), r2, r2.stride(0), h,
            PRE=ROUND[pre], MID=ROUND[mid], FACTOR=ROUND[factor], BD=triton.next_power_of_2(d),
            ADD=delta is not None, XR=ROUND.get(x.dtype, 0), num_warps=4 if d <= 4096 else 8,
        )  # fmt: skip
    return h.view(x.shape), y.view(x.shape)


@triton.jit
def _rope_kernel(
    x, cos, sin, y, heads, half, keep, s_xt, s_xh, s_c,
    LAYOUT: tl.constexpr, RND: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    t, hb = tl.program_id(0), tl.program_id(1)
    rh = hb * BH + tl.arange(0, BH)
    mh = rh < heads
    rp = tl.arange(0, BP)
    mp = rp < half
    width = keep + 2 * half
    xrow = x + t.to(tl.int64) * s_xt + rh[:, None].to(tl.int64) * s_xh
    yrow = y + (t.to(tl.int64) * heads + rh[:, None]) * width
    if keep > 0:  # the unrotated channels, copied
        rk = tl.arange(0, BK)
        mk = mh[:, None] & (rk < keep)[None, :]
        tl.store(yrow + rk[None, :], tl.load(xrow + rk[None, :], mask=mk, other=0.0), mask=mk)
    c = round_to(tl.load(cos + t * s_c + rp, mask=mp, other=0.0).to(tl.float32), RND)[None, :]
    s = round_to(tl.load(sin + t * s_c + rp, mask=mp, other=0.0).to(tl.float32), RND)[None, :]
    m2 = mh[:, None] & mp[None, :]
    if LAYOUT == 1:  # halves (x[i], x[i + half])
        a_off, b_off = keep + rp, keep + half + rp
    else:  # pairs (x[2i], x[2i + 1])
        a_off, b_off = keep + 2 * rp, keep + 2 * rp + 1
    a = tl.load(xrow + a_off[None, :], mask=m2, other=0.0).to(tl.float32)
    b = tl.load(xrow + b_off[None, :], mask=m2, other=0.0).to(tl.float32)
    if LAYOUT == 2:  # fp32, rounded once, each pair in place
        ya, yb = a * c - b * s, b * c + a * s
    else:  # x's dtype, op by op: each product rounded, then their difference / sum
        ya = round_to(round_to(a * c, RND) - round_to(b * s, RND), RND)
        yb = round_to(round_to(b * c, RND) + round_to(a * s, RND), RND)
    ty = y.dtype.element_ty
    if LAYOUT == 0:  # [rotated evens | rotated odds]
        tl.store(yrow + (keep + rp)[None, :], ya.to(ty), mask=m2)
        tl.store(yrow + (keep + half + rp)[None, :], yb.to(ty), mask=m2)
    else:
        tl.store(yrow + a_off[None, :], ya.to(ty), mask=m2)
        tl.store(yrow + b_off[None, :], yb.to(ty), mask=m2)


def rope(x, cos, sin, layout: int, keep: int = 0):
    """kernels/cpu.py `rope`'s contract: x [n, ..., keep + dim] (last dim contiguous), cos / sin [n, dim/2];
    a new tensor in x's dtype. None where it does not apply."""
    if not (
        x.dim() >= 2
        and cos.dim() == 2
        and cos.shape == sin.shape
        and cos.shape[0] == x.shape[0]
        and x.shape[-1] == keep + 2 * cos.shape[1]
        and x.dtype in ROUND
    ):
        return None
    check_device(x, cos, sin)
    n, W, half = x.shape[0], x.shape[-1], cos.shape[1]
    x3 = x.reshape(n, -1, W)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    heads = x3.shape[1]
    y = torch.empty(n, heads, W, dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    if n and heads and half:
        BH = min(16, triton.next_power_of_2(heads))
        _rope_kernel[(n, triton.cdiv(heads, BH))](
            x3, cos, sin, y, heads, half, keep, x3.stride(0), x3.stride(1), cos.stride(0),
            LAYOUT=layout, RND=ROUND[x.dtype], BH=BH, BK=triton.next_power_of_2(max(keep, 1)),
            BP=triton.next_power_of_2(half), num_warps=4,
        )  # fmt: skip
    elif n and heads:
        y.copy_(x3)
    return y.view(x.shape)


@triton.jit
def _silu_mul_kernel(g, u, y, d, s_g, s_u, RND: tl.constexpr, BD: tl.constexpr):
    r, cb = tl.program_id(0), tl.program_id(1)
    cols = cb * BD + tl.arange(0, BD)
    m = cols < d
    gv = tl.load(g + r.to(tl.int64) * s_g + cols, mask=m, other=0.0).to(tl.float32)
    uv = tl.load(u + r.to(tl.int64) * s_u + cols, mask=m, other=0.0).to(tl.float32)
    a = round_to(gv / (1.0 + tl.exp(-gv)), RND)
    tl.store(y + r.to(tl.int64) * d + cols, (a * uv).to(y.dtype.element_ty), mask=m)


def silu_mul(gate: torch.Tensor, up: torch.Tensor):
    """layers/moe.py `silu_glu`: gate, up [..., d] (e.g. the halves of a gate|up row, last dim contiguous) ->
    [..., d]. None where it does not apply."""
    if not (gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in ROUND and gate.dim() >= 1):
        return None
    check_device(gate, up)
    d = gate.shape[-1]
    g2, u2 = gate.reshape(-1, d), up.reshape(-1, d)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if y.numel():
        BD = min(1024, triton.next_power_of_2(d))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(d, BD))](
            g2, u2, y, d, g2.stride(0), u2.stride(0), RND=ROUND[gate.dtype], BD=BD, num_warps=4
        )
    return y.view(gate.shape)
