"""Long context on the GPU: one 128k-token prompt on the Llama-3-8B shape (rope scaled as
Llama 3.1 is: rope_type llama3, factor 8 over 8k), against floors measured in the same run.

    python3 benchmarks/long_context.py [--context 131072] [--decode-tokens 64] [--layers 32]
        [--max-num-batched-tokens 16384] [--short-context 16384] [--enforce-eager]
        [--compare-paged-kernel] [--out long.json]

Prints and writes (JSON):
  prefill   the time of the prompt's prefill (generate with max_tokens=1, prefix cache empty),
            against the matmul floor = (2 x body params x tokens + the causal attention's QK^T and
            PV FLOPs) / the bf16 matmul rate measured first
  memory    the device memory the prefill added at its peak (torch's max_memory_allocated, reset
            before it) against the bound chunked prefill promises: the same peak for one
            --short-context prompt (its chunks are as large; only the context they attend over
            differs), and against that bound plus what the runner reserves for chunks on a long
            prefix (their keys gathered for cuDNN, layers/attention/sdpa_extend.py). The weights
            and the KV pool are allocated before either and reported beside
  decode    batch-1 decode tok/s at that context: the prompt again (a prefix hit on all but its
            last block), with max_tokens = 1 + --decode-tokens and = 1, the difference over
            --decode-tokens; against the roofline = copy bandwidth / (weight bytes + the KV bytes
            of the context, read once per token)

--compare-paged-kernel first times the same prefill with every chunk in the paged prefill kernel
(no chunk routed to sdpa_extend), the prefix cache emptied before and after, and reports both
runs' two likeliest first tokens with their logprobs.

Random bf16 weights (load_format="dummy"): nothing to transfer, the kernels' work is the real
model's. Takes about 3-4 minutes on an H200 (most of it the engine's start and the prefill).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
from gpu_fast_path import GREEDY, attention_flops, random_prompts, report, shape_counts, timed
from gpu_reference_baseline import LLAMA3_8B, copy_bandwidth, matmul_rate, write_config_dir

ROPE_LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def prefill_floor_s(c: dict, tokens: int, flops: float) -> float:
    """Matmul FLOPs of a fresh prefill of `tokens` (every layer's projections and MLP for each
    token, the LM head for the last one, causal attention) at the measured matmul rate."""
    return (2 * c["body_params"] * tokens + 2 * c["head_params"] + attention_flops(c, 0, tokens)) / flops


def peak_added(fn) -> tuple[float, int]:
    """(seconds, bytes the peak of device memory rose above what was allocated before fn)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = timed(fn)
    return seconds, torch.cuda.max_memory_allocated() - before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=131072, help="prompt + decoded tokens")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--short-context", type=int, default=16384,
                        help="the prompt whose peak memory is the bound (one chunk or a few)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--compare-paged-kernel", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from deepinfer import LLM, SamplingParams

    config = dict(LLAMA3_8B, num_hidden_layers=args.layers, rope_scaling=ROPE_LLAMA31,
                  max_position_embeddings=args.context)
    c = shape_counts(config)
    prompt_len = args.context - args.decode_tokens - 1
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    result: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": c["layers"],
                    "context": args.context, "prompt_tokens": prompt_len, "decode_tokens": args.decode_tokens,
                    "max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": args.enforce_eager,
                    "copy_bandwidth_tb_s": bandwidth / 1e12, "bf16_matmul_tflop_s": flops / 1e12}
    for key, value in list(result.items()):
        report(result, key, value, args.out)

    t = time.perf_counter()
    llm = LLM(write_config_dir(config), load_format="dummy", max_model_len=args.context,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=8,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    report(result, "engine_start_s", time.perf_counter() - t, args.out)
    runner = llm.engine.executor.runner
    kv_bytes = sum(t.numel() * t.element_size() for kv in runner.kv_caches for t in {id(x): x for x in kv}.values())
    report(result, "weight_gb", runner.weight_bytes / 1e9, args.out)
    report(result, "kv_pool_gb", kv_bytes / 1e9, args.out)
    report(result, "kv_pool_tokens", runner.num_blocks * runner.block_size, args.out)

    def generate(prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    def first_token(prompt: list[int]) -> list[tuple[int, float]]:
        """The two likeliest first tokens with their logprobs (random weights make near ties)."""
        params = SamplingParams(max_tokens=1, logprobs=2, **GREEDY)
        top = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        return sorted(((token, round(lp.logprob, 4)) for token, lp in top.items()), key=lambda x: -x[1])

    vocab = config["vocab_size"]
    short = random_prompts(1, args.short_context, vocab, seed=1)[0]
    long = random_prompts(1, prompt_len, vocab, seed=2)[0]
    generate(random_prompts(1, 512, vocab, seed=3)[0], 4)   # warm-up (kernels compiled at start)

    _, short_peak = peak_added(lambda: generate(short, 1))
    report(result, "activation_bound_gb", short_peak / 1e9, args.out)
    reserve = runner.attention_backend.workspace_bytes(runner.groups, args.context, args.max_num_batched_tokens,
                                                       config["num_attention_heads"])
    report(result, "sdpa_extend_reserve_gb", reserve / 1e9, args.out)
    first_tokens = []
    if args.compare_paged_kernel:
        from bench_common import reset_prefix_cache

        from deepinfer.layers.attention import sdpa_extend

        shapes, sdpa_extend.EXTEND_MIN_SHAPES = sdpa_extend.EXTEND_MIN_SHAPES, ()   # no chunk qualifies
        try:
            paged_s, paged_peak = peak_added(lambda: first_tokens.append(first_token(long)))
        finally:
            sdpa_extend.EXTEND_MIN_SHAPES = shapes
        reset_prefix_cache(llm)
        report(result, "prefill_paged_kernel_s", paged_s, args.out)
        report(result, "prefill_paged_kernel_peak_added_gb", paged_peak / 1e9, args.out)
    prefill_s, long_peak = peak_added(lambda: first_tokens.append(first_token(long)))
    if args.compare_paged_kernel:
        report(result, "speedup_over_paged_kernel", paged_s / prefill_s, args.out)
        report(result, "first_tokens_paged_kernel", first_tokens[0], args.out)
        report(result, "first_tokens", first_tokens[1], args.out)
    floor = prefill_floor_s(c, prompt_len, flops)
    report(result, "prefill_s", prefill_s, args.out)
    report(result, "prefill_floor_s", floor, args.out)
    report(result, "prefill_floor_ratio", floor / prefill_s, args.out)
    report(result, "prefill_attention_share_of_floor", attention_flops(c, 0, prompt_len) / flops / floor, args.out)
    report(result, "prefill_peak_added_gb", long_peak / 1e9, args.out)
    report(result, "peak_over_bound", long_peak / short_peak, args.out)
    report(result, "peak_over_bound_and_reserve", long_peak / (short_peak + reserve), args.out)
    report(result, "device_peak_gb", torch.cuda.max_memory_allocated() / 1e9, args.out)

    hit_s = timed(lambda: generate(long, 1))   # the prefix hit alone: the last block recomputed
    decode_s = timed(lambda: generate(long, 1 + args.decode_tokens))
    tok_s = args.decode_tokens / (decode_s - hit_s)
    context_kv = args.context * c["kv_bytes_per_token"]
    roofline = bandwidth / (runner.weight_bytes + context_kv)
    report(result, "prefix_hit_ttft_s", hit_s, args.out)
    report(result, "decode_tok_s", tok_s, args.out)
    report(result, "decode_roofline_tok_s", roofline, args.out)
    report(result, "decode_roofline_ratio", tok_s / roofline, args.out)
    report(result, "decode_context_kv_gb", context_kv / 1e9, args.out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
