"""The OpenAI surface: /v1/completions and /v1/chat/completions, streamed (SSE) and not.

A chat choice's text goes through the family's output parser (parsers/), which splits reasoning, content
and tool calls; a streamed choice sends what the parser releases, so the deltas add up to the non-streamed
message. Structured output (`response_format`) and forced tool calls (`tool_choice` "required" or a named
function) are grammars (grammar.py): their output is JSON, sent as content or as the calls' arguments.
vLLM's conventions: `reasoning` (and its older name `reasoning_content`) beside `content`; every chunk has
`finish_reason: null` until the choice's last; with `stream_options.include_usage` each chunk carries
`usage: null` and a last chunk with `choices: []` carries the usage; `data: [DONE]` ends the stream, after
an error frame if the request fails on the way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from moesaic.engine.sampler import SEED_LIMIT, SamplingParams
from moesaic.errors import MoesaicError
from moesaic.tokenizer import BYTE_OFFSET, ByteTokenizer

from . import errors
from .chat.common import options, thinking_on
from .errors import HTTPError
from .parsers import Delta, ToolCallDelta, make_parser, merge_deltas, thinking_for_prompt

log = logging.getLogger("moesaic.server")

# ----------------------------------------------------------------------------- shared


def sampling(
    srv, body, max_tokens: int, logprobs, processor=None, skip_special_tokens=None
) -> SamplingParams:
    """The engine's SamplingParams of a request (OpenAI's defaults: temperature 1, top_p 1)."""
    if body.logit_bias:
        raise HTTPError(400, "logit_bias is not supported", "logit_bias")
    stop = body.stop
    if isinstance(stop, list) and not stop:
        stop = None
    p = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        min_p=body.min_p or 0.0,
        seed=None if body.seed is None else body.seed % SEED_LIMIT,
        stop_token_ids=list(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        n=body.n,
        stop=stop,
        logprobs=logprobs,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        skip_special_tokens=body.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        logits_processor=processor,
    )
    try:
        p.validate()
    except MoesaicError as e:
        param = str(e).split(" ", 1)[0]
        raise HTTPError(400, str(e), param if hasattr(body, param) else None) from None
    bad = [t for t in p.stop_token_ids if not 0 <= t < srv.vocab_size]
    if bad:
        raise HTTPError(
            400,
            f"stop_token_ids {bad[:5]} are outside the vocabulary (0..{srv.vocab_size - 1})",
            "stop_token_ids",
        )
    return p


def request_id() -> str:
    return uuid.uuid4().hex


def usage_dict(usages) -> dict:
    """OpenAI's usage from the engine's (one per prompt)."""
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    completion = sum(u.get("completion_tokens", 0) for u in usages)
    cached = sum(u.get("cached_tokens", 0) for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def outputs(gens):
    """(prompt index, RequestOutput) from every prompt's iterator as they come. Leaving early (an error, a
    disconnect) closes every iterator, which aborts its request in the engine."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class Tracker:
    """A request's bookkeeping for the log line and the metrics: its usage per prompt, first token time,
    finish reason."""

    def __init__(self, srv, request_id: str, prompts: int):
        self.srv, self.id = srv, request_id
        self.start = time.perf_counter()
        self.first = None
        self.usages = [{} for _ in range(prompts)]
        self.reason = None

    def saw(self, i: int, out) -> None:
        self.usages[i] = out.usage
        if self.first is None and any(o.token_ids for o in out.outputs):
            self.first = time.perf_counter()
        if out.finished:
            self.reason = self.reason or next((o.finish_reason for o in out.outputs if o.finish_reason), None)

    def done(self, reason: str | None = None) -> None:
        u = usage_dict(self.usages)
        self.srv.request_done(
            self.id, reason or self.reason, u["prompt_tokens"], u["completion_tokens"], self.start, self.first
        )


