"""Chat formats: a conversation (OpenAI messages + tools) rendered into the prompt the family expects.

    fmt = chat_format_for(model_type, template=read_chat_template(folder))
    prompt = fmt.render(messages, tools=tools, add_generation_prompt=True, thinking=None,
                        reasoning_effort=..., chat_template_kwargs={...})

A template, when there is one (the checkpoint's, or `--chat-template`), is rendered in a Jinja sandbox
(`jinja.JinjaChat`). DeepSeek-V4/V4.1 and Kimi K3 ship no template: moesaic's own encoders render them
(`deepseek.py`, `kimi_k3.py`). The families that ship one (GLM, Kimi Linear, Mistral, Nemotron) fall
back to the demo template in `templates/<model_type>.jinja` when a checkpoint lacks it.
`thinking=None` keeps the family's default. `SPECIAL_TOKENS[model_type]` lists the marker strings a
demo tokenizer must keep as single tokens for the family's prompts and output parser.
"""

from __future__ import annotations

import json
from pathlib import Path

from moesaic.errors import ConfigError

from .deepseek import DeepSeekV4Chat, DeepSeekV41Chat
from .jinja import JinjaChat
from .kimi_k3 import KimiK3Chat

TEMPLATES = Path(__file__).parent / "templates"

ENCODERS = {"deepseek_v4": DeepSeekV4Chat, "deepseek_v41": DeepSeekV41Chat, "kimi_k3": KimiK3Chat}

_DSML_V4 = [
    "｜DSML｜",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    "<｜DSML｜invoke",
    "</｜DSML｜invoke>",
]
_DSML_V4 += ["<｜DSML｜parameter", "</｜DSML｜parameter>"]
_DEEPSEEK = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
]

SPECIAL_TOKENS: dict[str, list[str]] = {
    "glm5_next": [
        "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
        "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
        "</arg_value>", "<tool_response>", "</tool_response>",
    ],
    "deepseek_v4": _DEEPSEEK + _DSML_V4 + ["<tool_result>", "</tool_result>"],
    "deepseek_v41": _DEEPSEEK + ["<｜System｜>", "｜DSML｜", "<｜DSML｜ calls>", "</｜DSML｜ calls>",
                                 "<｜DSML｜ invoke", "</｜DSML｜ invoke>", "<｜DSML｜ parameter",
                                 "</｜DSML｜ parameter>", "<tool_result>", "</tool_result>"],
    "kimi_k3": ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"],
    "kimi_linear": [
        "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>",
    ],
    "mistral4": [
        "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[THINK]",
        "[/THINK]", "[MODEL_SETTINGS]", "[/MODEL_SETTINGS]",
    ],
    "nemotron_h": [
        "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
        "<tool_response>", "</tool_response>", "<function=", "</function>", "<parameter=", "</parameter>",
        "<TOOLCALL>", "</TOOLCALL>",
    ],
}  # fmt: skip
SPECIAL_TOKENS["glm5_next_text"] = SPECIAL_TOKENS["glm5_next"]


def demo_template(model_type: str) -> str | None:
    """The packaged template of a family that ships one (the demo checkpoints get these)."""
    path = TEMPLATES / f"{model_type.removesuffix('_text')}.jinja"
    return path.read_text() if path.exists() else None


def read_chat_template(folder) -> str | None:
    """A checkpoint's template: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`
    (a string, or a list of {"name", "template"} of which "default" is used)."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    if not config.exists():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{config}: not a JSON object ({e})") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{config}: chat_template must be a string or a list of named templates")
    return template


def chat_format_for(model_type: str, template: str | None = None, special_tokens: dict | None = None):
    """The chat format of a family: `template` if given, else the family's encoder, else its packaged
    template. `special_tokens` ({"bos_token": ..., ...}) are variables of a Jinja template."""
    if template is not None:
        return JinjaChat(template, special_tokens)
    if model_type in ENCODERS:
        return ENCODERS[model_type]()
    packaged = demo_template(model_type)
    if packaged is None:
        raise ConfigError(f"model_type {model_type!r} has no chat template; pass one (--chat-template FILE)")
    return JinjaChat(packaged, special_tokens, source=f"the {model_type} chat template")


__all__ = ["SPECIAL_TOKENS", "chat_format_for", "demo_template", "read_chat_template", "JinjaChat"]
