"""Request body -> SamplingParams, with the checks that turn bad values into 400s.

Every protocol reads its own names (OpenAI's `max_completion_tokens`, `top_logprobs`, ...;
Anthropic's `top_k`), plus vLLM's extra sampling fields that clients send through `extra_body`
(`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, ...).
Types are checked here so that a wrong one is a 400 naming the field, never a 500.
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer.entrypoints.errors import bad_request
from deepinfer.sample.structured import validate as validate_structured_outputs
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams

MAX_TOP_LOGPROBS = 20   # OpenAI's limit for top_logprobs
MAX_N = 128

_INT = (int,)
_NUMBER = (int, float)

# vLLM's extra sampling fields, accepted by every OpenAI-style route.
_EXTRA_FIELDS = {
    "top_k": _INT, "min_p": _NUMBER, "repetition_penalty": _NUMBER, "min_tokens": _INT,
    "ignore_eos": (bool,), "stop_token_ids": (list,), "skip_special_tokens": (bool,),
    "include_stop_str_in_output": (bool,), "allowed_token_ids": (list,),
}


def field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] if it has one of `kinds` (None counts as absent), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:   # JSON true is not a number
        raise bad_request(f"{name} must be {_kind_names(kinds)}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise bad_request(f"{name} must be {_kind_names(kinds)}, got {value!r}", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", list: "a list", str: "a string",
             dict: "an object"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def include_usage(body: dict) -> bool:
    """stream_options.include_usage (OpenAI: only allowed when streaming)."""
    options = field(body, "stream_options", (dict,), {})
    if options and not body.get("stream"):
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return bool(field(options, "include_usage", (bool,), False))


def engine_request_fields(body: dict) -> dict:
    """vLLM's per-request scheduling fields: `priority` (lower runs first under --policy
    priority) and `cache_salt` (a tenant's prefix-cache namespace)."""
    return {"priority": field(body, "priority", _INT, 0), "cache_salt": field(body, "cache_salt", (str,))}


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, where: str = "messages") -> None:
    """Reject prompt + max_tokens beyond the context, with the numbers (vLLM's wording)."""
    requested = prompt_len + (max_tokens or 0)
    if prompt_len >= max_model_len or requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({prompt_len} in the {where}, {max_tokens or 0} in the completion). "
            f"Please reduce the length of the {where} or completion.", "max_tokens")


_STRUCTURED_FIELDS = {"json": (dict, str), "regex": (str,), "choice": (list,), "grammar": (str,),
                      "json_object": (bool,), "structural_tag": (dict, str), "disable_any_whitespace": (bool,), "compile_timeout_s": _NUMBER}


def structured_outputs(body: dict, response_format: dict | None = None,
                       tool_constraint: dict | None = None) -> StructuredOutputsParams | None:
    """The output constraint: vLLM's `structured_outputs` (extra_body), OpenAI's
    `response_format` ({"type": "json_object"} or {"type": "json_schema", "schema": ...}, already
    unpacked by the recipe), or the structural tag the recipe returns for a forced tool choice.
    An invalid schema, regex or grammar is a 400 with xgrammar's reason."""
    raw = field(body, "structured_outputs", (dict,))
    fmt = response_format if response_format and response_format.get("type") != "text" else None
    if raw is not None and fmt is not None:
        raise bad_request("give either response_format or structured_outputs, not both", "structured_outputs")
    if tool_constraint is not None and (raw is not None or fmt is not None):
        raise bad_request("a forced tool_choice already constrains the output; drop "
                          f"{'structured_outputs' if raw is not None else 'response_format'} or use tool_choice auto",
                          "tool_choice")
    if tool_constraint is not None:
        param = "tool_choice"
        kwargs = {"structural_tag": tool_constraint}
    elif raw is not None:
        param = "structured_outputs"
        unknown = sorted(set(raw) - set(_STRUCTURED_FIELDS))
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields {unknown}; known: "
                              f"{', '.join(_STRUCTURED_FIELDS)}", param)
        kwargs = {name: field(raw, name, kinds) for name, kinds in _STRUCTURED_FIELDS.items()}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs.setdefault("disable_any_whitespace", False)
    elif fmt is not None:
        param = "response_format"
        if fmt["type"] == "json_object":
            kwargs = {"json_object": True}
        elif fmt.get("schema") is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", param)
        else:
            # OpenAI's strict: true promises output that matches the schema; deepinfer always
            # enforces the schema, so strict only changes what the schema itself may say.
            kwargs = {"json": fmt["schema"]}
    else:
        return None
    try:
        constraint = StructuredOutputsParams(**kwargs)
        validate_structured_outputs(constraint)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param) from None
    return constraint


def check_tool_schemas(tools) -> None:
    """Each forced tool's parameters must compile as a JSON Schema: a 400 naming the tool's field
    (like `tools[1].function.parameters`) with xgrammar's reason, before the request is queued."""
    for tool in tools:
        if not tool.parameters:
            continue
        try:
            validate_structured_outputs(StructuredOutputsParams(json=tool.parameters))
        except (ValueError, TypeError) as e:
            reason = str(e).removeprefix("invalid structured_outputs.json: ")
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)   # xgrammar's time and source line
            where = f"{tool.schema_path}: " if tool.schema_path else ""
            raise bad_request(f"{where}invalid JSON Schema for tool {tool.name!r}: {reason}", tool.schema_path) from None


def build(body: dict, *, vocab_size: int, max_tokens: int | None, logprobs: int | None = None,
          stop: list[str] | None = None, n: int = 1, seed: int | None = None,
          detokenize: bool = True, response_format: dict | None = None,
          tool_constraint: dict | None = None) -> SamplingParams:
    """SamplingParams from the common OpenAI fields plus the extras; a bad value is a 400."""
    kwargs: dict[str, Any] = {
        "n": n,
        "temperature": field(body, "temperature", _NUMBER, 1.0),   # OpenAI's and Anthropic's default
        "top_p": field(body, "top_p", _NUMBER, 1.0),
        "presence_penalty": field(body, "presence_penalty", _NUMBER, 0.0),
        "frequency_penalty": field(body, "frequency_penalty", _NUMBER, 0.0),
        "seed": seed,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "stop": stop or None,
        "detokenize": detokenize,
        "structured_outputs": structured_outputs(body, response_format, tool_constraint),
    }
    bias = field(body, "logit_bias", (dict,))
    if bias is not None:
        kwargs["logit_bias"] = bias
    for name, kinds in _EXTRA_FIELDS.items():
        value = field(body, name, kinds)
        if value is not None:
            kwargs[name] = value
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {n}", "n")
    try:
        params = SamplingParams(**kwargs)
        params.verify_token_ids(vocab_size)
        return params
    except (ValueError, TypeError) as e:
        message = str(e)
        # The longest field name the message starts with ("stop_token_ids", not "stop").
        param = max((k for k in kwargs if message.startswith(k)), key=len, default=None)
        raise bad_request(message, param) from None
