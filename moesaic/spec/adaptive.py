"""Adaptive draft length: each step, how many drafts each decoding sequence gets, by measuring what drafting
buys at the current batch size.

Two parts. `DraftGate` picks the step's longest draft c (0: a plain step) by measuring whole steps: per batch
size, runs of a few decode steps at one length, each candidate length's run against the best length's runs
right before and after it, by the tokens committed per second, everything they cost included (the propose call that
made the drafts, the verify forward's rows, acceptance, rollbacks, a drafter's catch-up). A model of those
costs, with the gate only switching drafting on and off, was tried first and priced them wrong both ways
(docs/perf.md, "the length policy against the gate alone"): a round of k drafts cost ~1.13 + 0.30 k plain
steps where the model said 1 + 0.37 k, so it drafted one token where two paid best, and turned drafting off
in a fifth to a half of the rounds. Measured rates need no prices.

`DraftLength` then gives each sequence at most c drafts, as many as are worth their row by its own measured
acceptance: with a per-draft acceptance rate a (the chance that a draft is accepted given the ones before it
were), the j-th draft commits a^j more tokens for beta of a plain step's cost, beta = what one more row per
decoding sequence adds to a step (from a fitted time model t = t0 + t1 * rows of the target's forwards: beta =
t1 * S / (t0 + t1 * S) for S decoding sequences, so it grows with the batch). That is what a step-wide
measurement cannot see: in a batch, the one sequence whose drafts are never accepted (colibri, a DeepSeek
engine, stops below ~60 % acceptance; here the threshold follows from the measured row cost). While a
sequence is off its acceptance record decays towards the prior, so drafting is retried when the prior pays,
and after RETRY_AFTER rounds off in any case: a time model fitted on a noisy stretch (this machine's step
times move by half between phases) may price a row far above its cost, and only rounds that draft measure it
again.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

PRIOR_RATE = 0.6  # the acceptance a sequence is assumed to have before it is measured
PRIOR_WEIGHT = 1.0  # ... worth this many drafts
DECAY = 0.9  # weight of the past per measured round (an exponential moving average of the counts)
OFF_DECAY = 0.95  # per round spent not drafting: the record fades, so drafting is tried again
TIME_DECAY = 0.98  # weight of the past forwards in the time model
RETRY_AFTER = 16  # rounds off after which one round drafts the full length again (and measures its cost)
RUN = 4  # DraftGate: steps a length runs in a row before another is chosen (the first after a switch unmeasured)
EXPLORE_EVERY = 16  # runs of the best length between two runs of another candidate ...
BACKOFF = 2  # ... doubled after each losing candidate run in a row, up to 2 ** BACKOFF times as many
PAIRS = 2  # a candidate replaces the best length when each of its last PAIRS comparisons says it is faster


@dataclass
class Acceptance:
    """One sequence's acceptance record (moving sums of accepted and tried drafts)."""

    accepted: float = 0.0
    tried: float = 0.0
    off: int = 0  # rounds in a row with drafting off

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        """A verified round: `accepted` of `drafted` drafts (the first rejection ends the round, so the
        drafts tried are the accepted ones plus the rejected one)."""
        tried = min(drafted, accepted + 1)
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + tried

    def fade(self) -> None:
        self.accepted *= OFF_DECAY
        self.tried *= OFF_DECAY


def expected_tokens(rate: float, k: int) -> float:
    return sum(rate**i for i in range(k + 1))


