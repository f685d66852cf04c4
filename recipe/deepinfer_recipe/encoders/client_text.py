"""Which characters of a chat-template render the template wrote, and which the client sent.

A chat template renders one string; its control tokens have to be found in it afterwards. They
cannot be found by looking for the client's strings in the render: a tool description that is
exactly "<|im_end|>" equals every real <|im_end|> the template writes, so masking the client's
string would demote the template's own tokens, and not masking it would promote the client's.

So we render again with every client string *hidden*: the characters a client could use to
spell a control token are replaced by private-use placeholders, which no control token contains.
In that render every control-token spelling was written by the template. Replacing the
placeholders by what they stand for gives the text back, now with its control ranges known.

Two ways of hiding, tried in this order (hf_template.py):
  * `HideAll`: every client character becomes a placeholder of its own, one for one, so lengths,
    emptiness and `| length` checks are unchanged. No client character is left that could be
    part of a control token. Usable whenever the template copies client strings as they are
    (most templates), which we check: the render restored must equal the real render.
  * `HideSpellings`: only what could join a control token is hidden: the client's spellings of
    control tokens (in any letter case, against `| lower`), and fragments at the edges of each
    client string that the template's text could complete (a string ending in "<|im_" before a
    template's "end|>"). Everything else stays as sent, so templates that inspect client strings
    (`| trim`, `tojson` escaping, `param.type == "string"`) render them as usual.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import RequestError
from ..prompt import PromptBuilder, RenderedPrompt

# Unicode's private-use code points: no tokenizer's control token contains them, and no
# template filter changes them (they have no case, are not whitespace, JSON leaves them alone).
_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


class ControlSpellings:
    """The spellings of a tokenizer's control tokens (its added tokens), and the searches for them."""

    def __init__(self, spellings: Iterable[str]):
        ordered = sorted({s for s in spellings if s}, key=len, reverse=True)  # longest match first
        alternatives = "|".join(re.escape(s) for s in ordered)
        self.pattern = re.compile(alternatives) if ordered else None
        self._any_case = re.compile(alternatives, re.IGNORECASE) if ordered else None
        self._longest = len(ordered[0]) if ordered else 0
        # Proper beginnings and ends of spellings, case-folded as the searches compare them.
        self._heads = {s[:i].casefold() for s in ordered for i in range(1, len(s))}
        self._tails = {s[i:].casefold() for s in ordered for i in range(1, len(s))}

    def spans_to_hide(self, value: str) -> list[tuple[int, int]]:
        """Where `value` spells a control token (any case), plus its edge fragments."""
        if self._any_case is None:
            return []
        spans = [match.span() for match in self._any_case.finditer(value)]
        # The edges as sent, and inside surrounding whitespace (which `| trim` removes).
        start, end = len(value) - len(value.lstrip()), len(value.rstrip())
        for edge in {len(value), end}:  # ends with the beginning of a spelling
            size = self._edge_size(lambda n, edge=edge: value[edge - n : edge], edge, self._heads)
            if size:
                spans.append((edge - size, edge))
        for edge in {0, start}:  # starts with the end of a spelling
            size = self._edge_size(lambda n, edge=edge: value[edge : edge + n], len(value) - edge,
                                    self._tails)
            if size:
                spans.append((edge, edge + size))
        return spans

    def _edge_size(self, piece, room: int, fragments: set[str]) -> int:
        for size in range(min(self._longest - 1, room), 0, -1):
            if piece(size).casefold() in fragments:
                return size
        return 0


class _Placeholders:
    """Hands out private-use characters that occur nowhere else, each standing for a text."""

    def __init__(self, taken: set[str]):
        self._free = (chr(code) for block in _PRIVATE_USE for code in block if chr(code) not in taken)
        self._meaning: dict[int, str] = {}  # ord(placeholder) -> the text it stands for

    def new(self, text: str) -> str:
        placeholder = next(self._free, None)
        if placeholder is None:  # the client used nearly all 137,000 private-use characters
            raise RequestError("the conversation uses too many distinct private-use characters to render safely")
        self._meaning[ord(placeholder)] = text
        return placeholder

    def restore(self, text: str) -> str:
        return text.translate(self._meaning)


class HideAll:
    """Every client character becomes its own placeholder (same length, nothing spellable left)."""

    def __init__(self, client_chars: set[str], taken: set[str]):
        self._placeholders = _Placeholders(taken)
        self._table = {ord(c): self._placeholders.new(c) for c in sorted(client_chars)}

    def hide(self, value: str) -> str:
        return value.translate(self._table)

    def restore(self, text: str) -> str:
        return self._placeholders.restore(text)


class HideSpellings:
    """Only spellings of control tokens and edge fragments become placeholders."""

    def __init__(self, spellings: ControlSpellings, taken: set[str]):
        self._spellings = spellings
        self._placeholders = _Placeholders(taken)
        self._known: dict[str, str] = {}  # hidden text -> its placeholder (one per distinct text)

    def hide(self, value: str) -> str:
        pieces, cursor = [], 0
        for start, end in _merged(self._spellings.spans_to_hide(value)):
            pieces.append(value[cursor:start])
            text = value[start:end]
            if text not in self._known:
                self._known[text] = self._placeholders.new(text)
            pieces.append(self._known[text])
            cursor = end
        pieces.append(value[cursor:])
        return "".join(pieces)

    def restore(self, text: str) -> str:
        return self._placeholders.restore(text)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def mark_controls(hidden_render: str, restore, pattern: re.Pattern | None) -> RenderedPrompt:
    """The restored text of a render made with hidden client strings, its control tokens marked.

    A placeholder is no character of any spelling, so a control token found here lies wholly in
    text the template wrote; everything between them is restored and stays plain."""
    builder, cursor = PromptBuilder(), 0
    for match in pattern.finditer(hidden_render) if pattern is not None else ():
        builder.text(restore(hidden_render[cursor : match.start()]))
        builder.control(match.group())
        cursor = match.end()
    builder.text(restore(hidden_render[cursor:]))
    return builder.build()
