"""DeepSeek Sparse Attention with GLM-5.3's k-pool lightning indexer, over a NoPE MLA latent cache.

DSA is DeepSeek-V3.2's (arXiv:2512.02556, the lightning indexer); the k-pool compression and the tail
follow transformers' `Glm5NextTextIndexer` and `Glm5NextTextAttention` in
`src/transformers/models/glm5_next/modeling_glm5_next.py`. Per sequence, with P = index_kpool and
tokens at positions 0..T-1:

Indexer (on "full" layers; "shared" layers reuse the previous full layer's selection):
    k_j    = LayerNorm(x_j W_kᵀ; weight, bias, eps 1e-6)        cached per token (model dtype)
    z_j    = x_j Gᵀ                                             cached per token: the pool gate scores
    pool p = tokens [pP, (p+1)P); only complete pools exist
    K_p    = Σ_{j∈p} softmax_j(z_j + ape_j) ⊙ k_j               per-channel softmax over the P slots, fp32
    s(t,p) = Σ_h w_t[h] · ReLU(q_t[h]·K_p · c_I^-0.5)           w_t = (x_t W_wᵀ) · n_I^-0.5, q = qr W_q_bᵀ
    pool p is a candidate for query t iff its last token (p+1)P − 1 <= t
    the top min(topk // P, #candidates) candidates are selected, plus the tail: the (t+1) mod P
    newest tokens, which no complete pool holds yet (when `always_select_tail`).

Attention: NoPE MLA over the cached latent c (k_h | v_h = c W_kv_bᵀ), softmax in fp32 over the
selected tokens only, scale = qk_nope_head_dim^-0.5. With the tail on (the release), every query
has at least one key. Without it, a query before the first complete pool has none and gets 0
here; transformers' finfo.min mask gives it a uniform average over the whole cache instead.

A selection is a LongTensor [n, width] of token indices, -1 padded, width = topk + P − 1 with the
tail (topk without): the selected pools' tokens first, then the tail. It is what shared layers
receive, and what a GPU kernel gathers by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import cpu
from ..kernels.triton import kernels
from .linear import kept, linear, matmul, operand, product_limit
from .mla import page_tables, placer, project_rows, shared_pages

INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm LayerNorm (hard-coded in the reference)


@dataclass
class IndexerWeights:
    """One full layer's indexer (field names after transformers' `Glm5NextTextIndexer`)."""

    wq_b: object  # [n_I * c_I, q_lora_rank]
    wk: object  # [c_I, d]
    k_norm: Tensor  # [c_I] LayerNorm weight
    k_norm_bias: Tensor  # [c_I]
    weights_proj: object  # [n_I, d]
    ape: Tensor  # [P, c_I] index_kpool_compress_ape: the pool slots' position bias
    gate: object  # [c_I, d] index_kpool_compress_gate


def indexer_queries(qr: Tensor, x: Tensor, w: IndexerWeights, n_heads: int) -> tuple[Tensor, Tensor]:
    """(q [n, n_I, c_I] = qr W_q_bᵀ, head weights [n, n_I] fp32 = (x W_wᵀ) · n_I^-0.5) of the queries
    with q latent qr [n, q_lora_rank] and layer input x [n, d]."""
    q = linear(qr, w.wq_b).view(qr.shape[0], n_heads, -1)
    return q, linear(x, w.weights_proj).float() * n_heads**-0.5


def selection_width(index_topk: int, kpool: int, always_select_tail: bool) -> int:
    return index_topk + (kpool - 1 if always_select_tail else 0)


def indexer_keys(x: Tensor, w: IndexerWeights) -> tuple[Tensor, Tensor]:
    """The per-token indexer cache rows of x [n, d]: (k [n, c_I], z [n, c_I]) in x's dtype."""
    k = F.layer_norm(linear(x, w.wk), (w.k_norm.shape[0],), w.k_norm, w.k_norm_bias, INDEXER_NORM_EPS)
    return k, linear(x, w.gate)


