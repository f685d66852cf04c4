"""What every encoder returns, and what it tells the output parser."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import PromptTooLong
from ..images import ImagePrompt, count_images, expand_images
from ..prompt import RenderedPrompt
from ..tokenize import SafeTokenizer


@dataclass(frozen=True)
class OutputMarkers:
    """Control tokens the output parser acts on, by spelling. A marker counts only when the model
    emitted its id; the same characters spelled by ordinary tokens are text."""

    end_of_turn: tuple[str, ...] = ()  # generation ends here (EOS)
    think_start: str | None = None
    think_end: str | None = None
    dsml: str | None = None  # DeepSeek tool-call markup token
    dsml_calls: str = "tool_calls"  # tag names after the DSML token
    dsml_invoke: str = "invoke"
    dsml_parameter: str = "parameter"
    tool_call_start: str | None = None  # Hermes-style call tags (HF templates)
    tool_call_end: str | None = None


@dataclass(frozen=True)
class ParserStart:
    """Where the model's output begins, as decided by how the prompt ended."""

    stage: Literal["reasoning", "content", "tool_calls"] = "content"
    continuation: bool = False  # continuing a prefix turn: keep leading newlines
    parse_tool_calls: bool = False


@dataclass
class PromptEncoding:
    format: str
    rendered: RenderedPrompt
    parser_start: ParserStart
    token_ids: list[int] | None = None  # None when the format's tokenizer is unavailable
    stop: list[str] = field(default_factory=list)
    # For a forced tool call: an xgrammar structural tag (JSON) describing the only text the
    # model may emit (see tools/constraint.py); None when the output is unconstrained.
    constraint: dict | None = None
    echo: dict = field(default_factory=dict)  # Conversation.echo, for the final response object
    # Each tool's parameters schema by name, for output parsers that type values by it (qwen3_coder).
    tool_schemas: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        data = {"format": self.format, "token_ids": self.token_ids, "constraint": self.constraint}
        data.update(self.rendered.to_json())
        data["parser_start"] = {
            "stage": self.parser_start.stage,
            "continuation": self.parser_start.continuation,
            "parse_tool_calls": self.parser_start.parse_tool_calls,
        }
        return data


class Encoder:
    """Base: subclasses implement `render`; encoding is shared and always injection-safe."""

    name: str = ""
    tokenizer: SafeTokenizer | None = None
    markers: OutputMarkers = OutputMarkers()
    # How this model's prompt holds an image (images.py); None: the format places no images.
    image_prompt: ImagePrompt | None = None

    def render(self, conversation) -> tuple[RenderedPrompt, ParserStart]:  # pragma: no cover
        raise NotImplementedError

    def tool_constraint(self, conversation) -> dict | None:
        """The structural tag a forced tool choice imposes on the output (None: unconstrained)."""
        return None

    def encode(self, conversation, parallel: bool = True, max_chars: int | None = None) -> PromptEncoding:
        """max_chars: refuse (PromptTooLong) a render longer than this before tokenizing it: the
        caller's bound on what can fit its context (a context of N tokens holds at most N times
        the longest token's characters)."""
        rendered, start = self.render(conversation)
        if max_chars is not None and len(rendered.text) > max_chars:
            raise PromptTooLong(len(rendered.text), max_chars)
        # A model that reads images: each marker becomes its image's text (after the size check:
        # an image's tokens count against the context, not its characters). Without an
        # image_prompt a format renders images its own way (DeepSeek-V4: placeholder text).
        if self.image_prompt is not None and count_images(conversation):
            rendered = expand_images(rendered, self.image_prompt, count_images(conversation), self.name)
        constraint = self.tool_constraint(conversation)
        ids = self.tokenizer.encode_prompt(rendered, parallel) if self.tokenizer else None
        schemas = {t.name: t.parameters or {} for t in conversation.tools}
        return PromptEncoding(self.name, rendered, start, ids, list(conversation.stop), constraint, dict(conversation.echo),
                              schemas)
