"""Multi-head latent attention (DeepSeek-V2 MLA) over a cached latent.

Each token caches only the normalised latent `c` [kv_lora] and the shared rope key `kr` [rope];
per-head keys and values are `c @ W_kv_b`. Two exact evaluations of the same attention:

* expanded: materialise k_nope/v for every cached token, then ordinary attention — cheapest when
  many queries share the expansion (prefill);
* absorbed: fold W_uk into the query and W_uv into the output so attention runs in the latent
  space — cheapest when few queries meet a long cache (decode). The two folds are token-wise, so
  a caller can run them once over the packed tokens of every decoding sequence.

`prefers_absorbed` picks by the operation count of the two; `mla_batch` applies it per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..cache.paged import PagedRows
from ..kernels import cpu
from ..kernels.triton import kernels
from .linear import kept, linear, matmul, operand
from .norms import rms_norm


@dataclass
class MlaWeights:
    """One MLA module. q is either one projection (`q`, no q LoRA) or `q_a` -> norm -> `q_b`."""

    kv_a: object  # kv_a_proj_with_mqa [kvr + dr, d]
    kv_a_norm: torch.Tensor  # [kvr]
    kv_b: torch.Tensor  # [H (dn + dv), kvr], dense: split into W_uk / W_uv views for absorbed attention
    o: object  # o_proj [d, H dv]
    q: object | None = None
    q_a: object | None = None
    q_a_norm: torch.Tensor | None = None
    q_b: object | None = None
    gate: object | None = None  # an output gate g_proj [H dv, d] (Kimi K3's gated MLA)
    # cpu.mla_plan by (rows, threads), made at the first call (as MoeWeights.fused_plans)
    fused_plans: dict = field(default_factory=dict, repr=False, compare=False)


def causal_mask(n_new: int, total: int, device) -> torch.Tensor | None:
    """Bool mask [n_new, total] letting query i see keys 0..total-n_new+i (None when not needed)."""
    if n_new == 1:
        return None
    q = torch.arange(total - n_new, total, device=device)[:, None]
    return torch.arange(total, device=device)[None, :] <= q


def prefers_absorbed(n: int, kvr: int, dr: int, dn: int, dv: int) -> bool:
    """Absorbed costs ~n·(2·kvr + dr) per cached token and head; expanded ~kvr·(dn + dv)."""
    return n * (2 * kvr + dr) < kvr * (dn + dv)


def split_kv_b(w_kv_b: torch.Tensor, heads: int, dn: int, dv: int):
    """Views W_uk [H, dn, kvr] and W_uv [H, dv, kvr] of kv_b_proj's weight [H·(dn+dv), kvr]."""
    w = w_kv_b.view(heads, dn + dv, -1)
    return w[:, :dn], w[:, dn:]