class DraftLength:
    """The engine's per-sequence draft lengths (one per engine): `adaptive` False drafts k every round."""

    def __init__(self, k: int, adaptive: bool = True):
        self.k = k
        self.adaptive = adaptive
        self.sums = [0.0] * 5  # moving sums of 1, rows, seconds, rows^2, rows*seconds (forward times)
        # the same per number of sequences in the step: a step's cost grows with its sequences (the mixers
        # run sequence by sequence) as well as its rows, so one line over every batch size misleads
        self.by_seqs: dict[int, list[float]] = {}

    def forward_done(self, rows: int, seconds: float, seqs: int | None = None) -> None:
        r, t = float(rows), float(seconds)
        sums = [self.sums] if seqs is None else [self.sums, self.by_seqs.setdefault(seqs, [0.0] * 5)]
        for s in sums:
            for i, v in enumerate((1.0, r, t, r * r, r * t)):
                s[i] = TIME_DECAY * s[i] + v

    def step_model(self, seqs: int | None = None) -> tuple[float, float] | None:
        """(t0, t1) of t = t0 + t1 * rows (over the steps of `seqs` sequences, else all), or None while the
        rows seen do not vary enough to fit it."""
        n, r, t, rr, rt = self.sums if seqs is None else self.by_seqs.get(seqs, [0.0] * 5)
        if n < 2:
            return None
        var = rr / n - (r / n) ** 2
        if var <= 1e-9 * max(1.0, (r / n) ** 2):
            return None
        t1 = max(0.0, (rt / n - (r / n) * (t / n)) / var)
        t0 = max(0.0, t / n - t1 * r / n)
        return t0, t1

    def row_cost(self, decoders: int) -> float:
        """beta for a batch of `decoders` decoding sequences (see the module docstring); before the rows have
        varied (nothing drafted yet), a small one, so that drafting is tried and the line gets fitted."""
        here = self.by_seqs.get(decoders)
        model = self.step_model(decoders)
        if model is None and (here is None or here[0] <= 0):
            model = self.step_model()  # nothing of this size yet: the line over every size
        if model is None:
            return 0.05
        t0, t1 = model
        plain = t0 + t1 * decoders
        return t1 * decoders / plain if plain > 0 else 0.05

    def length(self, acc: Acceptance, decoders: int, limit: int, cap: int | None = None) -> int:
        """The draft length for one sequence this round (at most `limit` and the step's `cap`)."""
        return self.lengths([acc], decoders, [limit], cap)[0]

    def lengths(
        self, accs: list[Acceptance], decoders: int, limits: list[int], cap: int | None = None
    ) -> list[int]:
        """The draft lengths of the sequences asking this step, each at most its limit and the step's longest
        draft `cap` (the DraftGate's), in a step of `decoders` decoding sequences (those not asking decode
        one token)."""
        top = self.k if cap is None else min(self.k, cap)
        caps = [max(0, min(top, limit)) for limit in limits]
        if not self.adaptive:
            return caps
        beta = self.row_cost(max(decoders, len(accs), 1))
        # drafts worth their row: the j-th commits a^j tokens more for beta of a plain step's cost per sequence
        ks = [next((j for j in range(c) if acc.rate ** (j + 1) < beta), c) for acc, c in zip(accs, caps)]
        for i, acc in enumerate(accs):
            if caps[i] == 0:  # the request's limit or the step's, not the sequence's acceptance
                continue
            if ks[i] > 0:
                acc.off = 0
                continue
            acc.fade()
            acc.off += 1
            if acc.off >= RETRY_AFTER:  # a retry: the row cost it is judged by is measured again
                acc.off, ks[i] = 0, caps[i]
        return ks


@dataclass
class Climb:
    """One batch size's search (DraftGate): the best length so far, the current run, and per candidate
    length its last PAIRS comparisons (the log of its run's rate over the best's runs around it)."""

    best: int
    arm: int = -1  # the current run's length (-1: none yet)
    left: int = 0  # its steps still to come
    warm: bool = False  # its next recorded step is the first after a switch: not measured
    tokens: int = 0  # the run's measured steps: tokens committed ...
    seconds: list = field(default_factory=list)  # ... and each one's time
    base: float | None = None  # the log rate of the best length's last run
    pending: tuple | None = None  # a candidate's run (length, log rate, base before it) awaiting the best's
    runs: int = 0  # best runs since the last exploration
    losses: int = 0  # candidate runs in a row that lost (each doubles the wait, up to 2 ** BACKOFF)
    turn: int = 0  # candidates explored so far (round robin)
    scores: dict = field(default_factory=dict)  # length -> its last comparisons, the latest last


class DraftGate:
    """The longest draft the next decode step of `seqs` sequences may take (0: a plain step), from the tokens
    committed per second of earlier steps at each length (everything a step costs: the propose call that made
    its drafts, the verify forward, acceptance and rollbacks), per batch size.

    Lengths run in runs of RUN steps. A candidate length is judged only against the best one's runs right
    before and right after its own (the log of its run's rate over the geometric mean of theirs): this
    machine's step times move by up to half between stretches of a few dozen steps, and rates measured at
    different times would mostly compare the stretches; a stretch that begins or ends at the candidate's run
    moves one of its two neighbours, so it weighs half. The candidates of a best length c are c - 1 and
    c + 1 (a climb: the rate is one-humped in the length, each draft adding a row and drafter time for a
    smaller expected gain than the one before) and always 0 and k. Plain steps are the first best length; its
    candidates are measured at once, the full length first (PAIRS runs each), and a candidate takes the best's
    place when each of its last PAIRS comparisons says it is faster (one lucky run, a slow stretch on the
    best's side, does not move it). Then one candidate run in EXPLORE_EVERY, round robin, keeps the
    comparisons current, so that a change (acceptance, batch mix) is seen; each losing candidate run in a row
    doubles that wait (up to 2 ** BACKOFF times), since a candidate run costs what it loses (a drafter that
    never pays would otherwise draft one run in seventeen). A candidate that was faster in its last run runs
    again at once, to be confirmed or not. The first step after a switch is not measured: it pays for the
    switch (a drafter that defers its context rows catches up on every row committed while it drafted less),
    which a run judged one step at a time would always be charged with."""

    def __init__(self, k: int):
        self.k = k
        self.climbs: dict[int, Climb] = {}  # batch size -> its search

    def candidates(self, best: int) -> list[int]:
        """The lengths judged against `best`, longest first."""
        return sorted(
            {c for c in (best - 1, best + 1, 0, self.k) if 0 <= c <= self.k and c != best}, reverse=True
        )

    def best(self, seqs: int) -> int:
        return self.climbs[seqs].best if seqs in self.climbs else 0

    def length(self, seqs: int) -> int:
        climb = self.climbs.setdefault(seqs, Climb(best=0))
        if climb.left == 0:
            arm = self._next(climb)
            climb.warm = arm != climb.arm and climb.arm >= 0
            climb.arm, climb.left, climb.tokens, climb.seconds = arm, RUN, 0, []
        climb.left -= 1
        return climb.arm

    def _next(self, climb: Climb) -> int:
        if climb.arm != climb.best or climb.base is None:
            return climb.best  # a best run between two candidates' runs: each has one on either side
        near = self.candidates(climb.best)
        scores = [climb.scores.get(c, []) for c in near]
        for c, score in zip(near, scores):
            if len(score) < PAIRS:  # not compared enough yet
                return c
        for c, score in zip(near, scores):
            if score[-1] > 0.0:  # its last run was faster than the best's: confirmed (or not) at once
                return c
        climb.runs += 1
        if climb.runs < EXPLORE_EVERY << min(climb.losses, BACKOFF):
            return climb.best
        climb.runs = 0
        climb.turn += 1
        return near[climb.turn % len(near)]

    def record(self, seqs: int, tokens: int, seconds: float, length: int) -> None:
        """A decode step of `seqs` sequences, its drafts proposed under `length`, committed `tokens` in
        `seconds`."""
        climb = self.climbs.get(seqs)
        if climb is None or length != climb.arm:
            return
        if climb.warm:
            climb.warm = False
        else:
            climb.tokens += tokens
            climb.seconds.append(seconds)
        if climb.left > 0 or not climb.seconds or climb.tokens <= 0:
            return
        # the run is complete: its tokens over its steps' median time each (one step in a few tens here
        # takes several times the others, the collector's or the machine's; in a run of three it would
        # decide the comparison)
        rate = math.log(climb.tokens / (statistics.median(climb.seconds) * len(climb.seconds)))
        if climb.arm != climb.best:
            if climb.base is not None:
                climb.pending = (climb.arm, rate, climb.base)
            return
        climb.base = rate
        if climb.pending is None:
            return
        arm, own, before = climb.pending
        climb.pending = None
        score = climb.scores.setdefault(arm, [])
        score.append(own - (before + rate) / 2)
        del score[:-PAIRS]
        climb.losses = climb.losses + 1 if score[-1] <= 0.0 else 0
        if len(score) == PAIRS and min(score) > 0.0:  # faster than the best in each: the new best
            old = climb.best
            climb.best, climb.base, climb.runs, climb.losses = arm, own, 0, 0
            climb.scores = {old: [-x for x in score]}