def sse(events, anthropic: bool = False) -> StreamingResponse:
    """An SSE response of the dicts `events` yields; a failure on the way is an error frame (then `[DONE]`
    on OpenAI routes; Anthropic streams end with their error event)."""

    async def frames():
        try:
            async for item in events:
                if anthropic:
                    yield f"event: {item['type']}\ndata: {json.dumps(item, ensure_ascii=False)}\n\n"
                else:
                    yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
        except Exception as e:
            err = errors.from_exception(e)
            if err.status >= 500:
                log.exception("moesaic: a stream failed")
            body = json.dumps(errors.body(err, anthropic))
            yield f"event: error\ndata: {body}\n\n" if anthropic else f"data: {body}\n\n"
            if anthropic:
                return
        if not anthropic:
            yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def until_disconnected(request: Request, work):
    """Runs `work` (a coroutine) unless the client goes first: vLLM's `with_cancellation`, listening for
    `http.disconnect` on receive(). A disconnect cancels `work`, which aborts its requests at once."""
    task = asyncio.ensure_future(work)

    async def gone():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return Response(status_code=499)  # nobody reads it
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


def token_text(srv, tid: int) -> str:
    """A token as logprobs show it: its text, or `bytes:\\xNN` for a byte that is part of a character."""
    text = srv.tokenizer.decode([tid], skip_special_tokens=False) if srv.tokenizer else ""
    if "\ufffd" in text and isinstance(srv.tokenizer, ByteTokenizer) and tid >= BYTE_OFFSET:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(srv, tid))
    return text


def token_bytes(srv, tid: int) -> list[int]:
    if isinstance(srv.tokenizer, ByteTokenizer) and BYTE_OFFSET <= tid < 256 + BYTE_OFFSET:
        return [tid - BYTE_OFFSET]
    return list((srv.tokenizer.decode([tid], skip_special_tokens=False) if srv.tokenizer else "").encode())


def top_sorted(lp: dict, k: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])[:k]


# ----------------------------------------------------------------------------- /v1/completions


