"""Server-sent events, and the streaming response that carries them.

OpenAI Chat Completions / Completions send bare `data:` lines ending with `data: [DONE]`;
the Responses API and Anthropic Messages send `event: <type>` before each `data:` and no
[DONE]. A failure after the stream started cannot change the HTTP status any more, so
`streaming_response` turns any exception of the event source into a last error event in the
protocol's shape (plus [DONE] where the protocol ends with it): a client never sees a 200 with
an empty or cut-off body and no reason.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi.responses import StreamingResponse

from deepinfer.entrypoints.errors import APIError
from deepinfer.entrypoints.state import engine_error
from deepinfer.frontend.engine_client import RequestAbortedError

logger = logging.getLogger(__name__)

# msgspec: several times json.dumps's speed on these small dicts, UTF-8, no ASCII escapes
# (docs/benchmarks/design-measurements.md#sse-msgspec).
_encode = msgspec.json.encode


def data(payload: dict | str) -> bytes:
    body = payload.encode() if isinstance(payload, str) else _encode(payload)
    return b"data: " + body + b"\n\n"


def event(payload: dict) -> bytes:
    return b"event: " + payload["type"].encode() + b"\n" + data(payload)


DONE = b"data: [DONE]\n\n"


def openai_error_events(error: APIError) -> list[bytes]:
    return [data(error.openai_body()), DONE]


def anthropic_error_events(error: APIError) -> list[bytes]:
    return [event(error.anthropic_body())]


def responses_error_events(error: APIError) -> list[bytes]:
    return [event({"type": "error", "code": error.code or str(error.status), "message": error.message,
                   "param": error.param})]


def streaming_response(chunks: AsyncIterator[bytes],
                       error_events: Callable[[APIError], list[bytes]] = openai_error_events) -> StreamingResponse:
    return StreamingResponse(_guarded(chunks, error_events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _guarded(chunks: AsyncIterator[bytes], error_events) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except RequestAbortedError:
        return   # the client went away: nobody is listening
    except Exception as e:
        error = e if isinstance(e, APIError) else engine_error(e)
        if error is None:
            logger.exception("error while streaming a response")
            error = APIError(500, "internal server error while streaming the response (see the server log)")
        for piece in error_events(error):
            yield piece
