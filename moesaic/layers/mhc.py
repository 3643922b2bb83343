"""Manifold-constrained hyper-connections (mHC): the residual as n parallel streams.

Used by GLM-5.3-Flash and DeepSeek-V4 (reference/glm5next.md §3, reference/deepseek_v4.md §2.1,
§3.1). The embedding is copied into n = hc_mult streams h [N, n, d]. Each sub-block (attention,
FFN) is one "site" with weights fn [(2+n)·n, n·d], base [(2+n)·n], scale [3]:

    m     = (flat(h) · rsqrt(mean(flat(h)²) + norm_eps)) @ fnᵀ      # fp32; one projection, 1/RMS scaled
    pre   = sigmoid(m[:n]   · scale[0] + base[:n]) + hc_eps          # [n]   collapse weights
    post  = 2 · sigmoid(m[n:2n] · scale[1] + base[n:2n])             # [n]   expand weights
    comb  = sinkhorn(m[2n:] · scale[2] + base[2n:])                  # [n, n] doubly stochastic
    x     = Σ_j pre[j] h[j]                                          # the block's input (then its norm)
    h'[k] = post[k] · block(x) + Σ_j comb[j, k] h[j]                 # contraction over the FIRST index

sinkhorn: row softmax + hc_eps, one column normalisation, then iters − 1 rounds of (row, column),
each dividing by (sum + hc_eps). comb is not symmetric: contracting over the wrong index is a
silent bug.

Final collapse: GLM takes the unweighted mean of the streams (`head_mean`); DeepSeek-V4 a weighted
hyper head (`head_weighted`: hc_fn [n, n·d], hc_base [n], hc_scale [1]); V4.1's delayed pre
collapses with the previous site's `pre`, which `site_maps` + `collapse` express directly.

Coefficients are computed in fp32 from the streams whatever their dtype; the streams stay in the
model dtype (as transformers keeps them) and `post`/`comb` are cast to it for the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import cpu
from ..kernels.triton import kernels
from . import norms
from .norms import fused_rms_norm, unit_weight


@dataclass(frozen=True)
class MhcDims:
    hc_mult: int  # n, the number of streams
    sinkhorn_iters: int = 20
    hc_eps: float = 1e-6  # floor added to pre, to comb after the softmax and to every Sinkhorn divisor
    norm_eps: float = 1e-6  # eps of the unweighted RMS of the flattened streams (= rms_norm_eps: GLM 1e-5)

    @property
    def site_width(self) -> int:
        """Rows of a site's `fn` (and length of its `base`): pre n + post n + comb n·n."""
        return (2 + self.hc_mult) * self.hc_mult


@dataclass(frozen=True)
class MhcSite:
    """One site's weights: fn [(2+n)·n, n·d], base [(2+n)·n], scale [3] (pre, post, comb)."""

    fn: Tensor
    base: Tensor
    scale: Tensor

    def __post_init__(self):  # the maps are computed in fp32: convert the small vectors once, not per step
        object.__setattr__(self, "base", self.base.float())
        object.__setattr__(self, "scale", self.scale.float())
        # a mixing site's scale[0] for the pre columns, scale[1] for post, scale[2] for comb, as one
        # product over the row (site_maps); None for a head site (DeepSeek-V4's hc_head: one scale)
        columns = None
        if self.scale.numel() == 3:
            n = round(math.sqrt(self.base.shape[-1] + 1)) - 1  # (2 + n) n columns
            columns = self.scale.repeat_interleave(torch.tensor([n, n, n * n], device=self.scale.device))
        object.__setattr__(self, "columns", columns)
        object.__setattr__(self, "plans", {})  # Streams' cpu.mhc_plan answers at decode sizes