def absorb_queries(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[n, H, dn] -> [H, n, kvr]: the query in the latent space."""
    return matmul(q_nope.transpose(0, 1), w_uk)


def absorb_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """[H, n, kvr] -> [n, H, dv]."""
    return matmul(o_lat, w_uv.transpose(1, 2)).transpose(0, 1)


def latent_attention(q_lat, q_rope, latent, k_rope, scale) -> torch.Tensor:
    """Attention in the latent space for one sequence. q_lat [H, n, kvr], q_rope [n, H, dr],
    latent [T, kvr], k_rope [T, dr] -> o_lat [H, n, kvr]. Scores and softmax in fp32."""
    if tk := kernels("mla", q_lat):
        return tk.latent_attention(q_lat, q_rope, latent, k_rope, scale)
    n, T = q_lat.shape[1], latent.shape[0]
    scores = matmul(q_lat, latent.T)
    if k_rope.shape[1]:
        scores = scores + matmul(q_rope.transpose(0, 1), k_rope.T)
    scores = scores.float() * scale
    mask = causal_mask(n, T, latent.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return matmul(torch.softmax(scores, dim=-1).to(latent.dtype), latent)


def expanded_attention(q_nope, q_rope, latent, k_rope, w_kv_b, v_head_dim, scale) -> torch.Tensor:
    """Ordinary attention after expanding the latent, for one sequence -> [n, H, dv]."""
    n, H, dn = q_nope.shape
    T = latent.shape[0]
    kv = linear(latent, w_kv_b).view(T, H, dn + v_head_dim)  # fp32 tiles on a CPU without a bf16 GEMM
    k_shared = k_rope[:, None, :].expand(T, H, k_rope.shape[1])  # the rope key, one for every head
    fused = cpu.causal_attention(  # SDPA's math in one call (no cat, no mask): 4-12x faster on a CPU
        q_nope,
        kv[..., :dn],
        kv[..., dn:],
        scale,
        q_rope if k_rope.shape[1] else None,
        k_shared if k_rope.shape[1] else None,
        round_scores=False,
        normalize_first=False,
    )
    if fused is not None:
        return fused
    k = torch.cat([kv[..., :dn], k_shared], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        kv[..., dn:].transpose(0, 1),
        attn_mask=causal_mask(n, T, q.device),
        scale=scale,
    )
    return out.transpose(0, 1)


def project_rows(x: torch.Tensor, w: MlaWeights, kvr: int, eps: float):
    """(q [n, H·qk_head_dim], kv [n, kvr + dr] = x W_kv_a, latent = RMSNorm(kv[:, :kvr]) [n, kvr], qr =
    RMSNorm(x W_q_a) [n, q_lora_rank], q_b's input, or None without q's LoRA): an MLA module's products of
    its input and their norms, in one compiled call for decode rows and verify blocks on the CPU."""
    if x.is_cpu and x.shape[0] <= cpu.MAX_ROWS:  # the code below in one call
        mats = [w.q, w.kv_a] if w.q is not None else [w.q_a, w.q_b, w.kv_a]
        norms = [w.kv_a_norm] if w.q is not None else [w.q_a_norm, w.kv_a_norm]
        fused = cpu.mla_project(x, [operand(m) for m in mats], norms, eps, kvr)
        if fused is not None:
            return tuple(fused) if len(fused) == 4 else (*fused, None)
    if w.q is not None:
        q, qr = linear(x, w.q), None
    else:
        qr = rms_norm(linear(x, w.q_a), w.q_a_norm, eps)
        q = linear(qr, w.q_b)
    kv = linear(x, w.kv_a)
    return q, kv, rms_norm(kv[:, :kvr], w.kv_a_norm, eps), qr


def mla_project(x: torch.Tensor, w: MlaWeights, c, eps: float = 1e-6):
    """The token-wise half of an MLA module: the per-head query split [n, H, dn] / [n, H, dr], the
    normalised latent [n, kvr] and the shared key slice [n, dr], both still unrotated. (The q/kv a-norms
    use their class default eps, not the config's.)"""
    n, H = x.shape[0], c.num_attention_heads
    q, kv, latent, _ = project_rows(x, w, c.kv_lora_rank, eps)
    q = q.view(n, H, c.qk_head_dim)
    return q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :], latent, kv[:, c.kv_lora_rank :]


def mla_batch(
    L: int, batch, q_nope, q_rope, latent, k_rope, w_kv_b, v_head_dim: int, scale: float
) -> torch.Tensor:
    """MLA for every sequence of a ForwardBatch: appends each one's new latent rows to its layer-L
    cache, then attends. Sequences with few new tokens take the absorbed path, whose two folds run
    once over all their packed tokens; the others expand their cache. -> [N, H, dv]."""
    if batch.paged is not None:
        return paged_step_attention(L, batch.paged, q_nope, q_rope, latent, k_rope, w_kv_b, v_head_dim, scale)
    N, H, dn = q_nope.shape
    kvr, dr = latent.shape[1], k_rope.shape[1]
    layers = [s.state.layers[L] for s in batch.seqs]
    new = [
        dict(latent=latent[s.start : s.start + s.n], k_rope=k_rope[s.start : s.start + s.n])
        for s in batch.seqs
    ]
    if shared_pages(layers) and q_nope.dtype == torch.bfloat16 and not kernels("mla", q_nope):
        # the CPU's fused call reads the pages in place: no gather of every cached row per layer and step
        for r, rows in zip(layers, new):
            r.write(**rows)
        if (y := _absorbed_in_place(batch, layers, q_nope, q_rope, w_kv_b, v_head_dim, scale)) is not None:
            return y
        caches = [r.bufs for r in layers]
    else:
        caches = [r.append(**rows) for r, rows in zip(layers, new)]
    out = q_nope.new_empty(N, H, v_head_dim)
    absorbed = [i for i, s in enumerate(batch.seqs) if prefers_absorbed(s.n, kvr, dr, dn, v_head_dim)]
    for i, s in enumerate(batch.seqs):
        if i not in absorbed:
            rows = slice(s.start, s.start + s.n)
            out[rows] = expanded_attention(
                q_nope[rows],
                q_rope[rows],
                caches[i]["latent"],
                caches[i]["k_rope"],
                w_kv_b,
                v_head_dim,
                scale,
            )
    if absorbed:
        first, last = batch.seqs[absorbed[0]], batch.seqs[absorbed[-1]]
        if all(
            batch.seqs[i].start + batch.seqs[i].n == batch.seqs[j].start
            for i, j in zip(absorbed, absorbed[1:])
        ):
            rows = slice(
                first.start, last.start + last.n
            )  # one run of packed rows (decode): views, no gathers
        else:
            rows = torch.cat(
                [
                    torch.arange(
                        batch.seqs[i].start, batch.seqs[i].start + batch.seqs[i].n, device=out.device
                    )
                    for i in absorbed
                ]
            )
        w_uk, w_uv = split_kv_b(w_kv_b, H, dn, v_head_dim)
        if not kernels("mla", q_nope):  # bf16 on the CPU: the five small products in one call
            fused = cpu.mla_absorbed(
                q_nope[rows],
                q_rope[rows],
                w_uk,
                w_uv,
                [caches[i]["latent"] for i in absorbed],
                [caches[i]["k_rope"] for i in absorbed],
                [batch.seqs[i].n for i in absorbed],
                scale,
            )
            if fused is not None:
                out[rows] = fused
                return out
        q_lat = absorb_queries(q_nope[rows], w_uk)
        q_rope_rows = q_rope[rows]
        paged = [batch.seqs[i].state.layers[L] for i in absorbed]
        if (tk := kernels("mla", q_lat)) and shared_pages(paged):  # one launch over the engine's pages
            table, lens, starts = page_tables(paged, [batch.seqs[i].n for i in absorbed], q_lat.device)
            pool, rope = paged[0].fields["latent"], paged[0].fields["k_rope"] if dr else None
            o_lat = tk.paged_latent_attention(
                q_lat, q_rope_rows if dr else None, pool, rope, paged[0].index, table, lens, starts, scale
            )
        else:
            o_lat = torch.empty_like(q_lat)
            at = 0
            for i in absorbed:
                n = batch.seqs[i].n
                o_lat[:, at : at + n] = latent_attention(
                    q_lat[:, at : at + n],
                    q_rope_rows[at : at + n],
                    caches[i]["latent"],
                    caches[i]["k_rope"],
                    scale,
                )
                at += n
        out[rows] = absorb_output(o_lat, w_uv)
    return out


def paged_step_attention(
    L: int, step, q_nope, q_rope, latent, k_rope, w_kv_b, v_head_dim: int, scale: float
) -> torch.Tensor:
    """mla_batch for a static decode step (cache/batch.py PagedStep): each row's latent and rope key written
    to its page, then the absorbed attention over each row's pages through the block tables, every shape
    fixed by the step's (rows, table width). -> [B, H, dv]."""
    B, H, dn = q_nope.shape
    dr = k_rope.shape[1]
    fields, index = step.write(L, latent=latent, k_rope=k_rope)
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn, v_head_dim)
    q_lat = absorb_queries(q_nope, w_uk)  # [H, B, kvr]
    if tk := kernels("mla", q_lat):
        o_lat = tk.paged_latent_attention(
            q_lat, q_rope if dr else None, fields["latent"], fields["k_rope"] if dr else None, index,
            step.tables, step.lens, step.starts, scale, tok_seq=step.row_seq,
        )  # fmt: skip
    else:  # the reference: every row's W pages gathered, the keys past its length masked
        lat = fields["latent"][step.tables, index].flatten(1, 2)  # [B, W * BLOCK_SIZE, kvr]
        scores = matmul(q_lat.transpose(0, 1), lat.transpose(1, 2))  # [B, H, T]
        if dr:
            rope = fields["k_rope"][step.tables, index].flatten(1, 2)
            scores = scores + matmul(q_rope, rope.transpose(1, 2))
        scores = scores.float() * scale
        held = torch.arange(lat.shape[1], device=lat.device) < step.lens[:, None]
        scores = scores.masked_fill(~held[:, None, :], float("-inf"))
        lat = lat.masked_fill(~held[:, :, None], 0)  # rows past the length may be any bits (0 x NaN is NaN)
        o_lat = matmul(torch.softmax(scores, dim=-1).to(lat.dtype), lat).transpose(0, 1)
    return absorb_output(o_lat, w_uv)


