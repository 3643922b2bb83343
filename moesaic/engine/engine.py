"""The batching engine: sequences, a continuous-batching scheduler with chunked prefill, and the
step that runs one ForwardBatch and samples.

Each step packs every running sequence's next token (decode) plus prompt chunks (prefill) up to
a token budget into one ForwardBatch, so one forward serves sequences in different phases.
Admission asks the state planner how many bytes a sequence will hold at its longest and keeps
the sum under `max_state_bytes`.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.batch import ForwardBatch
from ..errors import CapacityError, RequestError
from .sampler import SamplingParams, make_generator, sample

_ids = itertools.count()


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    state: object = None
    prefilled: int = 0  # prompt tokens already in the state
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    planned_bytes: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending(self) -> list[int]:
        """Tokens the state has not seen yet."""
        if self.prefilled < len(self.prompt_ids):
            return self.prompt_ids[self.prefilled :]
        return self.output_ids[-1:]


def check_prompt(ids: list[int], vocab: int) -> None:
    if not ids:
        raise RequestError("the prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")


class Engine:
    def __init__(
        self,
        model,
        eos_ids=(),
        max_num_seqs: int = 32,
        max_batch_tokens: int = 1024,
        max_state_bytes: int | None = None,
        max_context: int | None = None,
        state_bytes=None,
    ):
        self.model = model
        self.eos_ids = set(eos_ids)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_state_bytes = max_state_bytes
        self.max_context = max_context
        self.state_bytes = state_bytes  # (per_token, fixed) for the planner
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.used_bytes = 0

    # ---- admission
    def plan_bytes(self, seq: Sequence) -> int:
        if self.state_bytes is None:
            return 0
        per_token, fixed = self.state_bytes
        longest = len(seq.prompt_ids) + seq.params.max_tokens
        if self.max_context is not None:  # generation stops at the context anyway
            longest = min(longest, self.max_context)
        return per_token * longest + fixed

    def add(self, seq: Sequence) -> None:
        seq.params.validate()
        check_prompt(seq.prompt_ids, self.model.cfg.vocab_size)
        if self.max_context is not None and len(seq.prompt_ids) >= self.max_context:
            raise CapacityError(
                f"the prompt has {len(seq.prompt_ids)} tokens; this model's context is {self.max_context}"
            )
        seq.planned_bytes = self.plan_bytes(seq)
        if self.max_state_bytes is not None and seq.planned_bytes > self.max_state_bytes:
            raise CapacityError(
                f"this request needs {seq.planned_bytes} bytes of state; the engine allows "
                f"{self.max_state_bytes} (lower max_tokens or shorten the prompt)"
            )
        seq.generator = make_generator(seq.params, self.model.device)
        self.waiting.append(seq)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (
                self.max_state_bytes is not None
                and self.used_bytes + seq.planned_bytes > self.max_state_bytes
            ):
                break
            self.waiting.popleft()
            seq.state = self.model.new_state()
            self.used_bytes += seq.planned_bytes
            self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step
    def schedule(self) -> list[tuple[Sequence, list[int]]]:
        """Decodes first (one token each), then prompt chunks in arrival order within the budget."""
        self._admit()
        budget = self.max_batch_tokens
        items = []
        for seq in self.running:
            if seq.prefilled >= len(seq.prompt_ids):
                items.append((seq, seq.pending()))
                budget -= 1
        for seq in self.running:
            if seq.prefilled < len(seq.prompt_ids) and budget > 0:
                chunk = seq.pending()[:budget]
                items.append((seq, chunk))
                budget -= len(chunk)
        return items

    def step(self) -> list[tuple[Sequence, int]]:
        """Runs one forward; returns the (sequence, new token) pairs sampled in it."""
        items = self.schedule()
        if not items:
            return []
        batch = ForwardBatch.build(
            [(s.state, toks) for s, toks in items], logits="last", device=self.model.device
        )
        logits = self.model.forward(batch)
        events = []
        for row, (seq, toks) in enumerate(items):
            if seq.prefilled < len(seq.prompt_ids):
                seq.prefilled += len(toks)
                if seq.prefilled < len(seq.prompt_ids):
                    continue  # mid-prompt chunk: its logits are not needed
            tok = sample(logits[row], seq.params, seq.generator)
            seq.output_ids.append(tok)
            events.append((seq, tok))
            self._check_stop(seq, tok)
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self.used_bytes -= seq.planned_bytes
            seq.state = None  # frees its cache
        return events

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens:
            seq.finish_reason = "length"
        elif self.max_context is not None and len(seq.prompt_ids) + len(seq.output_ids) >= self.max_context:
            seq.finish_reason = "length"

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.used_bytes -= seq.planned_bytes
            seq.state = None
        seq.finish_reason = seq.finish_reason or "abort"
