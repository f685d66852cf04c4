"""Tiny random-weight checkpoints of every supported architecture, written the way
`save_pretrained` writes a real one, with a word-level tokenizer.json, so tests go through the
real HF-directory loader."""

from __future__ import annotations

import json
import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 512

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False)


def tiny_config(arch: str, **overrides):
    """`overrides` replace fields of the config (e.g. head_dim=128 for a kernel that needs it)."""
    import transformers as tf

    if overrides:
        config = tiny_config(arch)
        for name, value in overrides.items():
            setattr(config, name, value)
        return config
    if arch == "llama":
        return tf.LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=12)   # shorter than the prompts
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32)
    if arch == "gemma3":
        cfg = dict(COMMON, num_hidden_layers=6, head_dim=32, tie_word_embeddings=True)
        return tf.Gemma3TextConfig(**cfg, sliding_window=12, query_pre_attn_scalar=24)
    raise ValueError(arch)


HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
ARCHS = list(HF_CLASSES)


def build_tiny_checkpoint(arch: str, directory: str, seed: int = 0, **overrides):
    """Write a tiny random checkpoint of `arch` to `directory`; return the HF model (float32)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = getattr(tf, HF_CLASSES[arch])(config).eval()
    perturb_norms(model)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return model


def perturb_norms(model, scale: float = 0.1) -> None:
    """Random init leaves norms at 1 (0 for Gemma); perturb them so norm bugs cannot hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * scale)


def write_tokenizer(directory: str) -> None:
    """A word-level tokenizer.json over the tiny vocabulary (token i is "w{i}"), EOS "w1"."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "w1", "bos_token": None}, f)


# Gemma 3 with images, tiny: the gemma3 text model above, a 2-layer SigLIP tower on 32 x 32
# images in 4 x 4 patches (an 8 x 8 grid), pooled by 2 into 16 tokens an image (more than the
# text model's sliding window of 12, so the window and the image's two-way attention meet).
# The image token ids are ids of the tiny vocabulary.
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                   patch_size=4, vision_use_head=False)
TINY_IMAGE_TOKENS = dict(boi_token_index=500, eoi_token_index=501, image_token_index=502, mm_tokens_per_image=16)


def tiny_vision_config(**vision_overrides):
    import transformers as tf

    return tf.Gemma3Config(text_config=tiny_config("gemma3"), vision_config={**TINY_VISION, **vision_overrides},
                           **TINY_IMAGE_TOKENS)


def build_tiny_vision_checkpoint(directory: str, seed: int = 0, **vision_overrides):
    """A tiny random Gemma3ForConditionalGeneration saved to `directory` (safetensors, with the
    tokenizer); returns the HF model (float32)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(tiny_vision_config(**vision_overrides)).eval()
    perturb_norms(model)
    with torch.no_grad():   # initialised to zeros: images would all embed to nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return model


# A chat tokenizer for the tiny vision checkpoint: the word-level vocabulary above, with "\n\n" and
# "\n" as ids 10 and 11 (newlines are tokens, as Gemma's are), the image tokens and the turn
# markers as special added tokens, and a chat template that writes <start_of_image> for each
# image part the way Gemma 3's does. Text spelling a special token stays words ("w0" for unknown).
VISION_CHAT_TOKENS = {"<start_of_image>": 500, "<end_of_image>": 501, "<image_soft_token>": 502,
                      "<start_of_turn>": 503, "<end_of_turn>": 504, "<bos>": 505}
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def tiny_vision_chat_model(directory: str):
    """A tiny Gemma 3 vision checkpoint with its chat tokenizer in `directory`; the transformers
    model comes back with no EOS in its generation config (greedy runs to max_new_tokens, as the
    engine's ignore_eos runs do)."""
    hf = build_tiny_vision_checkpoint(directory)
    write_vision_chat_tokenizer(directory)
    hf.generation_config.eos_token_id = None
    return hf


def write_vision_chat_tokenizer(directory: str, vocab_size: int = VOCAB, tokens: dict[str, int] = VISION_CHAT_TOKENS,
                                newlines: tuple[int, int] = (10, 11)) -> None:
    """The tiny checkpoint's chat tokenizer; another vocabulary size, special ids and newline ids
    ("\n\n", "\n") give a real model's shape one (benchmarks/vision_serving.py: Gemma 3's ids)."""
    from tokenizers import Regex

    vocab = {f"w{i}": i for i in range(vocab_size)}
    for i in (*newlines, *tokens.values()):
        vocab.pop(f"w{i}")
    vocab.update({"\n\n": newlines[0], "\n": newlines[1], **tokens})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    # Punctuation apart, so that text spelling "<start_of_image>" is several words, as BPE makes it.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                 pre_tokenizers.Split(Regex("\n\n|\n"), "isolated"),
                                                 pre_tokenizers.Punctuation("isolated")])
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True) for t in sorted(tokens, key=tokens.get)])
    assert all(tok.token_to_id(t) == i for t, i in tokens.items())
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<end_of_turn>", "bos_token": "<bos>", "chat_template": VISION_CHAT_TEMPLATE}, f)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(base_directory: str, directory: str, seed: int, rank: int = 8,
                       targets: tuple[str, ...] = LORA_TARGETS, b_scale: float = 20.0):
    """A random PEFT LoRA adapter of the checkpoint at `base_directory`, saved to `directory` the way
    PEFT saves one; returns the PEFT model (float32, eval) to compare with. PEFT starts B at zeros
    (the adapter would change nothing): init_lora_weights=False draws it, and `b_scale` makes it
    large enough that each adapter changes a tiny model's greedy tokens."""
    import peft
    import transformers as tf

    torch.manual_seed(seed)
    base = tf.AutoModelForCausalLM.from_pretrained(base_directory, dtype=torch.float32).eval()
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    model.save_pretrained(directory)
    return model.eval()
