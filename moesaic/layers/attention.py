"""Plain grouped-query attention of each sequence's new queries over its cached keys and values.

    s   = (q k^T) * scale          per query head; head h reads KV head h // (Hq / Hkv)
    p   = softmax(s) in fp32       causal: new query i sees keys 0 .. past + i
    out = p v                      in the values' dtype

No position encoding is applied here: a family ropes q and k (or not, e.g. Nemotron-H's NoPE
attention) before it appends k to the cache. The products are layers/linear.matmul's (half precision on
a CPU: in fp32, rounded once).
"""

from __future__ import annotations

import torch

from ..kernels import cpu
from .linear import matmul
from .mla import causal_mask


def gqa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] are the last n of the T cached positions; k [T, Hkv, D], v [T, Hkv, Dv].
    Returns [n, Hq, Dv]."""
    n, Hq, _ = q.shape
    T, Hkv, _ = k.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} key/value heads")
    if (
        n > 1
        and (fused := cpu.causal_attention(q, k, v, scale, round_scores=True, normalize_first=True))
        is not None
    ):
        return fused  # the code below in one call on the CPU (prompts; a decode row keeps it)
    qg = q.reshape(n, Hkv, Hq // Hkv, -1).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
    s = matmul(qg, k.permute(1, 2, 0)[:, None]).float() * scale  # [Hkv, g, n, T]
    mask = causal_mask(n, T, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    out = matmul(p, v.permute(1, 0, 2)[:, None])  # [Hkv, g, n, Dv]
    return out.permute(2, 0, 1, 3).reshape(n, Hq, -1)


def gqa_batch(L: int, batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """GQA for every sequence of a ForwardBatch: appends each one's new k [n, Hkv, D] and v [n, Hkv, Dv]
    rows to its layer-L cache (TokenRows with fields "k" and "v"), then attends its queries over all
    of them. q [N, Hq, D] -> [N, Hq, Dv]."""
    N, Hq, _ = q.shape
    Hkv = k.shape[1]
    out = q.new_empty(N, Hq, v.shape[-1])
    for s in batch.seqs:
        rows = slice(s.start, s.start + s.n)
        cache = s.state.layers[L].append(k=k[rows].flatten(1), v=v[rows].flatten(1))
        T = cache["k"].shape[0]
        out[rows] = gqa_attend(q[rows], cache["k"].view(T, Hkv, -1), cache["v"].view(T, Hkv, -1), scale)
    return out
