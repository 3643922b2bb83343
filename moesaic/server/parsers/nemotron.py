"""Nemotron-3 output: `<think>` reasoning and Qwen3-coder style XML calls; Nano 2's `<TOOLCALL>` JSON.

    reasoning
    </think>
    content
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter body is raw text typed by the tool's schema, less one newline after `<parameter=k>` and
one before `</parameter>`. A parameter whose close tag is missing ends at the next parameter or at
`</function>`. Nemotron Nano 2 writes `<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>`
instead; each of those calls is written when its JSON object is complete. A call inside the reasoning
ends the reasoning.

Reasoning: the template ends the generation prompt with `<think>\\n` when thinking is on, so the output
starts in the reasoning; with thinking off it writes `<think></think>` and the output starts in
content. A `<think>` the model writes opens the reasoning; a stray `</think>` is dropped.

Formats from NVIDIA's Nemotron-3 and Nemotron-Nano-9B-v2 chat templates and vLLM's `nemotron_v3` /
`qwen3_coder` and `nemotron_json` parsers.
"""

from __future__ import annotations

from .base import Parser

THINK, END_THINK = "<think>", "</think>"
CALL, CALL_END, FN, FN_END = "<tool_call>", "</tool_call>", "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
JSON_CALLS, JSON_CALLS_END = "<TOOLCALL>", "</TOOLCALL>"
VALUE_ENDS = (PARAM_END, PARAM, FN_END, CALL_END)


class NemotronParser(Parser):
    name = "nemotron"
    opens_reasoning, closes_reasoning = (THINK,), (END_THINK,)
    markup = (THINK, END_THINK, CALL, CALL_END, FN, FN_END, PARAM, PARAM_END, JSON_CALLS, JSON_CALLS_END)

    def start_state(self) -> str:
        return "reasoning" if self.thinking else "content"

    def step(self, final: bool) -> bool:
        s = self.state
        if s in ("reasoning", "content"):
            first = (END_THINK, THINK) if s == "reasoning" else (THINK, END_THINK)
            m = self._text(s, (*first, CALL, JSON_CALLS), final)
            if m is None:
                return False
            if m == JSON_CALLS:
                self._j = "open"
            self.state = {THINK: "reasoning", END_THINK: "content", CALL: "call"}.get(m, "list")
            return True
        if s == "call":  # inside <tool_call>: functions, then </tool_call>
            m = self._text(None, (FN, CALL_END), final)
            if m is None:
                return False
            self.state = "name" if m == FN else "content"
            return True
        if s == "name":
            r = self._until((">",), final)
            if r is None or r[1] is None:
                return False
            self._start_call(r[0].strip())
            self.state = "function"
            return True
        if s == "function":
            m = self._text(None, (PARAM, FN_END, CALL_END), final)
            return m is not None and self._after(m)
        if s == "key":
            r = self._until((">",), final)
            if r is None or r[1] is None:
                return False
            self._pkey = r[0].strip()
            if self._streams(self._pkey, None):
                self._open_string(self._pkey)
                self.state = "string"
            else:
                self.state = "raw"
            return True
        if s == "string":
            m = self._string_value(VALUE_ENDS, final, trim=True)
            if m is None:
                return False
            self._close_string()
            return self._after(m)
        if s == "raw":
            r = self._until(VALUE_ENDS, final)
            if r is None or r[1] is None:
                return False
            raw = r[0][1:] if r[0].startswith("\n") else r[0]
            self._raw_field(self._pkey, raw[:-1] if raw.endswith("\n") else raw, None)
            return self._after(r[1])
        if s == "list":
            r = self._json_calls(final)
            if r == "wait":
                return False
            if r == "done":
                self.state = "list_end"
            return True
        if s == "list_end":
            m = self._text(None, (JSON_CALLS_END,), final)
            if m is None:
                return False
            self.state = "content"
            return True
        raise AssertionError(s)

    def _after(self, m: str) -> bool:
        if m == PARAM_END:
            self.state = "function"
        elif m == PARAM:
            self.state = "key"
        elif m == FN_END:
            self._end_call()
            self.state = "call"
        else:  # </tool_call> without </function>
            self._end_call()
            self.state = "content"
        return True
