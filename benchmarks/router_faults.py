"""The router under faults and overload, with real replicas on loopback.

    python benchmarks/router_faults.py                      # smoke size: 3 replicas, 120 requests
    python benchmarks/router_faults.py --requests 500 --concurrency 24 --overload-seconds 40 --json out.json

Kill: --requests streamed chat completions (a short prompt each, --max-tokens tokens) go through a
least_load router over --replicas replicas (the embedded SmolLM2-135M unless --model), at most
--concurrency at once. When a third of them are done, replica 1 (its server and engine core) is
killed with SIGKILL. Each request ends one of three ways: answered (200, content, [DONE], no error
event), a clean error (an error status, or a stream that ends with the route's error event), or
hung (no end within --request-timeout-s: the target is none). Reported beside: the router's
retries (requests that failed on the killed replica before their first byte and were answered by
another), the replicas that answered, and, once the killed replica is started again on its port,
how long the router took to route to it again.

Overload: the sustainable rate R is measured first (a closed loop at --concurrency, requests per
second), then the unloaded TTFT (one request at a time); then requests arrive open-loop (Poisson)
at --overload-factor x R for --overload-seconds through a router with admission on
(--admission: by default --max-requests-per-replica 1). Reported: the share answered 429 (with Retry-After), and the
admitted requests' TTFT P50/P99 against the unloaded P99 (target: within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.bench_common import write_json  # noqa: E402
from benchmarks.router_policies import HEADERS, pct, start_router, stop  # noqa: E402
from tests.e2e.server_process import free_port, start_server, stop_server  # noqa: E402


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: how it ended, its TTFT, and which replica answered."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start, first, content, error_event, done = time.perf_counter(), None, False, False, False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=HEADERS) as r:
            replica = r.headers.get("x-deepinfer-replica", "")
            if r.status_code != 200:
                await r.aread()
                return {"end": "error", "status": r.status_code, "replica": replica,
                        "retry_after": r.headers.get("retry-after")}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error_event = True
                elif chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter()
                    content = True
    except httpx.TimeoutException:
        return {"end": "hung", "status": None, "replica": ""}
    except httpx.HTTPError as exc:   # the connection itself broke: the client saw no clean end
        return {"end": "broken", "status": None, "replica": "", "error": type(exc).__name__}
    end = "answered" if done and content and not error_event else "error"
    return {"end": end, "status": 200, "replica": replica,
            "ttft_s": (first - start) if first else None, "stream_error": error_event}


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("river", "mountain", "city", "garden", "engine", "library", "harbor", "forest", "bridge", "market")
    return [f"Request {i}: write one sentence about the " + " ".join(rng.choice(words) for _ in range(6))
            for i in range(n)]


def router_counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"deepinfer_router_{name}_total"))


async def kill_run(url: str, model: str, replicas, args) -> dict:
    semaphore = asyncio.Semaphore(args.concurrency)
    results: list[dict] = []
    killed_at: list[float] = []
    victim = replicas[1]

    async def run(client, prompt):
        async with semaphore:
            results.append(await one_request(client, url, model, prompt, args.max_tokens))
            if len(results) == args.requests // 3 and not killed_at:
                os.killpg(victim.process.pid, signal.SIGKILL)   # the server and its engine core
                killed_at.append(time.perf_counter())

    timeout = httpx.Timeout(args.request_timeout_s, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(run(client, p) for p in prompts(args.requests, args.seed)))
        elapsed = time.perf_counter() - start
    ends = {k: sum(r["end"] == k for r in results) for k in ("answered", "error", "hung", "broken")}
    by_replica: dict[str, int] = {}
    for r in results:
        if r["end"] == "answered":
            by_replica[r["replica"]] = by_replica.get(r["replica"], 0) + 1
    return {"requests": len(results), **ends, "stream_errors": sum(bool(r.get("stream_error")) for r in results),
            "answered_by": by_replica, "seconds": elapsed, "killed": victim.base_url}


def wait_readded(router_url: str, replica_url: str, timeout_s: float = 180) -> float | None:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        state = httpx.get(router_url + "/router/replicas", headers=HEADERS, timeout=5).json()["replicas"]
        if any(r.get("url") == replica_url and r.get("healthy") for r in state):
            return time.perf_counter() - start
        time.sleep(0.2)
    return None


async def closed_loop(url: str, model: str, n: int, concurrency: int, max_tokens: int, seed: int) -> tuple[float, list]:
    semaphore = asyncio.Semaphore(concurrency)
    out: list[dict] = []

    async def run(client, prompt):
        async with semaphore:
            out.append(await one_request(client, url, model, prompt, max_tokens))

    async with httpx.AsyncClient(timeout=120) as client:
        start = time.perf_counter()
        await asyncio.gather(*(run(client, p) for p in prompts(n, seed)))
        return n / (time.perf_counter() - start), out


async def open_loop(url: str, model: str, rate: float, seconds: float, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        start, i = time.perf_counter(), 0
        texts = prompts(int(rate * seconds * 2) + 10, seed)
        while time.perf_counter() - start < seconds:
            tasks.append(asyncio.create_task(one_request(client, url, model, texts[i % len(texts)], max_tokens)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def overload(workdir: str, replicas, model: str, args) -> dict:
    process, url = start_router(workdir, replicas, [], "least_load")
    try:
        rate, _ = asyncio.run(closed_loop(url, model, 4 * args.concurrency, args.concurrency, args.max_tokens,
                                          args.seed))
        _, unloaded = asyncio.run(closed_loop(url, model, 20, 1, args.max_tokens, args.seed + 1))
    finally:
        stop(process)
    unloaded_ttfts = [r["ttft_s"] for r in unloaded if r.get("ttft_s")]
    process, url = start_router(workdir, replicas, [], "least_load", *args.admission, "--metrics-interval-s", "0.2")
    try:
        loaded = asyncio.run(open_loop(url, model, args.overload_factor * rate, args.overload_seconds,
                                       args.max_tokens, args.seed + 2))
    finally:
        stop(process)
    admitted = [r["ttft_s"] for r in loaded if r["end"] == "answered" and r.get("ttft_s")]
    rejected = [r for r in loaded if r["status"] == 429]
    out = {"admission": " ".join(args.admission), "sustainable_rps": rate, "offered_rps": args.overload_factor * rate,
           "requests": len(loaded), "rejected_429": len(rejected), "rejected_share": len(rejected) / max(len(loaded), 1),
           "retry_after_on_every_429": all(r.get("retry_after") for r in rejected),
           "unloaded_ttft_p99_ms": 1e3 * pct(unloaded_ttfts, 99),
           "admitted_ttft_p50_ms": 1e3 * pct(admitted, 50), "admitted_ttft_p99_ms": 1e3 * pct(admitted, 99),
           "other_errors": sum(r["end"] != "answered" and r["status"] != 429 for r in loaded)}
    out["p99_ratio"] = out["admitted_ttft_p99_ms"] / out["unloaded_ttft_p99_ms"]
    return out


def kill(workdir: str, replicas, ports, model_args, model: str, args) -> dict:
    process, url = start_router(workdir, replicas, [], "least_load", "--health-interval-s", "0.5")
    try:
        retries_before = router_counter(url, "retries")
        out = asyncio.run(kill_run(url, model, replicas, args))
        out["router_retries"] = router_counter(url, "retries") - retries_before
        victim = replicas[1]
        replicas[1] = start_server(os.path.join(workdir, "replica1-restarted.log"), *model_args, port=ports[1])
        out["readded_after_restart_s"] = wait_readded(url, victim.base_url)
        return out
    finally:
        stop(process)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="replica model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--overload-factor", type=float, default=3.0)
    p.add_argument("--overload-seconds", type=float, default=15.0)
    p.add_argument("--admission", nargs="+", default=["--max-requests-per-replica", "1"],
                   help="the router's admission flags in the overload part")
    p.add_argument("--parts", default="overload,kill", help="comma-separated: overload, kill")
    p.add_argument("--pin", action="store_true",
                   help="replicas on the last CPU core, the router and this client on the others, so the "
                        "router's share is not taken from the replicas (overload part only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    if args.pin and (len(cores) < 2 or "kill" in args.parts.split(",")):
        p.error("--pin needs at least two CPU cores and --parts overload (a restarted replica would "
                "land on the router's cores)")
    workdir = tempfile.mkdtemp(prefix="router-faults-")
    model_args = ("--model", args.model) if args.model else ()
    ports = [free_port() for _ in range(args.replicas)]
    replicas, results = [], {}
    parts = args.parts.split(",")
    try:
        if args.pin:   # children inherit the affinity they are started with
            os.sched_setaffinity(0, cores[-1:])
        for i, port in enumerate(ports):
            replicas.append(start_server(os.path.join(workdir, f"replica{i}.log"), *model_args, port=port))
        if args.pin:
            os.sched_setaffinity(0, cores[:-1])
        model = httpx.get(replicas[0].base_url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
        if "overload" in parts:   # first, on healthy replicas
            results["overload"] = overload(workdir, replicas, model, args)
        if "kill" in parts:
            results["kill"] = kill(workdir, replicas, ports, model_args, model, args)
    finally:
        for r in replicas:
            stop_server(r)

    print(json.dumps(results, indent=2))
    write_json(args.json, {"args": vars(args), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
