"""Request JSON of each protocol → one Conversation."""

from __future__ import annotations

from typing import Literal

from ..conversation import Conversation
from ..errors import RequestError
from . import chat_completions, messages, responses

Protocol = Literal["chat", "responses", "messages"]
PROTOCOLS = ("chat", "responses", "messages")

_ADAPTERS = {
    "chat": chat_completions.to_conversation,
    "responses": responses.to_conversation,
    "messages": messages.to_conversation,
}


def parse_request(protocol: Protocol, body: dict) -> Conversation:
    """Validate a request body of `protocol` and map it to a Conversation (raises RequestError)."""
    try:
        adapter = _ADAPTERS[protocol]
    except KeyError:
        raise RequestError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}") from None
    return adapter(body)
