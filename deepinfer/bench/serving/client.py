"""One streaming request, sent and timed the way vLLM's benchmark client times it, at low cost.

What is measured (vLLM's definitions, so that both clients report the same numbers):
  * a *token event* is an SSE event whose `choices` list is not empty, whatever text it carries;
    the usage chunk at the end (empty `choices`) is not one;
  * TTFT is start -> first token event; ITL is the gap between consecutive token events;
  * latency (E2EL) is start -> the *last token event* (not the end of the stream);
  * output tokens come from the final usage chunk (`stream_options.include_usage`), and so do the
    prompt's cached tokens (`prompt_tokens_details.cached_tokens`, the KV benchmarks' hit);
  * a request succeeded if at least one token event came (and, ours, no error event).

Why it is lean: on a busy GPU server every stream gets one event per decode step, so the client
handles hundreds of events per step; any Python per event is paid hundreds of times per step. So:
  * aiohttp reads whatever bytes arrived (`iter_any`); the clock is read once per read;
  * events are found with `bytes.split(b"\\n\\n")` (C), and a token event is told apart from the
    others with one `bytes.find` for `"choices":[` and a look at the next byte: no JSON parsing;
  * only the few events without a choice (usage, errors) are parsed, after the stream ended;
  * the text is assembled only when asked (`keep_text`: multi-turn histories, --save-detailed),
    also after the stream ended, from the kept raw events.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import aiohttp

_CHOICES = b'"choices":['
_OPEN_BRACKET_END = len(_CHOICES)
_EMPTY, _OBJECT = ord("]"), ord("{")
# For servers that write JSON with spaces ("choices": [ ... ]); compact JSON never gets here.
_CHOICES_SPACED = re.compile(rb'"choices"\s*:\s*\[\s*(\S)')


@dataclass(slots=True)
class StreamResult:
    """What one request measured (times in seconds, from time.perf_counter)."""

    success: bool = False
    prompt_len: int = 0         # usage.prompt_tokens, else the tokens the workload meant to send
    output_tokens: int = 0      # usage.completion_tokens; 0 when the server sent no usage
    cached_tokens: int = 0      # usage.prompt_tokens_details.cached_tokens (prefix-cache hit), when sent
    token_events: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    queue_time: float = 0.0     # waiting for a --max-concurrency slot before it was sent
    error: str = ""
    text: str = ""


def carries_choice(event: bytes) -> bool:
    """Is this SSE event a token event (a non-empty `choices` list)? No JSON parsing."""
    i = event.find(_CHOICES)
    if i >= 0:
        j = i + _OPEN_BRACKET_END
        if j < len(event):
            if event[j] == _OBJECT:
                return True
            if event[j] == _EMPTY:
                return False
    match = _CHOICES_SPACED.search(event)
    return match is not None and match.group(1) != b"]"


def event_data(event: bytes) -> bytes | None:
    """The `data:` payload of one SSE event (lines joined), or None for a comment-only event."""
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def completion_body(model: str, prompt, max_tokens: int, extra: dict) -> bytes:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    return json.dumps(body, separators=(",", ":")).encode()


def chat_body(model: str, messages: list[dict], max_tokens: int, extra: dict) -> bytes:
    body = {"model": model, "messages": messages, "max_completion_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    return json.dumps(body, separators=(",", ":")).encode()


async def stream_request(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict,
                         prompt_len: int, keep_text: bool = False) -> StreamResult:
    """POST `body` (a streaming request) and time its token events; never raises for a failed request."""
    out = StreamResult(prompt_len=prompt_len)
    itl = out.itl
    kept: list[bytes] | None = [] if keep_text else None
    others: list[bytes] = []       # events without a choice: parsed once the stream has ended
    clock = time.perf_counter
    start = out.start_time = clock()
    last = None
    tail = b""

    def on_event(event: bytes, now: float) -> None:
        nonlocal last
        if carries_choice(event):
            if last is None:
                out.ttft = now - start
            else:
                itl.append(now - last)
            last = now
            if kept is not None:
                kept.append(event)
        elif event:
            others.append(event)

    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status} {response.reason}: {(await response.text())[:500]}"
                return out
            async for chunk in response.content.iter_any():
                now = clock()
                if tail:
                    chunk = tail + chunk
                if b"\r" in chunk:               # servers that end lines with CRLF
                    chunk = chunk.replace(b"\r\n", b"\n")
                events = chunk.split(b"\n\n")
                tail = events.pop()              # an incomplete event waits for the next read
                for event in events:
                    on_event(event, now)
            if tail.strip():                     # a last event without the closing blank line
                on_event(tail, clock())
    except Exception as e:  # a failed request is counted, not fatal to the benchmark
        out.error = f"{type(e).__name__}: {e}"
        return out

    if last is None:
        out.error = "no token event came back"
    else:
        out.success = True
        out.latency = last - start
        out.token_events = len(itl) + 1
    _read_other_events(out, others)
    if kept is not None:
        out.text = "".join(_piece(json.loads(event_data(event))) for event in kept)
    return out


def _read_other_events(out: StreamResult, events: list[bytes]) -> None:
    """The usage chunk sets the token counts; an error event fails the request."""
    for event in events:
        payload = event_data(event)
        if payload is None or payload == b"[DONE]":
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            out.success, out.error = False, f"an event that is not JSON: {payload[:200]!r}"
            continue
        if not isinstance(data, dict):
            continue
        if data.get("usage"):
            usage = data["usage"]
            out.output_tokens = usage.get("completion_tokens") or 0
            if usage.get("prompt_tokens") is not None:
                out.prompt_len = usage["prompt_tokens"]
            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        elif data.get("error"):
            out.success, out.error = False, f"error event: {json.dumps(data['error'])[:500]}"


def _piece(data: dict) -> str:
    """The text of one token event: completions carry `text`, chat carries `delta.content`."""
    choice = data["choices"][0]
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""