def project_rows_and_keys(x: Tensor, m, ix: IndexerWeights | None, kvr: int, eps: float):
    """(q, latent, qr, (k, z) or None): mla.project_rows of a DSA layer's input and, with an indexer, its keys
    (indexer_keys), in one compiled call for decode rows and verify blocks on the CPU (the same bits)."""
    if ix is not None and x.is_cpu and x.shape[0] <= cpu.MAX_ROWS and m.q is None:
        ops = [operand(t) for t in (m.q_a, m.q_b, m.kv_a, ix.wk, ix.gate)]
        fused = cpu.dsa_project(
            x, ops, [m.q_a_norm, m.kv_a_norm], eps, kvr, ix.k_norm, ix.k_norm_bias, INDEXER_NORM_EPS
        )
        if fused is not None:
            q, _, latent, qr, k, z = fused
            return q, latent, qr, (k, z)
    q, _, latent, qr = project_rows(x, m, kvr, eps)
    return q, latent, qr, None if ix is None else indexer_keys(x, ix)


def pool_keys(k: Tensor, z: Tensor, ape: Tensor) -> Tensor:
    """Pooled keys [T // P, c_I] of the complete pools of k, z [T, c_I] (P = ape.shape[0]): the
    per-channel softmax of z + ape over each pool's P slots in fp32, rounded to k's dtype, then
    the weighted sum of the pool's keys."""
    if tk := kernels("compressor", k):
        return tk.pool_keys(k, z, ape)
    P, c = ape.shape
    n_pools = k.shape[0] // P
    kp = k[: n_pools * P].view(n_pools, P, c)
    logits = z[: n_pools * P].view(n_pools, P, c).float() + ape.float()
    # over the last dim of the transposed view: torch's softmax over a middle dim blocks the outer rows
    # by their count on AVX-512 CPUs (other bits at 1 pool than among 25), the last-dim form row by row
    weights = torch.softmax(logits.transpose(1, 2), dim=-1).transpose(1, 2)
    return (weights.to(k.dtype) * kp).sum(dim=1)


def index_scores(q: Tensor, weights: Tensor, pooled: Tensor) -> Tensor:
    """s [n, n_pools] fp32 = Σ_h weights[:, h] · ReLU(q[:, h]·pooled_p · c_I^-0.5).
    q [n, n_I, c_I], weights [n, n_I] (already scaled by n_I^-0.5), pooled [n_pools, c_I]."""
    if tk := kernels("indexer", q):
        return tk.index_scores(q, weights, pooled)
    s = torch.relu(torch.matmul(q.float(), pooled.float().T) * q.shape[-1] ** -0.5)  # [n, n_I, n_pools]
    return torch.matmul(weights.float().unsqueeze(1), s).squeeze(1)


