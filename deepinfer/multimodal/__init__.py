"""Images in: what turns image bytes into embeddings a language model reads at its image tokens.

The stages, one file each, in the order a request meets them:

    image_processor.py   bytes -> RGB pixels (clear errors) -> pixel_values [n, 3, H, W] as the
                         checkpoint's HF image processor makes them; the image's hash (the key of
                         the encoder cache to come)
    prompt.py            where an image's tokens go in the prompt (begin-of-image, the image token
                         repeated once per embedding, end-of-image) and where they are found again
    siglip.py            the SigLIP vision tower: pixel_values -> one vector per patch
    gemma3_projector.py  Gemma 3's projector: patches pooled to the image's token count, normed,
                         projected into the language model's hidden size
    step_images.py       one forward step's images: which rows take which embedding, and the
                         attention inside an image (bidirectional in Gemma 3), layered on the
                         step's attention metadata

The language model that reads them is in deepinfer/models/gemma3_mm.py (registered as
`Gemma3ForConditionalGeneration`): `encode_images(pixel_values)` is the encoder stage, and its
`forward(..., images=StepImages)` takes the embeddings for the step's image rows. Nothing here
depends on the scheduler; the engine feeds these seams (docs/vision.md says what is left).
"""
