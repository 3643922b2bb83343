"""Kimi K3 output: XTML channels built from the special tokens `<|open|>`, `<|close|>`, `<|sep|>`.

    reasoning<|close|>think<|sep|><|open|>response<|sep|>content<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

A tag is `<|open|>NAME attrs<|sep|>` or `<|close|>NAME<|sep|>`; attribute values are escaped (&quot;
&amp;). `type="string"` argument values are raw text, other types are JSON; a call may instead hold
one `<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>` block. The think channel also ends,
without its close tag, where a later channel opens or the message closes: the model sometimes skips
`<|close|>think<|sep|>` (vllm#53246, where the tool calls then came back empty). Text outside every
channel is content; the message ends at `<|close|>message<|sep|>` or `<|end_of_msg|>`.

Reasoning: the encoder's generation prompt ends with `<|open|>think<|sep|>` when thinking is on (the
output starts in the reasoning) and with `<|open|>response<|sep|>` when it is off (the output starts
in content).

Format from Moonshot's `encoding_k3.py` (as vendored in vLLM `vllm/tokenizers/encoding_k3.py`) and
vLLM's `kimi_k3` tool and reasoning parsers.
"""

from __future__ import annotations

from .base import Parser, parse_attrs

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
TAGS = (OPEN, CLOSE, EOM)


class KimiK3Parser(Parser):
    name = "kimi_k3"
    opens_reasoning, closes_reasoning = (OPEN + "think" + SEP,), (OPEN + "response" + SEP,)
    markup = (OPEN, CLOSE, SEP, EOM)

    def start_state(self) -> str:
        return "think" if self.thinking else "response"

    def step(self, final: bool) -> bool:
        s = self.state
        if s in ("think", "response", "outside"):
            m = self._text("reasoning" if s == "think" else "content", TAGS, final)
            return m is not None and self._tag_start(m, s)
        if s in ("tools", "call", "json_end", "end"):
            m = self._text(None, TAGS if s != "end" else (), final)
            return m is not None and self._tag_start(m, s)
        if s == "tag":
            r = self._until((SEP,), final)
            if r is None or r[1] is None:
                return False
            head = r[0].strip()
            name, _, attrs = head.partition(" ")
            return self._tag(self._tag_kind, name, parse_attrs(attrs), self._tag_from)
        if s == "string":
            m = self._string_value(TAGS, final)
            if m is None:
                return False
            self._close_string()
            return self._tag_start(m, "call")
        if s == "raw":
            r = self._until(TAGS, final)
            if r is None or r[1] is None:
                return False
            self._raw_field(self._pkey, r[0], self._phint)
            return self._tag_start(r[1], "call")
        if s == "json":
            r = self._json(TAGS, final)
            if r == "wait":
                return False
            if r == "done":
                self.state = "json_end"
            return True
        raise AssertionError(s)

    def _tag_start(self, m: str, where: str) -> bool:
        if m == EOM:
            self._finish_call()
            self.state = "end"
        else:
            self._tag_kind, self._tag_from, self.state = m, where, "tag"
        return True

    def _tag(self, kind: str, name: str, attrs: dict, where: str) -> bool:
        """Act on a complete tag met in state `where`."""
        self.state = where
        if kind == OPEN:
            if name == "think":
                self.state = "think"
            elif name == "response":
                self.state = "response"
            elif name == "tools":
                self.state = "tools"
            elif name == "call" and where in ("tools", "call", "json_end"):
                self._start_call(attrs.get("tool", ""))
                self.state = "call"
            elif name == "argument" and self._in_call():
                self._pkey = attrs.get("key", "")
                self._phint = "string" if attrs.get("type", "string") == "string" else "json"
                if self._streams(self._pkey, self._phint):
                    self._open_string(self._pkey)
                    self.state = "string"
                else:
                    self.state = "raw"
            elif name == "json" and self._in_call():
                self._json_begin()
                self.state = "json"
            elif where == "end":
                self.state = "end"
            return True
        # a close tag
        if name == "message":
            self._finish_call()
            self.state = "end"
        elif name == "call":
            self._finish_call()
            self.state = "tools"
        elif name in ("think", "response", "tools"):
            self._finish_call()
            self.state = "outside"
        elif name in ("argument", "json") and self._in_call():
            self.state = "call"
        return True  # other close tags are dropped

    def _in_call(self) -> bool:
        call = self._call()
        return call is not None and not call.done

    def _finish_call(self) -> None:
        if self._in_call():
            self._end_call()
