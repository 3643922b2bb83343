"""The scheduler: two queues and one token budget (nano-vllm's shape, vLLM V1's policy).

Each step: running sequences that decode (one token each, least recently scheduled first), then running
sequences part-way through their prompt, then waiting ones in arrival order, each taking a chunk of
the budget `max_num_batched_tokens`, under `max_num_seqs` sequences. The blocks for every scheduled token
are allocated here, before the forward. A sequence that cannot get a block preempts, by recompute, the
newest running sequence that is newer than it (a paused one first): that one's blocks and state are
freed and it goes back to the front of the waiting queue, keeping its generated tokens (and its sampler's
generator), to be prefilled again later. Waiting sequences are admitted strictly in arrival order.

Prefix cache: an admitted sequence starts from the longest run of its full blocks found in the index
(block_manager.py), capped one token short of its tokens (the last one is computed for its logits). For a
family with state that is not paged, the run ends at the deepest block boundary that also has a state
snapshot; snapshots are taken at block boundaries of committed tokens: every SNAPSHOT_EVERY-th block, the
last full block of the prompt (and the one before it when the prompt fills its last block, where a repeat
of the prompt starts), the boundary where the prompt's match with the index ended (so the next
request with that prefix hits), and during decode the latest boundary of each sequence. Where every state
kind of the model can give its snapshot at a token inside a forward (SequenceState.snapshots_inside: the
recurrent states by running their recurrence in pieces, cache/state.py and layers/recurrent.py), a prompt's
chunk runs whole and the snapshots of the boundaries inside it are taken as it passes them; otherwise prompt
chunks are cut at those boundaries so that the state is there to snapshot (a 256-token prompt ran as 192 +
64 rows, ~7 % slower on the CPU: docs/perf.md).
"""

from __future__ import annotations

from collections import deque

from ..cache.paged import BLOCK_SIZE
from .block_manager import BlockManager, SnapshotStore
from .sequence import Sequence, Status

SNAPSHOT_EVERY = 4  # blocks


