"""What a chat-style request's own fields do to its Conversation and to its reply, beyond the
protocol itself (which the recipe reads): vLLM's chat extras (`add_generation_prompt`,
`continue_final_message`, `documents`, `echo`), OpenAI's older `functions` replies, the image
and output-modality checks, and the prompt-size check that runs before tokenization.

    conversation = parse_request(protocol, body)
    apply(conversation, fields, encoder, protocol, takes_images=...)   # RequestError names the field
    check_size(conversation, max_chars)                                 # before the render
"""

from __future__ import annotations

from deepinfer_recipe import Conversation, Encoder, RequestError
from deepinfer_recipe.conversation import TextPart

from deepinfer.chat import add_documents, apply_template_kwargs, continue_final_message, refuse_images
from deepinfer.entrypoints import sampling

# Roles whose text every chat template shows the model (templates may drop earlier turns'
# reasoning or rewrite an assistant's content, never a user's, system's or tool result's text).
_SHOWN_ROLES = ("system", "developer", "user", "tool", "latest_reminder")


def apply(conversation: Conversation, fields, encoder: Encoder, protocol: str, *, takes_images: bool) -> None:
    """The request fields that shape the prompt, on `conversation` (RequestError on a misuse)."""
    refuse_images(conversation, takes_images)
    if protocol != "chat":
        return
    if fields.modalities is not None and "audio" in fields.modalities:
        raise RequestError("this server produces text only; modalities may only ask for text", "modalities")
    apply_template_kwargs(conversation, fields.chat_template_kwargs or {}, encoder)
    if fields.documents is not None:
        add_documents(conversation, fields.documents, encoder)
    conversation.add_generation_prompt = fields.add_generation_prompt
    if fields.continue_final_message:
        if fields.add_generation_prompt and "add_generation_prompt" in fields.model_fields_set:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true "
                               "(the first continues the last message, the second starts a new one)",
                               "continue_final_message")
        continue_final_message(conversation)


def echo_text(conversation: Conversation, fields, protocol: str) -> str:
    """vLLM's chat `echo`: the reply begins with the last message's text when that message is
    the assistant's (a prefilled or continued turn); otherwise there is nothing to echo."""
    if protocol != "chat" or not fields.echo or not conversation.messages:
        return ""
    last = conversation.messages[-1]
    return last.text if last.role == "assistant" else ""


def check_size(conversation: Conversation, max_chars: int | None) -> None:
    """A 400 before the render when the text every template shows already cannot fit: the
    cheap first look at a huge conversation (Encoder.encode's max_chars is the exact one)."""
    if max_chars is None:
        return
    chars = sum(len(part.text) for m in conversation.messages if m.role in _SHOWN_ROLES
                for part in m.content if isinstance(part, TextPart))
    if chars > max_chars:
        raise sampling.prompt_too_long(chars, max_chars, "messages")


# ------------------------------------------------------------- OpenAI's older function calls
def legacy_message(message: dict) -> dict:
    """A final chat message in the older API's shape: its one call as `function_call`."""
    calls = message.pop("tool_calls", None)
    if calls:
        message["function_call"] = dict(calls[0]["function"])
    return message


def legacy_delta(delta: dict) -> dict:
    """A stream delta in the older API's shape: a call's pieces as `function_call`."""
    calls = delta.pop("tool_calls", None)
    if calls:
        function = calls[0].get("function", {})
        delta["function_call"] = {k: function[k] for k in ("name", "arguments") if k in function}
    return delta


def legacy_finish(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason
