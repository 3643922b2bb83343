"""Kimi K3 prompts: XTML messages (the release ships a Python encoder, no Jinja template).

    <|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>

- Every message is `<|open|>message role="R"[ attrs]<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>`;
  attribute values are escaped (& -> &amp;, " -> &quot;), bodies are raw.
- Tools come first, in a system message of type "tool-declare": "# Tools" and the OpenAI tool list
  as compact JSON with sorted keys. With thinking on, a "thinking-effort" system message follows
  (effort low/high/max, default max).
- An assistant turn holds channels: `think` (thinking mode only, even when empty), `response`, and
  `tools` with one `call tool="NAME" index="i"` per call and one `argument key="K" type="T"` per
  argument (strings raw, other values as JSON). Every turn keeps its reasoning.
- A tool result is `role="tool" tool="NAME" index="i"`, i counting the results after each assistant
  turn; results are put in the order of the calls they answer.
- The generation prompt opens the assistant message and its `think` channel (thinking on) or its
  `response` channel (off). tool_choice "required"/"none" and response_format add a system message.

Written from Moonshot's `encoding_k3.py` (as vendored in vLLM `vllm/tokenizers/encoding_k3.py`).
"""

from __future__ import annotations

import json

from moesaic.errors import RequestError

from .common import options, read_messages, text_of, thinking_on, tool_functions

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE = "<|kimi_image_placeholder|>"
EFFORTS = ("low", "high", "max")
JSON_REPLY = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)


def _attr(v) -> str:
    return str(v).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, **attrs) -> str:
    return OPEN + tag + "".join(f' {k}="{_attr(v)}"' for k, v in attrs.items()) + SEP


def _close(tag: str) -> str:
    return CLOSE + tag + SEP


def _message(body: str, **attrs) -> str:
    return _open("message", **attrs) + body + _close("message") + EOM


def _sorted(obj):
    if isinstance(obj, dict):
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_sorted(x) for x in obj]
    return obj


def _compact(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


class KimiK3Chat:
    """The Kimi K3 encoder. `render(..., reasoning_effort= / thinking_effort=, tool_choice=,
    response_format=)`."""

    def render(
        self, messages, tools=None, add_generation_prompt: bool = True, thinking=None, **kwargs
    ) -> str:
        opts = options(kwargs)
        thinking = thinking_on(thinking, opts)
        effort = opts.get("thinking_effort") or (
            opts.get("reasoning_effort") if opts.get("reasoning_effort") != "none" else None
        )
        effort = effort or "max"
        if thinking and effort not in EFFORTS:
            raise RequestError(f"reasoning_effort {effort!r}: Kimi K3 takes none, low, high or max")
        msgs = _in_call_order(read_messages(messages))
        out = []
        if tools:
            out.append(self._declare(tools, dynamic=False))
        if thinking:
            out.append(
                _message(
                    "`thinking_effort` guides on how much to think in your thinking channel (not including "
                    "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                    f"Now the system is invoked with `thinking_effort={effort}`.",
                    role="system",
                    type="thinking-effort",
                )
            )
        calls, results = [], 0
        for i, m in enumerate(msgs):
            role, name = m["role"], {"name": m["name"]} if m.get("name") else {}
            content = text_of(m.get("content"), image=IMAGE)
            if role == "user":
                out.append(_message(content, role="user", **name))
            elif role in ("system", "developer") and m.get("tools"):
                out.append(self._declare(m["tools"], dynamic=True))
            elif role in ("system", "developer"):
                out.append(_message(content, role="system", **name))
            elif role == "tool":
                results += 1
                tool = m.get("tool") or m.get("name")
                if tool is None and results <= len(calls):
                    tool = calls[results - 1]["name"]
                if tool is None:
                    raise RequestError(f"messages[{i}]: a tool result needs `name` or a matching tool call")
                out.append(_message(content, role="tool", tool=tool, index=results))
            else:
                calls, results = m["tool_calls"], 0
                out.append(_message(self._assistant(m, content, thinking), role="assistant", **name))
        choice = opts.get("tool_choice")
        if choice in ("required", "none"):
            rule = "You MUST call tools" if choice == "required" else "You MUST NOT call any tools"
            body = f"The system is invoked with `tool_choice={choice}`.\n{rule} in the next message."
            out.append(_message(body, role="system", type="tool-choice"))
        fmt = opts.get("response_format")
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            body = f"The system is invoked with `response_format=json_object`.\n{JSON_REPLY}"
            out.append(_message(body, role="system", type="response-format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema") or {}
            schema = _sorted(spec.get("schema", spec) if isinstance(spec, dict) else spec)
            body = (
                f"The system is invoked with `response_format=json_schema`.\n{JSON_REPLY}\n"
                f"The JSON data must match the following schema:\n```json\n{_compact(schema)}\n```"
            )
            out.append(_message(body, role="system", type="response-format"))
        if add_generation_prompt:
            out.append(_open("message", role="assistant") + _open("think" if thinking else "response"))
        return "".join(out)

    def _declare(self, tools, dynamic: bool) -> str:
        tool_functions(tools)  # checked: each tool names its function
        if dynamic:
            head = (
                "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools."
            )
        else:
            head = "# Tools\nHere are the available tools, described in JSONSchema."
        return _message(
            f"{head}\n\n```json\n{_compact(_sorted(tools))}\n```", role="system", type="tool-declare"
        )

    def _assistant(self, m: dict, content: str, thinking: bool) -> str:
        out = ""
        if thinking:
            reasoning = m.get("reasoning") or ""
            out += _open("think") + (reasoning if reasoning.strip() else "") + _close("think")
        out += _open("response") + content + _close("response")
        if m["tool_calls"]:
            out += _open("tools")
            for k, c in enumerate(m["tool_calls"], start=1):
                out += _open("call", tool=c["name"], index=k)
                args = c["arguments"]
                if isinstance(args, str):  # not JSON: passed on as written
                    out += _open("json", type="object") + args + _close("json")
                else:
                    for key, v in args.items():
                        value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                        out += _open("argument", key=key, type=_type(v)) + value + _close("argument")
                out += _close("call")
            out += _close("tools")
        return out


def _in_call_order(msgs: list[dict]) -> list[dict]:
    """Each run of tool results, sorted into the order of the calls they answer (by tool_call_id), and
    named after them; a run that does not match the calls is left as it is."""
    out, ids, i = [], {}, 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] != "tool":
            if m["role"] == "assistant":
                ids = {
                    str(c["id"]): (k, c["name"])
                    for k, c in enumerate(m["tool_calls"])
                    if c.get("id") is not None
                }
            out.append(m)
            i += 1
            continue
        run = []
        while i < len(msgs) and msgs[i]["role"] == "tool":
            run.append(msgs[i])
            i += 1
        keys = [ids.get(str(r.get("tool_call_id"))) for r in run]
        if all(keys):
            order = sorted(range(len(run)), key=lambda k: keys[k][0])
            run = [{**run[k], "tool": keys[k][1]} for k in order]
        out.extend(run)
    return out
