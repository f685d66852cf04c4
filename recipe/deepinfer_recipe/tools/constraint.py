"""The output constraint for a forced tool call, in the model's own tool-call format.

With `tool_choice: "required"` (Anthropic `{"type": "any"}`) or a named tool, the answer must be
one or more tool calls. The encoder returns, beside the prompt, a description of exactly the text
the model may emit: an xgrammar *structural tag* (plain JSON; this package does not import
xgrammar). The engine compiles it like any other structured-output constraint, off the critical
path. Each call's arguments are constrained by that tool's JSON Schema.

Two formats:
  * Hermes/Qwen (HF chat templates): `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`,
    calls separated by a newline. Where the tokenizer has `<tool_call>` / `</tool_call>` as
    tokens, the tags are required as those tokens (the parser acts on their ids).
  * DeepSeek DSML: the forced prompt already opened `<｜DSML｜tool_calls>`, so the constraint
    covers the invoke blocks (parameters in DSML's XML style) and the closing tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..conversation import Conversation, NamedToolChoice, ToolDefinition
from ..errors import RequestError

# Bounded whitespace runs inside arguments: with free `\s*` a small model can emit newlines
# forever and never close the object (the engine's JSON constraints use the same bound).
MAX_WHITESPACE = 2
_ANY_OBJECT = {"type": "object"}


def offered_tools(conversation: Conversation) -> tuple[list[ToolDefinition], bool]:
    """The tools this turn offers the model, and whether it must call one.

    `none` offers nothing; a named choice offers (and forces) that tool alone; `required` forces
    a call to any of them. Errors name `tool_choice`."""
    choice = conversation.tool_choice
    if choice == "none":
        return [], False
    tools = list(conversation.tools)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.name == choice.name]
        if not tools:
            raise RequestError(f"tool_choice names an undefined tool {choice.name!r}", "tool_choice")
        return tools, True
    if choice == "required" and not tools:
        raise RequestError("tool_choice requires tools", "tool_choice")
    return tools, choice == "required"


def parallel_calls(conversation: Conversation) -> bool:
    """Whether a forced turn may hold several calls: not for a named tool (OpenAI and Anthropic
    force exactly that call), nor with `parallel_tool_calls: false` / `disable_parallel_tool_use`."""
    return conversation.parallel_tool_calls and not isinstance(conversation.tool_choice, NamedToolChoice)


@dataclass(frozen=True)
class HermesTags:
    """How one Hermes-style call is delimited, and whether each tag is a single token."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    start_is_token: bool = False
    end_is_token: bool = False


def call_prefix(name: str) -> str:
    """The text between `<tool_call>` and the arguments object (the parser streams from here)."""
    return '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def hermes_constraint(tools: list[ToolDefinition], parallel: bool, tags: HermesTags = HermesTags()) -> dict:
    """Structural tag: one or more `<tool_call>` blocks (exactly one if not `parallel`)."""
    if not tools:
        raise RequestError("tool_choice requires tools", "tool_choice")
    calls = [
        {"type": "sequence", "elements": [
            {"type": "const_string", "value": call_prefix(tool.name)},
            _arguments(tool, "json"),
            {"type": "const_string", "value": "}\n"},
        ]}
        for tool in tools
    ]
    tag = {
        "type": "tag",
        "begin": {"type": "token", "token": tags.start} if tags.start_is_token else tags.start,
        "content": calls[0] if len(calls) == 1 else {"type": "or", "elements": calls},
        "end": {"type": "token", "token": tags.end} if tags.end_is_token else tags.end,
    }
    return {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": [tag], "separator": "\n",
        "at_least_one": True, "stop_after_first": not parallel,
    }}


def dsml_constraint(tools: list[ToolDefinition], parallel: bool, dsml: str, invoke: str, calls: str,
                    v41: bool) -> dict:
    """Structural tag for the invoke blocks after an opened `<DSML calls>` and its closing tag."""
    if not tools:
        raise RequestError("tool_choice requires tools", "tool_choice")
    style = "deepseek_v4_1_xml" if v41 else "deepseek_xml"
    invokes = [
        {"type": "tag", "begin": f'<{dsml}{invoke} name="{tool.name}">\n', "content": _arguments(tool, style),
         "end": f"</{dsml}{invoke}>\n"}
        for tool in tools
    ]
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tags_with_separator", "tags": invokes, "separator": "", "at_least_one": True,
         "stop_after_first": not parallel},
        {"type": "const_string", "value": f"</{dsml}{calls}>"},
    ]}}


def _arguments(tool: ToolDefinition, style: str) -> dict:
    return {"type": "json_schema", "json_schema": tool.parameters or _ANY_OBJECT, "style": style,
            "max_whitespace_cnt": MAX_WHITESPACE}
