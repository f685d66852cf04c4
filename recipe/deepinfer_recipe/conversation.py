"""The one conversation type that every protocol maps to and every encoder renders.

Protocol adapters (protocols/*.py) translate a request into a `Conversation`; encoders
(encoders/*.py) turn a `Conversation` into a prompt. Nothing here knows about any wire format,
so an encoder never needs to care which API the request came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

Role = Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]

# Reasoning effort levels understood by the encoders, weakest first. "none" switches thinking
# off (OpenAI's `reasoning_effort: "none"`); the others keep it on.
EFFORT_LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass
class TextPart:
    text: str


@dataclass
class ImagePart:
    """An image, kept only as a placeholder: fetching and preprocessing are not our job."""

    url: str | None = None
    detail: str | None = None
    path: str | None = None  # where it sits in the request (messages[0].content[1]), for errors


ContentPart = Union[TextPart, ImagePart]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text the model produced (or the client sent back)


@dataclass
class Message:
    role: Role
    content: list[ContentPart] = field(default_factory=list)
    reasoning: str | None = None  # assistant only: the thinking text
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant only
    tool_call_id: str | None = None  # tool only
    prefix: bool = False  # assistant only: continue this turn instead of starting a new one

    @property
    def text(self) -> str:
        """Text parts joined the way DeepSeek's renderer joins them (blank line between)."""
        return "\n\n".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def has_images(self) -> bool:
        return any(isinstance(p, ImagePart) for p in self.content)


@dataclass
class ToolDefinition:
    name: str
    description: str | None = None
    parameters: dict | None = None  # JSON Schema of the arguments object
    strict: bool | None = None
    schema_path: str | None = None  # where `parameters` sits in the request, for error messages


@dataclass
class NamedToolChoice:
    name: str


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice]


@dataclass
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict | None = None
    name: str | None = None
    strict: bool | None = None


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[ToolDefinition] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True  # False: at most one tool call per turn
    # None means "the format's default" (DeepSeek-V4: thinking on, like deepseek-recipe).
    thinking: bool | None = None
    reasoning_effort: str | None = None  # one of EFFORT_LEVELS or None
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    model: str | None = None
    protocol: Literal["chat", "responses", "messages"] = "chat"
    # Request fields the protocol's final object repeats back (the Responses API echoes
    # instructions, tools, sampling settings, ...); the output side copies them in.
    echo: dict = field(default_factory=dict)
    # Extra variables for a Jinja chat template (vLLM's `chat_template_kwargs`); encoders of
    # fixed formats (DeepSeek-V4) have no template and refuse them.
    template_kwargs: dict = field(default_factory=dict)
    # False: the prompt ends with the last message, without the opening of the assistant's
    # turn (vLLM's add_generation_prompt=False, which offline chat() offers).
    add_generation_prompt: bool = True

    def thinking_enabled(self, default: bool) -> bool:
        """Thinking switch: an explicit `thinking` wins; without one, effort "none" turns it off
        (deepseek-recipe: `thinking: enabled` with effort "none" thinks at the default effort)."""
        if self.thinking is not None:
            return self.thinking
        if self.reasoning_effort == "none":
            return False
        return default
