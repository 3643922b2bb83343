"""Lightning-indexer scores and top-k selection: GLM-5.3's k-pool indexer (layers/dsa.py `index_scores`,
`select`, `kpool_select`) and DeepSeek-V4's CSA indexer (layers/csa.py `index_score_blocks`,
`indexer_select`). Both score an entry (a pool of P tokens, or a compressed entry of m tokens) as

    s(t, e) = Σ_h w_t[h] · ReLU(q_t[h] · K_e) · c^-0.5      (fp32)

and query t may pick entry e iff e < (t + 1) // P (its window is complete). One program per (query,
block of entries) forms the [heads, entries] products with tl.dot and reduces over the heads; entries
not yet visible get -inf in the same kernel. The top-k is torch.topk on the device (no host sync); a
fused radix select is left for when the indexer shows up in a profile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import F32_DOT, check_device, pow2
from .compressor import pool_keys


@triton.jit
def _scores_kernel(
    q, w, keys, pos, out, nI, c, E, ratio, scale, s_qn, s_qh, s_wn, s_k, s_out,
    MASK: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    t, eb = tl.program_id(0), tl.program_id(1)
    rh = tl.arange(0, BH)
    re = eb * BE + tl.arange(0, BE)
    mh, me = rh < nI, re < E
    acc = tl.zeros([BH, BE], dtype=tl.float32)
    for c0 in range(0, c, BC):
        rc = c0 + tl.arange(0, BC)
        mc = rc < c
        qt = tl.load(
            q + t * s_qn + rh[:, None] * s_qh + rc[None, :], mask=mh[:, None] & mc[None, :], other=0.0
        )
        kt = tl.load(keys + re[:, None] * s_k + rc[None, :], mask=me[:, None] & mc[None, :], other=0.0)
        acc += tl.dot(qt.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision=F32_DOT)
    wt = tl.load(w + t * s_wn + rh, mask=mh, other=0.0).to(tl.float32)
    s = tl.sum(wt[:, None] * (tl.maximum(acc, 0.0) * scale), axis=0)
    if MASK:
        visible = (tl.load(pos + t) + 1) // ratio
        s = tl.where(re < visible, s, float("-inf"))
    tl.store(out + t * s_out + re, s, mask=me)


def _scores(q, weights, keys, positions, ratio):
    check_device(q, keys)
    n, nI, c = q.shape
    E = keys.shape[0]
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.contiguous()
    out = torch.empty(n, E, dtype=torch.float32, device=q.device)
    if n == 0 or E == 0:
        return out
    BE = 64
    mask = positions is not None
    pos = positions.to(device=q.device, dtype=torch.int64).contiguous() if mask else weights
    _scores_kernel[(n, triton.cdiv(E, BE))](
        q, weights, keys, pos, out, nI, c, E, max(1, int(ratio)), c**-0.5,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), out.stride(0),
        MASK=mask, BH=pow2(nI), BC=min(64, pow2(c)), BE=BE, num_warps=8,
    )  # fmt: skip
    return out


def index_scores(q, weights, pooled):
    """layers/dsa.py `index_scores`: s [n, n_pools] fp32 from q [n, n_I, c_I], weights [n, n_I] (already
    scaled by n_I^-0.5), pooled [n_pools, c_I]."""
    return _scores(q, weights, pooled, None, 1)


def indexer_scores(q, weights, keys, positions, ratio: int):
    """All of layers/csa.py `index_score_blocks` at once: [n, E] fp32, -inf on entries query t cannot
    see yet (e >= (positions[t] + 1) // ratio)."""
    return _scores(q, weights, keys, positions, ratio)


def indexer_select(
    q, weights, keys, positions, ratio: int, topk: int, block: int = 1, topk_blocks: int = 0, allowed=None
):
    """layers/csa.py `indexer_select`: (sel [n, min(topk, E)] the top-k visible entries per query, -1
    where nothing is selected; None, or with topk_blocks > 0 (V4.1's candidate source) the candidate
    blocks [n, ceil(E / block)] bool: the topk_blocks blocks of `block` entries with the highest max
    score, the block of the newest visible entry pinned). `allowed` [n, nb] (another layer's candidate
    blocks) sets the scores outside them to -inf. Scores and masks in Triton, the top-k in torch."""
    n, E = q.shape[0], keys.shape[0]
    k = min(topk, E)
    nb = -(-E // block)
    dev = q.device
    sel = torch.full((n, k), -1, dtype=torch.long, device=dev)
    keep = torch.zeros(n, nb, dtype=torch.bool, device=dev) if topk_blocks else None
    if E == 0 or n == 0:
        return sel, keep
    s = indexer_scores(q, weights, keys, positions, ratio)
    if topk_blocks:
        bs = F.pad(s, (0, nb * block - E), value=float("-inf")).view(n, nb, block).amax(-1)
        newest = ((positions.to(dev) + 1) // ratio - 1)[:, None]  # -1: nothing visible (all blocks -inf)
        col = newest.clamp(min=0) // block
        bs.scatter_(1, col, torch.where(newest >= 0, float("inf"), bs.gather(1, col)))
        val, idx = bs.topk(min(topk_blocks, nb), dim=-1)
        keep.scatter_(1, idx, val > float("-inf"))
    if allowed is not None:
        s = s.masked_fill(~allowed[:, torch.arange(E, device=dev) // block], float("-inf"))
    val, idx = s.topk(k, dim=-1)
    return torch.where(val == float("-inf"), -1, idx), keep


def _token_selection(masked, positions, kpool: int, index_topk: int, always_select_tail: bool):
    """The DSA selection [n, width] from pool scores with the invisible pools at -inf (dsa.py `select`:
    the selected pools' tokens, then the tail of the (t + 1) mod P newest tokens)."""
    n, n_pools = masked.shape
    dev = masked.device
    positions = positions.to(dev)
    width = index_topk + (kpool - 1 if always_select_tail else 0)
    out = torch.full((n, width), -1, dtype=torch.long, device=dev)
    k = min(index_topk // kpool, n_pools)
    if k:
        pools = masked.topk(k, dim=-1).indices
        ok = pools < ((positions + 1) // kpool)[:, None]
        tokens = pools[..., None] * kpool + torch.arange(kpool, device=dev)
        out[:, : k * kpool] = tokens.masked_fill(~ok[..., None], -1).flatten(1)
    if always_select_tail and kpool > 1:
        tail_count = (positions + 1) % kpool
        offs = torch.arange(kpool - 1, device=dev)
        tail = positions[:, None] + 1 - tail_count[:, None] + offs
        out[:, index_topk:] = tail.masked_fill(offs[None, :] >= tail_count[:, None], -1)
    return out


def select(scores, positions, kpool: int, index_topk: int, always_select_tail: bool):
    """layers/dsa.py `select` from unmasked pool scores [n, n_pools]."""
    n_pools = scores.shape[1]
    pool_last = (torch.arange(n_pools, device=scores.device) + 1) * kpool - 1
    masked = scores.masked_fill(pool_last[None, :] > positions.to(scores.device)[:, None], float("-inf"))
    return _token_selection(masked, positions, kpool, index_topk, always_select_tail)


def kpool_select(q, weights, k, z, ape, positions, index_topk: int, always_select_tail: bool = True):
    """layers/dsa.py `kpool_select`, the whole GLM-5.3 indexer for one sequence: pooled keys (Triton),
    masked scores (Triton), top-k and the tail."""
    P = ape.shape[0]
    masked = indexer_scores(q, weights, pool_keys(k, z, ape), positions, P)
    return _token_selection(masked, positions, P, index_topk, always_select_tail)
