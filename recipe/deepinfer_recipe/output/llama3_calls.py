"""Llama 3.x JSON tool calls (vLLM's `llama3_json`) → tool-call events.

The model calls tools with one or more JSON objects `{"name": NAME, "parameters": {...}}`
(`arguments` also accepted), separated by `;`, optionally after the `<|python_tag|>` token.
A block opens at that tag anywhere in the content, or at a `{` that starts the output (the
parser decides which, call_formats.py). Calls stream as json_calls.py reads them. There is no
closing tag: the block runs to the end of the output; text after the last call that is not
another call is content again (returned as `rest`). If the first object is not a call, the
whole block is given back as text (`leftover`).
"""

from __future__ import annotations

from collections.abc import Callable

from .json_calls import JsonCallObject
from .parser_events import Event


class Llama3CallBlock:
    def __init__(self, index_base: int, call_id: Callable[[int], str], start_text: str):
        self._index = index_base
        self._call_id = call_id
        self._start_text = start_text  # the tag, for `leftover` ("" when the block opened at `{`)
        self._seen = ""  # all body text, for `leftover`
        self._buf = ""  # text not yet handed to a call object
        self._call: JsonCallObject | None = None
        self._call_text = ""  # what the open call object was given
        self._calls = 0
        self._want_object = True  # at the start, and after a `;`
        self.leftover: str | None = None
        self.done = False

    def push(self, text: str) -> tuple[list[Event], str | None]:
        """Feed body text. Returns events and, once the calls are over, the text after them."""
        self._seen += text
        self._buf += text
        events: list[Event] = []
        while self._buf:
            if self._call is not None:
                pushed, self._buf = self._buf, ""
                events += self._call.push(pushed)
                self._call_text += pushed
                if self._call.end is None:
                    return events, None
                call, text_of_call = self._call, self._call_text
                self._buf, self._call = text_of_call[call.end:], None
                if call.failed:  # not a call: it and everything after it are text
                    return events + self._end(), (text_of_call + self._buf) if self._calls else ""
                self._calls += 1
                self._index += 1
                continue
            stripped = self._buf.lstrip()
            if not stripped:
                return events, None
            if stripped[0] == "{" and self._want_object:
                self._call, self._call_text, self._buf = JsonCallObject(self._index, self._call_id), "", stripped
                self._want_object = False
            elif stripped[0] == ";" and self._calls and not self._want_object:
                self._buf, self._want_object = stripped[1:], True
            else:  # ordinary text: after calls it is content again; before any, the block was not one
                rest = self._buf if self._calls else ""
                return events + self._end(), rest
        return events, None

    def close(self, end_seen: bool) -> list[Event]:
        """The output ended inside the block."""
        events: list[Event] = []
        if self._call is not None:
            events = self._call.cut()
            if not self._call.failed:
                self._calls += 1
            elif self._calls:  # the unfinished object after the calls is text
                self.leftover = self._call_text
        events += self._end()
        return events

    def _end(self) -> list[Event]:
        """Done; with no call read, the whole block is text."""
        self.done = True
        if not self._calls:
            self.leftover = self._start_text + self._seen
        return []
