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
    # Random init leaves norms at 1 (0 for Gemma); perturb them so norm bugs cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "w1", "bos_token": None}, f)
    return model
