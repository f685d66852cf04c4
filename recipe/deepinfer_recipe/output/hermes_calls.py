"""One Hermes/Qwen-style tool-call block (`<tool_call>` BODY `</tool_call>`) → tool-call events.

BODY is `{"name": NAME, "arguments": {...}}` (what the forced-call constraint produces), or a
JSON list of such objects (SmolLM2's training format); `parameters` is accepted for `arguments`.
When BODY opens with the name and then the arguments object, the arguments are streamed as
they arrive (holding back only a possible closing `}` and tag); any other shape is parsed when
the block closes. A block that does not parse as a call is given back as text (`leftover`).

The parser hands the block text that follows the opening tag. If the closing tag is a token,
the parser calls `close()` on its id; if it is plain text (`end_text`), the block finds it and
returns the text after it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from .parser_events import Event, ToolCallDelta, ToolCallEnd, ToolCallStart

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\\n]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_CLOSING = re.compile(r"\s*\}?\s*$")


class HermesCallBlock:
    def __init__(self, index_base: int, call_id: Callable[[int], str], start_text: str, end_spelling: str,
                 end_is_token: bool):
        self._index = index_base
        self._call_id = call_id
        self._start_text, self._end_spelling = start_text, end_spelling  # the tags, for `leftover`
        self._end_text = None if end_is_token else end_spelling  # None: the parser sees the closing id
        self._buf = ""
        self._args_at: int | None = None  # offset in _buf of the streamed arguments object
        self._sent = 0  # characters of the arguments already sent
        self.leftover: str | None = None  # set when the block is not a tool call
        self.done = False

    def push(self, text: str) -> tuple[list[Event], str | None]:
        """Feed body text. Returns events and, once the closing text tag was seen, what follows it."""
        if self._end_text is not None:
            combined = self._buf + text
            at = combined.find(self._end_text)
            if at >= 0:
                self._buf = combined[:at]
                return self._finish(closed=True), combined[at + len(self._end_text):]
            self._buf = combined
        else:
            self._buf += text
        return self._stream(), None

    def close(self, end_seen: bool) -> list[Event]:
        """The closing token was seen (`end_seen`), or the output ended inside the block."""
        return self._finish(closed=end_seen)

    # -- internals -------------------------------------------------------------------------------
    def _stream(self) -> list[Event]:
        events: list[Event] = []
        if self._args_at is None:
            match = _HEAD.match(self._buf)
            if match is None:
                return events
            self._args_at = match.end()
            events.append(ToolCallStart(self._index, self._call_id(self._index), json.loads(match.group(1))))
        body = self._buf[self._args_at:]
        if self._end_text is not None:
            body = body[: len(body) - _partial_suffix(body, self._end_text)]
        ready = max(len(body) - len(_CLOSING.search(body).group()), self._sent)
        if ready > self._sent:
            events.append(ToolCallDelta(self._index, body[self._sent:ready]))
            self._sent = ready
        return events

    def _finish(self, closed: bool) -> list[Event]:
        self.done = True
        events = self._stream()
        if self._args_at is not None:
            return events + self._end_streamed()
        try:
            value = json.loads(self._buf)
        except ValueError:
            value = None
        calls = value if isinstance(value, list) else [value]
        if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            self.leftover = self._start_text + self._buf + (self._end_spelling if closed else "")
            return events
        for call in calls:
            arguments = call.get("arguments", call.get("parameters", {}))
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            events += [ToolCallStart(self._index, self._call_id(self._index), call["name"]),
                       ToolCallDelta(self._index, text), ToolCallEnd(self._index, text)]
            self._index += 1
        return events

    def _end_streamed(self) -> list[Event]:
        """Close the streamed call: its arguments are the object before the body's final `}`."""
        text = self._buf
        if self._end_text is not None:  # output cut inside the closing tag
            text = text[: len(text) - _partial_suffix(text, self._end_text)]
        body = text[self._args_at:].rstrip()
        arguments = body[:-1].rstrip() if body.endswith("}") else body
        try:
            json.loads(text)
            complete = True
        except ValueError:
            complete = False  # cut short (max tokens): send what there is
        if not complete or not arguments.startswith(body[: self._sent]) or len(arguments) < self._sent:
            arguments = body
        events: list[Event] = []
        if len(arguments) > self._sent:
            events.append(ToolCallDelta(self._index, arguments[self._sent:]))
        self._index += 1
        return events + [ToolCallEnd(self._index - 1, arguments)]


def _partial_suffix(text: str, target: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `target`."""
    for size in range(min(len(target) - 1, len(text)), 0, -1):
        if text.endswith(target[:size]):
            return size
    return 0
