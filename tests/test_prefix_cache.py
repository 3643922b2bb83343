"""The hybrid prefix cache on every family's demo: a request that shares a prefix with an earlier one (or
a chat turn that extends the previous turn) is served partly from the cache and gives exactly the tokens
it gives with the cache off; the snapshot boundaries; short prompts; no blocks leak."""

from __future__ import annotations

import pytest
from helpers import random_ids

import moesaic
from moesaic.cache.paged import BLOCK_SIZE
from moesaic.engine.scheduler import SNAPSHOT_EVERY

FAMILY_DEMOS = [
    "demo-mistral4",
    "demo-nemotron-h",
    "demo-glm5-next-nvfp4",
    "demo-deepseek-v4",
    "demo-deepseek-v41",
    "demo-kimi-linear",
    "demo-kimi-k3",
]
GREEDY = moesaic.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
VOCAB = 259  # every demo's (the byte tokenizer's)


@pytest.fixture(scope="module", params=FAMILY_DEMOS)
def pair(request):
    """(cache on, cache off) LLMs of one demo."""
    name = request.param
    return (
        moesaic.LLM(name, dtype="float32"),
        moesaic.LLM(name, dtype="float32", enable_prefix_caching=False),
    )


def test_shared_prefix_ending_mid_block_hits_and_matches(pair):
    on, off = pair
    on.engine.reset_prefix_cache()
    shared = random_ids(5 * BLOCK_SIZE + 20, VOCAB, seed=11)  # several blocks, ending mid-block
    first = shared + random_ids(50, VOCAB, seed=12)  # its last full block lies past the shared part
    second = shared + random_ids(23, VOCAB, seed=13)
    a = on.generate([first], GREEDY)[0]
    assert a.num_cached_tokens == 0
    b = on.generate([second], GREEDY)[0]
    # the deepest boundary inside the shared part with a snapshot (every 4th block) or, paged-only, 5 blocks
    want = 5 * BLOCK_SIZE if not on.engine.hybrid else SNAPSHOT_EVERY * BLOCK_SIZE
    assert b.num_cached_tokens == want
    assert b.token_ids == off.generate([second], GREEDY)[0].token_ids
    assert a.token_ids == off.generate([first], GREEDY)[0].token_ids
    stats = on.stats()
    assert stats["cached_prompt_tokens"] >= want and stats["blocks"]["used"] == 0


def test_short_shared_prefix_hits_from_the_third_request(pair):
    # a prefix of 3 blocks + 10 tokens, and unique tails long enough that each prompt's own snapshots (every
    # 4th block, its last full block) fall in its tail: the second request's match with the index ends at
    # block 3, so it snapshots there and the third hits (hybrid); paged-only hits at once
    on, off = pair
    on.engine.reset_prefix_cache()
    shared = random_ids(3 * BLOCK_SIZE + 10, VOCAB, seed=21)
    prompts = [shared + random_ids(60 + 10 * i, VOCAB, seed=22 + i) for i in range(3)]
    outs = [on.generate([p], GREEDY)[0] for p in prompts]
    cached = [o.num_cached_tokens for o in outs]
    assert cached == ([0, 0, 3 * BLOCK_SIZE] if on.engine.hybrid else [0, 3 * BLOCK_SIZE, 3 * BLOCK_SIZE])
    assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, GREEDY)]


def test_multi_turn_chat_reuses_the_previous_turn(pair):
    on, off = pair
    on.engine.reset_prefix_cache()
    turn1 = random_ids(2 * BLOCK_SIZE + 50, VOCAB, seed=31)
    sp = moesaic.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out1 = on.generate([turn1], sp)[0]
    assert out1.token_ids == off.generate([turn1], sp)[0].token_ids
    turn2 = turn1 + out1.token_ids + random_ids(25, VOCAB, seed=32)
    out2 = on.generate([turn2], GREEDY)[0]
    # turn 1's state crossed the boundary at 3 blocks while decoding (prompt 178 + 15 computed tokens)
    assert out2.num_cached_tokens == 3 * BLOCK_SIZE
    assert out2.token_ids == off.generate([turn2], GREEDY)[0].token_ids


