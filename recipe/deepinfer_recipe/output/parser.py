"""Model output token ids → reasoning, content and tool calls, incrementally and token-aware.

The parser is fed ids as the sampler produces them. It acts on a control marker (end of turn,
`</think>`, the DSML token) only when the model emitted that marker's *id*; the same characters
produced by ordinary tokens are text. So a model that writes "<｜end▁of▁sentence｜>" or a DSML
tag as characters (e.g. quoting a prompt) produces text, never a tool call or an early end.
DeepSeek's release parser (encoding_dsv4.py) matches these markers in decoded text; we do not.
(deepseek-recipe 0.2.0's stream processor also keeps spelled markers as text: tests/test_injection.py
checks that our final objects equal its.)

HF-template models call tools Hermes-style (`<tool_call>{...}</tool_call>`, hermes_calls.py)
unless another format is chosen (`tool_format`, call_formats.py: vLLM's llama3_json, mistral,
pythonic, qwen3_coder). Where the tokenizer has a format's opening tag as a token, only its id
opens a call, as above; where it does not (SmolLM2), the tag can only be recognised in the text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Callable
from typing import Literal

from ..encoders.base import OutputMarkers, ParserStart
from ..tokenize import SafeTokenizer
from .call_formats import call_syntax
from .detokenize import IncrementalDetokenizer

# The event types live in parser_events.py; the renderers import them from here as well.
from .parser_events import (
    ContentDelta,
    Event,
    Finished,
    FinishReason,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from .stop import StopChecker

# Stands for one emitted DSML id inside the tool-call buffer. A lone surrogate can never come out
# of UTF-8 decoding, so text cannot forge it.
_MARK = "\ud800"


def default_call_id(index: int, prefix: str = "call_") -> str:
    """A fresh tool-call id; the prefix follows the protocol (OpenAI "call_", Anthropic "toolu_")."""
    return f"{prefix}{index:02d}_{secrets.token_urlsafe(18)[:24]}"


class OutputParser:
    def __init__(
        self,
        tokenizer: SafeTokenizer,
        markers: OutputMarkers,
        start: ParserStart | None = None,
        stop: list[str] | None = None,
        call_id: Callable[[int], str] = default_call_id,
        ignore_eos: bool = False,
        tool_format: str | None = None,
        tool_schemas: dict[str, dict] | None = None,
    ):
        """tool_format: the tool-call format to read (call_formats.FORMATS; None: the chat
        format's own). tool_schemas: each offered tool's parameters schema, by name (qwen3_coder
        types its values by them)."""
        # Control ids are acted on here, so the detokenizer keeps every token's text (the
        # parser drops the ones it must: see _skipped).
        self._detok = IncrementalDetokenizer(tokenizer.full, skip_special_tokens=False)
        ids = lambda s: tokenizer.control_id(s) if s and tokenizer.has_control(s) else None
        self._eos = {ids(s) for s in markers.end_of_turn} - {None}
        start = start or ParserStart()
        self._think_start, self._think_end, self._dsml = ids(markers.think_start), ids(markers.think_end), ids(markers.dsml)
        # The block-style call format (Hermes by default on HF templates); None: DSML or no tools.
        self._syntax = call_syntax(tool_format, markers) if start.parse_tool_calls else None
        self._tool_schemas = tool_schemas or {}
        syntax = self._syntax
        self._call_open = ids(syntax.open_tag) if syntax else None
        self._call_close = ids(syntax.close_tag) if syntax else None
        # The chat format's own call tags stay visible text where they mean nothing (no tools).
        own_tags = (ids(markers.tool_call_start), ids(markers.tool_call_end))
        marker_ids = (self._think_start, self._think_end, self._dsml, self._call_open, self._call_close, *own_tags)
        self._spelling = {i: tokenizer.full.id_to_token(i) for i in marker_ids if i is not None}
        # ignore_eos (the engine generates past the end of the turn, up to max_tokens): an end
        # token does not finish, and like every other special token that means nothing to the
        # parser it is left out of the text, as vLLM's skip_special_tokens does. The finish then
        # comes from the caller's finish("length").
        self._skipped = (self._eos | tokenizer.special_ids) - set(self._spelling) if ignore_eos else frozenset()
        self._markers = markers
        # DSML, unless another format was chosen for this DeepSeek model.
        foreign = tool_format not in (None, "hermes", "dsml")
        self._parse_tools = start.parse_tool_calls and self._dsml is not None and not foreign
        # `_open_text` is set when the opening tag is plain text, not a token; `_at_start` opens a
        # block when the output begins with it (formats whose calls carry no tag).
        self._open_text = syntax.open_tag if syntax and self._call_open is None else None
        self._at_start = syntax.at_start if syntax else None
        self._after_call = False  # drop the whitespace between consecutive calls
        self._stops = StopChecker([s for s in (stop or []) if s])
        self._call_id = call_id
        self.stage = start.stage
        self._strip_leading = not start.continuation
        self._pending = ""  # content held back: may begin a tool block or a stop sequence
        self._tools = None
        if start.stage == "tool_calls":  # the prompt already opened the block (forced tool choice)
            self._tools = _ToolBlock(markers, call_id)
            self._tools.opened()
        self.finished: FinishReason | None = None
        self.stop_sequence: str | None = None
        self.reasoning_tokens = 0
        self.completion_tokens = 0
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[dict] = []  # {"id", "name", "arguments"}

    # -- feeding -------------------------------------------------------------------------------
    def feed(self, token_ids: list[int]) -> list[Event]:
        events: list[Event] = []
        for token_id in token_ids:
            if self.finished:
                break
            self.completion_tokens += 1
            if self.stage == "reasoning":
                self.reasoning_tokens += 1
            events.extend(self._one(token_id))
        return events

    def finish(self, reason: Literal["stop", "length"] = "stop") -> list[Event]:
        """The engine stopped (EOS seen elsewhere, or max tokens). Flushes held-back text."""
        if self.finished:
            return []
        events = self._text(self._detok.flush())
        if self._pending:
            events += self._emit_content(self._pending, final=True)
            self._pending = ""
        if self._in_block():
            events += self._close_call()
        elif self._tools is not None:
            events += self._tools.close()
            self._collect(events)
        if reason == "length":  # a call still open now was cut short (Responses marks it incomplete)
            events = [dataclasses.replace(e, cut=True) if isinstance(e, ToolCallEnd) else e for e in events]
        return events + [self._finish(reason)]

    # -- internals -----------------------------------------------------------------------------
    def _finish(self, reason: FinishReason) -> Finished:
        if reason == "stop" and self.tool_calls:
            reason = "tool_calls"
        self.finished = reason
        return Finished(reason, self.stop_sequence)

    def _one(self, token_id: int) -> list[Event]:
        if token_id in self._skipped:
            return []
        if token_id in self._eos:
            return self.finish("stop")
        if token_id == self._think_end and self.stage == "reasoning":
            events = self._text(self._detok.flush())
            self.stage = "content"
            self._strip_leading = False
            return events
        if token_id == self._think_start and self.stage == "reasoning" and not self.reasoning:
            return []  # a redundant opening tag at the very start carries no text
        if token_id == self._dsml and self._parse_tools and self.stage == "content" and self._pending.endswith("<"):
            self._pending = ""  # the "<" and the blank line before it belong to the markup
            self.stage = "tool_calls"
            self._tools = _ToolBlock(self._markers, self._call_id, index_base=len(self.tool_calls))
            return self._tool_text("<" + _MARK)
        if token_id == self._dsml and self.stage == "tool_calls":
            return self._tool_text(_MARK)
        if token_id == self._call_open and self._call_open is not None and self.stage == "content":
            events = self._emit_content(self._pending + self._detok.flush(), final=True)
            return events if self.finished else events + self._open_call(self._spelling[token_id])
        if token_id == self._call_close and self._call_close is not None and self._in_block():
            return self._tool_text(self._detok.flush()) + self._close_call(end_seen=True)
        if token_id in self._spelling:  # a marker where it has no meaning: keep it visible
            return self._text(self._detok.flush() + self._spelling[token_id])
        return self._text(self._detok.step(token_id))

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.stage == "reasoning":
            if self._strip_leading:
                text = text.lstrip("\n")
                if not text:
                    return []
                self._strip_leading = False
            self.reasoning += text
            return [ReasoningDelta(text)]
        if self.stage == "tool_calls":
            return self._tool_text(text)
        return self._emit_content(self._pending + text, final=False)

    def _emit_content(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        if self._after_call:
            text = text.lstrip()
            self._pending = ""
            if not text:
                return events
            self._after_call = False
        # `text` is the held-back tail (searched before, never a whole stop string) plus new
        # text, so searching all of it finds the stop string that completes first.
        stop = self._stops.find(text)
        if self._at_start is not None and not self.content and not self.tool_calls:
            body = text.lstrip()
            if body.startswith(self._at_start) and (stop is None or stop.start >= len(text) - len(body)):
                self._open_call("")  # the leading whitespace goes with the markup
                return self._tool_text(body)
        if self._open_text is not None:
            at = text.find(self._open_text)
            if at >= 0 and (stop is None or stop.start >= at):   # a stop string before the tag wins
                events = self._emit_content(text[:at], final=True)
                if self.finished:
                    return events
                events += self._open_call(self._open_text)
                return events + self._tool_text(text[at + len(self._open_text):])
        if stop is not None:
            self.stop_sequence = stop.stop
            if text[:stop.start]:
                self.content += text[:stop.start]
                events.append(ContentDelta(text[:stop.start]))
            self._pending = ""
            return events + [self._finish("stop_sequence")]
        hold = 0 if final else self._holdback(text)
        ready, self._pending = text[: len(text) - hold], text[len(text) - hold :]
        if ready:
            self.content += ready
            events.append(ContentDelta(ready))
        return events

    def _holdback(self, text: str) -> int:
        """How many trailing characters might still turn into markup or a stop sequence."""
        hold = 0
        if self._parse_tools:
            match = re.search(r"\s*<?$", text)
            hold = len(text) - match.start()
        if self._open_text is not None:
            hold = max(hold, _partial_suffix(text, self._open_text))
        if self._at_start is not None and not self.content and not self.tool_calls and not text.strip():
            hold = len(text)  # the output may still begin with a call
        return max(hold, self._stops.hold_back(text))

    def _open_call(self, spelling: str) -> list[Event]:
        self._pending = ""
        self.stage = "tool_calls"
        self._tools = self._syntax.make_block(len(self.tool_calls), self._call_id, spelling, self._call_close is not None,
                                              self._tool_schemas)
        return []

    def _in_block(self) -> bool:
        """Inside a block-style call (not DSML's `_ToolBlock`)."""
        return self._tools is not None and not isinstance(self._tools, _ToolBlock)

    def _close_call(self, rest: str | None = None, end_seen: bool = False) -> list[Event]:
        """End the call block (closing tag seen, or end of output), then go on with `rest`."""
        block, events = self._tools, []
        if not block.done:
            events = block.close(end_seen)
            self._collect(events)
        self._tools, self.stage = None, "content"
        if block.leftover is not None:  # not a call after all: it was text (never re-scanned)
            self.content += block.leftover
            events.append(ContentDelta(block.leftover))
        else:
            self._after_call = True
        if rest:
            events += self._emit_content(rest, final=False)
        return events

    def _tool_text(self, text: str) -> list[Event]:
        if self._in_block():
            events, rest = self._tools.push(text) if text else ([], None)
            self._collect(events)
            return events + self._close_call(rest) if rest is not None else events
        events = self._tools.push(text)
        self._collect(events)
        if self._tools.leftover is not None:  # malformed markup: show it as content instead
            leftover = self._tools.leftover.replace(_MARK, self._markers.dsml or "")
            self._tools = None
            self.stage = "content"
            events += self._emit_content(leftover, final=False)
        return events

    def _collect(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, ToolCallStart):
                self.tool_calls.append({"id": event.id, "name": event.name, "arguments": ""})
            elif isinstance(event, ToolCallEnd):
                self.tool_calls[event.index]["arguments"] = event.arguments


class _ToolBlock:
    """Parses one DSML tool-call block from text in which `_MARK` stands for each DSML id."""

    def __init__(self, markers: OutputMarkers, call_id: Callable[[int], str], index_base: int = 0):
        m = _MARK
        calls, invoke, param = (re.escape(x) for x in (markers.dsml_calls, markers.dsml_invoke, markers.dsml_parameter))
        self._open_block = re.compile(rf"<{m}{calls}>\n?")
        self._open_invoke = re.compile(rf'\s*<{m}{invoke} name="([^"\n]*)">\n?')
        self._open_param = re.compile(rf'\s*<{m}{param} name="([^"\n]*)" string="(true|false)">')
        self._close_param = f"</{m}{markers.dsml_parameter}>"
        self._close_invoke = re.compile(rf"\s*</{m}{invoke}>\n?")
        self._close_block = re.compile(rf"\s*</{m}{calls}>")
        self._call_id = call_id
        self._buf = ""
        self._state = "block"  # block | invokes | params | value | done
        self._index = index_base - 1
        self._args = ""
        self._params = 0
        self._value_is_string = True
        self.leftover: str | None = None

    def opened(self) -> None:
        self._state = "invokes"

    def push(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            progressed, new = self._step()
            events += new
            if not progressed:
                return events

    def close(self) -> list[Event]:
        """End of output inside the block: close what is open so the call is still usable."""
        events: list[Event] = []
        if self._state == "value":
            events += self._value_piece(self._buf)
            self._buf = ""
            self._state = "params"
            events += self._end_param()
        if self._state == "params":
            events += self._end_invoke()
        self._state = "done"
        return events

    def _args_piece(self, text: str) -> list[Event]:
        self._args += text
        return [ToolCallDelta(self._index, text)] if text else []

    def _value_piece(self, text: str) -> list[Event]:
        if self._value_is_string:
            text = json.dumps(text, ensure_ascii=False)[1:-1]
        return self._args_piece(text)

    def _end_param(self) -> list[Event]:
        return self._args_piece('"') if self._value_is_string else []

    def _end_invoke(self) -> list[Event]:
        events = self._args_piece("}" if self._params else "{}")
        self._state = "invokes"
        return events + [ToolCallEnd(self._index, self._args)]

    def _step(self) -> tuple[bool, list[Event]]:
        buf, state = self._buf, self._state
        if state == "done":
            self._buf = ""
            return False, []
        if state == "value":
            end = buf.find(self._close_param)
            if end < 0:
                safe = len(buf) - _partial_suffix(buf, self._close_param)
                self._buf = buf[safe:]
                return False, self._value_piece(buf[:safe])
            self._buf = buf[end + len(self._close_param) :]
            self._state = "params"
            return True, self._value_piece(buf[:end]) + self._end_param()
        patterns = {
            "block": [(self._open_block, "open_block")],
            "invokes": [(self._open_invoke, "open_invoke"), (self._close_block, "close_block")],
            "params": [(self._open_param, "open_param"), (self._close_invoke, "close_invoke")],
        }[state]
        for pattern, action in patterns:
            match = pattern.match(buf)
            if match and (match.end() < len(buf) or not pattern.pattern.endswith("\\n?")):
                self._buf = buf[match.end() :]
                return True, self._act(action, match)
        if any(_could_match(p, buf) for p, _ in patterns):
            return False, []
        self.leftover, self._buf, self._state = buf, "", "done"
        return False, []

    def _act(self, action: str, match: re.Match) -> list[Event]:
        if action == "open_block":
            self._state = "invokes"
            return []
        if action == "open_invoke":
            self._index += 1
            self._args, self._params, self._state = "", 0, "params"
            return [ToolCallStart(self._index, self._call_id(self._index), match.group(1))]
        if action == "close_block":
            self._state = "done"
            return []
        if action == "close_invoke":
            return self._end_invoke()
        # open_param
        self._value_is_string = match.group(2) == "true"
        prefix = "{" if self._params == 0 else ", "
        self._params += 1
        self._state = "value"
        opening = prefix + json.dumps(match.group(1), ensure_ascii=False) + ": " + ('"' if self._value_is_string else "")
        return self._args_piece(opening)


def _partial_suffix(text: str, target: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `target`."""
    for size in range(min(len(target) - 1, len(text)), 0, -1):
        if text.endswith(target[:size]):
            return size
    return 0


def _could_match(pattern: re.Pattern, text: str) -> bool:
    """Whether more text could still complete a match of `pattern` at the start of `text`.

    Our tag patterns are short and literal apart from the quoted names, so we test whether `text`
    is consistent with a prefix of the pattern by trying it against a completed example."""
    stripped = text.lstrip()
    if not stripped:
        return True
    if len(stripped) > 512:  # a tag is never this long: give up on markup
        return False
    if pattern.match(text):
        return True
    example = pattern.pattern
    # Build the literal skeleton by removing regex syntax we used, then compare as a prefix.
    skeleton = (
        example.replace("\\s*", "").replace("\\n?", "\n").replace('([^"\\n]*)', "\x00").replace("(true|false)", "\x01")
    )
    skeleton = re.sub(r"\\(.)", r"\1", skeleton)
    return _prefix_consistent(stripped, skeleton)


def _prefix_consistent(text: str, skeleton: str) -> bool:
    i = j = 0
    while i < len(text) and j < len(skeleton):
        s = skeleton[j]
        if s == "\x00":  # a quoted name: any run of characters except quote/newline
            while i < len(text) and text[i] not in '"\n':
                i += 1
            j += 1
            continue
        if s == "\x01":
            rest = text[i:]
            for word in ("true", "false"):
                if word.startswith(rest[: len(word)]) and (len(rest) < len(word) or rest.startswith(word)):
                    if len(rest) < len(word):
                        return True
                    i += len(word)
                    break
            else:
                return False
            j += 1
            continue
        if text[i] != s:
            return False
        i += 1
        j += 1
    return True
