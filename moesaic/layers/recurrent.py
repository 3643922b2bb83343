"""Running a recurrent mixer (KDA, Mamba-2) over a batch: one sequence at a time on its own rows,
continuing that sequence's RecurrentState and keeping the snapshots its rollback window needs."""

from __future__ import annotations

import dataclasses

import torch


def run_recurrent(mixer, w, dims, L: int, x: torch.Tensor, batch) -> torch.Tensor:
    """`mixer(x_rows, w, dims, state, snapshot_last=k)` -> (y, new state, snapshots) on each sequence
    of `batch` (a ForwardBatch), whose layer-L state is a RecurrentState; returns y for all rows."""
    w, reduce = _local_output(w)
    out = torch.empty_like(x)
    for s in batch.seqs:
        rows = slice(s.start, s.start + s.n)
        rs = s.state.layers[L]
        y, new, snaps = mixer(x[rows], w, dims, rs.value, snapshot_last=rs.snapshots_needed(s.n))
        if snaps:  # the last snapshot is the new state: keep one copy
            snaps[-1] = new
        rs.advance(new, snaps, s.n)
        out[rows] = y
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
