"""Running a recurrent mixer (KDA, Mamba-2) over a batch: its row-wise projections over every row at once
(one weight read per step, not one per sequence), its recurrence one sequence at a time on that sequence's
rows, continuing its RecurrentState and keeping the snapshots its rollback window needs."""

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

    def run(self, x, w, dims, state, snapshot_last: int = 0):
        """One sequence's rows x, continuing `state`: (y, new state, snapshots)."""
        feats = self.project(x, w, dims)
        o, new, snaps = self.recur(feats, w, dims, state, snapshot_last)
        return self.output(o, feats, w, dims), new, snaps


def run_recurrent(mixer: RecurrentMixer, w, dims, L: int, x: torch.Tensor, batch) -> torch.Tensor:
    """The mixer over every sequence of `batch` (a ForwardBatch), whose layer-L state is a RecurrentState:
    the row-wise phases over all rows at once, the recurrence per sequence (continuing its state and keeping
    the snapshots its rollback window needs); returns y for all rows."""
    w, reduce = _local_output(w)
    feats = mixer.project(x, w, dims)
    o = None
    for s in batch.seqs:
        rows = slice(s.start, s.start + s.n)
        rs = s.state.layers[L]
        y, new, snaps = mixer.recur(
            tuple(f[rows] for f in feats), w, dims, rs.value, snapshot_last=rs.snapshots_needed(s.n)
        )
        if snaps:  # the last snapshot is the new state: keep one copy
            snaps[-1] = new
        rs.advance(new, snaps, s.n)
        if o is None:
            o = y.new_empty((x.shape[0],) + y.shape[1:])
        o[rows] = y
    if o is None:
        return x.new_zeros(x.shape)
    out = mixer.output(o, feats, w, dims)
    return out if reduce is None else reduce(out)


def _local_output(w):
    """Tensor parallelism: the mixer's row-parallel output projection (a weight with `local` and `group`,
    moesaic/parallel/comm.py) as its local piece, and the all-reduce that then sums the batch's rows once
    instead of once per sequence. Unchanged without one, or with an output bias (added after the sum)."""
    for f in dataclasses.fields(w):
        v = getattr(w, f.name)
        if hasattr(v, "local") and hasattr(v, "group") and getattr(w, f.name + "_bias", None) is None:
            return dataclasses.replace(w, **{f.name: v.local}), v.group.all_reduce
    return w, None
