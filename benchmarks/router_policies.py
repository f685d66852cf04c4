"""Routing policies over real replicas: prefix hit rate and TTFT of a multi-turn chat workload per
policy, beside one replica alone, and the router's added latency beside direct requests.

    python benchmarks/router_policies.py                       # smoke size: 3 replicas, 8 conversations
    python benchmarks/router_policies.py --conversations 100 --turns 4 --concurrency 16 \
        --policies round_robin least_load cache_aware cost --json out.json

Replicas are `deepinfer serve` processes on loopback (tests/e2e/server_process.py, the embedded
SmolLM2-135M-Instruct unless --model), each publishing KV events; one `deepinfer router` process
per policy. Workload: conversations of --turns user turns, each opening with one of --system-prompts
long shared system prompts; every turn resends the whole history (so each turn's prompt extends the
previous one), streamed, --max-tokens tokens, greedy. Each policy gets its own system prompts (a
run tag in them), so no policy inherits another's warm cache.

Reported per policy: prefix hit rate = sum of usage cached_tokens / sum of prompt tokens, TTFT
P50/P99 (first content chunk), requests per replica. "single" is the same workload against one
replica directly (every conversation's history is on it: the hit rate routing tries to reach).
Overhead: --overhead-requests sequential 1-token completions, alternately direct and through a
least_load router; the P50/P99 of each and their difference. With --pin the replicas run on the
last core and the router and client on the rest, so that on a small box the router's time is not
a wait for a replica's threads (the overhead target is measured with one replica: --replicas 1).

On a GPU: `--model llama3-8b` (a shape of kv_store_serving.py: random weights, word tokens) and
`--replica-args "--gpu-memory-utilization 0.3"` so that the replicas share the card, each at its
fraction, e.g. `DEEPINFER_ACCELERATOR=cuda python benchmarks/router_policies.py --model llama3-8b
--replicas 2 --replica-args "--gpu-memory-utilization 0.42" --conversations 64 --turns 4
--system-words 2000 --concurrency 16 --max-tokens 64 --policies round_robin cache_aware`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from kv_store_serving import SHAPES, resolve_model  # noqa: E402
from kv_store_serving import start as start_replica  # noqa: E402

from tests.e2e.server_process import API_KEY, free_port, stop_server  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WORDS = ("river", "mountain", "city", "garden", "engine", "library", "harbor", "forest", "bridge", "market")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def start_router(workdir: str, backends, events, policy: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.path.join(workdir, f"router-{policy}-{port}.log"), "w")
    args = [sys.executable, "-m", "deepinfer", "router", "--host", "127.0.0.1", "--port", str(port),
            "--api-key", API_KEY, "--policy", policy, "--uvicorn-log-level", "warning",
            "--backend", *[b.base_url for b in backends], *(("--kv-events", *events) if events else ()), *extra]
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                time.sleep(0.5)   # the KV-event subscriptions settle
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the router did not start")


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def conversations(args, tag: str, vocab: int | None = None) -> list[list[str]]:
    """vocab: a shape's word tokens t0..t{vocab-1} (its tokenizer knows no English), else English words."""
    rng = random.Random(args.seed)
    if vocab is None:
        words = WORDS
        system = "[{tag}] You are assistant {k}."
        question = "Question {t} of conversation {c}: tell me about the"
    else:
        words = tuple(f"t{i}" for i in rng.sample(range(10, vocab), 1000))
        system = "t1 t{k} t2 " + " ".join(f"t{3 + ord(ch) % 7}" for ch in tag)   # the run tag, in word tokens
        question = "t3 t{t} t4 t{c} t5"
    systems = [system.format(tag=tag, k=10 + k) + " " + " ".join(rng.choice(words) for _ in range(args.system_words))
               for k in range(args.system_prompts)]
    out = []
    for c in range(args.conversations):
        turns = [systems[c % len(systems)]]
        turns += [question.format(t=10 + t, c=10 + c) + " " + " ".join(rng.choice(words) for _ in range(8))
                  for t in range(args.turns)]
        out.append(turns)
    return out


async def run_workload(url: str, model: str, args, tag: str, vocab: int | None = None) -> dict:
    ttfts, prompt_tokens, cached_tokens, per_replica = [], 0, 0, {}
    semaphore = asyncio.Semaphore(args.concurrency)

    async def one(client: httpx.AsyncClient, convo: list[str]) -> None:
        nonlocal prompt_tokens, cached_tokens
        async with semaphore:
            messages = [{"role": "system", "content": convo[0]}]
            for turn in convo[1:]:
                messages.append({"role": "user", "content": turn})
                body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                        "stream": True, "stream_options": {"include_usage": True}}
                start, first, text = time.perf_counter(), None, []
                async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=HEADERS) as r:
                    replica = r.headers.get("x-deepinfer-replica", url)
                    per_replica[replica] = per_replica.get(replica, 0) + 1
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                            first = first or time.perf_counter()
                            text.append(chunk["choices"][0]["delta"]["content"])
                        if chunk.get("usage"):
                            prompt_tokens += chunk["usage"]["prompt_tokens"]
                            cached_tokens += (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                ttfts.append((first or time.perf_counter()) - start)
                messages.append({"role": "assistant", "content": "".join(text)})

    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, c) for c in conversations(args, tag, vocab)))
        elapsed = time.perf_counter() - start
    return {"hit_rate": cached_tokens / max(prompt_tokens, 1), "ttft_p50_ms": 1e3 * pct(ttfts, 50),
            "ttft_p99_ms": 1e3 * pct(ttfts, 99), "requests": len(ttfts), "seconds": elapsed,
            "requests_per_s": len(ttfts) / elapsed,
            "per_replica": sorted(per_replica.values(), reverse=True)}


