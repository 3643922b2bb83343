"""The output parsers (moesaic.server.parsers): golden model outputs of every family, including the
failures users report against vLLM and SGLang, split into reasoning, content and tool calls the same
way whether streamed in any chunking or parsed whole."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesaic.errors import ConfigError
from moesaic.server.parsers import PARSERS, make_parser, merge_deltas, parse, parser_for_model_type


def fn(name, props, required=()):
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": props, "required": list(required)},
        },
    }


TOOLS = [
    fn(
        "get_weather",
        {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}},
    ),
    fn("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    fn(
        "search",
        {
            "query": {"type": "string"},
            "filters": {"type": "object"},
            "limit": {"type": "integer"},
            "exact": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "score": {"type": "number"},
        },
    ),
    fn("ping", {}),
]
PY_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}
TYPES = {
    t["function"]["name"]: {
        k: v.get("type", "string") for k, v in t["function"]["parameters"]["properties"].items()
    }
    for t in TOOLS
}


@dataclass
class Case:
    id: str
    parser: str
    text: str
    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)  # [(name, arguments dict)]
    thinking: bool = True


LONG = "first line of a long file\n" * 12 + "last line"

# fmt: off
DS = "｜DSML｜"
DSML_CALL = (f'\n\n<{DS}tool_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="city" string="true">Paris</{DS}parameter>\n'
             f'<{DS}parameter name="days" string="false">3</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls>')
CASES = [
    # --- DeepSeek-V4 DSML -------------------------------------------------------------------
    Case("ds4-basic", "deepseek_v4", "The user wants the weather.</think>Let me check." + DSML_CALL,
         "The user wants the weather.", "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    Case("ds4-call-in-reasoning", "deepseek_v4",
         f'I will ping first.\n\n<{DS}tool_calls>\n<{DS}invoke name="ping">\n</{DS}invoke>\n</{DS}tool_calls>',
         "I will ping first.", "", [("ping", {})]),
    Case("ds4-markup-in-values", "deepseek_v4",
         f'</think><{DS}tool_calls>\n<{DS}invoke name="write_file">\n<{DS}parameter name="path" string="true">a.html</{DS}parameter>\n'
         f'<{DS}parameter name="content" string="true"><p class="x">a &amp; b</p>\n</think> <tool_call></{DS}parameter>\n'
         f'</{DS}invoke>\n</{DS}tool_calls>',
         "", "", [("write_file", {"path": "a.html", "content": '<p class="x">a &amp; b</p>\n</think> <tool_call>'})]),
    Case("ds4-json-body-and-two-calls", "deepseek_v4",
         f'Two lookups.</think>\n\n<{DS}tool_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="city" string="true">Oslo</{DS}parameter>\n'
         f'</{DS}invoke>\n<{DS}invoke name="search">\n{{"query": "say \\"hi\\" \\\\ bye", "filters": {{"lang": "en"}}, "limit": "5", "exact": true}}\n'
         f'</{DS}invoke>\n</{DS}tool_calls>',
         "Two lookups.", "", [("get_weather", {"city": "Oslo"}),
                              ("search", {"query": 'say "hi" \\ bye', "filters": {"lang": "en"}, "limit": 5, "exact": True})]),
    Case("ds4-typed-by-schema", "deepseek_v4",
         f'</think><{DS}tool_calls>\n<{DS}invoke name="search">\n<{DS}parameter name="query" string="true">cats</{DS}parameter>\n'
         f'<{DS}parameter name="limit" string="true">7</{DS}parameter>\n<{DS}parameter name="tags" string="false">["a", "b"]</{DS}parameter>\n'
         f'<{DS}parameter name="exact" string="false">false</{DS}parameter>\n<{DS}parameter name="score" string="false">0.5</{DS}parameter>\n'
         f'</{DS}invoke>\n</{DS}tool_calls>',
         "", "", [("search", {"query": "cats", "limit": 7, "tags": ["a", "b"], "exact": False, "score": 0.5})]),
    Case("ds4-missing-param-close", "deepseek_v4",
         f'</think><{DS}tool_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="city" string="true">Rome\n'
         f'<{DS}parameter name="days" string="false">2</{DS}invoke>\n</{DS}tool_calls>',
         "", "", [("get_weather", {"city": "Rome\n", "days": 2})]),
    Case("ds4-damaged-invoke-close", "deepseek_v4",  # garbage after a parameter is skipped, never read as a JSON body
         f'Two.</think><{DS}tool_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="city" string="true">Oslo</{DS}parameter>\n'
         f'</</thSML｜invoke>\n<{DS}invoke name="search">\n{{"query": "x"}}\n</{DS}invoke>\n</{DS}tool_calls>',
         "Two.", "", [("get_weather", {"city": "Oslo"})]),
    Case("ds4-truncated", "deepseek_v4",
         f'Writing.</think><{DS}tool_calls>\n<{DS}invoke name="write_file">\n<{DS}parameter name="path" string="true">notes.txt</{DS}parameter>\n'
         f'<{DS}parameter name="content" string="true">line one\nline tw',
         "Writing.", "", [("write_file", {"path": "notes.txt", "content": "line one\nline tw"})]),
    Case("ds4-thinking-off", "deepseek_v4", "Sure, checking." + DSML_CALL, "", "Sure, checking.",
         [("get_weather", {"city": "Paris", "days": 3})], thinking=False),
    Case("ds4-no-tools", "deepseek_v4", "Hmm, 2 < 3 and a<b.</think>Yes: 2 < 3.", "Hmm, 2 < 3 and a<b.", "Yes: 2 < 3."),
    # --- DeepSeek-V4.1 spaced DSML ----------------------------------------------------------
    Case("ds41-basic", "deepseek_v41",
         f'Weather.</think>Checking.\n\n<{DS} calls>\n<{DS} invoke name="get_weather">\n<{DS} parameter name="city" string="true">Lima</{DS} parameter>\n'
         f'<{DS} parameter name="days" string="false">1</{DS} parameter>\n</{DS} invoke>\n</{DS} calls>',
         "Weather.", "Checking.", [("get_weather", {"city": "Lima", "days": 1})]),
    Case("ds41-call-in-reasoning-truncated", "deepseek_v41",
         f'Let me write it.\n\n<{DS} calls>\n<{DS} invoke name="write_file">\n<{DS} parameter name="content" string="true">' + LONG,
         "Let me write it.", "", [("write_file", {"content": LONG})]),
    # --- GLM ----------------------------------------------------------------------------------
    Case("glm-basic", "glm",
         "Need the weather.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
         "Need the weather.", "Checking.", [("get_weather", {"city": "Paris", "days": 3})]),
    Case("glm45-newlines-two-calls", "glm",
         "\nTwo cities.\n</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>\n"
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bergen</arg_value>\n<arg_key>units</arg_key>\n<arg_value>c</arg_value>\n</tool_call>",
         "\nTwo cities.", "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen", "units": "c"})]),
    Case("glm-literal-close-in-value", "glm",
         "</think><tool_call>write_file<arg_key>path</arg_key><arg_value>x.xml</arg_value><arg_key>content</arg_key>"
         "<arg_value><a></tool_call></a>\n<think>no</think></arg_value></tool_call>",
         "", "", [("write_file", {"path": "x.xml", "content": "<a></tool_call></a>\n<think>no</think>"})]),
    Case("glm-zero-args", "glm", "Ping it.</think><tool_call>ping</tool_call>", "Ping it.", "", [("ping", {})]),
    Case("glm-call-before-think-end", "glm",
         "I'll look it up.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
         "I'll look it up.", "", [("get_weather", {"city": "Rome"})]),
    Case("glm53-json-variant", "glm",
         '</think>Both.<tool_call>get_weather>{"city": "Oslo", "days": "2"}</tool_call><tool_call>search>{"query": "fjords", "tags": ["x"]}',
         "", "Both.", [("get_weather", {"city": "Oslo", "days": 2}), ("search", {"query": "fjords", "tags": ["x"]})]),
    Case("glm53-namespaced-name", "glm", '<tool_call>Weather/get_weather>{"city": "Turku"}</tool_call>', "", "",
         [("get_weather", {"city": "Turku"})], thinking=False),
    Case("glm-missing-arg-value-open", "glm",
         "</think><tool_call>search<arg_key>query</arg_key>dogs</arg_value><arg_key>limit</arg_key>4</arg_value></tool_call>",
         "", "", [("search", {"query": "dogs", "limit": 4})]),
    Case("glm-typed", "glm",
         "</think><tool_call>search<arg_key>filters</arg_key><arg_value>{\"a\": [1, 2]}</arg_value><arg_key>exact</arg_key>"
         "<arg_value>true</arg_value><arg_key>score</arg_key><arg_value>1e-3</arg_value><arg_key>query</arg_key><arg_value>42</arg_value></tool_call>",
         "", "", [("search", {"filters": {"a": [1, 2]}, "exact": True, "score": 0.001, "query": "42"})]),
    Case("glm-damaged-after-name", "glm", '</think><tool_call>get_weather\nxx{"city": "A"}</tool_call>ok', "", "ok",
         [("get_weather", {})]),
    Case("glm-truncated", "glm",
         "</think><tool_call>write_file<arg_key>path</arg_key><arg_value>big.txt</arg_value><arg_key>content</arg_key><arg_value>" + LONG,
         "", "", [("write_file", {"path": "big.txt", "content": LONG})]),
    Case("glm-thinking-off", "glm", "Answer: a<b and c>d.\n<tool_call>ping</tool_call>", "", "Answer: a<b and c>d.",
         [("ping", {})], thinking=False),
    Case("glm-thinking-off-empty-think", "glm", "<think></think>Just text.", "", "Just text.", thinking=False),
    # --- Kimi Linear / K2 -------------------------------------------------------------------
    Case("k2-two-calls", "kimi_k2",
         "Checking both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         '{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
         '{"city": "Shanghai", "days": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
         "", "Checking both.", [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai", "days": 2})]),
    Case("k2-thinking", "kimi_k2",
         "<think>Use the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.ping:0<|tool_call_argument_begin|>{}"
         "<|tool_call_end|><|tool_calls_section_end|>",
         "Use the tool.", "", [("ping", {})]),
    Case("k2-section-in-reasoning", "kimi_k2",
         "<think>Go.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
         '{"query": "<p>{\\"x\\": 1}</p> <think>", "limit": "3", "tags": ["a"]}<|tool_call_end|><|tool_calls_section_end|>',
         "Go.", "", [("search", {"query": '<p>{"x": 1}</p> <think>', "limit": 3, "tags": ["a"]})]),
    Case("k2-marker-inside-string-ends-call", "kimi_k2",  # as the peers' regexes do: the marker wins
         '<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>{"path": "a", "content": "ab'
         '<|tool_call_end|><|tool_calls_section_end|>Done.',
         "", "Done.", [("write_file", {"path": "a", "content": "ab"})]),
    Case("k2-truncated", "kimi_k2",
         '<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>{"path": "a", "content": "abc\\ndef',
         "", "", [("write_file", {"path": "a", "content": "abc\ndef"})]),
    Case("k2-plain", "kimi_k2", "  Just an answer.\n", "", "  Just an answer.\n"),
    # --- Mistral --------------------------------------------------------------------------------
    Case("mistral-think-two-calls", "mistral",
         '[THINK]Two calls.[/THINK]On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Caf\\u00e9 \\ud83d\\ude00", "days": 1}'
         "[TOOL_CALLS]ping[ARGS]{}",
         "Two calls.", "On it.", [("get_weather", {"city": "Café 😀", "days": 1}), ("ping", {})]),
    Case("mistral-call-in-reasoning", "mistral",
         '[THINK]Call now[TOOL_CALLS]search[ARGS]{"query": "a [/THINK] [ARGS] b", "exact": "false", "filters": {"k": [1, {"v": "}"}]}}',
         "Call now", "", [("search", {"query": "a [/THINK] [ARGS] b", "exact": False, "filters": {"k": [1, {"v": "}"}]}})]),
    Case("mistral-legacy-list", "mistral",
         'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "ping", "arguments": {}}]',
         "", "Sure.", [("get_weather", {"city": "Nice"}), ("ping", {})]),
    Case("mistral-no-args-tag", "mistral", '[TOOL_CALLS]get_weather{"city": "Bern"}', "", "", [("get_weather", {"city": "Bern"})]),
    Case("mistral-truncated", "mistral", '[TOOL_CALLS]write_file[ARGS]{"path": "x.md", "content": "# Title\\n\\nSome te',
         "", "", [("write_file", {"path": "x.md", "content": "# Title\n\nSome te"})]),
    Case("mistral-plain", "mistral", "No tools [needed] here.", "", "No tools [needed] here."),
    # --- Nemotron -------------------------------------------------------------------------------
    Case("nemotron-basic", "nemotron",
         "The user asks.\n</think>\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n",
         "The user asks.", "Checking.", [("get_weather", {"city": "Paris", "days": 3})]),
    Case("nemotron-multiline-two-calls", "nemotron",
         "</think>\n<tool_call>\n<function=write_file>\n<parameter=path>\nm.py\n</parameter>\n<parameter=content>\n"
         "def f():\n    return '<tool_call>'\n\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>",
         "", "", [("write_file", {"path": "m.py", "content": "def f():\n    return '<tool_call>'\n"}), ("ping", {})]),
    Case("nemotron-call-before-think-end", "nemotron",
         "Search first.\n<tool_call>\n<function=search>\n<parameter=query>\nrust\n</parameter>\n<parameter=tags>\n[\"x\", \"y\"]\n"
         "</parameter>\n<parameter=exact>\nFalse\n</parameter>\n</function>\n</tool_call>",
         "Search first.", "", [("search", {"query": "rust", "tags": ["x", "y"], "exact": False})]),
    Case("nemotron-toolcall-json", "nemotron",
         '</think>\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Kyiv", "days": "4"}}, {"name": "ping", "arguments": "{}"}]</TOOLCALL>',
         "", "", [("get_weather", {"city": "Kyiv", "days": 4}), ("ping", {})]),
    Case("nemotron-truncated", "nemotron",
         "</think><tool_call>\n<function=write_file>\n<parameter=content>\n" + LONG,
         "", "", [("write_file", {"content": LONG})]),
    Case("nemotron-thinking-off", "nemotron", "Hello <b>there</b>.", "", "Hello <b>there</b>.", thinking=False),
    # --- Kimi K3 XTML ---------------------------------------------------------------------------
    Case("k3-full", "kimi_k3",
         'Need weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>'
         '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
         '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
         '<|close|>message<|sep|><|end_of_msg|>',
         "Need weather.", "Checking.", [("get_weather", {"city": "Paris", "days": 3})]),
    Case("k3-missing-think-close", "kimi_k3",
         'Call ping and search.<|open|>tools<|sep|><|open|>call tool="ping" index="1"<|sep|><|close|>call<|sep|>'
         '<|open|>call tool="search" index="2"<|sep|><|open|>argument key="query" type="string"<|sep|><think>x</think> & "y"'
         '<|close|>argument<|sep|><|open|>argument key="filters" type="object"<|sep|>{"n": null}<|close|>argument<|sep|>'
         '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>',
         "Call ping and search.", "", [("ping", {}), ("search", {"query": '<think>x</think> & "y"', "filters": {"n": None}})]),
    Case("k3-missing-think-close-response", "kimi_k3",
         "Short.<|open|>response<|sep|>The answer is 4.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
         "Short.", "The answer is 4."),
    Case("k3-thinking-off-json-block", "kimi_k3",
         'Here.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="search" index="1"<|sep|><|open|>json type="object"<|sep|>'
         '{"query": "q&amp;a", "limit": "2"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>',
         "", "Here.", [("search", {"query": "q&amp;a", "limit": 2})], thinking=False),
    Case("k3-escaped-attrs-truncated", "kimi_k3",
         '<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="write_file" index="1"<|sep|>'
         '<|open|>argument key="path" type="string"<|sep|>a&amp;b.txt<|close|>argument<|sep|>'
         '<|open|>argument key="content" type="string"<|sep|>' + LONG,
         "", "", [("write_file", {"path": "a&amp;b.txt", "content": LONG})]),
]
# fmt: on
IDS = [c.id for c in CASES]
CHUNKS = (1, 2, 3, 5, 11, 23, None)


def stream(case: Case, cuts) -> tuple:
    p = make_parser(case.parser, TOOLS, case.thinking)
    bounds = [0, *sorted(set(cuts)), len(case.text)]
    deltas = [p.feed(case.text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    return deltas, merge_deltas(deltas)


def cuts_every(n, text):
    return range(n, len(text), n) if n else []


def summary(msg):
    return msg.reasoning, msg.content, [(c.name, c.arguments) for c in msg.tool_calls]


def check_types(name, args):
    for k, v in args.items():
        t = TYPES[name].get(k)
        if t is not None:
            assert isinstance(v, PY_TYPES[t]) and not (t in ("integer", "number") and isinstance(v, bool)), (
                k,
                v,
            )


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda n: f"chunk{n or 'all'}")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_golden_outputs_in_every_chunking(case, chunk):
    _, msg = stream(case, cuts_every(chunk, case.text))
    assert msg.reasoning == case.reasoning
    assert msg.content == case.content
    got = [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]
    assert got == case.calls
    for name, args in got:
        check_types(name, args)
    assert summary(msg) == summary(parse(case.parser, case.text, TOOLS, case.thinking))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_no_markup_leaks(case):
    """No marker of the family reaches reasoning, content or an argument value unless the golden value
    itself holds it (markup-like text inside a value is data)."""
    markup = make_parser(case.parser).markup
    assert markup
    msg = parse(case.parser, case.text, TOOLS, case.thinking)
    got = [msg.reasoning, msg.content, *(s for c in msg.tool_calls for s in strings(json.loads(c.arguments)))]
    want = [case.reasoning, case.content, *(s for _, a in case.calls for s in strings(a))]
    for m in markup:
        assert sum(g.count(m) for g in got) == sum(w.count(m) for w in want), m


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_random_chunk_boundaries(case, data):
    cuts = data.draw(st.lists(st.integers(1, max(1, len(case.text) - 1)), max_size=40))
    _, msg = stream(case, cuts)
    assert summary(msg) == summary(parse(case.parser, case.text, TOOLS, case.thinking))


FAMILIES = ["deepseek_v4", "deepseek_v41", "glm", "kimi_k2", "kimi_k3", "mistral", "nemotron", "plain"]
NOISE = [
    "{",
    "}",
    '"',
    "\\",
    "\\u12",
    "\\ud83d",
    ":",
    ",",
    "[",
    "]",
    " ",
    "\n",
    ">",
    "<",
    "=",
    "abc",
    "12",
    "true",
    ' name="get_weather">',
    ' name="city" string="true">',
    ' string="false">',
    "get_weather",
    "functions.ping:0",
    '"city"',
    '"days": 2',
    'call tool="search" index="1"',
    'argument key="limit" type="number"',
    "=city>",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("name", FAMILIES)
def test_any_output_streams_like_the_whole(name, data):
    """Garbage made of the family's markers, their prefixes, JSON punctuation and text: no exception,
    the stream at random cuts equals the whole parse, and every call's arguments are a JSON object."""
    markup = make_parser(name).markup
    frags = [*markup, *(m[:k] for m in markup for k in (1, 2, len(m) // 2)), *NOISE]
    text = "".join(data.draw(st.lists(st.sampled_from(frags), min_size=1, max_size=30)))
    thinking = data.draw(st.booleans())
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=20))
    _, msg = stream(Case("fuzz", name, text, thinking=thinking), cuts)
    assert summary(msg) == summary(parse(name, text, TOOLS, thinking))
    for call in msg.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("name", FAMILIES[:-1])
def test_damaged_outputs_stream_like_the_whole(name, data):
    """A golden output with a few characters replaced by marker fragments and punctuation."""
    case = data.draw(st.sampled_from([c for c in CASES if c.parser == name]))
    markup = make_parser(name).markup
    frags = [*markup, *(m[:k] for m in markup for k in (1, 2, len(m) // 2)), *NOISE]
    i = data.draw(st.integers(0, len(case.text)))
    j = data.draw(st.integers(i, min(len(case.text), i + 8)))
    text = case.text[:i] + "".join(data.draw(st.lists(st.sampled_from(frags), max_size=3))) + case.text[j:]
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=20))
    _, msg = stream(Case("damaged", name, text, thinking=case.thinking), cuts)
    assert summary(msg) == summary(parse(name, text, TOOLS, case.thinking))
    for call in msg.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("case", [c for c in CASES if c.calls], ids=[c.id for c in CASES if c.calls])
def test_tool_call_deltas_are_well_formed(case):
    """Per call: the first delta carries id and name, later ones neither; calls start in index order."""
    deltas, msg = stream(case, cuts_every(1, case.text))
    seen = []
    for d in deltas:
        for t in d.tool_calls:
            if t.index not in seen:
                assert t.id and t.name is not None
                assert t.index == len(seen)
                seen.append(t.index)
            else:
                assert t.id is None and t.name is None
    assert len(seen) == len(case.calls)
    assert len({c.id for c in msg.tool_calls}) == len(msg.tool_calls)


LONG_VALUE = {
    "deepseek_v4": (
        f'</think><{DS}tool_calls>\n<{DS}invoke name="write_file">\n<{DS}parameter name="content" string="true">',
        f"</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls>",
    ),
    "deepseek_v41": (
        f'</think><{DS} calls>\n<{DS} invoke name="write_file">\n<{DS} parameter name="content" string="true">',
        f"</{DS} parameter>\n</{DS} invoke>\n</{DS} calls>",
    ),
    "glm": ("</think><tool_call>write_file<arg_key>content</arg_key><arg_value>", "</arg_value></tool_call>"),
    "kimi_k2": (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>{"content": "',
        '"}<|tool_call_end|><|tool_calls_section_end|>',
    ),
    "kimi_k3": (
        '<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="write_file" index="1"<|sep|>'
        '<|open|>argument key="content" type="string"<|sep|>',
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
    ),
    "mistral": ('[TOOL_CALLS]write_file[ARGS]{"content": "', '"}'),
    "nemotron": (
        "</think><tool_call>\n<function=write_file>\n<parameter=content>\n",
        "\n</parameter>\n</function>\n</tool_call>",
    ),
}


@pytest.mark.parametrize("name", sorted(LONG_VALUE))
def test_long_string_values_stream_before_their_close(name):
    """A long string argument reaches the client while it is generated, not at its closing tag
    (vllm#52846, #42878)."""
    head, tail = LONG_VALUE[name]
    value = "line\n" * 200 + "end"
    body = value.replace("\n", "\\n") if name in ("kimi_k2", "mistral") else value
    p = make_parser(name, TOOLS)
    pieces = []
    for i in range(0, len(head + body), 7):
        d = p.feed((head + body)[i : i + 7])
        pieces += [t.arguments for t in d.tool_calls if t.arguments]
    assert len(pieces) > 50
    sent = "".join(pieces)
    assert json.loads(sent + '"}')["content"].startswith(value[:-8])
    for piece in (p.feed(tail), p.finish()):
        pieces += [t.arguments for t in piece.tool_calls if t.arguments]
    assert json.loads("".join(pieces)) == {"content": value}


HOLD = {  # an output cut right inside a marker: the marker's start must not be sent as text
    "deepseek_v4": ("So</think>Answer<｜DS", "ML｜tool_calls>\n"),
    "deepseek_v41": ("So</think>Answer\n\n<｜DSML｜ ca", "lls>\n"),
    "glm": ("So</thi", "nk>Answer <tool_c"),
    "kimi_k2": ("Answer<|tool_calls_sec", "tion_begin|>"),
    "kimi_k3": ("So<|clo", "se|>think<|sep|>Answer<|clo"),
    "mistral": ("Answer [TOOL_CA", "LLS]"),
    "nemotron": ("So\n</thin", "k>\nAnswer\n<tool_"),
}


@pytest.mark.parametrize("name", sorted(HOLD))
def test_partial_markers_are_held_back(name):
    first, second = HOLD[name]
    p = make_parser(name, TOOLS)
    a, b = p.feed(first), p.feed(second)
    sent = a.reasoning + a.content + b.reasoning + b.content
    assert re.sub(r"\s", "", sent) in ("SoAnswer", "Answer"), sent
    assert not any(ch in sent for ch in "<[|｜")


@pytest.mark.parametrize("name", ["deepseek_v4", "glm", "nemotron", "kimi_k3"])
def test_thinking_switch_chooses_the_first_section(name):
    assert summary(parse(name, "Plain words.", TOOLS, thinking=True))[:2] == ("Plain words.", "")
    assert summary(parse(name, "Plain words.", TOOLS, thinking=False))[:2] == ("", "Plain words.")


@pytest.mark.parametrize("name", ["kimi_k2", "mistral", "plain"])
def test_families_whose_model_opens_the_reasoning_start_in_content(name):
    assert summary(parse(name, " Plain words. ", TOOLS, thinking=True))[:2] == ("", " Plain words. ")


def test_output_without_markup_is_unchanged():
    text = "\n  Indented code:\n    x = [1, 2]  # a <b> c\n\n"
    for name in PARSERS:
        msg = parse(name, text, TOOLS, thinking=False)
        assert (msg.reasoning + msg.content, msg.tool_calls) == (text, []), name


def test_tool_call_ids():
    kimi = parse("kimi_k2", CASES[IDS.index("k2-two-calls")].text, TOOLS)
    assert [c.id for c in kimi.tool_calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    mistral = parse("mistral", CASES[IDS.index("mistral-think-two-calls")].text, TOOLS)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in mistral.tool_calls)
    glm = parse("glm", CASES[IDS.index("glm-basic")].text, TOOLS)
    assert glm.tool_calls[0].id.startswith("call_")


def test_unknown_tools_and_parameters_are_typed_by_the_format():
    """Without a schema, DSML's string="true" stays a string, JSON-looking GLM values are read as JSON."""
    text = f'</think><{DS}tool_calls>\n<{DS}invoke name="f">\n<{DS}parameter name="a" string="true">12</{DS}parameter>\n'
    text += f'<{DS}parameter name="b" string="false">12</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls>'
    assert json.loads(parse("deepseek_v4", text).tool_calls[0].arguments) == {"a": "12", "b": 12}
    glm = "<tool_call>f<arg_key>a</arg_key><arg_value>12</arg_value><arg_key>b</arg_key><arg_value>hi</arg_value></tool_call>"
    assert json.loads(parse("glm", glm, thinking=False).tool_calls[0].arguments) == {"a": 12, "b": "hi"}


def test_registry():
    assert {m: parser_for_model_type(m) for m in ("glm5_next", "deepseek_v4", "deepseek_v41", "kimi_k3")} == {
        "glm5_next": "glm",
        "deepseek_v4": "deepseek_v4",
        "deepseek_v41": "deepseek_v41",
        "kimi_k3": "kimi_k3",
    }
    assert [parser_for_model_type(m) for m in ("kimi_linear", "mistral4", "nemotron_h")] == [
        "kimi_k2",
        "mistral",
        "nemotron",
    ]
    with pytest.raises(ConfigError, match="llama"):
        parser_for_model_type("llama")
    with pytest.raises(ConfigError, match="hermes"):
        make_parser("hermes")


def test_long_output_is_consumed_as_it_arrives():
    """The parser does not keep re-reading what it has already handled: after each small feed, the
    unconsumed text is no longer than a marker."""
    p = make_parser("glm", TOOLS)
    for _ in range(3000):
        p.feed("word <")
        assert len(p.buf) - p.pos <= len("<tool_call>")
