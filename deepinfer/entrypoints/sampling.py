"""Request body -> SamplingParams, with the checks that turn bad values into 400s.

Types and ranges are checked by the route's pydantic model (request_fields.py); here the
validated fields become SamplingParams, with the limits that depend on the server's options
(stop sequences, logprobs) and the model's generation_config defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from deepinfer.entrypoints.errors import APIError, bad_request
from deepinfer.entrypoints.options import ServerOptions
from deepinfer.sample.structured import validate as validate_structured_outputs
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams
from deepinfer.types import traffic_class as traffic

MAX_N = 128
# The longest stop string a request may give: the stop matcher keeps every proper prefix of each
# (what it holds back while streaming), memory quadratic in a string's length.
MAX_STOP_CHARS = 1024
# The most bad_words a request may give (each is matched against the output at every step).
MAX_BAD_WORDS = 128

# Fields a model's generation_config.json may give defaults for (vLLM's --generation-config).
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] if it has one of `kinds` (None counts as absent), else a 400 naming it; for
    the free-form objects inside a request (structured_outputs)."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise bad_request(f"{name} must be {_kind_names(kinds)}, got {value!r}", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", list: "a list", str: "a string",
             dict: "an object"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def include_usage(fields, force: bool = False) -> bool:
    """stream_options.include_usage (OpenAI: only allowed when streaming); `force`
    (--enable-force-include-usage): every stream ends with usage."""
    options = fields.stream_options
    if options is None:
        return force and fields.stream
    if not fields.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad_request(f"stream_options has unknown field(s) {unknown}", "stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    return value or force


def engine_request_fields(fields, traffic_classes: Sequence[str], header: str | None = None,
                          offers_tools: bool = False) -> dict:
    """vLLM's per-request scheduling fields: `priority` (lower runs first under --policy
    priority) and `cache_salt` (a tenant's prefix-cache namespace); and deepinfer's
    `traffic_class` (types/traffic_class.py): the body field, else the X-Traffic-Class header
    (`header`), else "agent" when the request offers tools, "chat" otherwise. A class kv_retention
    does not name is a 400 naming where it came from and the allowed classes."""
    if fields.traffic_class is not None:
        value, where = fields.traffic_class, "traffic_class"
    else:
        value, where = header, f"the {traffic.HEADER} header"
    try:
        traffic_class = traffic.resolve(value, traffic_classes, offers_tools=offers_tools, field=where)
    except ValueError as e:
        raise bad_request(str(e), "traffic_class") from None
    return {"priority": fields.priority, "cache_salt": fields.cache_salt, "traffic_class": traffic_class}


def check_stop_sequences(stop: str | Sequence[str] | None, limit: int, param: str = "stop") -> None:
    """The one check of every route's stop strings (completions' and chat's `stop`, Messages'
    `stop_sequences`): at most `limit` of them (--max-stop-sequences), each at most MAX_STOP_CHARS
    long; a 400 naming the field and the limit. Run before the recipe parses the request."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > limit:
        raise bad_request(f"{param}: at most {limit} stop sequences (--max-stop-sequences), got {len(stops)}", param)
    for index, text in enumerate(stops):
        if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
            where = param if isinstance(stop, str) else f"{param}[{index}]"
            raise bad_request(f"{where} is {len(text)} characters long; a stop sequence may have at most "
                              f"{MAX_STOP_CHARS}", where)


def truncate_prompt(prompt_ids: list[int], fields, max_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last N prompt tokens (truncation_side "right":
    the first N); -1 keeps as many as leave room for max_tokens (at least one token). A value
    beyond the context is a 400 naming the field and the limit."""
    keep = getattr(fields, "truncate_prompt_tokens", None)
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len - (max_tokens or 1)
        if keep < 1:
            raise bad_request(f"truncate_prompt_tokens -1 leaves no room for the prompt: max_tokens ({max_tokens}) "
                              f"fills the context ({max_model_len})", "truncate_prompt_tokens")
    elif keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1, got 0", "truncate_prompt_tokens")
    elif keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be at most max_model_len ({max_model_len}), got {keep}",
                          "truncate_prompt_tokens")
    if len(prompt_ids) <= keep:
        return prompt_ids
    return prompt_ids[:keep] if fields.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep:]


def check_logprobs(value: int | None, limit: int, name: str) -> None:
    """At most --max-logprobs (-1: no limit)."""
    if value is not None and 0 <= limit < value:
        raise bad_request(f"{name} must be at most {limit} (--max-logprobs), got {value}", name)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, where: str = "messages") -> None:
    """Reject prompt + max_tokens beyond the context, with the numbers (vLLM's wording)."""
    requested = prompt_len + (max_tokens or 0)
    if prompt_len >= max_model_len or requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({prompt_len} in the {where}, {max_tokens or 0} in the completion). "
            f"Please reduce the length of the {where} or completion.", "max_tokens")


def prompt_too_long(chars: int, max_chars: int, where: str) -> APIError:
    """The context-length 400 of a prompt refused by its size in characters, before it is
    tokenized (ServerState.prompt_char_limit gives `max_chars`)."""
    return bad_request(f"The {where} ({chars} characters) cannot fit: no prompt of more than {max_chars} characters "
                       "fits this model's context (max_model_len tokens, none of which stands for more characters "
                       f"than the longest token of its vocabulary). Please reduce the length of the {where}.",
                       where.split()[-1])


_STRUCTURED_FIELDS = {"json": (dict, str), "regex": (str,), "choice": (list,), "grammar": (str,),
                      "json_object": (bool,), "structural_tag": (dict, str), "disable_any_whitespace": (bool,),
                      "compile_timeout_s": (int, float)}
# vLLM's older request fields for the same constraints.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(fields, response_format: dict | None = None,
                       tool_constraint: dict | None = None) -> StructuredOutputsParams | None:
    """The output constraint: vLLM's `structured_outputs` (extra_body) or its `guided_*`
    fields, OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
    "schema": ...}, already unpacked by the recipe), or the structural tag the recipe returns
    for a forced tool choice. At most one of them; an invalid schema, regex or grammar is a 400
    with xgrammar's reason."""
    fmt = response_format if response_format and response_format.get("type") != "text" else None
    guided = {kind: getattr(fields, name) for name, kind in _GUIDED.items() if getattr(fields, name) is not None}
    given = [name for name, present in (("structured_outputs", fields.structured_outputs is not None),
                                        ("response_format", fmt is not None),
                                        *((f"guided_{k}", True) for k in guided),
                                        ("tool_choice", tool_constraint is not None)) if present]
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not several: {', '.join(given)}", given[-1])
    if tool_constraint is not None:
        param = "tool_choice"
        kwargs = {"structural_tag": tool_constraint}
    elif fields.structured_outputs is not None:
        param = "structured_outputs"
        raw = fields.structured_outputs
        unknown = sorted(set(raw) - set(_STRUCTURED_FIELDS))
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields {unknown}; known: "
                              f"{', '.join(_STRUCTURED_FIELDS)}", param)
        kwargs = {name: field(raw, name, kinds) for name, kinds in _STRUCTURED_FIELDS.items()}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs.setdefault("disable_any_whitespace", False)
    elif guided:
        param = f"guided_{next(iter(guided))}"
        kwargs = dict(guided)
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
    except (ValueError, TypeError, RecursionError) as e:
        raise bad_request(str(e) if not isinstance(e, RecursionError) else
                          f"{param} is nested too deeply to compile", param) from None
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
            where = f"{tool.schema_path}: " if tool.schema_path else ""
            raise bad_request(f"{where}invalid JSON Schema for tool {tool.name!r}: {reason}", tool.schema_path) from None