def site_shapes(dims: MhcDims, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """The shapes of one site's tensors (for tensor contracts)."""
    return {"fn": (dims.site_width, dims.hc_mult * hidden_size), "base": (dims.site_width,), "scale": (3,)}


def expand(x: Tensor, hc_mult: int) -> Tensor:
    """[N, d] -> [N, n, d]: the embedding copied into every stream."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], hc_mult, x.shape[-1]).contiguous()


def project(streams: Tensor, fn: Tensor, norm_eps: float) -> Tensor:
    """[N, n, d] -> [N, rows] fp32: one projection of the flattened n·d stream, scaled by its
    reciprocal (unweighted) RMS. The scaling is applied before the product, as transformers does
    (the same math as scaling the product; this order matches its rounding)."""
    flat = streams.reshape(*streams.shape[:-2], -1)
    # one kernel call on the CPU (a weight of ones: x * 1 is exact, the same bits as the torch lines)
    scaled = fused_rms_norm(
        flat, unit_weight(flat.shape[-1], flat.device), norm_eps, None, None, torch.float32
    )
    if scaled is None:
        flat = flat.float()
        scaled = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    # the fused site's product (cpu.mhc_enter): its bits, not torch's sum order. A bf16 fn is read as it is
    # (bf16 x fp32 products are exact in fp32): the products of F.linear on fn.float() without an fp32 copy
    # of fn made per call (3x fn's bytes moved a site, every step)
    if (out := cpu.f32_rows(scaled, fn)) is not None:
        return out
    return F.linear(scaled, fn.float())


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """[..., n, n] -> doubly stochastic (to `eps`): row softmax + eps, one column normalisation,
    then iters − 1 rounds of row then column normalisation."""
    if tk := kernels("mhc", logits):
        return tk.sinkhorn(logits, iters, eps)
    c = torch.softmax(logits.float(), dim=-1) + eps
    if iters >= 1 and cpu.sinkhorn_(c, iters, eps):  # the same rounds, bit for bit, in one call
        return c
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def site_maps(streams: Tensor, site: MhcSite, dims: MhcDims) -> tuple[Tensor, Tensor, Tensor]:
    """(pre [N, n], post [N, n], comb [N, n, n]) in fp32 for streams [N, n, d]."""
    if tk := kernels("mhc", streams):
        return tk.site_maps(streams, site, dims)
    n = dims.hc_mult
    z = project(streams, site.fn, dims.norm_eps) * site.columns + site.base  # each column's own scale
    # each sigmoid over its own contiguous [N, n]: torch's sigmoid takes its vector or its scalar code by
    # the layout, and the two round differently (these are the bits the maps have always had)
    pre = torch.sigmoid(z[..., :n].contiguous()) + dims.hc_eps
    post = 2 * torch.sigmoid(z[..., n : 2 * n].contiguous())
    return pre, post, sinkhorn(z[..., 2 * n :].view(*z.shape[:-1], n, n), dims.sinkhorn_iters, dims.hc_eps)


def collapse(streams: Tensor, pre: Tensor) -> Tensor:
    """Σ_j pre[j] h[j]: [N, n, d] -> [N, d], computed in fp32, returned in the streams' dtype."""
    if tk := kernels("mhc", streams):
        return tk.collapse(streams, pre)
    return (pre.float().unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def update(streams: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """h'[k] = post[k] · y + Σ_j comb[j, k] h[j], in the streams' dtype. streams [N, n, d],
    y [N, d] (the block output), post [N, n], comb [N, n, n]. The comb sum runs in fp32 from 0, j in
    order, and is rounded once (as collapse's): written as that sum rather than a matmul, so that the
    compiled call can do the same float operations by hand."""
    dt = streams.dtype
    if tk := kernels("mhc", streams):
        return tk.update(streams, y, post, comb)
    if streams.is_cpu:  # the same float operations in one compiled call
        h = cpu.mhc_update(streams, y, post, comb)
        if h is not None:
            return h
    c, h = comb.to(dt).float(), streams.float()
    mixed = torch.zeros_like(h)
    for j in range(h.shape[-2]):  # one stream at a time: no [N, n, n, d] product at a prompt's rows
        mixed = mixed + c[..., j, :, None] * h[..., j, None, :]
    return post.to(dt).unsqueeze(-1) * y.to(dt).unsqueeze(-2) + mixed.to(dt)


def site_input(streams: Tensor, site: MhcSite, dims: MhcDims) -> tuple[Tensor, Tensor, Tensor]:
    """The usual (non-delayed) site: (block input [N, d], post, comb); finish with `update`."""
    if streams.is_cpu and not kernels("mhc", streams):  # the same ops in one compiled call
        fused = cpu.mhc_enter(streams, None, *_site_args(site, dims))
        if fused is not None:
            return fused[1:]
    pre, post, comb = site_maps(streams, site, dims)
    return collapse(streams, pre), post, comb


def _site_args(site: MhcSite, dims: MhcDims) -> tuple:
    return site.fn, site.columns, site.base, dims.norm_eps, dims.hc_eps, dims.sinkhorn_iters


class Streams:
    """The streams h [N, n, d] of one pass between its blocks, each block entered through its site:
    `x = s.enter(site, norm, weight, eps)` gives the block's input (its norm applied: `norm` one of
    layers/norms.py's orders), `s.leave(y)` takes its output, `s.value()` the streams after it. The update
    by y waits for the next `enter` or `value`: on the CPU an update, the next site's maps and collapse and
    the next block's norm are one compiled call (cpu.mhc_plan's checks, then cpu.mhc_run: cpu.mhc_enter's
    update, site_input and the norm's operations, so the same bits); elsewhere those three functions run in
    turn."""

    def __init__(self, h: Tensor, dims: MhcDims):
        self.h, self.dims = h, dims
        self.maps = None  # (post, comb) of the site last entered
        self.waiting = None  # the block output whose update has not run yet
        self.key = None  # _plan's key for the streams (cpu.mhc_key's part of them), made at the first enter

    def enter(self, site: MhcSite, norm, weight: Tensor, eps: float) -> Tensor:
        h = self.h
        if h.is_cpu and not kernels("mhc", h):
            waiting = None if self.waiting is None else (self.waiting, *self.maps)
            if torch.is_grad_enabled() or h.shape[0] > cpu.MAX_ROWS:  # checked at every call
                plan = self._new_plan(site, norm, weight, eps, waiting)
            else:
                plan = self._plan(site, norm, weight, eps, waiting)
            if plan is not None:
                self.h, x, *maps = cpu.mhc_run(plan, h, waiting)
                self.maps, self.waiting = tuple(maps), None
                return x
        x, *maps = site_input(self.value(), site, self.dims)
        self.maps = tuple(maps)
        return norm(x, weight, eps)

    def _new_plan(self, site: MhcSite, norm, weight: Tensor, eps: float, waiting) -> tuple | None:
        """cpu.mhc_plan for this enter (None: the torch code runs it)."""
        rounding = norms.roundings(norm, self.h.dtype, weight.dtype)
        if rounding is None:
            return None
        return cpu.mhc_plan(self.h, waiting, *_site_args(site, self.dims), (weight, eps, *rounding))

    def _plan(self, site: MhcSite, norm, weight: Tensor, eps: float, waiting) -> tuple | None:
        """_new_plan kept on the site for decode's few rows (its checks cost more than the rest of the call's
        Python)."""
        if self.key is None:  # once a pass: every later h is an update's, of the same shape, dtype and layout
            d = self.dims
            self.key = (cpu.mhc_key(self.h, None), d.norm_eps, d.hc_eps, d.sinkhorn_iters)
        # the weight by id (a tensor's hash is a Python call): the plan holds it, so the id is not reused
        key = (self.key, cpu.mhc_update_key(waiting), norm, id(weight), eps)
        if key not in site.plans:
            site.plans[key] = self._new_plan(site, norm, weight, eps, waiting)
        return site.plans[key]

    def leave(self, y: Tensor) -> None:
        if self.maps is None or self.waiting is not None:
            raise RuntimeError("mhc.Streams: leave() follows an enter()")
        self.waiting = y

    def value(self) -> Tensor:
        if self.waiting is not None:
            self.h, self.waiting = update(self.h, self.waiting, *self.maps), None
            self.key = None  # an h not from mhc_run: checked again at the next enter
        return self.h


def head_mean(streams: Tensor) -> Tensor:
    """GLM-5.3's final collapse: the unweighted mean of the streams."""
    if streams.is_cpu and not kernels("mhc", streams) and (x := cpu.mhc_mean(streams)) is not None:
        return x  # one compiled call, torch's bits (its mean's code is cold after a step's weight streams)
    return streams.mean(dim=-2)


def head_weighted(streams: Tensor, hc_fn: Tensor, hc_base: Tensor, hc_scale: Tensor, dims: MhcDims) -> Tensor:
    """DeepSeek-V4's final hyper head: pre = sigmoid(m · hc_scale + hc_base) + hc_eps with
    m = the site projection through hc_fn [n, n·d]; returns Σ_j pre[j] h[j]."""
    if streams.is_cpu and not kernels("mhc", streams):  # the same operations in one compiled call
        x = cpu.mhc_head(streams, hc_fn, hc_base, hc_scale, dims.norm_eps, dims.hc_eps)
        if x is not None:
            return x
    m = project(streams, hc_fn, dims.norm_eps)
    pre = torch.sigmoid(m * hc_scale.float().reshape(-1)[0] + hc_base.float()) + dims.hc_eps
    return collapse(streams, pre)
