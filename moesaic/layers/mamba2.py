"""Mamba-2 mixer of Nemotron-H in plain torch: the projections over a batch's rows at once, the conv and
the scan per sequence.

    [z | xBC | dt] = x W_in^T                         widths H*P, H*P + 2*G*N, H
    xBC  = SiLU(causal depthwise conv_K(xBC) + conv_bias)
    x, B, C = split(xBC)      x [H, P], B and C [G, N]; head h reads group h // (H/G)
    dt   = clamp(softplus(dt + dt_bias), dt_min, dt_max)          [H]
    A    = -exp(A_log)                                            [H]
    h_t  = exp(dt*A) * h_{t-1} + dt * (x_t outer B_t)             [H, P, N] fp32
    y_t  = h_t . C_t + D * x_t                                    [H, P]
    y    = grouped RMSNorm(y * SiLU(z)) * norm_weight             gate first, groups of H*P/G
    out  = y W_out^T

A prefill of n > 1 tokens runs the chunked SSD scan (segment sums inside each chunk of
`chunk_size` tokens, the state carried from chunk to chunk, starting from the state passed in,
so a prompt fed in pieces continues exactly). One token, and every token that must leave a
snapshot, runs the recurrent step. Both agree to about 1e-6 in fp32.

dt clamp convention. moesaic clamps softplus(dt + dt_bias) to [dt_min, dt_max] in BOTH the
chunked scan and the recurrent step; Nemotron-H sets the bounds to (time_step_min, inf)
(`NemotronHConfig.mamba_dims` in moesaic/models/nemotron_h.py), the bounds transformers' mixer
hard-codes (it ignores `config.time_step_limit`). transformers clamps only in its chunked (prefill) path; its decode
step (and mamba_ssm's `selective_state_update` as it calls it) uses the unclamped softplus. So
moesaic prefill equals transformers prefill, and moesaic decode equals transformers decode
except at heads/tokens where softplus(dt + dt_bias) < time_step_min, where moesaic decode
instead equals its own (and transformers') prefill. Real checkpoints do reach that region.

Numerics. Projections go through `layers.linear` (dense or packed quantized weights) in the model
dtype (bf16 or fp32). The depthwise conv and SiLU run in fp32 and are rounded to the projection
dtype, as the causal_conv1d kernel and transformers do. dt, softplus, the scan, the state and the
D skip are fp32. The gated norm multiplies the gate and normalises in fp32, casts to the norm
weight's dtype, then multiplies by the weight.

State. `Mamba2State.conv` [conv_dim, K-1] fp32 holds the last K-1 conv inputs (pre-conv xBC,
oldest first); `ssm` [H, P, N] fp32. transformers keeps K inputs (one more than needed) in the
model dtype. `mamba2_mixer` never mutates the state passed in; it returns a new one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import cpu
from ..kernels.triton import kernels
from .linear import linear
from .norms import fused_rms_norm
from .recurrent import RecurrentMixer, fold_channels, repeat_sections, unfold_channels


@dataclass(frozen=True)
class Mamba2Dims:
    hidden_size: int  # d
    num_heads: int  # H
    head_dim: int  # P
    n_groups: int  # G
    state_size: int  # N
    conv_kernel: int = 4  # K
    chunk_size: int = 128
    eps: float = 1e-5
    dt_min: float = 1e-3  # lower clamp of softplus(dt + dt_bias), in prefill and decode
    dt_max: float = math.inf

    def __post_init__(self):
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba heads {self.num_heads} not divisible by n_groups {self.n_groups}")
        if self.conv_kernel < 1 or self.chunk_size < 1:
            raise ValueError(f"conv_kernel {self.conv_kernel} and chunk_size {self.chunk_size} must be >= 1")

    @property
    def inner(self) -> int:  # H*P
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # H*P + 2*G*N
        return self.inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_dim(self) -> int:  # 2*H*P + 2*G*N + H
        return self.inner + self.conv_dim + self.num_heads

    @property
    def state_nbytes(self) -> int:
        """Bytes of one sequence's Mamba2State (fp32 conv tail + fp32 SSM state)."""
        return 4 * (self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.head_dim * self.state_size)


