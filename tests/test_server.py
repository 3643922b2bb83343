"""`moesaic serve` as users run it: one real server process on the default demo (float32, a free loopback
port, an API key), started by a module fixture and driven by the official `openai` and `anthropic`
clients. Its answers are compared with `LLM.generate` on the same demo in this process: greedy text,
usage, seeds, stop strings, logprobs; structured output validates with jsonschema; 16 concurrent streams
of which some drop keep the others' output and leave no cache block in use; the last test stops the
server with SIGTERM while a stream is running: the stream finishes and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

import moesaic
from moesaic.server.chat import JinjaChat
from moesaic.server.parsers import parse

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-moesaic-test"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


@pytest.fixture(scope="module")
def llm():
    return moesaic.LLM("demo-mistral4", dtype="float32")  # also writes the demo before the server reads it


@pytest.fixture(scope="module")
def server(llm, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # the same number of threads as this process: the same float32 sums, so the same greedy tokens
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "moesaic.cli", "serve", "demo-mistral4", "--dtype", "float32", "--port", "0"]
    cmd += ["--api-key", KEY, "--max-body-bytes", "65536", "--shutdown-timeout", "30"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    url = None
    while url is None:
        m = re.search(r"ready at (http://\S+)/v1", log.read_text())
        if m:
            url = m.group(1)
        elif proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"moesaic serve did not start:\n{log.read_text()[-3000:]}")
        else:
            time.sleep(0.1)
    yield SimpleNamespace(url=url, proc=proc, log=log)
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy(**kw):
    return moesaic.SamplingParams(temperature=0.0, **kw)


def chat_ids(llm, messages=MESSAGES) -> list[int]:
    """The demo's chat prompt, rendered here from the template the demo folder ships."""
    text = JinjaChat((llm.path / "chat_template.jinja").read_text(), SPECIALS).render(messages)
    return llm.tokenizer.encode(text, add_bos=False)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} is not in /metrics"
    return sum(values)


# ----------------------------------------------------------------------------- the same text as LLM.generate


