"""GLM-4.5 ... 5.x output: `<think>` reasoning and `<tool_call>` calls.

    reasoning</think>content<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>

GLM-4.5 puts newlines between the parts (`<tool_call>name\\n<arg_key>...`); GLM-5.3 also writes a
JSON body after the name, `<tool_call>name>{"city": "Paris"}`, with or without `</tool_call>`. A value
is raw text typed by the tool's schema; only `</arg_value>` (or a next `<arg_key>`) ends it, so a
literal `</tool_call>` inside a value is kept. A missing `<arg_value>` after `</arg_key>` is tolerated
(PR vllm#49249); `<tool_call>name</tool_call>` is a call without arguments; a `<tool_call>` inside
the reasoning ends the reasoning (vllm#42400).

Reasoning: GLM's template ends the generation prompt with `<|assistant|><think>`, so with thinking on
the output starts in the reasoning; with thinking off it ends with `</think>` (GLM-4.7/5.x) and the
output starts in content. A `<think>` the model writes opens the reasoning; a stray `</think>` is
dropped.

Formats from zai-org's GLM-4.5/4.7/5.x chat templates and the peers' parsers (vLLM `glm47_moe`,
SGLang `glm47_moe_detector.py`, `glm53_flash_detector.py`).
"""

from __future__ import annotations

from .base import WAIT, Parser

THINK, END_THINK = "<think>", "</think>"
CALL, CALL_END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class GlmParser(Parser):
    name = "glm"
    opens_reasoning, closes_reasoning = (THINK,), (END_THINK,)
    markup = (THINK, END_THINK, CALL, CALL_END, KEY, KEY_END, VALUE, VALUE_END)

    def start_state(self) -> str:
        return "reasoning" if self.thinking else "content"

    def step(self, final: bool) -> bool:
        s = self.state
        if s in ("reasoning", "content"):
            markers = (END_THINK, THINK, CALL) if s == "reasoning" else (THINK, END_THINK, CALL)
            m = self._text(s, markers, final)
            if m is None:
                return False
            self.state = {THINK: "reasoning", END_THINK: "content"}.get(m, "name")
            return True
        if s == "name":
            if not self._skip_ws():
                return False
            r = self._until((KEY, CALL_END, CALL, ">", "\n", "{"), final)
            if r is None or r[1] is None:
                return False
            name, m = r
            self._start_call(self._tool_name(name.strip()))
            if m == "{":
                self.pos -= 1
            return self._after(m)
        if s == "after_name":  # after "name\n" or "name>": a JSON body, <arg_key>, or the end
            if not self._skip_ws():
                return False
            if self.buf[self.pos] == "{":
                self._json_begin()
                self.state = "json"
            else:
                self.state = "between"
            return True
        if s == "key":
            r = self._until((KEY_END, VALUE), final)
            if r is None or r[1] is None:
                return False
            self._pkey = r[0].strip()
            self.state = "value" if r[1] == VALUE else "value_open"
            return True
        if s == "value_open":
            if not self._skip_ws():
                return False
            if self._starts((VALUE,), final) == WAIT:
                return False
            self.state = "value"  # with or without <arg_value>
            return True
        if s == "value":
            if self._streams(self._pkey, None):
                self._open_string(self._pkey)
                self.state = "string"
            else:
                self.state = "raw"
            return True
        if s == "string":
            m = self._string_value((VALUE_END, KEY), final)
            if m is None:
                return False
            self._close_string()
            return self._after(m)
        if s == "raw":
            r = self._until((VALUE_END, KEY), final)
            if r is None or r[1] is None:
                return False
            self._raw_field(self._pkey, r[0], None)
            return self._after(r[1])
        if s == "between":  # arguments: the next key or the end of the call
            m = self._text(None, (KEY, CALL_END, CALL), final)
            return m is not None and self._after(m)
        if s == "json":
            r = self._json((CALL_END, CALL), final)
            if r == "wait":
                return False
            if r == "done":
                self.state = "json_end"
            return True
        if s == "json_end":  # a JSON body may or may not be followed by </tool_call>
            if not self._skip_ws() and not final:
                return False
            if self._starts((CALL_END,), final) == WAIT:
                return False
            self._end_call()
            self._ws, self._lead = "", True
            self.state = "content"
            return True
        raise AssertionError(s)

    def _after(self, m: str) -> bool:
        if m == KEY:
            self.state = "key"
        elif m == CALL_END:
            self._end_call()
            self.state = "content"
        elif m == CALL:  # the next call began without closing this one
            self._end_call()
            self.state = "name"
        elif m == VALUE_END:
            self.state = "between"
        else:  # after the name: "\n", ">" or "{"
            self.state = "after_name"
        return True

    def _tool_name(self, name: str) -> str:
        """GLM-5.3 sometimes writes a namespaced name ("Weather/get_weather"); use the declared tool."""
        if name in self.types or "/" not in name:
            return name
        return next((p for p in reversed(name.split("/")) if p.strip() in self.types), name).strip()