def all_absorbed(batch, N: int, kvr: int, dr: int, dn: int, dv: int) -> bool:
    """Whether the batch's N rows are every sequence's, packed in order, and each sequence prefers the absorbed
    path (decode rows, verify blocks): the rule of the paged calls over all sequences at once."""
    at = 0
    for s in batch.seqs:
        if s.start != at or not prefers_absorbed(s.n, kvr, dr, dn, dv):
            return False
        at += s.n
    return at == N


def _absorbed_in_place(batch, layers: list, q_nope, q_rope, w_kv_b, v_head_dim: int, scale: float):
    """Every sequence's rows absorbed (decode rows, verify blocks), packed in order, over paged caches whose
    new rows are written: cpu.mla_absorbed reading the pages in place; None where it does not apply."""
    N, H, dn = q_nope.shape
    if not all_absorbed(batch, N, w_kv_b.shape[-1], q_rope.shape[-1], dn, v_head_dim):
        return None
    views, ids = zip(*(r.pages() for r in layers))
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn, v_head_dim)
    return cpu.mla_absorbed(
        q_nope,
        q_rope,
        w_uk,
        w_uv,
        [v["latent"] for v in views],
        [v["k_rope"] for v in views],
        [s.n for s in batch.seqs],
        scale,
        blocks=[list(b) for b in ids],
        lengths=[r.length for r in layers],
    )


