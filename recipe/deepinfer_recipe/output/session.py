"""One generation's output side: feed token ids, get protocol events; ask for the final object.

    session = OutputSession.for_encoding(encoder, encoding, protocol="chat", model="m")
    events = session.start()
    events += session.feed(new_ids)        # as many times as ids arrive
    events += session.finish("length")     # only if the engine stopped it (EOS is seen in feed)
    body = session.final_response()
`session.finished` turns true on EOS or a stop sequence: the engine should stop generating then.
With `for_encoding(..., ignore_eos=True)` (the request's ignore_eos) end tokens do not finish
the session: they are left out of the text, parsing goes on, and the caller's finish("length")
ends it.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable
from typing import Literal

from ..encoders.base import Encoder, PromptEncoding
from ..errors import RecipeError
from .call_formats import FORMATS
from .chat_events import ChatCompletionsStream
from .messages_events import MessagesStream
from .mistral_calls import mistral_call_id
from .parser import OutputParser, default_call_id
from .responses_events import ResponsesStream


class OutputSession:
    def __init__(
        self,
        parser: OutputParser,
        protocol: Literal["chat", "responses", "messages"],
        model: str = "",
        prompt_tokens: int = 0,
        response_id: str | None = None,
        created: int | None = None,
        echo: dict | None = None,  # request fields the Responses object repeats (PromptEncoding.echo)
    ):
        self.parser = parser
        self.protocol = protocol
        self.prompt_tokens = prompt_tokens
        created = int(time.time()) if created is None else created
        if protocol == "chat":
            self.stream = ChatCompletionsStream(response_id or f"chatcmpl-{secrets.token_hex(12)}", model, created)
        elif protocol == "responses":
            self.stream = ResponsesStream(response_id or f"resp_{secrets.token_hex(12)}", model, created, echo)
        elif protocol == "messages":
            self.stream = MessagesStream(response_id or f"msg_{secrets.token_hex(12)}", model)
        else:
            raise RecipeError(f"unknown protocol {protocol!r}")

    @classmethod
    def for_encoding(
        cls,
        encoder: Encoder,
        encoding: PromptEncoding,
        protocol: Literal["chat", "responses", "messages"],
        model: str = "",
        call_id: Callable[[int], str] | None = None,
        ignore_eos: bool = False,
        tool_format: str | None = None,
        **kwargs,
    ) -> OutputSession:
        """call_id: makes the id of the n-th tool call; by default a random one with the
        protocol's prefix ("toolu_" for Messages, as Anthropic's ids, else "call_"; Mistral's
        format: 9 letters and digits, all its templates accept).
        ignore_eos: generation goes on past end tokens (see the module docstring).
        tool_format: the tool-call format the model writes (call_formats.FORMATS; vLLM's
        --tool-call-parser); None: the chat format's own. A forced tool choice constrains the
        output to the chat format's own form, so it is read as that whatever is chosen here."""
        if tool_format not in (None, *FORMATS):
            raise RecipeError(f"unknown tool-call format {tool_format!r}; expected one of {', '.join(FORMATS)}")
        if encoding.constraint is not None:
            tool_format = None
        if call_id is None and tool_format == "mistral" and protocol != "messages":
            call_id = mistral_call_id
        if call_id is None:
            prefix = "toolu_" if protocol == "messages" else "call_"
            call_id = functools.partial(default_call_id, prefix=prefix)
        if encoder.tokenizer is None:
            raise RecipeError(f"format {encoder.name} has no tokenizer to decode output with")
        parser = OutputParser(encoder.tokenizer, encoder.markers, encoding.parser_start, encoding.stop, call_id,
                              ignore_eos=ignore_eos, tool_format=tool_format, tool_schemas=encoding.tool_schemas)
        prompt_tokens = len(encoding.token_ids or [])
        return cls(parser, protocol, model, prompt_tokens, echo=encoding.echo, **kwargs)

    @property
    def finished(self) -> bool:
        return self.parser.finished is not None

    def usage(self) -> dict:
        completion = self.parser.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "reasoning_tokens": self.parser.reasoning_tokens,
        }

    def start(self) -> list[dict]:
        return self.stream.start(self.usage()) if self.protocol == "messages" else self.stream.start()

    def _render(self, events) -> list[dict]:
        out: list[dict] = []
        for event in events:
            out.extend(self.stream.on_event(event, self.usage()))
        return out

    def feed(self, token_ids: list[int]) -> list[dict]:
        return self._render(self.parser.feed(token_ids))

    def finish(self, reason: Literal["stop", "length"] = "stop") -> list[dict]:
        return self._render(self.parser.finish(reason))

    def final_response(self) -> dict:
        return self.stream.final()
