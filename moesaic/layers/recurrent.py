"""Running a recurrent mixer (KDA, Mamba-2) over a batch: its row-wise projections over every row at once
(one weight read per step, not one per sequence), its recurrence once per group of sequences with the same
row count (folded into one sequence with more heads), each continuing its RecurrentState and keeping the
snapshots its rollback window needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentMixer:
    """A recurrent mixer in three phases, so that only the part that reads a sequence's state runs per
    sequence:
        project(x [N, d], w, dims) -> per-row tensors (projections, gates), every row of the batch at once
        recur(those rows of one sequence, w, dims, state, snapshot_last) -> (features [n, ...], new state,
              snapshots of the last `snapshot_last` rows)
        output(features [N, ...] of every row, the per-row tensors, w, dims) -> y [N, d]
    (the output projection is row-wise too: the batch's rows go through it at once)."""

    project: Callable
    recur: Callable
    output: Callable
    # heads are independent, so B sequences with the same row count can run as one sequence of B x the
    # heads: fold(rows of each, w, dims, states) -> (rows, w, dims, state) of that wider sequence, and
    # unfold(its features, new state, snapshots, B, dims) -> each sequence's (features, new state, snapshots)
    fold: Callable | None = None
    unfold: Callable | None = None
    # stepped(t) -> True where every row of a recurrence over tensors like t takes the token recurrence
    # (its state's bits then do not depend on where the snapshots begin), so that a forward asks only the
    # snapshots its rollback window keeps; None: a longer forward may take a chunked scan
    stepped: Callable | None = None
    # row(x [1, d], w, dims, state) -> (y, new state): all three phases for one sequence's one row (a decode
    # step at batch 1) where one call serves it, else None
    row: Callable | None = None

    def run(self, x, w, dims, state, snapshot_last: int = 0):
        """One sequence's rows x, continuing `state`: (y, new state, snapshots)."""
        feats = self.project(x, w, dims)
        o, new, snaps = self.recur(feats, w, dims, state, snapshot_last)
        return self.output(o, feats, w, dims), new, snaps


STEPPED_ROWS = 17  # at least the largest rollback window + 1 (spec: MAX_SPECULATIVE_TOKENS + 2)


def run_recurrent(mixer: RecurrentMixer, w, dims, L: int, x: torch.Tensor, batch) -> torch.Tensor:
    """The mixer over every sequence of `batch` (a ForwardBatch), whose layer-L state is a RecurrentState:
    the row-wise phases over all rows at once; the recurrence once per group of sequences with the same row
    count and snapshot count (decode rows, verify blocks of one length: folded into one wider sequence), else
    per sequence (in pieces ending at the prefix-cache points its state wants: `_recur_pieces`), continuing each
    state and keeping the snapshots its rollback window needs; returns y for all rows."""
    w, reduce = _local_output(w)
    if mixer.row is not None and x.shape[0] == 1 and reduce is None:  # one sequence's decode row
        layer = batch.seqs[0].state.layers[L]
        if (done := mixer.row(x, w, dims, layer.value)) is not None:
            y, new = done
            # its snapshot, where the rollback window keeps one, is the new state (as below)
            layer.advance(new, [new] if layer.snapshots_needed(1) else [], 1)
            return y
    feats = mixer.project(x, w, dims)
    groups: dict[tuple[int, int], list] = {}
    o = None
    for s in batch.seqs:
        layer = s.state.layers[L]
        if any(0 < t - s.past < s.n for t in layer.wants):  # a prefix-cache point inside: its own pieces
            y = _recur_pieces(mixer, w, dims, x, tuple(s.rows(f) for f in feats), layer, s.past)
            o = _place(o, y, s, x)
        else:
            groups.setdefault((s.n, layer.snapshots_needed(s.n)), []).append(s)
    for (n, snap), seqs in groups.items():
        rows = [tuple(s.rows(f) for f in feats) for s in seqs]
        states = [s.state.layers[L].value for s in seqs]
        ask = _ask(mixer, x, n, snap)
        if len(seqs) > 1 and mixer.fold is not None:
            fr, fw, fd, fs = mixer.fold(rows, w, dims, states)
            results = mixer.unfold(*mixer.recur(fr, fw, fd, fs, snapshot_last=ask), len(seqs), dims)
        else:
            results = [mixer.recur(r, w, dims, st, snapshot_last=ask) for r, st in zip(rows, states)]
        for s, (y, new, snaps) in zip(seqs, results):
            _advance(s.state.layers[L], new, snaps, n, snap, ask)
            o = _place(o, y, s, x)
    if o is None:
        return x.new_zeros(x.shape)
    out = mixer.output(o, feats, w, dims)
    return out if reduce is None else reduce(out)


def _ask(mixer: RecurrentMixer, x: torch.Tensor, n: int, snap: int) -> int:
    """The snapshots a recurrence of n rows asks its mixer for, where its state keeps `snap`. A lone row's only
    snapshot is the new state, and a lone row takes the token recurrence with or without snapshots: none are
    asked for (a decode step with a rollback window copies nothing). Longer forwards take their last
    STEPPED_ROWS rows by the token recurrence (the rows a mixer snapshots) whatever the rollback window: the
    state after a prompt then has the same bits in an engine that drafts and in one that does not (the chunked
    scan rounds otherwise), and greedy drafting stays token for token lossless in bf16. A mixer whose rows all
    take the token recurrence on this device (KDA on the CPU) gives those bits anyway: it copies only the
    snapshots kept."""
    if n == 1:
        return 0
    if mixer.stepped is not None and mixer.stepped(x):
        return snap
    return max(snap, min(n, STEPPED_ROWS))


def _advance(layer, new, snaps, n: int, snap: int, ask: int) -> None:
    """The state moved on by n rows: the last snapshot is the new state (one copy kept), and only the `snap`
    the state keeps."""
    if snap:
        kept = list(snaps[:-1]) + [new] if ask else [new]
        snaps = kept[len(kept) - snap :]
    else:
        snaps = []
    layer.advance(new, snaps, n)


def _recur_pieces(
    mixer: RecurrentMixer, w, dims, x: torch.Tensor, rows: tuple, layer, past: int
) -> torch.Tensor:
    """One sequence's recurrence over its rows in pieces that end at the points its state wants (token counts
    after `past`): each piece as a forward ending there would run it (the same bits), the state there kept
    for the prefix cache's snapshot (RecurrentState.snapshot_at). Returns the features of every row."""
    n = rows[0].shape[0]
    cuts = sorted({t - past for t in layer.wants if 0 < t - past < n})
    ys = []
    for a, b in zip([0, *cuts], [*cuts, n]):
        snap = layer.snapshots_needed(b - a)
        ask = _ask(mixer, x, b - a, snap)
        y, new, snaps = mixer.recur(tuple(r[a:b] for r in rows), w, dims, layer.value, snapshot_last=ask)
        _advance(layer, new, snaps, b - a, snap, ask)
        if b < n:
            layer.mids[past + b] = new
        ys.append(y)
    return torch.cat(ys)


def _place(o, y: torch.Tensor, s, x: torch.Tensor):
    """The features of every row so far, with sequence s's set to y."""
    if s.n == x.shape[0]:  # the batch's only sequence: its y is every row's
        return y
    if o is None:
        o = y.new_empty((x.shape[0],) + y.shape[1:])
    o[s.start : s.start + s.n] = y
    return o


def fold_channels(parts: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """B tensors [..., C] whose channels are sections of `sizes` (C = sum) -> [..., B * C] with each section
    of every tensor together, tensor-major inside it: [s0 of 0, s0 of 1, ..., s1 of 0, ...] (the channel order
    of one sequence with B x the heads)."""
    x = torch.stack(parts, -2)  # [..., B, C]
    return torch.cat([p.flatten(-2) for p in x.split(sizes, -1)], -1)


def unfold_channels(x: torch.Tensor, B: int, sizes: list[int], b: int) -> torch.Tensor:
    """The inverse of fold_channels for tensor b: [..., B * C] -> [..., C]."""
    secs = x.split([B * c for c in sizes], -1)
    return torch.cat([sec.unflatten(-1, (B, c))[..., b, :] for sec, c in zip(secs, sizes)], -1)


def repeat_sections(t: torch.Tensor, B: int, sizes: list[int]) -> torch.Tensor:
    """A per-channel weight [C, ...] for the folded channel order: each section repeated B times."""
    return torch.cat([sec.repeat(B, *([1] * (t.dim() - 1))) for sec in t.split(sizes, 0)], 0)


def _local_output(w):
    """Tensor parallelism: the mixer's row-parallel output projection (a weight with `local` and `group`,
    moesaic/parallel/comm.py) as its local piece, and the all-reduce that then sums the batch's rows once
    instead of once per sequence. Unchanged without one, or with an output bias (added after the sum).
    Found once per weights object (bound once at load): the scan of its fields cost ~15 us a layer in a
    decode step. The answer is kept on the object; without tensor parallelism as None (no reference cycle)."""
    try:
        found = w.__dict__[_LOCAL]
    except KeyError:
        found = w.__dict__[_LOCAL] = _find_local_output(w)
    return (w, None) if found is None else found


_LOCAL = "_local_output"  # the attribute _local_output keeps its answer in (not a dataclass field)


def _find_local_output(w):
    for f in dataclasses.fields(w):
        v = getattr(w, f.name)
        if hasattr(v, "local") and hasattr(v, "group") and getattr(w, f.name + "_bias", None) is None:
            return dataclasses.replace(w, **{f.name: v.local}), v.group.all_reduce
    return None