def _key(seq: Sequence) -> tuple[int, int]:
    return seq.arrival, seq.index


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        new_state,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_state_bytes: int | None = None,
        hybrid: bool = False,
        snapshots: SnapshotStore | None = None,
        caching: bool = True,
        inside: bool = False,
    ):
        self.blocks = blocks
        self.new_state = new_state  # BlockTable -> a fresh SequenceState paged through it
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_state_bytes = max_state_bytes
        self.hybrid = hybrid
        self.snapshots = snapshots
        self.caching = caching
        self.inside = inside  # snapshots at boundaries inside a forward (no cut there)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.used_bytes = 0  # the planner's bytes of the running sequences (under max_state_bytes)
        self.step_no = 0
        self.arrivals = 0
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens served by the prefix cache (first admissions)
        self.admitted_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.arrivals += 1
        seq.arrival = self.arrivals
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def slots(self) -> int:
        return sum(s.samples for s in self.running)

    # ---- one step
    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of its pending tokens to compute) for the next forward; their blocks are held."""
        self.step_no += 1
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        chosen: set[int] = set()

        def take(seq: Sequence, n: int) -> None:
            nonlocal budget
            self._want_inside(seq, n)
            batch.append((seq, n))
            chosen.add(seq.id)
            seq.last_step = self.step_no
            budget -= n

        decoding = [s for s in self.running if not s.paused and s.num_pending == 1]
        for seq in sorted(decoding, key=lambda s: (s.last_step, _key(s))):
            if budget == 0:
                break
            if seq.status is Status.RUNNING and self._place(seq, 1, chosen, partial=False):
                take(seq, 1)
        for i, (seq, _) in enumerate(batch):  # then their drafts, as far as budget and free blocks go
            if budget == 0:
                break
            if seq.draft is not None and seq.draft.tokens:
                extra = self._place_draft(seq, min(len(seq.draft.tokens), budget))
                batch[i] = (seq, 1 + extra)
                budget -= extra
        prefilling = [s for s in self.running if not s.paused and s.num_pending > 1]
        for seq in sorted(prefilling, key=_key):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue
            n = self._place(seq, self._chunk(seq, seq.num_computed, budget), chosen, partial=True)
            if n:
                take(seq, n)
        while budget > 0:
            seq = next((s for s in self.waiting if not s.paused), None)
            if seq is None:
                break
            n = self._admit(seq, budget)
            if not n:
                break
            take(seq, n)
        return batch

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """How many of its pending tokens (from `start`) a sequence computes now: within the budget, and for
        a family with unpaged state up to its next snapshot boundary."""
        n = min(len(seq.token_ids) - start, budget)
        if self.hybrid and self.caching and seq.speculative == 0 and not self.inside:
            stop = self._next_point(seq, start)
            if stop is not None:
                n = min(n, stop - start)
        return n

    def _next_point(self, seq: Sequence, start: int) -> int | None:
        every = SNAPSHOT_EVERY * BLOCK_SIZE
        points = [(start // every + 1) * every, *self._prompt_points(seq), *seq.snapshot_points]
        later = [p for p in points if p > start]
        return min(later) if later else None

    @staticmethod
    def _prompt_points(seq: Sequence) -> tuple[int, int]:
        """The prompt's last full block, and the last one a repeat of the same prompt can start from (one
        token short of it: they differ when the prompt fills its last block)."""
        n = len(seq.prompt_ids)
        return n // BLOCK_SIZE * BLOCK_SIZE, (n - 1) // BLOCK_SIZE * BLOCK_SIZE

    def _want_inside(self, seq: Sequence, n: int) -> None:
        """Names to the sequence's state the snapshot boundaries inside its next forward of n tokens (where it
        runs whole past them: `inside`), and forgets those of the last one."""
        points: tuple[int, ...] = ()
        if self.inside and self.hybrid and self.caching and seq.speculative == 0 and n > 1:
            start = seq.num_computed
            first = (start // BLOCK_SIZE + 1) * BLOCK_SIZE
            points = tuple(p for p in range(first, start + n, BLOCK_SIZE) if self.is_point(seq, p))
        if points or seq.inside_points:
            seq.inside_points = points
            seq.state.want(points)

    def is_point(self, seq: Sequence, at: int) -> bool:
        """Whether `at` (a block boundary) is one of the sequence's permanent snapshot boundaries."""
        return (
            at % (SNAPSHOT_EVERY * BLOCK_SIZE) == 0
            or at in self._prompt_points(seq)
            or at in seq.snapshot_points
        )

    def _place(self, seq: Sequence, n: int, chosen: set[int], partial: bool) -> int:
        """Holds the blocks for the sequence's next n tokens, preempting newer sequences (paused ones
        first) while they are short; with `partial`, settles for fewer tokens. Returns how many are placed
        (0: none; the sequence waits, holding what it has)."""
        start = seq.num_computed
        while True:
            fit = self._fit(seq, start, n) if partial else (n if self._fits(seq, start, n) else 0)
            if fit == n:
                break
            victim = self._victim(seq, chosen)
            if victim is None:
                if not fit:
                    return 0
                break
            self.preempt(victim)
        ok = self.blocks.prepare(seq.block_table, start, start + fit)
        assert ok, "blocks counted free were not"
        return fit

    def _place_draft(self, seq: Sequence, k: int) -> int:
        """Holds the blocks for up to k draft rows after the sequence's placed pending token, without
        preempting anyone (a draft is worth less than another sequence's progress); returns how many."""
        start = seq.num_computed
        fit = self._fit(seq, start, 1 + k)
        ok = self.blocks.prepare(seq.block_table, start, start + fit)
        assert ok, "blocks counted free were not"
        return fit - 1

    def _fits(self, seq: Sequence, start: int, n: int) -> bool:
        return self.blocks.blocks_needed(seq.block_table, start, start + n) <= self.blocks.num_free

    def _fit(self, seq: Sequence, start: int, n: int) -> int:
        """The most tokens (<= n) whose blocks can be had now."""
        if self._fits(seq, start, n):
            return n
        lo, hi = 0, n  # blocks_needed grows with the count: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(seq, start, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _victim(self, seq: Sequence, chosen: set[int]) -> Sequence | None:
        others = [s for s in self.running if s is not seq and s.id not in chosen]
        paused = [s for s in others if s.paused]
        if paused:
            return max(paused, key=_key)
        newer = [s for s in others if _key(s) > _key(seq)]
        return max(newer, key=_key) if newer else None

    def _paused_running(self) -> Sequence | None:
        paused = [s for s in self.running if s.paused]
        return max(paused, key=_key) if paused else None

    # ---- admission
    def lookup(self, seq: Sequence) -> tuple[list[int], list[int], object]:
        """The prefix-cache hit of a sequence: (block ids, their hashes, state snapshot or None)."""
        if not self.caching:
            return [], [], None
        chain, hashes = self.blocks.match(seq.token_ids, (len(seq.token_ids) - 1) // BLOCK_SIZE)
        if not self.hybrid:
            return chain, hashes, None
        matched = len(chain) * BLOCK_SIZE
        best = next((i for i in range(len(chain), 0, -1) if hashes[i - 1] in self.snapshots), 0)
        if matched > best * BLOCK_SIZE and seq.speculative == 0:
            seq.snapshot_points = tuple(sorted(set(seq.snapshot_points) | {matched}))
        if not best:
            return [], [], None
        return chain[:best], hashes[:best], self.snapshots.get(hashes[best - 1])

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admits the first waiting sequence if a slot, the state budget and blocks for a first chunk allow
        (preempting paused sequences for them); returns the chunk's length, 0 if it must wait."""
        planned = seq.planned_bytes * seq.samples
        while True:
            over_slots = self.slots() + seq.samples > self.max_num_seqs
            over_bytes = self.max_state_bytes is not None and self.used_bytes + planned > self.max_state_bytes
            if not (over_slots or over_bytes):
                break
            victim = self._paused_running()
            if victim is None:
                return 0
            self.preempt(victim)
        while True:
            chain, hashes, snap = self.lookup(seq)
            hit = len(chain) * BLOCK_SIZE
            n = self._chunk(seq, hit, budget)
            room = (len(chain) + self.blocks.num_free - self.blocks.revivals(chain)) * BLOCK_SIZE - hit
            n = min(n, room)
            if n > 0:
                break
            victim = self._paused_running()
            if victim is None:
                return 0
            self.preempt(victim)
        self.waiting.remove(seq)
        seq.state = self.new_state(seq.block_table)
        self.blocks.attach(seq.block_table, chain)
        seq.hashes = list(hashes)
        if snap is not None:
            seq.state.restore(snap)
        elif hit:  # every layer is paged: the blocks are the prefix
            seq.state.restore((hit, [None if layer is None else hit for layer in seq.state.layers]))
        ok = self.blocks.prepare(seq.block_table, hit, hit + n)
        assert ok, "blocks counted free were not"
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.used_bytes += planned
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit
            self.cached_tokens += hit
            self.admitted_prompt_tokens += len(seq.prompt_ids)
        return n

    # ---- leaving
    def _release(self, seq: Sequence) -> None:
        self.blocks.free_table(seq.block_table)
        self.used_bytes -= seq.planned_bytes * seq.samples
        seq.state = None
        seq.hashes = []
        seq.tail_snapshot = None
        seq.inside_points = ()
        seq.draft = None  # the drafter starts again with its state
        seq.observed = -1
        seq.speculative = 0

    def preempt(self, seq: Sequence) -> None:
        """By recompute: its blocks and state go; it keeps its tokens and waits at the front."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    # ---- after the forward
    def computed(self, seq: Sequence, n: int) -> None:
        """Indexes the sequence's newly full blocks and takes the snapshots due at where it now stands."""
        if not self.caching:
            return
        committed = seq.num_committed
        self.blocks.register(seq.block_table, seq.hashes, seq.token_ids, committed)
        if seq.inside_points and seq.state is not None:  # the boundaries this forward passed
            for p in seq.inside_points:
                h = seq.hashes[p // BLOCK_SIZE - 1]
                if h not in self.snapshots:
                    self.snapshots.put(h, seq.state.snapshot_at(p))
            seq.inside_points = ()
            seq.state.want(())
        if not self.hybrid or seq.speculative or committed % BLOCK_SIZE or not committed:
            return
        h = seq.hashes[committed // BLOCK_SIZE - 1]
        if self.is_point(seq, committed):
            if h not in self.snapshots:
                self.snapshots.put(h, seq.state.snapshot())
        elif n == 1 and h not in self.snapshots:  # decode: keep only the latest such boundary
            if seq.tail_snapshot is not None:
                self.snapshots.drop(seq.tail_snapshot)
            if self.snapshots.put(h, seq.state.snapshot()):
                seq.tail_snapshot = h
