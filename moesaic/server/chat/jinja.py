"""A checkpoint's own Jinja chat template, rendered the way transformers' `apply_chat_template` does.

The environment is jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`, the loop
controls extension (`{% break %}`, `{% continue %}`), the `{% generation %}` block some templates mark
assistant text with, `raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that takes
json.dumps' keywords (`ensure_ascii`, `indent`, `separators`, `sort_keys`) and keeps non-ASCII text.
Tool-call arguments given as JSON strings are passed to the template as objects, as vLLM does, since
templates iterate them (`tc.arguments.items()`).

A template that does not compile is a ConfigError when loaded; one that fails while rendering (its
own `raise_exception`, an undefined name, an index out of range) is a RequestError.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moesaic.errors import ConfigError, MoesaicError, RequestError

from .common import options, read_messages


class _TemplateRaised(Exception):
    pass


def _raise(message):
    raise _TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's tokens for training; renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class JinjaChat:
    """`render(messages, tools, add_generation_prompt, thinking, **kwargs)`: `thinking` (or
    reasoning_effort="none") sets the templates' `enable_thinking` and `thinking`; `reasoning_effort`,
    the entries of `chat_template_kwargs` and other keywords are passed to the template as variables,
    and so are the special tokens (`bos_token`, `eos_token`, ...) given at construction."""

    def __init__(self, template: str, special_tokens: dict | None = None, source: str = "chat template"):
        try:
            self.template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{source} does not compile: {e.message} (line {e.lineno})") from None
        self.special_tokens = dict(special_tokens or {})
        self.source = source

    def render(
        self, messages, tools=None, add_generation_prompt: bool = True, thinking=None, **kwargs
    ) -> str:
        variables = {**self.special_tokens, **options(kwargs)}
        if thinking is None and variables.get("reasoning_effort") == "none":
            thinking = False
        if thinking is not None:
            variables["enable_thinking"] = variables["thinking"] = bool(thinking)
        msgs = []
        for m in read_messages(messages):
            for key in ("reasoning", "reasoning_content"):
                if m[key] is None:
                    del m[key]
            calls = m.pop("tool_calls")
            if calls:
                for c in calls:
                    if isinstance(c["arguments"], str):
                        raise RequestError(f"tool call {c['name']!r}: arguments are not valid JSON")
                m["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls
                ]
            msgs.append(m)
        variables.update(messages=msgs, tools=tools or None, add_generation_prompt=add_generation_prompt)
        try:
            return self.template.render(**variables)
        except MoesaicError:
            raise
        except _TemplateRaised as e:
            raise RequestError(f"{self.source}: {e}") from None
        except Exception as e:  # an undefined name, a bad index, a sandbox violation: the request's data
            raise RequestError(f"{self.source} failed to render: {type(e).__name__}: {e}") from None
