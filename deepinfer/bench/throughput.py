"""`deepinfer bench throughput`: N synthetic requests of fixed input/output length, offline.

Prompts are random token ids (seeded, control tokens avoided) so every engine sees the same
work; each request generates exactly `--output-len` tokens (EOS ignored), greedily. The
concurrency limit is the engine's `max_num_seqs`: when one request finishes the next starts.
Prints requests/s and token throughputs (also in vLLM's words and JSON keys), with a tqdm bar
while each level runs; `--output-json` writes them with the machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import time
from typing import Any


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, nargs="+", default=None,
                        help="requests per concurrency level: one value for all, or one per level "
                             "(default: 2 x concurrency, at least 8)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1],
                        help="one or more concurrency levels (max requests in flight)")
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def synthetic_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tokenizer.backend.get_added_tokens_decoder()) | set(tokenizer.eos_token_ids)
    pool = [t for t in range(min(tokenizer.vocab_size, 32000)) if t not in special]
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def run_stamp() -> dict:
    """When and where a benchmark ran, for its JSON result."""
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_description()}


def save_json(path: str | None, data) -> None:
    """Write a benchmark's result to `path` (the --output-json flag), when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            desc = f"{torch.cuda.get_device_name()} + {desc}"
    except ImportError:
        pass
    return desc


def run_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    from deepinfer import LLM, SamplingParams

    results = []
    counts = args.num_prompts or [max(8, 2 * c) for c in args.concurrency]
    if len(counts) == 1:
        counts = counts * len(args.concurrency)
    if len(counts) != len(args.concurrency):
        raise ValueError(f"--num-prompts has {len(counts)} values for {len(args.concurrency)} concurrency levels")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for concurrency, n in zip(args.concurrency, counts):
        # The concurrency limit is the engine's max_num_seqs: one engine per level.
        llm = LLM(**dict(engine_kwargs, max_num_seqs=concurrency))
        prompts = synthetic_prompts(llm.tokenizer, n, args.input_len, args.prompt_seed)
        # Warm-up (first calls allocate and pick kernels); not timed.
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        # The bar (one update per finished request, with tokens/s) costs next to nothing per step.
        outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - start
        n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        n_in = sum(len(o.prompt_token_ids) for o in outputs)
        # vLLM's own lines, so scripts that read `vllm bench throughput` output read ours too.
        print(f"Throughput: {n / elapsed:.2f} requests/s, {(n_in + n_out) / elapsed:.2f} total tokens/s, "
              f"{n_out / elapsed:.2f} output tokens/s")
        print(f"Total num prompt tokens:  {n_in}")
        print(f"Total num output tokens:  {n_out}")
        results.append({
            "engine": "deepinfer", "model": llm.model_id, "concurrency": concurrency, "num_prompts": n,
            "input_len": args.input_len, "output_len": args.output_len, "elapsed_s": round(elapsed, 3),
            "request_throughput": n / elapsed, "output_throughput": n_out / elapsed,
            "total_token_throughput": (n_in + n_out) / elapsed, "dtype": str(llm.engine.executor.runner.dtype),
            # vLLM's keys for the same figures
            "elapsed_time": elapsed, "num_requests": n, "total_num_tokens": n_in + n_out,
            "requests_per_second": n / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
            **run_stamp(),
        })
    print(f"{'concurrency':>11} {'requests':>8} {'elapsed s':>9} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>11}")
    for r in results:
        print(f"{r['concurrency']:>11} {r['num_prompts']:>8} {r['elapsed_s']:>9.2f} {r['request_throughput']:>7.2f} "
              f"{r['output_throughput']:>10.1f} {r['total_token_throughput']:>11.1f}")
    save_json(args.output_json, results)
    return 0

