"""Chat formats (moesaic.server.chat): the prompts of every family for system / user / assistant / tool
turns, tools, and thinking on and off, against prompt strings written out by hand from the formats'
public descriptions (DeepSeek's and Moonshot's encoder scripts, the released templates, mistral-common's
own test expectations); the Jinja sandbox and its errors."""

from __future__ import annotations

import json

import pytest

from moesaic.errors import ConfigError, RequestError
from moesaic.server.chat import SPECIAL_TOKENS, JinjaChat, chat_format_for, demo_template, read_chat_template
from moesaic.server.parsers import make_parser, parser_for_model_type, thinking_for_prompt

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOLS = [{"type": "function", "function": WEATHER}]
SCHEMA = '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}'
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [  # system, user, a tool call with its reasoning, the tool's result, an answer, a new user turn
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21C"},
    {"role": "assistant", "content": "It is sunny.", "reasoning": "Got it."},
    {"role": "user", "content": "Thanks!"},
]
HISTORY = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Bye"},
]

# ---------------------------------------------------------------------------------- DeepSeek-V4 / V4.1

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n"
)


def ds_tools(sp: str) -> str:
    """The "## Tools" section of DeepSeek's encoders; `sp` is V4.1's space in the DSML names."""
    d = "｜DSML｜" + sp
    block = f"<{d}{'calls' if sp else 'tool_calls'}>"
    end = block.replace("<", "</")
    return (
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
        f'writing a "{block}" block like the following:\n\n{block}\n<{d}invoke name="$TOOL_NAME">\n'
        f'<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n...\n'
        f'</{d}invoke>\n<{d}invoke name="$TOOL_NAME2">\n...\n</{d}invoke>\n{end}\n\n'
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
        "<think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        f"### Available Tool Schemas\n\n{SCHEMA}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def ds_call(sp: str) -> str:
    d = "｜DSML｜" + sp
    block = f"<{d}{'calls' if sp else 'tool_calls'}>"
    return (
        f'\n\n{block}\n<{d}invoke name="get_weather">\n<{d}parameter name="city" string="true">Paris</{d}parameter>\n'
        f"</{d}invoke>\n{block.replace('<', '</')}"
    )


def test_deepseek_v4_tools_keep_every_reasoning():
    want = (
        BOS
        + EFFORT_HIGH
        + "Be brief.\n\n"
        + ds_tools("")
        + "<｜User｜>Weather in Paris?<｜Assistant｜><think>"
        "Need the tool.</think>" + ds_call("") + EOS + "<｜User｜><tool_result>Sunny, 21C</tool_result>"
        "<｜Assistant｜><think>Got it.</think>It is sunny." + EOS + "<｜User｜>Thanks!<｜Assistant｜><think>"
    )
    assert chat_format_for("deepseek_v4").render(CHAT, tools=TOOLS) == want


def test_deepseek_v4_drops_old_reasoning_and_switches_thinking():
    v4 = chat_format_for("deepseek_v4")
    history = "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS + "<｜User｜>Bye<｜Assistant｜>"
    assert v4.render(HISTORY) == BOS + EFFORT_HIGH + history + "<think>"
    assert v4.render(HISTORY, reasoning_effort="max") == BOS + EFFORT_MAX + history + "<think>"
    assert v4.render(HISTORY, chat_template_kwargs={"reasoning_effort": "low"}) == BOS + history + "<think>"
    assert v4.render(HISTORY, thinking=False) == BOS + history + "</think>"
    assert v4.render(HISTORY, reasoning_effort="none") == BOS + history + "</think>"
    assert v4.render(HISTORY, chat_template_kwargs={"enable_thinking": False}) == BOS + history + "</think>"
    developer = [{"role": "developer", "content": "Use French."}, *HISTORY]
    assert v4.render(developer, reasoning_effort="low") == BOS + history + "<think>"
    assert v4.render(developer, thinking=False) == BOS + "<｜User｜>Use French." + history + "</think>"
    assert v4.render(HISTORY[:2], add_generation_prompt=False, thinking=False) == (
        BOS + "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS
    )


def test_deepseek_v4_tools_without_system_and_result_order():
    """Tools go onto an empty system message; results follow the calls' order, the next user text joins them."""
    calls = [
        dict(CALL, id="a"),
        {"id": "b", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
    ]
    msgs = [
        {"role": "user", "content": "Both?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "Rain"},
        {"role": "tool", "tool_call_id": "a", "content": "Sun"},
        {"role": "user", "content": "And?"},
    ]
    d = "｜DSML｜"
    two = (
        f'\n\n<{d}tool_calls>\n<{d}invoke name="get_weather">\n<{d}parameter name="city" string="true">Paris</{d}parameter>\n'
        f'</{d}invoke>\n<{d}invoke name="get_weather">\n<{d}parameter name="city" string="true">Rome</{d}parameter>\n'
        f"</{d}invoke>\n</{d}tool_calls>"
    )
    want = (
        BOS + "\n\n" + ds_tools("") + "<｜User｜>Both?<｜Assistant｜></think>Checking." + two + EOS
        + "<｜User｜><tool_result>Sun</tool_result>\n\n<tool_result>Rain</tool_result>\n\nAnd?<｜Assistant｜></think>"
    )  # fmt: skip
    assert chat_format_for("deepseek_v4").render(msgs, tools=TOOLS, thinking=False) == want


def test_deepseek_v41_system_token_effort_and_spaced_dsml():
    want = (
        BOS + "<｜System｜>Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)"
        "\n\nBe brief.\n\n" + ds_tools(" ") + "<｜User｜>Weather in Paris?<｜Assistant｜><think>Need the tool.</think>"
        + ds_call(" ") + EOS + "<｜User｜><tool_result>Sunny, 21C</tool_result><｜Assistant｜><think>Got it.</think>"
        "It is sunny." + EOS + "<｜User｜>Thanks!<｜Assistant｜><think>"
    )  # fmt: skip
    assert chat_format_for("deepseek_v41").render(CHAT, tools=TOOLS) == want


def test_deepseek_v41_mid_conversation_system_and_chat_mode():
    v41 = chat_format_for("deepseek_v41")
    msgs = [*HISTORY[:2], {"role": "system", "content": "Switch to French."}]
    assert v41.render(msgs, reasoning_effort="max") == (
        BOS
        + "<｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more thorough the reasoning)"
        "\n\n<｜User｜>Hi<｜Assistant｜></think>Hello!"
        + EOS
        + "<｜System｜>Switch to French.<｜Assistant｜><think>"
    )
    assert v41.render(HISTORY, thinking=False) == (
        BOS + "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS + "<｜User｜>Bye<｜Assistant｜></think>"
    )
    assert v41.render(HISTORY[:1], reasoning_effort=30).startswith(BOS + "<｜System｜>Reasoning Effort: 30 (")
    with pytest.raises(RequestError, match="reasoning_effort"):
        v41.render(HISTORY, reasoning_effort=101)
    with pytest.raises(RequestError, match="reasoning_effort"):
        chat_format_for("deepseek_v4").render(HISTORY, reasoning_effort="extreme")


# ---------------------------------------------------------------------------------- Kimi K3 (XTML)


def k3(tag, body, **attrs):
    a = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f"<|open|>{tag}{a}<|sep|>{body}<|close|>{tag}<|sep|>"


K3_TOOLS = (
    '[{"function":{"description":"Weather of a city","name":"get_weather","parameters":{"properties":{"city":'
    '{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]'
)
K3_EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`."
)


def test_kimi_k3_channels_tools_and_results():
    eom = "<|end_of_msg|>"
    call = k3("call", k3("argument", "Paris", key="city", type="string"), tool="get_weather", index=1)
    want = (
        k3("message", f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{K3_TOOLS}\n```",
           role="system", type="tool-declare") + eom
        + k3("message", K3_EFFORT, role="system", type="thinking-effort") + eom
        + k3("message", "Be brief.", role="system") + eom
        + k3("message", "Weather in Paris?", role="user") + eom
        + k3("message", k3("think", "Need the tool.") + k3("response", "") + k3("tools", call), role="assistant") + eom
        + k3("message", "Sunny, 21C", role="tool", tool="get_weather", index=1) + eom
        + k3("message", k3("think", "Got it.") + k3("response", "It is sunny."), role="assistant") + eom
        + k3("message", "Thanks!", role="user") + eom
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )  # fmt: skip
    assert chat_format_for("kimi_k3").render(CHAT, tools=TOOLS) == want


def test_kimi_k3_thinking_off_typed_arguments_and_escaping():
    eom = "<|end_of_msg|>"
    calls = [
        {
            "id": "b",
            "function": {"name": "get_weather", "arguments": {"city": 'a"b&c', "days": 2, "flags": [True]}},
        },
        {"id": "a", "function": {"name": "ping", "arguments": "not json"}},
    ]
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Go"}]},
        {
            "role": "assistant",
            "content": "Sure.",
            "reasoning": "dropped when thinking is off",
            "tool_calls": calls,
        },
        {"role": "tool", "tool_call_id": "a", "content": "pong"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    args = (
        k3("argument", 'a"b&c', key="city", type="string")
        + k3("argument", "2", key="days", type="number")
        + k3("argument", "[true]", key="flags", type="array")
    )
    tools = k3(
        "tools",
        k3("call", args, tool="get_weather", index=1)
        + k3("call", k3("json", "not json", type="object"), tool="ping", index=2),
    )
    want = (
        k3("message", "Go", role="user") + eom
        + k3("message", k3("response", "Sure.") + tools, role="assistant") + eom
        + k3("message", "rain", role="tool", tool="get_weather", index=1) + eom
        + k3("message", "pong", role="tool", tool="ping", index=2) + eom
        + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )  # fmt: skip
    assert chat_format_for("kimi_k3").render(msgs, thinking=False) == want
    wanted = '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.'
    assert wanted in chat_format_for("kimi_k3").render(msgs[:1], tool_choice="required")
    named = [{"role": "user", "name": 'Ann "A"', "content": "x"}]
    assert (
        chat_format_for("kimi_k3")
        .render(named, thinking=False)
        .startswith('<|open|>message role="user" name="Ann &quot;A&quot;"<|sep|>x')
    )
    with pytest.raises(RequestError, match="reasoning_effort"):
        chat_format_for("kimi_k3").render(msgs, reasoning_effort="medium")


# ---------------------------------------------------------------------------------- demo templates


def test_glm_template():
    want = (
        "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + SCHEMA + "\n</tools>\n\n"
        "For each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>"
        "{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
        "<|system|>Be brief.<|user|>Weather in Paris?<|assistant|></think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
        "<|observation|><tool_response>Sunny, 21C</tool_response><|assistant|></think>It is sunny.<|user|>Thanks!"
        "<|assistant|><think>"
    )  # fmt: skip
    glm = chat_format_for("glm5_next")
    assert glm.render(CHAT, tools=TOOLS) == want
    assert glm.render(CHAT[:3], add_generation_prompt=False).endswith(
        "<|assistant|><think>Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
        "</arg_value></tool_call>"
    )
    assert glm.render(HISTORY[:1], thinking=False) == "[gMASK]<sop><|user|>Hi<|assistant|></think>"
    typed = [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"n": 2, "l": ["x"]}}}]}
    ]
    assert glm.render(typed, add_generation_prompt=False) == (
        "[gMASK]<sop><|assistant|></think><tool_call>f<arg_key>n</arg_key><arg_value>2</arg_value><arg_key>l</arg_key>"
        '<arg_value>["x"]</arg_value></tool_call>'
    )


