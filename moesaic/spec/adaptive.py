"""Adaptive draft length: each step, how many drafts each decoding sequence gets, from its measured acceptance
and the cost of a step at the current batch size.

With a per-draft acceptance rate a (the chance that a draft is accepted given the ones before it were), a
round of k drafts commits E(a, k) = 1 + a + ... + a^k tokens. A step of S decoding sequences, sequence i
drafting k_i, costs, relative to a plain decode step of the same batch, 1 + beta * sum(k_i) / S + delta
(delta * max k_i for a drafter that runs once per draft, MTP): beta = what one more row per decoding
sequence adds to a step (from a fitted time model t = t0 + t1 * rows of the target's forwards: beta =
t1 * S / (t0 + t1 * S), so it grows with the batch), delta = the drafter's time per call (per draft) over
the plain step. The drafter runs once a step for every sequence together, so its cost is the step's, not
each sequence's: the policy picks the step's longest draft c that maximises sum E(a_i, k_i) / S over that
cost, where each sequence drafts k_i = min(c, the drafts worth their row: a_i^j >= beta). c = 0 (plain
decoding) wins unless drafting pays by 2 %; a sequence left at 0 is off (colibri, a DeepSeek engine, stops
below ~60 % acceptance; here the threshold follows from the measured costs). While off, its acceptance
record decays towards the prior, so drafting is retried when the prior pays, and after RETRY_AFTER rounds
off in any case: a time model fitted on a noisy stretch (this shared machine's step times move by half
between phases) may price a row far above its cost, and only rounds that draft measure it again.

The model above prices what it can see (a step's rows, a propose call); it cannot see all that drafting costs
(a verify forward's rows may take slower paths than a decode row's, rollbacks, the drafter's bookkeeping)
nor what the batch loses when one sequence's round holds the others. So `DraftGate` also measures the whole
thing: per batch size, the tokens committed per second of decode steps that verified drafts against steps
that did not, and lets drafting run only while it is the faster of the two (each arm kept measured by one
step in EXPLORE_EVERY, in runs of EXPLORE_RUN). That is what makes adaptive drafting no slower than plain decoding, whatever the
model gets wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_RATE = 0.6  # the acceptance a sequence is assumed to have before it is measured
PRIOR_WEIGHT = 1.0  # ... worth this many drafts
DECAY = 0.9  # weight of the past per measured round (an exponential moving average of the counts)
OFF_DECAY = 0.95  # per round spent not drafting: the record fades, so drafting is tried again
TIME_DECAY = 0.98  # weight of the past forwards in the time model
RETRY_AFTER = 16  # rounds off after which one round drafts the full length again (and measures its cost)
GATE_DECAY = 0.9  # weight of an arm's past per step it records (DraftGate)
GATE_MIN = 3  # steps each arm needs at a batch size before the two are compared
EXPLORE_EVERY = 16  # while one arm wins, the other takes one step in this many, so that it stays measured
EXPLORE_RUN = 4  # ... in runs of this many steps, the first of which is not measured (see DraftGate)


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
    """The engine's draft-length policy (one per engine): `adaptive` False drafts k every round."""

    def __init__(self, k: int, adaptive: bool = True):
        self.k = k
        self.adaptive = adaptive
        self.sums = [0.0] * 5  # moving sums of 1, rows, seconds, rows^2, rows*seconds (forward times)
        # the same per number of sequences in the step: a step's cost grows with its sequences (the mixers
        # run sequence by sequence) as well as its rows, so one line over every batch size misleads
        self.by_seqs: dict[int, list[float]] = {}
        self.draft_seconds: float | None = None  # moving mean of one propose call, per unit of its cost
        # "per_round": a drafter whose call costs the same for any k (DFlash's one block forward);
        # "per_token": one forward per draft (MTP recursing through its layer), so a short draft is cheaper
        self.draft_cost = "per_round"

    def forward_done(self, rows: int, seconds: float, seqs: int | None = None) -> None:
        r, t = float(rows), float(seconds)
        sums = [self.sums] if seqs is None else [self.sums, self.by_seqs.setdefault(seqs, [0.0] * 5)]
        for s in sums:
            for i, v in enumerate((1.0, r, t, r * r, r * t)):
                s[i] = TIME_DECAY * s[i] + v

    def draft_done(self, seconds: float, k: int = 1) -> None:
        """A propose call of `seconds` whose longest draft was `k` tokens."""
        unit = seconds / max(1, k) if self.draft_cost == "per_token" else seconds
        d = self.draft_seconds
        self.draft_seconds = unit if d is None else 0.9 * d + 0.1 * unit

    def draft_units(self, k: int) -> int:
        return k if self.draft_cost == "per_token" else 1

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

    def costs(self, decoders: int) -> tuple[float, float]:
        """(beta, delta) for a batch of `decoders` decoding sequences (see the module docstring); before
        anything is measured, a small row cost and no drafter cost, so that drafting starts and is measured."""
        here = self.by_seqs.get(decoders)
        seen_here = here is not None and here[0] > 0
        model = self.step_model(decoders)
        if model is None and not seen_here:
            model = self.step_model()  # nothing of this size yet: the line over every size
        if model is None:
            # the rows have not varied (e.g. drafting was off): a small row cost, so that drafting is tried
            # and the line gets fitted, and the drafter against the mean step (of this size where seen)
            n, _, t, _, _ = here if seen_here else self.sums
            beta, plain = 0.05, (t / n if n > 0 else 0.0)
        else:
            t0, t1 = model
            plain = t0 + t1 * decoders
            beta = t1 * decoders / plain if plain > 0 else 0.05
        if plain <= 0:
            return 0.05, 0.0
        return beta, (self.draft_seconds or 0.0) / plain

    def length(self, acc: Acceptance, decoders: int, limit: int) -> int:
        """The draft length for one sequence this round (at most `limit`)."""
        return self.lengths([acc], decoders, [limit])[0]

    def lengths(self, accs: list[Acceptance], decoders: int, limits: list[int]) -> list[int]:
        """The draft lengths of the sequences asking this step (each at most its limit), in a step of
        `decoders` decoding sequences (those not asking decode one token)."""
        caps = [max(0, min(self.k, limit)) for limit in limits]
        if not self.adaptive:
            return caps
        S = max(decoders, len(accs), 1)
        beta, delta = self.costs(S)
        rates = [acc.rate for acc in accs]
        # drafts worth their row: the j-th commits a^j tokens more for beta / S of a plain step's cost,
        # which makes S tokens (the drafter's cost is the step's and weighed below, for the longest draft)
        worth = [next((j for j in range(cap) if r ** (j + 1) < beta), cap) for r, cap in zip(rates, caps)]
        best, ks = 1.0, [0] * len(accs)
        for c in range(1, max(worth, default=0) + 1):
            trial = [min(c, w) for w in worth]
            gain = (sum(expected_tokens(r, k) for r, k in zip(rates, trial)) + S - len(accs)) / S
            cost = 1.0 + beta * sum(trial) / S + delta * self.draft_units(c)
            if gain / cost > best * 1.02:  # a 2 % margin: within noise, plain decoding wins
                best, ks = gain / cost, trial
        for i, acc in enumerate(accs):
            if caps[i] == 0:  # the request's limit, not the policy
                continue
            if ks[i] > 0:
                acc.off = 0
                continue
            acc.fade()
            acc.off += 1
            if acc.off >= RETRY_AFTER:  # a retry: the costs it is judged by are measured again
                acc.off, ks[i] = 0, caps[i]
        return ks