def select(
    scores: Tensor, positions: Tensor, kpool: int, index_topk: int, always_select_tail: bool
) -> Tensor:
    """The selection [n, width] (token indices, -1 padded) of queries at absolute `positions` [n]
    from their pool scores [n, n_pools]."""
    if tk := kernels("indexer", scores):
        return tk.select(scores, positions, kpool, index_topk, always_select_tail)
    n, n_pools = scores.shape
    dev = scores.device
    width = selection_width(index_topk, kpool, always_select_tail)
    out = torch.full((n, width), -1, dtype=torch.long, device=dev)
    k = min(index_topk // kpool, n_pools)
    if k:
        pool_last = (torch.arange(n_pools, device=dev) + 1) * kpool - 1
        candidate = pool_last[None, :] <= positions[:, None]
        masked = scores.masked_fill(~candidate, torch.finfo(torch.float32).min)
        pools = masked.topk(k, dim=-1).indices  # [n, k]
        ok = candidate.gather(1, pools)
        tokens = pools[..., None] * kpool + torch.arange(kpool, device=dev)
        out[:, : k * kpool] = tokens.masked_fill(~ok[..., None], -1).flatten(1)
    if always_select_tail and kpool > 1:
        _select_tail(out, positions, kpool, index_topk)
    return out


def _select_tail(out: Tensor, positions: Tensor, kpool: int, start: int) -> None:
    """The open pool's tokens of each query (up to kpool - 1, -1 padded) into out[:, start : start + kpool - 1]."""
    tail_count = (positions + 1) % kpool
    offs = torch.arange(kpool - 1, device=positions.device)
    tail = positions[:, None] + 1 - tail_count[:, None] + offs
    out[:, start : start + kpool - 1] = tail.masked_fill(offs[None, :] >= tail_count[:, None], -1)


def compact_width(num_keys: int, kpool: int, tail: bool) -> int:
    """The width of causal_selection's compact layout over num_keys cached tokens: the complete pools' tokens,
    then (tail: always_select_tail and kpool > 1) room for the open pool's, at least 1."""
    return max(1, num_keys // kpool * kpool + (kpool - 1 if tail else 0))


def every_pool_fits(num_keys: int, kpool: int, index_topk: int) -> bool:
    """Whether `select` over num_keys cached tokens keeps every complete pool (it keeps index_topk // kpool):
    then the indexer's scores choose nothing, and `causal_selection` gives the selection without them."""
    return num_keys // kpool <= index_topk // kpool


def causal_selection(
    positions: Tensor,
    num_keys: int,
    kpool: int,
    index_topk: int,
    always_select_tail: bool,
    newest: bool = False,
) -> Tensor:
    """`select`'s selection when every_pool_fits, without scoring: each query's complete pools that end at
    or before it (and its open pool's tokens with always_select_tail). The same tokens as `select`, in token
    order instead of score order, so attention over them equals it up to the order of the softmax sums.
    Where the torch code attends (sequence by sequence, not the Triton kernels' batched launch, which takes
    one width), it is only as wide as these tokens: the open pool's right after the complete pools', not
    at index_topk, so a short context does not attend over index_topk masked columns.
    `newest`: the caller's word that the queries are the newest of the num_keys tokens (positions
    num_keys - n ..). Each row's compact selection is then its tokens in order from 0, -1 after: every token
    up to its own with the open pool's, else those of its complete pools; an arange and a mask (a decode step
    of the GLM-5.3 demo spent ~4 % in the ten small ops of the general case, and a verify block's rows ~30 %
    of its DSA layers' glue). Where a query's complete pools end before the last one's, the general layout
    puts its open pool's tokens after a gap of -1; this one has no gap, as a decode row at that position
    has: the same tokens in the same order."""
    n = positions.shape[0]
    m = num_keys // kpool * kpool
    tail = always_select_tail and kpool > 1
    compact = not kernels("mla", positions)
    width = compact_width(num_keys, kpool, tail) if compact else selection_width(index_topk, kpool, tail)
    if newest and compact:
        dev = positions.device
        out = torch.arange(width, device=dev).view(1, width)
        if n == 1:
            out[:, num_keys if tail else m :] = -1
            return out
        ends = torch.arange(num_keys - n + 1, num_keys + 1, device=dev)  # each query's position + 1
        if not tail:
            ends = ends // kpool * kpool
        return out.masked_fill(out >= ends[:, None], -1)
    out = torch.full((n, width), -1, dtype=torch.long, device=positions.device)
    if m:
        tokens = torch.arange(m, device=positions.device)
        done = (positions + 1) // kpool * kpool  # the tokens of complete pools ending at or before the query
        out[:, :m] = tokens.masked_fill(tokens[None, :] >= done[:, None], -1)
    if tail:
        _select_tail(out, positions, kpool, m if compact else index_topk)
    return out


def kpool_select(
    q: Tensor,
    weights: Tensor,
    k: Tensor,
    z: Tensor,
    ape: Tensor,
    positions: Tensor,
    index_topk: int,
    always_select_tail: bool = True,
) -> Tensor:
    """The whole indexer for one sequence: queries q [n, n_I, c_I] and weights [n, n_I] at
    `positions`, against the cached k, z [T, c_I] of all its tokens (those of this step included)."""
    if tk := kernels("indexer", q):
        return tk.kpool_select(q, weights, k, z, ape, positions, index_topk, always_select_tail)
    pooled = pool_keys(k, z, ape)
    return select(index_scores(q, weights, pooled), positions, ape.shape[0], index_topk, always_select_tail)


def kpool_select_held(
    q: Tensor,
    weights: Tensor,
    held,
    ape: Tensor,
    positions: Tensor,
    index_topk: int,
    always_select_tail: bool = True,
) -> Tensor:
    """kpool_select against a sequence's held rows (TokenRows / PagedRows with fields k, z, this step's
    included). Where the torch code runs, the pooled keys of complete pools are kept with the rows
    (`held.memo`): a step pools only the pools it completed instead of all T / P again (the pooled keys of a
    pool are the same bits alone or among others: pool_keys works per pool, tested)."""
    if kernels("indexer", q):
        cache = held.rows("k", "z")
        return kpool_select(
            q, weights, cache["k"], cache["z"], ape, positions, index_topk, always_select_tail
        )
    P = ape.shape[0]
    memo, pools = held.memo("pooled_keys", P), held.length // P
    if memo.count < pools:
        new = held.rows_between(memo.count * P, pools * P, "k", "z")
        memo.extend(pool_keys(new["k"], new["z"], ape))
    return select(index_scores(q, weights, memo.rows()), positions, P, index_topk, always_select_tail)


def selection_mask(selection: Tensor, num_keys: int) -> Tensor:
    """Bool [n, num_keys]: which cached tokens each query attends to."""
    mask = torch.zeros(selection.shape[0], num_keys + 1, dtype=torch.bool, device=selection.device)
    mask.scatter_(1, torch.where(selection >= 0, selection, num_keys), True)
    return mask[:, :num_keys]


def paged_sparse_mla_attend(q: Tensor, rows: list, new: list[int], w_kv_b, v_head_dim, scale, selections):
    """`sparse_mla_attend` of every sequence of a batch in one launch over the engine's pages (rows:
    each sequence's PagedRows of this layer, this step's `new` tokens appended; selections: each one's
    [n, width]) on the CUDA path; None elsewhere (the caller attends sequence by sequence)."""
    if not ((tk := kernels("mla", q)) and shared_pages(rows)):
        return None
    table, lens, starts = page_tables(rows, new, q.device)
    pool, index, sel = rows[0].fields["latent"], rows[0].index, torch.cat(selections)
    return tk.paged_sparse_mla_attend(q, pool, index, table, lens, starts, w_kv_b, v_head_dim, scale, sel)


def sparse_mla_attend(
    q: Tensor,  # [n, H, dn] NoPE queries
    latent: Tensor,  # [T, kvr] all cached latents of the sequence
    w_kv_b: Tensor,  # [H * (dn + dv), kvr]
    v_head_dim: int,
    scale: float,
    selection: Tensor,  # [n, width] token indices, -1 padded
) -> Tensor:  # [n, H, dv]
    """Attention of each query over its selected tokens only (a query with none selected gets 0).
    Two exact evaluations, chosen by operation count: `expanded` turns every cached latent into
    per-head keys and values once and masks (many queries over a short cache); `gathered` takes
    each query's selected latents and attends in the latent space, W_k absorbed into the query
    and W_v applied after (decode, and any cache much longer than the selection)."""
    if tk := kernels("mla", q):
        return tk.sparse_mla_attend(q, latent, w_kv_b, v_head_dim, scale, selection)
    if gathered_is_cheaper(q, latent.shape[0], w_kv_b, v_head_dim, selection):
        return attend_gathered(q, latent, w_kv_b, v_head_dim, scale, selection)
    return attend_expanded(q, latent, w_kv_b, v_head_dim, scale, selection)


def gathered_is_cheaper(q: Tensor, num_keys: int, w_kv_b: Tensor, v_head_dim: int, selection: Tensor) -> bool:
    """sparse_mla_attend's choice by operation count: the gathered evaluation (each query's selected latents)
    rather than the expanded one (every cached latent turned into keys and values once)."""
    n, H, dn = q.shape
    return _gathered_cheaper(n, num_keys, w_kv_b.shape[1], dn, v_head_dim, selection.shape[1])


def _gathered_cheaper(n: int, num_keys: int, kvr: int, dn: int, dv: int, width: int) -> bool:
    return n * kvr * (2 * width + dn + dv) < num_keys * (dn + dv) * (kvr + n)


def fused_block(L: int, batch, x: Tensor, m, ix: IndexerWeights | None, c) -> Tensor | None:
    """A DSA module (GLM-5.3's Model.dsa_block, config c) in one compiled call where every sequence of the batch,
    packed in order, attends to all its cached tokens (every_pool_fits with this step's rows: the compact causal
    selections, no scores) by the gathered evaluation over the engine's pages (decode rows and verify blocks within
    index_topk tokens): cpu.dsa_block makes the calls the module's code makes, in its order, so the same bits,
    without ~30 small calls and ops a layer (~90 us a decode row on the GLM-5.3 benchmark model). -> [N, d]; None
    where it does not apply (the caller runs the code)."""
    N = x.shape[0]
    if not (x.is_cpu and x.dtype == torch.bfloat16 and N <= cpu.MAX_ROWS and m.q is None):
        return None
    if kernels("mla", x):
        return None
    layers = [s.state.layers[L] for s in batch.seqs]
    if not shared_pages(layers):
        return None
    H, dn, dv, kvr, P = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank, c.index_kpool
    tail = c.index_kpool_always_select_tail and P > 1
    at, widths = 0, []
    for s, held in zip(batch.seqs, layers):
        T = held.length + s.n
        widths.append(compact_width(T, P, tail))
        if s.start != at or not every_pool_fits(T, P, c.index_topk):
            return None
        if not _gathered_cheaper(s.n, T, kvr, dn, dv, widths[-1]):
            return None
        at += s.n
    if at != N:
        return None

    def make():
        mats = [m.q_a, m.q_b, m.kv_a, *(() if ix is None else (ix.wk, ix.gate)), m.o]
        k_norm, k_bias = (None, None) if ix is None else (ix.k_norm, ix.k_norm_bias)
        return cpu.dsa_plan([operand(t) for t in mats], [m.q_a_norm, m.kv_a_norm], m.kv_b, k_norm, k_bias, N)

    if (plan := kept(m.fused_plans, ("dsa", N, torch.get_num_threads()), make)) is None:
        return None

    views = layers[0].views
    pools = [views["latent"]] if ix is None else [views["latent"], views["k"], views["z"]]
    place, eps, scale = placer(layers, batch), c.rms_norm_eps, dn**-0.5
    return cpu.dsa_block(x, plan, pools, eps, kvr, INDEXER_NORM_EPS, H, dv, scale, P, tail, widths, place)


def sparse_mla_attend_held(q: Tensor, held, w_kv_b: Tensor, v_head_dim: int, scale: float, selection: Tensor):
    """`sparse_mla_attend` over a sequence's layer state `held` (its "latent" rows, this step's included):
    where the gathered evaluation is the one chosen and the CPU kernels take it (bf16), a paged state's rows
    are read in place from their pages; otherwise the rows are gathered and attended as before. A decode
    row's selection is every held row while the pools fit the top-k, so gathering copied the whole latent
    cache per layer and step (2 MB a layer at 2048 rows of 512) for the kernel to read it again."""
    T, dv = held.length, v_head_dim
    if hasattr(held, "pages") and not kernels("mla", q) and gathered_is_cheaper(q, T, w_kv_b, dv, selection):
        views, ids = held.pages()
        fused = cpu.dsa_gathered(
            q, views["latent"], w_kv_b, dv, scale, selection, 0, product_limit(), pages=(ids, T)
        )
        if fused is not None:
            return fused
    return sparse_mla_attend(q, held.rows("latent")["latent"], w_kv_b, dv, scale, selection)


def attend_expanded(q, latent, w_kv_b, dv, scale, selection):
    n, H, dn = q.shape
    T = latent.shape[0]
    kv = linear(latent, w_kv_b).view(T, H, dn + dv).transpose(0, 1)  # [H, T, dn+dv]
    k, v = kv[..., :dn], kv[..., dn:]
    mask = selection_mask(selection, T)
    s = matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, n, T]
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) * mask.any(-1, keepdim=True)
    return matmul(p, v).transpose(0, 1)


def attend_gathered(q, latent, w_kv_b, dv, scale, selection, block_elems: int = 1 << 25):
    fused = cpu.dsa_gathered(q, latent, w_kv_b, dv, scale, selection, block_elems, product_limit())
    if fused is not None:  # the code below in one call on the CPU
        return fused
    n, H, dn = q.shape
    kvr = latent.shape[1]
    w = w_kv_b.view(H, dn + dv, kvr)
    q_lat = matmul(q.transpose(0, 1), w[:, :dn]).transpose(0, 1)  # [n, H, kvr]
    o_lat = q_lat.new_empty(n, H, kvr)
    step = max(1, block_elems // max(1, selection.shape[1] * kvr))  # queries per block: bounds the gather
    for a in range(0, n, step):
        sel = selection[a : a + step]
        valid = sel >= 0
        lat = latent[sel.clamp(min=0)]  # [b, W, kvr]
        s = matmul(q_lat[a : a + step], lat.transpose(1, 2)).float() * scale  # [b, H, W]
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(latent.dtype)
        o_lat[a : a + step] = matmul(p, lat)
    return matmul(o_lat.transpose(0, 1), w[:, dn:].transpose(1, 2)).transpose(0, 1)  # [n, H, dv]
