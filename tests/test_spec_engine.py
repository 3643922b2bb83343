"""Speculative decoding in the engine (issue 15 items 1-5): drafting never changes what is generated.

Greedy with n-gram drafting equals plain greedy on every family's demo, for sequences of different lengths
drafting together while others prefill or decode in the same forward; forced-acceptance and forced-rejection
drafters give the plain tokens and roll back every state kind; the acceptance step's exact output
distribution (enumerated) is the target's; seeded sampling with a deterministic drafter equals plain seeded
sampling token for token; the prefix cache with drafting on a hybrid equals no cache, no drafting; the
DFlash drafter's logits equal an in-test reference of its formula; penalties, logprobs, stops, min_tokens,
max_tokens and n stay exact; the adaptive policy; bad speculative configs are ConfigErrors naming the field.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections import defaultdict

import pytest
import torch
from helpers import demo_model, drafter_reference, drafting_prompts, random_ids, run, write_drafter

import moesaic
from moesaic.cache.batch import ForwardBatch
from moesaic.cache.paged import BLOCK_SIZE
from moesaic.cache.state import SequenceState
from moesaic.errors import ConfigError
from moesaic.layers.recurrent import STEPPED_ROWS
from moesaic.spec import MAX_SPECULATIVE_TOKENS, adaptive
from moesaic.spec.adaptive import Acceptance, DraftGate, DraftLength
from moesaic.spec.base import Draft
from moesaic.spec.forced import ForcedProposer
from moesaic.spec.verify import accept_greedy, accept_sampled, inverse_cdf

FAMILIES = [
    "demo-mistral4",
    "demo-nemotron-h",
    "demo-glm5-next-nvfp4",
    "demo-deepseek-v4",
    "demo-deepseek-v41",
    "demo-kimi-linear",
    "demo-kimi-k3",
]
VOCAB = 258  # the demos' byte vocabulary is 259; random_ids(n, 258) stays below it


def greedy(n, **kw):
    return moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def prompts() -> list[list[int]]:
    return drafting_prompts(VOCAB, long=100)


_plain: dict = {}


def plain(name: str, ps, sp, **kw):
    """Plain decoding's outputs (cached per model and request set)."""
    key = (name, json.dumps(ps), repr(sp), json.dumps(kw, sort_keys=True))
    if key not in _plain:
        llm = moesaic.LLM(name, dtype="float32", **kw)
        _plain[key] = llm.generate(ps, sp)
    return _plain[key]


def spec_llm(name, method_or_proposer, k, **kw):
    if isinstance(method_or_proposer, str):
        config = {"method": method_or_proposer, "num_speculative_tokens": k, "adaptive": False}
    else:
        config = {"proposer": method_or_proposer, "num_speculative_tokens": k, "adaptive": False}
    config.update(kw.pop("spec", {}))
    return moesaic.LLM(name, dtype="float32", speculative_config=config, **kw)


def record_forwards(llm, monkeypatch) -> list[set]:
    """What each of the engine's forwards held: 'verify', 'decode' and / or 'prefill' rows."""
    eng, kinds = llm.engine, []
    forward = eng._forward

    def spy(items):
        kinds.append(
            {
                "verify" if n > s.num_pending else "prefill" if s.num_pending > 1 else "decode"
                for s, n in items
            }
        )
        return forward(items)

    monkeypatch.setattr(eng, "_forward", spy)
    return kinds


def record_rollbacks(monkeypatch) -> list[tuple[int, set]]:
    """Every SequenceState.rollback(n > 0): (n, the state kinds it rolled back)."""
    calls = []
    rollback = SequenceState.rollback

    def spy(self, n):
        if n:
            calls.append((n, {type(layer).__name__ for layer in self.layers if layer is not None}))
        return rollback(self, n)

    monkeypatch.setattr(SequenceState, "rollback", spy)
    return calls


# ---------------------------------------------------------------- greedy equality on every family


@pytest.mark.parametrize("name", FAMILIES)
def test_ngram_greedy_equals_plain_on_every_family(name, monkeypatch):
    ps, sp = prompts(), greedy(16)
    want = plain(name, ps, sp, max_num_batched_tokens=24)
    llm = spec_llm(name, "ngram", 3, max_num_batched_tokens=24, spec={"prompt_lookup_min": 1})
    # every sequence drafts as a served request would (generate's in-step drafting would hold back those
    # that decode while another prefills): verify rows then share forwards with prompt chunks
    monkeypatch.setattr(llm.engine, "whole_batch", contextlib.nullcontext)
    kinds = record_forwards(llm, monkeypatch)
    got = llm.generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = llm.stats()["speculative"]
    assert s["rounds"] > 0 and s["drafted"] > 0 and s["rolled_back_rows"] > 0
    assert any({"verify", "prefill"} <= k for k in kinds)  # drafts verified next to a prompt chunk
    assert llm.stats()["blocks"]["used"] == 0


