"""A sequence is data: its tokens, sampling parameters, status, block table and state."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..cache.paged import BlockTable
from ..cache.state import SequenceState
from ..spec.adaptive import Acceptance
from ..spec.base import Draft
from .sampler import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of one request. A request with n > 1 samples is one sequence until its prompt is
    computed; then it forks into n (`samples` counts what it will become, `index` is its sample number).

    The state holds `token_ids[:num_computed]`; the tokens after that are pending (the prompt, or after a
    preemption by recompute the prompt and the generated tokens, then each sampled token). `speculative`
    counts trailing tokens of the state that are not committed (a draft being verified): the prefix cache
    never indexes or snapshots them.

    Speculative decoding: `draft` is the proposal for the next round (None: not asked yet; verified
    together with the pending token, then cleared), `observed` how many of its committed rows the draft
    proposer has seen (-1: not started, e.g. after a preemption), `acceptance` its acceptance record."""

    prompt_ids: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    status: Status = Status.WAITING
    state: SequenceState | None = None
    block_table: BlockTable = field(default_factory=BlockTable)
    hashes: list[int] = field(default_factory=list)  # chain hashes of its indexed full blocks
    speculative: int = 0
    draft: Draft | None = None
    observed: int = -1
    acceptance: Acceptance = field(default_factory=Acceptance)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string matched
    error: BaseException | None = None
    generator: torch.Generator | None = None
    samples: int = 1
    index: int = 0
    group: list[Sequence] = field(default_factory=list)  # every sample of its request (index order)
    request_id: str | None = None
    arrival: int = 0
    last_step: int = -1
    paused: bool = False  # a stream nobody is reading: not scheduled, preempted first
    planned_bytes: int = 0  # the planner's worst case (admission under max_state_bytes)
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache (at first admission)
    snapshot_points: tuple[int, ...] = ()  # extra block boundaries to snapshot at (see Scheduler)
    tail_snapshot: int | None = None  # hash of its latest decode-time snapshot
    inside_points: tuple[int, ...] = ()  # snapshot boundaries inside the forward it is scheduled for
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    detok: object = None
    processor: object = None  # params.logits_processor's object for this sample
    times: dict = field(default_factory=dict)  # arrival / first_token / finished (perf_counter)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids) + list(self.output_ids)
        if not self.group:
            self.group = [self]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_computed(self) -> int:
        return 0 if self.state is None else self.state.num_tokens

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_committed(self) -> int:
        return self.num_computed - self.speculative

    def pending(self) -> list[int]:
        """Tokens the state has not seen yet."""
        return self.token_ids[self.num_computed :]

    def append_token(self, tok: int) -> None:
        self.output_ids.append(tok)
        self.token_ids.append(tok)
