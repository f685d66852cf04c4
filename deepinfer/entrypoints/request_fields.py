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

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.entrypoints.errors import bad_request

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


class CompletionFields(SamplingFields):
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


class ChatFields(SamplingFields):
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


class ResponsesFields(SamplingFields):
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


ROUTE_FIELDS = {"completions": CompletionFields, "chat": ChatFields, "responses": ResponsesFields,
                "messages": MessagesFields}


def parse_fields(protocol: str, body: dict) -> SamplingFields:
    """The body's fields for `protocol`, or a 400 naming the first bad one."""
    try:
        return ROUTE_FIELDS[protocol].model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(step) for step in error["loc"])
        if error["type"] == "extra_forbidden":
            raise bad_request(f"unknown or unsupported field '{path}' for this route", path) from None
        raise bad_request(f"{path}: {error['msg']}", path) from None
