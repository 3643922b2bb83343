"""N-gram drafting (prompt lookup; Saxena 2023, "Prompt Lookup Decoding", and vLLM's `ngram` method): the
tokens that followed the most recent earlier occurrence of the sequence's last n tokens are the drafts.
Any family, no weights, no hidden states.

Per sequence it keeps the committed tokens and, for each n in [min_n, max_n], the latest end of every
n-gram seen (a dict), so a round costs O(max_n) lookups whatever the context length. The longest n that
matches wins (n from max_n down to min_n).
"""

from __future__ import annotations

import torch

from .base import Draft


class NgramProposer:
    method = "ngram"
    taps: tuple[int, ...] = ()

    def __init__(self, min_n: int = 2, max_n: int = 4, max_k: int = 15):
        self.min_n, self.max_n, self.max_k = min_n, max_n, max_k
        self.tokens: dict[int, list[int]] = {}
        self.index: dict[int, dict[tuple, int]] = {}  # seq -> {n-gram: position after its latest occurrence}

    def start(self, seq_id: int) -> None:
        self.tokens[seq_id] = []
        self.index[seq_id] = {}

    def fork(self, parent: int, child: int) -> None:
        self.tokens[child] = list(self.tokens[parent])
        self.index[child] = dict(self.index[parent])

    def observe(self, seq_id: int, start: int, tokens: list[int], hidden: dict[int, torch.Tensor]) -> None:
        toks, index = self.tokens[seq_id], self.index[seq_id]
        if start != len(toks):
            raise ValueError(f"ngram: sequence {seq_id} holds {len(toks)} tokens, observe starts at {start}")
        for t in tokens:
            toks.append(t)
            end = len(toks)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(toks[end - n : end])] = end

    def propose(self, requests: list[tuple[int, int, int]]) -> list[Draft]:
        return [Draft(self._lookup(seq_id, last, k)) for seq_id, last, k in requests]

    def _lookup(self, seq_id: int, last: int, k: int) -> list[int]:
        toks, index = self.tokens[seq_id], self.index[seq_id]
        for n in range(min(self.max_n, len(toks) + 1), self.min_n - 1, -1):
            key = (*toks[len(toks) - n + 1 :], last)
            end = index.get(key)
            if end is not None:  # every indexed n-gram ends at or before len(toks): an earlier occurrence
                return (toks[end : end + k] + [last])[:k] if end + k > len(toks) else toks[end : end + k]
        return []

    def finish(self, seq_id: int) -> None:
        self.tokens.pop(seq_id, None)
        self.index.pop(seq_id, None)


def make_proposer(model, cfg, spec, folder) -> NgramProposer:
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
