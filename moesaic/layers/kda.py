"""Kimi Delta Attention (KDA): the linear-attention mixer of Kimi Linear, GLM-5.3 and Kimi K3.

Plain torch. The projections are row-wise and run over a whole batch at once; the short conv and the
recurrence continue each sequence's `KdaState` on that sequence's rows (layers/recurrent.py).

    qkv    = SiLU(causal depthwise conv_K([x Wq | x Wk | x Wv]))      # continues from the conv tail
    g      = gate law(f_b(f_a(x)) + dt_bias, A_log)                   # [n, H, Dk] log-decay, < 0
    beta   = sigmoid(x Wb)                                            # [n, H]
    q, k   = l2norm(q) / sqrt(Dk), l2norm(k)                          # eps inside the sqrt
    S_t    = diag(exp g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_tᵀ k_t))ᵀ;  o_t = S_tᵀ q_t
    out    = (RMSNorm_head(o) * sigmoid(output gate(x))) Wo

The three families differ in two places, both carried by `KdaDims`:
  - the gate law: `lower_bound=None` is Kimi Linear's `-exp(A_log) * softplus(z + dt_bias)`;
    a number (GLM-5.3 and K3: -5.0) is `lower_bound * sigmoid(exp(A_log) * (z + dt_bias))`,
    a different function, not a clamp. GLM-5.3 with a null bound and K3's 0.40B twin use the
    Kimi Linear law, so the law is a config value, not a family.
  - the output gate: low rank `g_b_proj(g_a_proj(x))` (Kimi Linear, GLM-5.3) or full rank
    `g_proj(x)` (K3).
K3's reference kernel takes beta as a logit and applies the sigmoid inside the step; that is the
same math as the sigmoid before the kernel, and here it is always taken in fp32.

The recurrent state S is [H, Dk, Dv] fp32 (key axis first, as transformers/FLA store it) and
is advanced in fp32. On GPUs prefill uses the chunked (WY) form and decode the token recurrence;
they agree to fp32 rounding. On the CPU every row takes the token recurrence (`kda_attend`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import cpu
from ..kernels.triton import kernels
from .linear import RowStack, linear, operand, products, replacement, stack_rows
from .norms import fused_rms_norm
from .recurrent import RecurrentMixer, fold_channels, repeat_sections, unfold_channels

L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class KdaDims:
    """The shapes and the per-family choices of one KDA layer."""

    hidden_size: int
    num_heads: int
    head_dim: int  # Dk = Dv
    conv_kernel: int = 4
    lower_bound: float | None = None  # None: Kimi Linear law; -5.0: GLM-5.3 / K3 law
    full_rank_gate: bool = False  # K3's g_proj instead of g_a_proj -> g_b_proj
    norm_eps: float = 1e-5  # o_norm, = rms_norm_eps
    chunk_size: int = 64  # prefill chunk of the WY form

    @classmethod
    def for_variant(
        cls, variant: str, hidden_size: int, num_heads: int, head_dim: int, **overrides
    ) -> KdaDims:
        """Defaults of each family: "kimi_linear", "glm5_next" or "kimi_k3"; overrides win
        (e.g. `lower_bound=None` for a GLM config with a null bound or K3's 0.40B twin)."""
        defaults = {
            "kimi_linear": dict(lower_bound=None, full_rank_gate=False),
            "glm5_next": dict(lower_bound=-5.0, full_rank_gate=False),
            "kimi_k3": dict(lower_bound=-5.0, full_rank_gate=True),
        }
        if variant not in defaults:
            raise ValueError(f"unknown KDA variant {variant!r}; expected one of {sorted(defaults)}")
        return cls(hidden_size, num_heads, head_dim, **{**defaults[variant], **overrides})

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass
class KdaState:
    """Per-sequence KDA state of one layer.

    conv:      [K-1, 3 * H * Dk] fp32, the last K-1 inputs of the q|k|v short convolutions,
               oldest first (channels in q, k, v order, as the fused conv weight).
    recurrent: [H, Dk, Dv] fp32.
    """

    conv: Tensor
    recurrent: Tensor

    @classmethod
    def zeros(cls, dims: KdaDims, device: torch.device | str | None = None) -> KdaState:
        return cls(
            conv=torch.zeros(dims.conv_kernel - 1, 3 * dims.qkv_dim, dtype=torch.float32, device=device),
            recurrent=torch.zeros(
                dims.num_heads, dims.head_dim, dims.head_dim, dtype=torch.float32, device=device
            ),
        )

    def clone(self) -> KdaState:
        return KdaState(self.conv.clone(), self.recurrent.clone())

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    @staticmethod
    def nbytes_for(dims: KdaDims) -> int:
        """Bytes of one state, from the config alone (the state planner's number)."""
        return 4 * (
            (dims.conv_kernel - 1) * 3 * dims.qkv_dim + dims.num_heads * dims.head_dim * dims.head_dim
        )


@dataclass
class KdaWeights:
    """One KDA layer's tensors (field names after the releases' modules; bound by models/parts.py bind_kda)."""

    q_proj: Tensor  # [H*Dk, d]
    k_proj: Tensor
    v_proj: Tensor
    conv: Tensor  # [3*H*Dk, K] fp32: q_conv1d | k_conv1d | v_conv1d (transformers' fused conv1d)
    f_a_proj: Tensor  # [Dk, d]
    f_b_proj: Tensor  # [H*Dk, Dk]
    dt_bias: Tensor  # [H*Dk]
    A_log: Tensor  # [H] (stored wider in K3: the first H are used)
    b_proj: Tensor  # [H, d]
    o_norm: Tensor  # [Dv]
    o_proj: Tensor  # [d, H*Dv]
    g_a_proj: Tensor | None = None  # [Dv, d]        low-rank output gate
    g_b_proj: Tensor | None = None  # [H*Dv, Dv]
    g_proj: Tensor | None = None  # [H*Dv, d]       full-rank output gate (K3)
    # q | k | v | f_a | b | g or g_a (every product of the layer input) stacked by rows (`stack_inputs`): one
    # kernel call and one longer weight stream at decode sizes; the fields above are views of its rows
    x_stack: RowStack | None = None


# ----------------------------------------------------------------------------- pieces


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis (FLA's form: eps inside the sqrt)."""
    if x.dtype == torch.float32 and (tk := kernels("kda", x)):  # one launch on a GPU
        return tk.l2norm(x, eps)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def short_conv(x: Tensor, tail: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv + SiLU over x [n, C] continuing from tail [K-1, C]; fp32.
    weight [C, K] (last tap = current token). Returns (y [n, C] fp32, the padded input [K-1+n, C])."""
    if tk := kernels("kda", x):
        return tk.short_conv(x, tail, weight)
    n, K = x.shape[0], weight.shape[-1]
    full = torch.cat([tail.float(), x.float()])
    w = weight.float()
    y = full[0:n] * w[:, 0]
    for j in range(1, K):
        y = y + full[j : j + n] * w[:, j]
    return F.silu(y), full


def kda_gate(z: Tensor, A_log: Tensor, dt_bias: Tensor, head_dim: int, lower_bound: float | None) -> Tensor:
    """Per-channel log-decay g [n, H, Dk] fp32 from z = f_b(f_a(x)) [n, H*Dk].

    lower_bound None: g = -exp(A_log[h]) * softplus(z + dt_bias)          (Kimi Linear)
    lower_bound lb:   g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias))     (GLM-5.3, K3)"""
    if tk := kernels("kda", z):
        return tk.kda_gate(z, A_log, dt_bias, head_dim, lower_bound)
    u = (z.float() + dt_bias.float()).view(z.shape[0], -1, head_dim)
    rate = torch.exp(A_log.float()).view(1, -1, 1)
    if lower_bound is None:
        return -rate * F.softplus(u, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(rate * u)


def gated_head_rmsnorm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over each head's Dv values, times the weight, times sigmoid(gate); all fp32."""
    normed = fused_rms_norm(o, weight, eps, None, None, torch.float32)  # one call (CPU: the same bits)
    if normed is None:
        o = o.float()
        normed = weight.float() * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps))
    return normed * torch.sigmoid(gate.float())


