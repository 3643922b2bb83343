"""DeepSeek-V4 and V4.1 output: `<think>` reasoning and DSML tool calls.

    reasoning</think>content

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

V4.1 spells the tags with a space: `<｜DSML｜ calls>`, `<｜DSML｜ invoke name="`, `<｜DSML｜ parameter`.
`string="true"` values are raw text; `string="false"` values are JSON. An invoke body may instead be
one JSON object (`<｜DSML｜invoke name="f">{"city": "Paris"}</｜DSML｜invoke>`). A tool block that
starts inside the reasoning ends the reasoning (the model skipped `</think>`). A parameter whose close
tag is missing ends at the next parameter or at the end of the invoke.

Reasoning: the encoder's generation prompt ends with `<｜Assistant｜><think>` in thinking mode, so the
output starts in the reasoning; in chat mode it ends with `</think>` and the output starts in content.
A `<think>` the model writes anyway opens the reasoning; a stray `</think>` is dropped.

Formats from DeepSeek's encoding script (`encoding_dsv32.py`, V4 and V4.1 encoders as vendored by
vLLM `vllm/tokenizers/deepseek_v4_encoding.py`, `deepseek_v41_encoding.py`) and the peers' parsers
(vLLM `vllm/parser/deepseek_v4.py`, `deepseek_v41.py`; SGLang `deepseekv4_detector.py`).
"""

from __future__ import annotations

from .base import Parser, parse_attrs

THINK, END_THINK = "<think>", "</think>"


class DeepSeekV4Parser(Parser):
    name = "deepseek_v4"
    opens_reasoning, closes_reasoning = (THINK,), (END_THINK,)
    blocks = ("<｜DSML｜tool_calls>", "<｜DSML｜function_calls>")  # V3.2 named the block function_calls
    block_ends = ("</｜DSML｜tool_calls>", "</｜DSML｜function_calls>")
    invoke, invoke_end = '<｜DSML｜invoke name="', "</｜DSML｜invoke>"
    param, param_end = "<｜DSML｜parameter", "</｜DSML｜parameter>"

    def __init__(self, tools=None, thinking: bool = True):
        super().__init__(tools, thinking)
        self.markup = (THINK, END_THINK, *self.blocks, *self.block_ends, self.invoke, self.invoke_end)
        self.markup += (self.param, self.param_end, "｜DSML｜")
        self.in_reasoning = (END_THINK, THINK, *self.blocks)
        self.in_content = (THINK, END_THINK, *self.blocks)
        self.in_block = (self.invoke, *self.block_ends)
        self.in_body = (self.param, self.invoke_end, *self.block_ends)
        self.value_ends = (self.param_end, self.param, self.invoke_end, *self.block_ends)
        self.after_json = (self.invoke_end, *self.block_ends)

    def start_state(self) -> str:
        return "reasoning" if self.thinking else "content"

    def step(self, final: bool) -> bool:
        s = self.state
        if s in ("reasoning", "content"):
            m = self._text(s, self.in_reasoning if s == "reasoning" else self.in_content, final)
            if m is None:
                return False
            self.state = {THINK: "reasoning", END_THINK: "content"}.get(m, "block")
            return True
        if s == "block":
            m = self._text(None, self.in_block, final)
            if m is None:
                return False
            self.state = "name" if m == self.invoke else "content"
            return True
        if s == "name":
            r = self._until(('">',), final)
            if r is None or r[1] is None:
                return False
            self._start_call(r[0].strip())
            self.state = "body_start"
            return True
        if s == "body_start":  # a direct JSON body, or parameters
            if not self._skip_ws():
                return False
            if self.buf[self.pos] == "{":
                self._json_begin()
                self.state = "json"
            else:
                self.state = "body"
            return True
        if s == "body":
            m = self._text(None, self.in_body, final)
            if m is None:
                return False
            return self._after_value(m)
        if s == "attrs":
            r = self._until((">",), final)
            if r is None or r[1] is None:
                return False
            attrs = parse_attrs(r[0])
            self._pkey = attrs.get("name", "")
            self._phint = {"true": "string", "false": "json"}.get(attrs.get("string"))
            if self._streams(self._pkey, self._phint):
                self._open_string(self._pkey)
                self.state = "string"
            else:
                self.state = "raw"
            return True
        if s == "string":
            m = self._string_value(self.value_ends, final)
            if m is None:
                return False
            self._close_string()
            return self._after_value(m)
        if s == "raw":
            r = self._until(self.value_ends, final)
            if r is None or r[1] is None:
                return False  # a value cut off by the end of generation is left out
            self._raw_field(self._pkey, r[0], self._phint)
            return self._after_value(r[1])
        if s == "json":
            r = self._json(self.after_json, final)
            if r == "wait":
                return False
            if r == "done":
                self.state = "json_end"
            return True
        if s == "json_end":
            m = self._text(None, self.after_json, final)
            if m is None:
                return False
            return self._after_value(m)
        raise AssertionError(s)

    def _after_value(self, m: str) -> bool:
        """Where a parameter (or a part of an invoke body) ended, on marker `m`."""
        if m == self.param_end:
            self.state = "body"
        elif m == self.param:
            self.state = "attrs"
        elif m == self.invoke_end:
            self._end_call()
            self.state = "block"
        else:  # the block's end
            self._end_call()
            self.state = "content"
        return True


class DeepSeekV41Parser(DeepSeekV4Parser):
    name = "deepseek_v41"
    blocks = ("<｜DSML｜ calls>",)
    block_ends = ("</｜DSML｜ calls>",)
    invoke, invoke_end = '<｜DSML｜ invoke name="', "</｜DSML｜ invoke>"
    param, param_end = "<｜DSML｜ parameter", "</｜DSML｜ parameter>"
