"""Block Attention Residuals (AttnRes, Kimi K3): a learned softmax mix over depth replaces the
residual sum.

Each token carries, across the layers of one forward, a *bank* of archived block sums and the
running *partial* sum of the current block. Wherever a residual stream would be read (before the
mixer, before the FFN, and once before the final norm) the model reads instead

    V      = [bank_0, ..., bank_{nb-1}, partial]           raw candidates [nb+1, N, d]
    K_i    = V_i / rms(V_i)                                weightless RMSNorm, eps = rms_norm_eps
    logit_i = sum_d K_i[d] * norm_w[d] * proj_w[d]         one learned pseudo-query per site
    mix    = sum_i softmax(logit)_i * V_i                  mixes the RAW candidates

Every `block_size` layers, at the start of layer L, the entering partial sum is archived
(after that layer's pre-mixer mix is read) and the partial restarts from zero; bank entry 0 is
the embedding. The bank lives only inside one forward (per token, across depth): AttnRes keeps
no state across tokens. Everything here is fp32, as in the released reference: the logits of
the candidates sit close together, so the mix amplifies rounding noise.

Sources: the Attention Residuals report (Kimi Team, arXiv:2603.15031, "Block AttnRes") and Moonshot's
remote code `modeling_kimi_linear.py` in the Hugging Face repository `moonshotai/Kimi-K3`; the model's
use of it: docs/families/kimi_k3.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


def attnres_mix(partial: Tensor, bank: list[Tensor], proj: Tensor, norm: Tensor, eps: float) -> Tensor:
    """The AttnRes read of one site for N tokens: partial [N, d], bank entries [N, d] (any float
    dtype), proj [1, d] or [d], norm [d]. Returns a new fp32 tensor [N, d] (never a view of an
    input: the caller keeps adding into `partial`)."""
    V = torch.stack([b.float() for b in bank] + [partial.float()])  # [K, N, d]
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    query = norm.float() * proj.float().reshape(-1)
    p = torch.softmax(K @ query, dim=0)  # [K, N]
    return (p.unsqueeze(-1) * V).sum(0)


def is_block_start(layer: int, block_size: int) -> bool:
    """Layers whose entering partial sum is archived into the bank (0, B, 2B, ...)."""
    return layer % block_size == 0


def bank_size(num_layers: int, block_size: int) -> int:
    """Bank entries at the end of a forward (the embedding counts as the first)."""
    return sum(is_block_start(L, block_size) for L in range(num_layers))
