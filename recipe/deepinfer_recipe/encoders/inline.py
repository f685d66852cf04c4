"""Conversation messages → the `messages` list a chat template receives.

`template_messages` is the usual mapping (tool calls as `tool_calls`, results as role `tool`).
`inline_tool_messages` is for templates that ignore tools (SmolLM2's, Gemma 3's): the tool list,
earlier calls and their results are written into ordinary messages in the Hermes convention the
output parser reads back, so the model still sees what it may call and what came of it:
  * the system message gains a `<tools>` block listing each tool as JSON and says how to call;
  * an assistant call becomes `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` text;
  * tool results become one user message of `<tool_response>` blocks (templates that insist on
    alternating user/assistant turns accept that).
Every client string (ids, names and JSON keys included) passes through `protect` (see
hf_template.py), so none of it can become a control token, whatever it spells.
"""

from __future__ import annotations

import json

from ..conversation import Message, TextPart, ToolDefinition
from ..tools.constraint import HermesTags, call_prefix

TOOLS_HEADER = (
    "You can call functions. They are listed below as JSON Schemas, one per line, between "
    "<tools></tools> tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\nTo call a function, answer with its name and arguments as a JSON object between "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": "<function name>", "arguments": <arguments as a JSON object>}\n</tool_call>'
)


def template_messages(messages: list[Message], protect) -> list[dict]:
    items = []
    for m in messages:
        item: dict = {"role": "system" if m.role == "developer" else m.role, "content": message_content(m, protect)}
        if m.reasoning:
            item["reasoning_content"] = protect(m.reasoning)
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": protect(c.id), "type": "function", "function": {"name": protect(c.name), "arguments": _arguments(c.arguments, protect)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            item["tool_call_id"] = protect(m.tool_call_id)
        items.append(item)
    return items


def message_content(m: Message, protect):
    """A message's text, or its parts when it has images (the HF convention: the template writes
    its image marker at each `{"type": "image"}`; ../images.py)."""
    return parts_content(m.content, protect) if m.has_images else protect(m.text)


def parts_content(parts, protect) -> list[dict]:
    return [{"type": "text", "text": protect(p.text)} if isinstance(p, TextPart) else {"type": "image"} for p in parts]


def tools_system_text(tools: list[ToolDefinition]) -> str:
    lines = [json.dumps({"name": t.name, "description": t.description or "", "parameters": t.parameters or {}},
                        ensure_ascii=False) for t in tools]
    return TOOLS_HEADER + "\n".join(lines) + TOOLS_FOOTER


def call_text(name: str, arguments: str) -> str:
    """One earlier call written the way the constraint makes the model write it."""
    try:
        parsed = json.loads(arguments)
        args = json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else json.dumps(arguments, ensure_ascii=False)
    except ValueError:
        args = json.dumps(arguments, ensure_ascii=False)
    return HermesTags.start + call_prefix(name) + args + "}\n" + HermesTags.end


def inline_tool_messages(messages: list[Message], tools: list[ToolDefinition], protect) -> list[dict]:
    items: list[dict] = []
    plain: list[tuple[str, str, str | None]] = []  # (role, text, reasoning) before protection
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if m.role == "tool":
            block = f"<tool_response>\n{m.text}\n</tool_response>"
            if plain and plain[-1][0] == "tool_results":
                plain[-1] = ("tool_results", plain[-1][1] + "\n" + block, None)
            else:
                plain.append(("tool_results", block, None))
            continue
        text = m.content if m.has_images else m.text   # parts: the template places the images
        if m.tool_calls:
            calls = "\n".join(call_text(c.name, c.arguments) for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        plain.append((role, text, m.reasoning))
    if tools:
        header = tools_system_text(tools)
        if plain and plain[0][0] == "system" and isinstance(plain[0][1], str):
            plain[0] = ("system", f"{plain[0][1]}\n\n{header}" if plain[0][1] else header, None)
        else:
            plain.insert(0, ("system", header, None))
    for role, text, reasoning in plain:
        content = protect(text) if isinstance(text, str) else parts_content(text, protect)
        item = {"role": "user" if role == "tool_results" else role, "content": content}
        if reasoning:
            item["reasoning_content"] = protect(reasoning)
        items.append(item)
    return items


def _arguments(arguments: str, protect):
    """HF templates expect arguments as a mapping (most `tojson` them); every string in it, keys
    and nested values included, is the client's."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return protect(arguments)
    if not isinstance(parsed, dict):
        return protect(arguments)
    return protect_tree(parsed, protect)


def protect_tree(value, protect):
    """A JSON value with every string in it, keys included, passed through `protect`."""
    if isinstance(value, str):
        return protect(value)
    if isinstance(value, dict):
        return {protect(k) if isinstance(k, str) else k: protect_tree(v, protect) for k, v in value.items()}
    if isinstance(value, list):
        return [protect_tree(v, protect) for v in value]
    return value
