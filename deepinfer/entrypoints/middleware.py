"""ASGI middleware of the server: API-key check and the request-body size limit.

Both are plain ASGI callables, not `@app.middleware("http")` (Starlette's BaseHTTPMiddleware):
that one wraps every request in a task group and memory streams, which cost a large share of the
front end's time per streamed token (docs/benchmarks/design-measurements.md#plain-asgi-middleware),
and it hides the client's `http.disconnect` from the route,
so a non-streaming request whose client went away would run to its end.
"""

from __future__ import annotations

import hmac
import json

from deepinfer.entrypoints.errors import APIError, is_anthropic_path

# Routes anyone may call even when --api-key is set (probes and scrapers carry no key).
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics", "/docs", "/openapi.json", "/redoc")


async def send_error(send, path: str, error: APIError) -> None:
    """Answer with `error` in the route's protocol shape (OpenAI or Anthropic)."""
    body = json.dumps(error.anthropic_body() if is_anthropic_path(path) else error.openai_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """401 unless the request carries the key (Authorization: Bearer KEY, or x-api-key)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PATHS) or self._matches(scope):
            return await self.app(scope, receive, send)
        await send_error(send, scope["path"], APIError(
            401, "Invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key').",
            code="invalid_api_key"))

    def _matches(self, scope) -> bool:
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        offered = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(offered, self.key)


class BodySizeLimitMiddleware:
    """413 at once for a body whose Content-Length is over `limit` bytes, before any of it is
    read. A chunked body (no Content-Length) is counted as it is read (state.read_json)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.limit:
                return await send_error(send, scope["path"], body_too_large(int(declared), self.limit))
        return await self.app(scope, receive, send)


def body_too_large(size: int, limit: int, streamed: bool = False) -> APIError:
    what = f"more than {limit}" if streamed else str(size)
    return APIError(413, f"the request body is {what} bytes; the limit is {limit} bytes "
                         "(--max-request-body-bytes)", code="request_too_large")
