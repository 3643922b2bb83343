"""The interface between the engine and a draft proposer.

The engine owns the target model and the sequences; a proposer owns its drafter and the drafter's own
per-sequence caches. Per sequence, the engine tells the proposer what was committed (token ids and the
target's tapped hidden states of those rows, in order, every row once) and asks it for up to k drafts. A
proposer's caches may hold drafted rows between `propose` and the next `observe`: `observe` first forgets
them (its own rollback), then appends the committed rows. The target's own rollback of rejected rows is the
engine's job.

Row convention: `observe(seq, start, tokens, hidden)` gives the committed tokens t_start .. t_{start+m-1}
and, for each of those positions, the target's taps of the forward that consumed that token (so
`hidden[layer][i]` is the target's hidden state at position start + i, computed from t_0 .. t_{start+i}).
The newest committed token, sampled from the last row, has no hidden yet; it is the `last` of `propose`.
Rows the target did not compute (a prompt prefix served by the prefix cache) come with `hidden` = {}: a
drafter that reads hidden states has no features for them and drafts from the rows it has (verification
keeps the output exact whatever it proposes).

Parallel samples (n > 1): when a request forks after its prompt, the engine calls `fork(parent, child)`
where a proposer has it (the child starts with the parent's rows); otherwise `start(child)` and an
`observe` of the prompt's tokens with `hidden` = {}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# committed rows a sequence's drafter may hold back (to run them with its next drafts, for every drafting
# sequence at once) before they are run on their own: mtp.py and dflash.py defer their `observe` work
MAX_DEFERRED = 64


@dataclass
class Draft:
    """Up to k proposed tokens; `probs` [len(tokens), vocab] fp32 is the drafter's distribution at each
    drafted position when it sampled them (None: a deterministic drafter, i.e. a one-hot on each token —
    rejection sampling stays exact either way)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


@runtime_checkable
class DraftProposer(Protocol):
    method: str  # "ngram" | "mtp" | "dspark" | "dflash" (or a test's own)
    taps: tuple[int, ...]  # the target layers whose hidden states it reads (cache.batch.FINAL included)
    max_k: int  # the most drafts it can propose per round

    def start(self, seq_id: int) -> None:
        """A new sequence (or one restarted after preemption: forget anything held for seq_id)."""

    def observe(self, seq_id: int, start: int, tokens: list[int], hidden: dict[int, torch.Tensor]) -> None:
        """Committed rows start .. start + len(tokens) - 1 (see the row convention above)."""

    def propose(self, requests: list[tuple[int, int, int]]) -> list[Draft]:
        """For each (seq_id, last committed token, k): a Draft of at most k tokens (may be empty). All
        requests of one step come together, so a drafter can batch its forward."""

    def finish(self, seq_id: int) -> None:
        """The sequence ended or was aborted: free what is held for it (if anything: it may have been
        preempted before, or never started)."""
