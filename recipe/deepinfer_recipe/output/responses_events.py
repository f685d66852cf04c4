"""Parser events → OpenAI Responses stream events (typed, numbered, no [DONE]) and the final
`response` object. Output items: reasoning (rs_*), message (msg_*), function_call (fc_*)."""

from __future__ import annotations

from .parser import ContentDelta, Event, Finished, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart


class ResponsesStream:
    def __init__(self, response_id: str, model: str, created: int):
        self.id, self.model, self.created = response_id, model, created
        self.output: list[dict] = []
        self._open: str | None = None  # "reasoning" | "message" | "function_call"
        self._sequence = 0
        self.status = "in_progress"
        self.incomplete_details: dict | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def response(self) -> dict:
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "model": self.model, "output": self.output, "incomplete_details": self.incomplete_details,
            "usage": self.usage, "error": None,
        }

    def start(self) -> list[dict]:
        snapshot = self.response()
        return [self._event("response.created", response=snapshot), self._event("response.in_progress", response=snapshot)]

    def _index(self) -> int:
        return len(self.output) - 1

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        item, index, events = self.output[-1], self._index(), []
        if self._open in ("reasoning", "message"):
            part = item["content"][0]
            kind = "reasoning_text" if self._open == "reasoning" else "output_text"
            events.append(self._event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"]))
        item["status"] = "completed"
        self._open = None
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _begin(self, kind: str, item: dict, part: dict | None) -> list[dict]:
        events = self._close()
        self.output.append(item)
        self._open = kind
        index = self._index()
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item, content=[]) if part else dict(item)))
        if part is not None:
            item["content"] = [part]
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=dict(part)))
        return events

    def on_event(self, event: Event, usage: dict) -> list[dict]:
        n = len(self.output)
        if isinstance(event, ReasoningDelta):
            events = [] if self._open == "reasoning" else self._begin(
                "reasoning", {"type": "reasoning", "id": f"rs_{self.id}_{n}", "status": "in_progress", "summary": []},
                {"type": "reasoning_text", "text": ""})
            self.output[-1]["content"][0]["text"] += event.text
            return events + [self._event("response.reasoning_text.delta", item_id=self.output[-1]["id"], output_index=self._index(), content_index=0, delta=event.text)]
        if isinstance(event, ContentDelta):
            events = [] if self._open == "message" else self._begin(
                "message", {"type": "message", "id": f"msg_{self.id}_{n}", "status": "in_progress", "role": "assistant"},
                {"type": "output_text", "text": "", "annotations": []})
            self.output[-1]["content"][0]["text"] += event.text
            return events + [self._event("response.output_text.delta", item_id=self.output[-1]["id"], output_index=self._index(), content_index=0, delta=event.text)]
        if isinstance(event, ToolCallStart):
            item = {"type": "function_call", "id": f"fc_{self.id}_{n}", "status": "in_progress", "call_id": event.id, "name": event.name, "arguments": ""}
            return self._begin("function_call", item, None)
        if isinstance(event, ToolCallDelta):
            self.output[-1]["arguments"] += event.arguments
            return [self._event("response.function_call_arguments.delta", item_id=self.output[-1]["id"], output_index=self._index(), delta=event.arguments)]
        if isinstance(event, ToolCallEnd):
            return self._close()
        if isinstance(event, Finished):
            events = self._close()
            self.usage = {
                "input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0),
                "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
            }
            if event.reason == "length":
                self.status = "incomplete"
                self.incomplete_details = {"reason": "max_output_tokens"}
                return events + [self._event("response.incomplete", response=self.response())]
            self.status = "completed"
            return events + [self._event("response.completed", response=self.response())]
        return []

    def final(self) -> dict:
        return self.response()
