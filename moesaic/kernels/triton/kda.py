"""KDA (gated delta rule with per-channel decay) in Triton: the gate law, the token recurrence (decode)
and the chunked WY form (prefill). Same signatures and layouts as moesaic/layers/kda.py; everything fp32.

Inputs are head-major: q (normalised, scaled), k (normalised), g [..., n, Dk], v [..., n, Dv], beta
[..., n], S [..., Dk, Dv] where the leading dims (H, or B x H for a batch of sequences of equal n) are
independent heads, so one launch serves many sequences.

Decode (`delta_rule_recurrent`): one program per (head, Dv block) holds its [Dk, BV] slice of the
state in registers for all n tokens: the state is read once and written once, the bandwidth bound.

Prefill (`delta_rule_chunked`, the WY form of Yang et al., "Gated Delta Networks", arXiv:2412.06464,
with KDA's per-channel decay, arXiv:2510.26692): a chunk-parallel kernel forms, per chunk, the pairwise
decayed products <k_i, k_j e^{G_i - G_j}> and <q_i, k_j e^{G_i - G_j}> channel by channel (never
e^{G} / e^{G'}, which overflows), inverts the unit lower-triangular system by forward substitution and
stores the chunk's products (W, U, q e^G, k e^{G_last - G}); a second kernel carries the state through
the chunks with four tl.dot products per chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import F32_DOT, check_device, pow2, sigmoid, softplus


def _flat(t: torch.Tensor, tail: int) -> torch.Tensor:
    """fp32, contiguous, leading dims flattened to one head axis."""
    return t.float().contiguous().reshape(-1, *t.shape[t.ndim - tail :])


# ----------------------------------------------------------------------------- the gate


@triton.jit
def _gate_kernel(
    z, a_log, dt_bias, out, numel, C, Dk, lower_bound, HAS_BOUND: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < numel
    c = i % C
    u = tl.load(z + i, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + c, mask=m, other=0.0).to(
        tl.float32
    )
    rate = tl.exp(tl.load(a_log + c // Dk, mask=m, other=0.0).to(tl.float32))
    if HAS_BOUND:
        g = lower_bound * sigmoid(rate * u)
    else:
        g = -rate * softplus(u)
    tl.store(out + i, g, mask=m)


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int, lower_bound):
    """Per-channel log-decay g [n, H, Dk] fp32 from z [n, H*Dk]: Kimi Linear's law
    -exp(A_log) * softplus(z + dt_bias) when lower_bound is None, else GLM-5.3 / K3's
    lower_bound * sigmoid(exp(A_log) * (z + dt_bias))."""
    check_device(z)
    n, C = z.shape
    z = z.contiguous()
    out = torch.empty(n, C // head_dim, head_dim, dtype=torch.float32, device=z.device)
    BLOCK = 1024
    _gate_kernel[(triton.cdiv(n * C, BLOCK),)](
        z,
        A_log.contiguous(),
        dt_bias.contiguous(),
        out,
        n * C,
        C,
        head_dim,
        0.0 if lower_bound is None else float(lower_bound),
        HAS_BOUND=lower_bound is not None,
        BLOCK=BLOCK,
    )
    return out


# ----------------------------------------------------------------------------- decode


@triton.jit
def _l2norm_kernel(x, y, d, s_x, eps, BD: tl.constexpr):
    r = tl.program_id(0)
    rd = tl.arange(0, BD)
    v = tl.load(x + r.to(tl.int64) * s_x + rd, mask=rd < d, other=0.0).to(tl.float32)
    tl.store(y + r.to(tl.int64) * d + rd, v / tl.sqrt(tl.sum(v * v, axis=0) + eps), mask=rd < d)


def l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/kda.py `l2norm` of x in fp32: x / sqrt(sum(x^2) + eps) over the last axis, one launch."""
    check_device(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] and d:
        _l2norm_kernel[(x2.shape[0],)](x2, y, d, x2.stride(0), float(eps), BD=pow2(d), num_warps=1)
    return y.view(x.shape)