@dataclass
class Mamba2Weights:
    """One layer's tensors (a family binds them from its checkpoint names)."""

    in_proj: Tensor  # [2HP + 2GN + H, d]
    conv_weight: Tensor  # [conv_dim, 1, K] (or [conv_dim, K])
    conv_bias: Tensor | None  # [conv_dim]
    dt_bias: Tensor  # [H]
    A_log: Tensor  # [H]
    D: Tensor  # [H]
    norm_weight: Tensor  # [HP]
    out_proj: Tensor  # [d, HP]
    in_proj_bias: Tensor | None = None
    out_proj_bias: Tensor | None = None


@dataclass
class Mamba2State:
    conv: Tensor  # [conv_dim, K-1] fp32, last K-1 conv inputs, oldest first
    ssm: Tensor  # [H, P, N] fp32

    @classmethod
    def zeros(cls, dims: Mamba2Dims, device: torch.device | str | None = None) -> Mamba2State:
        return cls(
            conv=torch.zeros(dims.conv_dim, dims.conv_kernel - 1, dtype=torch.float32, device=device),
            ssm=torch.zeros(
                dims.num_heads, dims.head_dim, dims.state_size, dtype=torch.float32, device=device
            ),
        )

    def clone(self) -> Mamba2State:
        return Mamba2State(self.conv.clone(), self.ssm.clone())

    def copy_(self, other: Mamba2State) -> Mamba2State:
        self.conv.copy_(other.conv)
        self.ssm.copy_(other.ssm)
        return self

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


