"""Absorbed MLA / DSA decode attention over the paged latent cache, many sequences per launch.

The paged layout (the engine's paged rows, issue 12): one pool tensor per row field, [num_blocks, layers,
PAGE, width] with PAGE = 64 rows; the sequences' block tables padded into one int32 [num_seqs, max_blocks]
(block i holds the sequence's tokens i*PAGE ...); `seq_lens` [num_seqs] counts each sequence's cached tokens, those of this
step included. Queries are packed over the sequences (varlen): `query_start` [num_seqs + 1] are their
offsets, and query i of a sequence with n new tokens sits at position seq_len - n + i (causal).

One kernel serves both attentions, in the latent space (W_uk folded into the query, W_uv applied after):
  dense (MLA): each query sees every cached token up to its position;   layers/mla.py latent_attention
  sparse (DSA): each query sees its selected tokens only (-1 padded);   layers/dsa.py sparse_mla_attend
Each program takes one query token, a block of BH = 16 heads (each latent row it reads serves all 16;
the H/16 programs of a token run side by side, so the other reads mostly hit L2) and one split of the
keys (flash-decoding: splits make enough programs for a batch of one); a second kernel merges the
splits' partial softmax sums. Scores and softmax in fp32, as the references; bf16 operands on the
tensor cores.

`latent_attention` and `sparse_mla_attend` keep the references' signatures (one sequence, contiguous
rows: they are viewed as pages, no copy); `paged_latent_attention` and `paged_sparse_mla_attend` are the
paged, varlen forms; `gather_pages` reads a sequence's rows back (the torch reference path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_device, mma, native_dot, num_sms, pow2

PAGE = 64


def gather_pages(pool: torch.Tensor, layer: int, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` rows of `layer` from a pool [blocks, layers, PAGE, width]."""
    nb = -(-length // pool.shape[2])
    return pool[block_ids[:nb].long(), layer].reshape(nb * pool.shape[2], -1)[:length]


@triton.jit
def _split_kernel(
    q_lat, q_rope, lat, rope, table, seq_lens, qstart, tok_seq, sel, part_o, part_ml,
    H, kvr, dr, W, split_len, scale,
    s_qh, s_qt, s_rt, s_rh, s_lb, s_ll, s_lr, s_pb, s_pl, s_pr, s_tab, s_sel, layer,
    PAGE: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    HAS_ROPE: tl.constexpr, SPARSE: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    hb, t, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    nsp = tl.num_programs(2)
    s = tl.load(tok_seq + t)
    q0 = tl.load(qstart + s)
    n_new = tl.load(qstart + s + 1) - q0
    pos = tl.load(seq_lens + s) - n_new + (t - q0)
    n_keys = W if SPARSE else pos + 1
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, n_keys)

    rh = hb * BH + tl.arange(0, BH)
    rd = tl.arange(0, BD)
    mh, md = rh < H, rd < kvr
    kv_ty = lat.dtype.element_ty
    q = tl.load(
        q_lat + rh[:, None] * s_qh + t * s_qt + rd[None, :], mask=mh[:, None] & md[None, :], other=0.0
    )
    if HAS_ROPE:
        rr = tl.arange(0, BR)
        mr = rr < dr
        qr = tl.load(
            q_rope + t * s_rt + rh[:, None] * s_rh + rr[None, :], mask=mh[:, None] & mr[None, :], other=0.0
        )

    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BD], dtype=tl.float32)
    for j0 in range(lo, hi, BN):
        j = j0 + tl.arange(0, BN)
        valid = j < hi
        if SPARSE:
            key = tl.load(sel + t * s_sel + j, mask=valid, other=-1)
            valid = valid & (key >= 0)
        else:
            key = j
        key = tl.where(valid, key, 0)
        blk = tl.load(table + s * s_tab + key // PAGE, mask=valid, other=0).to(tl.int64)
        row = blk * s_lb + layer * s_ll + (key % PAGE) * s_lr
        K = tl.load(lat + row[:, None] + rd[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        scores = mma(q, tl.trans(K), tl.zeros([BH, BN], dtype=tl.float32), NATIVE, kv_ty)
        if HAS_ROPE:
            rrow = blk * s_pb + layer * s_pl + (key % PAGE) * s_pr
            Kr = tl.load(rope + rrow[:, None] + rr[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
            scores = mma(qr, tl.trans(Kr), scores, NATIVE, kv_ty)
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p, K, acc * alpha[:, None], NATIVE, kv_ty)
        m_i = m_new

    base = (t * nsp + sp) * H + rh
    tl.store(part_o + base[:, None] * kvr + rd[None, :], acc, mask=mh[:, None] & md[None, :])
    tl.store(part_ml + base * 2, m_i, mask=mh)
    tl.store(part_ml + base * 2 + 1, l_i, mask=mh)


@triton.jit
def _merge_kernel(part_o, part_ml, out, H, kvr, nsp, s_oh, s_ot, BS: tl.constexpr, BD: tl.constexpr):
    h, t = tl.program_id(0), tl.program_id(1)
    rs = tl.arange(0, BS)
    ms = rs < nsp
    base = (t * nsp + rs) * H + h
    m = tl.load(part_ml + base * 2, mask=ms, other=float("-inf"))
    l = tl.load(part_ml + base * 2 + 1, mask=ms, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)
    denom = tl.sum(w * l, axis=0)
    inv = tl.where(
        denom > 0, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0
    )  # no key at all (a DSA query with none selected): 0
    for d0 in range(0, kvr, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < kvr
        o = tl.load(part_o + base[:, None] * kvr + rd[None, :], mask=ms[:, None] & md[None, :], other=0.0)
        o = tl.sum(o * w[:, None], axis=0) * inv
        tl.store(out + h * s_oh + t * s_ot + rd, o.to(out.dtype.element_ty), mask=md)


def _attend(
    q_lat,
    q_rope,
    lat,
    rope,
    layer,
    strides,
    table,
    seq_lens,
    query_start,
    scale,
    selection,
    max_keys,
    num_splits,
    tok_seq=None,
):
    """The launch shared by every form. q_lat [H, N, kvr] (any strides, last dim contiguous). tok_seq: each
    query's sequence (int32 [N]), when the caller has it (a decode step's arange); found from query_start
    otherwise."""
    check_device(q_lat, lat)
    H, N, kvr = q_lat.shape
    dev = q_lat.device
    out = torch.empty(H, N, kvr, dtype=lat.dtype, device=dev)
    if N == 0:
        return out
    has_rope = rope is not None and rope.shape[-1] > 0
    dr = rope.shape[-1] if has_rope else 0
    BH, BN = 16, 32
    nhb = triton.cdiv(H, BH)
    if num_splits is None:  # enough programs for ~2 waves, each split at least 256 keys
        num_splits = max(1, min(triton.cdiv(2 * num_sms(dev), N * nhb), triton.cdiv(max_keys, 256), 64))
    split_len = triton.cdiv(triton.cdiv(max(max_keys, 1), num_splits), BN) * BN
    qs = query_start.to(device=dev, dtype=torch.int32)
    if tok_seq is None:
        tok_seq = torch.searchsorted(qs[1:], torch.arange(N, device=dev, dtype=torch.int32), right=True)
        tok_seq = tok_seq.to(torch.int32)
    part_o = torch.empty(N, num_splits, H, kvr, dtype=torch.float32, device=dev)
    part_ml = torch.empty(N, num_splits, H, 2, dtype=torch.float32, device=dev)
    sel = selection.to(device=dev, dtype=torch.int32).contiguous() if selection is not None else qs
    q_rope_t = q_rope if has_rope else q_lat
    rope_t = rope if has_rope else lat
    (s_lb, s_ll, s_lr), (s_pb, s_pl, s_pr) = strides
    table = table.to(device=dev, dtype=torch.int32)
    _split_kernel[(nhb, N, num_splits)](
        q_lat, q_rope_t, lat, rope_t, table, seq_lens.to(device=dev, dtype=torch.int32), qs, tok_seq, sel,
        part_o, part_ml,
        H, kvr, dr, selection.shape[1] if selection is not None else 0, split_len, float(scale),
        q_lat.stride(0), q_lat.stride(1),
        q_rope_t.stride(0) if has_rope else 0, q_rope_t.stride(1) if has_rope else 0,
        s_lb, s_ll, s_lr, s_pb, s_pl, s_pr, table.stride(0), sel.stride(0) if selection is not None else 0,
        layer,
        PAGE=PAGE, BH=BH, BD=pow2(kvr), BR=pow2(dr), BN=BN, HAS_ROPE=has_rope, SPARSE=selection is not None,
        NATIVE=native_dot(lat.dtype),
        num_warps=8, num_stages=2,
    )  # fmt: skip
    _merge_kernel[(H, N)](
        part_o, part_ml, out, H, kvr, num_splits, out.stride(0), out.stride(1),
        BS=pow2(num_splits, 2), BD=min(512, pow2(kvr)), num_warps=4,
    )  # fmt: skip
    return out


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def paged_latent_attention(
    q_lat, q_rope, latent_pool, rope_pool, layer, block_table, seq_lens, query_start, scale, num_splits=None,
    tok_seq=None,
):  # fmt: skip
    """Absorbed MLA attention of every decoding sequence in one launch.

    q_lat [H, N, kvr] (absorb_queries of the packed queries), q_rope [N, H, dr] (or None), latent_pool
    [blocks, layers, PAGE, kvr], rope_pool [blocks, layers, PAGE, dr] (or None), layer: the pools' layer
    index, block_table int32 [S, max_blocks], seq_lens [S], query_start [S + 1], tok_seq: each query's
    sequence (int32 [N]) if known. -> o_lat [H, N, kvr] in the pool's dtype (absorb_output turns it into
    [N, H, dv])."""
    q_lat, latent_pool = _last_contiguous(q_lat), _last_contiguous(latent_pool)
    if rope_pool is not None:
        q_rope, rope_pool = _last_contiguous(q_rope), _last_contiguous(rope_pool)
    lat_s = latent_pool.stride()[:3]
    rope_s = rope_pool.stride()[:3] if rope_pool is not None else (0, 0, 0)
    max_keys = block_table.shape[1] * latent_pool.shape[2]
    return _attend(
        q_lat, q_rope, latent_pool, rope_pool, layer, (lat_s, rope_s),
        block_table, seq_lens, query_start, scale, None, max_keys, num_splits, tok_seq,
    )  # fmt: skip


def paged_sparse_latent_attention(
    q_lat, latent_pool, layer, block_table, seq_lens, query_start, scale, selection, num_splits=None
):
    """DSA's attention in the latent space over each query's selected tokens: selection [N, width]
    token indices within the query's sequence, -1 padded; other arguments as paged_latent_attention
    (no rope: GLM-5.3's DSA is NoPE). A query with nothing selected gets 0. -> o_lat [H, N, kvr]."""
    q_lat, latent_pool = _last_contiguous(q_lat), _last_contiguous(latent_pool)
    return _attend(
        q_lat, None, latent_pool, None, layer, (latent_pool.stride()[:3], (0, 0, 0)),
        block_table, seq_lens, query_start, scale, selection, selection.shape[1], num_splits,
    )  # fmt: skip


def _as_pages(rows: torch.Tensor):
    """Contiguous rows [T, w] seen as pages of PAGE rows (no copy): strides and the identity block table."""
    rows = _last_contiguous(rows)
    T = rows.shape[0]
    table = torch.arange(max(1, -(-T // PAGE)), dtype=torch.int32, device=rows.device)[None]
    return rows, (PAGE * rows.stride(0), 0, rows.stride(0)), table


def _one_sequence(n: int, T: int, device):
    """(seq_lens [1], query_start [2]) of one sequence, made on the device (a torch.tensor of host
    values would be a synchronous copy on CUDA)."""
    return (
        torch.full((1,), T, dtype=torch.int32, device=device),
        torch.arange(2, dtype=torch.int32, device=device) * n,
    )


def latent_attention(q_lat, q_rope, latent, k_rope, scale, num_splits=None):
    """layers/mla.py `latent_attention` for one sequence: q_lat [H, n, kvr], q_rope [n, H, dr],
    latent [T, kvr], k_rope [T, dr] -> o_lat [H, n, kvr] (causal over the last n positions)."""
    n, T = q_lat.shape[1], latent.shape[0]
    latent, lat_s, table = _as_pages(latent)
    has_rope = k_rope.shape[1] > 0
    rope_s = (0, 0, 0)
    if has_rope:
        k_rope, rope_s, _ = _as_pages(k_rope)
        q_rope = _last_contiguous(q_rope)
    seq_lens, qs = _one_sequence(n, T, latent.device)
    return _attend(
        _last_contiguous(q_lat), q_rope if has_rope else None, latent, k_rope if has_rope else None, 0,
        (lat_s, rope_s), table, seq_lens, qs, scale, None, T, num_splits,
    )  # fmt: skip


def _absorb(q, w_kv_b, v_head_dim):
    n, H, dn = q.shape
    w = w_kv_b.view(H, dn + v_head_dim, -1)
    return torch.einsum("nhd,hdk->hnk", q, w[:, :dn]), w[:, dn:]


def sparse_mla_attend(q, latent, w_kv_b, v_head_dim: int, scale: float, selection, num_splits=None):
    """layers/dsa.py `sparse_mla_attend` for one sequence: q [n, H, dn] NoPE queries, latent [T, kvr],
    w_kv_b [H (dn + dv), kvr], selection [n, width] (-1 padded) -> [n, H, dv]."""
    n = q.shape[0]
    q_lat, w_uv = _absorb(q, w_kv_b, v_head_dim)
    latent, lat_s, table = _as_pages(latent)
    seq_lens, qs = _one_sequence(n, latent.shape[0], latent.device)
    o_lat = _attend(
        q_lat, None, latent, None, 0, (lat_s, (0, 0, 0)), table, seq_lens, qs, scale, selection,
        selection.shape[1], num_splits,
    )  # fmt: skip
    return torch.einsum("hnk,hvk->nhv", o_lat, w_uv)


def paged_sparse_mla_attend(
    q, latent_pool, layer, block_table, seq_lens, query_start, w_kv_b, v_head_dim, scale, selection,
    num_splits=None,
):  # fmt: skip
    """`sparse_mla_attend` for many sequences over the paged latent: q [N, H, dn] packed queries, the
    rest as paged_sparse_latent_attention -> [N, H, dv]."""
    q_lat, w_uv = _absorb(q, w_kv_b, v_head_dim)
    o_lat = paged_sparse_latent_attention(
        q_lat, latent_pool, layer, block_table, seq_lens, query_start, scale, selection, num_splits
    )
    return torch.einsum("hnk,hvk->nhv", o_lat, w_uv)