@pytest.mark.parametrize(
    "name, method",
    [
        ("demo-glm5-next-nvfp4", "mtp"),
        ("demo-deepseek-v4", "mtp"),
        ("demo-nemotron-h", "mtp"),
        ("demo-deepseek-v41", "dspark"),
    ],
)
def test_the_models_own_heads_greedy_equals_plain(name, method, monkeypatch):
    """The demos' (random) MTP / DSpark heads through the engine: drafts mostly rejected, rolled back,
    and the tokens are plain decoding's, with prompts prefilling next to verify rounds and n = 2."""
    ps, sp = prompts(), greedy(12)
    want = plain(name, ps, sp, max_num_batched_tokens=24)
    llm = spec_llm(name, method, 3, max_num_batched_tokens=24)
    kinds = record_forwards(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [o.token_ids for o in want]
    s = llm.stats()["speculative"]
    assert s["method"] == method and s["drafted"] > 0 and s["rolled_back_rows"] > 0
    assert any({"verify", "prefill"} <= k for k in kinds)
    two = moesaic.SamplingParams(max_tokens=8, temperature=1.0, seed=2, n=2, ignore_eos=True)
    assert [c.token_ids for c in llm.generate(ps[:1], two)[0].outputs] == [
        c.token_ids for c in plain(name, ps[:1], two)[0].outputs
    ]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("mode", ["accept", "reject", "mixed"])
def test_forced_drafters_give_plain_tokens_and_roll_back_every_state_kind(name, mode, monkeypatch):
    ps, sp, k = prompts()[:3], greedy(16), 4
    want = plain(name, ps, sp)
    accept = {"accept": None, "reject": 0, "mixed": lambda r: r % (k + 1)}[mode]
    proposer = ForcedProposer([o.prompt_token_ids + o.token_ids for o in want], VOCAB + 1, accept)
    llm = spec_llm(name, proposer, k)
    calls = record_rollbacks(monkeypatch)
    got = llm.generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = llm.stats()["speculative"]
    assert s["drafted"] > 0
    kinds = {type(x).__name__ for x in llm.model.new_state(rollback_window=k + 1).layers if x is not None}
    if mode == "accept":
        assert s["accepted"] == s["drafted"] and s["tau"] > 3
        assert s["rolled_back_rows"] == 0
    else:
        assert s["rollbacks"] > 0 and s["accepted"] < s["drafted"]
        rolled = set().union(*(kinds_ for _, kinds_ in calls))
        paged = {"PagedRows"} if "TokenRows" in kinds else set()
        assert rolled == (kinds - {"TokenRows"}) | paged  # every kind (paged rows live in the pool)
        depths = {n for n, _ in calls}
        if mode == "reject":
            assert s["accepted"] == 0 and k in depths
        else:
            assert {1, 2, 3, k} <= depths  # every rollback depth


# ---------------------------------------------------------------- the acceptance step, enumerated


def _probs(key, V, sharp=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(key) % 2**31)
    p = torch.softmax(sharp * torch.randn(V, generator=g, dtype=torch.float64), -1)
    if len(key) % 2:  # some distributions with exact zeros (top-k / top-p make those)
        p[int(torch.argmin(p))] = 0
        p = p / p.sum()
    return p


def _intervals(cuts) -> list[tuple[float, float]]:
    """(midpoint, length) of the pieces [0, 1) is cut into."""
    pts = sorted({0.0, 1.0, *[float(c) for c in cuts if 0 < c < 1]})
    return [((a + b) / 2, b - a) for a, b in zip(pts, pts[1:]) if b > a]


def enumerate_round(run, cuts) -> dict[tuple, float]:
    """The exact distribution of `run(uniform)`'s result, every branch of its uniforms enumerated:
    `cuts(i, slot)` are the thresholds uniform (i, slot) is compared against (a superset is fine)."""
    out: dict[tuple, float] = defaultdict(float)

    class More(Exception):
        pass

    def go(answers, weight):
        asked = []

        def uniform(i, slot):
            asked.append((i, slot))
            if len(asked) <= len(answers):
                return answers[len(asked) - 1]
            raise More(i, slot)

        try:
            res = run(uniform)
        except More as e:
            for mid, w in _intervals(cuts(*e.args)):
                go(answers + [mid], weight * w)
            return
        out[tuple(res)] += weight

    go([], 1.0)
    return out


def round_law(accept, drafts, rows, qs) -> dict[tuple, float]:
    """The exact law of the tokens one verify round commits, for fixed drafts."""
    k = len(drafts)

    def cuts(i, slot):
        if slot == 0:
            return [float(rows[i][drafts[i]] / qs[i][drafts[i]])]
        res = (rows[i] - (qs[i] if qs is not None and i < k else 0)).clamp(min=0)
        out = rows[i].cumsum(0).tolist()
        return out + (res.cumsum(0) / res.sum()).tolist() if res.sum() > 0 else out

    return enumerate_round(lambda u: accept(lambda i: rows[i], list(drafts), qs, u), cuts)


def check_lossless(accept, V=3, k=2, deterministic=False):
    """The law of the first k + 1 tokens (a verify round, then plain sampling for what it did not commit)
    equals the target's law of k + 1 tokens, exactly. Returns the largest difference."""

    def p(prefix):  # the target's distribution after `prefix`
        return _probs(("p", *prefix), V)

    def q(prefix):  # the drafter's
        return _probs(("q", *prefix), V, 2.0)

    law: dict[tuple, float] = defaultdict(float)
    if deterministic:  # the drafter's argmax, a one-hot q
        drafts = [int(q(()).argmax())]
        for _ in range(k - 1):
            drafts.append(int(q(tuple(drafts)).argmax()))
        draft_sets = [(tuple(drafts), 1.0)]
    else:
        draft_sets = []
        for drafts in itertools.product(range(V), repeat=k):
            w = 1.0
            for i, d in enumerate(drafts):
                w *= float(q(drafts[:i])[d])
            draft_sets.append((drafts, w))
    for drafts, w in draft_sets:
        rows = [p(drafts[:i]) for i in range(k + 1)]
        qs = None if deterministic else torch.stack([q(drafts[:i]) for i in range(k)])
        for out, wo in round_law(accept, drafts, rows, qs).items():
            for tail in itertools.product(range(V), repeat=k + 1 - len(out)):  # plain sampling after it
                seq, pr = list(out), w * wo
                for t in tail:
                    pr *= float(p(tuple(seq))[t])
                    seq.append(t)
                law[tuple(seq)] += pr
    target = {}
    for seq in itertools.product(range(V), repeat=k + 1):
        pr = 1.0
        for i, t in enumerate(seq):
            pr *= float(p(seq[:i])[t])
        target[seq] = pr
    return max(abs(law.get(s, 0.0) - target[s]) for s in target)


def test_rejection_sampling_output_distribution_is_exactly_the_targets():
    assert check_lossless(accept_sampled) < 1e-12
    assert check_lossless(accept_sampled, deterministic=True) < 1e-12
    assert check_lossless(accept_sampled, V=4, k=3) < 1e-12


def test_a_broken_acceptance_step_fails_the_enumeration():
    def resample_from_target(p, drafts, q, uniform):  # on rejection draw from p, not from max(p - q, 0)
        out = []
        for i, d in enumerate(drafts):
            if uniform(i, 0) * float(q[i][d]) < float(p(i)[d]):
                out.append(d)
                continue
            out.append(inverse_cdf(p(i), uniform(i, 1)))
            return out
        return out + [inverse_cdf(p(len(drafts)), uniform(len(drafts), 1))]

    def always_accept_likely(p, drafts, q, uniform):  # accept with p(d) instead of p(d) / q(d)
        out = []
        for i, d in enumerate(drafts):
            if uniform(i, 0) < float(p(i)[d]):
                out.append(d)
                continue
            r = (p(i) - q[i]).clamp(min=0)
            out.append(inverse_cdf(r if r.sum() > 0 else p(i), uniform(i, 1)))
            return out
        return out + [inverse_cdf(p(len(drafts)), uniform(len(drafts), 1))]

    assert check_lossless(resample_from_target) > 1e-9  # the exact step is within 1e-12
    assert check_lossless(always_accept_likely) > 1e-9


def test_greedy_acceptance_and_inverse_cdf():
    assert accept_greedy(lambda i: [5, 6, 7][i], [5, 6]) == [5, 6, 7]
    assert accept_greedy(lambda i: [5, 9, 7][i], [5, 6]) == [5, 9]
    assert accept_greedy(lambda i: [4][i], [5, 6]) == [4]
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    assert [inverse_cdf(probs, u) for u in (0.0, 0.49, 0.5, 0.999999999)] == [1, 1, 3, 3]


def test_seeded_sampling_with_a_deterministic_drafter_equals_plain_sampling(monkeypatch):
    name = "demo-kimi-linear"
    ps = prompts()[:3]
    sp = moesaic.SamplingParams(
        max_tokens=20, temperature=0.8, top_k=40, top_p=0.95, seed=11, ignore_eos=True
    )
    want = plain(name, ps, sp)
    proposer = ForcedProposer([o.prompt_token_ids + o.token_ids for o in want], VOCAB + 1, lambda r: r % 3)
    got = spec_llm(name, proposer, 3).generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # n-gram drafts (rejected or not) do not move the random stream either, and a rerun reproduces
    llm = spec_llm(name, "ngram", 3, spec={"prompt_lookup_min": 1})
    a = llm.generate(ps, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in want]
    assert llm.stats()["speculative"]["rounds"] > 0


class SamplingDrafter:
    """A drafter that samples its drafts from a distribution of its own (not one-hot): probs are given."""

    method, taps, max_k = "sampling-test", (), 4

    def __init__(self, vocab):
        self.vocab, self.g = vocab, torch.Generator().manual_seed(0)

    def start(self, seq_id):
        pass

    def observe(self, seq_id, start, tokens, hidden):
        pass

    def propose(self, requests):
        out = []
        for _, last, k in requests:
            probs = torch.softmax(torch.randn(k, self.vocab, generator=self.g), -1)
            probs[:, last] += 2.0  # likes repeating the last token
            probs = probs / probs.sum(-1, keepdim=True)
            out.append(Draft(torch.multinomial(probs, 1, generator=self.g)[:, 0].tolist(), probs))
        return out

    def finish(self, seq_id):
        pass


def test_sampling_with_a_probabilistic_drafter_runs_and_reproduces():
    ps = prompts()[:2]
    sp = moesaic.SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    vocab = moesaic.LLM("demo-mistral4", dtype="float32").cfg.vocab_size
    llms = [spec_llm("demo-mistral4", SamplingDrafter(vocab), 4) for _ in range(2)]
    runs = [llm.generate(ps, sp) for llm in llms]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) == 16 for o in runs[0])
    s = llms[0].stats()["speculative"]
    assert s["drafted"] > 0 and s["proposer_errors"] == 0
    # probs of the wrong width are refused, not used
    wrong = spec_llm("demo-mistral4", SamplingDrafter(vocab - 1), 4)
    assert [o.token_ids for o in wrong.generate(ps, sp)] == [
        o.token_ids for o in plain("demo-mistral4", ps, sp)
    ]
    assert wrong.stats()["speculative"]["proposer_errors"] > 0


