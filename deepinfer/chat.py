"""Which recipe encoder renders a model's chats, and the request options every chat entry point
shares: the server's chat routes (entrypoints/conversation.py) and the offline `LLM.chat`.

    encoder = make_encoder(source)                       # once per model (and per template)
    conversation = parse_request("chat", body)           # deepinfer_recipe
    apply_template_kwargs(conversation, chat_template_kwargs, encoder)
    ids = encoder.encode(conversation).token_ids

Rendering through the recipe, not by running the chat template and tokenizing its text, is what
keeps a user's text from becoming control tokens: text that spells "<|im_end|>" stays those
characters (deepinfer_recipe/tokenize.py says how).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from deepinfer_recipe import Conversation, Encoder, RequestError, get_encoder
from deepinfer_recipe.conversation import ImagePart
from deepinfer_recipe.encoders.hf_template import HFTemplateEncoder

from deepinfer.models.registry import takes_images

if TYPE_CHECKING:
    from deepinfer.models.loader import ModelSource

# The formats `chat_format` names besides "auto" (the model's own) and "hf:PATH".
FIXED_FORMATS = ("deepseek-v4", "deepseek-v4.1")


def make_encoder(source: ModelSource, chat_format: str = "auto", chat_template: str | None = None) -> Encoder:
    """The recipe encoder for a model's chats.

    chat_format "auto": the DeepSeek-V4 format for a DeepSeek-V4 architecture, else the model's
    own HF chat template (also for GGUF models, whose tokenizer exists only in memory), or
    `chat_template` (its text) when one is given. "deepseek-v4" / "deepseek-v4.1" / "hf:PATH"
    name a format; any other value means "the template".
    """
    if chat_format == "auto":
        architectures = source.hf_config.get("architectures") or []
        chat_format = "deepseek-v4" if any("DeepseekV4" in a for a in architectures) else "template"
    if chat_format in FIXED_FORMATS:
        tokenizer_json = os.path.join(source.path, "tokenizer.json")
        return get_encoder(chat_format, tokenizer_json if os.path.isfile(tokenizer_json) else None)
    if chat_format.startswith("hf:"):
        return get_encoder(chat_format)
    tok = source.tokenizer
    if tok is None:
        raise ValueError("there is no tokenizer to render chats with (skip_tokenizer_init=True, --skip-tokenizer-init)")
    template = chat_template if chat_template is not None else tok.chat_template
    encoder = HFTemplateEncoder.from_tokenizer(tok.backend, template, tok.bos_token, tok.eos_token,
                                               name=f"hf:{source.name}")
    if takes_images(source.hf_config):   # the template's image marker -> the model's image tokens
        from deepinfer.multimodal.chat_images import image_prompt_for

        encoder.image_prompt = image_prompt_for(source)
    return encoder


def apply_template_kwargs(conversation: Conversation, kwargs: dict[str, Any], encoder: Encoder) -> None:
    """vLLM's chat_template_kwargs: `enable_thinking` / `thinking` switch thinking for every
    format (as the request's own `thinking` field does); any other key is a variable for the
    model's Jinja template, which fixed formats (DeepSeek-V4) do not have. Raises RequestError
    (naming the key) for what cannot apply."""
    kwargs = dict(kwargs)
    for switch in ("enable_thinking", "thinking"):
        if switch in kwargs:
            value = kwargs.pop(switch)
            if not isinstance(value, bool):
                raise RequestError("must be a boolean", f"chat_template_kwargs.{switch}")
            if conversation.thinking is None:
                conversation.thinking = value
    if kwargs and not isinstance(encoder, HFTemplateEncoder):
        key = next(iter(kwargs))
        raise RequestError(f"this model's chat format ({encoder.name}) has no template variables",
                           f"chat_template_kwargs.{key}")
    conversation.template_kwargs = kwargs


def refuse_images(conversation: Conversation, takes_images: bool) -> None:
    """A model that reads no images refuses an image part (OpenAI's image_url, Anthropic's image
    block, Responses' input_image) instead of answering without it: RequestError naming the part
    (`messages[0].content[1]`). `takes_images`: models/registry.takes_images of the model."""
    if takes_images:
        return
    for message in conversation.messages:
        for part in message.content:
            if isinstance(part, ImagePart):
                raise RequestError("this model takes text only: image input is not supported", part.path)


def continue_final_message(conversation: Conversation) -> None:
    """vLLM's continue_final_message: the prompt ends inside the last message, an assistant
    turn the model goes on with (no generation prompt, no end-of-turn after it)."""
    last = conversation.messages[-1] if conversation.messages else None
    if last is None or last.role != "assistant":
        raise RequestError("continue_final_message needs the last message to be the assistant's",
                           "continue_final_message")
    last.prefix = True
    conversation.add_generation_prompt = False


def add_documents(conversation: Conversation, documents: list[dict[str, Any]], encoder: Encoder) -> None:
    """vLLM's `documents`: a template variable for retrieval-augmented templates (each document a
    dict, usually "title" and "text"). Formats without a template (DeepSeek-V4) refuse them."""
    if not isinstance(encoder, HFTemplateEncoder):
        raise RequestError(f"this model's chat format ({encoder.name}) has no template to pass documents to",
                           "documents")
    if "documents" in conversation.template_kwargs:
        raise RequestError("documents are given twice (also in chat_template_kwargs)", "documents")
    conversation.template_kwargs = {**conversation.template_kwargs, "documents": documents}