# ----------------------------------------------------------------------------- the recurrence
# Inner forms take prepared inputs in head-major layout: q (normalised, scaled) and k
# (normalised) [H, n, Dk], v [H, n, Dv], g [H, n, Dk], beta [H, n], S [H, Dk, Dv]; all fp32.


def delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, keep_states: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Token by token. Returns (o [H, n, Dv], final S, the state after every token [n, H, Dk, Dv]
    when keep_states)."""
    if tk := kernels("kda", q):
        return tk.delta_rule_recurrent(q, k, v, g, beta, S, keep_states)
    if (out := cpu.delta_rule(q, k, v, g, beta, S, keep_states)) is not None:
        return out
    return delta_rule_loop(q, k, v, g, beta, S, keep_states)


def delta_rule_loop(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, keep_states: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """delta_rule_recurrent in torch ops (the reference of the CPU kernel)."""
    n = q.shape[1]
    o = v.new_empty(v.shape)
    states = [] if keep_states else None
    for t in range(n):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        k_t = k[:, t]
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hk,hkv->hv", k_t, S))
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        o[:, t] = torch.einsum("hk,hkv->hv", q[:, t], S)
        if keep_states:
            states.append(S)
    return o, S, (torch.stack(states) if keep_states and n else None)


def delta_rule_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """The chunked (WY) form. Inside a chunk with inclusive cumulative decay G_i = sum_{j<=i} g_j:

        u_i = beta_i (v_i - (k_i * e^{G_i})ᵀ S0 - sum_{j<i} <k_i, k_j e^{G_i - G_j}> u_j)
        o_i = (q_i * e^{G_i})ᵀ S0 + sum_{j<=i} <q_i, k_j e^{G_i - G_j}> u_j
        S   = e^{G_last} S0 + sum_j (k_j e^{G_last - G_j}) u_jᵀ

    The u's solve a unit lower-triangular system. Pairwise decays are taken as exp of
    differences of the cumulative sums (never e^{G} / e^{G'}, which overflows)."""
    if tk := kernels("kda", q):
        return tk.delta_rule_chunked(q, k, v, g, beta, S, chunk_size)
    H, n, _ = q.shape
    o = v.new_empty(v.shape)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        c = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e, None]
        G = torch.cumsum(g[:, s:e], dim=1)
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = (
            (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~lower[..., None], float("-inf")).exp()
        )  # [H,c,c,Dk]
        kk = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay)
        qk = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)
        system = (bc * kk).tril(-1) + torch.eye(c, dtype=q.dtype, device=q.device)
        rhs = bc * (vc - (kc * G.exp()) @ S)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        o[:, s:e] = (qc * G.exp()) @ S + qk @ u
        G_last = G[:, -1]
        S = G_last.exp().unsqueeze(-1) * S + (kc * (G_last.unsqueeze(1) - G).exp()).transpose(1, 2) @ u
    return o, S


def kda_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None,
    chunk_size: int = 64,
    snapshot_last: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The KDA core for one sequence.

    q, k [n, H, Dk] (raw: l2-normalised here, q also scaled by Dk^-0.5), v [n, H, Dv],
    g [n, H, Dk] log-decay, beta [n, H] in (0, 1), state [H, Dk, Dv] or None (zeros).
    Returns o [n, H, Dv] fp32, the new state [H, Dk, Dv] fp32, and snapshots
    [snapshot_last, H, Dk, Dv]: the state after each of the last `snapshot_last` tokens.

    On the CPU every token takes the token recurrence: its compiled kernel runs 30-40x the chunked
    form there, and the torch loop 2-7x (docs/perf.md), and a state's bits then do not depend on
    where a prompt was split. Elsewhere the first n - snapshot_last tokens use the chunked form
    when there are more than one and the last `snapshot_last` tokens the token recurrence. Either
    way a sequence restored from a snapshot and re-fed the same tokens with the same
    `snapshot_last` repeats bit for bit."""
    n, H, Dk = k.shape
    if not 0 <= snapshot_last <= n:
        raise ValueError(f"snapshot_last={snapshot_last} must be within [0, {n}]")
    q = (l2norm(q.float()) * Dk**-0.5).transpose(0, 1)
    k = l2norm(k.float()).transpose(0, 1)
    v, g, beta = v.float().transpose(0, 1), g.float().transpose(0, 1), beta.float().transpose(0, 1)
    S = (
        torch.zeros(H, Dk, v.shape[-1], dtype=torch.float32, device=q.device)
        if state is None
        else state.float()
    )

    m = n - snapshot_last
    parts = []
    if m > 1 and not kda_stepped(q):
        o, S = delta_rule_chunked(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], S, chunk_size)
        parts.append(o)
    elif m >= 1:
        o, S, _ = delta_rule_recurrent(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], S)
        parts.append(o)
    snapshots = S.new_empty(0, *S.shape)
    if snapshot_last:
        o, S, snapshots = delta_rule_recurrent(q[:, m:], k[:, m:], v[:, m:], g[:, m:], beta[:, m:], S, True)
        parts.append(o)
    o = torch.cat(parts, dim=1) if parts else v.new_empty(v.shape)
    return o.transpose(0, 1).contiguous(), S, snapshots


# ----------------------------------------------------------------------------- the block


def stack_inputs(w: KdaWeights) -> KdaWeights:
    """w with its six products of the layer input (q, k, v, f_a, b, then g or g_a) stacked by rows into one
    weight (layers/linear.stack_rows), where all six stack together (dense bf16, or packed in one scale
    layout); its fields become views of the stack's rows (no memory added). Unchanged otherwise."""
    gate = "g_proj" if w.g_proj is not None else "g_a_proj"
    fields = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", gate)
    stacks = stack_rows([getattr(w, f) for f in fields])
    if len(stacks) != 1 or len(stacks[0].parts) != len(fields):
        return w
    swap = replacement(stacks)
    return dataclasses.replace(w, x_stack=stacks[0], **{f: swap[id(getattr(w, f))] for f in fields})