def test_repeated_and_block_aligned_prompts(pair):
    on, off = pair
    on.engine.reset_prefix_cache()
    short = random_ids(BLOCK_SIZE - 7, VOCAB, seed=41)  # shorter than a block: no hit, no error
    outs = [on.generate([short], GREEDY)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0] and outs[0].token_ids == outs[1].token_ids
    aligned = random_ids(2 * BLOCK_SIZE, VOCAB, seed=42)  # all cached: the last token is still computed
    outs = [on.generate([aligned], GREEDY)[0] for _ in range(2)]
    assert outs[1].num_cached_tokens == BLOCK_SIZE
    assert outs[0].token_ids == outs[1].token_ids == off.generate([aligned], GREEDY)[0].token_ids


def test_concurrent_requests_sharing_a_prefix(pair):
    # prompts that share a prefix in one generate call, chunked by a small budget; a second call hits
    on, off = pair
    on.engine.reset_prefix_cache()
    shared = random_ids(4 * BLOCK_SIZE + 3, VOCAB, seed=51)
    prompts = [shared + random_ids(5, VOCAB, seed=52 + i) for i in range(3)]
    first = on.generate(prompts, GREEDY)
    again = on.generate(prompts, GREEDY)
    want = [o.token_ids for o in off.generate(prompts, GREEDY)]
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == want
    assert all(o.num_cached_tokens == 4 * BLOCK_SIZE for o in again)
    assert on.stats()["blocks"]["used"] == 0


def _tail_rows(keep: int, need: int):
    import torch

    from moesaic.cache.state import TailRows

    return TailRows({"a": 3, "b": 2}, torch.float32, "cpu", keep, need)


@pytest.mark.parametrize(
    "keep,need,before,n", [(5, 3, 0, 9), (5, 3, 2, 4), (8, 8, 11, 30), (4, 1, 3, 2), (6, 4, 20, 7)]
)
def test_tail_rows_snapshot_inside_an_append_equals_a_stop_there(keep, need, before, n):
    """TailRows' snapshot at a wanted token inside an append (in place or through a fresh buffer) restores to
    what a TailRows that stopped at that token holds: the same length, rows and later appends; the rows after
    it written in place leave the snapshot's alone."""
    import torch

    g = torch.Generator().manual_seed(keep * 100 + before + n)
    rows = {
        "a": torch.randn(before + n + 5, 3, generator=g),
        "b": torch.randn(before + n + 5, 2, generator=g),
    }

    def part(a, b):
        return {k: v[a:b] for k, v in rows.items()}

    whole = _tail_rows(keep, need)
    if before:
        whole.append(**part(0, before))
    points = list(range(before + 1, before + n))
    whole.want(points)
    whole.append(**part(before, before + n))
    snaps = {t: whole.snapshot_at(t) for t in points}
    whole.append(**part(before + n, before + n + 5))  # later rows: never over the snapshots'
    for t in points:
        stopped, got = _tail_rows(keep, need), _tail_rows(keep, need)
        for a, b in ((0, before), (before, t)):
            if b > a:
                stopped.append(**part(a, b))
        got.restore(snaps[t])
        assert got.length == stopped.length == t and got.held == stopped.held
        assert all(torch.equal(got.rows()[k], stopped.rows()[k]) for k in rows), t
        assert all(
            torch.equal(x, y)
            for x, y in zip(got.append(**part(t, t + 2)).values(), stopped.append(**part(t, t + 2)).values())
        )
    with pytest.raises(ValueError, match="nothing kept"):
        whole.snapshot_at(before + n + 2)


