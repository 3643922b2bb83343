"""DeepSeek-V4 and V4.1 prompts (the releases ship no Jinja template, only a Python encoder).

    <｜begin▁of▁sentence｜>{system}\\n\\n## Tools ...<｜User｜>{user}<｜Assistant｜><think>

- The tools are attached to the system message (one with empty content is added when there is none)
  as a "## Tools" section with the DSML call syntax and one JSON schema per line.
- Thinking mode ends the generation prompt with `<think>`, chat mode with `</think>`. In thinking mode
  the first message is preceded by the reasoning-effort instruction.
- An assistant turn is `{reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>`
  plus `<｜end▁of▁sentence｜>`. Turns before the last user message lose their reasoning (and their
  header gets `</think>`), unless the conversation has tools: then every turn keeps it.
- Tool results join the following user turn: `<｜User｜><tool_result>{result}</tool_result>`, ordered
  as the calls were.
- V4.1 puts `<｜System｜>` before the system prompt (and before any later system message), writes the
  effort as "Reasoning Effort: N (range 1-100, ...)", and spaces its DSML names (`<｜DSML｜ calls>`).

Written from DeepSeek's encoding scripts (`encoding_dsv32.py` and the V4/V4.1 encoders vendored in
vLLM as `vllm/tokenizers/deepseek_v4_encoding.py`, `deepseek_v41_encoding.py`) and the serving
wrappers around them (vLLM `vllm/tokenizers/deepseek_v4.py`, `deepseek_v41.py`): tools attached to the
system message, thinking on by default, reasoning_effort none/low/high/max.
"""

from __future__ import annotations

import json

from moesaic.errors import RequestError

from .common import options, read_messages, text_of, thinking_on, tool_functions

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, SYSTEM = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
THINK, END_THINK = "<think>", "</think>"

TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{block}" block like the following:

{block}
{invoke}$TOOL_NAME">
{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{param_end}
...
{invoke_end}
{invoke}$TOOL_NAME2">
...
{invoke_end}
{block_end}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

V4_EFFORT = {
    "low": "",
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
        "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
        "and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, "
        "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
        "unchecked.\n\n"
    ),
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
        "exhaustively decompose the problem into its most fundamental components, trace every causal "
        "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles "
        "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
    ),
}
# OpenAI's effort names onto V4's three prompts (as vLLM maps them)
V4_EFFORT_NAMES = {
    "minimal": "low",
    "low": "low",
    "medium": "low",
    "high": "high",
    "xhigh": "high",
    "max": "max",
}
V41_EFFORT = {"minimal": 25, "low": 25, "medium": 50, "high": 50, "xhigh": 75, "max": 100}


