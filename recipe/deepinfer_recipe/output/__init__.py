"""Output side: token ids → reasoning/content/tool calls → protocol stream events."""

from .parser import (
    ContentDelta, Finished, OutputParser, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart,
)
from .session import OutputSession

__all__ = [
    "OutputParser", "OutputSession", "ReasoningDelta", "ContentDelta", "ToolCallStart",
    "ToolCallDelta", "ToolCallEnd", "Finished",
]