def _project_operands(w: KdaWeights) -> tuple[list, tuple]:
    """kda_project's operands as cpu.kda_project takes them: (q, k, v, f_a, f_b, b, then g or g_a, g_b), or the
    stack of x's six products, then f_b (and g_b); and the stack's part sizes (() without one)."""
    low_rank = [] if w.g_proj is not None else [w.g_b_proj]
    if w.x_stack is not None:
        mats, stacked = [w.x_stack.weight, w.f_b_proj] + low_rank, w.x_stack.sizes
    else:
        mats, stacked = [w.q_proj, w.k_proj, w.v_proj, w.f_a_proj, w.f_b_proj, w.b_proj], ()
        mats += [w.g_proj] if w.g_proj is not None else [w.g_a_proj, w.g_b_proj]
    return [operand(m) for m in mats], stacked


def kda_row(x: Tensor, w: KdaWeights, dims: KdaDims, state: KdaState) -> tuple[Tensor, KdaState] | None:
    """The mixer for one decode row of one sequence in one compiled call on the CPU (cpu.kda_block:
    kda_project, kda_recur and kda_output's operations in their order, the same bits, one crossing from Python
    instead of ~10): (y [1, d], the new state), or None where it does not apply (the three phases run)."""
    if kernels("kda", x) or x.shape[0] != 1:
        return None
    ops, stacked = _project_operands(w)
    got = cpu.kda_block(
        x, ops, w.A_log, w.dt_bias, dims.head_dim, dims.lower_bound, stacked, state.conv, w.conv,
        state.recurrent, L2NORM_EPS, w.o_norm, dims.norm_eps, operand(w.o_proj),
    )  # fmt: skip
    if got is None:
        return None
    y, S, full = got
    return y, KdaState(conv=full[1:], recurrent=S)  # the conv tail after the row: as kda_recur keeps it


def kda_project(x: Tensor, w: KdaWeights, dims: KdaDims) -> tuple[Tensor, ...]:
    """The row-wise part before the recurrence, for every row of a batch at once (no state): the q|k|v
    projections [N, 3HD] in x's dtype, the log-decay g [N, H, Dk] and beta [N, H] in fp32, the output
    gate's projection [N, H*Dv]."""
    if not kernels("kda", x):  # decode rows and verify blocks on the CPU: the code below in one call
        ops, stacked = _project_operands(w)
        fused = cpu.kda_project(x, ops, w.A_log, w.dt_bias, dims.head_dim, dims.lower_bound, stacked)
        if fused is not None:
            return fused
    # on a GPU the stacked six in one product (on the CPU each its own, as before: their bits at prefill)
    stacks = (w.x_stack,) if w.x_stack is not None and kernels("quant", x) else ()
    lin = products(x, stacks)
    qkv = torch.cat([lin(w.q_proj), lin(w.k_proj), lin(w.v_proj)], dim=-1)
    g = kda_gate(linear(lin(w.f_a_proj), w.f_b_proj), w.A_log, w.dt_bias, dims.head_dim, dims.lower_bound)
    beta = torch.sigmoid(lin(w.b_proj).float())
    gate = lin(w.g_proj) if w.g_proj is not None else linear(lin(w.g_a_proj), w.g_b_proj)
    return qkv, g, beta, gate


