"""ForwardBatch: the tokens of several sequences packed along one axis.

Draft heads read the target's hidden states ("taps"): `taps` names the layers wanted (decoder layer i's
output, or FINAL = the hidden the final norm reads), and the model leaves `tapped[layer]` = [N, d] for every
row of the batch. For models whose residual is several streams (mHC) a layer's tap is their mean, the FINAL
tap the model's own collapse of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .paged import PagePool
from .state import SequenceState

FINAL = -1  # the tap of the hidden state the final norm reads (what MTP heads take)


@dataclass
class SeqChunk:
    state: SequenceState
    start: int  # first row of this sequence's new tokens in the packed batch
    n: int  # how many new tokens
    past: int  # tokens the state held before this forward

    def rows(self, t):
        """This sequence's rows of a per-row tensor t [N, ...] of its forward: t itself where they are all of
        them (a batch of one sequence: no slice made)."""
        return t if self.n == t.shape[0] else t[self.start : self.start + self.n]

    def place(self, out, rows, like):
        """rows' counterpart: the forward's per-row output with this sequence's rows set to `rows`. `rows` itself
        where they are all of the forward's (`like` [N, ...]: a batch of one sequence, no copy); else written into
        out, made like `like` at the first sequence (out None)."""
        if self.n == like.shape[0]:
            return rows
        if out is None:
            out = torch.empty_like(like)
        out[self.start : self.start + self.n] = rows
        return out


@dataclass
class PagedStep:
    """A decode step whose every row is one sequence's next token over the engine's pages, addressed by device
    tensors only (a CUDA graph's inputs, engine/graphs.py): the row's page (`blocks`, `offsets` [B] int64),
    the block tables [B, W] (int32, padded), the lengths after this token [B] (int32), query_start [B + 1]
    and each row's sequence [B] (int32 aranges: one row a sequence). A forward given one reads no sequence
    state and no host value of the batch, so the same launches serve every step of this shape."""

    pool: PagePool
    blocks: torch.Tensor
    offsets: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    row_seq: torch.Tensor

    def layer(self, L: int) -> tuple[dict[str, torch.Tensor], int]:
        """Paged layer L's pool fields ({field: [blocks, layers, BLOCK_SIZE, width]}) and its index in them."""
        fmt, index = self.pool.layers[L]
        return self.pool.pools[fmt], index

    def write(self, L: int, **rows: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
        """Writes each row's new entries of layer L into its page; returns layer(L)."""
        fields, index = self.layer(L)
        for k, r in rows.items():
            fields[k][self.blocks, index, self.offsets] = r.to(fields[k].dtype)
        return fields, index


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute positions
    seqs: list[SeqChunk]
    logit_rows: torch.Tensor  # rows of the packed batch whose logits are returned
    max_position: int = 0  # the largest position in the batch, known on the host (no device sync to ask)
    taps: tuple[
        int, ...
    ] = ()  # layers whose hidden states a draft head reads (FINAL: the final norm's input)
    tapped: dict[int, torch.Tensor] = field(default_factory=dict)
    host_token_ids: torch.Tensor | None = (
        None  # token_ids on the host (what host-side lookups read, unsynced)
    )
    paged: PagedStep | None = None  # a static decode step (then `seqs` is empty: engine/graphs.py)

    @staticmethod
    def build(
        items: list[tuple[SequenceState, list[int]]], logits: str | list[int] = "last", device="cpu"
    ) -> ForwardBatch:
        """items: (state, new token ids) per sequence. logits: "last" (one row per sequence), "all", or the
        rows themselves (indexes into the packed batch)."""
        ids, pos, seqs = [], [], []
        given = isinstance(logits, list)
        rows = logits if given else []
        start = 0
        for state, toks in items:
            n = len(toks)
            if n == 0:
                raise ValueError("a sequence in a forward needs at least one new token")
            ids.extend(toks)
            pos.extend(range(state.num_tokens, state.num_tokens + n))
            seqs.append(SeqChunk(state, start, n, state.num_tokens))
            if logits == "all":
                rows.extend(range(start, start + n))
            elif not given:
                rows.append(start + n - 1)
            start += n
        host_ids = torch.tensor(ids, dtype=torch.long)
        return ForwardBatch(
            host_ids.to(device),  # on the host: the same tensor
            torch.tensor(pos, dtype=torch.long, device=device),
            seqs,
            torch.tensor(rows, dtype=torch.long, device=device),
            max(pos),
            host_token_ids=host_ids,
        )

    def tap(self, layer: int, hidden: torch.Tensor, collapse: Callable | None = None) -> None:
        """Keeps `hidden` (through `collapse`, e.g. the mean of mHC streams) as layer `layer`'s tap [N, d]
        when a draft head asked for it; nothing is computed otherwise."""
        if layer in self.taps:
            self.tapped[layer] = hidden if collapse is None else collapse(hidden)

    def finish(self) -> None:
        """Advances every sequence's token count once all layers have appended their state."""
        for s in self.seqs:
            s.state.num_tokens = s.past + s.n
