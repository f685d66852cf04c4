"""API errors: one exception type, rendered as an OpenAI or an Anthropic error object.

Routes raise `APIError(status, message, ...)`; the app's exception handlers pick the shape from
the route (/v1/messages speaks Anthropic, everything else OpenAI). Nothing a client sends may
crash the server: unexpected exceptions become 500 errors of the same shapes, whose message
names no internals (those go to the server log with the request's id).
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

# HTTP status -> (OpenAI error type, Anthropic error type).
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    408: ("timeout_error", "timeout_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("internal_server_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
}
# Any other 5xx (a router's 502 when a replica failed, its 504 when one was too slow) is the
# server's failure, never the client's: it must not read as a request to fix and resend.
# Other 4xx keep the types they always had.
_SERVER_TYPES = ("server_error", "api_error")
_CLIENT_TYPES = ("invalid_request_error", "api_error")


def _types(status: int) -> tuple[str, str]:
    return _TYPES.get(status) or (_SERVER_TYPES if status >= 500 else _CLIENT_TYPES)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def openai_body(self) -> dict:
        kind = _types(self.status)[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def anthropic_body(self) -> dict:
        kind = _types(self.status)[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body(self, anthropic: bool = False) -> dict:
        return self.anthropic_body() if anthropic else self.openai_body()

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.body(anthropic), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def install_error_handlers(app, process: str) -> None:
    """APIError -> its status and body in the route's protocol (OpenAI or Anthropic); any other
    exception -> a 500 that points at `process`'s log (a bug, never the client's fault: the
    details go to the log, not to the client). Used by the server and the router alike."""
    import logging

    from fastapi import Request

    logger = logging.getLogger(f"deepinfer.{process}")

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response(anthropic=is_anthropic_path(request.url.path))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        wrapped = APIError(500, f"internal {process} error (the {process} log has the details)")
        return wrapped.response(anthropic=is_anthropic_path(request.url.path))
