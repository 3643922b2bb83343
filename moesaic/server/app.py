"""The FastAPI app: routes, the API-key and body-size guards, error handlers, and `Server`, what every route
reads (the async engine, tokenizer, chat format, output parser, grammars, metrics, limits).

`build_app(llm, ...)` takes a loaded `moesaic.LLM` (the entry points build it: the server sits below them)
and drives its engine through an AsyncEngine. A request is checked whole before it is queued, so that its
errors get their HTTP status (400/404/503); what fails after a stream has started is an error frame.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moesaic.engine.async_engine import AsyncEngine
from moesaic.errors import ConfigError, MoesaicError

from . import anthropic, errors, openai
from .chat import chat_format_for, read_chat_template
from .errors import HTTPError
from .grammar import Grammars
from .metrics import Metrics
from .parsers import PARSERS, parser_for_model_type
from .protocol import (
    ChatRequest,
    CompletionRequest,
    CountTokensRequest,
    DetokenizeRequest,
    MessagesRequest,
    TokenizeRequest,
)

log = logging.getLogger("moesaic.server")

MAX_BODY_BYTES = 32 * 2**20
MAX_PENDING = 1024  # requests in flight (running + queued) before new ones get 503


class Server:
    """What the routes share. `llm`: a loaded moesaic.LLM (its engine, tokenizer, family, config, path)."""

    def __init__(
        self,
        llm,
        served_model_names=None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        max_pending: int = MAX_PENDING,
        drain_timeout: float = 30.0,
    ):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_type = llm.family.MODEL_TYPES[0]
        self.vocab_size = llm.cfg.vocab_size
        self.max_context = llm.engine.max_context
        self.names = list(served_model_names or [str(getattr(llm, "name", None) or Path(llm.path).name)])
        self.parser = _parser_name(self.model_type, tool_call_parser, reasoning_parser)
        self.chat = None
        if self.tokenizer is not None:
            special = getattr(self.tokenizer, "special", None) or {}
            tokens = {k: v or "" for k, v in special.items() if isinstance(k, str) and k.endswith("_token")}
            if not tokens and "<s>" in special:  # the byte tokenizer's base specials
                tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
            template = chat_template if chat_template is not None else read_chat_template(llm.path)
            self.chat = chat_format_for(self.model_type, template, tokens)
        self.grammars = (
            Grammars(self.tokenizer, self.vocab_size, llm.engine.eos_ids) if self.tokenizer else None
        )
        self.engine = AsyncEngine(llm.engine)
        self.metrics = Metrics(self.engine, self.names[0])
        self.max_pending = max_pending
        self.drain_timeout = drain_timeout
        self.draining = False
        self.created = int(time.time())

    # ---- checks every route makes
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise HTTPError(
                404,
                f"The model `{name}` does not exist (this server serves {', '.join(self.names)})",
                "model",
            )

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise HTTPError(400, f"{what} needs a tokenizer; this checkpoint has none (send token ids)")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.need_tokenizer("text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise HTTPError(
                400, f"the text is not valid Unicode: a lone surrogate at index {e.start}"
            ) from None
        return self.tokenizer.encode(text, add_bos=add_bos)

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise HTTPError(400, "the prompt is empty: give at least one token", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise HTTPError(
                400, f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})", param
            )

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str = "messages") -> int:
        """The max_tokens of a request (the rest of the context when not given); 400 when it cannot fit."""
        if self.max_context is None:
            return 16 if max_tokens is None else max_tokens
        if prompt_len >= self.max_context:
            raise HTTPError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt has {prompt_len}",
                param,
            )
        if max_tokens is None:
            return self.max_context - prompt_len
        if max_tokens >= 1 and prompt_len + max_tokens > self.max_context:
            raise HTTPError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                "max_tokens",
            )
        return max_tokens

    def render(
        self,
        messages,
        tools=None,
        thinking=None,
        reasoning_effort=None,
        chat_template_kwargs=None,
        add_generation_prompt: bool = True,
    ) -> str:
        self.need_tokenizer("chat")
        if not messages:
            raise HTTPError(400, "messages must hold at least one message", "messages")
        kwargs = {"chat_template_kwargs": chat_template_kwargs or {}}
        if reasoning_effort is not None:
            kwargs["reasoning_effort"] = reasoning_effort
        return self.chat.render(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            **kwargs,
        )

    # ---- the engine
    def submit(self, ids: list[int], params, request_id: str):
        """Queues one prompt; its async iterator of outputs. 503 while overloaded or shutting down."""
        if self.draining or not self.engine.accepting:
            raise HTTPError(503, "the server is shutting down; no new requests")
        if not self.engine.thread.is_alive():
            raise HTTPError(503, "the engine has stopped")
        if len(self.engine.requests) >= self.max_pending:
            raise HTTPError(
                503, f"the server is overloaded ({len(self.engine.requests)} requests in flight); retry later"
            )
        try:
            return self.engine.add_request(ids, params, request_id)
        except MoesaicError as e:
            raise errors.from_exception(e) from None

    def submit_all(self, prompts: list[list[int]], params, request_id: str) -> list:
        """Every prompt queued, or none (a later one's error aborts the ones before it)."""
        gens = []
        try:
            for i, ids in enumerate(prompts):
                gens.append(
                    self.submit(ids, params, request_id if len(prompts) == 1 else f"{request_id}-{i}")
                )
        except BaseException:
            for i in range(len(gens)):
                self.engine.abort(request_id if len(prompts) == 1 else f"{request_id}-{i}")
            raise
        return gens

    def request_done(self, request_id, reason, prompt_tokens, completion_tokens, start, first) -> None:
        end = time.perf_counter()
        self.metrics.request_done(reason or "abort", prompt_tokens, completion_tokens, start, first, end)
        log.info(
            "%s: %d prompt tokens, %d completion tokens, %.3f s, %s",
            request_id,
            prompt_tokens,
            completion_tokens,
            end - start,
            reason or "abort",
        )


def _parser_name(model_type: str, tool_call_parser: str | None, reasoning_parser: str | None) -> str:
    """One parser splits reasoning and tool calls together: the flags may name it, and must agree."""
    for flag, name in (("--tool-call-parser", tool_call_parser), ("--reasoning-parser", reasoning_parser)):
        if name is not None and name not in PARSERS:
            raise ConfigError(f"{flag} {name!r}: unknown parser (known: {', '.join(sorted(PARSERS))})")
    if tool_call_parser and reasoning_parser and PARSERS[tool_call_parser] is not PARSERS[reasoning_parser]:
        raise ConfigError(
            f"--tool-call-parser {tool_call_parser!r} and --reasoning-parser {reasoning_parser!r} differ: moesaic's "
            "parsers split reasoning and tool calls jointly, so give one of them (or the same name)"
        )
    return tool_call_parser or reasoning_parser or parser_for_model_type(model_type)


# ----------------------------------------------------------------------------- guards (pure ASGI)


class BodyLimit:
    """413 for a body over `limit` bytes (Content-Length, or counted while reading a chunked one). The body
    is read here and handed on whole; after it the app's `receive` is the server's (disconnects)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        too_large = HTTPError(413, f"the request body is larger than {self.limit} bytes")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _send_error(send, too_large, scope["path"])
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect while reading: nothing to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await _send_error(send, too_large, scope["path"])
            if not message.get("more_body", False):
                break
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKeys:
    """`--api-key`: `/v1*` routes need `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`); each
    key is compared in constant time. OPTIONS, /health, /metrics and /tokenize are open (vLLM's choice)."""

    def __init__(self, app, keys):
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        given = []
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given.append(auth[7:].strip())
        if b"x-api-key" in headers:
            given.append(headers[b"x-api-key"].strip())
        ok = False
        for g in given:
            for k in self.keys:  # every comparison runs: the time does not tell which key nearly matched
                ok |= hmac.compare_digest(g, k)
        if not ok:
            return await _send_error(send, HTTPError(401, "invalid or missing API key"), scope["path"])
        await self.app(scope, receive, send)


async def _send_error(send, e: HTTPError, path: str) -> None:
    start, data = errors.raw_response(e, errors.is_anthropic(path))
    await send(start)
    await send({"type": "http.response.body", "body": data, "more_body": False})


# ----------------------------------------------------------------------------- the app


def build_app(
    llm,
    api_keys=None,
    served_model_names=None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    max_pending: int = MAX_PENDING,
    max_body_bytes: int = MAX_BODY_BYTES,
    drain_timeout: float = 30.0,
) -> FastAPI:
    srv = Server(
        llm, served_model_names, chat_template, tool_call_parser, reasoning_parser, max_pending, drain_timeout
    )

    @asynccontextmanager
    async def lifespan(app):
        yield
        srv.draining = True
        await asyncio.to_thread(srv.engine.shutdown, srv.drain_timeout)

    app = FastAPI(title="moesaic", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.moesaic = srv
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_keys:
        app.add_middleware(ApiKeys, keys=list(api_keys))

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return errors.response(e, errors.is_anthropic(request.url.path))

    @app.exception_handler(MoesaicError)
    async def _moesaic_error(request: Request, e: MoesaicError):
        return errors.response(errors.from_exception(e), errors.is_anthropic(request.url.path))

    @app.exception_handler(Exception)
    async def _internal(
        request: Request, e: Exception
    ):  # a bug: logged by the server, answered in the envelope
        return errors.response(errors.from_exception(e), errors.is_anthropic(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        what = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            what = f"the body is not valid JSON ({first.get('ctx', {}).get('error', what)})"
            param = None
        message = f"{param}: {what}" if param else what
        return errors.response(HTTPError(400, message, param), errors.is_anthropic(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, e: StarletteHTTPException):
        message = (
            f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        )
        return errors.response(HTTPError(e.status_code, message), errors.is_anthropic(request.url.path))

    @app.get("/health")
    async def health():
        if srv.draining or not srv.engine.thread.is_alive():
            return errors.response(
                HTTPError(503, "shutting down" if srv.draining else "the engine has stopped"), False
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        data = [
            {
                "id": name,
                "object": "model",
                "created": srv.created,
                "owned_by": "moesaic",
                "root": str(srv.llm.path),
                "max_model_len": srv.max_context,
            }
            for name in srv.names
        ]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        srv.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            text = srv.render(
                body.messages,
                body.tools,
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
            )
            ids = srv.encode(text, add_bos=False)
        else:
            ids = srv.encode(body.prompt, add_bos=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": srv.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        srv.check_model(body.model)
        srv.need_tokenizer("detokenize")
        bad = [t for t in body.tokens if not 0 <= t < srv.vocab_size]
        if bad:
            raise HTTPError(
                400, f"token ids {bad[:5]} are outside the vocabulary (0..{srv.vocab_size - 1})", "tokens"
            )
        return {"prompt": srv.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await openai.completions(srv, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await openai.chat(srv, body, request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await anthropic.messages(srv, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return anthropic.count_tokens(srv, body)

    return app
