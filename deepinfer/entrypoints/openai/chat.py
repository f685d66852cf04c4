"""POST /v1/chat/completions and POST /v1/responses.

The recipe's OutputSession produces each protocol's chunks and final objects for one choice;
here they are merged over n choices, given logprobs and usage (with cached prompt tokens),
and framed as SSE. OpenAI's streaming usage rule: chunks carry no usage; with
`stream_options.include_usage` one last chunk with empty `choices` carries it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints import chat_options, conversation, sampling, sse
from deepinfer.entrypoints.conversation import PreparedConversation
from deepinfer.entrypoints.state import abort_on_disconnect, engine_errors, get_state, read_json
from deepinfer.types import traffic_class as traffic

router = APIRouter()


def _openai_usage(state, prepared: PreparedConversation) -> dict:
    prompt, completion, cached = prepared.usage_counts()
    reasoning = sum(s.parser.reasoning_tokens for s in prepared.sessions)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached},
             "completion_tokens_details": {"reasoning_tokens": reasoning}}
    if not state.options.enable_prompt_tokens_details:
        del usage["prompt_tokens_details"]
    return usage


# ------------------------------------------------------------------------ chat completions
@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = get_state(request)
    body = await read_json(request)
    prepared = await state.run_off_loop(conversation.prepare, state, "chat", body,
                                        request.headers.get(traffic.HEADER))
    include_usage = sampling.include_usage(prepared.fields, state.options.enable_force_include_usage)
    with engine_errors():
        outputs = conversation.submit(state, prepared)
    if prepared.fields.stream:
        return sse.streaming_response(_chat_stream(request, state, prepared, outputs, include_usage))
    pending = await conversation.run_to_end(request, state, prepared, outputs)
    choices = []
    for index, session in enumerate(prepared.sessions):
        choice = session.final_response()["choices"][0]
        choice["index"] = index
        if prepared.top_logprobs is not None:
            choice["logprobs"] = {"content": pending[index]}
        message = choice["message"]
        if prepared.echo_text:
            message["content"] = prepared.echo_text + (message["content"] or "")
        if prepared.legacy_functions:
            chat_options.legacy_message(message)
            choice["finish_reason"] = chat_options.legacy_finish(choice["finish_reason"])
        choice["stop_reason"] = prepared.stop_reasons[index]
        choices.append(choice)
    final = prepared.sessions[0].final_response()
    final = {**final, "choices": choices, "usage": _openai_usage(state, prepared)}
    if prepared.prompt_logprobs is not None:
        final["prompt_logprobs"] = prepared.prompt_logprobs
    return JSONResponse(final)


async def _chat_stream(request: Request, state, prepared: PreparedConversation, outputs,
                       include_usage: bool) -> AsyncIterator[bytes]:
    pending: list[list[dict]] = [[] for _ in prepared.sessions]
    async with abort_on_disconnect(request, state.client, [prepared.request_id]):
        async for update in conversation.run(state, prepared, outputs):
            pending[update.index].extend(update.logprobs)
            for chunk in update.events:
                chunk.pop("usage", None)
                choice = chunk["choices"][0]
                choice["index"] = update.index
                delta = choice["delta"]
                carries_text = delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                # Logprobs ride on the next chunk that shows text (the parser may hold text back).
                if prepared.top_logprobs is not None and pending[update.index] and (
                        carries_text or choice["finish_reason"]):
                    choice["logprobs"] = {"content": pending[update.index]}
                    pending[update.index] = []
                if prepared.legacy_functions:
                    chat_options.legacy_delta(delta)
                    choice["finish_reason"] = chat_options.legacy_finish(choice["finish_reason"])
                if choice["finish_reason"] is not None:
                    choice["stop_reason"] = prepared.stop_reasons[update.index]
                yield sse.data(chunk)
                if prepared.echo_text and "role" in delta:   # the echo follows the opening chunk
                    yield sse.data({**chunk, "choices": [{**choice, "delta": {"content": prepared.echo_text}}]})
    if include_usage:
        session = prepared.sessions[0].stream
        yield sse.data({"id": session.id, "object": "chat.completion.chunk", "created": session.created,
                        "model": session.model, "choices": [], "usage": _openai_usage(state, prepared)})
    yield sse.DONE


# ------------------------------------------------------------------------------- responses
def _responses_usage(prepared: PreparedConversation, usage: dict | None) -> dict:
    prompt, completion, cached = prepared.usage_counts()
    usage = dict(usage or {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                           "output_tokens_details": {"reasoning_tokens": 0}})
    # Keep the recipe's other details (the SDK requires them); only the cache hit is known here.
    usage["input_tokens_details"] = {**usage.get("input_tokens_details", {}), "cached_tokens": cached}
    return usage


@router.post("/v1/responses")
async def responses(request: Request):
    state = get_state(request)
    body = await read_json(request)
    prepared = await state.run_off_loop(conversation.prepare, state, "responses", body,
                                        request.headers.get(traffic.HEADER))
    with engine_errors():
        outputs = conversation.submit(state, prepared)
    if prepared.fields.stream:
        return sse.streaming_response(_responses_stream(request, state, prepared, outputs),
                                      sse.responses_error_events)
    await conversation.run_to_end(request, state, prepared, outputs)
    final = prepared.sessions[0].final_response()
    final["usage"] = _responses_usage(prepared, final.get("usage"))
    return JSONResponse(final)


async def _responses_stream(request: Request, state, prepared: PreparedConversation, outputs) -> AsyncIterator[bytes]:
    async with abort_on_disconnect(request, state.client, [prepared.request_id]):
        async for update in conversation.run(state, prepared, outputs):
            for item in update.events:
                if item["type"] == "response.completed":
                    item["response"]["usage"] = _responses_usage(prepared, item["response"].get("usage"))
                yield sse.event(item)