@dataclass
class Arm:
    """Moving sums of the tokens committed and the seconds spent by one kind of step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = GATE_DECAY * self.tokens + tokens
        self.seconds = GATE_DECAY * self.seconds + seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DraftGate:
    """Whether the next decode step of `seqs` sequences may draft at all: drafting runs while steps that
    verified drafts (everything such a step costs: the propose call that made its drafts, the verify forward,
    acceptance and rollbacks) commit more tokens per second than steps that did not, at that batch size.
    The drafting arm is measured first; then the plain one; then the faster wins, and the other runs
    EXPLORE_RUN steps in a row once every EXPLORE_EVERY * EXPLORE_RUN, so that a change (acceptance, batch
    mix, the machine) is seen. The first step after a switch is not measured: it pays for the switch (a
    drafter that defers its context rows catches up on every row committed while it was off), which a
    drafting arm measured one step at a time would always be charged with."""

    def __init__(self):
        self.arms: dict[int, tuple[Arm, Arm]] = {}  # batch size -> (plain steps, drafting steps)
        self.turns: dict[int, int] = {}
        self.last: dict[int, bool] = {}  # batch size -> the last decision
        self.warming: set[int] = set()  # batch sizes whose next step follows a switch

    def record(self, seqs: int, tokens: int, seconds: float, drafted: bool) -> None:
        """A decode step of `seqs` sequences committed `tokens` in `seconds`; `drafted`: it verified drafts."""
        if seqs in self.warming:
            self.warming.discard(seqs)
            return
        self.arms.setdefault(seqs, (Arm(), Arm()))[drafted].add(tokens, seconds)

    def allows(self, seqs: int) -> bool:
        plain, drafting = self.arms.setdefault(seqs, (Arm(), Arm()))
        turn = self.turns[seqs] = self.turns.get(seqs, 0) + 1
        if drafting.steps < GATE_MIN:
            want = True
        elif plain.steps < GATE_MIN:
            want = False
        else:
            explore = turn % (EXPLORE_EVERY * EXPLORE_RUN) < EXPLORE_RUN
            want = (drafting.rate >= plain.rate) != explore
        if want != self.last.get(seqs):
            self.warming.add(seqs)
        self.last[seqs] = want
        return want
