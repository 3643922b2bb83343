"""The engine core: requests in, one step at a time, tokens out. Shared by `LLM.generate`, `LLM.stream`
and the async engine.

A step asks the scheduler what to compute (scheduler.py), turns it into one ForwardBatch (decodes and
prompt chunks of several sequences packed together), runs the model atomically (a forward that raises
leaves every sequence's state as it was; the batch is then retried one sequence at a time so that only
the sequences whose own forward fails are failed), samples, detokenizes, checks the stop conditions and
frees what finished.

Memory (planned once, here): the per-token rows of the paged layers live in a block pool
(cache/paged.py); a block costs its pages plus the family's other per-token bytes (compressed entries,
held in the sequence's own state) for its 64 tokens, so every byte that grows with a sequence is
accounted through the blocks it holds. The fixed per-sequence state (recurrent states, windows) is
reserved for `max_num_seqs` sequences. Snapshots for the prefix cache have their own budget.

Speculative decoding (spec/): with a draft proposer, every forward also leaves the hidden states the
proposer taps, and each step ends by giving the proposer the rows committed in it and asking it for the
next drafts of the decoding sequences (their lengths set each step by spec/adaptive.py: the DraftGate's
measured best length for the batch size, 0 while plain steps measure faster, and each sequence's acceptance;
LLM.generate's batches keep their sequences within a round of each other: `whole_batch`). The next
step verifies each sequence's [pending token, d1..dk] in the same forward as everything else, accepts
exactly (spec/verify.py) and rolls the rejected rows back in every state kind (states are made with a
rollback window of k + 1 rows). Draft rows are never in the prefix cache: the blocks and snapshots only
ever see committed tokens (and for a family with unpaged state a round never crosses a block boundary, so
that the state stops on each one for its decode-time snapshot).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import threading
import time
from dataclasses import dataclass

import torch

from ..cache.batch import ForwardBatch
from ..cache.paged import BLOCK_SIZE, BlockTable, PagePool, free_memory
from ..cache.state import TokenRows
from ..errors import CapacityError, ConfigError, RequestError
from ..kernels import cpu, memory
from ..spec import SpecConfig
from ..spec.adaptive import DraftGate, DraftLength
from ..spec.base import Draft, DraftProposer
from ..spec.verify import accept_greedy, accept_sampled
from .block_manager import BlockManager, SnapshotStore
from .graphs import DecodeGraphs, why_not
from .output import CompletionOutput, Detokenizer, RequestOutput
from .sampler import (
    SamplingParams,
    adjusted,
    argmax_rows,
    distribution,
    make_generator,
    sample,
    top_logprobs,
    uniform,
)
from .scheduler import Scheduler
from .sequence import Sequence, Status

log = logging.getLogger("moesaic")

# The default cache budget, as a fraction of the memory free once the weights are loaded: on a GPU most of
# it (the rest holds activations and the per-step gathered rows); on the CPU a quarter, because CPU memory
# is shared with the OS page cache that holds the mmap-ed weights and with other processes.
FREE_FRACTION = {"cuda": 0.8, "cpu": 0.25}
SNAPSHOT_FRACTION = 8  # default snapshot budget: 1/8 of the cache budget, on top of it


def check_prompt(ids: list[int], vocab: int) -> None:
    if not ids:
        raise RequestError("the prompt is empty: give at least one token")
    odd = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]  # True: id 1
    if odd:
        raise RequestError(f"token ids must be integers; got {odd[:5]!r} ({type(odd[0]).__name__})")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")


@dataclass
class EngineLimits:
    """The engine's limits, checked at construction (a ConfigError names the field)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_cache_bytes: int | None = None
    max_snapshot_bytes: int | None = None
    max_state_bytes: int | None = None
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        def positive(name, optional):
            v = getattr(self, name)
            if v is None and optional:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                what = "a positive integer" + (" or None" if optional else "")
                raise ConfigError(f"{name} must be {what}, got {v!r}")

        positive("max_num_seqs", False)
        positive("max_num_batched_tokens", False)
        positive("max_cache_bytes", True)
        positive("max_state_bytes", True)
        if self.max_snapshot_bytes is not None and (
            not isinstance(self.max_snapshot_bytes, int)
            or isinstance(self.max_snapshot_bytes, bool)
            or self.max_snapshot_bytes < 0
        ):
            raise ConfigError(
                f"max_snapshot_bytes must be an integer >= 0 or None, got {self.max_snapshot_bytes!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}"
            )

    @classmethod
    def checked(
        cls,
        max_num_seqs,
        max_batch_tokens,
        max_num_batched_tokens,
        max_cache_bytes,
        max_snapshot_bytes,
        max_state_bytes,
        enable_prefix_caching,
    ) -> EngineLimits:
        """The limits as the engine's (and LLM's) arguments give them, validated: max_batch_tokens is the old
        name of max_num_batched_tokens (both given and different: a ConfigError), 1024 when neither is."""
        if max_batch_tokens is not None and max_num_batched_tokens is not None:
            if max_batch_tokens != max_num_batched_tokens:
                raise ConfigError(
                    f"max_batch_tokens ({max_batch_tokens!r}) is the old name of max_num_batched_tokens "
                    f"({max_num_batched_tokens!r}): give one"
                )
        tokens = max_num_batched_tokens if max_num_batched_tokens is not None else max_batch_tokens
        limits = cls(
            max_num_seqs,
            1024 if tokens is None else tokens,
            max_cache_bytes,
            max_snapshot_bytes,
            max_state_bytes,
            enable_prefix_caching,
        )
        limits.validate()
        return limits


