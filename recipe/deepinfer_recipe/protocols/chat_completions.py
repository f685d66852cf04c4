"""OpenAI Chat Completions request → Conversation (plus DeepSeek's additions, research B.7:
`thinking`, `reasoning_effort`, assistant `reasoning_content` and `prefix`, `latest_reminder`).

OpenAI's older function calling is read too: `functions` and `function_call` are tools and
tool_choice (one call per turn, as that API had), an assistant's `function_call` is its one
tool call, and a `function` message is that call's result."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

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
    Int64,
    Lenient,
    Number,
    PositiveInt64,
    normalize_strict_schema,
    require_object_schema,
    validate,
)

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class TextContent(Lenient):
    type: Literal["text"]
    text: str


class ImageUrl(Lenient):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageContent(Lenient):
    type: Literal["image_url"]
    image_url: ImageUrl


class RefusalContent(Lenient):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[Union[TextContent, ImageContent], Field(discriminator="type")]
AssistantPart = Annotated[Union[TextContent, RefusalContent], Field(discriminator="type")]


class FunctionCall(Lenient):
    name: str
    arguments: str


class ToolCallItem(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Lenient):
    role: Literal["system"]
    content: Union[str, list[TextContent]]


class DeveloperMessage(Lenient):
    role: Literal["developer"]
    content: Union[str, list[TextContent]]


class UserMessage(Lenient):
    role: Literal["user"]
    content: Union[str, list[UserPart]]


class AssistantMessage(Lenient):
    role: Literal["assistant"]
    content: Union[str, list[AssistantPart], None] = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    function_call: FunctionCall | None = None  # the older API's one call
    prefix: bool = False


class ToolMessage(Lenient):
    role: Literal["tool"]
    content: Union[str, list[UserPart]]
    tool_call_id: str


class FunctionMessage(Lenient):
    """The older API's tool result: the output of the function the assistant called."""

    role: Literal["function"]
    name: str
    content: Union[str, None] = None


class LatestReminderMessage(Lenient):
    role: Literal["latest_reminder"]
    content: str


ChatMessage = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage,
          LatestReminderMessage],
    Field(discriminator="role"),
]


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolItem(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoiceItem(Lenient):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(Lenient):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatItem(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class ThinkingSwitch(Lenient):
    type: Literal["enabled", "disabled"]


class ChatCompletionRequest(Lenient):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolItem] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoiceItem, None] = None
    response_format: ResponseFormatItem | None = None
    thinking: ThinkingSwitch | None = None
    reasoning_effort: Effort | None = None
    stop: Union[str, list[str], None] = None
    max_tokens: PositiveInt64 | None = None
    max_completion_tokens: PositiveInt64 | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    seed: Int64 | None = None
    stream: bool = False
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = None
    function_call: Union[Literal["none", "auto"], NamedFunction, None] = None


def _parts(content, path: str | None = None) -> list:
    """`path`: where `content` sits in the request (messages[2].content), for image parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [TextPart(content)]
    parts = []
    for index, item in enumerate(content):
        if isinstance(item, TextContent):
            parts.append(TextPart(item.text))
        elif isinstance(item, RefusalContent):
            parts.append(TextPart(item.refusal))
        else:
            parts.append(ImagePart(item.image_url.url, item.image_url.detail, f"{path}[{index}]" if path else None))
    return parts


def tool_definitions(items, path: str) -> list[ToolDefinition]:
    """`items`: ToolItems at `path` ("tools"), or the older API's FunctionDefinitions ("functions")."""
    tools = []
    for index, item in enumerate(items or []):
        fn = item if isinstance(item, FunctionDefinition) else item.function
        where = f"{path}[{index}].parameters" if fn is item else f"{path}[{index}].function.parameters"
        require_object_schema(fn.parameters, where)
        params = normalize_strict_schema(fn.parameters) if fn.strict and fn.parameters else fn.parameters
        tools.append(ToolDefinition(fn.name, fn.description, params, fn.strict, where))
    return tools


def to_conversation(body: dict) -> Conversation:
    request = validate(ChatCompletionRequest, body)
    messages = []
    last_call_id = None  # the older API pairs a function message with the call before it
    for index, m in enumerate(request.messages):
        if isinstance(m, AssistantMessage):
            calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
            if m.function_call is not None:
                if calls:
                    raise RequestError("give tool_calls or the older function_call, not both", f"messages[{index}].function_call")
                last_call_id = f"call_{index}"
                calls = [ToolCall(last_call_id, m.function_call.name, m.function_call.arguments)]
            # OpenAI (and deepseek-recipe) require content unless the turn calls tools.
            if m.content is None and not calls:
                raise RequestError("an assistant message needs content or tool_calls", f"messages[{index}].content")
            if m.prefix and calls:
                raise RequestError("a prefix (continued) assistant message cannot have tool_calls", f"messages[{index}].prefix")
            messages.append(Message("assistant", _parts(m.content), m.reasoning_content, calls, prefix=m.prefix))
        elif isinstance(m, ToolMessage):
            messages.append(Message("tool", _parts(m.content, f"messages[{index}].content"), tool_call_id=m.tool_call_id))
        elif isinstance(m, FunctionMessage):
            messages.append(Message("tool", _parts(m.content or ""), tool_call_id=last_call_id or f"call_{index}"))
        elif isinstance(m, SystemMessage) and not any(p.text for p in _parts(m.content)):
            continue  # an empty system message says nothing; deepseek-recipe drops it too
        else:
            messages.append(Message(m.role, _parts(m.content, f"messages[{index}].content")))
    tools = tool_definitions(request.tools, "tools")
    choice = request.tool_choice or "auto"
    if isinstance(choice, NamedToolChoiceItem):
        choice = NamedToolChoice(choice.function.name)
    parallel = request.parallel_tool_calls is not False
    if request.functions is not None:
        if request.tools is not None:
            raise RequestError("give tools or the older functions, not both", "functions")
        tools, parallel = tool_definitions(request.functions, "functions"), False
    if request.function_call is not None:
        if request.tool_choice is not None:
            raise RequestError("give tool_choice or the older function_call, not both", "function_call")
        if request.functions is None:
            raise RequestError("function_call needs functions", "function_call")
        named = request.function_call
        choice = NamedToolChoice(named.name) if isinstance(named, NamedFunction) else named
    fmt = ResponseFormat()
    if request.response_format is not None:
        spec = request.response_format.json_schema
        fmt = ResponseFormat(
            request.response_format.type,
            spec.schema_ if spec else None,
            spec.name if spec else None,
            spec.strict if spec else None,
        )
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return Conversation(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        thinking=None if request.thinking is None else request.thinking.type == "enabled",
        reasoning_effort=request.reasoning_effort,
        response_format=fmt,
        stop=stop,
        max_tokens=request.max_completion_tokens or request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stream=request.stream,
        model=request.model,
        protocol="chat",
    )
