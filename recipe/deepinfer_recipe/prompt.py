"""A rendered prompt: text plus the exact character ranges that are control tokens.

This is the hinge of injection safety. An encoder never hands the tokenizer one string to
"find" control tokens in; it says, range by range, which characters are a control token that
the template itself emitted. Every other character is plain text, and plain text is encoded
without the added vocabulary (see tokenize.py), so text that merely spells a control token
stays text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RenderedPrompt:
    text: str
    # Ascending, disjoint, half-open (start, end) code-point offsets into `text`;
    # text[start:end] is the spelling of exactly one control token.
    control_ranges: list[tuple[int, int]] = field(default_factory=list)

    def segments(self) -> list[tuple[bool, str]]:
        """(is_control, text) pieces in order; plain pieces may be empty-free."""
        pieces: list[tuple[bool, str]] = []
        cursor = 0
        for start, end in self.control_ranges:
            if start > cursor:
                pieces.append((False, self.text[cursor:start]))
            pieces.append((True, self.text[start:end]))
            cursor = end
        if cursor < len(self.text):
            pieces.append((False, self.text[cursor:]))
        return pieces

    def to_json(self) -> dict:
        return {"prompt": self.text, "control_ranges": [list(r) for r in self.control_ranges]}


class PromptBuilder:
    """Appends plain text and control tokens, recording where each control token lies."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._length = 0
        self._ranges: list[tuple[int, int]] = []

    def text(self, value: str) -> PromptBuilder:
        if value:
            self._parts.append(value)
            self._length += len(value)
        return self

    def control(self, spelling: str) -> PromptBuilder:
        start = self._length
        self._parts.append(spelling)
        self._length += len(spelling)
        self._ranges.append((start, self._length))
        return self

    def build(self) -> RenderedPrompt:
        return RenderedPrompt("".join(self._parts), list(self._ranges))
