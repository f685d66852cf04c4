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
from typing import Any

from deepinfer_recipe import RequestError, parse_request
from deepinfer_recipe.errors import PromptTooLong, RecipeError
from deepinfer_recipe.output import OutputSession
from deepinfer_recipe.tools.constraint import offered_tools

from deepinfer.entrypoints import chat_options, sampling
from deepinfer.entrypoints.errors import bad_request
from deepinfer.entrypoints.logprobs import chat_logprob, prompt_logprobs_json
from deepinfer.entrypoints.parser_names import TOOL_CALL_PARSERS
from deepinfer.entrypoints.request_fields import SamplingFields, parse_fields, warn_ignored
from deepinfer.entrypoints.state import ServerState, abort_on_disconnect, engine_errors
from deepinfer.outputs import RequestOutput
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
    engine_fields: dict             # priority, cache_salt, traffic_class, lora_request
    fields: SamplingFields          # the validated request fields (stream, stream_options, ...)
    created: int = field(default_factory=lambda: int(time.time()))
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None   # vLLM's prompt_logprobs JSON, once the engine sent them
    echo_text: str = ""             # chat `echo`: what each choice's content begins with
    legacy_functions: bool = False  # the request used `functions`: reply with `function_call`
    as_token_ids: bool = False      # logprob tokens as "token_id:N"
    stop_reasons: list = field(default_factory=list)   # per choice: the stop string or token id, else None
    images: Any = None              # the prompt's images (multimodal/inputs.ImageInputs), or None

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt, completion summed over choices, cached prompt) tokens."""
        completion = sum(s.parser.completion_tokens for s in self.sessions)
        return len(self.prompt_token_ids), completion, self.num_cached_tokens


def prepare(state: ServerState, protocol: str, body: dict, traffic_class_header: str | None = None
            ) -> PreparedConversation:
    """Validate, encode and build sampling params; any client mistake is an APIError (400/404).
    `traffic_class_header`: the request's X-Traffic-Class header (the body field wins over it).

    CPU-heavy for a long conversation (template rendering, tokenization, schema compiles): the
    routes call it through `state.run_off_loop`."""
    fields = parse_fields(protocol, body)
    model, lora = state.resolve_model(fields.model)
    stop_field = "stop_sequences" if protocol == "messages" else "stop"
    sampling.check_stop_sequences(getattr(fields, stop_field, None), state.options.max_stop_sequences, stop_field)
    warn_ignored(fields)
    # Every chat-style protocol names its tools `tools` (chat's older spelling: `functions`).
    offers_tools = bool(fields.tools or getattr(fields, "functions", None))
    engine_fields = sampling.engine_request_fields(fields, state.client.traffic_classes, traffic_class_header,
                                                   offers_tools=offers_tools)
    engine_fields["lora_request"] = lora   # the adapter `model` names, or None
    encoder = state.chat_encoder()
    # A prompt cut to its last tokens may be any length; any other must fit the context.
    max_chars = None if getattr(fields, "truncate_prompt_tokens", None) is not None else state.prompt_char_limit(encoder)
    try:
        conversation = parse_request(protocol, body)
        chat_options.apply(conversation, fields, encoder, protocol, takes_images=state.takes_images)
        # Fetched, decoded and checked before the render: a bad image is a 400 naming its part.
        loaded = state.images.load(conversation) if state.images is not None else []
        chat_options.check_size(conversation, max_chars)
        encoding = encoder.encode(conversation, max_chars=max_chars)
    except PromptTooLong as e:
        raise sampling.prompt_too_long(e.chars, e.limit, "rendered messages") from None
    except RequestError as e:
        raise bad_request(str(e), e.path) from None
    except RecipeError as e:
        raise bad_request(str(e)) from None
    except RecursionError:
        raise bad_request("the conversation is nested too deeply to render") from None
    prompt_ids = encoding.token_ids
    if not prompt_ids:
        raise bad_request("the conversation renders to an empty prompt", "messages")

    n, top_logprobs, prompt_logprobs = 1, None, None
    if protocol == "chat":
        n = fields.n
        prompt_logprobs = fields.prompt_logprobs
        if fields.logprobs:
            top_logprobs = fields.top_logprobs or 0
        elif fields.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        sampling.check_logprobs(top_logprobs, state.options.max_logprobs, "top_logprobs")
    elif protocol == "responses":
        top_logprobs = fields.top_logprobs
        sampling.check_logprobs(top_logprobs, state.options.max_logprobs, "top_logprobs")
    max_tokens = sampling.default_max_tokens(state.sampling_defaults, conversation.max_tokens)
    where = "input" if protocol == "responses" else "messages"
    prompt_ids = sampling.truncate_prompt(prompt_ids, fields, max_tokens, state.max_model_len)
    try:   # after truncation: a cut that splits or drops an image is refused here
        images = state.images.inputs(prompt_ids, loaded) if loaded else None
    except RequestError as e:
        raise bad_request(str(e), e.path) from None
    sampling.check_context(len(prompt_ids), max_tokens, state.max_model_len, where)
    fmt = conversation.response_format
    if encoding.constraint is not None:   # a forced tool choice: the recipe's tool-call format
        sampling.check_tool_schemas(offered_tools(conversation)[0])
    params = state.sampling_params(fields, max_tokens=max_tokens, logprobs=top_logprobs,
                            prompt_logprobs=prompt_logprobs, n=n, detokenize=False,
                            response_format={"type": fmt.type, "schema": fmt.schema},
                            tool_constraint=encoding.constraint)
    request_id = state.client.new_request_id()
    sessions = []
    created = int(time.time())
    prefix = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}[protocol]
    # vLLM's request_id names the response (the engine keeps its own ids, unique in flight).
    response_id = prefix + (getattr(fields, "request_id", None) or request_id)
    # --tool-call-parser: the format the model writes calls in (None: the chat format's own).
    tool_format = TOOL_CALL_PARSERS.get(state.options.tool_call_parser or "")
    for _ in range(n):
        sessions.append(OutputSession.for_encoding(encoder, encoding, protocol, model=model,
                                                   response_id=response_id, created=created,
                                                   ignore_eos=fields.ignore_eos, tool_format=tool_format))
    prepared = PreparedConversation(protocol, request_id, model, prompt_ids, params, sessions, top_logprobs,
                                    engine_fields, fields, created)
    prepared.echo_text = chat_options.echo_text(conversation, fields, protocol)
    prepared.legacy_functions = protocol == "chat" and fields.functions is not None
    prepared.as_token_ids = state.tokens_as_ids(fields)
    prepared.stop_reasons = [None] * n
    prepared.images = images
    return prepared


def submit(state: ServerState, prepared: PreparedConversation) -> AsyncIterator[RequestOutput]:
    """Add the request to the engine (429/503 surface here, before any response starts)."""
    return state.client.generate(prepared.prompt_token_ids, prepared.params, request_id=prepared.request_id,
                                 images=prepared.images, **prepared.engine_fields)


async def run(state: ServerState, prepared: PreparedConversation,
              outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[ChoiceUpdate]:
    """Yield each choice's protocol events as tokens arrive.

    The start events come with the first engine output, when the prefix-cache hit (reported
    in usage) is known."""
    client = state.client
    started = False
    async for out in outputs:
        prepared.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and prepared.prompt_logprobs is None:
            prepared.prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
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
            if session.finished and prepared.stop_reasons:
                # The stop string the parser found, else the stop token id the engine stopped on
                # (None: EOS or the length limit), as completions report it.
                prepared.stop_reasons[completion.index] = session.parser.stop_sequence or completion.stop_reason
            logprobs = []
            if prepared.top_logprobs is not None and completion.logprobs:
                logprobs = [chat_logprob(entry, token_id, prepared.top_logprobs, prepared.as_token_ids)
                            for token_id, entry in zip(completion.token_ids, completion.logprobs)]
            yield ChoiceUpdate(completion.index, events, logprobs)


async def run_to_end(request, state: ServerState, prepared: PreparedConversation,
                     outputs: AsyncIterator[RequestOutput]) -> list[list[dict]]:
    """Run a non-streamed request to its end, aborting it if the client goes away; returns each
    choice's token logprobs (empty lists unless asked for)."""
    logprobs: list[list[dict]] = [[] for _ in prepared.sessions]
    async with abort_on_disconnect(request, state.client, [prepared.request_id]):
        with engine_errors():
            async for update in run(state, prepared, outputs):
                logprobs[update.index].extend(update.logprobs)
    return logprobs