@triton.jit
def _conv_kernel(full, w, y, n, C, K, s_f, BN: tl.constexpr, BC: tl.constexpr):
    ri = tl.program_id(0) * BN + tl.arange(0, BN)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mi, mc = ri < n, rc < C
    m2 = mi[:, None] & mc[None, :]
    acc = tl.zeros([BN, BC], dtype=tl.float32)
    for j in range(0, K):  # tap j reads row i + j of the padded input, taps in order (the reference's sum)
        wj = tl.load(w + rc * K + j, mask=mc, other=0.0).to(tl.float32)
        acc += (
            tl.load(full + (ri + j)[:, None].to(tl.int64) * s_f + rc[None, :], mask=m2, other=0.0)
            * wj[None, :]
        )
    tl.store(y + ri[:, None].to(tl.int64) * C + rc[None, :], acc * sigmoid(acc), mask=m2)


def short_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor):
    """layers/kda.py `short_conv`: the causal depthwise conv + SiLU of x [n, C] continuing from tail [K-1, C],
    weight [C, K], in fp32 -> (y [n, C], the padded input [K-1+n, C]); the taps in one launch."""
    check_device(x, tail, weight)
    n, C = x.shape
    K = weight.shape[-1]
    full = torch.cat([tail.float(), x.float()])
    w = weight.float().contiguous()
    y = torch.empty(n, C, dtype=torch.float32, device=x.device)
    if n and C:
        BN, BC = min(16, pow2(n, 1)), 256
        _conv_kernel[(triton.cdiv(n, BN), triton.cdiv(C, BC))](
            full, w, y, n, C, K, full.stride(0), BN=BN, BC=BC
        )
    return y, full


