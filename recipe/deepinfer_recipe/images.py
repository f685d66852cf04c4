"""Where a conversation's images go in its prompt: the chat template writes one marker per image
part, and each marker becomes the model's image text.

How a template meets an image: a message with an image part reaches the template with its
content as a list of parts, `{"type": "image"}` and `{"type": "text", "text": ...}` in order (the
Hugging Face convention multimodal templates read; messages without images keep a string). The
template writes its marker there (Gemma 3: `<start_of_image>`), and the encoder replaces each
marker by `ImagePrompt.pieces` (Gemma 3: "\\n\\n", begin-of-image, the image token once per
embedding, end-of-image, "\\n\\n"), as the model's HF processor replaces it in the text before
tokenizing; the plain pieces merge with the text beside them exactly as they do there.

Injection safety holds: a marker counts only as a control token the template itself wrote
(RenderedPrompt.control_ranges); a user's text that spells it stays text. The number of markers
must equal the number of image parts, so neither a template that writes none (it ignores
images) nor one that writes more lets an image go missing or a marker go unfilled.
"""

from __future__ import annotations

from dataclasses import dataclass

from .conversation import Conversation, ImagePart
from .errors import RequestError
from .prompt import PromptBuilder, RenderedPrompt


@dataclass(frozen=True)
class ImagePrompt:
    marker: str                          # the control token a template writes for an image
    pieces: tuple[tuple[bool, str], ...]  # what replaces it: (is_control, text) in order


def count_images(conversation: Conversation) -> int:
    return sum(isinstance(part, ImagePart) for message in conversation.messages for part in message.content)


def expand_images(rendered: RenderedPrompt, image_prompt: ImagePrompt, num_images: int,
                  format_name: str) -> RenderedPrompt:
    """`rendered` with each image marker replaced by the image's pieces (the module docstring)."""
    builder, found = PromptBuilder(), 0
    for is_control, text in rendered.segments():
        if is_control and text == image_prompt.marker:
            found += 1
            for piece_control, piece in image_prompt.pieces:
                (builder.control if piece_control else builder.text)(piece)
        elif is_control:
            builder.control(text)
        else:
            builder.text(text)
    if found != num_images:
        raise RequestError(f"the chat template ({format_name}) wrote {found} image marker(s) ({image_prompt.marker}) "
                           f"for {num_images} image(s); it must place each image it is given", "messages")
    return builder.build()
