"""The serving engine: paged state, preemption by recompute, parallel samples, stop strings, logprobs,
penalties, atomic steps, streams that are not read, threads, counters, and the engine-limit and API
inputs a user can get wrong (issue 13 items 1, 2, 4, 9)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import random_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moesaic
from moesaic.cache.batch import ForwardBatch
from moesaic.cache.paged import BLOCK_SIZE, BlockTable, PagedRows
from moesaic.engine.engine import EngineLimits
from moesaic.engine.output import Detokenizer
from moesaic.engine.sampler import SamplingParams, apply_penalties, sample_seed
from moesaic.engine.sequence import Sequence
from moesaic.errors import CapacityError, CheckpointError, ConfigError, MoesaicError, RequestError
from moesaic.tokenizer import ByteTokenizer

VOCAB = 259
POISON = 258  # random_ids(n, 258) never draws it


def greedy(n=8, **kw):
    return moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm():
    return moesaic.LLM("demo-mistral4", dtype="float32")


@pytest.fixture(scope="module")
def hybrid():
    return moesaic.LLM("demo-kimi-linear", dtype="float32")


# ---------------------------------------------------------------- paged state


def test_paged_state_equals_contiguous_state_with_rollback_and_snapshot(llm):
    model, blocks = llm.model, llm.engine.blocks
    ids = random_ids(150, VOCAB, seed=1)
    ref = model.new_state()
    want = torch.cat(
        [model.forward(ForwardBatch.build([(ref, c)], logits="all")) for c in (ids[:70], ids[70:])]
    )
    table = BlockTable()
    paged = llm.engine._new_state(table)
    assert sum(isinstance(x, PagedRows) for x in paged.layers) == llm.cfg.num_hidden_layers
    assert blocks.prepare(table, 0, 150) and len(table) == 3
    got = torch.cat(
        [model.forward(ForwardBatch.build([(paged, c)], logits="all")) for c in (ids[:70], ids[70:])]
    )
    assert torch.allclose(got, want, atol=1e-5)
    paged.rollback(30)  # forget 30 tokens, compute them again: the same logits
    again = model.forward(ForwardBatch.build([(paged, ids[120:])], logits="all"))
    assert torch.allclose(again, want[120:], atol=1e-5)
    snap = paged.snapshot()  # the paged part of a snapshot is its length: the pages are the table's
    assert snap[0] == 150 and all(s == 150 for s in snap[1])
    twin_table = blocks.fork(table)
    twin = llm.engine._new_state(twin_table)
    twin.restore(snap)
    assert blocks.prepare(twin_table, 150, 151)  # the shared last block is copied before the write
    assert twin_table.ids[:2] == table.ids[:2] and twin_table.ids[2] != table.ids[2]
    nxt = random_ids(1, VOCAB, seed=2)
    a = model.forward(ForwardBatch.build([(twin, nxt)]))
    assert blocks.prepare(table, 150, 151)
    b = model.forward(ForwardBatch.build([(paged, nxt)]))
    assert torch.equal(a, b)
    blocks.free_table(table)
    blocks.free_table(twin_table)
    assert blocks.num_used == 0


def test_atomic_step_restores_every_state_kind(hybrid):
    # mark / revert around forwards that change every kind of a hybrid state
    eng = hybrid.engine
    table = BlockTable()
    st_ = eng._new_state(table)
    ids = random_ids(90, VOCAB, seed=3)
    eng.blocks.prepare(table, 0, 90)
    hybrid.model.forward(ForwardBatch.build([(st_, ids[:40])]))
    mark = st_.mark()
    before = hybrid.model.forward(ForwardBatch.build([(st_, ids[40:])], logits="all"))
    st_.revert(mark)
    assert st_.num_tokens == 40
    after = hybrid.model.forward(ForwardBatch.build([(st_, ids[40:])], logits="all"))
    assert torch.equal(before, after)
    eng.blocks.free_table(table)


# ---------------------------------------------------------------- scheduling


@pytest.mark.parametrize("name", ["demo-mistral4", "demo-kimi-linear"])
def test_preemption_by_recompute_gives_the_solo_tokens(name):
    roomy = moesaic.LLM(name, dtype="float32", max_num_seqs=4)
    prompts = [random_ids(90 + 7 * i, VOCAB, seed=10 + i) for i in range(4)]
    # greedy, and one seeded sampler: its generator survives the preemption
    sp = [greedy(40)] * 3 + [moesaic.SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)]
    solo = [roomy.generate([p], s)[0].token_ids for p, s in zip(prompts, sp)]
    eng = roomy.engine
    block_cost = BLOCK_SIZE * (eng.pool.bytes_per_token + eng.rest_per_token)
    fixed = eng.state_bytes[1] * 4
    # 5 blocks: each request alone needs 3 (up to 150 tokens), all four at once 12
    tight = moesaic.LLM(name, dtype="float32", max_num_seqs=4, max_cache_bytes=fixed + 5 * block_cost)
    assert tight.engine.blocks.num_blocks == 5
    outs = tight.generate(prompts, sp)
    assert [o.token_ids for o in outs] == solo
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["blocks"]["used"] == 0
    with pytest.raises(CapacityError, match="cache blocks"):  # alone larger than the whole cache
        tight.generate([random_ids(300, VOCAB)], greedy(40))


def test_budget_and_seq_limits_are_respected():
    llm_ = moesaic.LLM("demo-mistral4", dtype="float32", max_num_seqs=2, max_num_batched_tokens=16)
    sched = llm_.engine.scheduler
    real, seen = sched.schedule, []

    def record():
        plan = real()
        seen.append((sum(n for _, n in plan), len(plan)))
        return plan

    sched.schedule = record
    outs = llm_.generate([random_ids(40, VOCAB, seed=s) for s in range(4)], greedy(5))
    assert all(len(o.token_ids) == 5 for o in outs)
    assert max(t for t, _ in seen) == 16 and max(k for _, k in seen) == 2 and min(k for _, k in seen) >= 1


def test_a_step_without_progress_raises_instead_of_spinning(monkeypatch):
    llm_ = moesaic.LLM("demo-mistral4", dtype="float32")
    monkeypatch.setattr(llm_.engine.scheduler, "schedule", lambda: [])  # a scheduler bug
    with pytest.raises(RuntimeError, match="nothing could be scheduled"):
        llm_.generate(["abc"], greedy(2))
    assert not llm_.engine.has_work()


def test_old_keyword_max_batch_tokens_is_an_alias():
    a = moesaic.LLM("demo-mistral4", dtype="float32", max_batch_tokens=13)
    assert a.engine.max_num_batched_tokens == 13
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        moesaic.LLM("demo-mistral4", dtype="float32", max_batch_tokens=13, max_num_batched_tokens=14)


# ---------------------------------------------------------------- requests


def test_parallel_samples_are_seeded_per_sample(llm):
    prompt = random_ids(20, VOCAB, seed=4)
    sp = moesaic.SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    again = llm.generate([prompt], sp)[0]
    samples = [o.token_ids for o in out.outputs]
    assert len(samples) == 4 and [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert samples == [o.token_ids for o in again.outputs]
    assert len({tuple(s) for s in samples}) > 1
    for i, s in enumerate(samples):
        alone = moesaic.SamplingParams(
            max_tokens=10, temperature=1.0, seed=sample_seed(1234, i), ignore_eos=True
        )
        assert llm.generate([prompt], alone)[0].token_ids == s
    assert sample_seed(2**64 - 1, 1) == 0 and out.usage["completion_tokens"] == 40
    assert llm.stats()["blocks"]["used"] == 0


def test_stop_strings_spanning_tokens(llm):
    prompt = random_ids(12, VOCAB, seed=5)
    base = llm.generate([prompt], greedy(30))[0]
    text = base.text
    at = next(
        i
        for i in range(4, len(text) - 3)
        if "\ufffd" not in text[i : i + 3] and text[i : i + 3] not in text[:i]
    )
    stop = text[at : at + 3]
    assert len(ByteTokenizer().encode(stop, add_bos=False)) >= 3  # spans at least 3 tokens
    out = llm.generate([prompt], greedy(30, stop=[stop, "\u2603never"]))[0]
    assert out.text == text[:at] and out.finish_reason == "stop" and out.stop_reason == stop
    assert base.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < 30
    # streamed text never shows the start of a stop string
    d = Detokenizer(ByteTokenizer(), ["lo w", "xyz"])
    shown = []
    for t in ByteTokenizer().encode("héllo wörld", add_bos=False):
        searched = len(d.text)
        d.feed(t)
        if d.find_stop(searched):
            break
        shown.append(d.visible(False))
    assert d.text == "hél" and all("lo w".startswith(s[len("hél") :]) or len(s) <= 3 for s in shown)
    assert all(len(s) <= len("hél") for s in shown)


def test_stop_needs_a_tokenizer_and_min_tokens_holds_eos(llm):
    prompt = random_ids(8, VOCAB, seed=6)
    base = llm.generate([prompt], greedy(12))[0].token_ids
    saved = llm.engine.eos_ids
    llm.engine.eos_ids = {base[1]}
    try:
        early = llm.generate([prompt], moesaic.SamplingParams(max_tokens=12, temperature=0.0))[0]
        assert early.token_ids == base[:2] and early.finish_reason == "stop" and early.stop_reason is None
        held = llm.generate([prompt], moesaic.SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5))[0]
        assert len(held.token_ids) >= 5 and base[1] not in held.token_ids[:5]
    finally:
        llm.engine.eos_ids = saved


def test_logprobs_equal_log_softmax_of_score(llm):
    prompt = random_ids(30, VOCAB, seed=7)
    out = llm.generate([prompt], greedy(6, logprobs=5))[0]
    ref = torch.log_softmax(llm.score(prompt + out.token_ids)[len(prompt) - 1 : -1], dim=-1)
    assert len(out.logprobs) == 6
    for row, lp, tok in zip(ref, out.logprobs, out.token_ids):
        values, ids = row.topk(5)
        assert set(ids.tolist()) | {tok} == set(lp)
        assert torch.allclose(torch.tensor([lp[i] for i in ids.tolist()]), values, atol=1e-4)
        assert abs(lp[tok] - row[tok].item()) < 1e-4 and tok == int(row.argmax())


def test_a_batch_of_greedy_samples_is_drawn_by_one_argmax(llm, monkeypatch):
    """A step whose every draw is plain greedy takes its tokens from one argmax over the rows (one host read,
    not one a sequence): the tokens of each prompt alone; a batch with a sample that asks for logprobs or has
    min_tokens left (EOS banned) draws row by row, with the same tokens."""
    from moesaic.engine.engine import Engine

    prompts = [random_ids(n, VOCAB, seed=40 + n) for n in (5, 17, 30)]
    alone = [llm.generate([p], greedy(6))[0].token_ids for p in prompts]
    drawn = []
    sample = Engine._sample
    monkeypatch.setattr(
        Engine, "_sample", lambda self, seq, row: drawn.append(seq.id) or sample(self, seq, row)
    )
    assert [o.token_ids for o in llm.generate(prompts, greedy(6))] == alone
    assert not drawn  # every step of the three took the batched argmax
    mixed = [greedy(6), greedy(6, logprobs=2), greedy(6)]
    assert [o.token_ids for o in llm.generate(prompts, mixed)] == alone
    assert len(drawn) == 18  # row by row: 3 sequences x 6 tokens
    drawn.clear()
    late = [greedy(6), greedy(6), moesaic.SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3)]
    assert [o.token_ids for o in llm.generate(prompts, late)] == alone
    assert len(drawn) == 3 * 3  # while EOS is banned for one; then the batched argmax


def test_penalties_follow_vllm():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    p = SamplingParams(repetition_penalty=2.0)
    got = apply_penalties(logits, p, prompt_ids=[0], output_ids=[1])
    assert got.tolist() == [1.0, -2.0, 0.5, 3.0, -2.0]  # seen: positive / 2, negative * 2
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, p, prompt_ids=[3], output_ids=[2, 2, 4])  # the prompt is not counted
    assert got.tolist() == [2.0, -1.0, 0.5 - 0.5 - 0.5, 3.0, -2.0 - 0.5 - 0.25]


def test_penalties_change_what_is_generated(llm):
    prompt = random_ids(10, VOCAB, seed=8)
    plain = llm.generate([prompt], greedy(24))[0].token_ids
    rep = llm.generate([prompt], greedy(24, frequency_penalty=2.0, presence_penalty=2.0))[0].token_ids
    assert len(set(rep)) >= len(set(plain))
    assert rep != plain or len(set(plain)) == 24


# ---------------------------------------------------------------- failures, threads, streams


MIXERS = {"demo-mistral4": "attention", "demo-kimi-linear": "mixer"}


@pytest.mark.parametrize("name", list(MIXERS))
def test_a_failing_layer_fails_only_its_request(name, monkeypatch):
    llm_ = moesaic.LLM(name, dtype="float32")
    good = random_ids(40, VOCAB, seed=9)
    want = llm_.generate([good], greedy(10))[0].token_ids
    real = getattr(llm_.model, MIXERS[name])
    shared_steps = []

    def mixer(L, *args, **kw):
        batch = args[2] if len(args) > 2 else kw["batch"]
        if L == 2 and bool((batch.token_ids == POISON).any()):  # after layers 0 and 1 changed every state
            shared_steps.append(len(batch.seqs))
            raise ValueError("poisoned layer")
        return real(L, *args, **kw)

    monkeypatch.setattr(llm_.model, MIXERS[name], mixer)
    eng = llm_.engine
    streaming = Sequence(good, greedy(10))
    eng.add(streaming)
    eng.step(), eng.step()
    bad = Sequence(random_ids(20, VOCAB, seed=10) + [POISON], greedy(4))
    eng.add(bad)
    while not streaming.finished:
        eng.step()
    assert streaming.output_ids == want and streaming.finish_reason == "length"
    assert bad.finish_reason == "error" and isinstance(bad.error, ValueError)
    assert shared_steps[0] == 2  # the failing forward held both
    assert llm_.stats()["requests"]["failed"] == 1 and llm_.stats()["blocks"]["used"] == 0
    with pytest.raises(ValueError, match="poisoned"):  # generate reports it
        llm_.generate([[5, POISON]], greedy(2))


@pytest.mark.parametrize("batched", [False, True])
def test_an_interrupt_between_forward_and_sampling_keeps_nothing_of_the_step(llm, monkeypatch, batched):
    # Ctrl-C after the forward, before every sequence has its token (drawn row by row: in the second one's
    # sample; batched greedy draws: in their one argmax): no state is left advanced
    a, b = random_ids(30, VOCAB, seed=13), random_ids(50, VOCAB, seed=14)
    params = greedy(6) if batched else greedy(6, logprobs=1)  # logprobs: drawn row by row
    want = [o.token_ids for o in llm.generate([a, b], params)]
    eng = llm.engine
    seqs = [Sequence(a, params), Sequence(b, params)]
    for s in seqs:
        eng.add(s)
    eng.step(), eng.step()
    from moesaic.engine import engine as engine_module

    real, calls = engine_module.sample, []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 2 or batched:
            raise KeyboardInterrupt
        return real(*args, **kw)

    if batched:
        monkeypatch.setattr(engine_module.Engine, "_greedy_rows", lambda self, draws: interrupted())
    else:
        monkeypatch.setattr(engine_module, "sample", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert calls
    monkeypatch.undo()
    while not all(s.finished for s in seqs):
        eng.step()
    assert [s.output_ids for s in seqs] == want


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_logits_mid_decode_end_only_that_request(llm, monkeypatch, bad_value):
    # a model that overflows for one request after two decode steps: that request ends with a
    # RequestError, the other request in the same forward goes on with its own tokens
    good, other = random_ids(30, VOCAB, seed=40), random_ids(25, VOCAB, seed=41)
    want = llm.generate([good], greedy(8))[0].token_ids
    eng = llm.engine
    a, b = Sequence(good, greedy(8)), Sequence(other, greedy(8))
    real, shared = llm.model.forward, []

    def forward(batch):
        logits = real(batch)
        for i, chunk in enumerate(batch.seqs):
            if chunk.state is b.state and len(b.output_ids) >= 2:
                shared.append(len(batch.seqs))
                logits = logits.clone()
                logits[i, 7] = bad_value
        return logits

    monkeypatch.setattr(llm.model, "forward", forward)
    failed = llm.stats()["requests"]["failed"]
    eng.add(a), eng.add(b)
    while not a.finished:
        eng.step()
    assert a.output_ids == want and a.finish_reason == "length"
    assert b.finish_reason == "error" and isinstance(b.error, RequestError)
    assert "non-finite logits" in str(b.error) and len(b.output_ids) == 2
    assert shared[0] == 2  # the forward that overflowed held both requests
    assert llm.stats()["requests"]["failed"] == failed + 1 and llm.stats()["blocks"]["used"] == 0
    monkeypatch.setattr(llm.model, "forward", lambda batch: real(batch) * bad_value)
    with pytest.raises(RequestError, match="non-finite"):  # through generate: that request's error
        llm.generate([other], greedy(3))
    assert not eng.has_work()


def test_the_non_finite_check_is_exact_where_a_row_sum_overflows():
    from moesaic.engine.engine import non_finite

    seqs = [(Sequence([1], greedy()), 1) for _ in range(3)]
    big = torch.full((3, 4), 3e38)  # every row sums to inf, every element finite
    assert non_finite(seqs, big) == {}
    big[1, 2] = float("nan")
    assert list(non_finite(seqs, big)) == [seqs[1][0].id]
    assert non_finite(seqs, torch.zeros(3, 4)) == {}


def test_without_snapshot_room_a_hybrid_computes_everything(hybrid):
    tight = moesaic.LLM("demo-kimi-linear", dtype="float32", max_snapshot_bytes=0)
    prompts = [
        random_ids(4 * BLOCK_SIZE + 9, VOCAB, seed=15)[:-5] + random_ids(5, VOCAB, seed=16 + i)
        for i in range(2)
    ]
    outs = [tight.generate([p], greedy(4))[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.token_ids for o in outs] == [o.token_ids for o in hybrid.generate(prompts, greedy(4))]
    assert tight.stats()["snapshot_bytes"] == 0


def test_an_unread_stream_does_not_hold_the_engine():
    llm_ = moesaic.LLM("demo-mistral4", dtype="float32", max_num_seqs=1)
    long_prompt = random_ids(10, VOCAB, seed=11)
    want = llm_.generate([long_prompt], greedy(120))[0].token_ids
    it = llm_.stream(long_prompt, greedy(120))
    got = [next(it)]
    steps = llm_.stats()["step_time_s"]["count"]
    quick = llm_.generate([random_ids(5, VOCAB, seed=12)], greedy(2))[0]
    assert len(quick.token_ids) == 2
    assert llm_.stats()["step_time_s"]["count"] - steps <= 3  # not the stream's 119 steps
    assert len(it.seq.output_ids) == 1  # the stream was paused, then preempted
    got += list(it)  # reading it again recomputes and continues
    assert got == want
    it2 = llm_.stream(long_prompt, greedy(120))
    next(it2)
    del it2  # dropped: aborted
    assert llm_.stats()["requests"]["running"] == 0 and llm_.stats()["blocks"]["used"] == 0


def test_two_threads_calling_generate_get_their_own_outputs(llm):
    prompts = [random_ids(12 + i, VOCAB, seed=20 + i) for i in range(6)]
    want = {i: llm.generate([p], greedy(6))[0].token_ids for i, p in enumerate(prompts)}
    got, errors = {}, []

    def worker(ks):
        try:
            for k in ks:
                got[k] = llm.generate([prompts[k]], greedy(6))[0].token_ids
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(ks,)) for ks in ([0, 2, 4], [1, 3, 5])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want


def test_stats_count_the_work(llm):
    before = llm.stats()
    llm.generate([random_ids(70, VOCAB, seed=30), random_ids(5, VOCAB, seed=31)], greedy(3))
    after = llm.stats()
    assert after["prompt_tokens"] - before["prompt_tokens"] == 75
    assert after["generated_tokens"] - before["generated_tokens"] == 6
    assert after["requests"]["finished"] - before["requests"]["finished"] == 2
    assert after["blocks"]["used"] == 0 and after["blocks"]["free"] == after["blocks"]["total"]
    assert (
        after["step_time_s"]["count"] > before["step_time_s"]["count"]
        and after["tokens_per_step"]["last"] >= 1
    )
    for key in ("cached_prompt_tokens", "prefix_hit_rate", "preemptions", "snapshot_bytes"):
        assert key in after


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("n", "2"),
        ("n", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -3),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("stop", [1, 2]),
        ("stop", ["ok", None]),
        ("stop", [""]),
        ("stop", 5),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
        ("min_tokens", 20),
        ("min_tokens", -1),
        ("seed", 2**64),
        ("seed", -1),
        ("seed", 1.0),
    ],
)
def test_bad_sampling_values_name_the_field(llm, field, value):
    with pytest.raises(RequestError, match=field):
        llm.generate(["abc"], moesaic.SamplingParams(max_tokens=8, **{field: value}))
    assert not llm.engine.has_work()


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-3, 300), st.text(max_size=3), st.none()), max_size=3),
)
FIELDS = [
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "n", "stop",
    "logprobs", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(FIELDS), value=VALUES)
def test_any_sampling_value_is_accepted_or_named(field, value):
    try:
        SamplingParams(**{field: value}).validate()
    except RequestError as e:
        assert field in str(e)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_seqs=-1), "max_num_seqs"),
        (dict(max_num_seqs="4"), "max_num_seqs"),
        (dict(max_num_seqs=True), "max_num_seqs"),
        (dict(max_batch_tokens=0), "max_num_batched_tokens"),
        (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"),
        (dict(max_cache_bytes="1e9"), "max_cache_bytes"),
        (dict(max_cache_bytes=1e9), "max_cache_bytes"),
        (dict(max_cache_bytes=10), "max_cache_bytes"),
        (dict(max_state_bytes="1e9"), "max_state_bytes"),
        (dict(max_snapshot_bytes=-1), "max_snapshot_bytes"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(precision=123), "precision"),
    ],
)
def test_bad_engine_limits_are_config_errors(kw, field):
    with pytest.raises(ConfigError, match=field):
        moesaic.LLM("demo-mistral4", **{"dtype": "float32", **kw})


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(
        ["max_num_seqs", "max_num_batched_tokens", "max_cache_bytes", "max_state_bytes", "max_snapshot_bytes"]
    ),
    value=VALUES,
)
def test_any_engine_limit_is_accepted_or_named(field, value):
    try:
        EngineLimits(**{field: value}).validate()
    except ConfigError as e:
        assert field in str(e)


@pytest.mark.parametrize(
    "model,kind", [(None, ConfigError), (123, ConfigError), ("", CheckpointError), ("  ", CheckpointError)]
)
def test_bad_model_arguments(model, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" must not open the current folder
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(kind, match="model"):
        moesaic.LLM(model, dtype="float32")


def test_prompt_and_params_shapes(llm):
    sp = greedy(3)
    want = [o.token_ids for o in llm.generate(["ab", "cd"], sp)]
    assert [o.token_ids for o in llm.generate((p for p in ["ab", "cd"]), sp)] == want  # a generator
    assert [o.token_ids for o in llm.generate(("ab", "cd"), (sp, sp))] == want  # tuples
    as_dict = dict(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(["ab", "cd"], as_dict)] == want
    cases = [
        (lambda: llm.generate(None, sp), "None"),
        (lambda: llm.generate({"ab": 1}, sp), "dict"),
        (lambda: llm.generate({"ab"}, sp), "set"),
        (lambda: llm.generate(b"ab", sp), "bytes"),
        (lambda: llm.generate(["ab", None], sp), "NoneType"),
        (lambda: llm.generate([[1, 2.5]], sp), "item 1"),
        (lambda: llm.generate(["a\ud800b"], sp), "surrogate"),
        (lambda: llm.generate(["ab"], dict(max_tokens=3, colour=1)), "colour"),
        (lambda: llm.generate(["ab"], (1, 2)), "params"),
        (lambda: llm.generate(["ab"], "greedy"), "params"),
        (lambda: llm.score(None), "None"),
        (lambda: llm.score(123), "int"),
        (lambda: llm.stream("ab", moesaic.SamplingParams(n=2)), "n must be 1"),
    ]
    for call, words in cases:
        with pytest.raises(RequestError, match=words):
            call()
    assert torch.equal(llm.score("ab"), llm.score(llm.encode("ab")))
    assert not llm.engine.has_work()


PROMPTS = st.recursive(
    st.one_of(
        st.none(),
        st.integers(-5, 300),
        st.floats(allow_nan=True),
        st.text(max_size=6),
        st.binary(max_size=3),
        st.booleans(),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner), st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=6,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPTS)
def test_any_prompt_shape_generates_or_is_a_moesaic_error(llm, prompt):
    try:
        outs = llm.generate(prompt, greedy(1))
    except MoesaicError:
        pass
    else:
        assert all(len(o.token_ids) == 1 for o in outs)
    assert not llm.engine.has_work()
