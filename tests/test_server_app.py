"""The server app in this process (httpx's ASGITransport under the official openai and anthropic clients),
on the Nemotron-H and Kimi K3 demos (a Jinja-template family and an encoder family):

- tool calls and reasoning end to end: the model's tokens are scripted through the engine's own
  logits_processor hook to a golden output of the family (reasoning, content, a typed call), and every
  surface (chat streamed and not, Anthropic streamed and not) must carry exactly the parser's reading of
  it, with no markup left;
- forced tool calls (tool_choice required / named) are grammars whose arguments validate;
- more than 15 malformed or impossible requests, each with its status and error body, then a normal one;
- an error inside a stream is an error frame followed by [DONE]; the engine hooks the server relies on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

import moesaic
from moesaic.errors import RequestError
from moesaic.server.app import build_app
from moesaic.server.chat import chat_format_for, read_chat_template
from moesaic.server.grammar import Grammars
from moesaic.server.parsers import parse, thinking_for_prompt
from moesaic.tokenizer import HFTokenizer

KEY = "sk-in-process"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class App:
    """A served demo and a second copy of it for reference generation (the two never share an engine)."""

    def __init__(self, demo: str, name: str, **kw):
        self.llm = moesaic.LLM(demo, dtype="float32")
        self.ref = moesaic.LLM(demo, dtype="float32")
        self.app = build_app(self.llm, api_keys=[KEY], served_model_names=[name], **kw)
        self.srv = self.app.state.moesaic
        self.name = name

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://moesaic", timeout=120
        )

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url="http://moesaic/v1", api_key=KEY, http_client=self.http(), max_retries=0
        )

    def anthropic(self) -> anthropic.AsyncAnthropic:
        import httpx2  # this anthropic client's own fork of httpx

        transport = httpx2.ASGITransport(app=self.app)
        http = httpx2.AsyncClient(transport=transport, base_url="http://moesaic", timeout=120)
        return anthropic.AsyncAnthropic(
            base_url="http://moesaic", api_key=KEY, http_client=http, max_retries=0
        )

    def close(self):
        self.srv.engine.shutdown(timeout=5)


@pytest.fixture(scope="module")
def nemo():
    a = App("demo-nemotron-h", "nemo", max_body_bytes=65536)
    yield a
    a.close()


@pytest.fixture(scope="module")
def k3():
    a = App("demo-kimi-k3", "k3")
    yield a
    a.close()


def run(coro):
    return asyncio.run(coro)


class Script:
    """A logits processor that lets only the next token of `ids` through: the model 'says' the script."""

    def __init__(self, ids, fail_at=None):
        self.ids, self.k, self.fail_at = ids, 0, fail_at

    def mask(self, logits):
        x = torch.full_like(logits, float("-inf"))
        x[self.ids[min(self.k, len(self.ids) - 1)]] = 0.0
        return x

    def accept(self, token):
        if self.k == self.fail_at:
            raise RequestError("scripted failure")
        self.k += 1


def script(monkeypatch, a: App, text: str, end: str | None, fail_at=None):
    """Makes every request of `a` generate `text` (then the end-of-turn marker `end`)."""
    tok = a.llm.tokenizer
    ids = tok.encode(text, add_bos=False) + ([tok.special[end]] if end else [])
    submit = a.srv.submit

    def scripted(prompt, params, rid):
        return submit(prompt, dataclasses.replace(params, logits_processor=lambda: Script(ids, fail_at)), rid)

    monkeypatch.setattr(a.srv, "submit", scripted)
    return len(ids)


MARKUP = re.compile(r"<\|?/?(think|tool_call|function|parameter|open|close|sep|end_of_msg)")

GOLDEN = {
    # Nemotron-H (Qwen3-coder XML calls); the prompt opens the reasoning
    "nemo": (
        "Look it up.\n</think>\nChecking.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<|im_end|>",
        "nemotron",
        "nemotron_h",
    ),
    # Kimi K3 (XTML channels): think, response, then a tools block
    "k3": (
        "Look it up.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
        'type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3'
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
        "<|end_of_msg|>",
        "kimi_k3",
        "kimi_k3",
    ),
}


@pytest.mark.parametrize("which", ["nemo", "k3"])
def test_tool_calls_and_reasoning_on_every_surface(which, request, monkeypatch):
    """Nemotron-H on every surface with the tools in the prompt; Kimi K3 (a slower demo) on the chat route,
    streamed and not, without them (markup is parsed anyway; the values typed by the format's hints)."""
    a = request.getfixturevalue(which)
    every = which == "nemo"
    tools = TOOLS if every else None
    text, end, parser, model_type = GOLDEN[which]
    n = script(monkeypatch, a, text, end)
    prompt = chat_format_for(model_type, read_chat_template(a.llm.path)).render(ASK, tools=tools)
    want = parse(parser, text, tools, thinking_for_prompt(parser, prompt))
    assert want.reasoning == "Look it up." and want.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in want.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]

    async def go():
        async with a.http() as h:
            tokens = (await h.post("/tokenize", json={"messages": ASK, "tools": tools})).json()
        assert tokens["tokens"] == a.llm.tokenizer.encode(prompt, add_bos=False)
        c = a.openai()
        extra = {"tools": tools} if tools else {}
        r = await c.chat.completions.create(model=a.name, messages=ASK, max_tokens=400, **extra)
        chunks = [ch async for ch in await c.chat.completions.create(
            model=a.name, messages=ASK, max_tokens=400, stream=True, **extra)]  # fmt: skip
        if not every:
            return r, chunks, None, None, None, None
        none = await c.chat.completions.create(
            model=a.name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=400
        )
        an = a.anthropic()
        schemas = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
        m = await an.messages.create(model=a.name, max_tokens=400, messages=ASK, tools=schemas)
        async with an.messages.stream(model=a.name, max_tokens=400, messages=ASK, tools=schemas) as s:
            events = [e async for e in s]
            final = await s.get_final_message()
        return r, chunks, none, m, events, final

    r, chunks, none, m, events, final = run(go())
    msg = r.choices[0].message
    assert msg.content == want.content and msg.reasoning == want.reasoning == msg.reasoning_content
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [
        (c.name, c.arguments) for c in want.tool_calls
    ]
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens == n
    assert not MARKUP.search(msg.content + msg.reasoning + msg.tool_calls[0].function.arguments)
    # the stream: the deltas add up to the same message; the call's id and name come once, first
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning", None) or "" for ch in chunks if ch.choices)
    pieces = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
    assert (content, reasoning) == (want.content, want.reasoning)
    assert pieces[0].id and pieces[0].function.name == "get_weather" and all(p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == want.tool_calls[0].arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    if not every:
        return
    # tool_choice "none": the tools are not offered and no call is returned
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    # Anthropic: thinking, text and tool_use blocks, the input typed by the schema
    for msg_ in (m, final):
        kinds = [b.type for b in msg_.content]
        assert kinds == ["thinking", "text", "tool_use"] and msg_.stop_reason == "tool_use"
        assert msg_.content[0].thinking == want.reasoning and msg_.content[1].text == want.content
        assert msg_.content[2].name == "get_weather" and msg_.content[2].input == {"city": "Paris", "days": 3}
    assert [e.type for e in events][0] == "message_start" and [e.type for e in events][-1] == "message_stop"


def test_forced_tool_calls_are_grammars(nemo):
    params = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip

    async def go():
        c = nemo.openai()
        named = await c.chat.completions.create(
            model="nemo", messages=ASK, tools=tools, max_tokens=200, temperature=1.0, seed=5,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        required = await c.chat.completions.create(
            model="nemo",
            messages=ASK,
            tools=tools,
            max_tokens=300,
            temperature=1.0,
            seed=6,
            tool_choice="required",
        )
        single = await c.chat.completions.create(
            model="nemo", messages=ASK, tools=tools, max_tokens=300, temperature=1.0, seed=6, n=2,
            tool_choice="required", parallel_tool_calls=False,
        )  # fmt: skip
        return named, required, single

    named, required, single = run(go())
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), params)
    assert len(required.choices[0].message.tool_calls) == 2  # this seed's sample calls twice
    for choice in required.choices + single.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for t in choice.message.tool_calls:
            schema = params if t.function.name == "get_weather" else {"type": "object", "properties": {}}
            jsonschema.validate(json.loads(t.function.arguments), schema)