class DeepSeekV4Chat:
    """The DeepSeek-V4 encoder. `render(..., reasoning_effort=, drop_thinking=)`."""

    dsml = "｜DSML｜"
    block, tag_invoke, tag_param = "tool_calls", "invoke", "parameter"

    def render(
        self, messages, tools=None, add_generation_prompt: bool = True, thinking=None, **kwargs
    ) -> str:
        opts = options(kwargs)
        thinking = thinking_on(thinking, opts)
        effort = self._effort(opts.get("reasoning_effort")) if thinking else None
        msgs = self._prepare(read_messages(messages), tools)
        drop = bool(opts.get("drop_thinking", True)) and not any(m.get("tools") for m in msgs)
        if thinking and drop:  # earlier developer messages go too (their reasoning is never rendered)
            last = self._last_user(msgs)
            msgs = [m for i, m in enumerate(msgs) if not (m["role"] == "developer" and i < last)]
        last = self._last_user(msgs)
        parts = [BOS]
        for i in range(len(msgs)):
            parts.append(self._message(i, msgs, thinking, drop, effort, last, add_generation_prompt))
        return "".join(parts)

    # --- the pieces ---------------------------------------------------------------

    def _effort(self, effort):
        if effort is None:
            return "high"
        if effort not in V4_EFFORT_NAMES:
            raise RequestError(f"reasoning_effort {effort!r}: DeepSeek-V4 takes none, low, high or max")
        return V4_EFFORT_NAMES[effort]

    def _effort_prompt(self, effort) -> str:
        return V4_EFFORT[effort]

    def _tags(self) -> dict:
        d = self.dsml
        return {
            "block": f"<{d}{self.block}>",
            "block_end": f"</{d}{self.block}>",
            "invoke": f'<{d}{self.tag_invoke} name="',
            "invoke_end": f"</{d}{self.tag_invoke}>",
            "param": f"<{d}{self.tag_param}",
            "param_end": f"</{d}{self.tag_param}>",
        }

    def _tools_prompt(self, tools) -> str:
        schemas = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in tool_functions(tools))
        return TOOLS_PROMPT.format(schemas=schemas, **self._tags())

    def _prepare(self, msgs: list[dict], tools) -> list[dict]:
        """Tools onto the leading system message; runs of assistant turns merged; tool results merged
        into user turns."""
        if tools:
            if msgs and msgs[0]["role"] in ("system", "developer"):
                msgs[0] = {**msgs[0], "tools": tools}
            else:
                msgs.insert(0, {"role": "system", "content": "", "tools": tools, "tool_calls": []})
        return _merge_tool_results(_merge_assistants(msgs))

    def _last_user(self, msgs) -> int:
        return max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)

    def _calls(self, calls: list[dict]) -> str:
        t = self._tags()
        invokes = []
        for c in calls:
            args = c["arguments"]
            if not isinstance(args, dict):
                raise RequestError(f"tool call {c['name']!r}: arguments are not a JSON object")
            params = "\n".join(
                f'{t["param"]} name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{t['param_end']}"
                for k, v in args.items()
            )
            invokes.append(f'{t["invoke"]}{c["name"]}">\n{params}\n{t["invoke_end"]}')
        return "\n\n" + t["block"] + "\n" + "\n".join(invokes) + "\n" + t["block_end"]

    def _body(self, m: dict, tag: str = "") -> str:
        """A system/developer/user body; tools and tool results included."""
        if m.get("blocks") is not None:
            text = "\n\n".join(m["blocks"])
        else:
            text = text_of(m.get("content"))
        if m.get("tools"):
            text += "\n\n" + self._tools_prompt(m["tools"])
        return tag + text

    def _message(self, i, msgs, thinking, drop, effort, last_user, add_generation_prompt) -> str:
        m, role = msgs[i], msgs[i]["role"]
        out = self._effort_prompt(effort) if i == 0 and thinking else ""
        if role == "system":
            out += self._body(m)
        elif role in ("user", "developer"):
            out += self._body(m, USER)
        else:  # assistant
            reasoning = (
                (m.get("reasoning") or "") + END_THINK if thinking and (not drop or i > last_user) else ""
            )
            calls = self._calls(m["tool_calls"]) if m["tool_calls"] else ""
            out += reasoning + text_of(m.get("content")) + calls + EOS
        is_last = i == len(msgs) - 1
        if is_last and not add_generation_prompt:
            return out
        if not is_last and msgs[i + 1]["role"] != "assistant":
            return out
        if role != "assistant":
            out += ASSISTANT + (THINK if thinking and (not drop or i >= last_user) else END_THINK)
        return out