def test_completions_match_llm_generate(client, llm):
    prompt = "The quick brown fox"
    ref = llm.generate([prompt], greedy(max_tokens=24))[0]
    r = client.completions.create(model="demo-mistral4", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(llm.encode(prompt)) == len(ref.prompt_token_ids)
    assert (
        r.usage.completion_tokens == len(ref.token_ids) and r.usage.total_tokens == r.usage.prompt_tokens + 24
    )
    chunks = list(
        client.completions.create(
            model="demo-mistral4",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [t for c in chunks for t in c.choices[0].token_ids] == ref.token_ids  # vLLM's return_token_ids
    assert [c.choices[0].finish_reason for c in chunks][-1] == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # a prompt of token ids, and two prompts in one request
    ids = [1, 70, 71, 72]
    ref_ids = llm.generate([ids], greedy(max_tokens=8))[0]
    r = client.completions.create(
        model="demo-mistral4", prompt=[ids, llm.encode(prompt)], max_tokens=8, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == ref_ids.text and r.choices[1].text == ref.text[: len(r.choices[1].text)]
    assert r.usage.prompt_tokens == 4 + len(ref.prompt_token_ids) and r.usage.completion_tokens == 16


def test_chat_matches_llm_generate_streamed_and_not(client, llm, server):
    ids = chat_ids(llm)
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    ref = llm.generate([ids], greedy(max_tokens=32, skip_special_tokens=False))[0]
    want = parse("mistral", ref.text)
    r = client.chat.completions.create(model="demo-mistral4", messages=MESSAGES, max_tokens=32, temperature=0)
    msg = r.choices[0].message
    assert (msg.content or "") == want.content and (getattr(msg, "reasoning", None) or "") == want.reasoning
    assert len(msg.tool_calls or []) == len(want.tool_calls)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    stream = client.chat.completions.create(
        model="demo-mistral4",
        messages=MESSAGES,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.content
    # include_usage: every chunk carries usage null, then one last chunk with no choices carries it
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(ids) and all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body][-1] in ("stop", "length", "tool_calls")
    # without include_usage there is no usage chunk
    plain = list(
        client.chat.completions.create(model="demo-mistral4", messages=MESSAGES, max_tokens=4, stream=True)
    )
    assert all(c.choices for c in plain)


def test_n_samples_and_seeds_are_reproducible(client, llm):
    prompt = "Once upon a time"
    kw = dict(
        model="demo-mistral4",
        prompt=prompt,
        max_tokens=16,
        temperature=1.0,
        n=2,
        seed=7,
        extra_body={"top_k": 50},
    )
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)] and texts[0] != texts[1]
    ref = llm.generate(
        [prompt], moesaic.SamplingParams(max_tokens=16, temperature=1.0, top_k=50, n=2, seed=7)
    )[0]
    assert texts == [o.text for o in ref.outputs]
    # sample 1 of seed 7 is the request with seed 8
    one = client.completions.create(**dict(kw, n=1, seed=8))
    assert one.choices[0].text == texts[1]
    assert first.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    streamed = {0: "", 1: ""}
    for c in client.completions.create(**kw, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert [streamed[0], streamed[1]] == texts


def test_stop_strings(client, llm):
    prompt = "Stop here"
    full = llm.generate([prompt], greedy(max_tokens=24))[0].text
    i = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[i : i + 2]
    ref = llm.generate([prompt], greedy(max_tokens=24, stop=[stop, "never-seen"]))[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    r = client.completions.create(
        model="demo-mistral4", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never-seen"]
    )
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model="demo-mistral4", prompt=prompt, max_tokens=24, temperature=0,
                                                              stop=stop, stream=True)
    )  # fmt: skip
    assert streamed == ref.text


def test_logprobs(client, llm):
    ids = chat_ids(llm)
    ref = llm.generate([ids], greedy(max_tokens=8, logprobs=3, skip_special_tokens=False))[0]
    r = client.chat.completions.create(
        model="demo-mistral4", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for entry, tok, lp in zip(content, ref.token_ids, ref.logprobs):
        assert entry.logprob == pytest.approx(lp[tok], abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            sorted(lp.values(), reverse=True)[:3], abs=1e-5
        )
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the top one
    prompt = "Numbers"
    ref = llm.generate([prompt], greedy(max_tokens=6, logprobs=2))[0]
    r = client.completions.create(
        model="demo-mistral4", prompt=prompt, max_tokens=6, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    assert all(len(t) == 2 for t in lp.top_logprobs) and len(lp.tokens) == 6


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = client.chat.completions.create(
        model="demo-mistral4", messages=MESSAGES, max_tokens=120, temperature=0, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, SCHEMA)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="demo-mistral4",
            messages=MESSAGES,
            max_tokens=120,
            temperature=0,
            response_format=fmt,
            stream=True,
        )
        if c.choices
    )
    assert streamed == r.choices[0].message.content
    sampled = client.chat.completions.create(
        model="demo-mistral4",
        messages=MESSAGES,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=2,
        response_format=fmt,
    )
    for c in sampled.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


# ----------------------------------------------------------------------------- concurrency and disconnects


def test_concurrent_streams_with_clients_dropping(server, llm):
    prompts = [f"Stream {i}: tell me" for i in range(16)]
    drop = {i for i in range(16) if i % 4 == 1}  # these leave after 3 chunks of a long request
    solo = {
        i: llm.generate([p], greedy(max_tokens=24))[0].text for i, p in enumerate(prompts) if i not in drop
    }

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120
        ) as c:

            async def one(i):
                long = i in drop
                stream = await c.completions.create(
                    model="demo-mistral4", prompt=prompts[i], temperature=0, stream=True,
                    max_tokens=3000 if long else 24, extra_body={"ignore_eos": long},
                )  # fmt: skip
                text, n = "", 0
                async for chunk in stream:
                    text += chunk.choices[0].text
                    n += 1
                    if long and n == 3:
                        await stream.close()
                        return None
                return text

            return await asyncio.gather(*(one(i) for i in range(16)))

    before = _aborts(server)
    texts = asyncio.run(run())
    assert {i: t for i, t in enumerate(texts) if i not in drop} == solo
    # a dropped stream is aborted at once: 3000 tokens would take minutes
    deadline = time.monotonic() + 20
    while (metric(server, "moesaic_cache_blocks_used") or metric(server, "moesaic_num_requests_active")) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert (
        metric(server, "moesaic_cache_blocks_used") == 0
        and metric(server, "moesaic_num_requests_active") == 0
    )
    assert _aborts(server) - before == len(drop)


def _aborts(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    m = re.search(r'^moesaic_request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    before = _aborts(server)
    body = {"model": "demo-mistral4", "prompt": "a long one", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.5
        )
    deadline = time.monotonic() + 20
    while _aborts(server) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborts(server) == before + 1 and metric(server, "moesaic_cache_blocks_used") == 0


# ----------------------------------------------------------------------------- Anthropic


def test_anthropic_messages_streamed_and_not(server, client):
    a = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model="demo-mistral4", messages=MESSAGES, max_tokens=16, temperature=0
    )
    user = [{"role": "user", "content": "Hello there"}]
    greedy_body = {"temperature": 0}  # this client no longer has the argument; the API still takes it
    m = a.messages.create(
        model="demo-mistral4", max_tokens=16, system="Be brief.", messages=user, extra_body=greedy_body
    )
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == (chat.choices[0].message.content or "")
    assert (
        m.usage.input_tokens == chat.usage.prompt_tokens
        and m.usage.output_tokens == chat.usage.completion_tokens
    )
    assert (
        m.stop_reason
        == {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}[
            chat.choices[0].finish_reason
        ]
    )
    with a.messages.stream(
        model="demo-mistral4", max_tokens=16, system="Be brief.", messages=user, extra_body=greedy_body
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.usage.output_tokens == m.usage.output_tokens
    count = a.messages.count_tokens(model="demo-mistral4", system="Be brief.", messages=user)
    assert count.input_tokens == m.usage.input_tokens
    with pytest.raises(anthropic.NotFoundError) as e:
        a.messages.create(model="nope", max_tokens=4, messages=user)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="demo-mistral4", max_tokens=4, messages=user
        )


# ----------------------------------------------------------------------------- errors from the real server


def test_errors_over_http_then_a_normal_request(server, client, llm):
    url = server.url
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [
        (httpx.post(url + "/v1/completions", json={"model": "demo-mistral4", "prompt": "x"}), 401),
        (httpx.post(url + "/v1/completions", json={"model": "demo-mistral4", "prompt": "x"}, headers={"Authorization": "Bearer no"}), 401),
        (httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=auth), 404),
        (httpx.post(url + "/v1/nothing", json={}, headers=auth), 404),
        (httpx.post(url + "/v1/completions", content=b'{"prompt": ', headers=dict(auth, **{"content-type": "application/json"})), 400),
        (httpx.post(url + "/v1/completions", content=b"x" * 70000, headers=auth), 413),
        (httpx.post(url + "/v1/chat/completions", json={"model": "demo-mistral4", "messages": MESSAGES, "max_tokens": 10**6}, headers=auth), 400),
    ]  # fmt: skip
    for r, status in cases:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == status and err["message"] and "type" in err and "param" in err
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo-mistral4", prompt="x", max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    assert httpx.get(url + "/health").status_code == 200  # open without a key
    ref = llm.generate(["after"], greedy(max_tokens=6))[0]
    assert (
        client.completions.create(model="demo-mistral4", prompt="after", max_tokens=6, temperature=0)
        .choices[0]
        .text
        == ref.text
    )
    assert [m.id for m in client.models.list().data] == ["demo-mistral4"]


# ----------------------------------------------------------------------------- SIGTERM (last: it stops the server)


def test_sigterm_drains_the_running_stream_and_exits_0(server, llm):
    ref = llm.generate(["drain me"], greedy(max_tokens=40, ignore_eos=True))[0]
    got, first = [], threading.Event()

    def read():
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        s = c.completions.create(model="demo-mistral4", prompt="drain me", max_tokens=40, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})  # fmt: skip
        for chunk in s:
            got.append(chunk.choices[0])
            first.set()

    t = threading.Thread(target=read)
    t.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert server.proc.wait(60) == 0
    assert "".join(c.text for c in got) == ref.text and got[-1].finish_reason == "length"
    log = server.log.read_text()
    assert re.search(r"cmpl-\w+: \d+ prompt tokens, 40 completion tokens, [\d.]+ s, length", log), log[-2000:]