def completion_prompts(srv, prompt) -> list[list[int]]:
    """The token ids of each prompt: text, token ids, or a list of either."""
    if prompt == "" or (isinstance(prompt, list) and "" in prompt):
        raise HTTPError(400, "prompt is empty: give some text or token ids", "prompt")
    if isinstance(prompt, str):
        prompts = [srv.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif prompt:
        prompts = [srv.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    else:
        raise HTTPError(400, "prompt is empty", "prompt")
    for ids in prompts:
        srv.check_ids(ids)
    return prompts


def completion_logprobs(srv, token_ids, lps, k: int, offset: int) -> dict:
    tokens = [token_text(srv, t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp[t] for t, lp in zip(token_ids, lps)],
        "top_logprobs": [{token_text(srv, i): v for i, v in top_sorted(lp, k)} for lp in lps],
        "text_offset": offsets,
    }


async def completions(srv, body, request: Request):
    srv.check_model(body.model)
    rid = f"cmpl-{request_id()}"
    if body.unknown_fields:
        log.warning("%s: ignoring unknown fields %s", rid, body.unknown_fields)
    if body.suffix:
        raise HTTPError(400, "suffix is not supported", "suffix")
    if body.echo and body.logprobs is not None:
        raise HTTPError(
            400, "echo with logprobs needs the prompt's logprobs, which are not supported", "echo"
        )
    if body.response_format is not None and body.response_format.type != "text":
        processor = await grammar_for(srv, body.response_format)
    else:
        processor = None
    prompts = completion_prompts(srv, body.prompt)
    max_tokens = min(srv.check_length(len(ids), body.max_tokens, "prompt") for ids in prompts)
    params = sampling(srv, body, max_tokens, body.logprobs, processor)
    gens = srv.submit_all(prompts, params, rid)
    n, name = body.n, body.model or srv.names[0]
    echo = [srv.tokenizer.decode(ids) if body.echo and srv.tokenizer else "" for ids in prompts]
    track = Tracker(srv, rid, len(prompts))
    created = int(time.time())

    def chunk(choices, usage=None, include=False):
        c = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
        if include:
            c["usage"] = usage
        return c

    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            offsets = {}
            try:
                async for i, out in outputs(gens):
                    track.saw(i, out)
                    entries = []
                    for o in out.outputs:
                        index = i * n + o.index
                        text = o.text
                        if index not in offsets:
                            offsets[index] = 0
                            text = echo[i] + text
                        lp = None
                        if body.logprobs is not None and o.logprobs:
                            lp = completion_logprobs(
                                srv, o.token_ids, o.logprobs, body.logprobs, offsets[index]
                            )
                        offsets[index] += len(text)
                        ids = body.return_token_ids and o.token_ids
                        if text or lp or ids or o.finish_reason:
                            e = {
                                "index": index,
                                "text": text,
                                "logprobs": lp,
                                "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason,
                            }
                            if body.return_token_ids:
                                e["token_ids"] = o.token_ids
                            entries.append(e)
                    if entries:
                        yield chunk(entries, None, include)
                if include:
                    yield chunk([], usage_dict(track.usages), True)
            finally:
                track.done()

        return sse(events())

    async def collect():
        texts = {}
        try:
            async for i, out in outputs(gens):
                track.saw(i, out)
                for o in out.outputs:
                    c = texts.setdefault(
                        i * n + o.index, {"text": echo[i], "ids": [], "lps": [], "reason": None}
                    )
                    c["text"] += o.text
                    c["ids"] += o.token_ids
                    c["lps"] += o.logprobs or []
                    if o.finish_reason:
                        c["reason"], c["stop"] = o.finish_reason, o.stop_reason
        finally:
            track.done()
        choices = []
        for index in sorted(texts):
            c = texts[index]
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(srv, c["ids"], c["lps"], body.logprobs, len(echo[index // n]))
            choices.append(
                {
                    "index": index,
                    "text": c["text"],
                    "logprobs": lp,
                    "finish_reason": c["reason"],
                    "stop_reason": c.get("stop"),
                }
            )
            if body.return_token_ids:
                choices[-1]["token_ids"] = c["ids"]
        return chunk(choices, usage_dict(track.usages), True)

    return await until_disconnected(request, collect())


async def grammar_for(srv, fmt):
    """The logits_processor factory of a response_format (json_object, json_schema)."""
    if srv.grammars is None:
        raise HTTPError(400, "response_format needs a tokenizer; this checkpoint has none", "response_format")
    if fmt.type == "json_object":
        schema, param = {"type": "object"}, "response_format"
    else:
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise HTTPError(
                400, "response_format json_schema needs json_schema.schema", "response_format.json_schema"
            )
        schema, param = fmt.json_schema.schema_, "response_format.json_schema"
    try:
        compiled = await asyncio.to_thread(srv.grammars.json_schema, schema, param)
    except MoesaicError as e:
        raise HTTPError(400, str(e), param) from None
    return srv.grammars.processor(compiled)


# ----------------------------------------------------------------------------- /v1/chat/completions


class ChatChoice:
    """One choice of a chat completion. `mode`: "parse" (the family's output parser), "text" (structured
    output: the text is the content), "named" (a forced function: the text is its arguments) or
    "required" (a JSON list of calls, read when complete). `drop_calls`: tool_choice "none"."""

    def __init__(self, index: int, mode: str, parser, forced: str | None = None, drop_calls: bool = False):
        self.index, self.mode, self.parser, self.forced, self.drop_calls = (
            index,
            mode,
            parser,
            forced,
            drop_calls,
        )
        self.text = ""
        self.has_calls = False
        self.started = False

    def feed(self, text: str, final: bool) -> Delta:
        self.text += text
        if self.mode == "parse":
            d = self.parser.feed(text) if text else Delta()
            if final:
                d = join(d, self.parser.finish())
        elif self.mode == "text":
            d = Delta(content=text)
        elif self.mode == "named":
            if not self.started:
                d = Delta(tool_calls=[ToolCallDelta(0, self.parser.new_id(), self.forced, text)])
            else:
                d = Delta(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])
        else:
            d = self._required() if final else Delta()
        self.started = True
        if self.drop_calls:
            d.tool_calls = []
        self.has_calls = self.has_calls or bool(d.tool_calls)
        return d

    def _required(self) -> Delta:
        try:
            calls = json.loads(self.text)
        except ValueError:  # cut off at max_tokens: the text stays content
            return Delta(content=self.text)
        if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
            return Delta(content=self.text)
        return Delta(
            tool_calls=[
                ToolCallDelta(
                    i,
                    self.parser.new_id(),
                    c["name"],
                    json.dumps(c.get("parameters", {}), ensure_ascii=False),
                )
                for i, c in enumerate(calls)
            ]
        )

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.has_calls and self.mode in ("parse", "required"):
            return "tool_calls"
        return reason


def join(a: Delta, b: Delta) -> Delta:
    """Two deltas as one (a piece of call i followed by more of call i becomes one piece)."""
    calls = list(a.tool_calls)
    for t in b.tool_calls:
        if calls and calls[-1].index == t.index and t.id is None:
            last = calls[-1]
            calls[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + t.arguments)
        else:
            calls.append(t)
    return Delta(a.reasoning + b.reasoning, a.content + b.content, calls)


def delta_dict(d: Delta) -> dict:
    out = {}
    if d.reasoning:
        out["reasoning"] = out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        calls = []
        for t in d.tool_calls:
            call = {"index": t.index, "function": {"arguments": t.arguments}}
            if t.id is not None:
                call.update(id=t.id, type="function")
            if t.name is not None:
                call["function"]["name"] = t.name
            calls.append(call)
        out["tool_calls"] = calls
    return out


def chat_logprobs(srv, token_ids, lps, k: int) -> list[dict]:
    def entry(tid, v):
        return {"token": token_text(srv, tid), "logprob": v, "bytes": token_bytes(srv, tid)}

    return [
        dict(entry(t, lp[t]), top_logprobs=[entry(i, v) for i, v in top_sorted(lp, k)])
        for t, lp in zip(token_ids, lps)
    ]


def tool_plan(srv, body):
    """(tools for the prompt, mode, the forced function's name, the JSON schema to force or None)."""
    tools, choice = body.tools or [], body.tool_choice
    names = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise HTTPError(400, f"tools[{i}] needs function.name", f"tools[{i}]")
        names[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise HTTPError(
                400, f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
            )
        return tools, "named", name, names[name]
    if choice not in ("auto", "none", "required"):
        raise HTTPError(
            400, f"tool_choice must be auto, none, required or a function, got {choice!r}", "tool_choice"
        )
    if choice == "required":
        if not tools:
            raise HTTPError(400, 'tool_choice "required" needs tools', "tool_choice")
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"],
            }
            for n, p in names.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return tools, "required", None, schema
    if choice == "none":
        return None, "parse", None, None
    return tools, "parse", None, None


async def chat(srv, body, request: Request):
    srv.check_model(body.model)
    rid = f"chatcmpl-{request_id()}"
    if body.unknown_fields:
        log.warning("%s: ignoring unknown fields %s", rid, body.unknown_fields)
    if body.top_logprobs is not None and not body.logprobs:
        raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    tools, mode, forced, schema = tool_plan(srv, body)
    processor = None
    if schema is not None:
        if body.response_format is not None and body.response_format.type != "text":
            raise HTTPError(
                400, "response_format cannot be combined with a forced tool_choice", "response_format"
            )
        if srv.grammars is None:
            raise HTTPError(400, "tool_choice needs a tokenizer; this checkpoint has none", "tool_choice")
        try:
            compiled = await asyncio.to_thread(srv.grammars.json_schema, schema, "tools")
        except MoesaicError as e:
            raise HTTPError(400, str(e), "tools") from None
        processor = srv.grammars.processor(compiled)
    elif body.response_format is not None and body.response_format.type != "text":
        processor = await grammar_for(srv, body.response_format)
        mode = "text"
    opts = options({"chat_template_kwargs": body.chat_template_kwargs or {}})
    if body.reasoning_effort is not None:
        opts["reasoning_effort"] = body.reasoning_effort
    requested = thinking_on(None, opts)
    constrained = processor is not None  # a grammar starts at the first token: no reasoning before it
    prompt = srv.render(
        body.messages,
        tools,
        thinking=False if constrained else None,
        reasoning_effort=body.reasoning_effort,
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
    )
    ids = srv.encode(prompt, add_bos=False)
    srv.check_ids(ids, "messages")
    wanted = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = srv.check_length(len(ids), wanted)
    k = body.top_logprobs or 0
    # the parser reads the family's markers, special tokens, from the text (a grammar never allows them)
    skip = body.skip_special_tokens if srv.parser == "plain" else False
    params = sampling(
        srv, body, max_tokens, k if body.logprobs else None, processor, skip_special_tokens=skip
    )
    thinking = thinking_for_prompt(srv.parser, prompt, default=requested and not constrained)
    gens = srv.submit_all([ids], params, rid)
    parsers = [make_parser(srv.parser, tools, thinking) for _ in range(body.n)]
    choices = [
        ChatChoice(i, mode, parsers[i], forced, drop_calls=body.tool_choice == "none") for i in range(body.n)
    ]
    name = body.model or srv.names[0]
    track = Tracker(srv, rid, 1)
    created = int(time.time())

    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(entries, usage=None):
            c = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": entries,
            }
            if include:
                c["usage"] = usage
            return c

        async def events():
            try:
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])  # fmt: skip
                async for _, out in outputs(gens):
                    track.saw(0, out)
                    entries = []
                    for o in out.outputs:
                        c = choices[o.index]
                        final = o.finish_reason is not None
                        d = c.feed(o.text, final)
                        lp = (
                            chat_logprobs(srv, o.token_ids, o.logprobs, k)
                            if body.logprobs and o.logprobs
                            else None
                        )
                        ids = body.return_token_ids and o.token_ids
                        if d or lp or ids or final:
                            e = {
                                "index": c.index,
                                "delta": delta_dict(d),
                                "logprobs": {"content": lp} if lp else None,
                                "finish_reason": c.finish_reason(o.finish_reason) if final else None,
                            }
                            if final:
                                e["stop_reason"] = o.stop_reason
                            if body.return_token_ids:
                                e["token_ids"] = o.token_ids
                            entries.append(e)
                    if entries:
                        yield chunk(entries)
                if include:
                    yield chunk([], usage_dict(track.usages))
            finally:
                track.done()

        return sse(events())

    async def collect():
        deltas = {c.index: [] for c in choices}
        tokens = {c.index: ([], []) for c in choices}
        ends = {}
        try:
            async for _, out in outputs(gens):
                track.saw(0, out)
                for o in out.outputs:
                    c = choices[o.index]
                    final = o.finish_reason is not None
                    deltas[c.index].append(c.feed(o.text, final))
                    tokens[c.index][0].extend(o.token_ids)
                    tokens[c.index][1].extend(o.logprobs or [])
                    if final:
                        ends[c.index] = (c.finish_reason(o.finish_reason), o.stop_reason)
        finally:
            track.done()
        result = []
        for c in choices:
            m = merge_deltas(deltas[c.index])
            message = {"role": "assistant", "content": m.content if (m.content or not m.tool_calls) else None}
            if m.reasoning:
                message["reasoning"] = message["reasoning_content"] = m.reasoning
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                    for t in m.tool_calls
                ]
            ids_, lps = tokens[c.index]
            reason, stop = ends.get(c.index, ("abort", None))
            result.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": {"content": chat_logprobs(srv, ids_, lps, k)} if body.logprobs else None,
                    "finish_reason": reason,
                    "stop_reason": stop,
                    **({"token_ids": ids_} if body.return_token_ids else {}),
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": result,
            "usage": usage_dict(track.usages),
        }

    return await until_disconnected(request, collect())