def _with_server_defaults(constraint: StructuredOutputsParams | None, fields, options: ServerOptions
                          ) -> StructuredOutputsParams | None:
    """--structured-outputs-config's disable_any_whitespace, for a constraint whose request did
    not say (the request's own value wins)."""
    if (constraint is None or not options.structured_outputs.get("disable_any_whitespace")
            or "disable_any_whitespace" in (fields.structured_outputs or {})):
        return constraint
    return dataclasses.replace(constraint, disable_any_whitespace=True)


def build(fields, *, options: ServerOptions, vocab_size: int, max_tokens: int | None,
          defaults: dict | None = None, logprobs: int | None = None, prompt_logprobs: int | None = None,
          stop: list[str] | None = None, n: int = 1, detokenize: bool = True,
          response_format: dict | None = None, tool_constraint: dict | None = None,
          tokenizer=None) -> SamplingParams:
    """SamplingParams from a route's validated fields (request_fields.py); the fields a request
    leaves out take `defaults` (the model's generation_config), then vLLM's. A bad value is a 400.
    `tokenizer` turns bad_words into token ids (without one, bad_words is a 400)."""
    defaults = defaults or {}
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {n}", "n")
    check_stop_sequences(stop, options.max_stop_sequences, "stop")
    check_logprobs(logprobs, options.max_logprobs, "logprobs")
    check_logprobs(prompt_logprobs, options.max_logprobs, "prompt_logprobs")
    bad_words = getattr(fields, "bad_words", None) or None
    if bad_words is not None:
        if len(bad_words) > MAX_BAD_WORDS:
            raise bad_request(f"at most {MAX_BAD_WORDS} bad_words, got {len(bad_words)}", "bad_words")
        if tokenizer is None:
            raise bad_request("bad_words needs a tokenizer, and the server runs without one (--skip-tokenizer-init)",
                              "bad_words")
    given = fields.model_fields_set
    kwargs: dict[str, Any] = {
        "n": n,
        "seed": fields.seed,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "stop": stop or None,
        "detokenize": detokenize,
        "structured_outputs": _with_server_defaults(structured_outputs(fields, response_format, tool_constraint),
                                                    fields, options),
        "presence_penalty": fields.presence_penalty or 0.0,
        "frequency_penalty": fields.frequency_penalty or 0.0,
        "min_tokens": fields.min_tokens,
        "ignore_eos": fields.ignore_eos,
        "stop_token_ids": fields.stop_token_ids,
        "allowed_token_ids": fields.allowed_token_ids,
        "logit_bias": fields.logit_bias,
        "skip_special_tokens": fields.skip_special_tokens,
        "include_stop_str_in_output": fields.include_stop_str_in_output,
        "bad_words": bad_words,
    }
    for name in _DEFAULTED:
        value = getattr(fields, name) if name in given else None
        if value is None:
            value = defaults.get(name)
        if value is not None:
            kwargs[name] = value
    try:
        params = SamplingParams(**kwargs)
        params.update_from_tokenizer(tokenizer)
        params.verify_token_ids(vocab_size)
        return params
    except (ValueError, TypeError) as e:
        message = str(e)
        # The longest field name the message starts with ("stop_token_ids", not "stop").
        param = max((k for k in kwargs if message.startswith(k)), key=len, default=None)
        raise bad_request(message, param) from None


def default_max_tokens(defaults: dict, requested: int | None) -> int | None:
    """max_tokens: the request's, else the model's generation_config max_new_tokens, else None
    (up to the context length)."""
    return requested if requested is not None else defaults.get("max_tokens")