# ---------------------------------------------------------------- prefix cache, preemption, parameters


@pytest.mark.parametrize(
    "name, method", [("demo-kimi-linear", None), ("demo-mistral4", None), ("demo-glm5-next-nvfp4", "mtp")]
)
def test_prefix_cache_with_drafting_equals_no_cache_no_drafting(name, method):
    """Shared system prompts and a follow-up turn whose prefix holds a block written by verify rounds
    (rejected drafts included), on hybrids (snapshots; the MTP head gets no hidden states for the rows the
    cache served) and on an all-paged family."""
    system = random_ids(2 * BLOCK_SIZE + 10, VOCAB, seed=50)
    turns = [system + random_ids(7 + i, VOCAB, seed=60 + i) for i in range(3)]
    sp = greedy(72)
    base = moesaic.LLM(name, dtype="float32", enable_prefix_caching=False)
    want = [base.generate([t], sp)[0].token_ids for t in turns]
    follow = turns[0] + want[0] + random_ids(5, VOCAB, seed=70)  # a second turn: the first one's text + more
    want.append(base.generate([follow], sp)[0].token_ids)
    refs = [t + w for t, w in zip(turns + [follow], want)]
    llm = spec_llm(name, method or ForcedProposer(refs, VOCAB + 1, lambda r: r % 4), 3)
    got = [llm.generate([t], sp)[0].token_ids for t in turns + [follow]]
    assert got == want
    stats = llm.stats()
    assert stats["speculative"]["rollbacks"] > 0
    if name != "demo-mistral4":
        assert stats["snapshots"] > 0
    # the follow-up reused the block of positions 128..191, which verify rounds wrote
    follow_hit = llm.engine.scheduler.cached_tokens - sum(
        min(len(system) // BLOCK_SIZE * BLOCK_SIZE, len(t) - 1) if i else 0 for i, t in enumerate(turns)
    )
    assert follow_hit >= 3 * BLOCK_SIZE


def test_preemption_with_drafting_gives_the_plain_tokens():
    name = "demo-kimi-linear"
    ps = [random_ids(90 + 7 * i, VOCAB, seed=10 + i) for i in range(4)]
    sp = greedy(40)
    want = plain(name, ps, sp, max_num_seqs=4)
    roomy = moesaic.LLM(name, dtype="float32", max_num_seqs=4)
    eng = roomy.engine
    block_cost = BLOCK_SIZE * (eng.pool.bytes_per_token + eng.rest_per_token)
    per_token, fixed = roomy.family.state_bytes(roomy.cfg, 4, rollback_window=4)
    proposer = ForcedProposer([o.prompt_token_ids + o.token_ids for o in want], VOCAB + 1, lambda r: r % 4)
    llm = spec_llm(name, proposer, 3, max_num_seqs=4, max_cache_bytes=fixed * 4 + 5 * block_cost)
    assert llm.engine.blocks.num_blocks == 5
    got = llm.generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.stats()["preemptions"] > 0 and llm.stats()["speculative"]["accepted"] > 0


PARAMS = [
    dict(max_tokens=20, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    dict(max_tokens=20, temperature=0.0, logprobs=3),
    dict(max_tokens=30, temperature=0.0, min_tokens=12),  # the model's EOS inside drafts before min_tokens
    dict(max_tokens=13, temperature=0.7, seed=9, frequency_penalty=0.5, logprobs=2),
    dict(max_tokens=20, temperature=1.0, seed=4, n=3),
]


@pytest.mark.parametrize("kw", PARAMS, ids=lambda kw: ",".join(kw))
def test_sampling_parameters_stay_exact_under_drafting(kw):
    name = "demo-mistral4"
    ps = prompts()[:2]
    sp = moesaic.SamplingParams(ignore_eos=False, **kw)
    base = moesaic.LLM(name, dtype="float32")
    base.engine.eos_ids = {b for b in range(40, 48)}  # frequent EOS, so that stops land inside drafts
    want = base.generate(ps, sp)
    refs = [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs]
    llm = spec_llm(name, ForcedProposer(refs, VOCAB + 1), 4)
    llm.engine.eos_ids = base.engine.eos_ids
    got = llm.generate(ps, sp)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.finish_reason, c.text) for c in g.outputs] == [
            (c.token_ids, c.finish_reason, c.text) for c in w.outputs
        ]
        for cg, cw in zip(g.outputs, w.outputs):
            assert (cg.logprobs is None) == (cw.logprobs is None)
            for a, b in zip(cg.logprobs or [], cw.logprobs or []):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert llm.stats()["speculative"]["accepted"] > 0


