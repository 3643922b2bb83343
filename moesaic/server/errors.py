"""The error bodies of both surfaces, and the status of each error a request can cause.

OpenAI routes answer `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status (vLLM's
body since its PR #22099, which the openai clients read); Anthropic routes (`/v1/messages...`) answer
`{"type": "error", "error": {"type", "message"}}`. In a stream the same body goes out as one SSE frame.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from moesaic.errors import CapacityError, MoesaicError, RequestError

OPENAI_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


class HTTPError(Exception):
    """An error answered with `status`; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def from_exception(e: BaseException) -> HTTPError:
    """The HTTP error of an exception raised while serving a request: the user's mistakes (RequestError,
    CapacityError: a prompt too long, a request that can never fit) are 400, anything else 500."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, RequestError | CapacityError):
        return HTTPError(400, str(e))
    if isinstance(e, MoesaicError):
        return HTTPError(500, str(e))
    return HTTPError(500, f"internal error: {type(e).__name__}: {e}")


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def body(e: HTTPError, anthropic: bool) -> dict:
    if anthropic:
        return {
            "type": "error",
            "error": {"type": ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message},
        }
    kind = OPENAI_TYPES.get(e.status, "BadRequestError" if e.status < 500 else "InternalServerError")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.status}}


def response(e: HTTPError, anthropic: bool, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body(e, anthropic), status_code=e.status, headers=headers)


def raw_response(e: HTTPError, anthropic: bool) -> tuple[dict, bytes]:
    """The ASGI start message and body of an error, for the pure-ASGI middlewares."""
    data = json.dumps(body(e, anthropic)).encode()
    start = {
        "type": "http.response.start",
        "status": e.status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
    }
    return start, data
