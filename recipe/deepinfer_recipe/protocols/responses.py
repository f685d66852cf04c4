"""OpenAI Responses request → Conversation (research E.1).

Output items of earlier turns (reasoning, assistant message, function_call) that follow each
other are one assistant turn; `function_call_output` items are tool results. A `reasoning` item
contributes its `content` (reasoning_text), not its `summary`: a summary is not what the model
thought, and deepseek-recipe renders it as empty reasoning too. Hosted tools (web_search, ...)
are dropped: this server runs only client functions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Strict, Tag

from ..conversation import (
    Conversation,
    ImagePart,
    Message,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCall,
    ToolDefinition,
)
from ..errors import RequestError
from ._common import (
    Lenient,
    NonNegativeInt64,
    Number,
    PositiveInt64,
    normalize_strict_schema,
    require_object_schema,
    validate,
)

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class InputText(Lenient):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(Lenient):
    type: Literal["refusal"]
    refusal: str


class InputImage(Lenient):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


Part = Annotated[Union[InputText, Refusal, InputImage], Field(discriminator="type")]


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Part]]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[Part]]


class ReasoningText(Lenient):
    type: str = "reasoning_text"
    text: str


class ReasoningItem(Lenient):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText] | None = None


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


Item = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(_item_kind),
]


class FunctionTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Lenient):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # echoed; we write no summaries


class ResponsesRequest(Lenient):
    model: str | None = None
    input: Union[str, list[Item]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedChoice, None] = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: PositiveInt64 | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    stream: bool = False
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    # Only repeated back in the response object (see `_echo`).
    top_logprobs: NonNegativeInt64 | None = None  # the server bounds it (its max_logprobs)
    truncation: Literal["disabled"] | None = None  # nothing is ever truncated to fit
    metadata: dict[str, Annotated[str, Strict()]] | None = None
    user: str | None = None
    store: bool | None = None


def _parts(content, path: str | None = None) -> list:
    """`path`: where `content` sits in the request (input[2].content), for image parts."""
    if isinstance(content, str):
        return [TextPart(content)]
    parts = []
    for index, item in enumerate(content):
        if isinstance(item, InputText):
            parts.append(TextPart(item.text))
        elif isinstance(item, Refusal):
            parts.append(TextPart(item.refusal))
        else:
            parts.append(ImagePart(item.image_url, item.detail, f"{path}[{index}]" if path else None))
    return parts


def _messages(request: ResponsesRequest) -> list[Message]:
    messages: list[Message] = []
    if request.instructions:
        messages.append(Message("system", [TextPart(request.instructions)]))
    items = [MessageItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    open_turn: Message | None = None  # the assistant turn that output items are gathered into

    def assistant_turn(starts_new: bool) -> Message:
        nonlocal open_turn
        if open_turn is None or starts_new:
            open_turn = Message("assistant", [])
            messages.append(open_turn)
        return open_turn

    for number, item in enumerate(items):
        where = f"input[{number}]" if isinstance(request.input, list) else "input"
        if isinstance(item, MessageItem) and item.role == "assistant":
            turn = assistant_turn(starts_new=open_turn is not None and bool(open_turn.tool_calls or open_turn.content))
            turn.content.extend(_parts(item.content, f"{where}.content"))
        elif isinstance(item, ReasoningItem):
            text = "".join(part.text for part in item.content or [])
            if not text:
                continue  # only a summary (or nothing): no reasoning to render, no turn (as deepseek-recipe)
            turn = assistant_turn(starts_new=open_turn is not None and bool(open_turn.tool_calls or open_turn.content))
            turn.reasoning = (turn.reasoning or "") + text
        elif isinstance(item, FunctionCallItem):
            assistant_turn(starts_new=False).tool_calls.append(ToolCall(item.call_id, item.name, item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            open_turn = None
            messages.append(Message("tool", _parts(item.output, f"{where}.output"), tool_call_id=item.call_id))
        else:
            open_turn = None
            messages.append(Message(item.role, _parts(item.content, f"{where}.content")))
    return messages


def _says_something(message: Message) -> bool:
    """Text, an image, reasoning, a tool call or a tool result (even an empty one)."""
    return bool(message.role == "tool" or message.tool_calls or message.reasoning
                or any(isinstance(part, ImagePart) or part.text for part in message.content))


def to_conversation(body: dict) -> Conversation:
    request = validate(ResponsesRequest, body)
    if request.previous_response_id:
        raise RequestError("previous_response_id is not supported: send the full input", "previous_response_id")
    tools = []
    for index, tool in enumerate(request.tools or []):
        if tool.type != "function":
            continue  # hosted tools are not ours to run
        if not tool.name:
            raise RequestError("a function tool needs a name", f"tools[{index}].name")
        where = f"tools[{index}].parameters"
        require_object_schema(tool.parameters, where)
        params = normalize_strict_schema(tool.parameters) if tool.strict and tool.parameters else tool.parameters
        tools.append(ToolDefinition(tool.name, tool.description, params, tool.strict, where))
    choice = request.tool_choice or "auto"
    if isinstance(choice, NamedChoice):
        choice = NamedToolChoice(choice.name)
    fmt = ResponseFormat()
    if request.text and request.text.format:
        f = request.text.format
        fmt = ResponseFormat(f.type, f.schema_, f.name, f.strict)
    messages = _messages(request)
    if not any(_says_something(m) for m in messages):
        # Nothing to answer: the model would ramble until max_output_tokens (OpenAI refuses too).
        raise RequestError("the input is empty: send at least one item with content, or instructions", "input")
    return Conversation(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        reasoning_effort=request.reasoning.effort if request.reasoning else None,
        response_format=fmt,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        model=request.model,
        protocol="responses",
        echo=_echo(request),
    )


def _echo(request: ResponsesRequest) -> dict:
    """The request's settings as OpenAI's Response object repeats them. Sampling values the
    request left out stay null: the server fills in the model's defaults, which only it knows."""
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
             for t in request.tools or [] if t.type == "function"]  # hosted tools were dropped, not run
    choice = request.tool_choice or "auto"
    if isinstance(choice, NamedChoice):
        choice = {"type": "function", "name": choice.name}
    text: dict = {"format": {"type": "text"}}
    if request.text is not None:
        if request.text.format is not None:
            text["format"] = request.text.format.model_dump(by_alias=True, exclude_none=True)
        if request.text.verbosity is not None:
            text["verbosity"] = request.text.verbosity
    reasoning = request.reasoning
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,  # refused above: every request carries its whole input
        "reasoning": {"effort": reasoning.effort if reasoning else None, "summary": reasoning.summary if reasoning else None},
        "service_tier": "default",  # there is one tier
        "store": False,  # nothing is stored, whatever the request asked
        "temperature": request.temperature,
        "text": text,
        "tool_choice": choice,
        "tools": tools,
        "top_logprobs": request.top_logprobs,
        "top_p": request.top_p,
        "truncation": "disabled",
        "user": request.user,
        "metadata": request.metadata or {},
    }
