"""What a serving run measured, with vLLM's definitions and JSON key names.

Per successful request (see client.py for how the times are taken):
  output tokens  usage.completion_tokens; without usage, the tokenizer's count of the text when we
                 have both, else the number of token events
  TPOT           (latency - TTFT) / (output tokens - 1), for requests of more than one token
  ITL            every gap between token events, of every request, in one list
  E2EL           the request's latency (start -> last token event)
Over the run:
  *_throughput          per second of the whole run (`duration`)
  request_goodput       requests that met every SLO given with --goodput, per second; a request
                        of one token counts as TPOT 0 there
  max_output_tokens_per_s  the most token events that fell into one 1-second bucket, buckets
                        counted from the first request's start
  max_concurrent_requests  the most requests in flight at once: a sweep over [start, end) intervals
                        in which a request ending at the moment another starts does not overlap it
Mean, median, std (population) and percentiles (linear interpolation) are numpy's, 0 for none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:   # the client pulls in aiohttp, which the command line does not need to start
    from deepinfer.bench.serving.client import StreamResult

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """--goodput ttft:MS tpot:MS e2el:MS -> {"ttft": MS, ...}, checked."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            number = float(value) if sep else None
        except ValueError:
            number = None
        if number is None:
            raise ValueError(f"--goodput takes KEY:VALUE pairs (milliseconds), got {pair!r}")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: unknown metric {name!r}; it takes {', '.join(GOODPUT_METRICS)}")
        if number < 0:
            raise ValueError(f"--goodput: {name} must be >= 0 ms, got {number}")
        slos[name] = number
    return slos


def parse_percentile_metrics(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)}; it takes "
                         f"{', '.join(PERCENTILE_METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers separated by commas, got {text!r}") from None
    if any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {text!r}")
    return values


def percentile_key(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9" (vLLM's key names)."""
    return f"p{int(p)}" if p == int(p) else f"p{p}"


def output_length(result: StreamResult, tokenizer=None) -> int:
    if result.output_tokens:
        return result.output_tokens
    if tokenizer is not None and result.text:
        return len(tokenizer.encode(result.text, add_special_tokens=False).ids)
    return result.token_events


def token_times(result: StreamResult) -> np.ndarray:
    """When each token event of a request came, on the perf_counter clock."""
    return np.cumsum([result.start_time + result.ttft, *result.itl])


def peak_output_per_second(results: Sequence[StreamResult]) -> float:
    if not results:
        return 0.0
    first = min(r.start_time for r in results)
    times = np.concatenate([token_times(r) for r in results]) - first
    return float(np.bincount(times.astype(np.int64)).max())


def peak_concurrency(results: Sequence[StreamResult]) -> int:
    # (time, +1 start / -1 end); sorting puts an end before a start at the same instant.
    events = sorted([(r.start_time, 1) for r in results] + [(r.start_time + r.latency, -1) for r in results])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def _stats(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0]) * 1000
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def summarize(results: Sequence[StreamResult], duration: float, percentiles: Sequence[float],
              metrics: Sequence[str] = PERCENTILE_METRICS, goodput: dict[str, float] | None = None,
              tokenizer=None) -> dict:
    """The run's result with vLLM's keys; the per-request lists are there too (see report.py)."""
    ok = [r for r in results if r.success]
    output_lens = [output_length(r, tokenizer) if r.success else 0 for r in results]
    ok_lens = [n for r, n in zip(results, output_lens) if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    # TPOT over requests of more than one token; goodput counts a one-token request as TPOT 0.
    tpot_all = [(r.latency - r.ttft) / (n - 1) if n > 1 else 0.0 for r, n in zip(ok, ok_lens)]
    tpots = [t for t, n in zip(tpot_all, ok_lens) if n > 1]
    itls = [gap for r in ok for gap in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(output_lens)

    good = None
    if goodput:
        limits = {name: ms / 1000 for name, ms in goodput.items()}
        per_request = {"ttft": ttfts, "tpot": tpot_all, "e2el": e2els}
        met = sum(all(per_request[name][i] <= limit for name, limit in limits.items())
                  for i in range(len(ok)))
        good = met / duration

    summary = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "request_goodput": good,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_output_per_second(ok),
        "max_concurrent_requests": peak_concurrency(ok),
        # Per request, in the order sent (kept in the JSON with --save-detailed).
        "input_lens": [r.prompt_len for r in results], "output_lens": output_lens,
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results], "start_times": [r.start_time for r in results],
        "queue_times": [r.queue_time for r in results], "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in metrics:
        summary.update(_stats(name, series[name], percentiles))
    return summary
