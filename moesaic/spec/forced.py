"""Two drafters for tests, which know the target's continuation in advance (`references`: full token lists,
prompt + the tokens plain decoding gives; a sequence follows the one its tokens so far start): forced acceptance proposes the continuation
itself (every draft is accepted, the longest rounds), forced rejection proposes `accept` right tokens
and then wrong ones (`accept` = 0: the first draft is always rejected, and each round rolls back k rows).
Outputs with either must equal plain decoding's: the engine's verification and rollback are what is
tested. `accept` may be a callable (round number -> how many right tokens) to vary the rollback depth."""

from __future__ import annotations

import torch

from .base import Draft


class ForcedProposer:
    method = "forced"

    def __init__(self, references: list[list[int]], vocab: int, accept=None, max_k: int = 15, taps=()):
        self.references = [list(r) for r in references]
        self.vocab = vocab
        self.accept = accept  # None: all right
        self.max_k = max_k
        self.taps = tuple(taps)  # ask the engine for taps too (tests that the rows line up)
        self.tokens: dict[int, list[int]] = {}
        self.rounds = 0
        self.observed_hidden = 0  # rows that came with every asked tap, [1, hidden] each

    def start(self, seq_id: int) -> None:
        self.tokens[seq_id] = []

    def observe(self, seq_id: int, start: int, tokens: list[int], hidden: dict[int, torch.Tensor]) -> None:
        toks = self.tokens[seq_id]
        if start != len(toks):
            raise ValueError(f"forced: sequence {seq_id} holds {len(toks)} tokens, observe starts at {start}")
        if hidden:
            if set(hidden) != set(self.taps) or any(h.shape[0] != len(tokens) for h in hidden.values()):
                raise ValueError("forced: the hidden states do not line up with the tokens")
            self.observed_hidden += len(tokens)
        toks.extend(tokens)

    def _continuation(self, toks: list[int]) -> list[int] | None:
        return next((full for full in self.references if full[: len(toks)] == toks), None)

    def propose(self, requests: list[tuple[int, int, int]]) -> list[Draft]:
        out = []
        for seq_id, last, k in requests:
            toks = self.tokens[seq_id] + [last]
            full = self._continuation(toks)
            if full is None:
                out.append(Draft([]))
                continue
            right = full[len(toks) : len(toks) + k]
            n = (
                k
                if self.accept is None
                else self.accept(self.rounds)
                if callable(self.accept)
                else self.accept
            )
            drafts = right[:n] + [(t + 1) % self.vocab for t in right[n:]]
            self.rounds += 1
            out.append(Draft(drafts))
        return out

    def finish(self, seq_id: int) -> None:
        self.tokens.pop(seq_id, None)
