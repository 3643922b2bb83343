"""The async engine: many concurrent requests, aborts that free their blocks, incremental outputs, errors
that end one request only, shutdown."""

from __future__ import annotations

import asyncio

import pytest
from helpers import random_ids

import moesaic
from moesaic.errors import CapacityError, RequestError

VOCAB = 259
POISON = 258


def greedy(n, **kw):
    return moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def allm():
    a = moesaic.AsyncLLM("demo-mistral4", dtype="float32")
    yield a
    a.shutdown(timeout=5)


async def collect(it, stop_after=None, on_item=None):
    """(token ids, text, the last item) of a request's stream; aborts via `on_item` when asked."""
    toks, text, last = [], "", None
    async for item in it:
        last = item
        for out in item.outputs:
            toks += out.token_ids
            text += out.text
        if on_item is not None:
            on_item(item, toks)
    return toks, text, last


def test_concurrent_requests_with_aborts(allm):
    prompts = [random_ids(8 + i % 5, VOCAB, seed=100 + i) for i in range(32)]
    sp = greedy(12)
    solo = [allm.llm.generate([p], sp)[0] for p in prompts]
    aborted = set(range(3, 32, 4))  # 8 of them

    async def main():
        async def one(i):
            rid = f"r{i}"

            def maybe_abort(item, toks):
                if i in aborted and len(toks) >= 3:
                    allm.abort(rid)

            params = greedy(400) if i in aborted else sp  # far from done when the abort arrives
            return await collect(allm.add_request(prompts[i], params, request_id=rid), on_item=maybe_abort)

        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(main())
    for i, (toks, text, last) in enumerate(results):
        assert last.finished
        if i in aborted:
            assert last.outputs[-1].finish_reason == "abort" and 3 <= len(toks) < 400
            k = min(len(toks), 12)
            assert toks[:k] == solo[i].token_ids[:k]
        else:
            assert toks == solo[i].token_ids and text == solo[i].text
            assert last.outputs[-1].finish_reason == "length" and last.usage["completion_tokens"] == 12
    stats = allm.stats()
    assert stats["blocks"]["used"] == 0 and stats["requests"]["running"] == 0
    assert stats["async"]["active_requests"] == 0 and stats["requests"]["aborted"] >= 8


def test_a_consumer_that_leaves_frees_its_request(allm):
    async def main():
        it = allm.add_request(random_ids(10, VOCAB, seed=7), greedy(500))
        async for _ in it:
            break
        await it.aclose()
        for _ in range(200):  # the stepping thread takes the abort before its next step
            if not allm.stats()["async"]["active_requests"]:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    stats = allm.stats()
    assert stats["async"]["active_requests"] == 0 and stats["blocks"]["used"] == 0


def test_bad_requests_raise_at_once_and_errors_end_one_request(allm, monkeypatch):
    async def main():
        with pytest.raises(RequestError, match="n must"):
            allm.add_request("abc", moesaic.SamplingParams(n=0))
        with pytest.raises(CapacityError, match="context"):
            allm.add_request([5] * 5000, greedy(2))
        with pytest.raises(RequestError, match="prompt is None"):
            allm.add_request(None)
        it = allm.add_request("abc", greedy(2), request_id="dup")
        with pytest.raises(RequestError, match="already running"):
            allm.add_request("abc", greedy(2), request_id="dup")
        await collect(it)

        # a forward that raises for one request (its layer fails) while another streams
        model = allm.llm.model
        real = model.attention

        def attention(L, *args, **kw):
            if L == 1 and bool((args[2].token_ids == POISON).any()):
                raise ValueError("poisoned")
            return real(L, *args, **kw)

        monkeypatch.setattr(model, "attention", attention)
        good = random_ids(30, VOCAB, seed=8)
        want = allm.llm.generate([good], greedy(20))[0].token_ids
        good_it = allm.add_request(good, greedy(20))
        first = await good_it.__anext__()
        bad_it = allm.add_request(random_ids(30, VOCAB, seed=9) + [POISON], greedy(5))
        with pytest.raises(ValueError, match="poisoned"):
            await collect(bad_it)
        toks, _, last = await collect(good_it)
        return first.outputs[0].token_ids + toks, want, last

    got, want, last = asyncio.run(main())
    assert got == want and last.finished
    assert allm.stats()["blocks"]["used"] == 0


def test_stop_strings_stream_without_the_stop(allm):
    prompt = random_ids(12, VOCAB, seed=5)
    base = allm.llm.generate([prompt], greedy(30))[0].text
    at = next(
        i
        for i in range(4, len(base) - 2)
        if "\ufffd" not in base[i : i + 2] and base[i : i + 2] not in base[:i]
    )
    stop = base[at : at + 2]

    async def main():
        return await collect(allm.add_request(prompt, greedy(30, stop=stop)))

    toks, text, last = asyncio.run(main())
    assert text == base[:at] and last.outputs[0].stop_reason == stop


def test_shutdown_drains_then_refuses():
    a = moesaic.AsyncLLM("demo-mistral4", dtype="float32")

    async def main():
        it = a.add_request("hello", greedy(4))
        task = asyncio.ensure_future(collect(it))
        await asyncio.sleep(0)
        await asyncio.to_thread(a.shutdown, 10)
        return await task

    toks, _, last = asyncio.run(main())
    assert len(toks) == 4 and last.finished and not a.engine.thread.is_alive()

    async def late():
        a.add_request("hello", greedy(4))

    with pytest.raises(RequestError, match="shutting down"):
        asyncio.run(late())
