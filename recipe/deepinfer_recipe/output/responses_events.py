"""Parser events → OpenAI Responses stream events (typed, numbered, no [DONE]) and the final
`response` object. Output items: reasoning (rs_*), message (msg_*), function_call (fc_*).

Every event and the response object validate against the `openai` SDK's types, and the SDK's
`client.responses.stream(...)` helper accumulates them (tests/test_responses_sdk.py). Per item:
output_item.added, content_part.added, deltas, *.done, content_part.done, output_item.done.

The stream always ends with `response.completed`, also when max_output_tokens cut it short: the
response in it then has status "incomplete" and incomplete_details {"reason":
"max_output_tokens"}, and the item that was cut has status "incomplete". OpenAI sends
`response.incomplete` there instead, but the SDK's stream helper (openai 3.57) takes the final
response only from `response.completed` (its get_final_response() raises after
`response.incomplete`), and vLLM ends every stream with `response.completed` as we do.
"""

from __future__ import annotations

import copy
import time

from .parser import ContentDelta, Event, Finished, ReasoningDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

# What the response object repeats of a request that set nothing (OpenAI's values); a request's
# own settings come in as `echo` (protocols/responses.py).
_DEFAULT_ECHO = {
    "instructions": None, "max_output_tokens": None, "parallel_tool_calls": True, "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False, "temperature": None,
    "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_logprobs": None, "top_p": None,
    "truncation": "disabled", "user": None, "metadata": {},
}


class ResponsesStream:
    def __init__(self, response_id: str, model: str, created: int, echo: dict | None = None):
        self.id, self.model, self.created = response_id, model, created
        self.echo = {**_DEFAULT_ECHO, **(echo or {})}
        self.output: list[dict] = []
        self._open: str | None = None  # "reasoning" | "message" | "function_call"
        self._sequence = 0
        self.status = "in_progress"
        self.incomplete_details: dict | None = None
        self.usage: dict | None = None
        self.completed_at: int | None = None

    def _event(self, kind: str, **fields) -> dict:
        # A copy: the items keep changing after this event, and a caller may serialize it later.
        event = {"type": kind, **copy.deepcopy(fields), "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def response(self) -> dict:
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "background": False, "completed_at": self.completed_at, "error": None,
            "incomplete_details": self.incomplete_details, "model": self.model, "output": self.output,
            "usage": self.usage, **self.echo,
        }

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def _index(self) -> int:
        return len(self.output) - 1

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        item, index, events = self.output[-1], self._index(), []
        if self._open in ("reasoning", "message"):
            part = item["content"][0]
            done = {"item_id": item["id"], "output_index": index, "content_index": 0, "text": part["text"]}
            if self._open == "reasoning":
                events.append(self._event("response.reasoning_text.done", **done))
            else:
                events.append(self._event("response.output_text.done", **done, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"]))
        item["status"] = status
        self._open = None
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _begin(self, kind: str, item: dict, part: dict | None) -> list[dict]:
        events = self._close()
        self.output.append(item)
        self._open = kind
        index = self._index()
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item, content=[]) if part else item))
        if part is not None:
            item["content"] = [part]
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part))
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
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.output[-1]["content"][0]["text"] += event.text
            return events + [self._event("response.output_text.delta", item_id=self.output[-1]["id"], output_index=self._index(),
                                         content_index=0, delta=event.text, logprobs=[])]
        if isinstance(event, ToolCallStart):
            item = {"type": "function_call", "id": f"fc_{self.id}_{n}", "status": "in_progress", "call_id": event.id, "name": event.name, "arguments": ""}
            return self._begin("function_call", item, None)
        if isinstance(event, ToolCallDelta):
            self.output[-1]["arguments"] += event.arguments
            return [self._event("response.function_call_arguments.delta", item_id=self.output[-1]["id"], output_index=self._index(), delta=event.arguments)]
        if isinstance(event, ToolCallEnd):
            return self._close("incomplete" if event.cut else "completed")
        if isinstance(event, Finished):
            cut_short = event.reason == "length"
            events = self._close("incomplete" if cut_short else "completed")
            self.usage = {
                "input_tokens": usage.get("prompt_tokens", 0),
                # The server knows the prefix-cache hit and sets cached_tokens.
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage.get("completion_tokens", 0),
                "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
                "total_tokens": usage.get("total_tokens", 0),
            }
            self.completed_at = None if cut_short else int(time.time())  # OpenAI: only when completed
            self.status = "incomplete" if cut_short else "completed"
            self.incomplete_details = {"reason": "max_output_tokens"} if cut_short else None
            return events + [self._event("response.completed", response=self.response())]
        return []

    def final(self) -> dict:
        return copy.deepcopy(self.response())
