"""POST /v1/completions: raw prompts (text or token ids, one or a batch), no chat template.

Text, stop strings and n > 1 come from the engine client's OutputProcessor. A batch of prompts
is one engine request per prompt; choice `index` is prompt_index * n + sample_index, as OpenAI
numbers them.

`echo` returns the prompt before the completion, and with `logprobs` the prompt tokens'
logprobs too (the first prompt token has none: null). With `max_tokens: 0` only the prompt is
returned: this is how lm-evaluation-harness scores multiple-choice answers. The engine always
generates at least one token, so that one is computed and dropped.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints import sampling, sse
from deepinfer.entrypoints.errors import bad_request
from deepinfer.entrypoints.logprobs import CompletionLogprobs, join_completion_logprobs, prompt_logprobs_json
from deepinfer.entrypoints.request_fields import CompletionFields, parse_fields, warn_ignored
from deepinfer.entrypoints.state import ServerState, abort_on_disconnect, engine_errors, get_state, read_json
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.types import traffic_class as traffic

router = APIRouter()

MAX_PROMPTS = 256


@dataclass
class CompletionJob:
    fields: CompletionFields
    model: str
    prompts: list[tuple[str | None, list[int]]]   # (text, token ids) per prompt
    params: SamplingParams
    include_usage: bool
    prompt_only: bool   # max_tokens 0: the generated token is dropped
    engine_fields: dict   # priority, cache_salt, traffic_class, lora_request
    as_token_ids: bool = False   # logprob tokens as "token_id:N" (return_tokens_as_token_ids)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(state: ServerState, fields: CompletionFields) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt from `prompt`: a string, token ids, or a list of either."""
    prompt = fields.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
    vocab = state.client.vocab_size
    for item in prompt:
        if isinstance(item, list) and item and all(_is_id(t) for t in item):
            if any(not 0 <= t < vocab for t in item):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        elif not isinstance(item, str) or not item:
            raise bad_request("each prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    texts = [item for item in prompt if isinstance(item, str)]
    # Refused by its size before it is tokenized: more characters than the context can hold
    # (a prompt cut to its last tokens by truncate_prompt_tokens may be any length).
    max_chars = state.prompt_char_limit() if texts and fields.truncate_prompt_tokens is None else None
    for item in texts:
        if max_chars is not None and len(item) > max_chars:
            raise sampling.prompt_too_long(len(item), max_chars, "prompt")
    encoded = iter(state.tokenizer().encode_many(texts, fields.add_special_tokens) if texts else [])
    out = [(item, next(encoded)) if isinstance(item, str) else (None, list(item)) for item in prompt]
    if any(not ids for _, ids in out):
        raise bad_request("the prompt is empty; it needs at least one token", "prompt")
    return out


def _response_format(fields: CompletionFields) -> dict | None:
    """vLLM also takes OpenAI's response_format on completions; unpacked as the recipe does."""
    fmt = fields.response_format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format.type must be text, json_object or json_schema", "response_format.type")
    schema = (fmt.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    return {"type": kind, "schema": schema}


def prepare(state: ServerState, body: dict, traffic_class_header: str | None = None) -> CompletionJob:
    """Validate and tokenize; any client mistake is an APIError. Runs off the event loop.
    `traffic_class_header`: the request's X-Traffic-Class header (the body field wins over it)."""
    fields = parse_fields("completions", body)
    model, lora = state.resolve_model(fields.model)
    warn_ignored(fields)
    engine_fields = sampling.engine_request_fields(fields, state.client.traffic_classes, traffic_class_header)
    engine_fields["lora_request"] = lora   # the adapter `model` names, or None
    include_usage = sampling.include_usage(fields, state.options.enable_force_include_usage)
    if fields.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if fields.best_of is not None and fields.best_of != fields.n:
        raise bad_request("best_of must equal n (or be omitted)", "best_of")
    prompt_only = fields.max_tokens == 0
    if prompt_only and not fields.echo:
        raise bad_request("max_tokens 0 returns nothing without echo: true", "max_tokens")
    stop = [fields.stop] if isinstance(fields.stop, str) else fields.stop
    max_tokens = sampling.default_max_tokens(state.sampling_defaults, 1 if prompt_only else fields.max_tokens)
    prompts = []
    for text, ids in _prompts(state, fields):
        kept = sampling.truncate_prompt(ids, fields, max_tokens, state.max_model_len)
        prompts.append((text if len(kept) == len(ids) else None, kept))   # echo decodes a cut prompt
    for _, ids in prompts:
        sampling.check_context(len(ids), max_tokens, state.max_model_len, "prompt")
    prompt_logprobs = fields.prompt_logprobs
    if fields.echo and fields.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, fields.logprobs)
    params = state.sampling_params(fields, max_tokens=max_tokens, logprobs=fields.logprobs,
                            prompt_logprobs=prompt_logprobs, stop=stop, n=fields.n,
                            response_format=_response_format(fields))
    return CompletionJob(fields, model, prompts, params, include_usage, prompt_only, engine_fields,
                         state.tokens_as_ids(fields))


@router.post("/v1/completions")
async def completions(request: Request):
    state = get_state(request)
    body = await read_json(request)
    job = await state.run_off_loop(prepare, state, body, request.headers.get(traffic.HEADER))
    # vLLM's request_id names the response; the engine's ids stay unique in flight.
    response_id = f"cmpl-{job.fields.request_id or secrets.token_hex(12)}"
    engine_id = f"cmpl-{secrets.token_hex(12)}"
    request_ids = [f"{engine_id}-{i}" for i in range(len(job.prompts))]
    streams = []
    engine_fields = job.engine_fields
    try:
        with engine_errors():
            for request_id, (text, ids) in zip(request_ids, job.prompts):
                streams.append(state.client.generate(ids, job.params, request_id=request_id, prompt=text,
                                                     **engine_fields))
    except BaseException:
        for request_id in request_ids:
            state.client.abort(request_id)
        raise
    header = {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": job.model}
    choices = _Choices(state, job)
    merged = _merge(streams)
    if job.fields.stream:
        return sse.streaming_response(_stream(request, state, job, header, choices, merged, request_ids))
    async with abort_on_disconnect(request, state.client, request_ids):
        with engine_errors():
            async for prompt_index, out in merged:
                choices.add(prompt_index, out)
    return JSONResponse({**header, "choices": choices.final(), "usage": choices.usage()})


class _Choices:
    """The choices of one completion request as outputs arrive, for both response kinds."""

    def __init__(self, state: ServerState, job: CompletionJob) -> None:
        self.state, self.job = state, job
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprob_parts: dict[int, list[dict]] = {}   # per choice, one part per output
        self.logprobs: dict[int, CompletionLogprobs] = {}
        self.finish: dict[int, tuple] = {}
        self.prompt_logprobs: dict[int, list] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.completion_tokens = 0

    def add(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Record one output; returns the stream chunks' choices it makes."""
        job = self.job
        self.prompt_tokens[out.request_id] = len(out.prompt_token_ids or ())
        self.cached[out.request_id] = out.num_cached_tokens
        if out.prompt_logprobs is not None and prompt_index not in self.prompt_logprobs:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        pieces = []
        for c in out.outputs:
            index = prompt_index * job.fields.n + c.index
            first = index not in self.texts
            text, token_ids, entries = c.text, c.token_ids, c.logprobs
            if job.prompt_only:
                text, token_ids, entries = "", [], [] if entries is not None else None
            else:
                self.completion_tokens += len(token_ids)
            tracker = self.logprobs.get(index)
            if tracker is None:
                tracker = self.logprobs[index] = CompletionLogprobs(self._decode, job.as_token_ids)
            lp = None
            if first and job.fields.echo:
                prompt_text, lp = self._echo(prompt_index, out, tracker)
                text = prompt_text + text
            if job.fields.logprobs is not None and entries is not None:
                part = tracker.positions(token_ids, entries)
                lp = part if lp is None else join_completion_logprobs([lp, part])
            if lp is not None:
                self.logprob_parts.setdefault(index, []).append(lp)
            self.texts.setdefault(index, []).append(text)
            self.token_ids.setdefault(index, []).extend(token_ids)
            finish = (c.finish_reason, c.stop_reason)
            if job.prompt_only and c.finish_reason is not None:
                finish = ("length", None)
            self.finish[index] = finish
            if text or c.finish_reason is not None:
                piece = {"index": index, "text": text, "logprobs": lp if job.fields.logprobs is not None else None,
                         "finish_reason": finish[0], "stop_reason": finish[1]}
                if job.fields.return_token_ids:
                    piece["token_ids"] = token_ids
                pieces.append(piece)
        return pieces

    def _decode(self, token_id: int) -> str:
        tokenizer = self.state.client.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""

    def _echo(self, prompt_index: int, out: RequestOutput, tracker: CompletionLogprobs) -> tuple[str, dict | None]:
        """The prompt's text and (with logprobs) its positions' logprobs object."""
        text, ids = self.job.prompts[prompt_index]
        if text is None:
            tokenizer = self.state.client.tokenizer
            text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""
        part = None
        if self.job.fields.logprobs is not None:
            part = tracker.positions(ids, out.prompt_logprobs or [None] * len(ids))
        tracker.offset = len(text)   # generated text starts after the prompt's (decoded) text
        return text, part

    def final(self) -> list[dict]:
        job, choices = self.job, []
        for index in sorted(self.finish):
            reason, stop_reason = self.finish[index]
            lp = join_completion_logprobs(self.logprob_parts.get(index, [])) if job.fields.logprobs is not None else None
            choice = {"index": index, "text": "".join(self.texts[index]), "logprobs": lp,
                      "finish_reason": reason, "stop_reason": stop_reason}
            prompt_index = index // job.fields.n
            if job.fields.prompt_logprobs is not None and prompt_index in self.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[prompt_index])
            if job.fields.return_token_ids:
                choice["token_ids"] = self.token_ids[index]
                choice["prompt_token_ids"] = job.prompts[prompt_index][1]
            choices.append(choice)
        return choices

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        usage = {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                 "total_tokens": prompt + self.completion_tokens}
        if self.state.options.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self.cached.values())}
        return usage


async def _stream(request: Request, state: ServerState, job: CompletionJob, header: dict, choices: _Choices,
                  merged, request_ids: list[str]) -> AsyncIterator[bytes]:
    async with abort_on_disconnect(request, state.client, request_ids):
        async for prompt_index, out in merged:
            for piece in choices.add(prompt_index, out):
                yield sse.data({**header, "choices": [piece]})
    if job.include_usage:
        yield sse.data({**header, "choices": [], "usage": choices.usage()})
    yield sse.DONE


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