def test_kimi_linear_template():
    declare = '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather","description":"Weather of a city","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]<|im_end|>'
    call = dict(CALL, id="functions.get_weather:0")
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {
            "role": "tool",
            "name": "get_weather",
            "tool_call_id": "functions.get_weather:0",
            "content": "Sunny",
        },
    ]
    want = (
        declare + "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>Checking."
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )  # fmt: skip
    kimi = chat_format_for("kimi_linear")
    assert kimi.render(msgs, tools=TOOLS) == want
    assert kimi.render(CHAT[:2]) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


MATH = {
    "type": "function",
    "function": {
        "name": "math_interpreter",
        "description": "Get the value of an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "Math expression."}},
        },
    },
}
MISTRAL_CHAT = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {
        "role": "assistant",
        "content": "A1",
        "tool_calls": [
            {"id": "123456789", "function": {"name": "F1", "arguments": "{}"}},
            {"id": "999999999", "function": {"name": "F2", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "123456789", "content": "R1"},
    {"role": "tool", "tool_call_id": "999999999", "content": "R2"},
    {"role": "assistant", "content": "A2"},
    {"role": "user", "content": "U2"},
]


def test_mistral_template_matches_mistral_common():
    """The expected text of mistral-common's own v14 test (`tests/test_tokenize_v14.py`-style fixture)."""
    tools = (
        '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "math_interpreter", "description": "Get the value '
        'of an arithmetic expression.", "parameters": {"type": "object", "properties": {"expression": {"type": '
        '"string", "description": "Math expression."}}}}}][/AVAILABLE_TOOLS]'
    )
    rest = (
        "[INST]U1[/INST]A1[TOOL_CALLS]F1[ARGS]{}[TOOL_CALLS]F2[ARGS]{}</s>[TOOL_RESULTS]R1[/TOOL_RESULTS]"
        "[TOOL_RESULTS]R2[/TOOL_RESULTS]A2</s>[INST]U2[/INST]"
    )
    mistral = chat_format_for("mistral4")
    high = '[MODEL_SETTINGS]{"reasoning_effort": "high"}[/MODEL_SETTINGS]'
    none = '[MODEL_SETTINGS]{"reasoning_effort": "none"}[/MODEL_SETTINGS]'
    assert (
        mistral.render(MISTRAL_CHAT, tools=[MATH], reasoning_effort="high")
        == "<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT]" + tools + high + rest
    )
    assert mistral.render(MISTRAL_CHAT) == "<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT]" + none + rest
    assert mistral.render(MISTRAL_CHAT[1:2], thinking=True) == "<s>" + high + "[INST]U1[/INST]"
    custom = chat_format_for(
        "mistral4", demo_template("mistral4"), {"bos_token": "<BOS>", "eos_token": "<EOS>"}
    )
    assert custom.render(MISTRAL_CHAT[5:], thinking=False) == "<BOS>" + none + "A2<EOS>[INST]U2[/INST]"


NEMOTRON_TOOLS = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>get_weather</name>\n"
    "<description>Weather of a city</description>\n<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n"
    '</parameter>\n<required>["city"]</required>\n</parameters>\n</function>\n</tools>\n\n'
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)


def test_nemotron_template():
    want = (
        "<|im_start|>system\nBe brief.\n\n" + NEMOTRON_TOOLS + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think><tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>It is sunny.<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )  # fmt: skip
    nemotron = chat_format_for("nemotron_h")
    assert nemotron.render(CHAT, tools=TOOLS) == want
    assert nemotron.render(HISTORY, thinking=False, truncate_history_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nGreet back.\n</think>\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think></think>"
    )


# ---------------------------------------------------------------------------------- Jinja sandbox, errors


def test_jinja_helpers_and_kwargs():
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}"
        "{% endif %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ tools | tojson(indent=1) if tools }}"
        "|{{ flag }}|{{ enable_thinking }}|{{ reasoning_effort | default('-') }}|{{ bos_token }}"
        "{% generation %}{{ (strftime_now('%Y') | int) > 2000 }}{% endgeneration %}"
    )
    chat = JinjaChat(template, {"bos_token": "<B>"})
    got = chat.render(CHAT, tools=[{"a": "é"}], thinking=False, chat_template_kwargs={"flag": "on"})
    assert got == '[user:Weather in Paris?][\n {\n  "a": "é"\n }\n]|on|False|-|<B>True'
    assert chat.render(CHAT[:1], reasoning_effort="none").endswith("||False|none|<B>True")