@triton.jit
def _recurrent_kernel(
    q, k, v, g, beta, s_in, s_out, o, states, n, Dk, Dv,
    KEEP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    nh = tl.num_programs(0)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < Dk, rv < Dv
    m2 = mk[:, None] & mv[None, :]
    soff = rk[:, None] * Dv + rv[None, :]
    S = tl.load(s_in + h * Dk * Dv + soff, mask=m2, other=0.0)
    for t in range(n):
        row = h * n + t
        k_t = tl.load(k + row * Dk + rk, mask=mk, other=0.0)
        q_t = tl.load(q + row * Dk + rk, mask=mk, other=0.0)
        g_t = tl.load(g + row * Dk + rk, mask=mk, other=0.0)
        v_t = tl.load(v + row * Dv + rv, mask=mv, other=0.0)
        b_t = tl.load(beta + row)
        S = S * tl.exp(g_t)[:, None]
        u = b_t * (v_t - tl.sum(k_t[:, None] * S, axis=0))
        S = S + k_t[:, None] * u[None, :]
        tl.store(o + row * Dv + rv, tl.sum(q_t[:, None] * S, axis=0), mask=mv)
        if KEEP:
            tl.store(states + (t * nh + h) * Dk * Dv + soff, S, mask=m2)
    tl.store(s_out + h * Dk * Dv + soff, S, mask=m2)


def delta_rule_recurrent(q, k, v, g, beta, S, keep_states: bool = False):
    """Token by token. q, k, g [..., n, Dk], v [..., n, Dv], beta [..., n], S [..., Dk, Dv].
    Returns (o [..., n, Dv], final S, the state after every token [n, ..., Dk, Dv] when keep_states)."""
    check_device(q)
    lead, n, Dk = q.shape[:-2], q.shape[-2], q.shape[-1]
    Dv = v.shape[-1]
    qf, kf, gf, vf = _flat(q, 2), _flat(k, 2), _flat(g, 2), _flat(v, 2)
    bf, Sf = _flat(beta, 1), _flat(S, 2)
    G = qf.shape[0]
    o = torch.empty(G, n, Dv, dtype=torch.float32, device=q.device)
    S_out = torch.empty_like(Sf)
    keep = keep_states and n > 0
    states = torch.empty(n if keep else 1, G, Dk, Dv, dtype=torch.float32, device=q.device)
    BV = min(32, pow2(Dv))
    _recurrent_kernel[(G, triton.cdiv(Dv, BV))](
        qf, kf, vf, gf, bf, Sf, S_out, o, states, n, Dk, Dv, KEEP=keep, BK=pow2(Dk), BV=BV, num_warps=4
    )
    kept = states.view(n, *lead, Dk, Dv) if keep else None
    return o.view(*lead, n, Dv), S_out.view(*lead, Dk, Dv), kept


# ----------------------------------------------------------------------------- prefill


@triton.jit
def _chunk_prep_kernel(
    q, k, v, g, beta, a_out, w_out, u_out, qg_out, kend_out, gl_out, n, Dk, Dv,
    BT: tl.constexpr, BKC: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Per (head, chunk), with G the chunk's inclusive cumulative decay and T = (I + tril(beta_i
    <k_i, k_j e^{G_i-G_j}>, -1))^-1 (forward substitution), everything the state pass needs:
    A = tril(<q_i, k_j e^{G_i-G_j}>), W = T (beta k e^G), U = T (beta v), q e^G, k e^{G_last-G}, e^{G_last}.
    Then u = U - W S, o = (q e^G) S + A u and S' = e^{G_last} S + (k e^{G_last-G})ᵀ u."""
    h, c = tl.program_id(0), tl.program_id(1)
    nc = tl.num_programs(1)
    ri = tl.arange(0, BT)
    t = c * BT + ri
    mt = t < n
    row = h * n + t
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    lower = ri[:, None] >= ri[None, :]
    for c0 in range(0, Dk, BKC):  # the pairwise decays, channel by channel: a [BT, BT, BKC] tile
        rc = c0 + tl.arange(0, BKC)
        m2 = mt[:, None] & (rc < Dk)[None, :]
        off = row[:, None] * Dk + rc[None, :]
        k_c = tl.load(k + off, mask=m2, other=0.0)
        q_c = tl.load(q + off, mask=m2, other=0.0)
        G = tl.cumsum(tl.load(g + off, mask=m2, other=0.0), axis=0)  # [BT, BKC]
        e = tl.exp(tl.where(lower[:, :, None], G[:, None, :] - G[None, :, :], float("-inf")))  # <= 1
        kj = k_c[None, :, :] * e
        kk += tl.sum(k_c[:, None, :] * kj, axis=2)
        qk += tl.sum(q_c[:, None, :] * kj, axis=2)
    b = tl.load(beta + row, mask=mt, other=0.0)
    L = tl.where(ri[:, None] > ri[None, :], b[:, None] * kk, 0.0)
    T = tl.where(ri[:, None] == ri[None, :], 1.0, 0.0)
    for i in range(1, BT):  # T_i = e_i - sum_{j<i} L_ij T_j
        l_i = tl.sum(tl.where(ri[:, None] == i, L, 0.0), axis=0)
        t_i = tl.where(ri == i, 1.0, -tl.sum(l_i[:, None] * T, axis=0))
        T = tl.where(ri[:, None] == i, t_i[None, :], T)
    off2 = ((h * nc + c) * BT + ri)[:, None] * BT + ri[None, :]
    tl.store(a_out + off2, tl.where(lower, qk, 0.0))
    for c0 in range(0, Dk, BD):
        rc = c0 + tl.arange(0, BD)
        mc = rc < Dk
        m2 = mt[:, None] & mc[None, :]
        off = row[:, None] * Dk + rc[None, :]
        k_c = tl.load(k + off, mask=m2, other=0.0)
        g_c = tl.load(g + off, mask=m2, other=0.0)  # padded rows add 0 to the sums
        G = tl.cumsum(g_c, axis=0)
        G_last = tl.sum(g_c, axis=0)
        eG = tl.exp(G)
        w = tl.dot(T, b[:, None] * k_c * eG, input_precision=F32_DOT)
        tl.store(w_out + off, w, mask=m2)
        tl.store(qg_out + off, tl.load(q + off, mask=m2, other=0.0) * eG, mask=m2)
        tl.store(kend_out + off, k_c * tl.exp(G_last[None, :] - G), mask=m2)
        tl.store(gl_out + (h * nc + c) * Dk + rc, tl.exp(G_last), mask=mc)
    for v0 in range(0, Dv, BD):
        rv = v0 + tl.arange(0, BD)
        m2 = mt[:, None] & (rv < Dv)[None, :]
        voff = row[:, None] * Dv + rv[None, :]
        u = tl.dot(T, b[:, None] * tl.load(v + voff, mask=m2, other=0.0), input_precision=F32_DOT)
        tl.store(u_out + voff, u, mask=m2)