def overhead(direct: str, routed: str, model: str, n: int, prompt: str = "Hello") -> dict:
    times: dict[str, list[float]] = {"direct": [], "router": []}
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with httpx.Client(timeout=60, headers=HEADERS) as client:
        for url in (direct, routed):   # warm both connection paths
            client.post(url + "/v1/completions", json=body)
        for _ in range(n):
            for name, url in (("direct", direct), ("router", routed)):
                start = time.perf_counter()
                client.post(url + "/v1/completions", json=body).raise_for_status()
                times[name].append(time.perf_counter() - start)
    out = {}
    for q in (50, 99):
        d, r = 1e3 * pct(times["direct"], q), 1e3 * pct(times["router"], q)
        out[f"p{q}"] = {"direct_ms": d, "router_ms": r, "added_ms": r - d}
    return out


def plot(results: dict, path: str) -> None:
    from benchmarks.bench_common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    results = results.get("results", results)
    names = [n for n in results if n not in ("overhead", "args")]
    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(10, 3.6))
    hit.bar(names, [results[n]["hit_rate"] for n in names], color="tab:blue")
    hit.set_ylabel("prefix hit rate")
    hit.set_ylim(0, 1)
    x = range(len(names))
    ttft.bar([i - 0.2 for i in x], [results[n]["ttft_p50_ms"] for n in names], width=0.4, label="P50")
    ttft.bar([i + 0.2 for i in x], [results[n]["ttft_p99_ms"] for n in names], width=0.4, label="P99")
    ttft.set_xticks(list(x), names)
    ttft.set_ylabel("TTFT (ms)")
    ttft.legend()
    for axis in (hit, ttft):
        axis.tick_params(axis="x", labelrotation=20)
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help=f"replica model: smollm2 (the embedded SmolLM2-135M-Instruct), "
                   f"gemma3-270m, a shape of random weights ({', '.join(SHAPES)}) or a path")
    p.add_argument("--replica-args", default="", help="more flags for every replica, e.g. "
                   "\"--gpu-memory-utilization 0.42\" for replicas sharing one GPU")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["round_robin", "least_load", "cache_aware", "cost"])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--overhead-requests", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--plot", default=None, help="a PNG of hit rate and TTFT per policy (needs matplotlib)")
    p.add_argument("--plot-from", default=None, help="only draw --plot from a saved --json result")
    p.add_argument("--pin", action="store_true",
                   help="replicas on the last CPU core, the router and this client on the others (Linux): "
                        "on a small box the router then never waits for a replica's torch threads")
    args = p.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot or os.path.splitext(args.plot_from)[0] + ".png")
        return 0

    workdir = tempfile.mkdtemp(prefix="router-bench-")
    served = resolve_model(args.model, 4096)
    vocab = served.config["vocab_size"] if served.tokenizer is None else None
    ports = [free_port() for _ in range(args.replicas)]
    replicas = []
    cores = sorted(os.sched_getaffinity(0))
    if args.pin and len(cores) < 2:
        p.error("--pin needs at least two CPU cores")
    try:
        if args.pin:   # children inherit the affinity they are started with
            os.sched_setaffinity(0, cores[-1:])
        for i, port in enumerate(ports):
            replicas.append(start_replica(served, os.path.join(workdir, f"replica{i}.log"), None,
                                          "--kv-events-endpoint", f"tcp://*:{port}", *shlex.split(args.replica_args)))
        if args.pin:
            os.sched_setaffinity(0, cores[:-1])
        events = [f"tcp://127.0.0.1:{port}" for port in ports]
        model = httpx.get(replicas[0].base_url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
        results = {"single": asyncio.run(run_workload(replicas[0].base_url, model, args, "single", vocab))}
        for policy in args.policies:
            process, url = start_router(workdir, replicas, events, policy)
            try:
                results[policy] = asyncio.run(run_workload(url, model, args, policy, vocab))
            finally:
                stop(process)
        if args.overhead_requests:
            # least_load: no tokenize round trip, so this is the proxy's own cost.
            process, url = start_router(workdir, replicas, events, "least_load")
            try:
                results["overhead"] = overhead(replicas[0].base_url, url, model, args.overhead_requests,
                                               "Hello" if vocab is None else "t11 t12")
            finally:
                stop(process)
    finally:
        for r in replicas:
            stop_server(r)

    print(f"{args.replicas} replicas, {args.conversations} conversations x {args.turns} turns, "
          f"{args.system_prompts} system prompts, concurrency {args.concurrency}, max_tokens {args.max_tokens}")
    print("| policy | prefix hit rate | TTFT P50 ms | TTFT P99 ms | requests per replica |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if name != "overhead":
            print(f"| {name} | {r['hit_rate']:.3f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                  f"{r['per_replica']} |")
    if "overhead" in results:
        for q, o in results["overhead"].items():
            print(f"overhead {q}: direct {o['direct_ms']:.2f} ms, router {o['router_ms']:.2f} ms, "
                  f"added {o['added_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
