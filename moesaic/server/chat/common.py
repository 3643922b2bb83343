"""What the chat formats share: reading OpenAI-style messages and the thinking switches of a request."""

from __future__ import annotations

import json

from moesaic.errors import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


def text_of(content, sep: str = "", image: str = "") -> str:
    """The text of a message's content: a string, None, or a list of parts ({"type": "text", "text":
    ...}; image parts become `image`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"message content must be a string or a list of parts, not {type(content).__name__}"
        )
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") in ("image", "image_url", "input_image"):
            if image:
                parts.append(image)
        else:
            raise RequestError(f"unsupported content part {part!r:.80}")
    return sep.join(parts)


def arguments_of(call: dict, where: str):
    """A tool call's arguments as a dict; a string that is not JSON comes back as that string."""
    fn = call.get("function", call)
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if args is None or args == "":
        return {}
    if isinstance(args, dict):
        return args
    if not isinstance(args, str):
        raise RequestError(f"{where}.function.arguments must be a JSON object or a string")
    try:
        value = json.loads(args)
    except ValueError:
        return args
    if not isinstance(value, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object, got {args[:80]!r}")
    return value


def read_messages(messages) -> list[dict]:
    """Validated copies of the messages: role checked, `reasoning` / `reasoning_content` both set, each
    tool call as {"id", "name", "arguments"} (a dict, or the raw string when it is not JSON)."""
    if not isinstance(messages, list | tuple):
        raise RequestError("messages must be a list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        m = dict(m)
        if m.get("content") is not None and not isinstance(m["content"], str | list):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise RequestError(f"messages[{i}].reasoning must be a string")
        m["reasoning"] = m["reasoning_content"] = reasoning
        calls = []
        for j, c in enumerate(m.get("tool_calls") or ()):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{where} needs function.name")
            calls.append({"id": c.get("id"), "name": fn["name"], "arguments": arguments_of(c, where)})
        m["tool_calls"] = calls
        out.append(m)
    return out


def options(kwargs: dict) -> dict:
    """Request options for a format: `chat_template_kwargs` entries, then the explicit keywords."""
    extra = kwargs.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise RequestError("chat_template_kwargs must be an object")
    return {**extra, **{k: v for k, v in kwargs.items() if k != "chat_template_kwargs"}}


def thinking_on(thinking, opts: dict, default: bool = True) -> bool:
    """The thinking switch: the `thinking` argument, else the `thinking` / `enable_thinking` options,
    else the family's default; `reasoning_effort="none"` turns it off."""
    if thinking is None:
        for key in ("thinking", "enable_thinking"):
            if opts.get(key) is not None:
                thinking = opts[key]
                break
    on = default if thinking is None else bool(thinking)
    return on and opts.get("reasoning_effort") != "none"


def tool_functions(tools) -> list[dict]:
    """The function dicts of OpenAI tools ({"type": "function", "function": {...}})."""
    out = []
    for i, t in enumerate(tools or ()):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}] needs function.name")
        out.append(fn)
    return out
