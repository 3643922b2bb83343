"""The Anthropic surface: /v1/messages (streamed and not) and /v1/messages/count_tokens.

A Messages request becomes a chat request, as SGLang's Anthropic adapter does
(`entrypoints/anthropic/serving.py`): `system` is the system message, `tool_result` blocks are `tool`
messages, `tool_use` blocks the assistant's tool calls, `thinking` blocks its reasoning; tool_choice
`any` is "required" and `tool` a named function; `thinking: {"type": "enabled"|"disabled"}` switches the
reasoning. The stop reasons: EOS `end_turn`, a stop string `stop_sequence`, the length `max_tokens`,
tool calls `tool_use`. Streams are Anthropic's events (message_start, content_block_start / _delta /
_stop per block, message_delta, message_stop); an error is an `error` event.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request

from moesaic.errors import MoesaicError

from .chat.common import text_of
from .errors import HTTPError
from .openai import ChatChoice, Tracker, outputs, request_id, sampling, sse, tool_plan, until_disconnected
from .parsers import make_parser, merge_deltas, thinking_for_prompt
from .protocol import ChatRequest

log = logging.getLogger("moesaic.server")


def _text(content, where: str) -> str:
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") not in ("text", None):
                raise HTTPError(
                    400, f"{where}: content blocks of type {part.get('type')!r} are not supported here"
                )
    try:
        return text_of(content)
    except Exception as e:
        raise HTTPError(400, f"{where}: {e}") from None


def chat_messages(body) -> list[dict]:
    """The OpenAI chat messages of a Messages request."""
    out = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise HTTPError(
                400, f"messages[{i}].role must be user or assistant, got {role!r}", f"messages.{i}.role"
            )
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise HTTPError(
                400, f"messages[{i}].content must be a string or a list of blocks", f"messages.{i}.content"
            )
        text, reasoning, calls = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str):
                    raise HTTPError(400, f"{where}: tool_use needs a name")
                args = json.dumps(b.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {"name": b["name"], "arguments": args},
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = b.get("content")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.get("tool_use_id"),
                        "content": _text(result or "", where),
                    }
                )
            else:
                raise HTTPError(400, f"{where}: a {kind!r} block is not supported in a {role} message")
        if role == "user" and not text:
            continue  # only tool results
        msg = {"role": role, "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_tools(body):
    """(OpenAI tools, tool_choice) of a Messages request."""
    tools = []
    for i, t in enumerate(body.tools or ()):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise HTTPError(400, f"tools[{i}] needs a name", f"tools.{i}")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if choice is None:
        return tools, None
    kind = choice.get("type")
    if kind == "tool":
        return tools, {"type": "function", "function": {"name": choice.get("name")}}
    if kind not in ("auto", "any", "none"):
        raise HTTPError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice")
    return tools, {"auto": "auto", "any": "required", "none": "none"}[kind]


def thinking_switch(body):
    if body.thinking is None:
        return None
    kind = body.thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise HTTPError(400, f"thinking.type must be enabled or disabled, got {kind!r}", "thinking")
    return {"enabled": True, "disabled": False}.get(kind)


def stop_reason(reason, stop, has_calls: bool) -> tuple[str | None, str | None]:
    if reason == "stop" and has_calls:
        return "tool_use", None
    if reason == "stop":
        return ("stop_sequence", stop) if isinstance(stop, str) else ("end_turn", None)
    if reason == "length":
        return "max_tokens", None
    return reason, None


def _prompt(srv, body):
    tools, choice = chat_tools(body)
    thinking = thinking_switch(body)
    chat = ChatRequest(
        model=body.model, messages=chat_messages(body), tools=tools or None, tool_choice=choice
    )
    tools_for_prompt, mode, forced, schema = tool_plan(srv, chat)
    prompt = srv.render(chat.messages, tools_for_prompt, thinking=False if schema is not None else thinking)
    return chat, prompt, tools_for_prompt, mode, forced, schema, thinking


def count_tokens(srv, body) -> dict:
    srv.check_model(body.model)
    _, prompt, *_ = _prompt(srv, body)
    return {"input_tokens": len(srv.encode(prompt, add_bos=False))}


async def messages(srv, body, request: Request):
    srv.check_model(body.model)
    rid = f"msg_{request_id()}"
    if body.unknown_fields:
        log.warning("%s: ignoring unknown fields %s", rid, body.unknown_fields)
    chat, prompt, tools, mode, forced, schema, thinking = _prompt(srv, body)
    processor = None
    if schema is not None:
        try:
            compiled = await asyncio.to_thread(srv.grammars.json_schema, schema, "tools")
        except MoesaicError as e:
            raise HTTPError(400, str(e), "tools") from None
        processor = srv.grammars.processor(compiled)
    ids = srv.encode(prompt, add_bos=False)
    srv.check_ids(ids, "messages")
    max_tokens = srv.check_length(len(ids), body.max_tokens)
    sampling_body = ChatRequest(
        model=body.model,
        messages=chat.messages,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
    )
    skip = srv.parser == "plain"
    params = sampling(srv, sampling_body, max_tokens, None, processor, skip_special_tokens=skip)
    start_thinking = thinking_for_prompt(
        srv.parser, prompt, default=thinking is not False and processor is None
    )
    gens = srv.submit_all([ids], params, rid)
    choice = ChatChoice(
        0, mode, make_parser(srv.parser, tools, start_thinking), forced, drop_calls=chat.tool_choice == "none"
    )
    track = Tracker(srv, rid, 1)
    name = body.model

    if body.stream:
        return sse(_events(srv, rid, name, len(ids), choice, gens, track), anthropic=True)

    async def collect():
        deltas, end = [], ("abort", None)
        try:
            async for _, out in outputs(gens):
                track.saw(0, out)
                for o in out.outputs:
                    final = o.finish_reason is not None
                    deltas.append(choice.feed(o.text, final))
                    if final:
                        end = (o.finish_reason, o.stop_reason)
        finally:
            track.done()
        m = merge_deltas(deltas)
        content = []
        if m.reasoning:
            content.append({"type": "thinking", "thinking": m.reasoning, "signature": ""})
        if m.content:
            content.append({"type": "text", "text": m.content})
        for t in m.tool_calls:
            content.append({"type": "tool_use", "id": t.id, "name": t.name, "input": _input(t.arguments)})
        reason, stop = stop_reason(*end, bool(m.tool_calls))
        usage = track.usages[0]
        return {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": {
                "input_tokens": usage.get("prompt_tokens", len(ids)),
                "output_tokens": usage.get("completion_tokens", 0),
            },
        }

    return await until_disconnected(request, collect())


def _input(arguments: str):
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}


async def _events(srv, rid, name, prompt_tokens, choice, gens, track):
    """Anthropic's stream: one content block per kind of text (thinking, text) or per tool call, opened
    when its first piece comes and closed when another block starts or the message ends."""
    yield {
        "type": "message_start",
        "message": {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        },
    }
    block = {"index": -1, "kind": None, "call": None}

    def open_block(kind, content_block, call=None):
        events = close_block()
        block["index"] += 1
        block["kind"], block["call"] = kind, call
        events.append(
            {"type": "content_block_start", "index": block["index"], "content_block": content_block}
        )
        return events

    def close_block():
        if block["kind"] is None:
            return []
        block["kind"] = None
        return [{"type": "content_block_stop", "index": block["index"]}]

    end, calls = ("abort", None), False
    try:
        async for _, out in outputs(gens):
            track.saw(0, out)
            for o in out.outputs:
                final = o.finish_reason is not None
                d = choice.feed(o.text, final)
                events = []
                if d.reasoning:
                    if block["kind"] != "thinking":
                        events += open_block(
                            "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                        )
                    events.append(
                        {"type": "content_block_delta", "index": block["index"],
                         "delta": {"type": "thinking_delta", "thinking": d.reasoning}}
                    )  # fmt: skip
                if d.content:
                    if block["kind"] != "text":
                        events += open_block("text", {"type": "text", "text": ""})
                    events.append(
                        {"type": "content_block_delta", "index": block["index"],
                         "delta": {"type": "text_delta", "text": d.content}}
                    )  # fmt: skip
                for t in d.tool_calls:
                    calls = True
                    if block["kind"] != "tool_use" or block["call"] != t.index:
                        start = {"type": "tool_use", "id": t.id, "name": t.name, "input": {}}
                        events += open_block("tool_use", start, t.index)
                    if t.arguments:
                        events.append(
                            {"type": "content_block_delta", "index": block["index"],
                             "delta": {"type": "input_json_delta", "partial_json": t.arguments}}
                        )  # fmt: skip
                for e in events:
                    yield e
                if final:
                    end = (o.finish_reason, o.stop_reason)
        for e in close_block():
            yield e
        reason, stop = stop_reason(*end, calls)
        usage = track.usages[0]
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop},
            "usage": {"output_tokens": usage.get("completion_tokens", 0)},
        }
        yield {"type": "message_stop"}
    finally:
        track.done()
