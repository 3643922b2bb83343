"""Multi-head latent attention (DeepSeek-V2 MLA) over a cached latent.

Each token caches only the normalised latent `c` [kv_lora] and the shared rope key `kr` [rope];
per-head keys and values are `c @ W_kv_b`. Two exact evaluations of the same attention:

* expanded: materialise k_nope/v for every cached token, then ordinary attention — cheapest when
  many queries share the expansion (prefill);
* absorbed: fold W_k into the query and W_v into the output so attention runs in the latent
  space — cheapest when few queries meet a long cache (decode).

`mla_attend` picks by the operation count of the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(n_new: int, total: int, device) -> torch.Tensor | None:
    """Bool mask [n_new, total] letting query i see keys 0..total-n_new+i (None when not needed)."""
    if n_new == 1:
        return None
    q = torch.arange(total - n_new, total, device=device)[:, None]
    return torch.arange(total, device=device)[None, :] <= q


def mla_attend(
    q_nope: torch.Tensor,  # [n, H, dn]
    q_rope: torch.Tensor,  # [n, H, dr]
    latent: torch.Tensor,  # [T, kvr] all cached rows (the last n are this step's)
    k_rope: torch.Tensor,  # [T, dr]
    w_kv_b: torch.Tensor,  # [H * (dn + dv), kvr]
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [n, H, dv]
    n, H, dn = q_nope.shape
    T, kvr = latent.shape
    dv = v_head_dim
    absorbed_cost = n * (2 * kvr + k_rope.shape[1])
    expanded_cost = kvr * (dn + dv)
    if absorbed_cost < expanded_cost:
        return _attend_absorbed(q_nope, q_rope, latent, k_rope, w_kv_b, dv, scale)
    return _attend_expanded(q_nope, q_rope, latent, k_rope, w_kv_b, dv, scale)


def _attend_expanded(q_nope, q_rope, latent, k_rope, w_kv_b, dv, scale):
    n, H, dn = q_nope.shape
    T = latent.shape[0]
    kv = F.linear(latent, w_kv_b).view(T, H, dn + dv)
    k = torch.cat([kv[..., :dn], k_rope[:, None, :].expand(T, H, k_rope.shape[1])], dim=-1)
    v = kv[..., dn:]
    q = torch.cat([q_nope, q_rope], dim=-1)
    mask = causal_mask(n, T, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def _attend_absorbed(q_nope, q_rope, latent, k_rope, w_kv_b, dv, scale):
    n, H, dn = q_nope.shape
    T, kvr = latent.shape
    w = w_kv_b.view(H, dn + dv, kvr)
    q_lat = torch.einsum("nhd,hdk->hnk", q_nope, w[:, :dn])  # [H, n, kvr]
    scores = torch.matmul(q_lat, latent.T) + torch.matmul(q_rope.transpose(0, 1), k_rope.T)  # [H, n, T]
    scores = scores.float() * scale
    mask = causal_mask(n, T, q_nope.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(latent.dtype)
    o_lat = torch.matmul(p, latent)  # [H, n, kvr]
    return torch.einsum("hnk,hvk->nhv", o_lat, w[:, dn:])
