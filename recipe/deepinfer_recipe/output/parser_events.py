"""What the output parser reports: reasoning and content text, tool-call pieces, the finish."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

FinishReason = Literal["stop", "length", "tool_calls", "stop_sequence"]


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallDelta:
    index: int
    arguments: str  # a piece of the JSON arguments text


@dataclass
class ToolCallEnd:
    index: int
    arguments: str  # the whole JSON arguments text
    cut: bool = False  # closed because max tokens stopped the output inside the call


@dataclass
class Finished:
    reason: FinishReason
    stop_sequence: str | None = None


Event = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallDelta, ToolCallEnd, Finished]
