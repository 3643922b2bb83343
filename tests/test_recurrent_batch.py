"""layers/recurrent.run_recurrent: a batch of sequences runs the mixers' row-wise projections once over all
rows (one weight read per step, not one per sequence), the recurrence once per group of sequences with the
same row count (folded into one sequence with more heads), and gives each sequence what running it alone
gives."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_kda_layer import HIDDEN, dims_for, hf_module, ours
from test_mamba2_layer import build as build_mamba2

from moesaic.cache.batch import SeqChunk
from moesaic.cache.state import RecurrentState
from moesaic.layers import kda, mamba2
from moesaic.layers.recurrent import run_recurrent

ROWS = [1, 4, 1, 3, 4]  # decode rows, verify blocks, a prompt chunk: three groups of row counts


def kda_case():
    module, _ = hf_module("kimi_linear")
    dims = dims_for("kimi_linear", chunk_size=16)
    return kda, kda.KDA, ours(module, dims), dims, kda.KdaState.zeros(dims), HIDDEN


def mamba2_case():
    _, _, w, dims = build_mamba2()
    return mamba2, mamba2.MAMBA2, w, dims, mamba2.Mamba2State.zeros(dims), dims.hidden_size


def counting(monkeypatch, module):
    calls = []
    real = module.linear
    monkeypatch.setattr(module, "linear", lambda x, w, *a: calls.append(x.shape[0]) or real(x, w, *a))
    return calls


@pytest.mark.parametrize("case", [kda_case, mamba2_case], ids=["kda", "mamba2"])
@torch.no_grad()
def test_a_batch_projects_once_and_equals_each_sequence_alone(case, monkeypatch):
    module, mixer, w, dims, zero, d = case()
    g = torch.Generator().manual_seed(3)
    # each sequence first gets a prompt of its own length, alone, so the batch continues different states
    states = []
    for i in range(len(ROWS)):
        _, s, _ = mixer.run(torch.randn(5 + 2 * i, d, generator=g), w, dims, zero)
        states.append(s)
    x = torch.randn(sum(ROWS), d, generator=g)
    starts = [sum(ROWS[:i]) for i in range(len(ROWS))]

    alone = [mixer.run(x[a : a + n], w, dims, s, min(n, 3)) for a, n, s in zip(starts, ROWS, states)]

    seqs = [
        SeqChunk(SimpleNamespace(layers={0: RecurrentState(s, window=3)}), a, n, 0)
        for a, n, s in zip(starts, ROWS, states)
    ]
    calls = counting(monkeypatch, module)
    recurs = []
    counted = dataclasses.replace(mixer, recur=lambda *a, **k: recurs.append(a[0]) or mixer.recur(*a, **k))
    y = run_recurrent(counted, w, dims, 0, x, SimpleNamespace(seqs=seqs))
    assert len(recurs) == len(set(ROWS))  # one recurrence per row count, the same-length sequences folded
    batched_calls = list(calls)
    calls.clear()
    run_recurrent(
        mixer,
        w,
        dims,
        0,
        x[:1],
        SimpleNamespace(
            seqs=[SeqChunk(SimpleNamespace(layers={0: RecurrentState(states[0], window=3)}), 0, 1, 0)]
        ),
    )

    # the projections ran once over every row: as many weight reads as for a single sequence
    assert len(batched_calls) == len(calls)
    assert all(n == x.shape[0] for n in batched_calls)
    for (y_alone, new, snaps), a, n, s in zip(alone, starts, ROWS, seqs):
        torch.testing.assert_close(y[a : a + n], y_alone, rtol=1e-5, atol=1e-5)
        rs = s.state.layers[0]
        for got, want in [(rs.value, new)] + list(zip(rs.history[-len(snaps) :], snaps)):
            for f in ("conv", "recurrent") if module is kda else ("conv", "ssm"):
                torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=1e-5, atol=1e-5)
        assert rs.can_rollback(min(n, 3))


@pytest.mark.parametrize("window", [0, 4])
@torch.no_grad()
def test_a_stepped_mixer_asks_only_the_snapshots_it_keeps(window, monkeypatch):
    """KDA on the CPU takes every row by the token recurrence, so a prompt's state has the same bits
    whatever the snapshots asked: a prompt asks only those its rollback window keeps (none without drafting;
    each is a [H, Dk, Dv] fp32 copy), and the state equals the one made asking the last STEPPED_ROWS rows.
    Mamba-2 (a chunked scan before its stepped rows) still asks them."""
    from moesaic.layers.recurrent import STEPPED_ROWS

    assert kda.KDA.stepped(torch.zeros(1))
    results = {}
    for stepped in (kda.KDA.stepped, None):
        module, mixer, w, dims, zero, d = kda_case()
        mixer = dataclasses.replace(mixer, stepped=stepped)
        asked = []
        counted = dataclasses.replace(
            mixer,
            recur=lambda *a, snapshot_last=0, asked=asked, m=mixer: (
                asked.append(snapshot_last) or m.recur(*a, snapshot_last)
            ),
        )
        x = torch.randn(24, d, generator=torch.Generator().manual_seed(5))
        state = RecurrentState(zero, window=window)
        kept = state.snapshots_needed(24)
        seq = SeqChunk(SimpleNamespace(layers={0: state}), 0, 24, 0)
        y = run_recurrent(counted, w, dims, 0, x, SimpleNamespace(seqs=[seq]))
        results[stepped is not None] = (asked, y, seq.state.layers[0])
    assert results[True][0] == [kept] and results[False][0] == [STEPPED_ROWS] and kept <= window + 1
    (_, y1, s1), (_, y0, s0) = results[True], results[False]
    assert torch.equal(y1, y0)
    assert torch.equal(s1.value.recurrent, s0.value.recurrent) and torch.equal(s1.value.conv, s0.value.conv)
    assert len(s1.history) == len(s0.history)
    for a, b in zip(s1.history, s0.history):
        assert torch.equal(a.recurrent, b.recurrent) and torch.equal(a.conv, b.conv)
    assert mamba2.MAMBA2.stepped is None
