"""Server-sent events, and the streaming response that carries them.

OpenAI Chat Completions / Completions send bare `data:` lines ending with `data: [DONE]`;
the Responses API and Anthropic Messages send `event: <type>` before each `data:` and no
[DONE]. A failure after the stream started cannot change the HTTP status any more, so it is
sent as a last `error` event in the protocol's error shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse


def data(payload: dict | str) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


def event(payload: dict) -> str:
    return f"event: {payload['type']}\n{data(payload)}"


DONE = "data: [DONE]\n\n"


def streaming_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
