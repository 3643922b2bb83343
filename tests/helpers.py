"""Tiny checkpoints for the tests, written by transformers itself (the oracle) or by moesaic's writers."""

from __future__ import annotations

import torch


def randomize_(model, seed: int = 0, std: float = 0.2) -> None:
    """Gives every parameter random values, including those transformers initialises to constants
    (norm gains = 1, router = 0), so that no path hides behind a constant."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and ("norm" in name or name.endswith("layernorm.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * (std if p.dim() == 1 else fan_in**-0.5))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
