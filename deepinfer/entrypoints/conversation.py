"""Chat-style requests (Chat Completions, Responses, Messages) through the recipe package.

    body --parse_request--> Conversation --encoder.encode--> prompt ids --engine--> output ids
         --OutputSession.feed--> protocol events (one session per choice)

All protocol knowledge lives in deepinfer_recipe: the same code serves DeepSeek-V4 formats and
every HF chat template. This module only builds the engine request, runs it, and hands each
choice's events (plus the logprobs of the tokens behind them) to the protocol's formatter.
Stop sequences are found by the recipe's parser (token-aware, with the protocol's stop
reason), so they are not given to the engine; when a choice stops on one, that child is
aborted in the core.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer_recipe import RequestError, parse_request
from deepinfer_recipe.errors import RecipeError
from deepinfer_recipe.output import OutputSession
from deepinfer_recipe.tools.constraint import offered_tools

from deepinfer.entrypoints import sampling
from deepinfer.entrypoints.errors import APIError, bad_request
from deepinfer.entrypoints.state import ServerState, abort_on_disconnect, engine_errors
from deepinfer.frontend.engine_client import RequestAbortedError
from deepinfer.outputs import Logprob, RequestOutput
from deepinfer.sampling_params import SamplingParams


@dataclass
class ChoiceUpdate:
    index: int
    events: list[dict]
    logprobs: list[dict]   # OpenAI chat logprob entries of the tokens fed in this update


@dataclass
class PreparedConversation:
    protocol: str
    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sessions: list[OutputSession]
    top_logprobs: int | None        # None: logprobs not requested
    engine_fields: dict             # priority, cache_salt
    created: int = field(default_factory=lambda: int(time.time()))
    num_cached_tokens: int = 0

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt, completion summed over choices, cached prompt) tokens."""
        completion = sum(s.parser.completion_tokens for s in self.sessions)
        return len(self.prompt_token_ids), completion, self.num_cached_tokens


def prepare(state: ServerState, protocol: str, body: dict) -> PreparedConversation:
    """Validate, encode and build sampling params; any client mistake is an APIError (400/404)."""
    model = state.check_model(body)
    encoder = state.chat_encoder()
    try:
        conversation = parse_request(protocol, body)
        encoding = encoder.encode(conversation)
    except RequestError as e:
        raise bad_request(str(e), e.path) from None
    except RecipeError as e:
        raise bad_request(str(e)) from None
    prompt_ids = encoding.token_ids
    if not prompt_ids:
        raise bad_request("the conversation renders to an empty prompt", "messages")

    n, top_logprobs, seed = 1, None, conversation.seed
    if protocol == "chat":
        n = sampling.field(body, "n", (int,), 1)
        if sampling.field(body, "logprobs", (bool,), False):
            top_logprobs = sampling.field(body, "top_logprobs", (int,), 0)
            if not 0 <= top_logprobs <= sampling.MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {sampling.MAX_TOP_LOGPROBS}], got {top_logprobs}",
                                  "top_logprobs")
        elif body.get("top_logprobs") is not None:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    elif protocol == "responses":
        top = sampling.field(body, "top_logprobs", (int,))
        if top is not None:
            if not 0 <= top <= sampling.MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {sampling.MAX_TOP_LOGPROBS}]", "top_logprobs")
            top_logprobs = top
    max_tokens = conversation.max_tokens
    where = "input" if protocol == "responses" else "messages"
    sampling.check_context(len(prompt_ids), max_tokens, state.max_model_len, where)
    fmt = conversation.response_format
    if encoding.constraint is not None:   # a forced tool choice: the recipe's tool-call format
        sampling.check_tool_schemas(offered_tools(conversation)[0])
    params = sampling.build(body, vocab_size=state.client.vocab_size, max_tokens=max_tokens, logprobs=top_logprobs,
                            n=n, seed=seed, detokenize=False,
                            response_format={"type": fmt.type, "schema": fmt.schema},
                            tool_constraint=encoding.constraint)
    request_id = state.client.new_request_id()
    sessions = []
    created = int(time.time())
    prefix = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}[protocol]
    for _ in range(n):
        sessions.append(OutputSession.for_encoding(encoder, encoding, protocol, model=model,
                                                   response_id=prefix + request_id, created=created))
    return PreparedConversation(protocol, request_id, model, prompt_ids, params, sessions, top_logprobs,
                                sampling.engine_request_fields(body), created)


def submit(state: ServerState, prepared: PreparedConversation) -> AsyncIterator[RequestOutput]:
    """Add the request to the engine (429/503 surface here, before any response starts)."""
    return state.client.generate(prepared.prompt_token_ids, prepared.params, request_id=prepared.request_id,
                                 **prepared.engine_fields)


async def run(state: ServerState, prepared: PreparedConversation,
              outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[ChoiceUpdate]:
    """Yield each choice's protocol events as tokens arrive.

    The start events come with the first engine output, when the prefix-cache hit (reported
    in usage) is known."""
    client = state.client
    started = False
    async for out in outputs:
        prepared.num_cached_tokens = out.num_cached_tokens
        if not started:
            started = True
            for index, session in enumerate(prepared.sessions):
                yield ChoiceUpdate(index, session.start(), [])
        for completion in out.outputs:
            session = prepared.sessions[completion.index]
            if session.finished:
                continue
            events = session.feed(completion.token_ids)
            if completion.finish_reason is not None and not session.finished:
                events += session.finish("length" if completion.finish_reason == "length" else "stop")
            elif session.finished and completion.finish_reason is None:
                client.abort_child(prepared.request_id, completion.index)   # a stop sequence
            logprobs = []
            if prepared.top_logprobs is not None and completion.logprobs:
                logprobs = [chat_logprob(entry, token_id, prepared.top_logprobs)
                            for token_id, entry in zip(completion.token_ids, completion.logprobs)]
            yield ChoiceUpdate(completion.index, events, logprobs)


async def run_to_end(request, state: ServerState, prepared: PreparedConversation,
                     outputs: AsyncIterator[RequestOutput]) -> list[list[dict]]:
    """Run a non-streamed request to its end, aborting it if the client goes away; returns each
    choice's token logprobs (empty lists unless asked for)."""
    logprobs: list[list[dict]] = [[] for _ in prepared.sessions]
    async with abort_on_disconnect(request, state.client, [prepared.request_id]):
        with engine_errors():
            try:
                async for update in run(state, prepared, outputs):
                    logprobs[update.index].extend(update.logprobs)
            except RequestAbortedError:
                raise APIError(499, "the client closed the request") from None
    return logprobs


def chat_logprob(entry: dict[int, Logprob], token_id: int, top: int) -> dict:
    """One position in OpenAI's chat logprobs shape."""
    chosen = entry.get(token_id) or next(iter(entry.values()))
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:top]
    return {**_token_logprob(chosen), "top_logprobs": [_token_logprob(lp) for _, lp in ranked]}


def _token_logprob(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    # -inf is not JSON; OpenAI reports -9999.0 for impossible tokens.
    value = max(lp.logprob, -9999.0)
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
