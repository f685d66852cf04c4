"""`--lora-modules`, vLLM's two forms: `name=path`, or a JSON object
`{"name": "sql", "path": "/adapters/sql", "base_model_name": "llama"}` (base_model_name optional:
the adapter's `parent` in /v1/models). Parsed when the server options are made, so a malformed
value stops the server at start with the value named; the adapters themselves are checked against
the model when the server registers them (lora/registry.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """One --lora-modules value; ValueError naming it and the accepted forms."""
    where = f"--lora-modules {text!r}"
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        unknown = sorted(set(value) - {"name", "path", "base_model_name"}) if isinstance(value, dict) else []
        if not isinstance(value, dict) or unknown:
            raise ValueError(f"{where}: a JSON value is an object of name, path and (optional) base_model_name"
                             + (f"; unknown key(s) {', '.join(unknown)}" if unknown else ""))
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"{where}: base_model_name must be a string, got {base!r}")
    else:
        name, _, path = text.partition("=")
        base = None
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where}: expected name=path or a JSON object with \"name\" and \"path\"")
    return LoRAModule(name.strip(), path.strip(), base)