def mla_block(L: int, batch, x: torch.Tensor, w: MlaWeights, c, rope=None, eps: float = 1e-6, qscale=None):
    """An MLA module in one compiled call where every sequence of the batch takes the absorbed path over the
    engine's pages (decode rows, verify blocks): mla_project, the rotation `rope` = (cos, sin, layout as
    kernels/cpu.py's rope takes it: 0 rope_interleaved, 1 rope_half) of the query's and key's rope parts
    (None: no rotation), the queries times `qscale` [N, 1, 1] where given (Mistral-4's llama-4 scaling past its
    original context), mla_batch and the output product of its [N, H * dv] rows by w.o. cpu.mla_block makes
    the calls this module's code makes, in its order: the same bits, without ~40 small calls and ops a layer.
    -> [N, d]; None where it does not apply (the caller runs the code)."""
    N = x.shape[0]
    if not (x.is_cpu and x.dtype == torch.bfloat16 and N <= cpu.MAX_ROWS) or kernels("mla", x):
        return None
    layers = [s.state.layers[L] for s in batch.seqs]
    if not shared_pages(layers):
        return None
    H, dn, kvr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank, c.v_head_dim
    if not all_absorbed(batch, N, kvr, c.qk_head_dim - dn, dn, dv):
        return None

    def make():
        mats = [w.q, w.kv_a] if w.q is not None else [w.q_a, w.q_b, w.kv_a]
        norms = [w.kv_a_norm] if w.q is not None else [w.q_a_norm, w.kv_a_norm]
        ops = [operand(m) for m in (*mats, w.o)]
        return cpu.mla_plan(ops, norms, *split_kv_b(w.kv_b, H, dn, dv), N)

    if (plan := kept(w.fused_plans, (N, torch.get_num_threads()), make)) is None:
        return None

    views = layers[0].views
    pools = (views["latent"], views["k_rope"])
    return cpu.mla_block(
        x, plan, pools, eps, kvr, H, dn, rope, c.softmax_scale, placer(layers, batch), qscale
    )


def placer(layers: list, batch):
    """The `place` a compiled block calls once it applies: () -> (each new row's block and row flat, the caches
    advanced; rows per sequence; each sequence's block ids; lengths), for the batch's paged `layers`."""

    def place():
        where = [v for r, s in zip(layers, batch.seqs) for v in r.place(s.n)]
        blocks = [list(r.pages()[1]) for r in layers]
        return where, [s.n for s in batch.seqs], blocks, [r.length for r in layers]

    return place


def shared_pages(rows: list) -> bool:
    """Whether every sequence's rows are the engine's pages of one pool (the paged kernels' input)."""
    return all(type(r) is PagedRows and r.fields is rows[0].fields and r.index == rows[0].index for r in rows)


def page_tables(rows: list, new: list[int], device):
    """(block tables int32 [S, max blocks] padded with block 0, seq_lens int32 [S], query_start int32
    [S + 1]) of paged rows holding `new` tokens of this step each, from the host's metadata: uploaded,
    never read back."""
    width = max(len(r.table) for r in rows)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    host = [
        torch.tensor([r.table.ids + [0] * (width - len(r.table)) for r in rows], dtype=torch.int32),
        torch.tensor([r.length for r in rows], dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
    ]
    if torch.device(device).type != "cuda":
        return tuple(t.to(device) for t in host)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in host)  # no wait on the copy
