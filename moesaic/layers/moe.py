"""The MoE block every family uses, its routers, the routed experts, MLPs and their activations.

`moe(x, w, spec)` is the whole block: route (the router's kind is data, `Router`), the optional latent
projections around the experts (Kimi K3's LatentMoE, Nemotron-H's latent MoE), the routed experts, the
shared expert. A family declares its `MoeSpec` once and binds each layer's `MoeWeights`.

Activations come in two shapes. A gated one is written over its two halves, `glu(gate, up)`
(silu_glu, clamped_silu_glu, situ_glu): that is what `glu_mlp` takes, its halves coming from two
projections. The routed experts keep gate and up fused in one weight, so `run_experts` takes
`act(gate_up)` over a [.., 2I] row (swiglu, clamped_swiglu), or over the up row of an ungated
expert (relu2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from ..kernels import cpu
from ..kernels.triton import kernels
from .linear import kept, linear, operand
from .norms import rms_norm

PREFETCH_MAX_TOKENS = 32  # streamed experts: a batch this large (a prefill chunk) reads, not guesses


def limit_groups(scores: torch.Tensor, n_group: int, topk_group: int, fill: float) -> torch.Tensor:
    """DeepSeek group limiting: keep the `topk_group` expert groups whose top-2 scores sum highest,
    set the other groups' scores to `fill`. A no-op at one group."""
    if n_group <= 1:
        return scores
    N, E = scores.shape
    g = scores.view(N, n_group, E // n_group)
    group_scores = g.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    return g.masked_fill(~keep[..., None], fill).view(N, E)


def route_softmax(logits, top_k, n_group=1, topk_group=1, normalize=True, scale=1.0):
    """Softmax router (Mistral/DeepSeek-V2 style), in the logits' dtype. Returns (weights, ids) [N, k]."""
    if tk := kernels("router", logits):
        return tk.route_softmax(logits, top_k, n_group, topk_group, normalize, scale)
    if n_group <= 1 and (fused := cpu.route(logits, "softmax", top_k, None, None, normalize, scale)):
        return fused
    scores = logits.softmax(-1)
    choice = limit_groups(scores, n_group, topk_group, 0.0)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def route_sigmoid(logits, top_k, bias=None, n_group=1, topk_group=1, normalize=True, scale=1.0):
    """Sigmoid router with a selection-only correction bias (DeepSeek-V3 style), fp32."""
    if tk := kernels("router", logits):
        return tk.route_sigmoid(logits, top_k, bias, n_group, topk_group, normalize, scale)
    if n_group <= 1 and (fused := cpu.route(logits, "sigmoid", top_k, bias, None, normalize, scale)):
        return fused
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    choice = limit_groups(choice, n_group, topk_group, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: SiLU(gate) · up (one Triton launch on a GPU)."""
    if (tk := kernels("norm", gate)) and (y := tk.silu_mul(gate, up)) is not None:
        return y
    if gate.is_cpu and (y := cpu.glu_rows(gate, up)) is not None:  # one compiled call, the same bits
        return y
    return F.silu(gate) * up


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU over a [.., 2I] gate|up row."""
    return silu_glu(*gate_up.chunk(2, dim=-1))


def clamped_silu_glu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, L)) · clamp(up, −L, L) (the gate is clamped above only)."""
    if gate.is_cpu and (y := cpu.glu_rows(gate, up, limit)) is not None:  # one compiled call, the same bits
        return y
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def clamped_swiglu(limit: float):
    """`clamped_silu_glu` over a [.., 2I] gate|up row."""
    return lambda gate_up: clamped_silu_glu(*gate_up.chunk(2, dim=-1), limit)


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """Kimi K3's SiTU-GLU in fp32: a SiLU whose linear factor is soft-capped at +-beta, times the up
    branch soft-capped at +-linear_beta. Returns gate's dtype."""
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's squared ReLU (an ungated MLP)."""
    return F.relu(x).square()


