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