def test_chat_prompt_of_an_encoder_family(k3):
    """Kimi K3 ships no template: the server renders with moesaic's encoder, reasoning switches included."""

    async def go():
        async with k3.http() as h:
            auth = {"Authorization": f"Bearer {KEY}"}
            on = (await h.post("/tokenize", json={"messages": ASK}, headers=auth)).json()["tokens"]
            off = await h.post(
                "/tokenize", json={"messages": ASK, "chat_template_kwargs": {"thinking": False}}
            )
            return on, off.json()["tokens"]

    on, off = run(go())
    fmt = chat_format_for("kimi_k3")
    assert k3.llm.tokenizer.decode(on, skip_special_tokens=False) == fmt.render(ASK)
    assert (
        k3.llm.tokenizer.decode(off, skip_special_tokens=False)
        == fmt.render(ASK, thinking=False)
        != fmt.render(ASK)
    )
    assert k3.llm.tokenizer.special["<|open|>"] in on  # the markers are single tokens


# ----------------------------------------------------------------------------- bad input


def test_malformed_and_impossible_requests_then_a_normal_one(nemo):
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": "nemo", "messages": ASK, "max_tokens": 4}
    long_prompt = list(range(3, 200)) * 25  # 4925 tokens: past the demo's 4096
    cases = [
        # (method, path, body, headers, status, param)
        ("POST", "/v1/chat/completions", chat, {}, 401, None),
        ("POST", "/v1/chat/completions", chat, {"Authorization": "Bearer wrong"}, 401, None),
        ("POST", "/v1/chat/completions", dict(chat, model="gpt-9"), auth, 404, "model"),
        ("POST", "/v1/nowhere", {}, auth, 404, None),
        ("GET", "/v1/chat/completions", None, auth, 405, None),
        ("POST", "/v1/chat/completions", b'{"model": "nemo", "messages": [', auth, 400, None),
        ("POST", "/v1/chat/completions", dict(chat, messages="hi"), auth, 400, "messages"),
        ("POST", "/v1/chat/completions", dict(chat, messages=[]), auth, 400, "messages"),
        ("POST", "/v1/chat/completions", dict(chat, messages=[{"role": "wizard", "content": "x"}]), auth, 400, None),
        ("POST", "/v1/chat/completions", dict(chat, temperature=-1), auth, 400, "temperature"),
        ("POST", "/v1/chat/completions", dict(chat, n=0), auth, 400, "n"),
        ("POST", "/v1/chat/completions", dict(chat, top_logprobs=3), auth, 400, "top_logprobs"),
        ("POST", "/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=50), auth, 400, "logprobs"),
        ("POST", "/v1/chat/completions", dict(chat, max_tokens=5000), auth, 400, "max_tokens"),
        ("POST", "/v1/chat/completions", dict(chat, seed=2**64), auth, 400, "seed"),
        ("POST", "/v1/chat/completions", dict(chat, stop_token_ids=[10**6]), auth, 400, "stop_token_ids"),
        ("POST", "/v1/chat/completions", dict(chat, logit_bias={"5": 1.0}), auth, 400, "logit_bias"),
        ("POST", "/v1/chat/completions",
         dict(chat, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
         auth, 400, "response_format.json_schema"),
        ("POST", "/v1/chat/completions", dict(chat, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         auth, 400, "tool_choice"),
        ("POST", "/v1/chat/completions", dict(chat, tool_choice="required"), auth, 400, "tool_choice"),
        ("POST", "/v1/completions", {"model": "nemo", "prompt": [1, 2, 10**6]}, auth, 400, "prompt"),
        ("POST", "/v1/completions", {"model": "nemo", "prompt": long_prompt}, auth, 400, "prompt"),
        ("POST", "/v1/completions", {"model": "nemo", "prompt": ""}, auth, 400, "prompt"),
        ("POST", "/v1/completions", {"model": "nemo", "prompt": "x", "max_tokens": "many"}, auth, 400, "max_tokens"),
        ("POST", "/v1/completions", {"model": "nemo", "prompt": "x" * 70000}, auth, 413, None),
        ("POST", "/detokenize", {"tokens": [1, -4]}, {}, 400, "tokens"),
    ]  # fmt: skip

    async def go():
        out = []
        async with nemo.http() as h:
            for method, path, body, headers, status, param in cases:
                if isinstance(body, bytes):
                    r = await h.request(
                        method,
                        path,
                        content=body,
                        headers=dict(headers, **{"content-type": "application/json"}),
                    )
                else:
                    r = await h.request(method, path, json=body, headers=headers)
                out.append((r, status, param, path))
            # Anthropic routes answer with Anthropic's envelope
            bad = await h.post("/v1/messages", json={"model": "nemo", "messages": ASK}, headers=auth)
            anon = await h.post("/v1/messages", json={"model": "nemo", "max_tokens": 4, "messages": ASK})
            # 503: shutting down, overloaded
            nemo.srv.draining = True
            draining = await h.post("/v1/chat/completions", json=chat, headers=auth)
            health = await h.get("/health")
            nemo.srv.draining, nemo.srv.max_pending = False, 0
            busy = await h.post(
                "/v1/messages", json={"model": "nemo", "max_tokens": 4, "messages": ASK}, headers=auth
            )
            nemo.srv.max_pending = 1024
            ok = await h.post("/v1/completions", json={"model": "nemo", "prompt": "fine", "max_tokens": 6, "temperature": 0},
                              headers=auth)  # fmt: skip
        return out, bad, anon, draining, health, busy, ok

    out, bad, anon, draining, health, busy, ok = run(go())
    assert len(cases) >= 15
    for r, status, param, path in out:
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == status and isinstance(err["message"], str) and err["message"], r.text
        assert err["type"].endswith("Error"), r.text
        if param is not None:
            assert err["param"] == param, (path, r.text)
    for r, status, kind in ((bad, 400, "invalid_request_error"), (anon, 401, "authentication_error"),
                            (busy, 503, "overloaded_error")):  # fmt: skip
        assert r.status_code == status and r.json() == {
            "type": "error",
            "error": {"type": kind, "message": r.json()["error"]["message"]},
        }
    assert (
        draining.status_code == 503 and draining.json()["error"]["code"] == 503 and health.status_code == 503
    )
    ref = nemo.ref.generate(["fine"], moesaic.SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref.text


def test_an_error_inside_a_stream_is_an_error_frame_then_done(nemo, monkeypatch):
    script(monkeypatch, nemo, "abcdefgh", None, fail_at=3)

    async def go():
        async with nemo.http() as h:
            auth = {"Authorization": f"Bearer {KEY}"}
            body = {"model": "nemo", "messages": ASK, "max_tokens": 8, "stream": True}
            oa = await h.post("/v1/chat/completions", json=body, headers=auth)
            an = await h.post("/v1/messages", json=dict(body, max_tokens=8), headers=auth)
            monkeypatch.undo()
            ok = await h.post(
                "/v1/completions", json={"model": "nemo", "prompt": "x", "max_tokens": 3}, headers=auth
            )
            metrics = await h.get("/metrics")
            return oa, an, ok, metrics

    oa, an, ok, metrics = run(go())
    frames = [line[6:] for line in oa.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["message"] == "scripted failure"
    assert json.loads(frames[-2])["error"]["code"] == 400
    deltas = [json.loads(f).get("choices", [{}])[0].get("delta", {}) for f in frames[:-2]]
    assert "".join(d.get("reasoning", "") + d.get("content", "") for d in deltas) == "abc"  # what came before
    assert "event: error" in an.text and '"type": "error"' in an.text and "[DONE]" not in an.text
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) >= 0
    assert re.search(r"^moesaic_cache_blocks_used\S* 0\.0$", metrics.text, re.M)
    assert re.search(r'finished_reason="error"\} [1-9]', metrics.text) or "error" in metrics.text


def test_models_health_tokenize_and_metrics(nemo):
    async def go():
        async with nemo.http() as h:
            auth = {"Authorization": f"Bearer {KEY}"}
            models = (await h.get("/v1/models", headers=auth)).json()
            tok = (await h.post("/tokenize", json={"prompt": "héllo <think>"})).json()
            detok = (await h.post("/detokenize", json={"tokens": tok["tokens"]})).json()
            r = (await h.post("/v1/completions", json={"model": "nemo", "prompt": "count me", "max_tokens": 5,
                                                       "ignore_eos": True}, headers=auth)).json()  # fmt: skip
            metrics = (await h.get("/metrics")).text
            return models, tok, detok, r, metrics, (await h.get("/health")).status_code

    models, tok, detok, r, metrics, health = run(go())
    assert [m["id"] for m in models["data"]] == ["nemo"] and models["data"][0]["max_model_len"] == 4096
    assert tok["tokens"] == nemo.llm.tokenizer.encode("héllo <think>") and tok["count"] == len(tok["tokens"])
    assert tok["tokens"][-1] == nemo.llm.tokenizer.special["<think>"]  # a marker is one token
    assert detok["prompt"] == "héllo " and health == 200
    assert r["usage"]["completion_tokens"] == 5

    def value(name):
        m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", metrics, re.M)
        return float(m.group(1))

    assert value("moesaic_generation_tokens_total") >= 5 and value("moesaic_prompt_tokens_total") >= 9
    assert value("moesaic_time_to_first_token_seconds_count") >= 1 and value("moesaic_cache_blocks_total") > 0
    assert "moesaic_num_requests_running" in metrics and "moesaic_prefix_cache_hit_rate" in metrics


# ----------------------------------------------------------------------------- what the server relies on


def test_engine_hooks_min_p_skip_special_tokens_and_the_logits_processor(nemo):
    llm = nemo.ref
    greedy = llm.generate(["min p"], moesaic.SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
    # min_p = 1 keeps only the most likely token: sampling at any temperature is the argmax
    assert (
        llm.generate(["min p"], moesaic.SamplingParams(max_tokens=8, temperature=2.0, min_p=1.0, seed=1))[
            0
        ].token_ids
        == greedy
    )
    think = llm.tokenizer.special["<think>"]
    seen = []

    class Force:
        def mask(self, logits):
            x = logits.clone()
            x[:] = float("-inf")
            x[think] = 0.0
            return x

        def accept(self, token):
            seen.append(token)

    sp = dict(max_tokens=3, temperature=0.0, logits_processor=Force, logprobs=1)
    shown, hidden = llm.generate(
        ["x", "x"], [moesaic.SamplingParams(**sp, skip_special_tokens=False), moesaic.SamplingParams(**sp)]
    )
    assert shown.token_ids == [think] * 3 and seen == [think] * 6
    assert shown.text == "<think>" * 3 and hidden.text == ""
    # the logprobs stay the model's own: the forced token is not given probability 1
    assert all(lp[think] < 0 for lp in shown.logprobs)
    with pytest.raises(RequestError, match="min_p"):
        llm.generate(["x"], moesaic.SamplingParams(min_p=1.5))


def test_grammar_on_a_tokenizer_json_vocabulary(tmp_path):
    """grammar.py reads a byte-level BPE `tokenizer.json` through xgrammar's own detection: a valid JSON
    text's tokens are each allowed in turn, then only EOS; a token that breaks the schema is masked."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(['{"name": "Paris", "age": 30}', '{"ok": true, "color": "red"}'] * 50, trainer)
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = HFTokenizer(tmp_path)
    eos = tok.eos_ids[0]
    g = Grammars(tok, tok.vocab_size, [eos])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    proc = g.processor(g.json_schema(schema))()
    for t in tok.encode('{"name": "Rome", "age": 7}', add_bos=False):
        assert proc.mask(torch.zeros(tok.vocab_size))[t] == 0.0
        proc.accept(t)
    allowed = (proc.mask(torch.zeros(tok.vocab_size)) == 0).nonzero().flatten().tolist()
    assert allowed == [eos]
    other = g.processor(g.json_schema(schema))()
    brace = tok.encode("{", add_bos=False)[0]
    other.accept(brace)
    bad = tok.encode("7", add_bos=False)[0]  # a value where a key must come
    assert other.mask(torch.zeros(tok.vocab_size))[bad] == float("-inf")
    with pytest.raises(RequestError, match="does not continue"):
        other.accept(bad)
    with pytest.raises(RequestError, match="cannot be compiled"):
        g.json_schema({"type": "objectx"})


def test_speculative_decoding_behind_the_server_and_its_metrics():
    """A server whose engine drafts (n-gram): completions equal the plain engine's greedy text, and /metrics
    carries the drafting counters the engine reports."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = moesaic.LLM("demo-mistral4", dtype="float32", speculative_config=spec)
    ref = moesaic.LLM("demo-mistral4", dtype="float32")
    app = build_app(llm, api_keys=[KEY], served_model_names=["spec"])
    prompt = "abc abc abc abc abc abc abc"
    want = ref.generate([prompt], moesaic.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[
        0
    ].text

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://moesaic", timeout=120) as h:
            body = {"model": "spec", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            r = (
                await h.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
            ).json()
            return r, (await h.get("/metrics")).text

    try:
        r, metrics = run(go())
    finally:
        app.state.moesaic.engine.shutdown(timeout=5)
    assert r["choices"][0]["text"] == want
    s = llm.stats()["speculative"]
    assert s["drafted"] > 0

    def value(metric):
        m = re.search(rf"^{metric}\{{[^}}]*\}} (\S+)$", metrics, re.M)
        return float(m.group(1))

    assert value("moesaic_spec_decode_num_draft_tokens_total") == s["drafted"]
    assert value("moesaic_spec_decode_num_accepted_tokens_total") == s["accepted"]
    assert value("moesaic_spec_decode_num_drafts_total") == s["rounds"]
    assert value("moesaic_spec_decode_gated_steps_total") == s["gated_steps"]
    per = re.findall(r'^moesaic_spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"\} (\S+)$',
                     metrics, re.M)  # fmt: skip
    assert [float(v) for _, v in per] == s["per_position_accepted"]