def glu_mlp(x: torch.Tensor, w_gate, w_up, w_down, glu=silu_glu) -> torch.Tensor:
    """A gated MLP (a dense MLP or the shared experts): w_down(glu(w_gate x, w_up x))."""
    return linear(glu(linear(x, w_gate), linear(x, w_up)), w_down)


def run_experts(x, weights, ids, w_in, w_out, act=swiglu, then=None, every_expert=True):
    """Sum over each token's chosen experts of weight * w_out[e](act(w_in[e] x)).

    x [N, d]; weights/ids [N, k]; w_in [E, *, d] and w_out [E, d, *] (dense stacks or stacked
    quantized tensors indexable by expert, or streamed stacks that `fetch` their experts: all of
    the batch's experts are asked for at once, each read once, and computed as they arrive; `then()`
    runs once those reads are issued). Each token's terms are added in ascending expert id.
    Weighting and the sum run in the routing weights' dtype when it is wider (an fp32 router over
    bf16 activations, as transformers does), cast to x's dtype at the end. Ids outside 0..E-1 are
    experts this rank does not hold (expert parallelism; `every_expert=False`): their terms are left out.

    On CUDA (and MOESAIC_TRITON=interpret) the experts run as two grouped Triton launches with no host
    sync; the torch path below reads the expert counts on the host (free on a CPU)."""
    if every_expert and not hasattr(w_in, "fetch") and (tk := kernels("quant", x)):
        return tk.run_experts(x, weights, ids, w_in, w_out, act)
    E = w_in.shape[0]
    ids, perm = ids.sort(dim=1)  # a token's experts in ascending id: the order its terms are summed in
    weights = weights.gather(1, perm)
    N, k = ids.shape
    flat = ids.reshape(-1)
    flat = flat.masked_fill((flat < 0) | (flat >= E), E)  # another rank's: a group after the last, never run
    counts = torch.bincount(flat, minlength=E + 1)[:E]
    if N == 1 and every_expert:  # one token (a batch-1 decode): its sorted slots are already by expert
        order, xs = None, x.expand(k, -1).contiguous()
    else:
        order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
        xs = x.index_select(0, order // k)  # (x[order // k]: the same rows, ~8x the time on a CPU)
    if hasattr(w_in, "fetch"):  # streamed (weights/experts.py): the same per-expert products
        ys = torch.empty_like(xs)
        starts = (counts.cumsum(0) - counts).tolist()
        used = counts.nonzero().flatten().tolist()
        with w_in.fetch(used, w_out) as got:
            if then is not None:
                then()
            for e, (wi, wo) in got:
                s, c = starts[e], int(counts[e])
                ys[s : s + c] = linear(act(linear(xs[s : s + c], wi)), wo)
    elif hasattr(w_in, "grouped_matmul") and hasattr(w_out, "grouped_matmul"):
        # packed stacks: one grouped call per projection (the kernels at decode sizes; expert by expert,
        # as `linear` computes each, above them)
        offs = counts.cumsum(0)
        ys = _held_rows(
            xs, offs, every_expert, lambda h: w_out.grouped_matmul(act(w_in.grouped_matmul(h, offs)), offs)
        )
    elif _cpu_half(x, w_in, w_out):
        # half-precision stacks on the CPU: cpu.grouped_linear per projection (one kernel call where every
        # expert's rows fit cpu.dense_rows(K), else `linear` expert by expert: what the loop below gives)
        offs = counts.cumsum(0)
        ys = _held_rows(
            xs,
            offs,
            every_expert,
            lambda h: cpu.grouped_linear(act(cpu.grouped_linear(h, w_in, offs)), w_out, offs),
        )
    elif not _cpu_half(x, w_in, w_out) and _grouped(x, w_in, w_out):
        # one grouped GEMM per projection over every expert's rows: no per-expert Python loop
        offs = counts.cumsum(0).to(torch.int32)
        ys = F.grouped_mm(
            act(F.grouped_mm(xs, w_in.transpose(-2, -1), offs=offs)), w_out.transpose(-2, -1), offs=offs
        )
        ys = ys.masked_fill((torch.arange(len(ys), device=ys.device) >= offs[-1])[:, None], 0)
    else:
        ys = torch.zeros_like(xs)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                ys[start : start + c] = linear(act(linear(xs[start : start + c], w_in[e])), w_out[e])
                start += c
    inv = None  # y[order] = ys, as a gather by the inverse permutation (~7x faster on a CPU than the scatter)
    if order is not None:
        inv = torch.empty_like(order)
        inv[order] = torch.arange(len(order), device=order.device)
    if x.is_cpu and x.dtype == ys.dtype and (out := cpu.combine_rows(ys, inv, weights)) is not None:
        return out  # (the lines below in one call: the same bits)
    y = ys.view(N, k, -1) if inv is None else ys.index_select(0, inv).view(N, k, -1)
    # every slot's product at once (in the promoted dtype), then the slots added in order, each sum
    # rounded to that dtype: the bits of `out = 0; out += y[:, j] * w[:, j]` in fewer small ops
    wide = torch.promote_types(y.dtype, weights.dtype)
    # (y cast first: the same products, where torch's mixed-dtype product took ~3x the time on a CPU)
    terms = (y if y.dtype == wide else y.to(wide)) * weights[..., None]
    if x.is_cpu and terms.dtype in (torch.float32, torch.float64):
        # torch's CPU sum over a middle dim adds the rows in order: the same bits (tests/test_cpu_perf.py)
        return terms.sum(1).to(x.dtype)
    out = terms[:, 0] + 0  # + 0: a new tensor (and -0.0 -> 0.0, as the zero-started sum gives)
    for j in range(1, k):
        out += terms[:, j]
    return out.to(x.dtype)


def _held_rows(xs, offs, every_expert: bool, run):
    """run(xs) where this rank holds every expert; else run on the rows of the experts it holds (the first
    offs[-1]: the other ranks' rows are a group after the last) and zeros for the others."""
    if every_expert:
        return run(xs)
    ys = torch.zeros_like(xs)
    n = int(offs[-1])
    if n:
        ys[:n] = run(xs[:n])
    return ys


def _cpu_half(x, w_in, w_out) -> bool:
    """Dense half-precision expert stacks on the CPU: `linear`'s kernel / fp32-tile paths beat torch's
    grouped_mm there (which runs the slow bf16 GEMM of CPUs without AMX: docs/perf.md)."""
    return (
        isinstance(w_in, torch.Tensor)
        and isinstance(w_out, torch.Tensor)
        and w_in.is_cpu
        and w_in.dtype in (torch.bfloat16, torch.float16)
        and w_out.dtype == w_in.dtype
    )


def _grouped(x, w_in, w_out) -> bool:
    """Whether torch's grouped GEMM can run these experts: dense stacks of a dtype it supports, with
    every row stride and base address a multiple of 16 bytes (its requirement)."""
    if not (
        hasattr(F, "grouped_mm")
        and isinstance(w_in, torch.Tensor)
        and isinstance(w_out, torch.Tensor)
        and x.dtype == w_in.dtype == w_out.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
    ):
        return False
    widths = (x.shape[-1], w_in.shape[-2], w_out.shape[-2], w_out.shape[-1])
    return all(w * x.element_size() % 16 == 0 for w in widths) and all(
        t.data_ptr() % 16 == 0 for t in (w_in, w_out)
    )


def route_sqrtsoftplus(logits, top_k, bias=None, scale=1.0, ids=None):
    """DeepSeek-V4's router, in the logits' dtype: scores s = sqrt(softplus(logits)); experts =
    topk(s + bias) (the correction bias chooses, it never weighs), or the static `ids` [N, k] of a
    hash layer (tid2eid[token]); weights = s[experts] / (sum + 1e-20) * scale. Returns (weights, ids)."""
    if tk := kernels("router", logits):
        return tk.route_sqrtsoftplus(logits, top_k, bias, scale, ids)
    if fused := cpu.route(logits, "sqrtsoftplus", top_k, bias, ids, True, scale):
        return fused
    scores = F.softplus(logits).sqrt()
    if ids is None:
        choice = scores if bias is None else scores + bias
        ids = choice.topk(top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scale, ids


# ---------------------------------------------------------------- the block


@dataclass(frozen=True)
class Router:
    """How a layer chooses and weighs its experts. score: "softmax" (Mistral, DeepSeek-V2), "sigmoid"
    with a selection-only bias (DeepSeek-V3, GLM, Kimi, Nemotron), "sqrtsoftplus" (DeepSeek-V4; a hash
    layer's experts come from a static token table instead). fp32: the router's logits in fp32 (as the
    references that keep the router in fp32 do); else in the activations' dtype."""

    score: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = True
    scale: float = 1.0
    fp32: bool = False

    def __post_init__(self):
        if self.score not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"router score {self.score!r}: softmax, sigmoid or sqrtsoftplus")


@dataclass
class Mlp:
    """A dense MLP or shared expert: down(glu(gate x, up x)), or down(act(up x)) without a gate."""

    up: object
    down: object
    gate: object | None = None
    # (operands, cpu.ffn_plan) by (rows, threads), made at their first call (as MoeWeights.fused_plans)
    fused_plans: dict = field(default_factory=dict, repr=False, compare=False)

    def __call__(self, x: torch.Tensor, glu=silu_glu, act=relu2) -> torch.Tensor:
        form = fused_form(self.gate is not None, glu, act)
        if x.shape[0] <= cpu.MAX_ROWS and form is not None:
            key = (x.shape[0], torch.get_num_threads(), form[1])
            ops, plan = kept(self.fused_plans, key, lambda: self._plan(x.shape[0], form[1]))
            if (
                plan is not None
                and (y := cpu.ffn_rows(x, dense=ops, limit=form[0], relu2=form[1], plan=plan)) is not None
            ):
                return y  # decode rows on the CPU: the same products and roundings in one call
        if self.gate is None:
            return linear(act(linear(x, self.up)), self.down)
        return linear(glu(linear(x, self.gate), linear(x, self.up)), self.down)

    def operands(self) -> tuple:
        """(gate, up, down) as the CPU kernels take them (each None where they do not; gate None without one)."""
        return (None if self.gate is None else operand(self.gate), operand(self.up), operand(self.down))

    def _plan(self, rows: int, relu2: bool) -> tuple:
        ops = self.operands()
        return ops, cpu.ffn_plan(rows, 0, None, None, ops, relu2, routed=False)


@dataclass
class MoeWeights:
    """One MoE layer. experts_in [E, 2I, d'] (gate|up fused; [E, I, d'] ungated), experts_out [E, d', I];
    d' = d, or the latent width when latent_in/latent_out project around the experts."""

    router: torch.Tensor  # [E, d]
    experts_in: object
    experts_out: object
    bias: torch.Tensor | None = None  # [E] selection-only correction bias
    hash_ids: torch.Tensor | None = None  # [vocab, k] a hash layer's static experts per token
    shared: Mlp | None = None
    latent_in: object | None = None  # [d', d]
    latent_norm: torch.Tensor | None = None  # RMSNorm over the experts' latent output
    latent_out: object | None = None  # [d, d']
    next_moe: MoeWeights | None = None  # the next MoE layer, when its streamed experts are prefetched
    # tensor / expert parallelism (moesaic/parallel): the routed experts held here are the router's
    # first_expert.. (all of them, or each one's share of the width), and `reduce` sums the ranks' partial
    # outputs; None on one rank
    first_expert: int = 0
    reduce: Callable | None = None
    # the router in fp32 for a router that takes fp32 logits (the same values), made at its first call: a
    # bf16 router converted at every call cost GLM-5.3-Flash's 288 x 4096 ~220 of ~365 us a layer and step
    router_f32: torch.Tensor | None = None
    # the fused block's parts and plan (cpu.ffn_plan) by (spec, every, rows, threads), made at their first call:
    # the operands and their thread counts do not change from step to step
    fused_plans: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class MoeSpec:
    """A family's MoE law: its router, the experts' and shared expert's gated activation `glu(gate, up)`,
    or for ungated experts (gated=False) `act(up)`; the latent norm's eps."""

    router: Router
    glu: Callable = silu_glu
    gated: bool = True
    act: Callable = relu2
    eps: float = 1e-6


def _router_f32(w: MoeWeights) -> torch.Tensor:
    """The layer's router in fp32 (for a router that takes fp32 logits), made at its first call."""
    if w.router_f32 is None:
        w.router_f32 = w.router.float()
    return w.router_f32


def _score_args(w: MoeWeights, r: Router, token_ids) -> tuple:
    """(bias, hash ids, normalize) as the router's score takes them: softmax no bias; a hash layer's static
    experts (sqrtsoftplus, which always normalizes) instead of the bias."""
    hash_ids = w.hash_ids[token_ids] if r.score == "sqrtsoftplus" and w.hash_ids is not None else None
    bias = None if r.score == "softmax" or hash_ids is not None else w.bias
    return bias, hash_ids, r.normalize if r.score != "sqrtsoftplus" else True


def route(x: torch.Tensor, w: MoeWeights, r: Router, token_ids: torch.Tensor | None = None):
    """(weights [N, k], expert ids [N, k]) of each token."""
    if r.fp32:
        logits = F.linear(x.float(), _router_f32(w))
    else:
        logits = linear(x, w.router)
    bias, hash_ids, normalize = _score_args(w, r, token_ids)
    if r.score == "softmax":
        return route_softmax(logits, r.top_k, r.n_group, r.topk_group, normalize, r.scale)
    if r.score == "sigmoid":
        return route_sigmoid(logits, r.top_k, bias, r.n_group, r.topk_group, normalize, r.scale)
    return route_sqrtsoftplus(logits, r.top_k, bias, r.scale, ids=hash_ids)


def prefetch(x: torch.Tensor, w: MoeWeights, r: Router, token_ids: torch.Tensor | None = None) -> None:
    """Starts reading the streamed experts layer `w` would choose for x: its router (selection only)
    run on the previous MoE layer's input, while that layer computes. Routing is never changed."""
    if w.hash_ids is None or token_ids is not None:
        w.experts_in.prefetch(route(x, w, r, token_ids)[1].unique().tolist())


def _fused_parts(w: MoeWeights, spec: MoeSpec, every: bool) -> tuple | None:
    """The feed-forward block's parts as one compiled call takes them, (w_in, w_out, dense, limit, relu2), where
    it applies: SwiGLU (or squared-ReLU) experts in dense bf16 or packed stacks on the CPU, `every` one held
    here, no latent projections; else None. The same bits as the code below (cpu.ffn_rows). Ungated experts
    take it with relu2 (Nemotron-H)."""
    form = fused_form(spec.gated, spec.glu, spec.act)
    if form is None or not (every and w.latent_in is None and w.latent_out is None):
        return None
    if w.latent_norm is not None or w.reduce is not None or w.next_moe is not None:
        return None
    if w.shared is not None and (w.shared.gate is not None) != spec.gated:  # gated like the experts
        return None
    w_in, w_out = operand(w.experts_in), operand(w.experts_out)
    if w_in is None or w_out is None:  # streamed, split over ranks, gate | up quantized apart, fp32
        return None
    return w_in, w_out, () if w.shared is None else w.shared.operands(), *form


def _fused_plan(w: MoeWeights, spec: MoeSpec, every: bool, rows: int) -> tuple:
    """(_fused_parts, cpu.ffn_plan for them at `rows` rows), kept on the layer per thread count."""

    def make():
        parts = _fused_parts(w, spec, every)
        if parts is None:
            return None, None
        return parts, cpu.ffn_plan(rows, spec.router.top_k, *parts[:3], relu2=parts[4])

    return kept(w.fused_plans, (spec, every, rows, torch.get_num_threads()), make)


def _fused_block(x: torch.Tensor, w: MoeWeights, r: Router, token_ids, parts: tuple, plan=None):
    """The whole block for a few tokens in one compiled call (cpu.moe_rows: the router's product, `route` and
    the feed-forward block, the calls the code below makes) where the router fuses too: one expert group, a
    router the bf16 kernel serves (or kept in fp32), no Triton router; else None."""
    if (r.score != "sqrtsoftplus" and r.n_group > 1) or kernels("router", x):
        return None
    if not r.fp32 and type(w.router) is not torch.Tensor:
        return None
    bias, hash_ids, normalize = _score_args(w, r, token_ids)
    router, router_f32 = (None, _router_f32(w)) if r.fp32 else (w.router, None)
    return cpu.moe_rows(
        x, router, router_f32, r.score, r.top_k, bias, hash_ids, normalize, r.scale, *parts, plan=plan
    )


def fused_form(gated: bool, glu, act) -> tuple[float | None, bool] | None:
    """cpu.ffn_rows' (limit, relu2) for a block's activation: a gated one that swiglu_limit names, or relu2
    without a gate; None for any other (the torch code runs it)."""
    if not gated:
        return (None, True) if act is relu2 else None
    limit = swiglu_limit(glu)
    return None if limit is False else (limit, False)


def swiglu_limit(glu) -> float | None | bool:
    """What the fused block needs to know of a gated activation: None for silu_glu, the limit of
    clamped_silu_glu bound by `partial(clamped_silu_glu, limit=L)` (the families' form), False for any
    other (the torch code runs it)."""
    if glu is silu_glu:
        return None
    if (
        isinstance(glu, partial)
        and glu.func is clamped_silu_glu
        and not glu.args
        and set(glu.keywords) == {"limit"}
    ):
        return float(glu.keywords["limit"])
    return False


def moe(x: torch.Tensor, w: MoeWeights, spec: MoeSpec, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE block on packed tokens x [N, d] (token_ids: for a hash layer's table)."""
    every = w.first_expert == 0 and w.experts_in.shape[0] == w.router.shape[0]  # no expert on another rank
    # (no plan: the operands do not fit a fused call, which cpu.ffn_plan would find again at every call)
    parts, plan = _fused_plan(w, spec, every, x.shape[0]) if x.shape[0] <= cpu.MAX_ROWS else (None, None)
    if plan is not None and (y := _fused_block(x, w, spec.router, token_ids, parts, plan)) is not None:
        return y
    weights, ids = route(x, w, spec.router, token_ids)
    if plan is not None and (y := cpu.ffn_rows(x, weights, ids, *parts, plan=plan)) is not None:
        return y
    h = x if w.latent_in is None else linear(x, w.latent_in)
    act = (lambda gu: spec.glu(*gu.chunk(2, dim=-1))) if spec.gated else spec.act
    then = None
    if w.next_moe is not None and x.shape[0] <= PREFETCH_MAX_TOKENS:  # a prefill chunk reads, not guesses
        then = lambda: prefetch(x, w.next_moe, spec.router, token_ids)  # noqa: E731
    local = ids if w.first_expert == 0 else ids - w.first_expert  # this rank's expert numbers
    y = run_experts(h, weights, local, w.experts_in, w.experts_out, act, then, every)
    reduce = w.reduce  # split over ranks: y (and the shared expert's output) are this rank's part
    if w.latent_norm is not None:
        if reduce is not None:  # the norm needs the whole sum
            y = reduce(y)
        y = rms_norm(y, w.latent_norm, spec.eps)
    if w.latent_out is not None:
        y = linear(y, w.latent_out)
    if w.shared is not None:
        s = w.shared(x, spec.glu, spec.act)
        y = y + (reduce(s) if reduce is not None and w.latent_norm is not None else s)
    return y if reduce is None or w.latent_norm is not None else reduce(y)  # one all-reduce of the block
