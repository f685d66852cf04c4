"""Anthropic Messages request → Conversation (research E.2).

A user turn's `tool_result` blocks become tool messages (placed before the turn's other blocks,
which is where Anthropic requires them); assistant `thinking` blocks become reasoning,
`tool_use` blocks tool calls. `thinking` absent means the format's default, as deepseek-recipe
does; `budget_tokens` does not change the prompt. Hosted server tools are dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from ..conversation import (
    Conversation,
    ImagePart,
    Message,
    NamedToolChoice,
    TextPart,
    ToolCall,
    ToolDefinition,
)
from ..errors import RequestError
from ._common import Lenient, NonNegativeInt64, Number, PositiveInt64, require_object_schema, validate


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(Lenient):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[ResultPart], None] = None
    is_error: bool = False


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Lenient):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
    Field(discriminator="type"),
]


class InputMessage(Lenient):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(Lenient):
    type: str | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: NonNegativeInt64 | None = None


class OutputConfig(Lenient):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(Lenient):
    model: str | None = None
    max_tokens: PositiveInt64
    system: Union[str, list[TextBlock], None] = None
    messages: list[InputMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    stream: bool = False


def _blocks_to_parts(blocks, path: str | None = None) -> list:
    """`blocks`: (index, block) pairs of the list at `path` (messages[1].content), so that an
    image part knows where it sits in the request."""
    parts = []
    for index, block in blocks:
        if isinstance(block, TextBlock):
            parts.append(TextPart(block.text))
        elif isinstance(block, ImageBlock):
            where = f"{path}[{index}]" if path else None
            parts.append(ImagePart(_image_url(block.source, where), path=where))
    return parts


def _image_url(source: dict, where: str | None) -> str:
    """An image block's source as one URL: base64 data as a data: URL, a url source as itself."""
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise RequestError("a base64 image source needs media_type and data strings",
                               f"{where}.source" if where else None)
        return f"data:{media_type};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise RequestError(f"image source type must be base64 or url, got {kind!r}", f"{where}.source" if where else None)


def _messages(request: MessagesRequest) -> list[Message]:
    messages: list[Message] = []
    if isinstance(request.system, str):  # even "": DeepSeek-V4.1 opens a <｜System｜> block for it
        messages.append(Message("system", [TextPart(request.system)]))
    elif isinstance(request.system, list) and request.system:
        messages.append(Message("system", [TextPart(b.text) for b in request.system]))
    for number, turn in enumerate(request.messages):
        blocks = [TextBlock(type="text", text=turn.content)] if isinstance(turn.content, str) else turn.content
        path = f"messages[{number}].content"
        if turn.role == "user":
            for index, block in enumerate(blocks):
                if isinstance(block, ToolResultBlock):
                    content = block.content
                    parts = ([TextPart(content)] if isinstance(content, str)
                             else _blocks_to_parts(enumerate(content or []), f"{path}[{index}].content"))
                    messages.append(Message("tool", parts, tool_call_id=block.tool_use_id))
            rest = _blocks_to_parts(((i, b) for i, b in enumerate(blocks) if not isinstance(b, ToolResultBlock)), path)
            if rest or not any(isinstance(b, ToolResultBlock) for b in blocks):
                messages.append(Message("user", rest))
            continue
        reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock)) or None
        calls = [
            ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        messages.append(Message("assistant", _blocks_to_parts(enumerate(blocks), path), reasoning, calls))
    return messages


def to_conversation(body: dict) -> Conversation:
    request = validate(MessagesRequest, body)
    tools = []
    for index, tool in enumerate(request.tools or []):
        if tool.type not in (None, "custom"):
            continue  # hosted server tools (web_search_..., bash_...) are not ours to run
        where = f"tools[{index}].input_schema"
        require_object_schema(tool.input_schema, where)
        tools.append(ToolDefinition(tool.name, tool.description, tool.input_schema, schema_path=where))
    choice: Any = "auto"
    if request.tool_choice is not None:
        kind = request.tool_choice.type
        if kind == "tool":
            if not request.tool_choice.name:
                raise RequestError("tool_choice of type tool needs a name", "tool_choice.name")
            choice = NamedToolChoice(request.tool_choice.name)
        else:
            choice = {"any": "required"}.get(kind, kind)
    parallel = not (request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use)
    thinking = None
    if request.thinking is not None:
        thinking = request.thinking.type != "disabled"
    return Conversation(
        messages=_messages(request),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        thinking=thinking,
        reasoning_effort=request.output_config.effort if request.output_config else None,
        stop=list(request.stop_sequences or []),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        model=request.model,
        protocol="messages",
    )
