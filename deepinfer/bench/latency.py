"""`deepinfer bench latency`: the end-to-end time of one batch, as vLLM's latency benchmark.

One batch of `--batch-size` synthetic prompts of `--input-len` tokens, each generating exactly
`--output-len` tokens (greedy, EOS ignored), timed `--num-iters` times after warm-up. Prints the
mean and percentiles of the batch latency, the prefill (time to the first token of the batch)
and the decode time per output token, so a decode figure can be set against the bandwidth
roofline. Prefix caching is always off here: iterations repeat prompts, and a hit would skip the
prefill being measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from deepinfer.bench.throughput import run_stamp, save_json, synthetic_prompts


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def run_latency(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    from deepinfer import LLM, SamplingParams

    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    kwargs = dict(engine_kwargs, enable_prefix_caching=False)
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 1, args.batch_size)
    llm = LLM(**kwargs)
    prompts = synthetic_prompts(llm.tokenizer, args.batch_size, args.input_len, args.prompt_seed)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def timed(params: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)   # returns host token lists: the device is done
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        timed(full)
    prefill = [timed(first) for _ in range(args.num_iters)]
    latencies = [timed(full) for _ in range(args.num_iters)]
    prefill_s = statistics.median(prefill)
    decode_steps = max(args.output_len - 1, 1)
    per_token = [(t - prefill_s) / decode_steps for t in latencies]
    result = {
        "engine": "deepinfer", "model": llm.model_id, "batch_size": args.batch_size,
        "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
        "avg_latency_s": statistics.mean(latencies),
        "percentiles_s": {str(q): _percentile(latencies, q) for q in (10, 25, 50, 75, 90, 99)},
        "prefill_s": prefill_s, "decode_ms_per_step": 1e3 * statistics.median(per_token),
        "decode_tok_s": args.batch_size / statistics.median(per_token),
        "dtype": str(llm.engine.executor.runner.dtype), "attention_backend": llm.engine.executor.runner.attention_backend.name,
        **run_stamp(),
    }
    print(f"Avg latency: {result['avg_latency_s']:.4f} s over {args.num_iters} iterations "
          f"(batch {args.batch_size}, {args.input_len} in / {args.output_len} out)")
    for q, value in result["percentiles_s"].items():
        print(f"{q}% percentile latency: {value:.4f} s")
    print(f"prefill: {1e3 * prefill_s:.1f} ms; decode: {result['decode_ms_per_step']:.2f} ms per step, "
          f"{result['decode_tok_s']:.1f} tok/s")
    save_json(args.output_json, result)
    return 0
