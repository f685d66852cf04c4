"""The two kinds of failure a caller must tell apart.

`RequestError` means the client sent something we reject (HTTP 400); it names the JSON path
of the offending field so a client can fix its request. `RecipeError` is the base for
everything else this package raises on purpose (a missing tokenizer, an unknown format).
"""

from __future__ import annotations


class RecipeError(ValueError):
    """Something this package refuses to do; the message says what and why."""


class RequestError(RecipeError):
    """An invalid client request. `path` is like `messages[2].content[0].type` (or None)."""

    def __init__(self, message: str, path: str | None = None):
        self.message = message
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)

    def to_openai_error(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.path,
                "code": None,
            }
        }

    def to_anthropic_error(self) -> dict:
        return {"type": "error", "error": {"type": "invalid_request_error", "message": str(self)}}


class PromptTooLong(RequestError):
    """The rendered prompt has more characters than `limit`, so it cannot fit the context:
    raised before it is tokenized (Encoder.encode's `max_chars`)."""

    def __init__(self, chars: int, limit: int):
        self.chars, self.limit = chars, limit
        super().__init__(f"the rendered prompt has {chars} characters, more than the {limit} any prompt "
                         "that fits the context can have")
