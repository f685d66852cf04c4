"""POST /v1/completions: raw prompts (text or token ids, one or a batch), no chat template.

Text, stop strings and n > 1 come from the engine client's OutputProcessor. A batch of prompts
is one engine request per prompt; choice `index` is prompt_index * n + sample_index, as OpenAI
numbers them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints import sampling, sse
from deepinfer.entrypoints.errors import APIError, bad_request
from deepinfer.entrypoints.state import ServerState, abort_on_disconnect, engine_errors, get_state, read_json
from deepinfer.frontend.engine_client import EngineDeadError, RequestAbortedError
from deepinfer.outputs import CompletionOutput, RequestOutput

router = APIRouter()

MAX_PROMPTS = 256


def _prompts(state: ServerState, body: dict) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt from `prompt`: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
    out = []
    vocab = state.client.vocab_size
    for item in prompt:
        if isinstance(item, str):
            out.append((item, state.client.tokenizer.encode(item)))
        elif isinstance(item, list) and item and all(_is_id(t) for t in item):
            if any(not 0 <= t < vocab for t in item):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
            out.append((None, list(item)))
        else:
            raise bad_request("each prompt must be a non-empty string or a non-empty list of token ids", "prompt")
        if not out[-1][1]:
            raise bad_request("the prompt is empty; it needs at least one token", "prompt")
    return out


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logprobs(out: CompletionOutput, offset: int) -> tuple[dict, int]:
    """OpenAI's legacy logprobs object for this output's tokens; returns the next text offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(out.token_ids, out.logprobs or []):
        chosen = entry.get(token_id) or next(iter(entry.values()))
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(max(chosen.logprob, -9999.0))
        top.append({lp.decoded_token or "": max(lp.logprob, -9999.0) for lp in entry.values()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


@router.post("/v1/completions")
async def completions(request: Request):
    state = get_state(request)
    body = await read_json(request)
    model = state.check_model(body)
    stream = sampling.field(body, "stream", (bool,), False)
    include_usage = sampling.include_usage(body)
    if body.get("echo"):
        raise bad_request("echo is not supported", "echo")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    n = sampling.field(body, "n", (int,), 1)
    best_of = sampling.field(body, "best_of", (int,))
    if best_of is not None and best_of != n:
        raise bad_request("best_of must equal n (or be omitted)", "best_of")
    logprobs = sampling.field(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= sampling.MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {sampling.MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
    stop = sampling.field(body, "stop", (str, list))
    stop = [stop] if isinstance(stop, str) else stop
    max_tokens = sampling.field(body, "max_tokens", (int,), 16)
    prompts = _prompts(state, body)
    for _, ids in prompts:
        sampling.check_context(len(ids), max_tokens, state.max_model_len, "prompt")
    params = sampling.build(body, vocab_size=state.client.vocab_size, max_tokens=max_tokens, logprobs=logprobs,
                            stop=stop, n=n, seed=sampling.field(body, "seed", (int,)))
    engine_fields = sampling.engine_request_fields(body)
    response_id = f"cmpl-{secrets.token_hex(12)}"
    request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
    streams = []
    try:
        with engine_errors():
            for request_id, (text, ids) in zip(request_ids, prompts):
                streams.append(state.client.generate(ids, params, request_id=request_id, prompt=text,
                                                     **engine_fields))
    except APIError:
        for request_id in request_ids:
            state.client.abort(request_id)
        raise
    created = int(time.time())
    header = {"id": response_id, "object": "text_completion", "created": created, "model": model}
    merged = _merge(streams)
    if stream:
        return sse.streaming_response(_stream(request, state, header, merged, request_ids, n, include_usage))
    texts: dict[int, list[str]] = {}
    finals: dict[int, CompletionOutput] = {}
    logprob_parts: dict[int, list[dict]] = {}
    usage = _Usage()
    offsets: dict[int, int] = {}
    with engine_errors():
        try:
            async for prompt_index, out in _watch(request, state, merged, request_ids):
                usage.add(out)
                for c in out.outputs:
                    index = prompt_index * n + c.index
                    texts.setdefault(index, []).append(c.text)
                    finals[index] = c
                    if logprobs is not None:
                        part, offsets[index] = _logprobs(c, offsets.get(index, 0))
                        logprob_parts.setdefault(index, []).append(part)
        except RequestAbortedError:
            raise APIError(499, "the client closed the request") from None
    choices = []
    for index in sorted(finals):
        lp = _join_logprobs(logprob_parts[index]) if logprobs is not None else None
        c = finals[index]
        choices.append({"index": index, "text": "".join(texts[index]), "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return JSONResponse({**header, "choices": choices, "usage": usage.body()})


class _Usage:
    def __init__(self) -> None:
        self.prompt: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.completion = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt[out.request_id] = len(out.prompt_token_ids or ())
        self.cached[out.request_id] = out.num_cached_tokens
        self.completion += sum(len(c.token_ids) for c in out.outputs)

    def body(self) -> dict:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


def _join_logprobs(parts: list[dict]) -> dict:
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                       "text_offset")}


async def _stream(request: Request, state: ServerState, header: dict, merged, request_ids: list[str], n: int,
                  include_usage: bool) -> AsyncIterator[str]:
    usage = _Usage()
    offsets: dict[int, int] = {}
    try:
        async for prompt_index, out in _watch(request, state, merged, request_ids):
            usage.add(out)
            for c in out.outputs:
                if not c.text and c.finish_reason is None:
                    continue
                index = prompt_index * n + c.index
                lp = None
                if c.logprobs is not None:
                    lp, offsets[index] = _logprobs(c, offsets.get(index, 0))
                yield sse.data({**header, "choices": [{"index": index, "text": c.text, "logprobs": lp,
                                                       "finish_reason": c.finish_reason,
                                                       "stop_reason": c.stop_reason}]})
    except RequestAbortedError:
        return
    except EngineDeadError as e:
        yield sse.data(APIError(503, f"the engine is not available: {e}").openai_body())
        return
    if include_usage:
        yield sse.data({**header, "choices": [], "usage": usage.body()})
    yield sse.DONE


async def _watch(request: Request, state: ServerState, merged, request_ids: list[str]):
    """Iterate `merged`, aborting every prompt's request if the HTTP client goes away."""
    async with abort_on_disconnect(request, state.client, request_ids):
        async for item in merged:
            yield item


async def _merge(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they arrive: (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except BaseException as e:  # hand errors (aborts, a dead engine) to the consumer
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
