"""POST /v1/messages (Anthropic Messages) and POST /v1/messages/count_tokens.

Events and the final `message` come from the recipe's OutputSession. Usage follows Anthropic's
accounting: `input_tokens` excludes prompt tokens read from the prefix cache, which are
reported as `cache_read_input_tokens` (so the three input fields add up to the prompt).
A `ping` follows `message_start`, as Anthropic's own streams do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints import conversation, sse
from deepinfer.entrypoints.conversation import PreparedConversation
from deepinfer.entrypoints.state import abort_on_disconnect, engine_errors, get_state, read_json
from deepinfer.types import traffic_class as traffic

router = APIRouter()


def _usage(prepared: PreparedConversation, with_input: bool = True) -> dict:
    prompt, completion, cached = prepared.usage_counts()
    usage = {"output_tokens": completion}
    if with_input:
        usage = {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached, **usage}
    return usage


@router.post("/v1/messages")
async def messages(request: Request):
    state = get_state(request)
    body = await read_json(request)
    prepared = await state.run_off_loop(conversation.prepare, state, "messages", body,
                                        request.headers.get(traffic.HEADER))
    with engine_errors():
        outputs = conversation.submit(state, prepared)
    if prepared.fields.stream:
        return sse.streaming_response(_stream(request, state, prepared, outputs), sse.anthropic_error_events)
    await conversation.run_to_end(request, state, prepared, outputs)
    final = prepared.sessions[0].final_response()
    final["usage"] = _usage(prepared)
    return JSONResponse(final)


async def _stream(request: Request, state, prepared: PreparedConversation, outputs) -> AsyncIterator[bytes]:
    async with abort_on_disconnect(request, state.client, [prepared.request_id]):
        async for update in conversation.run(state, prepared, outputs):
            for item in update.events:
                if item["type"] == "message_start":
                    item["message"]["usage"] = {**_usage(prepared), "output_tokens": 0}
                    yield sse.event(item)
                    yield sse.event({"type": "ping"})
                    continue
                if item["type"] == "message_delta":
                    item["usage"] = _usage(prepared)
                yield sse.event(item)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state = get_state(request)
    body = await read_json(request)
    body.setdefault("max_tokens", 1)   # required by the Messages schema, irrelevant to counting
    body.pop("stream", None)
    prepared = await state.run_off_loop(conversation.prepare, state, "messages", body)
    return JSONResponse({"input_tokens": len(prepared.prompt_token_ids)})
