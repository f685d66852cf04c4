"""One JSON tool-call object (`{"name": NAME, "arguments": {...}}`) read as it arrives, for the
formats that write calls as bare JSON objects (llama3_calls.py, mistral_calls.py).

When the object opens with the name (optionally after `"type": "function"`) and then the
arguments object, the arguments are streamed as they arrive; any other key order is parsed
once the object closes. `parameters` is accepted for `arguments` (Llama writes either).
The end of the object and of its arguments are found by a scanner that tracks strings and
nesting, so a `}` inside a string never ends anything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from .parser_events import Event, ToolCallDelta, ToolCallEnd, ToolCallStart

_STRING = r'"(?:[^"\\\n]|\\.)*"'
_HEAD_MAX = 1024  # a head is never this long: later, the object is parsed whole when it closes
_HEAD = re.compile(rf'\{{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*({_STRING})\s*,\s*'
                   rf'"(?:arguments|parameters)"\s*:\s*(?=\{{)')


class JsonEnd:
    """Finds where a JSON object or array that starts the fed text ends, fed piece by piece."""

    def __init__(self):
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int | None:
        """Offset in `text` just past the value's closing bracket, or None if it is still open."""
        for at, char in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return at + 1
        return None


def call_arguments(value) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a parsed call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" in value and "parameters" in value:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class JsonCallObject:
    """Text from the object's `{` on. `end` is set (an offset into the text pushed so far) once
    the object closed; `failed` once it closed and is not a call."""

    def __init__(self, index: int, call_id: Callable[[int], str]):
        self.index = index
        self._call_id = call_id
        self._buf = ""
        self._object = JsonEnd()
        self._args = JsonEnd()
        self._args_at: int | None = None  # offset of the streamed arguments object
        self._args_end: int | None = None
        self._sent = 0  # characters of the arguments already sent
        self.end: int | None = None
        self.failed = False
        self.started = False

    def push(self, text: str) -> list[Event]:
        if self.end is not None:
            return []
        before = len(self._buf)
        self._buf += text
        closed = self._object.feed(text)
        if closed is not None:
            self.end = before + closed
        events: list[Event] = []
        if not self.started and before < _HEAD_MAX:
            match = _HEAD.match(self._buf)
            if match is not None and (self.end is None or match.end() < self.end):
                self.started = True
                self._args_at = match.end()
                events.append(ToolCallStart(self.index, self._call_id(self.index), json.loads(match.group(1))))
        if self.started:
            return events + self._stream()
        if self.end is not None:
            return self._whole()
        return events

    def cut(self) -> list[Event]:
        """The output ended inside the object: a streamed call ends with what there is."""
        if not self.started or self.end is not None:
            self.failed = self.failed or not self.started
            return []
        args = self._buf[self._args_at:(self._args_at + self._args_end) if self._args_end else None].rstrip()
        events = [ToolCallDelta(self.index, args[self._sent:])] if len(args) > self._sent else []
        self.end = len(self._buf)
        return events + [ToolCallEnd(self.index, args)]

    # -- internals -------------------------------------------------------------------------------
    def _stream(self) -> list[Event]:
        limit = self.end if self.end is not None else len(self._buf)
        if self._args_end is None:
            scanned = self._args_at + self._sent
            found = self._args.feed(self._buf[scanned:limit])
            if found is not None:
                self._args_end = self._sent + found
        ready = self._args_end if self._args_end is not None else limit - self._args_at
        events: list[Event] = []
        if ready > self._sent:
            events.append(ToolCallDelta(self.index, self._buf[self._args_at + self._sent:self._args_at + ready]))
            self._sent = ready
        if self.end is not None:
            events.append(ToolCallEnd(self.index, self._buf[self._args_at:self._args_at + self._sent]))
        return events

    def _whole(self) -> list[Event]:
        try:
            call = call_arguments(json.loads(self._buf[:self.end]))
        except (ValueError, RecursionError):
            call = None
        if call is None:
            self.failed = True
            return []
        name, arguments = call
        self.started = True
        return [ToolCallStart(self.index, self._call_id(self.index), name), ToolCallDelta(self.index, arguments),
                ToolCallEnd(self.index, arguments)]