def _leaves(snap):
    """The tensors and numbers of a snapshot, in order (dicts by key)."""
    import torch

    if isinstance(snap, torch.Tensor):
        return [snap]
    if isinstance(snap, dict):
        return [x for k in sorted(snap) for x in _leaves(snap[k])]
    if isinstance(snap, (list, tuple)):
        return [x for s in snap for x in _leaves(s)]
    if hasattr(snap, "__dict__"):  # a recurrent state value (KDA / Mamba-2): its tensors
        return [x for k in sorted(vars(snap)) for x in _leaves(vars(snap)[k])]
    return [snap]


def _held(snap):
    """A snapshot's rows as a restored state would hold them: TailRows' (length, start, held, bufs) and
    TokenRows' (length, bufs) cut to what they hold, so that buffer capacity and offsets do not count."""
    if isinstance(snap, tuple) and len(snap) == 4 and isinstance(snap[3], dict):
        length, start, held, bufs = snap
        return (length, held, {k: b[start : start + held] for k, b in bufs.items()})
    if isinstance(snap, tuple) and len(snap) == 2 and isinstance(snap[1], dict):
        return (snap[0], {k: b[: snap[0]] for k, b in snap[1].items()})
    if isinstance(snap, (list, tuple)):
        return type(snap)(_held(s) for s in snap)
    return snap


@pytest.mark.parametrize(
    "name",
    ["demo-nemotron-h", "demo-glm5-next-nvfp4", "demo-deepseek-v4", "demo-deepseek-v41", "demo-kimi-linear"],
)
def test_snapshot_inside_a_prompt_equals_a_stop_there(name, monkeypatch):
    """A hybrid prompt runs as one forward past its snapshot boundaries (scheduler `inside`), and the snapshot
    taken inside it equals the one a prompt cut at that boundary takes (to fp32 rounding of the row-wise
    products at another row count): every recurrent state, window and compressor row."""
    import torch

    prompt = random_ids(3 * BLOCK_SIZE + 30, VOCAB, seed=61)  # its last full block, 192, inside the prompt
    snaps, forwards = {}, {}
    for inside in (True, False):
        llm = moesaic.LLM(name, dtype="float32")
        assert llm.engine.scheduler.inside
        llm.engine.scheduler.inside = inside
        calls = []
        forward = llm.engine.model.forward
        monkeypatch.setattr(llm.engine.model, "forward", lambda b, f=forward, c=calls: c.append(1) or f(b))
        llm.generate([prompt], moesaic.SamplingParams(max_tokens=1, temperature=0.0))
        store = llm.engine.snapshots.entries
        assert len(store) == 1
        snaps[inside] = _leaves(_held(next(iter(store.values()))[0]))
        forwards[inside] = len(calls)
        monkeypatch.undo()
    assert forwards == {True: 1, False: 2}
    assert len(snaps[True]) == len(snaps[False])
    for a, b in zip(snaps[True], snaps[False]):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5), name
        else:
            assert a == b, name
    assert snaps[True][0] == 3 * BLOCK_SIZE


def test_two_snapshot_boundaries_inside_one_forward(pair):
    """A prompt whose one forward passes two snapshot boundaries (every SNAPSHOT_EVERY-th block, and its last full
    block) keeps both snapshots: requests sharing either prefix start there and give the cache-off tokens."""
    on, off = pair
    if not on.engine.hybrid:
        pytest.skip("paged state only: no snapshots")
    on.engine.reset_prefix_cache()
    every = SNAPSHOT_EVERY * BLOCK_SIZE
    first = random_ids(
        every + BLOCK_SIZE + 20, VOCAB, seed=71
    )  # boundaries every and every + BLOCK_SIZE inside
    assert on.generate([first], GREEDY)[0].num_cached_tokens == 0
    assert len(on.engine.snapshots.entries) == 2
    prompts = [
        first[: every + 5] + random_ids(30, VOCAB, seed=72),
        first[: every + BLOCK_SIZE + 3] + [7, 8, 9],
    ]
    outs = [on.generate([p], GREEDY)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [every, every + BLOCK_SIZE]
    assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, GREEDY)]
