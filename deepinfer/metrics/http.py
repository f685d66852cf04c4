"""HTTP metrics under the names prometheus-fastapi-instrumentator gives them (what vLLM's server
exports), recorded by a pure ASGI middleware:

    http_requests_total{method, status, handler}      status grouped: "2xx", "4xx", "5xx"
    http_request_duration_seconds{method, handler}    few buckets (0.1, 0.5, 1), for per-route SLIs
    http_request_duration_highr_seconds               no labels, many buckets, for percentiles
    http_request_size_bytes{handler}                  summary of the requests' Content-Length
    http_response_size_bytes{handler}                 summary of the response bodies' bytes

`handler` is the path template of the route that served the request ("/v1/chat/completions");
a request that reached no route (an unknown path, or one refused before routing, such as a 401
from the API-key check) is "none", so a scanner cannot grow the label set. The probes and the
scrape itself are left out (as vLLM does): they would outnumber real traffic. A duration runs to
the last body chunk, so a stream counts whole.

Why pure ASGI and not `@app.middleware("http")` (BaseHTTPMiddleware): that runs the app behind a
stream of its own and hands it a different `receive`, which breaks the routes' detection of a
client that went away (an abandoned stream would keep generating). This middleware passes
`receive` through untouched and only watches the messages that go out through `send`.

One deliberate difference from the library: the response size is the body bytes actually sent,
where the library reads the Content-Length header (and so records 0 for every streamed answer).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from starlette.types import ASGIApp, Message, Receive, Scope, Send

EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/version"})

# The library's defaults.
_DURATION_BUCKETS = (0.1, 0.5, 1.0)
_DURATION_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5,
                           7.5, 10, 30, 60)


class HTTPMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                ["method", "status", "handler"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds",
                                  "Latency with only few buckets by handler, to the last byte of the response.",
                                  ["method", "handler"], buckets=_DURATION_BUCKETS, registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds",
                                        "Latency with many buckets but no API specific labels.",
                                        buckets=_DURATION_HIGHR_BUCKETS, registry=registry)
        self.request_size = Summary("http_request_size_bytes", "Content length of incoming requests by handler.",
                                    ["handler"], registry=registry)
        self.response_size = Summary("http_response_size_bytes", "Body bytes of outgoing responses by handler.",
                                     ["handler"], registry=registry)

    def observe(self, handler: str, method: str, status: int, duration: float, request_bytes: int,
                response_bytes: int) -> None:
        self.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.duration.labels(method, handler).observe(duration)
        self.duration_highr.observe(duration)
        self.request_size.labels(handler).observe(request_bytes)
        self.response_size.labels(handler).observe(response_bytes)


class HTTPMetricsMiddleware:
    """app.add_middleware(HTTPMetricsMiddleware, metrics=HTTPMetrics(registry))"""

    def __init__(self, app: ASGIApp, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500            # what the client gets if the app raises before it answers
        response_bytes = 0
        body_end: float | None = None

        async def watching_send(message: Message) -> None:
            nonlocal status, response_bytes, body_end
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                response_bytes += len(message.get("body", b""))
                if not message.get("more_body", False):
                    body_end = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            duration = (body_end or time.perf_counter()) - start
            handler = route_template(scope)   # known once the router has run
            if handler not in EXCLUDED_HANDLERS:
                self.metrics.observe(handler, scope["method"], status, duration, _content_length(scope),
                                     response_bytes)


def route_template(scope: Scope) -> str:
    """The path template of the route that served the request, or "none".

    Starlette and FastAPI leave the matched route in scope["route"] (also a route that matched
    the path but not the method: it answered 405). FastAPI's route does not know a prefix given
    to include_router(); ours are included without one."""
    return getattr(scope.get("route"), "path", None) or "none"


def _content_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return max(int(value), 0)
            except ValueError:
                return 0
    return 0
