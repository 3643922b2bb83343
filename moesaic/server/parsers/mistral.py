"""Mistral (Small 4, tokenizer v11+) output: `[THINK]` reasoning and `[TOOL_CALLS]` calls.

    [THINK]reasoning[/THINK]content[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f2[ARGS]{}

Each call is `[TOOL_CALLS]name[ARGS]{json}`; `name{json}` without `[ARGS]` is read too, and so is the
pre-v11 form `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. Tool-call ids are 9 letters and
digits, as mistral-common's validator requires.

Reasoning: the prompt carries `[MODEL_SETTINGS]{"reasoning_effort": ...}` and the model opens
`[THINK]` itself, so the output always starts in content. `[TOOL_CALLS]` inside the reasoning ends it.

Format from mistral-common (special tokens, `InstructTokenizerV13/V14`) and vLLM's `mistral` parser.
"""

from __future__ import annotations

import secrets
import string

from .base import Parser

THINK, END_THINK, CALLS, ARGS = "[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


class MistralParser(Parser):
    name = "mistral"
    markup = (THINK, END_THINK, CALLS, ARGS)

    def start_state(self) -> str:
        return "content"

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def step(self, final: bool) -> bool:
        s = self.state
        if s in ("reasoning", "content"):
            markers = (END_THINK, THINK, CALLS) if s == "reasoning" else (THINK, END_THINK, CALLS)
            m = self._text(s, markers, final)
            if m is None:
                return False
            self.state = {THINK: "reasoning", END_THINK: "content"}.get(m, "name")
            return True
        if s == "name":
            if not self._skip_ws():
                return False
            if self.buf[self.pos] == "[" and not self.buf.startswith(ARGS, self.pos):
                if len(self.buf) - self.pos < len(ARGS) and ARGS.startswith(self.buf[self.pos :]):
                    return False  # "[" may begin "[ARGS]" (an empty name) or the old JSON list
                self._j = "open"
                self.state = "list"
                return True
            r = self._until((ARGS, "{", CALLS), final)
            if r is None or r[1] is None:
                return False
            self._start_call(r[0].strip())
            if r[1] == CALLS:  # a name with no arguments, then the next call
                self._end_call()
                return True
            if r[1] == "{":
                self.pos -= 1
            self._json_begin()
            self.state = "args"
            return True
        if s == "args":
            r = self._json((CALLS,), final)
            if r == "wait":
                return False
            if r == "done":
                self._end_call()
                self._ws, self._lead = "", True
                self.state = "content"
            return True
        if s == "list":
            r = self._json_calls(final)
            if r == "wait":
                return False
            if r == "done":
                self._ws, self._lead = "", True
                self.state = "content"
            return True
        raise AssertionError(s)
