"""What a serving run shows and saves: vLLM's printed table, its JSON result file, and a plot.

The table has vLLM's lines and layout (labels left in 40 columns, values left in 10), so output
of both tools can be read side by side or parsed by the same script. The JSON result has vLLM's
keys; the per-request lists (input_lens, output_lens, ttfts, itls, start_times, generated_texts,
errors) are kept only with --save-detailed, as in vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer.bench.serving.metrics import percentile_key

if TYPE_CHECKING:
    from deepinfer.bench.serving.client import StreamResult

DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
_TITLES = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency")}


def print_traffic(request_rate: float, burstiness: float, max_concurrency: int | None) -> None:
    distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {request_rate}")
    print(f"Burstiness factor: {burstiness} ({distribution})")
    print(f"Maximum request concurrency: {max_concurrency}")


def print_failures(results: Sequence[StreamResult], limit: int = 10) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        print(f"Failed requests during benchmark run detected (capping to {limit}):")
        for i, r in enumerate(failed[:limit]):
            print(f"Error {i}: {r.error}")


def _row(label: str, value, fmt: str = "") -> None:
    print(f"{label:<40} {value:<10{fmt}}")


def print_table(summary: dict, metrics: Sequence[str], percentiles: Sequence[float], request_rate: float,
                max_concurrency: int | None, goodput: bool) -> None:
    print(f"{' Serving Benchmark Result ':=^50}")
    _row("Successful requests:", summary["completed"])
    _row("Failed requests:", summary["failed"])
    if max_concurrency is not None:
        _row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        _row("Request rate configured (RPS):", request_rate, ".2f")
    _row("Benchmark duration (s):", summary["duration"], ".2f")
    _row("Total input tokens:", summary["total_input_tokens"])
    _row("Total generated tokens:", summary["total_output_tokens"])
    _row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    if goodput:
        _row("Request goodput (req/s):", summary["request_goodput"], ".2f")
    _row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    _row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"], ".2f")
    _row("Peak concurrent requests:", summary["max_concurrent_requests"], ".2f")
    _row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for name in metrics:
        short, title = _TITLES[name]
        print(f"{title:-^50}")
        _row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"], ".2f")
        _row(f"Median {short} (ms):", summary[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            key = percentile_key(p)
            _row(f"{key.upper()} {short} (ms):", summary[f"{key}_{name}_ms"], ".2f")
    print("=" * 50)


def result_path(result_dir: str | None, result_filename: str | None, label: str, request_rate: float,
                max_concurrency: int | None, model_id: str, date: str) -> str:
    """vLLM's default name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    name = result_filename or f"{label}-{request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        name = os.path.join(result_dir, name)
    return name


def result_json(config: dict, summary: dict, detailed: bool) -> dict:
    """The run's settings, then its measurements (vLLM's order); per-request lists only if detailed."""
    result = {**config, **summary}
    if not detailed:
        for key in DETAILED_KEYS:
            result.pop(key, None)
    return result


def save_result(path: str, result: dict, append: bool) -> None:
    """Write (or with --append-result add a line to) the JSON file."""
    with open(path, "a+" if append else "w", encoding="utf-8") as f:
        if append and f.tell():
            f.write("\n")
        json.dump(result, f)


def check_plot_available() -> None:
    """--plot needs matplotlib; say so before the run, not after it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'deepinfer[bench]'")


def plot(results: Sequence[StreamResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.hist([r.ttft * 1000 for r in ok], bins=30)
    left.set(title="TTFT", xlabel="ms", ylabel="requests")
    right.hist([gap * 1000 for r in ok for gap in r.itl], bins=30)
    right.set(title="Inter-token latency", xlabel="ms", ylabel="token events")
    fig.tight_layout()
    fig.savefig(path)