def non_finite(sched, logits: torch.Tensor, rows: list[torch.Tensor] | None = None) -> dict:
    """{seq id: RequestError} for the sequences of a forward whose logits rows (`logits`, all of them;
    `rows`, each sequence's, by default one row each) hold a NaN or an Inf (a model overflowing at run time): those requests
    end, the others of the batch go on. One reduction and one host sync per step: the sum of all the rows
    is finite unless one holds NaN/Inf (or the sum overflows, which only makes the exact check run); read
    as a Python float (~6 us a step on one core, where isfinite, all and bool on the rows' sums took ~27). On
    the CPU one compiled loop (cpu.all_finite): after a step's weight stream the sum's code is cold (~60 us a
    step in place)."""
    finite = cpu.all_finite(logits)
    if finite or finite is None and math.isfinite(float(logits.sum())):
        return {}
    bad = [not bool(torch.isfinite(r).all()) for r in (list(logits) if rows is None else rows)]
    return {
        s.id: RequestError(
            "the model produced non-finite logits (NaN or Inf) for this request: its weights or scales "
            "are likely broken, or its activations overflow the model dtype"
        )
        for (s, _), b in zip(sched, bad)
        if b
    }


class Engine:
    def __init__(
        self,
        model,
        eos_ids=(),
        max_num_seqs: int = 32,
        max_batch_tokens: int | None = None,
        max_state_bytes: int | None = None,
        max_context: int | None = None,
        state_bytes=None,
        tokenizer=None,
        max_num_batched_tokens: int | None = None,
        max_cache_bytes: int | None = None,
        max_snapshot_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        proposer: DraftProposer | None = None,
        spec: SpecConfig | None = None,
        spmd=None,
        decode_graphs: bool | None = False,
    ):
        """state_bytes: the family planner's (bytes per token, fixed bytes per sequence) of a state with the
        rollback window the engine uses (spec.k + 1 with a proposer, else 0). max_batch_tokens is the old
        name of max_num_batched_tokens. proposer / spec: speculative decoding (spec/__init__.py). spmd: the
        hooks of a tensor-parallel run (moesaic/parallel/workers.py `Lockstep`): the same engine runs on
        every rank, rank 0 sends each step's new requests and aborts and the tokens it samples, the others
        never sample. decode_graphs: decode steps through static shapes, captured as CUDA graphs on a GPU
        (engine/graphs.py), where the model allows it (else logged, and steps run eager); None: on CUDA where
        the model allows it, quietly eager elsewhere."""
        if torch.device(model.device).type == "cpu":
            memory.keep_freed_memory()  # each forward reuses the last one's freed memory (no page faults)
        if spmd is not None and proposer is not None:
            raise ConfigError(
                "speculative decoding does not run tensor-parallel yet: use tensor_parallel_size=1 with a "
                "speculative config, or no speculative config with tensor_parallel_size > 1"
            )
        self.limits = EngineLimits.checked(
            max_num_seqs,
            max_batch_tokens,
            max_num_batched_tokens,
            max_cache_bytes,
            max_snapshot_bytes,
            max_state_bytes,
            enable_prefix_caching,
        )
        self.model = model
        self.eos_ids = set(eos_ids)
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.max_num_seqs = self.limits.max_num_seqs
        self.max_num_batched_tokens = self.limits.max_num_batched_tokens
        self.max_state_bytes = max_state_bytes
        self.spmd = spmd
        self.lock = threading.RLock()
        if (proposer is None) != (spec is None):
            raise ConfigError("a draft proposer needs its speculative config (and the config its proposer)")
        self.proposer = proposer
        self.spec = spec
        self.rollback_window = spec.k + 1 if spec is not None else 0
        self.draft_length = DraftLength(spec.k, spec.adaptive) if spec is not None else None
        # adaptive: each step drafts as far as the DraftGate measures pays best (plain steps included)
        self.gate = DraftGate(spec.k) if spec is not None and spec.adaptive else None
        self._propose_s = 0.0  # the last step's propose call: the next step, which verifies, pays for it
        self._gate_length = None  # the length the gate chose for the next step's drafts (None: it did not)
        self._gate_measured = False  # the last step decoded: the next one is measured for the gate
        self.keep_in_step = False  # whole_batch(): drafts keep decoding sequences in step
        self._plan_memory(state_bytes)
        self.graphs = None
        asked = decode_graphs is True
        if decode_graphs is None:
            decode_graphs = torch.device(model.device).type == "cuda"
        if decode_graphs:
            why = why_not(model, self.hybrid or self.rest_per_token > 0)
            why = why or ("speculative decoding verifies several rows a sequence" if proposer else None)
            why = why or ("tensor-parallel steps run in lockstep eagerly" if spmd is not None else None)
            if why:
                (log.warning if asked else log.info)(
                    "moesaic: no CUDA graphs for this model: %s; decode steps run eager", why
                )
            else:
                context = self.max_context or 1 << 20
                self.graphs = DecodeGraphs(
                    model, self.pool, self.max_num_seqs, context, self.blocks.reserve()
                )
        self.counters = dict(
            requests=0, finished=0, aborted=0, failed=0, prompt_tokens=0, generated_tokens=0, steps=0
        )
        self.step_time = dict(count=0, sum=0.0, last=0.0)
        self.step_tokens = dict(sum=0, last=0)
        k = spec.k if spec is not None else 0
        self.spec_counters = dict(
            rounds=0,  # verify rounds (a sequence's drafts checked in one forward)
            drafted=0,
            accepted=0,
            drafted_at=[0] * k,  # per draft position
            accepted_at=[0] * k,
            committed=0,  # tokens the rounds committed (accepted + 1 each, before stops)
            target_forwards=0,  # forwards of the target model (every step's, drafting or not)
            rollbacks=0,  # rounds that rolled rows back
            rolled_back=0,  # rows rolled back
            draft_s=0.0,
            proposer_errors=0,
            gated_steps=0,  # decode steps the DraftGate kept from drafting (plain decoding measured faster)
        )

    # ---- memory
    def _plan_memory(self, state_bytes) -> None:
        probe = self.model.new_state()
        self.paged_layers = [L for L, s in enumerate(probe.layers) if type(s) is TokenRows]
        self.hybrid = any(s is not None and type(s) is not TokenRows for s in probe.layers)
        paged = PagePool.paged_bytes_per_token(probe)
        per_token, fixed = state_bytes if state_bytes is not None else (paged, 0)
        self.state_bytes = (per_token, fixed)
        self.rest_per_token = max(0, per_token - paged)  # compressed entries etc., in the sequence's state
        block_cost = BLOCK_SIZE * (paged + self.rest_per_token)
        context = self.max_context or 1 << 20
        blocks_per_seq = -(-context // BLOCK_SIZE)
        reserve = fixed * self.max_num_seqs
        budget = self.limits.max_cache_bytes
        if budget is None:
            kind = torch.device(self.model.device).type
            fraction = FREE_FRACTION.get(kind, 0.25)
            free = free_memory(self.model.device)
            budget = int(free * fraction)
            # never more than every slot at full context needs
            cap = reserve + block_cost * blocks_per_seq * self.max_num_seqs
            source = (
                f"{fraction:.0%} of the {free / 2**30:.1f} GiB free on {kind} "
                f"(the rest for activations{'' if kind == 'cuda' else ', the page cache and other processes'})"
            )
            if cap < budget:
                budget, source = (
                    cap,
                    f"what {self.max_num_seqs} sequences at the full context need (under {source})",
                )
        else:
            source = "max_cache_bytes"
        if self.spmd is not None:  # every rank plans the same blocks: the smallest budget of any
            budget = self.spmd.agree(budget)
        if budget - reserve < max(block_cost, 1):
            raise ConfigError(
                f"max_cache_bytes: {budget} bytes cannot hold the fixed state of max_num_seqs="
                f"{self.max_num_seqs} sequences ({fixed} bytes each) plus one block of {BLOCK_SIZE} tokens "
                f"({block_cost} bytes); raise max_cache_bytes or lower max_num_seqs"
            )
        num_blocks = (budget - reserve) // block_cost if block_cost else blocks_per_seq * self.max_num_seqs
        self.cache_bytes = budget
        self.pool = PagePool(probe, num_blocks)
        snap_budget = self.limits.max_snapshot_bytes
        if snap_budget is None:
            snap_budget = budget // SNAPSHOT_FRACTION if self.hybrid else 0
        self.snapshots = SnapshotStore(snap_budget) if self.hybrid else None
        self.blocks = BlockManager(num_blocks, self.pool, self.snapshots)
        self.scheduler = Scheduler(
            self.blocks,
            self._new_state,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_state_bytes,
            hybrid=self.hybrid,
            snapshots=self.snapshots,
            caching=self.limits.enable_prefix_caching,
            inside=probe.snapshots_inside,
        )
        log.info(
            "moesaic cache: %d blocks of %d tokens (%.1f MiB, %d bytes a token: %d paged, %d in sequence "
            "state) + %.1f MiB fixed state for %d sequences; budget %.1f MiB = %s; prefix cache %s%s",
            num_blocks,
            BLOCK_SIZE,
            num_blocks * block_cost / 2**20,
            paged + self.rest_per_token,
            paged,
            self.rest_per_token,
            reserve / 2**20,
            self.max_num_seqs,
            budget / 2**20,
            source,
            "on" if self.limits.enable_prefix_caching else "off",
            f", snapshots up to {snap_budget / 2**20:.1f} MiB" if self.hybrid else "",
        )

    def _new_state(self, table: BlockTable):
        return self.pool.page(self.model.new_state(rollback_window=self.rollback_window), table)

    # ---- what the tests and the API read
    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def used_bytes(self) -> int:
        return self.scheduler.used_bytes

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- admission
    def _longest(self, seq: Sequence) -> int:
        longest = len(seq.prompt_ids) + seq.params.max_tokens
        if self.max_context is not None:  # generation stops at the context anyway
            longest = min(longest, self.max_context)
        return longest

    def plan_bytes(self, seq: Sequence) -> int:
        per_token, fixed = self.state_bytes
        return per_token * self._longest(seq) + fixed

    def check(self, seq: Sequence) -> None:
        """RequestError / CapacityError for a request (a Sequence with its prompt and params) that is
        malformed or can never fit. Takes no lock."""
        p = seq.params
        if not isinstance(p, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(p).__name__}")
        p.validate()
        check_prompt(seq.prompt_ids, self.model.cfg.vocab_size)
        if self.max_context is not None and len(seq.prompt_ids) >= self.max_context:
            raise CapacityError(
                f"the prompt has {len(seq.prompt_ids)} tokens; this model's context is {self.max_context}"
            )
        if p.stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        if p.n > self.max_num_seqs:
            raise CapacityError(
                f"n={p.n} samples run together; the engine runs at most max_num_seqs={self.max_num_seqs}"
            )
        seq.planned_bytes = self.plan_bytes(seq)
        if self.max_state_bytes is not None and seq.planned_bytes * p.n > self.max_state_bytes:
            raise CapacityError(
                f"this request needs {seq.planned_bytes * p.n} bytes of state; the engine allows "
                f"{self.max_state_bytes} (lower max_tokens or shorten the prompt)"
            )
        longest = self._longest(seq)
        prompt_blocks = len(seq.prompt_ids) // BLOCK_SIZE
        need = prompt_blocks + p.n * (-(-longest // BLOCK_SIZE) - prompt_blocks)
        if need > self.blocks.num_blocks:
            raise CapacityError(
                f"this request needs up to {need} cache blocks of {BLOCK_SIZE} tokens ({longest} tokens"
                f"{f' x {p.n} samples' if p.n > 1 else ''}); the cache holds {self.blocks.num_blocks} "
                f"(lower max_tokens, or raise max_cache_bytes)"
            )

    def add(self, seq: Sequence) -> None:
        """Queues a request after `check`."""
        self.check(seq)
        p = seq.params
        with self.lock:
            seq.samples = p.n
            seq.generator = make_generator(p, self.model.device, seq.index)
            seq.detok = Detokenizer(self.tokenizer, p.stop_strings, p.skip_special_tokens)
            seq.processor = p.logits_processor() if p.logits_processor is not None else None
            seq.logprobs = [] if p.logprobs is not None else None
            seq.times["arrival"] = time.perf_counter()
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(seq.prompt_ids)
            self.scheduler.add(seq)
            if self.spmd is not None:
                self.spmd.added(seq)

    def abort(self, seq: Sequence) -> None:
        """Ends a request (every sample of it) now, freeing its blocks."""
        with self.lock:
            if self.spmd is not None:
                self.spmd.aborted(seq)
            for s in list(seq.group):
                if not s.finished:
                    s.finish_reason = "abort"
                    self.counters["aborted"] += 1
                    s.times["finished"] = time.perf_counter()
                self._finish(s)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer is not None:
            seq.observed = -2
            self._call_proposer(seq, self.proposer.finish, seq.id)

    @contextlib.contextmanager
    def whole_batch(self):
        """While a caller waits for every running sequence (LLM.generate): once nothing waits to be admitted,
        a decoding sequence ahead of the furthest-behind one gains nothing by drafting (it would wait at the
        end, and its rows cost every step), so drafts keep each within one round of that one. Serving does
        not use it: there each request's own latency counts."""
        self.keep_in_step = True
        try:
            yield
        finally:
            self.keep_in_step = False

    # ---- one step
    def step(self) -> list[tuple[Sequence, int]]:
        """Runs one forward; returns the (sequence, new token) pairs sampled in it (with drafting, a
        sequence may get several)."""
        with self.lock, self.spmd.turn(self) if self.spmd is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            if not sched:
                stuck = [s for s in list(self.running) + list(self.waiting) if not s.paused]
                if stuck:
                    raise RuntimeError(
                        f"moesaic engine: nothing could be scheduled with {len(stuck)} sequence(s) pending "
                        f"({self.blocks.num_free} of {self.blocks.num_blocks} blocks free); this is a bug"
                    )
                return []
            events = self._run(sched)
            dt = time.perf_counter() - t0
            self.counters["steps"] += 1
            self.step_time["count"] += 1
            self.step_time["sum"] += dt
            self.step_time["last"] = dt
            n = sum(k for _, k in sched)
            self.step_tokens["sum"] += n
            self.step_tokens["last"] = n
            return events

    def _tokens(self, seq: Sequence, n: int) -> list[int]:
        """The n tokens a scheduled sequence computes: pending ones, then (a verify round) its drafts."""
        pending = seq.pending()
        if n <= len(pending):
            return pending[:n]
        return pending + seq.draft.tokens[: n - len(pending)]

    def _forward(
        self, items: list[tuple[Sequence, int]]
    ) -> tuple[list[torch.Tensor], list[dict], torch.Tensor]:
        """Per sequence: its logits rows (every row of a verify round, else the last) and its taps; and all
        the rows as one tensor."""
        if self.graphs is not None and all(n == 1 == s.num_pending for s, n in items):
            logits = self.graphs.forward([s.state for s, _ in items], [s.pending()[0] for s, _ in items])
            if logits is not None:
                self.spec_counters["target_forwards"] += 1
                return list(logits.split_with_sizes([1] * len(items))), [{} for _ in items], logits
        rows, counts, start = [], [], 0
        for s, n in items:  # a verify round's every row, else the last
            verify = n > s.num_pending
            rows.extend(range(start, start + n) if verify else [start + n - 1])
            counts.append(n if verify else 1)
            start += n
        batch = ForwardBatch.build(
            [(s.state, self._tokens(s, n)) for s, n in items], logits=rows, device=self.model.device
        )
        if self.proposer is not None:
            batch.taps = tuple(self.proposer.taps)
        logits = self.model.forward(batch)
        self.spec_counters["target_forwards"] += 1
        taps = [{L: t[c.start : c.start + c.n] for L, t in batch.tapped.items()} for c in batch.seqs]
        return list(logits.split_with_sizes(counts)), taps, logits  # not split(): its Python wrapper ~2 us

    def _forward_atomic(self, sched, marks) -> tuple[list, list, dict]:
        """Logits rows and taps per scheduled sequence (None for a failed one) and {seq id: exception}. A
        forward that raises is undone for every sequence in it (`marks`); then each sequence runs alone. A
        sequence whose logits are not finite fails too (`non_finite`)."""
        try:
            rows, taps, logits = self._forward(sched)
            failed = non_finite(sched, logits, rows)
            for (s, _), m in zip(sched, marks):
                if s.id in failed:
                    s.state.revert(m)
            return rows, taps, failed
        except BaseException as e:
            for (s, _), m in zip(sched, marks):
                s.state.revert(m)
            if not isinstance(e, Exception):
                raise
            if len(sched) == 1:
                return [None], [{}], {sched[0][0].id: e}
            log.warning(
                "moesaic: a forward of %d sequences failed (%r); retrying them one by one", len(sched), e
            )
        rows, taps, failed = [], [], {}
        for (s, n), mark in zip(sched, marks):
            try:
                r, t, whole = self._forward([(s, n)])
                failed.update(non_finite([(s, n)], whole, r))
                if s.id in failed:
                    s.state.revert(mark)
                rows.append(r[0])
                taps.append(t[0])
            except BaseException as e:
                s.state.revert(mark)
                if not isinstance(e, Exception):
                    raise
                rows.append(None)
                taps.append({})
                failed[s.id] = e
        return rows, taps, failed

    def _run(self, sched) -> list[tuple[Sequence, int]]:
        t_start = time.perf_counter()
        if self.proposer is not None:
            self._start_drafting(sched)
        marks = [s.state.mark() for s, _ in sched]
        drafts = {s.id: n - s.num_pending for s, n in sched if n > s.num_pending}  # verify rounds
        # the time model of drafting's costs: steps of decodes and verify rounds only (a prefill chunk's
        # rows cost another amount each, and would make a row look several times dearer than it is)
        decoding = all(s.num_pending == 1 for s, _ in sched)
        t0 = time.perf_counter()
        rows, taps, failed = self._forward_atomic(sched, marks)
        if self.draft_length is not None and not failed and decoding:
            self.draft_length.forward_done(sum(n for _, n in sched), time.perf_counter() - t0, len(sched))
        try:
            draws = []  # (sequence, logits rows, its drafts) of every sample that draws tokens now
            for (seq, n), row in zip(sched, rows):
                if seq.id in failed:
                    continue
                if seq.id in drafts:
                    seq.speculative = drafts[seq.id]
                    draws.append((seq, row, seq.draft.tokens[: drafts[seq.id]]))
                    continue
                self.scheduler.computed(seq, n)
                if seq.num_pending:  # a prompt chunk: its logits are not needed
                    continue
                if seq.samples > 1:
                    self._fork(seq)
                    draws.extend((s, row, []) for s in seq.group)
                else:
                    draws.append((seq, row, []))
            outcomes = []  # the [(token, logprobs)] drawn, or the exception, per draw
            if self.spmd is None or self.spmd.rank == 0:
                outcomes = self._greedy_rows(draws) or [self._draw(*d) for d in draws]
            if self.spmd is not None:  # rank 0's draws, on every rank
                outcomes = self.spmd.share(outcomes)
            picked = []
            for (seq, _, _), got in zip(draws, outcomes):
                if isinstance(got, BaseException):
                    failed[seq.id] = got
                else:
                    picked.append((seq, got))
        except BaseException:
            for (s, _), m in zip(sched, marks):  # nothing of this step is kept
                if s.state is not None:
                    s.state.revert(m)
                s.speculative = 0
            raise
        events = []
        for seq, tokens in picked:
            seq.draft = None  # verified, or (not scheduled with it) stale
            for tok, lp in tokens:
                self._append(seq, tok, lp)
                events.append((seq, tok))
                if seq.finished:
                    break
            if seq.id in drafts:
                self._end_round(seq, drafts[seq.id], len(tokens) - 1, len(seq.output_ids))
        for s, _ in sched:
            for g in s.group:
                if g.id in failed and not g.finished:
                    self._fail(g, failed[g.id])
                elif g.finished and g.status is not Status.FINISHED:
                    self._finish(g)
        if self.proposer is not None:
            for (s, _), t in zip(sched, taps):
                if s.id not in failed:
                    self._observe(s, t)
            spent = time.perf_counter() - t_start
            # a decode step after a decode step: one after a prompt carries the drafter's catch-up on the
            # prompt's rows in its propose call, which is not what its length costs
            measured = decoding and not failed and self._gate_measured
            if self.gate is not None and measured and self._gate_length is not None:
                # before the next step's length is chosen, so that it sees this step. A step the gate let
                # draft where no sequence did (each one's acceptance kept it off, or its limit) is a plain
                # step: it counts for no length (under the length, plain steps mixed into its runs made a
                # drafting length look as fast as plain decoding while its drafting steps lost)
                length = self._gate_length if drafts or self._gate_length == 0 else -1
                self.gate.record(len(sched), len(events), spent + self._propose_s, length)
            self._gate_measured = decoding and not failed
            self._propose()
        return events

    def _end_round(self, seq: Sequence, drafted: int, accepted: int, outputs: int) -> None:
        """After a verify round's tokens are committed: its rejected rows (and those past a stop) leave
        the state, its counters, and the prefix cache indexes what is now committed."""
        c = self.spec_counters
        c["rounds"] += 1
        c["drafted"] += drafted
        c["accepted"] += accepted
        c["committed"] += accepted + 1
        for i in range(drafted):
            c["drafted_at"][i] += 1
            c["accepted_at"][i] += i < accepted
        seq.acceptance.record(drafted, accepted)
        seq.speculative = 0
        if seq.state is None:  # failed while committing
            return
        committed = len(seq.token_ids) - 1  # the newest token is pending, as after a plain decode
        extra = seq.state.num_tokens - committed
        if extra:
            seq.state.rollback(extra)
            c["rollbacks"] += 1
            c["rolled_back"] += extra
        if not seq.finished:
            self.scheduler.computed(seq, 1)

    def _fork(self, seq: Sequence) -> None:
        """A request with n > 1 samples, its prompt computed: n - 1 more sequences sharing its blocks."""
        n, seq.samples = seq.samples, 1
        snap = seq.state.snapshot()
        group = [seq]
        for i in range(1, n):
            child = Sequence(
                list(seq.prompt_ids),
                seq.params,
                index=i,
                request_id=seq.request_id,
                arrival=seq.arrival,
                status=Status.RUNNING,
                num_cached_tokens=seq.num_cached_tokens,
                planned_bytes=seq.planned_bytes,
                times=dict(seq.times),
            )
            child.block_table = self.blocks.fork(seq.block_table)
            child.state = self._new_state(child.block_table)
            child.state.restore(snap)
            child.hashes = list(seq.hashes)
            child.last_step = seq.last_step
            child.generator = make_generator(seq.params, self.model.device, i)
            child.detok = Detokenizer(self.tokenizer, seq.params.stop_strings, seq.params.skip_special_tokens)
            child.processor = (
                seq.params.logits_processor() if seq.params.logits_processor is not None else None
            )
            child.logprobs = [] if seq.params.logprobs is not None else None
            group.append(child)
            self.scheduler.running.append(child)
        for s in group:
            s.group = group

    def _banned(self, seq: Sequence, ahead: int = 0) -> set:
        """Ids a sample may not draw `ahead` tokens from now: EOS and the stop ids before min_tokens."""
        p = seq.params
        if len(seq.output_ids) + ahead < p.min_tokens:
            return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        return set()

    def _greedy_rows(self, draws) -> list | None:
        """Every draw's token by one argmax over their rows and one read to the host, where each is a plain
        greedy sample (no drafts, penalties, banned ids, logits processor or logprobs): what `_sample` draws
        row by row, with one device sync a step instead of one a sequence (on a GPU ~60 us of host time a
        row; a lone draw skips `sample`'s Python). None otherwise."""
        if not draws:
            return None
        for seq, _, draft in draws:
            p = seq.params
            if draft or not p.greedy or p.penalized or seq.processor is not None or p.logprobs is not None:
                return None
            if self._banned(seq):
                return None
        try:
            top = argmax_rows(
                draws[0][1][-1:] if len(draws) == 1 else torch.cat([row[-1:] for _, row, _ in draws])
            )
        except Exception:  # drawn row by row, where a failure is that sequence's alone
            return None
        return [[(tok, None)] for tok in top]

    def _draw(self, seq: Sequence, row: torch.Tensor, draft: list[int]):
        """One draw's [(token, logprobs)], or the exception it raised (that sequence alone fails)."""
        try:
            return self._verify(seq, row, draft) if draft else [self._sample(seq, row[-1])]
        except Exception as e:
            return e

    def _sample(self, seq: Sequence, row: torch.Tensor) -> tuple[int, dict | None]:
        p = seq.params
        x = row if seq.processor is None else seq.processor.mask(row)
        tok = sample(x, p, seq.generator, seq.prompt_ids, seq.output_ids, self._banned(seq))
        lp = top_logprobs(row, p.logprobs, tok) if p.logprobs is not None else None
        return tok, lp

    def _verify(self, seq: Sequence, rows: torch.Tensor, draft: list[int]) -> list[tuple[int, dict | None]]:
        """The tokens a verify round commits (accepted drafts, then the correction or the bonus token) with
        their logprobs. Row i is the target's distribution after the drafts before it, with the penalties and
        min_tokens of that point, exactly as plain decoding would have it."""
        p = seq.params

        def target(i: int) -> torch.Tensor:
            return adjusted(rows[i], p, seq.prompt_ids, seq.output_ids + draft[:i], self._banned(seq, i))

        if p.greedy and not p.penalized and not self._banned(seq):  # every row's argmax at once
            top = rows.argmax(-1).tolist()
            tokens = accept_greedy(lambda i: top[i], draft)
        elif p.greedy:
            tokens = accept_greedy(lambda i: int(target(i).argmax()), draft)
        else:
            q = seq.draft.probs
            tokens = accept_sampled(
                lambda i: distribution(target(i), p),
                draft,
                None if q is None else q[: len(draft)],
                lambda i, slot: uniform(seq.generator, rows.device),
            )
        return [
            (t, top_logprobs(rows[i], p.logprobs, t) if p.logprobs is not None else None)
            for i, t in enumerate(tokens)
        ]

    # ---- the draft proposer
    def _call_proposer(self, seq: Sequence | None, fn, *args):
        """A proposer call; one that raises turns drafting off for that sequence (or, for a whole-step
        call, for every sequence asked) and is logged: the target's output never depends on a drafter."""
        try:
            return fn(*args)
        except Exception as e:
            self.spec_counters["proposer_errors"] += 1
            log.warning(
                "moesaic: the %s draft proposer failed (%r); drafting off for it", self.proposer.method, e
            )
            for s in [seq] if seq is not None else [s for s in self.running if s.draft is None]:
                s.observed = -2  # never again for this sequence
            return None

    def _start_drafting(self, sched) -> None:
        """Sequences scheduled with no proposer state (new, or back from a preemption) start one; the
        rows the prefix cache gave them are observed without hidden states."""
        for seq, _ in sched:
            if seq.observed == -1:
                self._call_proposer(seq, self.proposer.start, seq.id)
                if seq.observed == -1:
                    seq.observed = 0
                    hit = seq.num_computed
                    if hit:
                        self._call_proposer(seq, self.proposer.observe, seq.id, 0, seq.token_ids[:hit], {})
                        if seq.observed == 0:
                            seq.observed = hit

    def _observe(self, seq: Sequence, taps: dict) -> None:
        """Gives the proposer the rows this step committed for `seq` (and starts its new samples)."""
        if seq.state is not None and 0 <= seq.observed < seq.num_computed and not seq.finished:
            start, end = seq.observed, seq.num_computed
            hidden = {L: t[: end - start] for L, t in taps.items()}
            self._call_proposer(seq, self.proposer.observe, seq.id, start, seq.token_ids[start:end], hidden)
            if seq.observed == start:
                seq.observed = end
        for child in seq.group:
            if child is seq or child.observed != -1 or child.state is None or seq.observed < 0:
                continue
            fork = getattr(self.proposer, "fork", None)
            if fork is not None:
                self._call_proposer(child, fork, seq.id, child.id)
            else:
                self._call_proposer(child, self.proposer.start, child.id)
                self._call_proposer(
                    child, self.proposer.observe, child.id, 0, child.token_ids[: seq.observed], {}
                )
            if child.observed == -1:
                child.observed = seq.observed

    def _propose(self) -> None:
        """Asks the proposer, in one call, for the next drafts of every decoding sequence that has none."""
        self._propose_s, self._gate_length = 0.0, None
        ready = [
            s
            for s in self.running
            if s.draft is None and s.state is not None and s.observed == s.num_computed and s.num_pending == 1
        ]
        if not ready:
            return
        decoders = sum(s.num_pending == 1 for s in self.running)
        cap = None
        if self.gate is not None:
            cap = self._gate_length = self.gate.length(decoders)
            if cap == 0:
                self.spec_counters["gated_steps"] += 1
                for s in ready:
                    s.draft = Draft([])
                return
        limits = []
        snapshots = self.hybrid and self.limits.enable_prefix_caching
        behind = None  # the most tokens a decoding sequence may still generate (LLM.generate's batches)
        if self.keep_in_step and not self.waiting:
            behind = max(r.params.max_tokens - len(r.output_ids) for r in self.running if r.num_pending == 1)
        for s in ready:
            limit = s.params.max_tokens - len(s.output_ids) - 1
            if self.max_context is not None:
                limit = min(limit, self.max_context - len(s.token_ids) - 1)
            if snapshots:  # a round never jumps over a block boundary, so the state stops on each one
                pending = s.num_computed  # the pending token's position
                limit = min(limit, (pending // BLOCK_SIZE + 1) * BLOCK_SIZE - 1 - pending)
            if s.processor is not None:  # structured output: its grammar state cannot take drafts back
                limit = 0
            if behind is not None:  # how far this one is ahead of the furthest behind, less a round
                limit = min(limit, self.spec.k - (behind - (s.params.max_tokens - len(s.output_ids))))
            limits.append(limit)
        lengths = self.draft_length.lengths([s.acceptance for s in ready], decoders, limits, cap)
        requests = []
        for s, k in zip(ready, lengths):
            if k > 0:
                requests.append((s, k))
            else:
                s.draft = Draft([])
        if not requests:
            return
        t0 = time.perf_counter()
        out = self._call_proposer(
            None, self.proposer.propose, [(s.id, s.token_ids[-1], k) for s, k in requests]
        )
        dt = self._propose_s = time.perf_counter() - t0
        self.spec_counters["draft_s"] += dt
        vocab = self.model.cfg.vocab_size
        for i, (s, k) in enumerate(requests):
            draft = out[i] if out is not None and i < len(out) else Draft([])
            tokens = []
            for t in draft.tokens[:k]:  # a drafter's out-of-vocabulary id ends its draft
                if not isinstance(t, int) or not 0 <= t < vocab:
                    break
                tokens.append(t)
            probs = draft.probs[: len(tokens)] if draft.probs is not None and tokens else None
            if probs is not None and tuple(probs.shape) != (len(tokens), vocab):
                self.spec_counters["proposer_errors"] += 1
                log.warning(
                    "moesaic: the %s draft proposer gave probs of shape %s for %d drafts (vocabulary %d); "
                    "draft dropped",
                    self.proposer.method,
                    tuple(probs.shape),
                    len(tokens),
                    vocab,
                )
                tokens, probs = [], None
            s.draft = Draft(tokens, probs)

    def _append(self, seq: Sequence, tok: int, lp) -> None:
        seq.append_token(tok)
        self.counters["generated_tokens"] += 1
        seq.times.setdefault("first_token", time.perf_counter())
        if lp is not None:
            seq.logprobs.append(lp)
        try:
            if seq.processor is not None:
                seq.processor.accept(tok)
            self._check_stop(seq, tok)
        except Exception as e:  # a detokenizer failing on this request ends it, and only it
            self._fail(seq, e)

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p, d = seq.params, seq.detok
        searched = len(d.text)
        may_stop = len(seq.output_ids) >= p.min_tokens
        if not (may_stop and (tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos))):
            d.feed(tok)  # the token that ends the request as EOS or a stop id is not text
        reason = None
        if may_stop and tok in p.stop_token_ids:
            reason = ("stop", tok)
        elif may_stop and tok in self.eos_ids and not p.ignore_eos:
            reason = ("stop", None)
        elif may_stop and (s := d.find_stop(searched)) is not None:
            reason = ("stop", s)
        elif len(seq.output_ids) >= p.max_tokens:
            reason = ("length", None)
        elif self.max_context is not None and len(seq.token_ids) >= self.max_context:
            reason = ("length", None)
        if reason is None:
            return
        if not isinstance(reason[1], str):  # the last tokens' text, even an incomplete character
            searched = len(d.text)
            d.flush()
            if may_stop and (s := d.find_stop(searched)) is not None:
                reason = ("stop", s)
        seq.finish_reason, seq.stop_reason = reason
        seq.times["finished"] = time.perf_counter()
        self.counters["finished"] += 1

    def _fail(self, seq: Sequence, e: BaseException) -> None:
        seq.error = e
        seq.finish_reason = "error"
        seq.times["finished"] = time.perf_counter()
        self.counters["failed"] += 1
        self._finish(seq)

    # ---- outputs and counters
    def output(self, seq: Sequence) -> RequestOutput:
        """The request's result so far (every sample of it)."""
        group = seq.group
        outs = [
            CompletionOutput(
                s.index,
                list(s.output_ids),
                s.detok.visible(s.finished) if s.detok is not None else "",
                s.finish_reason,
                s.stop_reason,
                None if s.logprobs is None else list(s.logprobs),
            )
            for s in group
        ]
        for i in range(len(group), seq.params.n):  # samples not forked yet (or never: the request ended)
            outs.append(CompletionOutput(i, [], "", group[0].finish_reason))
        first = group[0]
        return RequestOutput(
            list(first.prompt_ids),
            outs,
            first.request_id,
            first.num_cached_tokens or 0,
            all(s.finished for s in group),
            usage=self.usage(seq),
            error=next((s.error for s in group if s.error is not None), None),
        )

    def usage(self, seq: Sequence) -> dict:
        group = seq.group
        return dict(
            prompt_tokens=len(group[0].prompt_ids),
            completion_tokens=sum(len(s.output_ids) for s in group),
            cached_tokens=group[0].num_cached_tokens or 0,
        )

    def stats(self) -> dict:
        with self.lock:
            c, s = self.counters, self.scheduler
            return dict(
                requests=dict(
                    running=len(s.running),
                    waiting=len(s.waiting),
                    finished=c["finished"],
                    aborted=c["aborted"],
                    failed=c["failed"],
                    total=c["requests"],
                ),
                prompt_tokens=c["prompt_tokens"],
                generated_tokens=c["generated_tokens"],
                cached_prompt_tokens=s.cached_tokens,
                prefix_hit_rate=s.cached_tokens / s.admitted_prompt_tokens
                if s.admitted_prompt_tokens
                else 0.0,
                preemptions=s.preemptions,
                blocks=dict(
                    used=self.blocks.num_used,
                    free=self.blocks.num_free,
                    total=self.blocks.num_blocks,
                    cached=len(self.blocks.cached),
                    block_tokens=BLOCK_SIZE,
                ),
                snapshot_bytes=0 if self.snapshots is None else self.snapshots.bytes,
                snapshots=0 if self.snapshots is None else len(self.snapshots.entries),
                step_time_s=dict(self.step_time),
                tokens_per_step=dict(
                    last=self.step_tokens["last"],
                    mean=self.step_tokens["sum"] / self.step_time["count"]
                    if self.step_time["count"]
                    else 0.0,
                ),
                cache_bytes=self.cache_bytes,
                prefix_caching=self.limits.enable_prefix_caching,
                speculative=self.spec_stats(),
                decode_graphs=None if self.graphs is None else self.graphs.stats(),
            )

    def spec_stats(self) -> dict | None:
        """Speculative decoding's counters (None when it is off): drafted and accepted drafts, the
        acceptance at each draft position, tau = mean tokens committed per verify round (accepted + the
        bonus or correction), and the target's forwards (every step's, drafting or not)."""
        if self.spec is None:
            return None
        c = self.spec_counters
        return dict(
            method=self.proposer.method,
            num_speculative_tokens=self.spec.k,
            adaptive=self.spec.adaptive,
            rounds=c["rounds"],
            drafted=c["drafted"],
            accepted=c["accepted"],
            acceptance=c["accepted"] / c["drafted"] if c["drafted"] else 0.0,
            per_position_acceptance=[a / d if d else 0.0 for a, d in zip(c["accepted_at"], c["drafted_at"])],
            per_position_drafted=list(c["drafted_at"]),
            per_position_accepted=list(c["accepted_at"]),
            tau=c["committed"] / c["rounds"] if c["rounds"] else 0.0,
            target_forwards=c["target_forwards"],
            rollbacks=c["rollbacks"],
            rolled_back_rows=c["rolled_back"],
            draft_time_s=c["draft_s"],
            proposer_errors=c["proposer_errors"],
            gated_steps=c["gated_steps"],
        )

    def reset_prefix_cache(self) -> None:
        with self.lock:
            if self.spmd is not None:
                self.spmd.reset()
            self.blocks.reset_cache()
            if self.snapshots is not None:
                for h in list(self.snapshots.entries):
                    self.snapshots.drop(h)
