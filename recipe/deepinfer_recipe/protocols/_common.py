"""Shared pieces of the protocol adapters: validation-error paths and strict-schema rules."""

from __future__ import annotations

import copy
import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from ..errors import RequestError
from ..tools.schema_check import check_tool_schema

Model = TypeVar("Model", bound=BaseModel)


class Lenient(BaseModel):
    """Request models ignore unknown fields, as the real APIs do (clients send extras)."""

    model_config = ConfigDict(extra="ignore")


# Numbers in requests are JSON numbers: pydantic's lax mode would also take "42" or true, which
# OpenAI and Anthropic reject (and the engine's own fields do too). Integers are bounded to int64,
# so a huge one is a 400 naming the field instead of an OverflowError in the sampler.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt64 = Annotated[int, Strict(), Field(ge=1, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
Number = Annotated[float, Strict()]  # an integer is a number too; strict floats accept ints


def _json_path(data: Any, loc: tuple) -> tuple[str, int]:
    """Turn a pydantic error location into a JSON path over the *input*, and its depth.

    Pydantic puts union member names into `loc` (e.g. "str", "list[...]" or a tag); walking the
    input alongside keeps only the steps that exist in the client's JSON."""
    path = ""
    depth = 0
    node = data
    for step in loc:
        if isinstance(step, int) and isinstance(node, list) and 0 <= step < len(node):
            path += f"[{step}]"
            node = node[step]
            depth += 1
        elif isinstance(step, str) and isinstance(node, dict) and step in node:
            path += f".{step}" if path else step
            node = node[step]
            depth += 1
    return path, depth


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_path(node: Any, path: str = "") -> str | None:
    """JSON allows escapes such as "\\ud800" that decode to a lone surrogate: not a character,
    so no tokenizer can encode it. Find the first one (in a key or a string value)."""
    if isinstance(node, str):
        return path if _SURROGATE.search(node) else None
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return where
            found = _lone_surrogate_path(value, where)
            if found is not None:
                return found
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found = _lone_surrogate_path(value, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _error_path(body: Any, error: dict) -> tuple[str, int]:
    """The JSON path a pydantic error is about (a missing field's own name included) and its
    depth in steps."""
    path, depth = _json_path(body, tuple(error["loc"]))
    field = None
    if error["type"] == "missing":
        field = str(error["loc"][-1])
    elif error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        field = str(error.get("ctx", {}).get("discriminator", "type")).strip("'\"")
        if not field.isidentifier():
            field = "type"  # a callable discriminator (e.g. `_item_kind()`) reads the item's type
        if path.endswith(field):
            field = None
    if field is not None:
        path = f"{path}.{field}" if path else field
        depth += 1
    return path, depth


def validate(model: type[Model], body: Any) -> Model:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    surrogate = _lone_surrogate_path(body)
    if surrogate is not None:
        raise RequestError("the string contains a lone UTF-16 surrogate (an invalid \\u escape)", surrogate or None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # With unions pydantic reports one error per member; the one that got deepest into the
        # input is the one that describes what the client meant.
        # Ties go to the first error, i.e. the first field in the model's order.
        error = max(exc.errors(), key=lambda e: _error_path(body, e)[1])
        path = _error_path(body, error)[0]
        message = error["msg"]
        if error["type"] == "union_tag_invalid":
            message = f"unsupported value {error['ctx'].get('tag')!r}; expected {error['ctx'].get('expected_tags')}"
        raise RequestError(message, path or None) from None


def normalize_strict_schema(schema: Any) -> Any:
    """What `strict: true` means for a tool's parameters (OpenAI structured outputs): every object
    forbids extra properties and requires all its properties. deepseek-recipe renders the
    normalized schema into the prompt, so we do too."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "object" and isinstance(node.get("properties"), dict):
            for value in node["properties"].values():
                visit(value)
            node.setdefault("additionalProperties", False)
            node["required"] = list(node["properties"].keys())
        for key in ("items", "anyOf", "oneOf", "allOf", "$defs", "definitions"):
            if key in node:
                child = node[key]
                visit(list(child.values()) if isinstance(child, dict) and key in ("$defs", "definitions") else child)

    visit(schema)
    return schema


def require_object_schema(schema: Any, path: str) -> None:
    """A tool's parameters: an object schema whose keywords have valid shapes (400 naming the field)."""
    check_tool_schema(schema, path)


