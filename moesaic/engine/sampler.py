"""Sampling parameters and the sampler: penalties, greedy, temperature, top-k, top-p, seeded per
request, and the top-k log-probabilities of each sampled token.

The parameters follow vLLM's semantics and ranges (vllm/sampling_params.py): `presence_penalty` and
`frequency_penalty` in [-2, 2] act on the tokens generated so far, `repetition_penalty` > 0 on the
prompt's and the generated tokens (a seen token's positive logit is divided by it, a negative one
multiplied); `min_tokens` keeps EOS and the stop ids (and stop strings) from ending the request before
that many tokens; `logprobs` (at most MAX_LOGPROBS) are those of the model's own distribution (fp32
log_softmax of the logits before penalties and temperature), the sampled token always included.

`min_p` drops the tokens whose probability (after temperature) is below min_p times the most likely
one's, as vLLM does. `logits_processor` is a factory the server uses for structured output: called once
per sample, it makes an object whose `mask(logits)` returns the logits to sample from (e.g. with the
tokens a grammar forbids at -inf; logprobs stay those of the model) and whose `accept(token)` is told
each token sampled. `skip_special_tokens=False` keeps special tokens in the text (output parsers read
markers such as `<think>` from it); the token that ends a request as EOS or a stop id is never in it.

Seeds: sample i of a request with `n` samples and seed s draws from a generator seeded with
(s + i) mod 2**64 (vLLM's choice for parallel sampling), so sample i equals the same request with
n=1 and seed (s + i) mod 2**64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from ..errors import RequestError
from ..kernels import cpu
from ..spec.verify import inverse_cdf

GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20
SEED_LIMIT = 2**64


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return (_integer(v) or isinstance(v, float)) and math.isfinite(v)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # 0 <= seed < 2**64
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # parallel samples of one prompt (the prompt is computed once)
    stop: list[str] | str | None = None  # stop strings: not in the returned text
    logprobs: int | None = None  # top-k log-probabilities of every sampled token, k <= 20
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # 0 = off
    skip_special_tokens: bool = True
    logits_processor: Callable | None = None  # () -> an object with mask(logits) and accept(token)

    @staticmethod
    def from_dict(d: dict) -> SamplingParams:
        names = {f.name for f in fields(SamplingParams)}
        unknown = [k for k in d if k not in names]
        if unknown:
            raise RequestError(f"unknown sampling parameter(s) {unknown}; known: {', '.join(sorted(names))}")
        return SamplingParams(**d)

    def validate(self) -> None:
        """Raises RequestError for a value a request cannot have (checked before any work starts)."""
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise RequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _integer(t) for t in self.stop_token_ids
        ):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not _integer(self.n) or self.n < 1:
            raise RequestError(f"n must be a positive integer, got {self.n!r}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (
            not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops)
        ):
            raise RequestError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        for s in stops or ():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"stop string {s!r} is not valid Unicode (a lone surrogate)") from None
        if self.logprobs is not None and (
            not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise RequestError(f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}")
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise RequestError("logits_processor must be a callable that makes one processor per sample")

    @property
    def greedy(self) -> bool:
        # below this, exp(logit / T) overflows to a one-hot anyway; treat it as the argmax it is
        return self.temperature < GREEDY_BELOW

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def sample_seed(seed: int | None, i: int) -> int | None:
    """The seed of sample i of a request seeded with `seed` (see the module docstring)."""
    return None if seed is None else (seed + i) % SEED_LIMIT


def make_generator(params: SamplingParams, device="cpu", sample: int = 0) -> torch.Generator | None:
    """The random stream of one sample of a request, on the device where its logits live."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(sample_seed(params.seed, sample))
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    """vLLM's order: repetition (prompt and output tokens), then frequency and presence (output)."""
    x = logits.float().clone()
    vocab = x.shape[-1]
    out = torch.tensor(output_ids, dtype=torch.long, device=x.device)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=x.device)] = True
        seen[out] = True
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if out.numel() and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(x.dtype)
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(x.dtype)
    return x


def adjusted(
    logits: torch.Tensor, params: SamplingParams, prompt_ids=(), output_ids=(), banned=()
) -> torch.Tensor:
    """One row of logits after the penalties, with the `banned` ids (EOS before min_tokens) at -inf: what
    greedy decoding takes the argmax of."""
    x = logits
    if params.penalized:
        x = apply_penalties(x, params, prompt_ids, output_ids)
    if banned:
        x = x.float().clone()
        x[torch.tensor(list(banned), dtype=torch.long, device=x.device)] = float("-inf")
    return x


def distribution(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities a (non-greedy) sample draws from: `adjusted` logits through temperature, top-k
    and top-p."""
    x = x.float() / params.temperature
    if params.min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
    return x.softmax(-1)


def uniform(generator: torch.Generator | None, device="cpu") -> float:
    """One uniform in [0, 1) from a request's random stream: every sampled token takes exactly one, drawn
    or not with speculative decoding (spec/verify.py), so a seeded request gives the same tokens either way."""
    dev = generator.device if generator is not None else device
    return float(torch.rand((), generator=generator, device=dev, dtype=torch.float64))


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_ids=(),
    output_ids=(),
    banned=(),
) -> int:
    """One token from one row of fp32 logits; `banned` ids (EOS before min_tokens) are never drawn. A
    sample is the inverse CDF of the distribution at one uniform of the request's stream."""
    x = adjusted(logits, params, prompt_ids, output_ids, banned)
    if params.greedy:
        return argmax_rows(x.unsqueeze(0))[0]
    return inverse_cdf(distribution(x, params), uniform(generator, x.device))


def argmax_rows(rows: torch.Tensor) -> list[int]:
    """The greedy token of each logits row of rows [n, V]: torch's argmax (the first of equal largest values), on
    the CPU by one small compiled loop (torch's argmax code is cold after a step's weight stream)."""
    top = cpu.argmax_rows(rows)
    return rows.argmax(-1).tolist() if top is None else top


def top_logprobs(logits: torch.Tensor, k: int, token: int) -> dict[int, float]:
    """{token id: log-probability} of the k most likely tokens and the sampled one (fp32)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {}
    if k:
        values, ids = lp.topk(k)
        out = dict(zip(ids.tolist(), values.tolist()))
    out[token] = float(lp[token])
    return out
