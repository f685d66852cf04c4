"""What an HTTP client library costs per request, against one real replica on loopback: httpx
(the router's client to its replicas until this measure moved it to aiohttp) beside aiohttp (the
router's client now, and `deepinfer bench serve`'s).

    python benchmarks/http_client_cost.py [--requests 300] [--warmup 20]

One `deepinfer serve` replica of the embedded SmolLM2 on the last CPU core, this client on the
others; --requests sequential 1-token completions, alternately through each library, one
keep-alive connection each. The replica's time is the same for both, so the difference of the
two is the difference in client cost: what a router hop through that library adds beyond the
other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import aiohttp
import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.e2e.server_process import API_KEY, start_server, stop_server  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def measure(url: str, requests: int, warmup: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
    async with httpx.AsyncClient(headers=HEADERS, timeout=60) as hx, aiohttp.ClientSession(headers=HEADERS) as ah:
        model = (await hx.get(url + "/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        for i in range(warmup + requests):
            for name in times:
                start = time.perf_counter()
                if name == "httpx":
                    response = await hx.post(url + "/v1/completions", json=body)
                    response.raise_for_status()
                else:
                    async with ah.post(url + "/v1/completions", json=body) as response:
                        response.raise_for_status()
                        await response.read()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:   # the replica inherits the last core; this client keeps the others
        os.sched_setaffinity(0, cores[-1:])
    server = start_server(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"http-client-cost-{os.getpid()}.log"))
    if len(cores) > 1:
        os.sched_setaffinity(0, cores[:-1])
    try:
        times = asyncio.run(measure(server.base_url, args.requests, args.warmup))
    finally:
        stop_server(server)
    for name, values in times.items():
        values.sort()
        p50, p90 = values[len(values) // 2], values[int(len(values) * 0.9)]
        print(f"{name:>8}: P50 {p50 * 1e3:.2f} ms, P90 {p90 * 1e3:.2f} ms ({len(values)} requests)")
    d50 = sorted(times["httpx"])[len(times["httpx"]) // 2] - sorted(times["aiohttp"])[len(times["aiohttp"]) // 2]
    print(f"httpx - aiohttp at P50: {d50 * 1e3:+.2f} ms")


if __name__ == "__main__":
    main()
