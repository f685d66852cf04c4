"""Static checks of a tool's parameter schema, so a broken schema is a 400 naming its field.

The constraint compiler (xgrammar, in the engine) would reject many of these too, but only with
its own message and without knowing which tool or field of the request it came from. Here we
walk the schema once and check the keywords whose *shape* JSON Schema fixes (a `properties`
that is not an object, a `required` entry that is not a string, an unknown `type` name, a
`$ref` that points nowhere local ...). Keywords we do not know are left alone: vendors add
their own, and being strict about them would reject schemas that every API accepts.
"""

from __future__ import annotations

from typing import Any

from ..errors import RequestError

TYPE_NAMES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "additionalItems")
_NON_NEGATIVE_INTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_tool_schema(schema: Any, path: str) -> None:
    """Raise RequestError(path of the bad keyword) if `schema` is not a usable parameters schema.

    `path` is where the schema sits in the request, like `tools[0].function.parameters`."""
    if schema is None:
        return
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise RequestError('tool parameters must be a JSON Schema with type "object"', path)
    _check(schema, path, schema)


def _check(node: Any, path: str, root: dict) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise RequestError(f"a schema must be an object or a boolean, got {_kind(node)}", path)
    _check_type(node.get("type"), f"{path}.type", "type" in node)
    if "required" in node:
        required = node["required"]
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise RequestError("required must be a list of property names (strings)", f"{path}.required")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise RequestError("enum must be a non-empty list", f"{path}.enum")
    for key in _NON_NEGATIVE_INTS:
        if key in node and (isinstance(node[key], bool) or not isinstance(node[key], int) or node[key] < 0):
            raise RequestError(f"{key} must be a non-negative integer, got {node[key]!r}", f"{path}.{key}")
    for key in _NUMBERS:
        if key in node and (isinstance(node[key], bool) or not isinstance(node[key], (int, float))):
            raise RequestError(f"{key} must be a number, got {node[key]!r}", f"{path}.{key}")
    for low, high in (("minItems", "maxItems"), ("minLength", "maxLength"), ("minimum", "maximum"),
                      ("minProperties", "maxProperties")):
        if low in node and high in node and node[low] > node[high]:
            raise RequestError(f"{low} ({node[low]}) is greater than {high} ({node[high]})", f"{path}.{low}")
    if "pattern" in node and not isinstance(node["pattern"], str):
        raise RequestError("pattern must be a string (a regular expression)", f"{path}.pattern")
    if "$ref" in node:
        _check_ref(node["$ref"], f"{path}.$ref", root)
    for key in _SCHEMA_MAPS:
        if key in node:
            children = node[key]
            if not isinstance(children, dict):
                raise RequestError(f"{key} must be an object mapping names to schemas", f"{path}.{key}")
            for name, child in children.items():
                _check(child, f"{path}.{key}.{name}", root)
    for key in _SCHEMA_LISTS:
        if key in node:
            children = node[key]
            if not isinstance(children, list) or not children:
                raise RequestError(f"{key} must be a non-empty list of schemas", f"{path}.{key}")
            for index, child in enumerate(children):
                _check(child, f"{path}.{key}[{index}]", root)
    for key in _SCHEMA_VALUES:
        if key in node:
            _check(node[key], f"{path}.{key}", root)


def _check_type(value: Any, path: str, present: bool) -> None:
    if not present:
        return
    names = value if isinstance(value, list) else [value]
    if not names:
        raise RequestError("type must name at least one type", path)
    for name in names:
        if name not in TYPE_NAMES:
            raise RequestError(f"unknown type {name!r}; expected one of {', '.join(TYPE_NAMES)}", path)


def _check_ref(ref: Any, path: str, root: dict) -> None:
    """Local references (`#/...`) must resolve inside the tool's own schema."""
    if not isinstance(ref, str):
        raise RequestError("$ref must be a string", path)
    if ref == "#":
        return
    if not ref.startswith("#/"):
        raise RequestError(f"only local references ('#/...') are supported, got {ref!r}", path)
    node: Any = root
    for step in ref[2:].split("/"):
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            raise RequestError(f"$ref {ref!r} points to nothing in this schema", path)


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number"}.get(type(value), type(value).__name__)
