"""Mistral tool calls (vLLM's `mistral`) → tool-call events.

After the `[TOOL_CALLS]` marker the model writes either a JSON array of call objects
(`[{"name": NAME, "arguments": {...}}, ...]`, older tokenizers), or, with newer tokenizers, the
name and then the arguments object: `NAME[ARGS]{...}` (`[ARGS]` absent in some versions; a
`[CALL_ID]ID` between them is skipped), each further call behind another `[TOOL_CALLS]`.
Array items stream as json_calls.py reads them; in the name form the call starts when its
arguments open. There is no closing tag: text after the calls is content again (`rest`). If
nothing after the marker reads as a call, the block is given back as text (`leftover`).
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Callable

from .json_calls import JsonCallObject, JsonEnd
from .parser_events import Event, ToolCallDelta, ToolCallEnd, ToolCallStart

MARKER = "[TOOL_CALLS]"
_NAME = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*(?=\{)")
_ALPHANUMERIC = string.ascii_letters + string.digits


def _could_be_name(text: str) -> bool:
    """Whether more text could still make `text` a name form's head (`NAME[CALL_ID]ID[ARGS]`)."""
    rest = text[re.match(r"[A-Za-z0-9_.\-]*", text).end():]
    if rest.startswith("[CALL_ID]"):
        rest = rest[re.match(r"\[CALL_ID\][A-Za-z0-9]*", rest).end():]
    elif "[CALL_ID]".startswith(rest) and rest:
        return True
    if rest.startswith("[ARGS]"):
        rest = rest[len("[ARGS]"):]
    elif "[ARGS]".startswith(rest) and rest:
        return True
    return not rest.strip()


def mistral_call_id(index: int) -> str:
    """Mistral's chat templates accept only call ids of 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralCallBlock:
    def __init__(self, index_base: int, call_id: Callable[[int], str], start_text: str):
        self._index = index_base
        self._call_id = call_id
        self._start_text = start_text
        self._seen = ""
        self._buf = ""
        self._state = "start"  # start | array | item | name | args | after
        self._item: JsonCallObject | None = None
        self._item_text = ""
        self._args = JsonEnd()
        self._args_text = ""
        self._calls = 0
        self.leftover: str | None = None
        self.done = False

    def push(self, text: str) -> tuple[list[Event], str | None]:
        """Feed body text. Returns events and, once the calls are over, the text after them."""
        self._seen += text
        self._buf += text
        events: list[Event] = []
        while self._buf and not self.done:
            new, rest, waiting = self._step()
            events += new
            if rest is not None:
                return events, rest
            if waiting:
                break
        return events, None

    def close(self, end_seen: bool) -> list[Event]:
        """The output ended inside the block: an open call ends with what there is."""
        events: list[Event] = []
        if self._state == "item" and self._item is not None:
            events = self._item.cut()
            self._calls += not self._item.failed
        elif self._state == "args":
            events = [ToolCallEnd(self._index, self._args_text)]
            self._calls += 1
        return events + self._end()

    # -- internals -------------------------------------------------------------------------------
    def _step(self) -> tuple[list[Event], str | None, bool]:
        """One move; returns (events, rest once the block ends, whether it needs more text)."""
        state, buf = self._state, self._buf
        if state in ("start", "array", "after"):
            stripped = buf.lstrip()
            if not stripped:
                return [], None, True
            if state == "start":
                if stripped[0] == "[":
                    self._state, self._buf = "array", stripped[1:]
                else:
                    self._state, self._buf = "name", stripped
                return [], None, False
            if state == "after" and stripped.startswith(MARKER):
                self._state, self._buf = "name", stripped[len(MARKER):].lstrip()
                return [], None, False
            if state == "after" and MARKER.startswith(stripped):
                return [], None, True
            if state == "array" and stripped[0] == "{":
                self._state, self._buf = "item", stripped
                self._item, self._item_text = JsonCallObject(self._index, self._call_id), ""
                return [], None, False
            if state == "array" and stripped[0] in ",]" and self._calls:
                self._buf = stripped[1:]
                if stripped[0] == "]":
                    self._state = "after"
                return [], None, False
            return self._end(), self._rest(), False
        if state == "item":
            pushed, self._buf = buf, ""
            events = self._item.push(pushed)
            self._item_text += pushed
            if self._item.end is None:
                return events, None, True
            if self._item.failed:
                return events + self._end(), self._rest(self._item_text), False
            self._buf = self._item_text[self._item.end:]
            self._calls += 1
            self._index += 1
            self._state = "array"
            return events, None, False
        if state == "name":
            match = _NAME.match(buf)
            if match is None:
                if len(buf) < 512 and _could_be_name(buf):  # no name is longer
                    return [], None, True
                return self._end(), self._rest(), False
            self._buf = buf[match.end():]
            self._state, self._args, self._args_text = "args", JsonEnd(), ""
            return [ToolCallStart(self._index, self._call_id(self._index), match.group(1))], None, False
        # args: stream the object up to its closing brace
        found = self._args.feed(buf)
        piece = buf if found is None else buf[:found]
        self._args_text += piece
        self._buf = "" if found is None else buf[found:]
        events = [ToolCallDelta(self._index, piece)] if piece else []
        if found is None:
            return events, None, True
        events.append(ToolCallEnd(self._index, self._args_text))
        self._calls += 1
        self._index += 1
        self._state = "after"
        return events, None, False

    def _rest(self, prefix: str = "") -> str:
        """Text after the calls: content again (all of the block is, if there was no call)."""
        if not self._calls:
            return ""
        rest, self._buf = prefix + self._buf, ""
        return rest

    def _end(self) -> list[Event]:
        self.done = True
        if not self._calls:
            self.leftover = self._start_text + self._seen
        return []
