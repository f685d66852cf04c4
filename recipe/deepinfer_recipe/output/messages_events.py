"""Parser events → Anthropic Messages stream events and the final `message` object."""

from __future__ import annotations

import json

from .parser import ContentDelta, Event, Finished, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

_STOP = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesStream:
    def __init__(self, response_id: str, model: str, signature: str | None = None):
        self.id, self.model = response_id, model
        self.signature = signature if signature is not None else response_id
        self.blocks: list[dict] = []
        self._open: str | None = None  # "thinking" | "text" | "tool_use"
        self._tool_json = ""
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict = {}

    def _usage(self, usage: dict) -> dict:
        return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}

    def start(self, usage: dict) -> list[dict]:
        message = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": self._usage(usage),
        }
        return [{"type": "message_start", "message": message}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        events = []
        index = len(self.blocks) - 1
        if self._open == "thinking":
            self.blocks[-1]["signature"] = self.signature
            events.append({"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": self.signature}})
        if self._open == "tool_use":
            try:
                self.blocks[-1]["input"] = json.loads(self._tool_json or "{}")
            except ValueError:
                self.blocks[-1]["input"] = {}
        self._open = None
        return events + [{"type": "content_block_stop", "index": index}]

    def _begin(self, kind: str, block: dict) -> list[dict]:
        events = self._close()
        self.blocks.append(dict(block))
        self._open = kind
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block})
        return events

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def on_event(self, event: Event, usage: dict) -> list[dict]:
        if isinstance(event, ReasoningDelta):
            events = [] if self._open == "thinking" else self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += event.text
            return events + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ContentDelta):
            events = [] if self._open == "text" else self._begin("text", {"type": "text", "text": ""})
            self.blocks[-1]["text"] += event.text
            return events + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallStart):
            self._tool_json = ""
            return self._begin("tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolCallDelta):
            self._tool_json += event.arguments
            return [self._delta({"type": "input_json_delta", "partial_json": event.arguments})]
        if isinstance(event, ToolCallEnd):
            return self._close()
        if isinstance(event, Finished):
            self.stop_reason = _STOP[event.reason]
            self.stop_sequence = event.stop_sequence
            self.usage = self._usage(usage)
            delta = {"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}, "usage": self.usage}
            return self._close() + [delta, {"type": "message_stop"}]
        return []

    def final(self) -> dict:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
            "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage,
        }