def test_stop_strings_and_stop_ids_inside_accepted_drafts_truncate_there():
    name = "demo-mistral4"
    p = prompts()[0]
    free = moesaic.LLM(name, dtype="float32").generate([p], greedy(30))[0]
    ref = [p + free.token_ids]
    stop_id = free.token_ids[9]
    text = moesaic.LLM(name, dtype="float32").decode(free.token_ids)
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    for kw in (dict(stop_token_ids=[stop_id]), dict(stop=[stop_str])):
        want = moesaic.LLM(name, dtype="float32").generate([p], greedy(30, **kw))[0]
        llm = spec_llm(name, ForcedProposer(ref, VOCAB + 1), 6)
        got = llm.generate([p], greedy(30, **kw))[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
        assert want.finish_reason == "stop" and len(want.token_ids) < 30


def test_rows_the_proposer_observes_are_the_committed_rows_hidden_states():
    """With taps asked, `observe` gets every committed row once, in order, with the hidden state a full
    prefill of the committed tokens gives at that row (never a rejected draft's)."""
    name = "demo-glm5-next-nvfp4"
    ps, sp = prompts()[:2], greedy(16)
    want = plain(name, ps, sp)

    class Recording(ForcedProposer):
        def observe(self, seq_id, start, tokens, hidden):
            super().observe(seq_id, start, tokens, hidden)
            for i in range(len(tokens)):
                rows.setdefault(seq_id, []).append({L: h[i] for L, h in hidden.items()})

    rows: dict = {}
    taps = (0, 2, -1)
    proposer = Recording(
        [o.prompt_token_ids + o.token_ids for o in want], VOCAB + 1, lambda r: r % 3, taps=taps
    )
    llm = spec_llm(name, proposer, 3)
    got = llm.generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.stats()["speculative"]["rolled_back_rows"] > 0
    for seq_rows, o in zip(rows.values(), got):
        committed = o.prompt_token_ids + o.token_ids[:-1]  # the last token is never computed
        n = len(seq_rows)  # the last round's rows are not observed: the sequence ended in it
        assert len(committed) - 4 <= n < len(committed)
        batch = ForwardBatch.build([(llm.model.new_state(), committed)])
        batch.taps = taps
        llm.model.forward(batch)
        for L in taps:
            got_rows = torch.stack([r[L] for r in seq_rows])
            assert (got_rows - batch.tapped[L][:n]).abs().max() < 1e-4


# ---------------------------------------------------------------- DFlash


@pytest.mark.parametrize("name", ["demo-glm5-next-nvfp4", "demo-nemotron-h", "demo-kimi-k3"])
def test_dflash_logits_equal_the_formula_and_greedy_equals_plain(name, tmp_path):
    base = moesaic.LLM(name, dtype="float32")
    layers = len(base.model.layers)
    folder = write_drafter(tmp_path / "drafter", base, taps=[0, layers - 1])
    llm = spec_llm(name, "dflash", 4, spec={"model": str(folder)})
    proposer = llm.engine.proposer
    # the proposer, fed the rows the engine would give (prompt, then two verify rounds' committed rows)
    ids = random_ids(40, VOCAB, seed=80)
    st = llm.model.new_state()
    proposer.start(0)
    for lo, hi in ((0, 25), (25, 29), (29, 31)):
        batch = ForwardBatch.build([(st, ids[lo:hi])])
        batch.taps = proposer.taps
        llm.model.forward(batch)
        proposer.observe(0, lo, ids[lo:hi], batch.tapped)
    got = proposer.block_logits([(0, ids[31], 4)])[0]
    want = drafter_reference(folder, llm.model, ids[:31], ids[31])[1:] @ llm.model.lm_head.float().T
    assert (got - want).abs().max() < 1e-3 * max(1.0, want.abs().max().item())
    # a shorter sequence drafting in the same call (its context padded to the longer one's, masked)
    st1 = llm.model.new_state()
    proposer.start(1)
    batch = ForwardBatch.build([(st1, ids[:12])])
    batch.taps = proposer.taps
    llm.model.forward(batch)
    proposer.observe(1, 0, ids[:12], batch.tapped)
    alone = proposer.block_logits([(1, ids[12], 4)])[0]
    both = proposer.block_logits([(0, ids[31], 4), (1, ids[12], 4)])
    assert (both[0] - got).abs().max() < 1e-4 * max(1.0, got.abs().max().item())
    assert (both[1] - alone).abs().max() < 1e-4 * max(1.0, alone.abs().max().item())
    assert (alone - got).abs().max() > 1e-2  # two different blocks
    # end to end
    ps, sp = prompts()[:3], greedy(16)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [o.token_ids for o in plain(name, ps, sp)]
    s = llm.stats()["speculative"]
    assert s["drafted"] > 0 and s["rolled_back_rows"] > 0


def test_dflash_drafter_that_does_not_fit_the_target_is_a_config_error(tmp_path):
    base = moesaic.LLM("demo-glm5-next-nvfp4", dtype="float32")
    cases = [
        (dict(hidden_size=base.cfg.hidden_size + 8), "hidden_size"),
        (dict(vocab_size=base.cfg.vocab_size + 1), "vocab_size"),
        (dict(num_target_layers=99), "num_target_layers"),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 99]}), "target_layer_ids"),
        (dict(dflash_config={"mask_token_id": 9999, "target_layer_ids": [0]}), "mask_token_id"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ]
    for i, (over, field) in enumerate(cases):
        folder = write_drafter(tmp_path / f"d{i}", base, taps=[0, 1], **over)
        with pytest.raises(ConfigError, match=field):
            moesaic.LLM(
                "demo-glm5-next-nvfp4",
                dtype="float32",
                speculative_config={"method": "dflash", "num_speculative_tokens": 3, "model": str(folder)},
            )
    folder = write_drafter(tmp_path / "ok", base, taps=[0, 1], block=4)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):  # block 4 drafts at most 3
        moesaic.LLM(
            "demo-glm5-next-nvfp4",
            dtype="float32",
            speculative_config={"method": "dflash", "num_speculative_tokens": 4, "model": str(folder)},
        )


