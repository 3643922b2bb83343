"""Output parsers: split what a model generates into reasoning, content and tool calls, streamed or not.

    p = make_parser("glm", tools=request_tools, thinking=True)
    for text in generated_text_deltas:
        delta = p.feed(text)        # Delta(reasoning, content, tool_calls=[ToolCallDelta, ...])
    delta = p.finish()              # what was held back at the end of generation
    message = parse("glm", full_text, tools, thinking)   # the same result in one piece

One parser per format family, chosen by model_type (`parser_for_model_type`) or by name (the
`--tool-call-parser` / `--reasoning-parser` flags). What starts the reasoning section, per family, is
in each module's docstring; `thinking=False` means the prompt already closed the reasoning (or never
opened it) and the output starts in content; `thinking_for_prompt` reads that from the rendered
prompt. Tool markup is parsed whether or not the request listed tools (without schemas, values are
typed only by the format's own hints); what to do with calls the request did not allow is the
server's decision.
"""

from __future__ import annotations

from moesaic.errors import ConfigError

from .base import Delta, Message, Parser, ToolCall, ToolCallDelta, merge_deltas
from .deepseek import DeepSeekV4Parser, DeepSeekV41Parser
from .glm import GlmParser
from .kimi_k2 import KimiK2Parser
from .kimi_k3 import KimiK3Parser
from .mistral import MistralParser
from .nemotron import NemotronParser

PARSERS: dict[str, type[Parser]] = {
    "plain": Parser,
    "deepseek_v4": DeepSeekV4Parser,
    "deepseek_v41": DeepSeekV41Parser,
    "glm": GlmParser,
    "glm45": GlmParser,
    "glm47": GlmParser,
    "kimi_k3": KimiK3Parser,
    "kimi_k2": KimiK2Parser,
    "kimi_linear": KimiK2Parser,
    "mistral": MistralParser,
    "nemotron": NemotronParser,
    "nemotron_v3": NemotronParser,
    "qwen3_coder": NemotronParser,
}

MODEL_TYPE_PARSERS = {
    "glm5_next": "glm",
    "glm5_next_text": "glm",
    "deepseek_v4": "deepseek_v4",
    "deepseek_v41": "deepseek_v41",
    "kimi_k3": "kimi_k3",
    "kimi_linear": "kimi_k2",
    "mistral4": "mistral",
    "nemotron_h": "nemotron",
}


def parser_for_model_type(model_type: str) -> str:
    """The parser name of a family."""
    if model_type not in MODEL_TYPE_PARSERS:
        known = ", ".join(sorted(MODEL_TYPE_PARSERS))
        raise ConfigError(f"no output parser for model_type {model_type!r} (known: {known})")
    return MODEL_TYPE_PARSERS[model_type]


def _parser_class(name: str) -> type[Parser]:
    if name not in PARSERS:
        raise ConfigError(f"unknown parser {name!r} (known: {', '.join(sorted(PARSERS))})")
    return PARSERS[name]


def make_parser(name: str, tools=None, thinking: bool = True) -> Parser:
    """A fresh streaming parser for one generation."""
    return _parser_class(name)(tools, thinking)


def thinking_for_prompt(name: str, prompt: str, default: bool = True) -> bool:
    """Whether the output of `prompt` starts in the reasoning, read from the prompt's end (a template may
    open or close the reasoning whatever the request asked): GLM, DeepSeek and Nemotron prompts end in
    `<think>` or `</think>`, Kimi K3's in its think or response channel. Otherwise `default`."""
    cls = _parser_class(name)
    tail = prompt.rstrip()
    if any(tail.endswith(m) for m in cls.opens_reasoning):
        return True
    if any(tail.endswith(m) for m in cls.closes_reasoning):
        return False
    return default


def parse(name: str, text: str, tools=None, thinking: bool = True) -> Message:
    """The whole output at once: equal to merging the deltas of any streamed run over the same text."""
    p = make_parser(name, tools, thinking)
    return merge_deltas([p.feed(text), p.finish()])


__all__ = [
    "Delta",
    "Message",
    "PARSERS",
    "Parser",
    "ToolCall",
    "ToolCallDelta",
    "make_parser",
    "merge_deltas",
    "parse",
    "parser_for_model_type",
    "thinking_for_prompt",
]
