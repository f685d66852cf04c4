"""deepinfer-recipe: protocol requests ⇄ injection-safe token ids, without torch.

Input side:   body --parse_request--> Conversation --Encoder.encode--> PromptEncoding(token_ids)
Output side:  token ids --OutputSession.feed--> protocol stream events --> final response object
"""

from __future__ import annotations

from .conversation import Conversation, ImagePart, Message, TextPart, ToolCall, ToolDefinition
from .encoders import Encoder, PromptEncoding, get_encoder
from .errors import RecipeError, RequestError
from .prompt import RenderedPrompt
from .protocols import parse_request
from .tokenize import SafeTokenizer, load_deepseek_v4_tokenizer

__version__ = "0.1.0"


def encode_request(body: dict, protocol: str, format: str = "deepseek-v4") -> PromptEncoding:
    """Request JSON of `protocol` → PromptEncoding for model `format` (ids, prompt, ranges)."""
    return get_encoder(format).encode(parse_request(protocol, body))


def __getattr__(name: str):
    # The output side imports lazily so that input-only users load less.
    if name in ("OutputSession", "OutputParser"):
        from . import output

        return getattr(output, name)
    raise AttributeError(name)


__all__ = [
    "Conversation", "Message", "TextPart", "ImagePart", "ToolCall", "ToolDefinition",
    "Encoder", "PromptEncoding", "RenderedPrompt", "SafeTokenizer", "RecipeError", "RequestError",
    "encode_request", "get_encoder", "parse_request", "load_deepseek_v4_tokenizer",
    "OutputSession", "OutputParser",
]
