"""Shared pieces of the protocol adapters: validation-error paths and strict-schema rules."""

from __future__ import annotations

import copy
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import RequestError
from ..tools.schema_check import check_tool_schema

Model = TypeVar("Model", bound=BaseModel)


class Lenient(BaseModel):
    """Request models ignore unknown fields, as the real APIs do (clients send extras)."""

    model_config = ConfigDict(extra="ignore")


def _json_path(data: Any, loc: tuple) -> str:
    """Turn a pydantic error location into a JSON path over the *input*.

    Pydantic puts union member names into `loc` (e.g. "str", "list[...]" or a tag); walking the
    input alongside keeps only the steps that exist in the client's JSON."""
    path = ""
    node = data
    for step in loc:
        if isinstance(step, int) and isinstance(node, list) and 0 <= step < len(node):
            path += f"[{step}]"
            node = node[step]
        elif isinstance(step, str) and isinstance(node, dict) and step in node:
            path += f".{step}" if path else step
            node = node[step]
    return path


def validate(model: type[Model], body: Any) -> Model:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # With unions pydantic reports one error per member; the one that got deepest into the
        # input is the one that describes what the client meant.
        error = max(exc.errors(), key=lambda e: len(_json_path(body, tuple(e["loc"]))))
        path = _json_path(body, tuple(error["loc"]))
        if error["type"] == "missing":
            field = str(error["loc"][-1])
            path = f"{path}.{field}" if path else field
        if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            field = str(error.get("ctx", {}).get("discriminator", "type")).strip("'\"")
            if not path.endswith(field):
                path = f"{path}.{field}" if path else field
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


