"""The tool-call formats the output parser reads, by name, and how each one's block opens.

A format's calls sit in a block the parser hands text to (hermes_calls.py and the modules
named below; each has `push`, `close`, `leftover`, `done`). A block opens at `open_tag`
anywhere in the content — only by its id where the tokenizer has that tag as a control token,
else where it is spelled — or, for formats whose calls carry no tag, at `at_start` when it
begins the output (those characters are then the block's first text). `close_tag` ends the
block; without one the block decides where its calls end and gives back the text after them.

"hermes" is what HF chat templates get by default; "dsml" (DeepSeek) is parsed by parser.py
itself. The other names are vLLM's `--tool-call-parser` formats for models whose templates
teach another convention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..encoders.base import OutputMarkers
from ..errors import RecipeError
from .hermes_calls import HermesCallBlock
from .llama3_calls import Llama3CallBlock
from .mistral_calls import MARKER as MISTRAL_MARKER
from .mistral_calls import MistralCallBlock
from .pythonic_calls import PythonicCallBlock
from .qwen3_coder_calls import Qwen3CoderCallBlock

FORMATS = ("hermes", "dsml", "llama3_json", "mistral", "pythonic", "qwen3_coder")


@dataclass(frozen=True)
class CallSyntax:
    open_tag: str | None
    close_tag: str | None
    at_start: str | None
    # (index of the first call, call id maker, opening text, whether close_tag is a token, tool schemas)
    make_block: Callable[..., object]


def _qwen3_coder(index, call_id, start_text, end_is_token, tools):
    return Qwen3CoderCallBlock(index, call_id, start_text, "</tool_call>", end_is_token, tools)


_SYNTAX = {
    "llama3_json": CallSyntax("<|python_tag|>", None, "{", lambda i, c, s, e, t: Llama3CallBlock(i, c, s)),
    "mistral": CallSyntax(MISTRAL_MARKER, None, None, lambda i, c, s, e, t: MistralCallBlock(i, c, s)),
    "pythonic": CallSyntax(None, None, "[", lambda i, c, s, e, t: PythonicCallBlock(i, c, s)),
    "qwen3_coder": CallSyntax("<tool_call>", "</tool_call>", None, _qwen3_coder),
}


def call_syntax(tool_format: str | None, markers: OutputMarkers) -> CallSyntax | None:
    """The syntax to read calls with; None: none besides DSML (which parser.py reads itself).
    None, "hermes" and "dsml" all mean the chat format's own: Hermes tags where the encoder
    names them (HF templates), DSML for DeepSeek's formats."""
    if tool_format not in (None, *FORMATS):
        raise RecipeError(f"unknown tool-call format {tool_format!r}; expected one of {', '.join(FORMATS)}")
    if tool_format in _SYNTAX:
        return _SYNTAX[tool_format]
    if markers.tool_call_start is None:
        return None
    end = markers.tool_call_end

    def make(index, call_id, start_text, end_is_token, tools):
        return HermesCallBlock(index, call_id, start_text, end, end_is_token)

    return CallSyntax(markers.tool_call_start, end, None, make)