class DeepSeekV41Chat(DeepSeekV4Chat):
    """The DeepSeek-V4.1 encoder: V4's layout with `<｜System｜>`, a 1-100 effort and spaced DSML names."""

    block, tag_invoke, tag_param = " calls", " invoke", " parameter"

    def _effort(self, effort):
        if effort is None:
            return 50
        if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
            return effort
        if effort not in V41_EFFORT:
            raise RequestError(
                f"reasoning_effort {effort!r}: DeepSeek-V4.1 takes none, low, high, xhigh, max or 1-100"
            )
        return V41_EFFORT[effort]

    def _effort_prompt(self, effort) -> str:
        return f"Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

    def _prepare(self, msgs: list[dict], tools) -> list[dict]:
        """Tools onto the first system message; tool results merged into user turns (no assistant merge)."""
        if tools:
            i = next((i for i, m in enumerate(msgs) if m["role"] == "system"), None)
            if i is None:
                msgs.insert(0, {"role": "system", "content": "", "tool_calls": []})
                i = 0
            msgs[i] = {**msgs[i], "tools": tools}
        return _merge_tool_results(msgs, "\n\n")

    def _last_user(self, msgs) -> int:
        return max(
            (
                i
                for i, m in enumerate(msgs)
                if m["role"] in ("user", "developer") or (m["role"] == "system" and i)
            ),
            default=-1,
        )

    def _message(self, i, msgs, thinking, drop, effort, last_user, add_generation_prompt) -> str:
        m, role = msgs[i], msgs[i]["role"]
        effort_prompt = self._effort_prompt(effort) if i == 0 and thinking else ""
        out = (SYSTEM if i == 0 and (effort_prompt or role == "system") else "") + effort_prompt
        if role == "system":
            out += self._body(m, SYSTEM if i > 0 else "")
        elif role in ("user", "developer"):
            out += self._body(m, USER)
        else:
            reasoning = (
                (m.get("reasoning") or "") + END_THINK if thinking and (not drop or i > last_user) else ""
            )
            calls = self._calls(m["tool_calls"]) if m["tool_calls"] else ""
            out += reasoning + text_of(m.get("content")) + calls + EOS
        is_last = i == len(msgs) - 1
        if is_last and not add_generation_prompt:
            return out
        if not is_last and msgs[i + 1]["role"] != "assistant":
            return out
        if (
            role in ("user", "developer")
            or (role == "system" and i > 0)
            or (is_last and role in ("system", "assistant"))
        ):
            out += ASSISTANT + (THINK if thinking and (not drop or i >= last_user) else END_THINK)
        return out


def _merge_assistants(msgs: list[dict]) -> list[dict]:
    """A run of assistant messages is one turn: contents and reasonings joined by a blank line, calls in order."""
    out: list[dict] = []
    for m in msgs:
        if m["role"] == "assistant" and out and out[-1]["role"] == "assistant":
            prev = out[-1]
            joined = {}
            for key in ("content", "reasoning"):
                texts = [t for t in (text_of(prev.get(key)), text_of(m.get(key))) if t]
                joined[key] = "\n\n".join(texts) or None
            out[-1] = {**prev, **joined, "tool_calls": prev["tool_calls"] + m["tool_calls"]}
        else:
            out.append(m)
    return out


def _merge_tool_results(msgs: list[dict], sep: str = "") -> list[dict]:
    """DeepSeek has no tool role: each result becomes a `<tool_result>` block of a user turn, and the
    user text after it joins the same turn; blocks follow the order of the calls. `sep` joins the text
    parts of a user message."""
    out: list[dict] = []
    order: dict = {}
    for m in msgs:
        role = m["role"]
        if role == "assistant" and m["tool_calls"]:
            order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c.get("id")}
        if role in ("tool", "user"):
            if role == "tool":
                block = (
                    "tool",
                    m.get("tool_call_id"),
                    "<tool_result>" + text_of(m.get("content"), "\n\n") + "</tool_result>",
                )
            else:
                block = ("text", None, text_of(m.get("content"), sep))
            if out and out[-1]["role"] == "user" and out[-1].get("raw_blocks") is not None:
                out[-1]["raw_blocks"].append(block)
            else:
                out.append({**m, "role": "user", "raw_blocks": [block], "order": order})
        else:
            out.append(m)
    for m in out:
        raw = m.pop("raw_blocks", None)
        if raw is None:
            continue
        order = m.pop("order")
        results = sorted((b for b in raw if b[0] == "tool"), key=lambda b: order.get(b[1], 0))
        it = iter(results)
        m["blocks"] = [next(it)[2] if b[0] == "tool" else b[2] for b in raw]
    return out
