"""Parser events → OpenAI Chat Completions stream chunks and the final `chat.completion`."""

from __future__ import annotations

from .parser import ContentDelta, Event, Finished, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


class ChatCompletionsStream:
    def __init__(self, response_id: str, model: str, created: int):
        self.id, self.model, self.created = response_id, model, created
        self.reasoning, self.content = "", ""
        self.tool_calls: list[dict] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def _chunk(self, delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def on_event(self, event: Event, usage: dict) -> list[dict]:
        if isinstance(event, ReasoningDelta):
            self.reasoning += event.text
            return [self._chunk({"reasoning_content": event.text})]
        if isinstance(event, ContentDelta):
            self.content += event.text
            return [self._chunk({"content": event.text})]
        if isinstance(event, ToolCallStart):
            self.tool_calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
            call = {"index": event.index, "id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
            return [self._chunk({"tool_calls": [call]})]
        if isinstance(event, ToolCallDelta):
            self.tool_calls[event.index]["function"]["arguments"] += event.arguments
            return [self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})]
        if isinstance(event, ToolCallEnd):
            return []
        if isinstance(event, Finished):
            self.finish_reason = _FINISH[event.reason]
            self.usage = {
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0),
                "completion_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
            }
            return [self._chunk({}, self.finish_reason, self.usage)]
        return []

    def final(self) -> dict:
        message: dict = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason}],
            "usage": self.usage,
        }
