"""Output side: token ids → text (detokenize.py, stop.py) → reasoning/content/tool calls →
protocol stream events."""

from .detokenize import IncrementalDetokenizer
from .parser import (
    ContentDelta,
    Finished,
    OutputParser,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from .session import OutputSession
from .stop import StopChecker

__all__ = [
    "OutputParser", "OutputSession", "ReasoningDelta", "ContentDelta", "ToolCallStart",
    "ToolCallDelta", "ToolCallEnd", "Finished", "IncrementalDetokenizer", "StopChecker",
]
