"""Qwen3-Coder tool calls (vLLM's `qwen3_coder`) → tool-call events.

Inside `<tool_call>` ... `</tool_call>` (tokens or text, as for Hermes: the parser finds the
tags) the model writes XML-ish calls:

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>

Values are raw text (one newline after the opening tag and one before the closing tag are not
part of it), typed by the offered tool's JSON schema as vLLM does: string types stay text,
integer / number / boolean values are converted when they read as one, object and array values
are parsed as JSON (else as a Python literal, with `ast`), `null` is null; a parameter the schema
does not name stays text. A value ends at `</parameter>` (or, when that is missing, at
`</function>`). Each parameter is sent when its value ends, so the arguments stream per
parameter. A block that does not open with a function is given back as text (`leftover`);
unexpected text after a call ends the call and is text.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable

from .hermes_calls import _partial_suffix
from .parser_events import Event, ToolCallDelta, ToolCallEnd, ToolCallStart

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_FUNCTION_END = re.compile(r"\s*</function>")
_VALUE_ENDS = ("</parameter>", "</function>")
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


class Qwen3CoderCallBlock:
    def __init__(self, index_base: int, call_id: Callable[[int], str], start_text: str, end_spelling: str,
                 end_is_token: bool, tools: dict[str, dict] | None = None):
        self._index = index_base
        self._call_id = call_id
        self._start_text, self._end_spelling = start_text, end_spelling
        self._end_text = None if end_is_token else end_spelling
        self._tools = tools or {}
        self._seen = ""  # the whole body, for `leftover`
        self._hold = ""  # text that may begin the closing tag (when it is text)
        self._buf = ""
        self._state = "functions"  # functions | params | value | junk
        self._calls = 0
        self._properties: dict = {}
        self._param = ""
        self._args = ""
        self._junk = ""  # text after a call that is not markup
        self.leftover: str | None = None
        self.done = False

    def push(self, text: str) -> tuple[list[Event], str | None]:
        """Feed body text. Returns events and, once the closing text tag was seen, what follows it."""
        if self._end_text is not None:
            combined = self._hold + text
            at = combined.find(self._end_text)
            if at >= 0:
                self._seen += combined[:at]
                self._buf += combined[:at]
                return self._finish(closed=True), combined[at + len(self._end_text):]
            keep = _partial_suffix(combined, self._end_text)  # may be the start of the closing tag
            text, self._hold = combined[:len(combined) - keep], combined[len(combined) - keep:]
        self._seen += text
        self._buf += text
        return self._steps(), None

    def close(self, end_seen: bool) -> list[Event]:
        """The closing token was seen (`end_seen`), or the output ended inside the block."""
        return self._finish(closed=end_seen)

    # -- internals -------------------------------------------------------------------------------
    def _steps(self, final: bool = False) -> list[Event]:
        events: list[Event] = []
        while self._buf:
            progressed, new = self._step(final)
            events += new
            if not progressed:
                break
        return events

    def _step(self, final: bool) -> tuple[bool, list[Event]]:
        buf = self._buf
        if self._state == "junk":
            self._junk, self._buf = self._junk + buf, ""
            return False, []
        if self._state == "value":
            ends = [(at, tag) for tag in _VALUE_ENDS if (at := buf.find(tag)) >= 0]
            if not ends and not final:
                return False, []
            at, tag = min(ends) if ends else (len(buf), "")
            self._buf = buf[at + len(tag):] if tag == "</parameter>" else buf[at:]
            self._state = "params"
            return True, self._arg_piece(self._param, buf[:at])
        if self._state == "functions":
            match = _FUNCTION.match(buf)
            if match:
                self._buf, self._state, self._args = buf[match.end():], "params", ""
                name = match.group(1).strip()
                schema = self._tools.get(name) or {}
                props = schema.get("properties") if isinstance(schema, dict) else None
                self._properties = props if isinstance(props, dict) else {}
                return True, [ToolCallStart(self._index, self._call_id(self._index), name)]
        else:  # params
            match = _PARAMETER.match(buf)
            if match:
                self._buf, self._state, self._param = buf[match.end():], "value", match.group(1).strip()
                return True, []
            match = _FUNCTION_END.match(buf)
            if match:
                self._buf, self._state = buf[match.end():], "functions"
                return True, self._end_call()
        if not buf.strip() or (not final and _could_be_tag(buf)):
            return False, []
        # Not markup: the block was not a call, or the text after the calls is text.
        events = self._end_call() if self._state == "params" else []
        self._state, self._junk, self._buf = "junk", buf, ""
        return False, events

    def _arg_piece(self, name: str, raw: str) -> list[Event]:
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = _typed(raw, self._properties.get(name))
        piece = ("{" if not self._args else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        piece += json.dumps(value, ensure_ascii=False)
        self._args += piece
        return [ToolCallDelta(self._index, piece)]

    def _end_call(self) -> list[Event]:
        piece = "}" if self._args else "{}"
        self._args += piece
        self._calls += 1
        self._index += 1
        return [ToolCallDelta(self._index - 1, piece), ToolCallEnd(self._index - 1, self._args)]

    def _finish(self, closed: bool) -> list[Event]:
        self.done = True  # text held back as a possible closing tag is dropped: the output was cut there
        events = self._steps(final=True)
        if self._state in ("params", "value"):
            if self._state == "value":
                events += self._step(final=True)[1]
            events += self._end_call()
        if not self._calls:
            self.leftover = self._start_text + self._seen + (self._end_spelling if closed else "")
        elif self._junk.strip():
            self.leftover = self._junk
        return events


def _could_be_tag(text: str) -> bool:
    """Whether more text could still make `text` one of the tags a call is written with."""
    text = text.lstrip()
    for tag in ("<function=", "<parameter=", "</function>"):
        if tag.startswith(text):
            return True
        if tag.endswith("=") and text.startswith(tag) and not any(c in text for c in ">\n") and len(text) < 512:
            return True
    return False


def _typed(raw: str, schema) -> object:
    """The parameter's value, typed by its JSON schema (see the module docstring); a value that
    cannot be written as JSON stays text."""
    value = _convert(raw, schema)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return raw
    return value


def _convert(raw: str, schema) -> object:
    if raw.lower() == "null":
        return None
    if not isinstance(schema, dict):
        return raw
    kind = schema.get("type", "string")
    if isinstance(kind, list):  # e.g. ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in _STRING_TYPES:
        return raw
    text = raw.strip()
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return raw
        if number != number or number in (float("inf"), float("-inf")):
            return raw
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.lower(), raw)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw
