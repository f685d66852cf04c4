"""`deepinfer bench serve`: replay a workload against a running server, report latency and throughput.

Workloads (`--dataset`):
  random         prompts of random token ids, lengths uniform in input_len * [1 - r, 1 + r]
                 (r = --range-ratio), outputs likewise; /v1/completions
  shared-prefix  --num-prefixes random prefixes of --prefix-len tokens, each prompt one prefix plus a
                 random suffix: what the prefix cache is for; /v1/completions
  multi-turn     chat conversations of --turns user turns, each turn sent with the whole history
                 (the model's earlier replies included); /v1/chat/completions
Every request streams with `ignore_eos`, so it produces exactly its max_tokens.

Arrivals follow a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency requests in flight. Reported, with vLLM's JSON key names: request throughput,
output and total token throughput, and TTFT / TPOT / ITL / E2EL mean, median, std and the
--metric-percentiles (default 50,90,99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# Token ids in this range exist in every vocabulary we serve and are ordinary (not control) tokens.
_TOKEN_RANGE = (1000, 20000)
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
          "point government company number group problem fact river mountain city music light paper "
          "water story garden engine window market table letter road ocean forest winter summer").split()


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (multi-turn: conversations)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary by this fraction")
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all now")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metric-percentiles", default="50,90,99")
    parser.add_argument("--save-result", default=None, metavar="FILE", help="write the JSON result here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="TTFT/ITL histograms (needs matplotlib)")


# ------------------------------------------------------------------------------- workload
@dataclass
class Job:
    """One request (or, for multi-turn, one conversation: a request per user turn)."""

    endpoint: str
    prompts: list[Any]      # completions: [token ids]; multi-turn: the user messages
    max_tokens: int


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(n)]


def build_workload(args: argparse.Namespace) -> list[Job]:
    rng = random.Random(args.seed)
    jobs = []
    if args.dataset == "multi-turn":
        for _ in range(args.num_prompts):
            turns = [" ".join(rng.choice(_WORDS) for _ in range(_length(rng, args.input_len, args.range_ratio)))
                     for _ in range(args.turns)]
            jobs.append(Job("/v1/chat/completions", turns, _length(rng, args.output_len, args.range_ratio)))
        return jobs
    prefixes = [_ids(rng, args.prefix_len) for _ in range(args.num_prefixes)]
    for i in range(args.num_prompts):
        prompt = _ids(rng, _length(rng, args.input_len, args.range_ratio))
        if args.dataset == "shared-prefix":
            prompt = prefixes[i % len(prefixes)] + prompt
        jobs.append(Job("/v1/completions", [prompt], _length(rng, args.output_len, args.range_ratio)))
    return jobs


# ----------------------------------------------------------------------------- measuring
@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one_request(client, endpoint: str, payload: dict) -> tuple[Result, str]:
    """Stream one request; returns its measurements and the generated text."""
    start = time.perf_counter()
    last = None
    result, text = Result(ok=False), []
    try:
        async with client.stream("POST", endpoint, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result, ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    piece = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(piece)
    except Exception as e:  # a failed request is counted, not fatal to the benchmark
        result.error = f"{type(e).__name__}: {e}"
        return result, ""
    result.e2e = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    return result, "".join(text)


async def _run_job(client, job: Job, model: str) -> list[Result]:
    common = {"model": model, "max_tokens": job.max_tokens, "ignore_eos": True, "temperature": 0,
              "stream": True, "stream_options": {"include_usage": True}}
    if job.endpoint == "/v1/completions":
        return [(await _one_request(client, job.endpoint, {**common, "prompt": job.prompts[0]}))[0]]
    results, history = [], []
    for turn in job.prompts:
        history.append({"role": "user", "content": turn})
        result, reply = await _one_request(client, job.endpoint, {**common, "messages": history})
        results.append(result)
        if not result.ok:
            break
        history.append({"role": "assistant", "content": reply})
    return results


async def _run(args: argparse.Namespace, jobs: list[Job]) -> tuple[list[Result], float, str]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model = args.model
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)

        async def gated(job: Job) -> list[Result]:
            if gate is None:
                return await _run_job(client, job, model)
            async with gate:
                return await _run_job(client, job, model)

        tasks = []
        start = time.perf_counter()
        for job in jobs:
            tasks.append(asyncio.create_task(gated(job)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = [r for group in await asyncio.gather(*tasks) for r in group]
        return results, time.perf_counter() - start, model


# ------------------------------------------------------------------------------ reporting
def summarize(results: list[Result], duration: float, percentiles: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    for name, values in series.items():
        ms = sorted(v * 1000 for v in values) or [0.0]
        summary[f"mean_{name}_ms"] = statistics.fmean(ms)
        summary[f"median_{name}_ms"] = statistics.median(ms)
        summary[f"std_{name}_ms"] = statistics.pstdev(ms)
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = _percentile(ms, p)
    errors = [r.error for r in results if not r.ok and r.error]
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * p / 100
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def print_table(summary: dict[str, Any], percentiles: list[float]) -> None:
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [("Successful requests:", summary["completed"]), ("Failed requests:", summary["failed"]),
            ("Benchmark duration (s):", f"{summary['duration']:.2f}"),
            ("Total input tokens:", summary["total_input_tokens"]),
            ("Total generated tokens:", summary["total_output_tokens"]),
            ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:>10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        print(f"{' ' + title + ' ':-^50}")
        print(f"{'Mean ' + name.upper() + ' (ms):':<40}{summary[f'mean_{name}_ms']:>10.2f}")
        print(f"{'Median ' + name.upper() + ' (ms):':<40}{summary[f'median_{name}_ms']:>10.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} ' + name.upper() + ' (ms):':<40}{summary[f'p{p:g}_{name}_ms']:>10.2f}")
    print(line)


def plot(results: list[Result], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'deepinfer[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.hist([r.ttft * 1000 for r in ok], bins=30)
    left.set(title="TTFT", xlabel="ms", ylabel="requests")
    right.hist([gap * 1000 for r in ok for gap in r.itl], bins=30)
    right.set(title="Inter-token latency", xlabel="ms", ylabel="tokens")
    fig.tight_layout()
    fig.savefig(path)


def run_serve_bench(args: argparse.Namespace) -> int:
    from deepinfer.bench.throughput import run_stamp, save_json

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per request otherwise
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    jobs = build_workload(args)
    results, duration, model = asyncio.run(_run(args, jobs))
    summary = summarize(results, duration, percentiles)
    print_table(summary, percentiles)
    summary.update({
        "backend": "deepinfer", "model_id": model, "dataset": args.dataset, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, **run_stamp(),
    })
    if args.dataset == "shared-prefix":
        summary.update(prefix_len=args.prefix_len, num_prefixes=args.num_prefixes)
    if args.dataset == "multi-turn":
        summary["turns"] = args.turns
    save_json(args.save_result, summary)
    if args.plot:
        plot(results, args.plot)
    return 0 if summary["failed"] == 0 else 1
