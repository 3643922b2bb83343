"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import RequestError

GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raises RequestError for a value a request cannot have (checked before any work starts)."""

        def integer(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v):
            return (integer(v) or isinstance(v, float)) and math.isfinite(v)

        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not integer(self.seed):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            integer(t) for t in self.stop_token_ids
        ):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        # below this, exp(logit / T) overflows to a one-hot anyway; treat it as the argmax it is
        return self.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator | None:
    """The request's own random stream, on the device where its logits live."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of fp32 logits."""
    if params.greedy:
        return int(logits.argmax())
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
