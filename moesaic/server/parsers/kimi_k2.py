"""Kimi Linear / Kimi K2 output: content, then a tool-calls section.

    content<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The text between `<|tool_call_begin|>` and `<|tool_call_argument_begin|>` is the call id,
`functions.NAME:INDEX`; it is kept as the tool call's id because Kimi's template writes tool results
as "## Return of {tool_call_id}". The arguments are one JSON object. A call outside a section, and a
call whose `<|tool_call_end|>` runs into the next `<|tool_call_begin|>` in one delta (vllm#28543), are
read the same way. `<|im_end|>` ends the message.

Reasoning: Kimi Linear Instruct does not reason; the Kimi K2 Thinking models write `<think>...</think>`
themselves, so the output always starts in content and a `<think>` opens the reasoning. A section that
starts inside the reasoning ends it.

Format from Moonshot's Kimi-K2 `docs/tool_call_guidance.md` and chat template, and vLLM's `kimi_k2`
tool parser.
"""

from __future__ import annotations

from .base import Parser

THINK, END_THINK = "<think>", "</think>"
SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
IM_END = "<|im_end|>"


class KimiK2Parser(Parser):
    name = "kimi_k2"
    markup = (THINK, END_THINK, *SECTIONS, *SECTION_ENDS, CALL, ARGS, CALL_END, IM_END)

    def start_state(self) -> str:
        return "content"

    def step(self, final: bool) -> bool:
        s = self.state
        if s in ("reasoning", "content"):
            first = (END_THINK, THINK) if s == "reasoning" else (THINK, END_THINK)
            m = self._text(s, (*first, *SECTIONS, CALL, IM_END), final)
            if m is None:
                return False
            return self._go(m)
        if s == "section":
            m = self._text(None, (CALL, *SECTION_ENDS, IM_END), final)
            return m is not None and self._go(m)
        if s == "id":
            r = self._until((ARGS, CALL_END, CALL, *SECTION_ENDS), final)
            if r is None or r[1] is None:
                return False
            call_id = r[0].strip()
            self._start_call(_name(call_id), call_id or None)
            if r[1] == ARGS:
                self._json_begin()
                self.state = "args"
                return True
            self._end_call()
            return self._go(r[1])
        if s == "args":
            r = self._json((CALL_END, CALL, *SECTION_ENDS, IM_END), final)
            if r == "wait":
                return False
            if r == "done":
                self.state = "call_end"
            return True
        if s == "call_end":
            m = self._text(None, (CALL_END, CALL, *SECTION_ENDS, IM_END), final)
            if m is None:
                return False
            self._end_call()
            return self._go(m)
        if s == "end":
            self._text(None, (), final)
            return False
        raise AssertionError(s)

    def _go(self, m: str) -> bool:
        self.state = {
            THINK: "reasoning",
            END_THINK: "content",
            CALL: "id",
            CALL_END: "section",
            IM_END: "end",
        }.get(m, "section" if m in SECTIONS else "content")
        return True


def _name(call_id: str) -> str:
    """ "functions.get_weather:0" -> "get_weather"."""
    head, _, index = call_id.rpartition(":")
    name = head if head and index.isdigit() else call_id
    return name.removeprefix("functions.")
