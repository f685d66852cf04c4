"""Baseline of the plain reference path on a GPU, for a Llama-3-8B-shaped random-weight model.

Prints, with the ceilings measured in the same run: (a) batch-1 decode tok/s at 1k context
against the bandwidth roofline (copy bandwidth / weight bytes), (b) one 8k-token prefill against
the measured bf16 matmul rate. This is the starting point the CUDA fast path is measured from.

    python benchmarks/gpu_reference_baseline.py [--layers 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

import torch

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                 max_position_embeddings=8192 + 256, tie_word_embeddings=False, torch_dtype="bfloat16")


def write_config_dir(config: dict) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tempfile.mkdtemp(prefix="deepinfer-shape-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    return directory


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (2 << 30) / sorted(times)[len(times) // 2]


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from deepinfer import LLM, SamplingParams

    bandwidth, flops = copy_bandwidth(), matmul_rate()
    config = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    # No prefix caching: the timed runs repeat prompts, and a hit would skip the work measured.
    llm = LLM(write_config_dir(config), load_format="dummy", max_model_len=8192 + 256,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.6, enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    weight_bytes = llm.engine.executor.runner.weight_bytes
    params = sum(p.numel() for p in model.parameters())
    greedy = dict(temperature=0, ignore_eos=True)

    prompt = [[(7 * i) % 100000 + 10 for i in range(1024)]]
    llm.generate(prompt, SamplingParams(max_tokens=8, **greedy), use_tqdm=False)   # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    torch.cuda.synchronize()
    prefill_1k = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=129, **greedy), use_tqdm=False)
    torch.cuda.synchronize()
    decode_tps = 128 / (time.perf_counter() - t - prefill_1k)
    roofline = bandwidth / weight_bytes

    long_prompt = [[(13 * i) % 100000 + 10 for i in range(8192)]]
    llm.generate(long_prompt, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(long_prompt, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t
    # Matmul FLOPs of the prefill (attention score/value products included, causal half).
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    prefill_flops = 2 * (params - config["vocab_size"] * h) * 8192 + layers * 2 * 2 * 8192 * 8192 * h / 2

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "layers": layers, "weight_gb": weight_bytes / 1e9,
        "copy_bandwidth_tb_s": bandwidth / 1e12, "bf16_matmul_tflop_s": flops / 1e12,
        "decode_b1_1k_tok_s": decode_tps, "roofline_tok_s": roofline, "decode_fraction_of_roofline": decode_tps / roofline,
        "prefill_8k_ms": prefill_s * 1e3, "prefill_fraction_of_matmul_rate": prefill_flops / prefill_s / flops,
    }
    for key, value in result.items():
        print(f"{key:>34}: {value:.4g}" if isinstance(value, float) else f"{key:>34}: {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
