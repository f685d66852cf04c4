"""POST /v1/embeddings: OpenAI's embeddings API over a decoder model, as vLLM's pooling runner
serves one.

`input` is a string, a list of token ids, or a list of either (OpenAI's four shapes); each input
is one pooling request in the engine (a prefill, nothing sampled; engine/admission.py), all of a
request's inputs in flight together, so they batch with each other and with generation. The
vector is the engine's pooler_config pooling (default: the last token's final hidden state,
L2-normalized), answered as floats or, with `encoding_format: "base64"`, as the base64 of its
little-endian float32 bytes (what the OpenAI SDK asks for by default and decodes).

`dimensions` follows vLLM: only a matryoshka model (config.json's is_matryoshka or
matryoshka_dimensions) may cut its vectors; any other model answers 400 naming the field.
Every client mistake (no or empty input, a token id outside the vocabulary, an input longer than
max_model_len without truncate_prompt_tokens, too many inputs) is a 400 naming the field and
the limit before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deepinfer.entrypoints import sampling
from deepinfer.entrypoints.errors import bad_request
from deepinfer.entrypoints.request_fields import EmbeddingFields, parse_fields
from deepinfer.entrypoints.state import ServerState, abort_on_disconnect, engine_errors, get_state, read_json
from deepinfer.outputs import EmbeddingRequestOutput
from deepinfer.pooling_params import PoolingParams, check_dimensions
from deepinfer.types import traffic_class as traffic

router = APIRouter()

MAX_INPUTS = 2048   # OpenAI's limit of inputs per request


@dataclass
class EmbeddingJob:
    fields: EmbeddingFields
    model: str
    inputs: list[tuple[str | None, list[int]]]   # (text, token ids) per input
    params: PoolingParams
    engine_fields: dict   # priority, cache_salt, traffic_class, lora_request


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape(value) -> tuple[list, bool]:
    """The inputs of `input`, each a string or a list of token ids (emptiness and range are the
    caller's checks), and whether `input` was one input (its errors then name `input`)."""
    if value is None:
        raise bad_request("input is required: a string, a list of token ids, or a list of either", "input")
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_id(t) for t in value)):
        return [value], True
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a non-empty string, a list of token ids, or a non-empty list of "
                          "those", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(value)}", "input")
    for i, item in enumerate(value):
        if not (isinstance(item, str) or (isinstance(item, list) and all(_is_id(t) for t in item))):
            raise bad_request(f"input[{i}] must be a string or a list of token ids", f"input[{i}]")
    return value, False


def _keep(fields: EmbeddingFields, max_model_len: int) -> int | None:
    """How many last tokens truncate_prompt_tokens keeps (-1: as many as fit); None: no cut."""
    keep = fields.truncate_prompt_tokens
    if keep is None:
        return None
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1, got 0", "truncate_prompt_tokens")
    if keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be at most max_model_len ({max_model_len}), got {keep}",
                          "truncate_prompt_tokens")
    return max_model_len if keep == -1 else keep


def _inputs(state: ServerState, fields: EmbeddingFields) -> list[tuple[str | None, list[int]]]:
    items, single = _shape(fields.input)
    where = (lambda i: "input") if single else (lambda i: f"input[{i}]")
    vocab, limit = state.client.vocab_size, state.max_model_len
    keep = _keep(fields, limit)
    texts = [item for item in items if isinstance(item, str)]
    # Refused by its size before it is tokenized (a cut input may be any length).
    max_chars = state.prompt_char_limit() if texts and keep is None else None
    for i, item in enumerate(items):
        if not item:
            raise bad_request(f"{where(i)} is empty; an input needs at least one token", where(i))
        if isinstance(item, list) and any(not 0 <= t < vocab for t in item):
            raise bad_request(f"{where(i)}: token ids must be in [0, {vocab})", where(i))
        if isinstance(item, str) and max_chars is not None and len(item) > max_chars:
            raise sampling.prompt_too_long(len(item), max_chars, where(i))
    encoded = iter(state.tokenizer().encode_many(texts, fields.add_special_tokens) if texts else [])
    out = []
    for i, item in enumerate(items):
        text, ids = (item, next(encoded)) if isinstance(item, str) else (None, list(item))
        if keep is not None and len(ids) > keep:
            text, ids = None, ids[len(ids) - keep:]
        if not ids:
            raise bad_request(f"{where(i)} encodes to no tokens; an input needs at least one", where(i))
        if len(ids) > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, {where(i)} has "
                              f"{len(ids)} tokens. Please reduce the length of the input, or set "
                              "truncate_prompt_tokens to keep its last tokens.", where(i))
        out.append((text, ids))
    return out


def prepare(state: ServerState, body: dict, traffic_class_header: str | None = None) -> EmbeddingJob:
    """Validate and tokenize; any client mistake is an APIError. Runs off the event loop."""
    fields = parse_fields("embeddings", body)
    model, lora = state.resolve_model(fields.model)
    why = check_dimensions(fields.dimensions, state.client.hf_config)
    if why is not None:
        raise bad_request(f'Model "{model}": {why}', "dimensions")
    engine_fields = sampling.engine_request_fields(fields, state.client.traffic_classes, traffic_class_header)
    engine_fields["lora_request"] = lora   # the adapter `model` names, or None
    params = PoolingParams(dimensions=fields.dimensions, normalize=fields.normalize)
    return EmbeddingJob(fields, model, _inputs(state, fields), params, engine_fields)


def embedding_json(out: EmbeddingRequestOutput, index: int, encoding_format: str) -> dict:
    vector = out.outputs
    data = base64.b64encode(vector.data).decode("ascii") if encoding_format == "base64" else vector.embedding
    return {"object": "embedding", "index": index, "embedding": data}


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    state = get_state(request)
    body = await read_json(request)
    job = await state.run_off_loop(prepare, state, body, request.headers.get(traffic.HEADER))
    response_id = f"embd-{job.fields.request_id or secrets.token_hex(12)}"
    engine_id = f"embd-{secrets.token_hex(12)}"
    request_ids = [f"{engine_id}-{i}" for i in range(len(job.inputs))]
    tasks = [asyncio.ensure_future(state.client.embed(ids, job.params, request_id=request_id, prompt=text,
                                                      **job.engine_fields))
             for request_id, (text, ids) in zip(request_ids, job.inputs)]
    try:
        async with abort_on_disconnect(request, state.client, request_ids):
            with engine_errors():
                outputs = await asyncio.gather(*tasks)
    finally:   # one input failed (busy, a dead core): the others stop too
        for task in tasks:
            task.cancel()
    num_tokens = sum(len(ids) for _, ids in job.inputs)
    return JSONResponse({"id": response_id, "object": "list", "created": int(time.time()), "model": job.model,
                         "data": [embedding_json(out, i, job.fields.encoding_format) for i, out in enumerate(outputs)],
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
