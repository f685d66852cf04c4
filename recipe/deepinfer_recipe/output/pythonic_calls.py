"""Pythonic tool calls (vLLM's `pythonic`: Llama 3.2, ToolACE) → tool-call events.

The output starts with a Python list of calls with keyword arguments:
`[get_weather(city="Paris", days=2), get_time()]`. The list is read with `ast` (never run):
each element must be a call of a plain name with keyword arguments whose values are literals
(strings, numbers, True/False/None, lists, tuples, dicts with literal keys); anything else,
or a list that never closes, is text (`leftover`). The calls are sent when the list closes
(it must be whole to be known to be calls); text after it is content again (`rest`).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable

from .parser_events import Event, ToolCallDelta, ToolCallEnd, ToolCallStart

# What the start of a call list looks like, and what can still become one.
_OPENING = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_OPENING_SO_FAR = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?$")
_NAME_MAX = 512  # no function name is this long
_MAX_CHARS = 1 << 20  # a call list is never this long: give up holding it back


class _NotACall(Exception):
    pass


class PythonicCallBlock:
    def __init__(self, index_base: int, call_id: Callable[[int], str], start_text: str = ""):
        self._index = index_base
        self._call_id = call_id
        self._buf = start_text  # the opening `[` is part of the list
        self._scan = _BracketScan()
        self._scanned = 0  # characters of _buf the scanner has seen
        self._opened = False  # _buf starts like a call list
        self.leftover: str | None = None
        self.done = False

    def push(self, text: str) -> tuple[list[Event], str | None]:
        """Feed body text. Returns events and, once the list closed, the text after it."""
        self._buf += text
        if not self._opened:
            self._opened = _OPENING.match(self._buf) is not None
        if not self._opened:
            if len(self._buf) < _NAME_MAX and _OPENING_SO_FAR.match(self._buf):
                return [], None
            return self._text(), ""
        end = self._scan.feed(self._buf[self._scanned:])
        if end is None:
            self._scanned = len(self._buf)
            return ([], None) if len(self._buf) < _MAX_CHARS else (self._text(), "")
        end += self._scanned
        try:
            calls = _calls(self._buf[:end])
        except _NotACall:
            return self._text(), ""
        self.done = True
        events: list[Event] = []
        for name, arguments in calls:
            events += [ToolCallStart(self._index, self._call_id(self._index), name),
                       ToolCallDelta(self._index, arguments), ToolCallEnd(self._index, arguments)]
            self._index += 1
        return events, self._buf[end:]

    def close(self, end_seen: bool) -> list[Event]:
        """The output ended before the list closed: it is text."""
        return self._text()

    def _text(self) -> list[Event]:
        self.done = True
        self.leftover = self._buf
        return []


class _BracketScan:
    """Finds the `]` closing the list, skipping brackets inside Python string literals."""

    def __init__(self):
        self._depth = 0
        self._quote: str | None = None
        self._escape = False

    def feed(self, text: str) -> int | None:
        for at, char in enumerate(text):
            if self._quote is not None:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == self._quote:
                    self._quote = None
            elif char in "'\"":
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth <= 0:
                    return at + 1
        return None


def _calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in the list `text`; _NotACall if it is not one."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _NotACall from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise _NotACall
    calls = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise _NotACall
        arguments = {}
        for keyword in call.keywords:
            if keyword.arg is None:  # **kwargs
                raise _NotACall
            arguments[keyword.arg] = _literal(keyword.value)
        try:
            calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, RecursionError):
            raise _NotACall from None
    return calls


def _literal(node: ast.expr):
    """The value of a literal expression; _NotACall for anything else (names, calls, operators)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, (str, int, float, bool)) for k in node.keys):
            raise _NotACall
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise _NotACall
