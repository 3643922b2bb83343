"""The request bodies, as pydantic models with vLLM's field names. Unknown fields are accepted (clients send
fields of newer API versions) and logged once per request; the response bodies are plain dicts built in
openai.py and anthropic.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MIN, SEED_END = -(2**63), 2**64  # int64 and uint64 seeds both work


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(Body):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class Sampling(Body):
    """What completions and chat share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, lt=SEED_END)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: each choice (and chunk) also carries its token ids
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatRequest(Sampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # deprecated by OpenAI; max_completion_tokens wins
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class MessagesRequest(Body):
    """Anthropic's /v1/messages."""

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(Body):
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
