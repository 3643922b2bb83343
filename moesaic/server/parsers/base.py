"""What every output parser shares: the delta types, the hold-back scanner, the JSON-arguments writer.

A parser is a small state machine over the text the model has generated so far. `feed(text)` appends
text and runs the machine as far as the text allows; it returns what became certain: reasoning and
content text, tool-call names and argument fragments. Text that could still turn out to be markup (a
suffix that is the start of a marker, whitespace that may stand before a marker, an unfinished tag)
is held back, not consumed. What is consumed is never re-read, so (1) the streamed deltas concatenate
to the non-streamed result (`parse` is one `feed` of the whole text plus `finish`) for every chunking,
and (2) the work is linear in the length of the output. This is the peers' "re-parse and diff"
contract (vLLM, SGLang) without the re-parse.

Whitespace: a reasoning or content section loses the whitespace next to markup inside the output
("answer\\n\\n<tool_call>" gives content "answer"); the output's own first and last characters are kept
as generated, so an output without markup comes back unchanged.

Tool-call arguments are written as one JSON object, field by field, in the model's order. A string
value streams as it is generated; any other value, and a value of unknown type, is written once its
text is complete, converted to the type the tool's JSON schema declares. A call cut off by the end of
generation (max_tokens) is kept with what was streamed and closed into valid JSON: an open string is
closed, a value whose text had not ended is left out. Streaming clients of vLLM and SGLang get the
same name and partial arguments; here the non-streamed message and the stream agree, and the
arguments always parse.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

# ----------------------------------------------------------------------------- results


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: `id` and `name` come with its first piece only; `arguments` is the
    next fragment of its JSON arguments string."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's `function.arguments`)


@dataclass
class Message:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def merge_deltas(deltas) -> Message:
    """The message a client assembles from a stream of deltas."""
    reasoning, content, calls = [], [], {}
    for d in deltas:
        reasoning.append(d.reasoning)
        content.append(d.content)
        for t in d.tool_calls:
            call = calls.setdefault(t.index, ToolCall(t.id or "", t.name or "", ""))
            call.arguments += t.arguments
    return Message("".join(reasoning), "".join(content), [calls[i] for i in sorted(calls)])


# ----------------------------------------------------------------------------- JSON schema types


def json_type(schema) -> str | None:
    """The one JSON type a parameter schema declares ("string", "integer", ...), or None when it
    declares none or several."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        types = [x for x in t if x != "null"]
        t = types[0] if len(types) == 1 else None
    if isinstance(t, str):
        return t
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            types = {json_type(s) for s in schema[key]} - {"null"}
            return types.pop() if len(types) == 1 else None
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        if all(isinstance(x, str) for x in schema["enum"]):
            return "string"
    if isinstance(schema.get("const"), str):
        return "string"
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def tool_param_types(tools) -> dict[str, dict[str, str | None]]:
    """{tool name: {parameter: JSON type}} from OpenAI tool dicts (`{"type": "function", "function":
    {...}}`) or bare function dicts."""
    out: dict[str, dict[str, str | None]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = {k: json_type(v) for k, v in props.items()} if isinstance(props, dict) else {}
    return out


def convert_raw(raw: str, t: str | None):
    """A value the model wrote as bare text (an XML-ish parameter body), as JSON type `t`. Text that does
    not fit the type stays a string; with no declared type, JSON text is read as JSON."""
    s = raw.strip()
    if t == "string":
        return raw
    if t in ("integer", "number"):
        try:
            v = json.loads(s)
        except (ValueError, RecursionError):
            return raw
        if isinstance(v, bool) or not isinstance(v, int | float):
            return raw
        return int(v) if t == "integer" and isinstance(v, float) and v.is_integer() else v
    if t == "boolean":
        return {"true": True, "false": False}.get(s.lower(), raw)
    if t == "null":
        return None if s.lower() in ("null", "none", "") else raw
    if t in ("object", "array"):
        try:
            v = json.loads(s)
        except (ValueError, RecursionError):
            return raw
        return v if isinstance(v, dict if t == "object" else list) else raw
    if t is None:
        try:
            return json.loads(s)
        except (ValueError, RecursionError):
            return raw
    return raw


def coerce(value, t: str | None, raw: str):
    """A JSON value the model wrote (`raw` is its text) as the schema's type `t`: a string where an
    integer belongs becomes the integer, a number where a string belongs becomes its text."""
    if t is None:
        return value
    if t == "string":
        return value if isinstance(value, str) else raw.strip()
    if isinstance(value, str):
        return convert_raw(value, t)
    if t == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# ----------------------------------------------------------------------------- JSON scanning

_STRING_END = re.compile(r'(?:[^"\\]|\\.)*"', re.S)
_PLAIN = re.compile(r'[^"\\]+')
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"'}


def string_end(s: str, i: int, limit: int | None = None) -> int | None:
    """Index after the JSON string that starts at s[i] == '"', or None if it does not end before `limit`."""
    m = _STRING_END.match(s, i + 1, len(s) if limit is None else limit)
    return m.end() if m else None


def json_value_end(s: str, i: int, final: bool, limit: int | None = None) -> int | None:
    """Index after the JSON value that starts at s[i], or None if its text does not end before `limit`.
    A bare literal (number, true, ...) that runs into `limit` has ended only if `final`."""
    n = len(s) if limit is None else limit
    c = s[i]
    if c == '"':
        return string_end(s, i, n)
    if c in "{[":
        depth, j = 0, i
        while j < n:
            ch = s[j]
            if ch == '"':
                e = string_end(s, j, n)
                if e is None:
                    return None
                j = e
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and s[j] not in ",}] \t\r\n":
        j += 1
    return None if j == n and not final else j


# ----------------------------------------------------------------------------- the machine

WAIT = "wait"  # a step needs more text
MORE = "more"  # a step made progress
DONE = "done"  # a JSON object (or array of calls) is complete


@dataclass
class _Call:
    index: int
    name: str
    fields: int = 0
    in_string: bool = False
    done: bool = False


class Parser:
    """The base parser: all output is content. Families override `start_state` and `step`."""

    name = "plain"
    markup: tuple[str, ...] = ()  # the family's marker strings: none may reach content or arguments
    opens_reasoning: tuple[
        str, ...
    ] = ()  # a prompt ending in one of these leaves the output in the reasoning
    closes_reasoning: tuple[str, ...] = ()  # ... ending in one of these, in content

    def __init__(self, tools=None, thinking: bool = True):
        self.types = tool_param_types(tools)
        self.thinking = bool(thinking)
        self.buf, self.pos = "", 0
        self.state = self.start_state()
        self._ws, self._lead = "", False  # held trailing whitespace of the section; drop its leading ws
        self._calls: list[_Call] = []
        self._memo = None  # (pos, markers, end): no marker of `markers` starts in buf[pos:end - maxlen]
        self._j, self._jkey = "", ""  # the JSON-arguments sub-machine
        self._pkey, self._phint = "", None  # the parameter being read, and its format's type hint
        self._vstart, self._vhold = True, ""  # newline trimming of a raw string value
        self._reset_out()

    def start_state(self) -> str:
        return "content"

    def step(self, final: bool) -> bool:
        """Advance by one construct. False when it needs more text (or, when final, the text is used up)."""
        self._text("content", (), final)
        return False

    # --- public -------------------------------------------------------------

    def feed(self, text: str) -> Delta:
        if self.pos > 1 << 16:  # forget consumed text
            self.buf, self.pos, self._memo = self.buf[self.pos :], 0, None
        self.buf += text
        self._run(False)
        return self._take()

    def finish(self) -> Delta:
        """End of generation: flush held text, close a call that was cut off."""
        self._run(True)
        call = self._call()
        if call is not None and not call.done:
            self._end_call()
        self.pos = len(self.buf)
        return self._take()

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    # --- driver ---------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            before = (self.state, self._j, self.pos)
            if not self.step(final):
                return
            if (self.state, self._j, self.pos) == before:
                raise RuntimeError(f"{self.name} parser: no progress in state {self.state!r}")

    def _reset_out(self) -> None:
        self._r: list[str] = []
        self._c: list[str] = []
        self._out: dict[int, ToolCallDelta] = {}

    def _take(self) -> Delta:
        d = Delta("".join(self._r), "".join(self._c), [self._out[i] for i in sorted(self._out)])
        self._reset_out()
        return d

    # --- scanning -------------------------------------------------------------

    def _find(self, markers) -> tuple[int, str | None]:
        """(index, marker) of the first marker at or after pos (the longest on a tie), or (-1, None)."""
        start, memo = self.pos, self._memo
        if not markers:
            return -1, None
        if memo is not None and memo[0] == self.pos and memo[1] == markers:
            start = max(self.pos, memo[2] - max(map(len, markers)) + 1)
        best, found = -1, None
        for m in markers:
            i = self.buf.find(m, start)
            if i != -1 and (found is None or i < best or (i == best and len(m) > len(found))):
                best, found = i, m
        self._memo = (self.pos, markers, len(self.buf)) if found is None else None
        return best, found

    def _held(self, markers) -> int:
        """Length of the longest suffix of the unconsumed text that is the start of a marker."""
        if not markers:
            return 0
        tail = self.buf[max(self.pos, len(self.buf) - max(map(len, markers)) + 1) :]
        best = 0
        for m in markers:
            for k in range(min(len(m) - 1, len(tail)), best, -1):
                if tail.endswith(m[:k]):
                    best = k
                    break
        return best

    def _text(self, kind: str | None, markers, final: bool) -> str | None:
        """Consume text of section `kind` ("reasoning", "content"; None discards) up to the first of
        `markers`. Returns the marker, consumed, or None when the text ran out first."""
        i, m = self._find(markers)
        if m is not None:
            self._emit(kind, self.buf[self.pos : i])
            self._ws, self._lead = "", True
            self.pos = i + len(m)
            return m
        end = len(self.buf) if final else len(self.buf) - self._held(markers)
        self._emit(kind, self.buf[self.pos : end])
        self.pos = end
        if final and kind is not None:
            self._put(kind, self._ws)
            self._ws = ""
        return None

    def _emit(self, kind: str | None, s: str) -> None:
        if kind is None or not s:
            return
        if self._lead:
            s = s.lstrip()
            if not s:
                return
            self._lead = False
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body) :]
        self._put(kind, body)

    def _put(self, kind: str, s: str) -> None:
        if s:
            (self._r if kind == "reasoning" else self._c).append(s)

    def _until(self, terms, final: bool):
        """(text, terminator) up to the first of `terms`, both consumed; None while the terminator may
        still come; (rest, None) when a final text ends first."""
        i, m = self._find(terms)
        if m is None:
            if not final:
                return None
            text, self.pos = self.buf[self.pos :], len(self.buf)
            return text, None
        text, self.pos = self.buf[self.pos : i], i + len(m)
        return text, m

    def _skip_ws(self) -> bool:
        """Skip whitespace; True if a character follows."""
        i, n = self.pos, len(self.buf)
        while i < n and self.buf[i].isspace():
            i += 1
        self.pos = i
        return i < n

    def _starts(self, options, final: bool) -> str | None:
        """The option the unconsumed text starts with (consumed); WAIT if it may still become one."""
        rest = self.buf[self.pos :]
        for o in options:
            if rest.startswith(o):
                self.pos += len(o)
                return o
        if not final and any(o.startswith(rest) for o in options):
            return WAIT
        return None

    # --- tool calls -------------------------------------------------------------

    def _call(self) -> _Call | None:
        return self._calls[-1] if self._calls else None

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        call = self._call()
        if call is not None and not call.done:
            self._end_call()
        index = len(self._calls)
        self._calls.append(_Call(index, name))
        self._out[index] = ToolCallDelta(index, call_id or self.new_id(), name)

    def _args(self, s: str) -> None:
        index = self._calls[-1].index
        d = self._out.get(index)
        if d is None:
            d = self._out[index] = ToolCallDelta(index)
        d.arguments += s

    def _key(self, key: str) -> None:
        call = self._calls[-1]
        self._args(("{" if call.fields == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        call.fields += 1

    def _field(self, key: str, value) -> None:
        self._key(key)
        self._args(json.dumps(value, ensure_ascii=False))

    def _open_string(self, key: str) -> None:
        self._key(key)
        self._args('"')
        self._calls[-1].in_string = True
        self._vstart, self._vhold = True, ""

    def _close_string(self) -> None:
        self._args('"')
        self._calls[-1].in_string = False

    def _end_call(self) -> None:
        call = self._calls[-1]
        if call.in_string:
            self._close_string()
        self._args("}" if call.fields else "{}")
        call.done = True

    def _ptype(self, key: str) -> str | None:
        call = self._call()
        return self.types.get(call.name, {}).get(key) if call else None

    def _streams(self, key: str, hint: str | None) -> bool:
        """Whether a raw-text value streams as a JSON string: the schema says string, or the format
        marks it a string (DSML string="true", XTML type="string") and the schema says nothing."""
        t = self._ptype(key)
        return t == "string" or (hint == "string" and t is None)

    def _raw_field(self, key: str, raw: str, hint: str | None) -> None:
        """A complete raw-text value; hint "json" when the format marks it JSON."""
        t = self._ptype(key)
        if hint == "json":
            try:
                self._field(key, coerce(json.loads(raw), t, raw))
                return
            except (ValueError, RecursionError):
                pass
        self._field(key, convert_raw(raw, t))

    def _string_value(self, ends, final: bool, trim: bool = False) -> str | None:
        """Stream a raw-text string value up to the first of `ends` (returned, consumed). `trim` drops
        one newline after the opening tag and one before the closing tag (Qwen3-coder style)."""
        i, m = self._find(ends)
        if m is not None:
            s, self.pos = self.buf[self.pos : i], i + len(m)
        else:
            end = len(self.buf) if final else len(self.buf) - self._held(ends)
            s, self.pos = self.buf[self.pos : end], end
        if trim:
            if self._vstart and s:
                self._vstart = False
                s = s[1:] if s[0] == "\n" else s
            s, self._vhold = self._vhold + s, ""
            if m is not None:
                s = s[:-1] if s.endswith("\n") else s
            elif not final and s.endswith("\n"):
                s, self._vhold = s[:-1], "\n"
        if s:
            self._args(json.dumps(s, ensure_ascii=False)[1:-1])
        return m

    # --- JSON arguments: {"key": value, ...} as the model writes it ------------------

    def _json_begin(self) -> None:
        self._j = "start"

    def _json(self, ends, final: bool) -> str:
        """Advance over a JSON arguments object at pos; MORE, WAIT or DONE. String values stream; other
        values are written when complete. The first of `ends` (the family's end-of-call markers) ends the
        object even inside a string, as the peers' parsers end it; the marker is left unconsumed. A body
        that is not an object is read whole up to that marker; malformed text is skipped up to it."""
        i, m = self._find(ends)
        limit = i if m is not None else len(self.buf) if final else len(self.buf) - self._held(ends)
        ran_out = DONE if m is not None else WAIT  # what running into `limit` means
        j, buf = self._j, self.buf
        if j in ("start", "key", "colon", "value", "sep"):
            while self.pos < limit and buf[self.pos].isspace():
                self.pos += 1
            if self.pos >= limit:
                return ran_out
            c = buf[self.pos]
        if j == "start":
            if c != "{":
                self._j = "opaque"
                return MORE
            self.pos += 1
            self._j = "key"
            return MORE
        if j == "key":
            if c == "}":
                self.pos += 1
                return DONE
            if c == ",":
                self.pos += 1
                return MORE
            if c != '"':
                self._j = "skip"
                return MORE
            end = string_end(buf, self.pos, limit)
            if end is None:
                return ran_out
            try:
                self._jkey = json.loads(buf[self.pos : end])
            except (ValueError, RecursionError):  # a bad escape in the key
                self._j = "skip"
                return MORE
            self.pos, self._j = end, "colon"
            return MORE
        if j == "colon":
            if c != ":":
                self._j = "skip"
                return MORE
            self.pos += 1
            self._j = "value"
            return MORE
        if j == "value":
            key = self._jkey
            t = self._ptype(key)
            if c == '"' and t in (None, "string"):
                self.pos += 1
                self._open_string(key)
                self._j = "string"
                return MORE
            end = json_value_end(buf, self.pos, final or m is not None, limit)
            if end is None:
                return ran_out
            if end == self.pos:
                self._j = "skip"
                return MORE
            raw, self.pos = buf[self.pos : end], end
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                value = raw
            self._field(key, coerce(value, t, raw))
            self._j = "sep"
            return MORE
        if j == "string":
            if not self._json_string(limit):
                return ran_out
            self._close_string()
            self._j = "sep"
            return MORE
        if j == "sep":
            if c == ",":
                self.pos += 1
                self._j = "key"
                return MORE
            if c == "}":
                self.pos += 1
                return DONE
            self._j = "skip"
            return MORE
        if j == "opaque":
            if m is None and not final:
                return WAIT
            raw, self.pos = buf[self.pos : limit], limit
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                value = None
            for k, v in (value if isinstance(value, dict) else {}).items():
                self._field(k, coerce(v, self._ptype(k), json.dumps(v, ensure_ascii=False)))
            return DONE
        # "skip": malformed; drop text up to an end marker
        self.pos = limit if m is not None or not final else len(buf)
        return DONE if m is not None or final else WAIT

    def _json_string(self, limit: int) -> bool:
        """Stream the inside of a JSON string from pos up to `limit`; True once its closing quote is
        consumed. An escape is decoded only when complete."""
        buf, i, n = self.buf, self.pos, limit
        out, closed = [], False
        while i < n:
            c = buf[i]
            if c == '"':
                i, closed = i + 1, True
                break
            if c != "\\":
                m = _PLAIN.match(buf, i, n)
                out.append(m.group())
                i = m.end()
                continue
            if i + 1 >= n:
                break
            e = buf[i + 1]
            if e != "u":
                out.append(_ESCAPES.get(e, e))
                i += 2
                continue
            if i + 6 > n:
                break
            try:
                cp = int(buf[i + 2 : i + 6], 16)
            except (ValueError, RecursionError):
                out.append("u")
                i += 2
                continue
            if 0xD800 <= cp < 0xDC00:  # a high surrogate pairs with the next \\uDCxx
                if i + 8 <= n and buf[i + 6 : i + 8] != "\\u":
                    out.append("\ufffd")
                    i += 6
                    continue
                if i + 12 > n:
                    break
                try:
                    lo = int(buf[i + 8 : i + 12], 16)
                except (ValueError, RecursionError):
                    lo = -1
                if 0xDC00 <= lo < 0xE000:
                    out.append(chr(0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)))
                    i += 12
                else:
                    out.append("\ufffd")
                    i += 6
                continue
            out.append("\ufffd" if 0xDC00 <= cp < 0xE000 else chr(cp))
            i += 6
        self.pos = i
        if out:
            self._args(json.dumps("".join(out), ensure_ascii=False)[1:-1])
        return closed

    def _json_calls(self, final: bool) -> str:
        """Advance over a JSON array of calls, `[{"name": ..., "arguments": {...}}, ...]` (Mistral before
        tokenizer v11, Nemotron Nano 2's <TOOLCALL>). Each call is written when its object is complete."""
        if not self._skip_ws():
            return WAIT
        c = self.buf[self.pos]
        if self._j == "open":
            if c != "[":
                return DONE
            self.pos += 1
            self._j = "item"
            return MORE
        if c == ",":
            self.pos += 1
            return MORE
        if c == "]":
            self.pos += 1
            return DONE
        if c != "{":
            return DONE
        end = json_value_end(self.buf, self.pos, final)
        if end is None:
            return WAIT
        try:
            item = json.loads(self.buf[self.pos : end])
        except (ValueError, RecursionError):
            item = None
        self.pos = end
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except (ValueError, RecursionError):
                    args = {}
            self._start_call(item["name"])
            for k, v in (args if isinstance(args, dict) else {}).items():
                self._field(k, coerce(v, self._ptype(k), json.dumps(v, ensure_ascii=False)))
            self._end_call()
        return MORE


def parse_attrs(text: str) -> dict[str, str]:
    """key="value" pairs of a tag, with &quot; and &amp; undone."""
    return {
        m.group(1): m.group(2).replace("&quot;", '"').replace("&amp;", "&")
        for m in re.finditer(r'([\w-]+)\s*=\s*"([^"]*)"', text)
    }
