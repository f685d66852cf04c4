"""Prefill/decode disaggregation beside a colocated replica: TTFT, ITL and the answers.

    python benchmarks/router_pd.py                          # smoke size
    python benchmarks/router_pd.py --requests 40 --prompt-words 700 --max-tokens 32 --json out.json

Colocated: one `deepinfer serve` replica. Disaggregated: a `--kv-role prefill` and a `--kv-role
decode` replica on one dir:// KV store behind `deepinfer router --prefill URL --backend URL`. The
same streamed chat requests (each with a prompt of its own of --prompt-words words, --max-tokens
greedy tokens, --concurrency at once) go to each; reported per setup: TTFT and inter-token
latency P50/P99, the decode side's cached prompt tokens (what it loaded instead of computing),
and how many answers equal the colocated ones. In bf16 a few may differ after some tokens: the
decode side computes only the prompt's last partial block, a step of another shape than the
colocated prefill, and bf16 products round differently by shape (on the CPU a few-row step takes
the int4 kernel); --dtype float32 removes that. On one 2-core machine the three processes of
the disaggregated setup share the cores, so this measures correctness and the hand-over's cost,
not the separation of prefill and decode load that P/D buys on separate machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.bench_common import write_json  # noqa: E402
from benchmarks.router_policies import HEADERS, pct, start_router, stop  # noqa: E402
from tests.e2e.server_process import start_server, stop_server  # noqa: E402

WORDS = ("river", "mountain", "city", "garden", "engine", "library", "harbor", "forest", "bridge", "market")


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, times, text, cached = time.perf_counter(), [], [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=HEADERS) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                text.append(chunk["choices"][0]["delta"]["content"])
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": times[0] - start if times else None, "itl": [b - a for a, b in zip(times, times[1:])],
            "text": "".join(text), "cached": cached}


async def workload(url: str, model: str, texts: list[str], args) -> list[dict]:
    semaphore = asyncio.Semaphore(args.concurrency)

    async def one(client, prompt):
        async with semaphore:
            return await stream_chat(client, url, model, prompt, args.max_tokens)

    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(one(client, t) for t in texts)))


def summary(results: list[dict]) -> dict:
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [x for r in results for x in r["itl"]]
    return {"ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "cached_tokens": sum(r["cached"] for r in results)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="replica model: smollm2 (the default), gemma3-270m (its GGUF, "
                   "with Gemma 3's turn template: the GGUF has none) or a path")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="the replicas' --dtype (float32: answers free of bf16 "
                   "rounding that differs with a step's shape)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    rng = random.Random(args.seed)
    texts = [f"Text {i}: " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) + " Summarize it."
             for i in range(args.requests)]
    workdir = tempfile.mkdtemp(prefix="router-pd-")
    model_args = ("--dtype", args.dtype)
    if args.model:
        from benchmarks.kv_store_serving import resolve_model

        served = resolve_model(args.model, 2048)
        model_args += ("--model", served.path)
        if served.chat_template is not None:
            model_args += ("--chat-template", served.chat_template)
    store = ("--kv-store", f"dir://{os.path.join(workdir, 'store')}")
    results = {}
    servers = []
    colocated = start_server(os.path.join(workdir, "colocated.log"), *model_args)
    servers.append(colocated)
    try:
        model = httpx.get(colocated.base_url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
        asyncio.run(workload(colocated.base_url, model, ["warm up"], args))
        colocated_out = asyncio.run(workload(colocated.base_url, model, texts, args))
        results["colocated"] = summary(colocated_out)
        stop_server(colocated)
        servers.remove(colocated)
        prefill = start_server(os.path.join(workdir, "prefill.log"), *model_args, *store, "--kv-role", "prefill")
        servers.append(prefill)
        decode = start_server(os.path.join(workdir, "decode.log"), *model_args, *store, "--kv-role", "decode")
        servers.append(decode)
        process, url = start_router(workdir, [decode], [], "least_load", "--prefill", prefill.base_url)
        try:
            asyncio.run(workload(url, model, ["warm up"], args))
            pd_out = asyncio.run(workload(url, model, texts, args))
        finally:
            stop(process)
        results["disaggregated"] = summary(pd_out)
        results["disaggregated"]["same_answers"] = sum(a["text"] == b["text"] for a, b in zip(pd_out, colocated_out))
        results["requests"] = len(texts)
    finally:
        for s in servers:
            stop_server(s)
    print(json.dumps(results, indent=2))
    write_json(args.json, {"args": vars(args), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
