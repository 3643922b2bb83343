"""The public API: `LLM(model, dtype, device)` with `generate` and `score`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .cache.batch import ForwardBatch
from .demo import DEMO_NAME, DEMOS, ensure_demo, is_demo_name
from .engine.engine import Engine, Sequence, check_prompt
from .engine.sampler import SamplingParams
from .errors import CapacityError, CheckpointError, ConfigError, RequestError
from .models import Checkpoint
from .tokenizer import load_tokenizer


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop id) | "length"


def resolve_model_path(model: str | Path) -> Path:
    if is_demo_name(str(model)):
        return ensure_demo(str(model))
    path = Path(model)
    if not path.exists():
        raise CheckpointError(
            f"{model}: no such checkpoint folder (moesaic reads local folders only; "
            f"built-in demo models: {', '.join(DEMOS)})"
        )
    return path


def check_device(device) -> str:
    """The device name if this torch can run on it, else a ConfigError saying why."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {device!r} is not a device name (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: this torch build sees no CUDA device (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported (cpu or cuda)")
    return str(dev)


class Stream:
    """One request's tokens as they are sampled. Other calls on the same LLM (a generate() while this
    stream is open) may step its sequence too: it yields everything the sequence holds not yet yielded."""

    def __init__(self, engine: Engine, seq: Sequence):
        self.engine = engine
        self.seq = seq
        self.sent = 0

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> int:
        seq = self.seq
        try:
            while self.sent >= len(seq.output_ids):
                if seq.finished:
                    raise StopIteration
                self.engine.step()
        except BaseException:
            self.close()
            raise
        self.sent += 1
        return seq.output_ids[self.sent - 1]

    def close(self) -> None:
        """Aborts the request if it has not finished (frees its state)."""
        if not self.seq.finished:
            self.engine.abort(self.seq)

    def __del__(self):
        self.close()


class LLM:
    def __init__(
        self,
        model: str | Path = DEMO_NAME,
        dtype="bfloat16",
        device="cpu",
        max_num_seqs: int = 32,
        max_batch_tokens: int = 1024,
        max_state_bytes: int | None = None,
        precision: str | None = None,
        expert_cache=None,
        expert_cache_policy: str = "lfru",
        expert_prefetch: bool = True,
    ):
        """precision: a precision schedule, e.g. "router=bf16,expert=fp8" (see moesaic/weights/precision.py).
        expert_cache: routed experts stay in the shards and are read on demand into a cache of at most
        this many bytes (an int, "8GiB", or "10%": room for that share of the experts; weights/experts.py), with
        policy "lru" or "lfru" and, unless expert_prefetch=False, the next layer's experts read ahead."""
        device = check_device(device)
        self.path = resolve_model_path(model)
        ckpt = Checkpoint.open(self.path)
        self.family, self.cfg, self.raw_config = ckpt.family, ckpt.cfg, ckpt.raw
        self.model = ckpt.build(dtype, device, precision, expert_cache, expert_cache_policy, expert_prefetch)
        self.expert_cache = ckpt.expert_cache
        self.dtype, self.device = self.model.dtype, device
        self.tokenizer = load_tokenizer(self.path, ckpt.store.config, self.cfg.eos_token_ids)
        eos = set(self.cfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_ids", ()) or ())
        self.engine = Engine(
            self.model,
            eos,
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            max_state_bytes=max_state_bytes,
            max_context=self.family.max_context(self.cfg),
            state_bytes=self.family.state_bytes(self.cfg, self.model.dtype.itemsize),
        )

    # ---- prompts
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.path} has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise RequestError("a prompt is a string or a list of token ids")

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    # ---- generation
    def generate(self, prompts, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generates for every prompt together (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(
                f"{len(prompts)} prompts but {len(plist)} SamplingParams: give one, or one per prompt"
            )
        seqs = [Sequence(self.encode(p), sp) for p, sp in zip(prompts, plist)]
        added = []
        try:
            for s in seqs:
                self.engine.add(s)
                added.append(s)
            while any(not s.finished for s in seqs):
                self.engine.step()
        finally:  # an error must not leave this call's sequences in the engine
            for s in added:
                if not s.finished:
                    self.engine.abort(s)
        return [
            RequestOutput(s.prompt_ids, s.output_ids, self.decode(s.output_ids), s.finish_reason)
            for s in seqs
        ]

    def stream(self, prompt, params: SamplingParams | None = None) -> Stream:
        """The token ids of one prompt as they are sampled (an iterator); its `finish_reason` is set once
        it is exhausted. Dropping or closing it before the end aborts the request."""
        seq = Sequence(self.encode(prompt), params or SamplingParams())
        self.engine.add(seq)
        return Stream(self.engine, seq)

    def stats(self) -> dict:
        """Counters: the expert cache's (bytes read, hits and misses, prefetch, stall; see
        ExpertCache.stats) under "expert_cache" when one is configured."""
        return {} if self.expert_cache is None else {"expert_cache": self.expert_cache.stats()}

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of one full prefill of `token_ids`."""
        ids = self.encode(list(token_ids))
        check_prompt(ids, self.cfg.vocab_size)
        if len(ids) > self.engine.max_context:
            raise CapacityError(f"{len(ids)} tokens exceed this model's context of {self.engine.max_context}")
        state = self.model.new_state()
        return self.model.forward(ForwardBatch.build([(state, ids)], logits="all", device=self.device))