def test_jinja_arguments_become_objects():
    chat = JinjaChat(
        "{% for m in messages %}{% for tc in m.tool_calls %}{{ tc.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    assert chat.render(CHAT[2:3]) == "Paris"
    with pytest.raises(RequestError, match="not valid JSON"):
        chat.render(
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
        )


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
        ("{{ messages[7].content }}", "failed to render"),
        ("{{ messages[0].content[99999].strip() }}", "failed to render"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{{ messages.append(1) }}", "SecurityError"),
        ("{{ ''.__class__.__mro__ }}", "failed to render"),
    ],
)
def test_template_failures_are_request_errors(template, match):
    with pytest.raises(RequestError, match=match):
        JinjaChat(template).render(HISTORY)


def test_bad_templates_and_messages():
    with pytest.raises(ConfigError, match="does not compile"):
        chat_format_for("glm5_next", "{% if messages %}unclosed")
    with pytest.raises(ConfigError, match="no chat template"):
        chat_format_for("llama")
    for fmt in (chat_format_for(m) for m in ("glm5_next", "deepseek_v4", "kimi_k3")):
        with pytest.raises(RequestError, match="role"):
            fmt.render([{"role": "wizard", "content": "x"}])
        with pytest.raises(RequestError, match="messages must be a list"):
            fmt.render("hello")
        with pytest.raises(RequestError, match="content"):
            fmt.render([{"role": "user", "content": 3}])
    with pytest.raises(RequestError, match="tool result"):
        chat_format_for("kimi_k3").render([{"role": "tool", "content": "orphan"}])
    with pytest.raises(RequestError, match="JSON object"):
        chat_format_for("deepseek_v4").render(
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]
        )