def kda_recur(
    rows: tuple[Tensor, ...], w: KdaWeights, dims: KdaDims, state: KdaState, snapshot_last: int = 0
) -> tuple[Tensor, KdaState, list[KdaState]]:
    """One sequence's rows of `kda_project`: the short conv from its tail and the delta rule from its state.
    Returns (o [n, H, Dv] fp32, the state after the last row, the states after each of the last
    `snapshot_last` rows, oldest first)."""
    qkv, g, beta, _ = rows
    n, H, D, K = qkv.shape[0], dims.num_heads, dims.head_dim, dims.conv_kernel
    fused = (
        None
        if kernels("kda", qkv)
        else cpu.kda_recur(qkv, g, beta, state.conv, w.conv, state.recurrent, H, D, snapshot_last, L2NORM_EPS)
    )
    if fused is not None:  # the CPU: the code below in one call
        o, S, snaps, full = fused
    else:
        y, full = short_conv(qkv, state.conv, w.conv)
        q, k, v = y.to(qkv.dtype).view(n, 3, H, D).unbind(1)
        o, S, snaps = kda_attend(q, k, v, g, beta, state.recurrent, dims.chunk_size, snapshot_last)
    tail = full[full.shape[0] - (K - 1) :]
    # a lone row's tail is all of full but its first row: kept as that view (a longer forward's is copied, so
    # that the rest of full is freed)
    new_state = KdaState(conv=tail if n == 1 else tail.clone(), recurrent=S)
    # after new token t the conv tail is full[t+1 : t+K]
    snapshots = [
        KdaState(conv=full[t + 1 : t + K].clone(), recurrent=snaps[i])
        for i, t in enumerate(range(n - snapshot_last, n))
    ]
    return o, new_state, snapshots


def kda_output(o: Tensor, feats: tuple[Tensor, ...], w: KdaWeights, dims: KdaDims) -> Tensor:
    """Every row again: the gated head norm of o [N, H, Dv] and the output projection, in the gate's dtype."""
    gate = feats[3]
    N, H, D = o.shape
    o = gated_head_rmsnorm(o, gate.view(N, H, D), w.o_norm, dims.norm_eps).to(gate.dtype)
    return linear(o.reshape(N, H * D), w.o_proj)


def kda_fold(rows: list[tuple], w: KdaWeights, dims: KdaDims, states: list[KdaState]):
    """B sequences' rows (the same count) and states as one sequence of B*H heads (layers/recurrent.py)."""
    B, sizes = len(states), 3 * [dims.qkv_dim]  # q | k | v
    folded = (
        fold_channels([r[0] for r in rows], sizes),
        torch.cat([r[1] for r in rows], 1),  # g [n, B*H, Dk]
        torch.cat([r[2] for r in rows], 1),  # beta [n, B*H]
        None,
    )
    state = KdaState(fold_channels([s.conv for s in states], sizes), torch.cat([s.recurrent for s in states]))
    w = dataclasses.replace(w, conv=repeat_sections(w.conv, B, sizes))
    return folded, w, dataclasses.replace(dims, num_heads=B * dims.num_heads), state


def kda_unfold(o: Tensor, new: KdaState, snaps: list[KdaState], B: int, dims: KdaDims):
    sizes, H = 3 * [dims.qkv_dim], dims.num_heads

    def one(st: KdaState, b: int) -> KdaState:
        return KdaState(unfold_channels(st.conv, B, sizes, b), st.recurrent[b * H : (b + 1) * H])

    return [(o[:, b * H : (b + 1) * H], one(new, b), [one(s, b) for s in snaps]) for b in range(B)]


def kda_stepped(t: Tensor) -> bool:
    """Whether KDA's rows over tensors like t all take the token recurrence (kda_attend: the CPU without
    Triton kernels), so a prompt need not snapshot its last rows for their bits (layers/recurrent.py)."""
    return t.is_cpu and not kernels("kda", t)


KDA = RecurrentMixer(kda_project, kda_recur, kda_output, kda_fold, kda_unfold, kda_stepped, kda_row)


def kda_mixer(
    x: Tensor, w: KdaWeights, dims: KdaDims, state: KdaState | None = None, *, snapshot_last: int = 0
) -> tuple[Tensor, KdaState, list[KdaState]]:
    """The whole KDA block for one sequence's new tokens x [n, d] (the normed block input).

    Returns (out [n, d] in x's dtype, the state after the last token, and the states after
    each of the last `snapshot_last` tokens, oldest first, for exact speculative rollback).
    `state` is not modified. Projections run in the weights' dtype; the conv, the gate, the
    recurrence and the gated norm run in fp32, cast back where transformers casts back.
    The batched engine runs the same three phases (KDA) with the projections over all its rows."""
    return KDA.run(
        x, w, dims, state if state is not None else KdaState.zeros(dims, device=x.device), snapshot_last
    )
