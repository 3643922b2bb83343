"""Exact acceptance of a round of drafts, as pure functions of the target's distributions, the draft's and
the uniforms (so that a test can enumerate every branch).

One round verifies drafts d_1..d_k with the target's rows 0..k (row i: the target's distribution of the token
after d_1..d_i, i.e. the one d_{i+1} guesses). It commits the accepted drafts and one more token: the
correction where a draft was rejected, or the bonus token of row k when all were accepted.

- Greedy: d_{i+1} is accepted iff it is the target's argmax of row i; the committed tokens are exactly
  plain greedy decoding's.
- Sampled, draft distribution q_i (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding", arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318): accept d with probability
  min(1, p_i(d) / q_i(d)); on rejection draw from norm(max(p_i - q_i, 0)). The committed tokens are
  distributed exactly as the target's own samples.
- Sampled, deterministic drafter (q_i one-hot on d): the same rule reads "accept with probability p_i(d),
  else draw from p_i without d", which is drawing x ~ p_i and accepting iff x == d. Done that way, with the
  uniform plain sampling would use for that token (`inverse_cdf`), the committed tokens are not only
  equal in distribution but equal token for token to plain sampling from the same seed.

Uniforms: `uniform(i, slot)` for row i; slot 0 is the acceptance test of d_{i+1} (probabilistic drafts
only), slot 1 draws a token from row i (correction, bonus, or the coupled draw). The engine draws them from
the request's generator in the order asked; a test gives chosen values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval holds u * total (u in [0, 1)): the token plain
    sampling draws from `probs` [V] with uniform u. A token of probability 0 is never returned."""
    cdf = probs.double().cumsum(-1)
    i = int(
        torch.searchsorted(
            cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device), right=True
        )
    )
    if i >= probs.shape[-1] or probs[i] <= 0:  # u * total rounded onto the end of the last interval
        i = int(torch.nonzero(probs > 0).max())
    return i


def accept_greedy(target: Callable[[int], int], drafts: list[int]) -> list[int]:
    """The committed tokens of a greedy round; `target(i)` is the target's argmax of row i."""
    out = []
    for i, d in enumerate(drafts):
        t = target(i)
        out.append(t)
        if t != d:
            return out
    out.append(target(len(drafts)))
    return out


def accept_sampled(
    p: Callable[[int], torch.Tensor],
    drafts: list[int],
    q: torch.Tensor | None,
    uniform: Callable[[int, int], float],
) -> list[int]:
    """The committed tokens of a sampled round. `p(i)`: the target's probabilities [V] of row i (after
    penalties, temperature, top-k/top-p); `q`: the drafter's [k, V] (None: a deterministic drafter)."""
    out = []
    for i, d in enumerate(drafts):
        pi = p(i)
        if q is None:  # one-hot q: draw the target's token and compare
            x = inverse_cdf(pi, uniform(i, 1))
            out.append(x)
            if x != d:
                return out
            continue
        qi = q[i].to(pi.dtype)
        if uniform(i, 0) * float(qi[d]) < float(pi[d]):
            out.append(d)
            continue
        residual = (pi - qi).clamp(min=0)
        out.append(inverse_cdf(residual if float(residual.sum()) > 0 else pi, uniform(i, 1)))
        return out
    out.append(inverse_cdf(p(len(drafts)), uniform(len(drafts), 1)))
    return out