def test_read_chat_template(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
        )
    )
    assert read_chat_template(tmp_path) == "D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages | length }}"}))
    assert chat_format_for("mistral4", read_chat_template(tmp_path)).render(HISTORY) == "3"
    (tmp_path / "chat_template.jinja").write_text("file wins")
    assert read_chat_template(tmp_path) == "file wins"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json"):
        read_chat_template(tmp_path)


def test_demo_templates_and_special_tokens():
    """Every family has a prompt; each special token of a demo tokenizer is a marker its prompts or its
    output parser use, and every parser marker the prompts contain is one of them (or starts with one)."""
    for model_type in (
        "glm5_next",
        "deepseek_v4",
        "deepseek_v41",
        "kimi_k3",
        "kimi_linear",
        "mistral4",
        "nemotron_h",
    ):
        fmt = chat_format_for(model_type)
        prompts = (
            fmt.render(CHAT, tools=TOOLS)
            + fmt.render(HISTORY, thinking=False)
            + fmt.render(HISTORY, thinking=True)
        )
        tokens = SPECIAL_TOKENS[model_type]
        assert len(set(tokens)) == len(tokens)
        markup = make_parser(parser_for_model_type(model_type)).markup
        for t in tokens:
            assert t in prompts or any(m.startswith(t) for m in markup), (model_type, t)
        for m in markup:
            if m in prompts:
                assert any(m.startswith(t) for t in tokens), (model_type, m)
    assert demo_template("deepseek_v4") is None and demo_template("glm5_next_text") == demo_template(
        "glm5_next"
    )


@pytest.mark.parametrize("model_type", ["glm5_next", "deepseek_v4", "deepseek_v41", "kimi_k3", "nemotron_h"])
def test_the_prompt_tells_the_parser_where_the_output_starts(model_type):
    fmt, name = chat_format_for(model_type), parser_for_model_type(model_type)
    assert thinking_for_prompt(name, fmt.render(HISTORY, thinking=True), default=False) is True
    assert thinking_for_prompt(name, fmt.render(HISTORY, thinking=False), default=True) is False


def test_tools_must_name_a_function():
    for model_type in ("deepseek_v4", "kimi_k3"):
        with pytest.raises(RequestError, match=r"tools\[0\]"):
            chat_format_for(model_type).render(HISTORY, tools=["get_weather"])


def test_a_prompt_without_reasoning_markers_keeps_the_default():
    prompt = chat_format_for("mistral4").render(HISTORY, thinking=True)
    assert [thinking_for_prompt("mistral", prompt, d) for d in (False, True)] == [False, True]