def causal_conv(xbc: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU over n new inputs `xbc` [n, C], continuing from `tail`
    [C, K-1]. Returns (SiLU(conv) [n, C] fp32, all inputs [K-1+n, C] fp32 oldest first)."""
    n, c = xbc.shape
    w = weight.reshape(c, -1).float().t()  # [K, C]
    seq = torch.cat([tail.float().t(), xbc.float()], dim=0)  # [K-1+n, C]
    # the depthwise conv as K shifted products added oldest first (after the bias), each rounded: a row's
    # sum is the same operations whatever n is (decode rows, verify blocks and prompt chunks agree), and a
    # decode row costs a quarter of F.conv1d's (2560 channels: ~150 -> ~40 us)
    out = seq[0:n] * w[0]
    if bias is not None:
        out.add_(bias.float())
    for k in range(1, w.shape[0]):
        out.add_(seq[k : k + n] * w[k])
    return F.silu(out), seq


def ssd_chunked(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """Chunked SSD scan in fp32. x [T, H, P], dt [T, H] (already softplus'ed and clamped), A [H],
    B and C [T, H, N] (groups already expanded to heads), h0 [H, P, N].
    Returns y [T, H, P] without the D skip, and the state after the last token."""
    if tk := kernels("mamba2", x):
        return tk.ssd_chunked(x, dt, A, B, C, h0, chunk)
    T = x.shape[0]
    y = torch.empty_like(x)
    h = h0
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device)
    below = torch.tril(tri, diagonal=-1)  # k > j
    lower = torch.tril(tri)  # i >= j
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        L = e - s
        xdt = x[s:e] * dt[s:e, :, None]  # [L, H, P]
        a = (A * dt[s:e]).t()  # [H, L], log decay per step
        acum = torch.cumsum(a, dim=-1)  # [H, L]
        # seg[h, i, j] = sum_{j < k <= i} a[h, k]: decay from after step j up to step i (stable form)
        seg = torch.cumsum(a[:, :, None].expand(-1, L, L).masked_fill(~below[:L, :L], 0.0), dim=1)
        decay = torch.exp(seg.masked_fill(~lower[:L, :L], -math.inf))  # [H, L(i), L(j)]
        Bc, Cc = B[s:e], C[s:e]  # [L, H, N]
        scores = torch.einsum("ihn,jhn->hij", Cc, Bc) * decay  # [H, L, L]
        y_in = torch.einsum("hij,jhp->ihp", scores, xdt)  # contributions from inside the chunk
        y_prev = (
            torch.einsum("ihn,hpn->ihp", Cc, h) * torch.exp(acum).t()[:, :, None]
        )  # from the carried state
        y[s:e] = y_in + y_prev
        to_end = decay[:, -1, :]  # [H, L] decay from after step j to the chunk end
        h = torch.exp(acum[:, -1])[:, None, None] * h + torch.einsum("jhn,hj,jhp->hpn", Bc, to_end, xdt)
    return y, h


def ssd_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """One recurrent step in fp32. x [H, P], dt [H], A [H], B and C [H, N], h [H, P, N].
    Returns y [H, P] without the D skip, and the new state."""
    if tk := kernels("mamba2", x):
        return tk.ssd_step(x, dt, A, B, C, h)
    h = torch.exp(dt * A)[:, None, None] * h + (x * dt[:, None])[:, :, None] * B[:, None, :]
    y = torch.einsum("hpn,hn->hp", h, C)
    return y, h


def gated_rmsnorm(y: Tensor, z: Tensor, weight: Tensor, groups: int, eps: float) -> Tensor:
    """RMSNorm(y * SiLU(z)) over `groups` equal slices of the last dim; fp32 math, then cast to
    the weight's dtype and scaled by it."""
    g = y.float() * F.silu(z.float())
    g = g.unflatten(-1, (groups, -1))
    # the norm in one call (CPU: the same bits): each group's rows with its slice of the weight
    normed = fused_rms_norm(g, weight.view(groups, -1), eps, None, weight.dtype, weight.dtype)
    if normed is not None:
        return normed.flatten(-2)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.flatten(-2).to(weight.dtype)


def mamba2_project(x: Tensor, w: Mamba2Weights, dims: Mamba2Dims) -> tuple[Tensor, ...]:
    """The row-wise part, for every row of a batch at once (no state): z [N, H*P] and the pre-conv xBC in
    the projection's dtype, dt [N, H] fp32 after softplus and the clamp."""
    zxbcdt = linear(x, w.in_proj, w.in_proj_bias)
    z, xbc, dt = zxbcdt.split_with_sizes([dims.inner, dims.conv_dim, dims.num_heads], -1)
    dt = F.softplus(dt.float() + w.dt_bias.float()).clamp(dims.dt_min, dims.dt_max)
    return z, xbc, dt


def mamba2_recur(
    rows: tuple[Tensor, ...], w: Mamba2Weights, dims: Mamba2Dims, state: Mamba2State, snapshot_last: int = 0
) -> tuple[Tensor, Mamba2State, list[Mamba2State]]:
    """One sequence's rows of `mamba2_project`: the causal conv from its tail and the SSM from its state.
    Returns (y [n, H*P] fp32 with the D skip, the state after the last row, snapshots as `mamba2_mixer`)."""
    _, xbc, dt = rows
    n = xbc.shape[0]
    H, P, G, N, K = dims.num_heads, dims.head_dim, dims.n_groups, dims.state_size, dims.conv_kernel
    fused = None
    if not kernels("mamba2", xbc):  # decode rows and verify blocks on the CPU: the code below in one call
        fused = cpu.mamba2_recur(
            xbc, dt, state.conv, w.conv_weight, w.conv_bias, w.A_log, w.D, state.ssm, dims, snapshot_last
        )
    if fused is not None:
        y, h, states, seq = fused
        snapshots = [
            Mamba2State(conv=_rows_to_tail(seq[t + 1 : t + K]), ssm=states[t])
            for t in range(n - snapshot_last, n)
        ]
        new_state = Mamba2State(conv=_rows_to_tail(seq[n:]), ssm=h.clone() if snapshots else h)
        return y, new_state, snapshots
    dtype = xbc.dtype
    xbc, seq = causal_conv(xbc, state.conv, w.conv_weight, w.conv_bias)
    xbc = xbc.to(dtype).float()
    xs, B, C = xbc.split_with_sizes([dims.inner, G * N, G * N], -1)
    xs = xs.reshape(n, H, P)
    B = B.reshape(n, G, N).repeat_interleave(H // G, dim=1)  # [n, H, N]
    C = C.reshape(n, G, N).repeat_interleave(H // G, dim=1)
    A = -torch.exp(w.A_log.float())

    n_scan = n - snapshot_last if n > 1 else 0
    y = torch.empty(n, H, P, dtype=torch.float32, device=xbc.device)
    h = state.ssm.float()
    if n_scan:
        y[:n_scan], h = ssd_chunked(xs[:n_scan], dt[:n_scan], A, B[:n_scan], C[:n_scan], h, dims.chunk_size)
    snapshots = []
    first = n - snapshot_last  # the first token that leaves a snapshot
    stepped = None
    if n > n_scan and not kernels("mamba2", xs):
        stepped = cpu.ssd_steps(xs[n_scan:], dt[n_scan:], A, B[n_scan:], C[n_scan:], h, snapshot_last > 0)
    if stepped is not None:  # every step in one CPU call
        y[n_scan:], h, states = stepped
        for t in range(first, n):
            snapshots.append(Mamba2State(conv=_rows_to_tail(seq[t + 1 : t + K]), ssm=states[t - n_scan]))
    else:
        for t in range(n_scan, n):
            y[t], h = ssd_step(xs[t], dt[t], A, B[t], C[t], h)
            if t >= first:
                snapshots.append(Mamba2State(conv=_rows_to_tail(seq[t + 1 : t + K]), ssm=h))
    y = y + w.D.float()[:, None] * xs
    new_state = Mamba2State(conv=_rows_to_tail(seq[n:]), ssm=h.clone() if snapshots else h)
    return y.reshape(n, dims.inner), new_state, snapshots


def mamba2_output(y: Tensor, feats: tuple[Tensor, ...], w: Mamba2Weights, dims: Mamba2Dims) -> Tensor:
    """Every row again: the gated grouped norm of y [N, H*P] by z, and the output projection."""
    out = gated_rmsnorm(y, feats[0], w.norm_weight, dims.n_groups, dims.eps)
    return linear(out, w.out_proj, w.out_proj_bias)


def _sections(dims: Mamba2Dims) -> list[int]:
    return [dims.inner, dims.n_groups * dims.state_size, dims.n_groups * dims.state_size]


def mamba2_fold(rows: list[tuple], w: Mamba2Weights, dims: Mamba2Dims, states: list[Mamba2State]):
    """B sequences' rows (the same count) and states as one sequence of B*H heads in B*G groups (head b*H+h
    reads group b*G + h // (H/G), as each sequence's own head reads its own group)."""
    B, sizes = len(states), _sections(dims)
    folded = (None, fold_channels([r[1] for r in rows], sizes), torch.cat([r[2] for r in rows], 1))
    state = Mamba2State(
        fold_channels([s.conv.t() for s in states], sizes).t(), torch.cat([s.ssm for s in states])
    )
    w = dataclasses.replace(
        w,
        conv_weight=repeat_sections(w.conv_weight, B, sizes),
        conv_bias=None if w.conv_bias is None else repeat_sections(w.conv_bias, B, sizes),
        A_log=w.A_log.repeat(B),
        D=w.D.repeat(B),
    )
    return (
        folded,
        w,
        dataclasses.replace(dims, num_heads=B * dims.num_heads, n_groups=B * dims.n_groups),
        state,
    )


def mamba2_unfold(y: Tensor, new: Mamba2State, snaps: list[Mamba2State], B: int, dims: Mamba2Dims):
    sizes, H, inner = _sections(dims), dims.num_heads, dims.inner

    def one(st: Mamba2State, b: int) -> Mamba2State:
        conv = unfold_channels(st.conv.t(), B, sizes, b).t().contiguous()
        return Mamba2State(conv, st.ssm[b * H : (b + 1) * H])

    return [(y[:, b * inner : (b + 1) * inner], one(new, b), [one(s, b) for s in snaps]) for b in range(B)]


MAMBA2 = RecurrentMixer(mamba2_project, mamba2_recur, mamba2_output, mamba2_fold, mamba2_unfold)


def mamba2_mixer(
    x: Tensor,
    w: Mamba2Weights,
    dims: Mamba2Dims,
    state: Mamba2State,
    snapshot_last: int = 0,
) -> tuple[Tensor, Mamba2State, list[Mamba2State]]:
    """Run the mixer over the n new tokens `x` [n, d] of one sequence, continuing `state`.

    Returns (y [n, d] in the out-projection's dtype, the state after the last token, snapshots).
    `snapshots[i]` is the state after token n - snapshot_last + i, so `snapshots[-1]` equals the
    new state and forgetting the last r < snapshot_last tokens restores `snapshots[-1 - r]`
    (r == snapshot_last: the state passed in). Tokens that leave a snapshot, and a lone token,
    run the recurrent step; the rest run the chunked scan. The batched engine runs the same three
    phases (MAMBA2) with the projections over all its rows."""
    n = x.shape[0]
    if not 0 <= snapshot_last <= n:
        raise ValueError(f"snapshot_last={snapshot_last} must be within [0, n={n}]")
    if n == 0:
        return x.new_zeros(0, dims.hidden_size), state, []
    return MAMBA2.run(x, w, dims, state, snapshot_last)


def _rows_to_tail(rows: Tensor) -> Tensor:
    """[K-1, C] conv inputs -> an owned [C, K-1] tail."""
    return rows.t().clone(memory_format=torch.contiguous_format)