def trained_demo_folders():
    try:
        from moesaic.demo import trained_demo_path
    except ImportError:
        return None
    target = trained_demo_path()
    drafter = target.parent / (target.name + "-dflash")
    return (target, drafter) if (target / "config.json").exists() and drafter.exists() else None


@pytest.mark.skipif(trained_demo_folders() is None, reason="the trained demo is not in this checkout")
def test_dflash_on_the_trained_demo_is_lossless_and_accepts():
    target, drafter = trained_demo_folders()
    prompts_ = [
        "import os\n\n\ndef ",
        "class Queue:\n    def __init__(self):\n        self.",
        "for i in range(",
    ]
    sp = greedy(48)
    want = moesaic.LLM(str(target), dtype="float32").generate(prompts_, sp)
    llm = moesaic.LLM(
        str(target),
        dtype="float32",
        speculative_config={
            "method": "dflash",
            "num_speculative_tokens": 7,
            "model": str(drafter),
            "adaptive": False,
        },
    )
    got = llm.generate(prompts_, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = llm.stats()["speculative"]
    print(f"trained demo DFlash: tau {s['tau']:.2f}, per-position acceptance {s['per_position_acceptance']}")
    assert s["accepted"] > 0 and s["tau"] > 1.2


# ---------------------------------------------------------------- adaptive drafting, counters, robustness


def test_adaptive_length_follows_acceptance_and_batch_size():
    policy = DraftLength(k=6)
    for rows in (1, 2, 4, 8, 16, 64):  # a step costs 10 ms + 1 ms a row
        policy.forward_done(rows, 0.010 + 0.001 * rows)
    good, bad = Acceptance(), Acceptance()
    for _ in range(20):
        good.record(6, 6)
        bad.record(6, 0)
    assert policy.length(good, decoders=1, limit=10) == 6  # cheap rows, every draft accepted
    before = bad.tried
    assert policy.length(bad, decoders=1, limit=10) == 0  # nothing accepted: off ...
    assert bad.tried < before  # ... and while off the record fades, so drafting is tried again later
    assert policy.length(good, decoders=1, limit=2) == 2  # never past the request's limit
    mid = Acceptance()
    for _ in range(20):
        mid.record(4, 2)
    alone, crowded = policy.length(mid, decoders=1, limit=10), policy.length(mid, decoders=200, limit=10)
    assert alone > crowded  # a batch where rows cost more drafts less
    assert DraftLength(k=5, adaptive=False).length(bad, 1, 10) == 5
    # off for RETRY_AFTER rounds in a row: one full-length round, then off again (a stale or noisy time
    # model must not keep drafting off for good: only drafting rounds measure what a row costs)
    policy.by_seqs.clear()
    for rows in (1, 2, 4):  # a fit from a slow stretch: rows priced at 20 ms each
        policy.forward_done(rows, 0.010 + 0.020 * rows, seqs=1)
    never = Acceptance()
    got = [policy.length(never, decoders=1, limit=10) for _ in range(2 * adaptive.RETRY_AFTER)]
    want = ([0] * (adaptive.RETRY_AFTER - 1) + [6]) * 2
    assert got == want


def test_adaptive_time_model_is_fitted_per_batch_size():
    """Steps of 1 sequence cost 10 ms + 1 ms a row, steps of 4 sequences 25 ms + 1 ms a row: one line over
    both would make a row look about twice as dear; the per-size fits give each size its own row cost."""
    policy = DraftLength(k=4)
    for rows in (1, 2, 3, 4, 5):
        policy.forward_done(rows, 0.010 + 0.001 * rows, seqs=1)
    for rows in (4, 8, 12, 16, 20):
        policy.forward_done(rows, 0.025 + 0.001 * rows, seqs=4)
    t0, t1 = policy.step_model(4)
    assert t0 == pytest.approx(0.025) and t1 == pytest.approx(0.001)
    assert policy.step_model(1) == pytest.approx((0.010, 0.001))
    assert policy.step_model()[1] > 0.0015  # the pooled line over both sizes: the misleading one
    assert policy.row_cost(4) == pytest.approx(0.004 / 0.029)
    assert policy.row_cost(1) == pytest.approx(0.001 / 0.011)
    t0, t1 = policy.step_model()  # a size not seen: the pooled line
    assert policy.row_cost(2) == pytest.approx(2 * t1 / (t0 + 2 * t1))
    assert DraftLength(k=4).row_cost(1) == 0.05  # nothing measured: a small cost, so that drafting is tried


def accepting(rate: float) -> Acceptance:
    """A sequence whose measured acceptance is `rate` (a long record outweighs the prior)."""
    return Acceptance(accepted=rate * 1e6, tried=1e6)


def test_sequence_lengths_follow_their_acceptance_within_the_steps_cap():
    """Each sequence drafts as far as its drafts are worth their row (a^j >= beta), at most the step's
    longest draft (the DraftGate's) and its own limit."""
    policy = DraftLength(k=3)
    policy.row_cost = lambda decoders: 0.2  # a row: 20 % of a plain step per decoding sequence
    accs = [accepting(r) for r in (0.9, 0.9, 0.3, 0.1)]
    assert policy.lengths(accs, 4, [3, 3, 3, 3]) == [3, 3, 1, 0]
    assert accs[3].off == 1 and accs[0].off == 0  # the one left at 0 is off (its record fades)
    assert policy.lengths(accs[:2], 4, [1, 3]) == [1, 3]  # each within its limit
    assert policy.lengths(accs, 4, [3] * 4, cap=2) == [2, 2, 1, 0]  # and within the step's
    off = accs[0].off
    assert policy.lengths(accs, 4, [3] * 4, cap=0) == [0] * 4
    assert accs[0].off == off  # a step held plain is not the sequence's acceptance: not counted as off
    assert DraftLength(k=3, adaptive=False).lengths(accs, 4, [3] * 4, cap=2) == [2] * 4


def gate_steps(gate: DraftGate, seqs: int, turns: int, seconds_at, slower=lambda turn: 1.0) -> list[int]:
    """Runs `turns` decode steps of `seqs` sequences through the gate: a step at length c commits
    seqs * (c + 1) tokens (every draft accepted) in seconds_at(c), times slower(turn) (the machine)."""
    got = []
    for turn in range(turns):
        c = gate.length(seqs)
        gate.record(seqs, seqs * (c + 1), seconds_at(c) * slower(turn), c)
        got.append(c)
    return got


def test_draft_gate_climbs_to_the_fastest_length():
    """k = 4; a step at length c commits c + 1 tokens a sequence in cost[c], best at c = 2 (the third and
    fourth drafts cost more than they commit). The gate starts plain, measures the full length and one draft,
    climbs to 2 and stays there but for one candidate run in EXPLORE_EVERY (waits that double while the
    candidates lose, up to 2 ** BACKOFF); it leaves when drafting gets dear. Each candidate run is judged
    against the best's runs around it, so a machine whose steps take 1.5x as long in every other stretch of
    40 steps finds the same length, as does one whose every seventh step takes 5x as long."""
    k, R = 4, adaptive.RUN
    cost = {0: 0.008, 1: 0.012, 2: 0.015, 3: 0.030, 4: 0.045}  # tok/s a sequence: 125, 167, 200, 133, 111
    gate = DraftGate(k)
    first = gate_steps(gate, 4, 40 * R, cost.get)
    runs = [first[i] for i in range(0, len(first), R)]
    assert all(first[i : i + R] == [first[i]] * R for i in range(0, len(first), R))  # in runs of R steps
    # plain first, the full length and one draft against it (PAIRS runs each, each between two plain runs),
    # then 1 is best and 2 is its best candidate; then 2 is best, and no other candidate beats it
    assert runs[:9] == [0, 4, 0, 4, 0, 1, 0, 1, 0]
    assert gate.best(4) == 2 and runs[-1] == 2
    longest = (adaptive.EXPLORE_EVERY << adaptive.BACKOFF) + 1  # a best run's wait and a candidate's run
    got = gate_steps(gate, 4, 6 * longest * R, cost.get)
    candidate_runs = (len(got) - got.count(2)) // R
    # at most one in EXPLORE_EVERY + 1 runs, the waits doubling to 2 ** BACKOFF times that
    assert 6 <= candidate_runs <= 6 + 2 * adaptive.BACKOFF + 2
    assert all(got.count(c) >= R for c in (0, 1, 3, 4))  # every candidate kept measured, round robin
    assert gate.length(1) == 0 and gate.best(1) == 0  # every batch size is measured on its own
    # and one step in 7 takes 5x as long (a collection, the host): a run is judged by its median step
    slower = lambda turn: (1.5 if turn // 40 % 2 else 1.0) * (5.0 if turn % 7 == 0 else 1.0)  # noqa: E731
    phased = DraftGate(k)
    gate_steps(phased, 4, 40 * R, cost.get, slower)
    assert phased.best(4) == 2
    # drafting got dear (e.g. acceptance fell): plain steps win, found by the candidates' runs
    dear = {c: 0.008 + 0.010 * c for c in range(k + 1)}  # 125, 111, 107, 105, 104 tok/s a sequence
    gate_steps(gate, 4, 2 * longest * R, dear.get)
    assert gate.best(4) == 0
    got = gate_steps(gate, 4, 2 * longest * R, dear.get)
    assert got.count(0) >= 2 * (longest - 4) * R


def test_draft_gate_is_not_moved_by_one_slow_stretch():
    """Drafting that never pays (each length 0.8x plain's rate): a slow stretch over the best's run right
    before a candidate's (the machine's step times double for a run) makes that comparison say the
    candidate is faster; the best's run after it weighs the stretch half, and the candidate must win each
    of its last PAIRS comparisons, so plain decoding stays best. The rule of the sum of the last PAIRS (a
    stretch of 2x against a loss of 0.8x: +0.47 - 0.22) moved to drafting. Then the candidates' runs thin
    out: their waits double while they lose."""
    k, R = 3, adaptive.RUN
    cost = {0: 0.010, **{c: 0.0125 * (c + 1) for c in range(1, k + 1)}}  # drafting: 0.8x plain's rate
    gate = DraftGate(k)
    # the machine's slow stretch: plain's first run, the best's run right before the full length's first
    stretch = range(0, R)
    bests = []
    for turn in range(30 * R):
        c = gate.length(2)
        gate.record(2, 2 * (c + 1), cost[c] * (2.0 if turn in stretch else 1.0), c)
        bests.append(gate.best(2))
    assert bests == [0] * len(bests)
    longest = (adaptive.EXPLORE_EVERY << adaptive.BACKOFF) + 1
    got = gate_steps(gate, 2, 4 * longest * R, cost.get)
    assert (len(got) - got.count(0)) // R <= 4 + 2 * adaptive.BACKOFF + 2


def test_adaptive_drafting_turns_off_for_a_drafter_that_never_hits(monkeypatch):
    name = "demo-mistral4"
    ps, sp = prompts()[:2], greedy(40)
    want = plain(name, ps, sp)
    monkeypatch.setattr(DraftLength, "row_cost", lambda self, decoders: 0.3)  # no timing in a test
    refs = [o.prompt_token_ids + o.token_ids for o in want]
    never = spec_llm(name, ForcedProposer(refs, VOCAB + 1, 0), 4, spec={"adaptive": True})
    assert [o.token_ids for o in never.generate(ps, sp)] == [o.token_ids for o in want]
    always = spec_llm(name, ForcedProposer(refs, VOCAB + 1), 4, spec={"adaptive": True})
    assert [o.token_ids for o in always.generate(ps, sp)] == [o.token_ids for o in want]
    off, on = never.stats()["speculative"], always.stats()["speculative"]
    assert off["rounds"] < 0.5 * 2 * 40 and off["accepted"] == 0  # it stopped drafting early on
    assert on["accepted"] == on["drafted"] and on["tau"] > 3


def test_adaptive_drafting_stops_when_its_steps_are_slower_than_plain_ones(monkeypatch):
    """A drafter that is always right but takes 100 ms a call: its steps commit 5 tokens where a plain step
    commits 1 in a few ms. The time model is told drafting is cheap (it does not see the sleep), so only the
    DraftGate, which measures whole steps of both kinds, keeps plain decoding."""
    name = "demo-mistral4"
    monkeypatch.setattr(DraftLength, "row_cost", lambda self, decoders: 0.05)
    ps, sp = prompts()[:2], greedy(64)
    want = plain(name, ps, sp)

    class Slow(ForcedProposer):
        def propose(self, requests):
            time.sleep(0.1)
            return super().propose(requests)

    slow = Slow([o.prompt_token_ids + o.token_ids for o in want], VOCAB + 1)
    llm = spec_llm(name, slow, 4, spec={"adaptive": True})
    assert [o.token_ids for o in llm.generate(ps, sp)] == [o.token_ids for o in want]
    s = llm.stats()["speculative"]
    assert s["accepted"] == s["drafted"] > 0  # it drafted (first measured), and every draft was right
    # two sequences drafted PAIRS runs at the full length and as many at 1 (plain steps' candidates)
    assert s["gated_steps"] > 10 and s["rounds"] <= 2 * 2 * adaptive.PAIRS * adaptive.RUN


def test_a_gated_step_without_drafts_counts_for_no_length(monkeypatch):
    """The DraftGate lets a step draft up to c; each sequence then drafts as far as its own acceptance pays.
    A step in which no sequence drafted is a plain step, and is not measured as length c: mixed into c's
    runs, such steps made a drafting length look as fast as plain decoding while its drafting steps lost."""
    name = "demo-mistral4"
    ps, sp = prompts()[:2], greedy(40)
    want = plain(name, ps, sp)
    refs = [o.prompt_token_ids + o.token_ids for o in want]
    seen = []
    real = DraftGate.record

    def record(self, seqs, tokens, seconds, length):
        seen.append((self.climbs[seqs].arm, length))
        return real(self, seqs, tokens, seconds, length)

    monkeypatch.setattr(DraftGate, "record", record)
    monkeypatch.setattr(
        DraftLength, "lengths", lambda self, accs, decoders, limits, cap=None: [0] * len(accs)
    )
    llm = spec_llm(name, ForcedProposer(refs, VOCAB + 1), 4, spec={"adaptive": True})
    assert [o.token_ids for o in llm.generate(ps, sp)] == [o.token_ids for o in want]
    assert llm.stats()["speculative"]["drafted"] == 0
    assert any(arm > 0 for arm, _ in seen)  # the gate tried drafting lengths ...
    assert all(length == (0 if arm == 0 else -1) for arm, length in seen)  # ... which measured nothing


def test_generate_keeps_its_batch_in_step():
    """LLM.generate returns when every sequence is done: a sequence ahead of the furthest-behind one gains
    nothing by drafting, so its drafts are held back (the tokens never change). Two requests of 40 and 12
    tokens, an always-right drafter: the short one drafts only once the long one has come within a round."""
    name = "demo-mistral4"
    ps, sps = prompts()[:2], [greedy(40), greedy(12)]
    want = [o.token_ids for o in plain(name, ps, sps)]
    refs = [p + w for p, w in zip(ps, want)]
    stats = {}
    for in_step in (True, False):
        llm = spec_llm(name, ForcedProposer(refs, VOCAB + 1), 4)
        if not in_step:  # as a served request would: every sequence drafts
            llm.engine.whole_batch = contextlib.nullcontext
        assert [o.token_ids for o in llm.generate(ps, sps)] == want
        stats[in_step] = llm.stats()["speculative"]
    held, free = stats[True], stats[False]
    assert held["accepted"] == held["drafted"] and free["accepted"] == free["drafted"]
    assert held["drafted"] < free["drafted"]  # the short one's rounds
    assert held["target_forwards"] <= free["target_forwards"]  # the batch ends no later


def test_counters_add_up():
    name = "demo-mistral4"
    p, sp = prompts()[1], greedy(19)  # 1 + 3 x (1 + 5): rounds of 0 and 4 accepted, alternating
    want = plain(name, [p], sp)
    llm = spec_llm(name, ForcedProposer([p + want[0].token_ids], VOCAB + 1, lambda r: r % 2 * 4), 4)
    calls = []
    forward = llm.model.forward
    llm.model.forward = lambda b: calls.append(b) or forward(b)
    out = llm.generate([p], sp)[0]
    assert out.token_ids == want[0].token_ids
    s = llm.stats()["speculative"]
    assert s["target_forwards"] == len(calls)
    assert s["drafted"] == sum(s["per_position_drafted"]) and s["per_position_drafted"][0] == s["rounds"]
    assert s["tau"] == pytest.approx((s["accepted"] + s["rounds"]) / s["rounds"])
    # every round either accepted all 4 or none: 1 prefill + plain first token, then rounds of 5 or 1
    assert s["accepted"] % 4 == 0 and s["rolled_back_rows"] == 4 * (s["rounds"] - s["accepted"] // 4)
    assert (
        1 + s["rounds"] == len(calls)
        and s["per_position_acceptance"] == [s["accepted"] / 4 / s["rounds"]] * 4
    )


def test_a_failing_proposer_turns_drafting_off_and_changes_nothing():
    class Broken(ForcedProposer):
        def propose(self, requests):
            raise RuntimeError("drafter bug")

    name = "demo-mistral4"
    ps, sp = prompts()[:2], greedy(10)
    want = plain(name, ps, sp)
    llm = spec_llm(name, Broken([], VOCAB + 1), 3)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [o.token_ids for o in want]
    assert llm.stats()["speculative"]["proposer_errors"] > 0


def test_drafting_is_off_by_default():
    llm = moesaic.LLM("demo-mistral4", dtype="float32")
    assert llm.stats()["speculative"] is None and llm.engine.proposer is None
    assert llm.engine.rollback_window == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 16}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "dflash", "num_speculative_tokens": 2, "model": "/no/such/folder"}, "model"),
        ({"method": "dflash", "num_speculative_tokens": 2}, "ngram"),  # no folder: says what it can use
        ({"method": "mtp", "num_speculative_tokens": 2}, "it can use: ngram"),  # Mistral 4 has no MTP head
        ({"proposer": object(), "num_speculative_tokens": 2}, "proposer"),
        ('{"method": "ngram", "num_speculative_tokens": ', "JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_speculative_configs_are_config_errors_naming_the_field(config, field):
    with pytest.raises(ConfigError, match=field):
        moesaic.LLM("demo-mistral4", dtype="float32", speculative_config=config)


def test_a_json_string_config_works_and_a_proposer_over_its_limit_is_refused():
    llm = moesaic.LLM(
        "demo-mistral4",
        dtype="float32",
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )
    assert llm.engine.spec.k == 3 and llm.engine.rollback_window == 4
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        spec_llm("demo-mistral4", ForcedProposer([], VOCAB + 1, max_k=2), 3)


def test_cli_speculative_config(capsys):
    from moesaic.cli import main

    ok = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    assert (
        main(["generate", "--model", "demo-mistral4", "--max-tokens", "6", "--speculative-config", ok]) == 0
    )
    assert "drafting (ngram)" in capsys.readouterr().err
    assert main(["generate", "--model", "demo-mistral4", "--speculative-config", '{"method": 1}']) == 2
    assert "field 'method'" in capsys.readouterr().err


def test_async_llm_and_streams_draft_and_give_the_plain_tokens():
    import asyncio

    name = "demo-mistral4"
    ps, sp = prompts()[:3], greedy(20)
    want = [o.token_ids for o in plain(name, ps, sp)]
    refs = [p + w for p, w in zip(ps, want)]
    config = {"proposer": ForcedProposer(refs, VOCAB + 1, lambda r: r % 3), "num_speculative_tokens": 3}
    allm = moesaic.AsyncLLM(name, dtype="float32", speculative_config=config)
    try:

        async def one(p):
            toks = []
            async for item in allm.add_request(p, sp):
                toks += item.outputs[0].token_ids
            return toks

        async def main():
            return await asyncio.gather(*(one(p) for p in ps))

        assert asyncio.run(main()) == want
        assert allm.stats()["speculative"]["accepted"] > 0
    finally:
        allm.shutdown(timeout=5)
    llm = spec_llm(name, ForcedProposer(refs, VOCAB + 1), 4)
    assert list(llm.stream(ps[0], sp)) == want[0]  # several tokens a step, one at a time to the reader
    assert llm.stats()["speculative"]["accepted"] > 0


@pytest.mark.parametrize("demo", ["demo-kimi-linear", "demo-nemotron-h", "demo-glm5-next-nvfp4"])
def test_prompt_state_does_not_depend_on_the_rollback_window(demo):
    """An engine that drafts keeps snapshots of a forward's last rows, which the recurrent mixers make by the
    token recurrence; a prompt's last rows are taken that way whatever the window, so the state after a
    prompt (and every logit after it) has the same bits in a drafting engine and a plain one. In bf16 the
    chunked scan rounds otherwise: the plain and the drafting engine parted on the trained demo (one of four
    code prompts at its 41st token, greedy MTP at k = 3)."""
    _, model = demo_model(demo, "bfloat16")
    assert MAX_SPECULATIVE_TOKENS + 2 <= STEPPED_ROWS  # every window's snapshots are stepped rows
    ids = random_ids(70, model.cfg.vocab_size, seed=3)
    chunks = [ids[:50], ids[50:53], [ids[53]], [ids[54]]]  # a prompt, a verify-sized block, decode rows
    got = {w: run(model, chunks, rollback_window=w) for w in (0, 4, 16)}
    for w in (4, 16):
        assert torch.equal(got[w][0], got[0][0]), w
        for a, b in zip(got[w][1].layers, got[0][1].layers):
            if hasattr(a, "history"):  # a recurrent layer: the same state (the recurrence and the conv tail)
                xs, ys = _tensors(a.value), _tensors(b.value)
                assert len(xs) == len(ys) >= 2 and all(torch.equal(x, y) for x, y in zip(xs, ys))


def _tensors(value):
    return (
        [t for t in vars(value).values() if isinstance(t, torch.Tensor)]
        if hasattr(value, "__dict__")
        else [value]
    )
