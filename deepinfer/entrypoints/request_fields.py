"""Every top-level field each route accepts, as strict pydantic models.

One model per route lists the fields the server implements, so that:
  * an unknown or unimplemented field is a 400 naming it, never silently dropped (a vLLM
    field such as `guided_json` either works or is refused, it is never ignored);
  * a wrong type is a 400 naming the field: a JSON string is not a number ("42" for seed), a
    boolean is not a number, NaN is not a temperature;
  * integers the engine passes on (seed, priority, top_k, token ids) are bounded to int64, so
    nothing fails later in msgpack or torch with an OverflowError.
Fields that the recipe parses (messages, tools, input, ...) are typed `Any` here: the recipe's own
models validate them, with the JSON path of the mistake. Which fields a request *set* (pydantic's
`model_fields_set`) decides whether the model's generation_config defaults apply.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.entrypoints.errors import bad_request

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
INT32_MAX = 2 ** 31 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class _Fields(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SamplingFields(_Fields):
    """Sampling and scheduling fields every generation route takes (OpenAI's names plus
    vLLM's extras, which OpenAI SDK users send through `extra_body`)."""

    model: str | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Int64 | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    # JSON object keys are strings: {"50256": -100}; the token ids are checked against the vocab.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained output: vLLM's structured_outputs, and its older guided_* spellings.
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "xgrammar"] | None = None
    guided_whitespace_pattern: None = None   # not implemented: only null is accepted
    # vLLM's scheduling fields: lower priority runs first under --policy priority; cache_salt is
    # a tenant's prefix-cache namespace (an empty salt would share the unsalted one: refused).
    priority: Int64 = 0
    cache_salt: NonEmptyStr | None = None
    # deepinfer's: the KV store retention class (one of kv_retention's; types/traffic_class.py).
    traffic_class: str | None = None
    # OpenAI's end-user id: accepted, used only in request logs.
    user: str | None = None


class VLLMFields(SamplingFields):
    """vLLM's request extras of its OpenAI routes (completions, chat, responses)."""

    # The response's id is built from it (vLLM's rule); the engine keeps its own unique ids.
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Keep only the last (truncation_side "left") or first N prompt tokens; -1: as many as fit.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Words whose token sequences may not be generated (SamplingParams.bad_words).
    bad_words: list[str] | None = None
    # Logprob tokens as "token_id:N"; None: the server's --return-tokens-as-token-ids.
    return_tokens_as_token_ids: bool | None = None
    # Accepted and not acted on (IGNORED below says why; a warning is logged once per field).
    mm_processor_kwargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


# Fields accepted and not acted on, with the reason the warning gives (vLLM also accepts fields
# it ignores, with a warning). Any other field a route does not list is a 400.
IGNORED = {
    "mm_processor_kwargs": "the model takes no images or audio",
    "kv_transfer_params": "prefill/decode hand-over is the router's here (--kv-role), not the request's",
    "vllm_xargs": "deepinfer has no custom logits-processor plugins to pass them to",
    "prompt_cache_key": "the prefix cache is automatic and shared by every request here; the key does not "
                        "partition it (cache_salt does)",
    "safety_identifier": "nothing here acts on end-user ids",
    "verbosity": "the model's verbosity cannot be set by a parameter",
    "prediction": "predicted outputs only speed generation up, and are not used for drafts here",
}
_warned: set[str] = set()


def warn_ignored(fields: SamplingFields) -> None:
    """One warning line per ignored field the request set, the first time each is seen."""
    for name in IGNORED.keys() & fields.model_fields_set:
        if getattr(fields, name) is not None and name not in _warned:
            _warned.add(name)
            logger.warning("request field '%s' is accepted and ignored: %s (logged once)", name, IGNORED[name])


class CompletionFields(VLLMFields):
    prompt: Any = None
    suffix: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = 16
    n: Annotated[int, Field(ge=1)] = 1
    best_of: Annotated[int, Field(ge=1)] | None = None
    logprobs: Count | None = None
    echo: bool = False
    stop: Union[str, list[str], None] = None
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prompt_logprobs: Count | None = None
    add_special_tokens: bool = True
    return_token_ids: bool = False


class ChatFields(VLLMFields):
    # Parsed by the recipe (protocols/chat_completions.py).
    messages: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    thinking: Any = None
    reasoning_effort: Any = None
    parallel_tool_calls: Any = None
    stop: Union[str, list[str], None] = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    logprobs: bool = False
    top_logprobs: Count | None = None
    prompt_logprobs: Count | None = None
    stream_options: dict[str, Any] | None = None
    # Extra variables for the model's Jinja chat template (vLLM's name), e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and not acted on: deepinfer stores nothing (store/metadata) and has one tier.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's chat extras: the prompt's end (chat_options.py), the last message echoed back, and
    # documents for the template (RAG templates read `documents`).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    documents: list[dict[str, Any]] | None = None
    # OpenAI's older spelling of tools and tool_choice (parsed by the recipe); replies in kind.
    functions: Any = None
    function_call: Any = None
    # The output's kinds: only text is produced here (a list asking for audio is a 400).
    modalities: list[Literal["text", "audio"]] | None = None
    # OpenAI SDK fields accepted and ignored (IGNORED says why).
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ResponsesFields(VLLMFields):
    # Parsed by the recipe (protocols/responses.py).
    input: Any = None
    instructions: Any = None
    tools: Any = None
    tool_choice: Any = None
    reasoning: Any = None
    text: Any = None
    parallel_tool_calls: Any = None
    previous_response_id: Any = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    top_logprobs: Count | None = None
    truncation: Literal["disabled"] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class MessagesFields(SamplingFields):
    # Parsed by the recipe (protocols/messages.py).
    max_tokens: Any = None
    system: Any = None
    messages: Any = None
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    output_config: Any = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class EmbeddingFields(_Fields):
    """/v1/embeddings: OpenAI's fields and vLLM's extras (entrypoints/openai/embeddings.py)."""

    model: str | None = None
    input: Any = None   # a string, token ids, or a list of either: checked by the route
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    user: str | None = None
    # vLLM's: keep each input's last N tokens (-1: max_model_len); special tokens; normalization
    # (None: --pooler-config's); base64 always carries little-endian float32 (what the SDK decodes).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little"] = "native"
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    priority: Int64 = 0
    cache_salt: NonEmptyStr | None = None
    traffic_class: str | None = None


ROUTE_FIELDS = {"completions": CompletionFields, "chat": ChatFields, "responses": ResponsesFields,
                "messages": MessagesFields, "embeddings": EmbeddingFields}


def parse_fields(protocol: str, body: dict) -> SamplingFields | EmbeddingFields:
    """The body's fields for `protocol`, or a 400 naming the first bad one."""
    try:
        return ROUTE_FIELDS[protocol].model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(step) for step in error["loc"])
        if error["type"] == "extra_forbidden":
            raise bad_request(f"unknown or unsupported field '{path}' for this route", path) from None
        raise bad_request(f"{path}: {error['msg']}", path) from None