@triton.jit
def _chunk_scan_kernel(
    a_in, w_in, u_in, qg_in, kend_in, gl_in, s_in, s_out, o, n, Dk, Dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (head, Dv block): the state through every chunk, from _chunk_prep_kernel's products."""
    h = tl.program_id(0)
    nc = tl.cdiv(n, BT)
    ri = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < Dk, rv < Dv
    soff = rk[:, None] * Dv + rv[None, :]
    S = tl.load(s_in + h * Dk * Dv + soff, mask=mk[:, None] & mv[None, :], other=0.0)
    for c in range(nc):
        row = h * n + c * BT + ri
        mt = c * BT + ri < n
        koff = row[:, None] * Dk + rk[None, :]
        voff = row[:, None] * Dv + rv[None, :]
        mkt, mvt = mt[:, None] & mk[None, :], mt[:, None] & mv[None, :]
        W = tl.load(w_in + koff, mask=mkt, other=0.0)
        u = tl.load(u_in + voff, mask=mvt, other=0.0) - tl.dot(W, S, input_precision=F32_DOT)
        A = tl.load(a_in + ((h * nc + c) * BT + ri)[:, None] * BT + ri[None, :])
        Qg = tl.load(qg_in + koff, mask=mkt, other=0.0)
        o_c = tl.dot(Qg, S, input_precision=F32_DOT) + tl.dot(A, u, input_precision=F32_DOT)
        tl.store(o + voff, o_c, mask=mvt)
        Ke = tl.load(kend_in + koff, mask=mkt, other=0.0)
        gl = tl.load(gl_in + (h * nc + c) * Dk + rk, mask=mk, other=1.0)
        S = gl[:, None] * S + tl.dot(tl.trans(Ke), u, input_precision=F32_DOT)
    tl.store(s_out + h * Dk * Dv + soff, S, mask=mk[:, None] & mv[None, :])


def delta_rule_chunked(q, k, v, g, beta, S, chunk_size: int = 64):
    """The chunked (WY) form; arguments as `delta_rule_recurrent`. Returns (o, final S).
    `chunk_size` is the chunk of the WY form, a power of two in 16..32 here (other values are rounded
    to one: the result is the same to fp32 rounding whatever the chunk; 32 keeps the state pass's
    tiles in sm_90's registers)."""
    check_device(q)
    lead, n, Dk = q.shape[:-2], q.shape[-2], q.shape[-1]
    Dv = v.shape[-1]
    qf, kf, gf, vf = _flat(q, 2), _flat(k, 2), _flat(g, 2), _flat(v, 2)
    bf, Sf = _flat(beta, 1), _flat(S, 2)
    G = qf.shape[0]
    BT = min(32, pow2(chunk_size))
    nc = triton.cdiv(n, BT)
    o = torch.empty(G, n, Dv, dtype=torch.float32, device=q.device)
    S_out = torch.empty_like(Sf)
    if n == 0:
        S_out.copy_(Sf)
        return o.view(*lead, n, Dv), S_out.view(*lead, Dk, Dv)
    A = torch.empty(G, nc, BT, BT, dtype=torch.float32, device=q.device)
    W, Qg, Ke = torch.empty_like(qf), torch.empty_like(qf), torch.empty_like(qf)
    U = torch.empty_like(vf)
    gl = torch.empty(G, nc, Dk, dtype=torch.float32, device=q.device)
    BKC = min(16, 16384 // (BT * BT))  # the [BT, BT, BKC] pairwise tiles stay within registers
    _chunk_prep_kernel[(G, nc)](
        qf, kf, vf, gf, bf, A, W, U, Qg, Ke, gl, n, Dk, Dv, BT=BT, BKC=BKC, BD=32, num_warps=8
    )
    BV = 16
    _chunk_scan_kernel[(G, triton.cdiv(Dv, BV))](
        A, W, U, Qg, Ke, gl, Sf, S_out, o, n, Dk, Dv, BT=BT, BK=pow2(Dk), BV=BV, num_warps=8, num_stages=1
    )
    return o.view(*lead, n, Dv), S_out.view(*lead, Dk, Dv)
