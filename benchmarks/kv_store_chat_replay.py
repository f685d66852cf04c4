"""KV store, multi-turn chat replay through a real server: conversations on a few shared system
prompts, more of them than the device KV pool holds, with a KV store behind the pool and without.

    python benchmarks/kv_store_chat_replay.py [--model smollm2|gemma3-270m|PATH] [--conversations 200]
        [--turns 3] [--system-prompts 4] [--system-tokens 1024] [--first-tokens 256]
        [--turn-tokens 64] [--answer-tokens 8] [--concurrency 4] [--pool-fraction 0.25]
        [--modes no-store,store] [--store dir|redis] [--workdir DIR] [--seed 0]
        [--out replay.json] [--plot replay.png] [--plot-from replay.json]

How to run: the defaults (SmolLM2, 200 conversations x 3 turns, both modes) take about 6-10
minutes on the 2-core CPU box; the store mode writes about 2 GB into a temp dir (--workdir),
removed at the end. A quick check: `--conversations 16 --turns 2 --system-tokens 256
--first-tokens 128`. `--store redis` starts a redis-server of its own (Debian's redis-server).
Times are for a quiet machine: on a shared 2-core box the engine's threads wait on each other and
TTFTs swing 3-5x between runs.

Conversation c has system prompt c mod --system-prompts (each ~--system-tokens tokens of this
Python's standard-library source), a first user turn of --first-tokens tokens and later ones
of --turn-tokens (more of that source, never shared), and --answer-tokens greedy tokens per
answer (ignore_eos), which go back into the conversation as the assistant's message. Turns go
round-robin over the conversations (turn 1 of all, then turn 2 of all, ...), --concurrency
requests in flight, so a conversation's own blocks have left the device pool when it comes
back: the pool (--num-kv-blocks, so on a GPU too) holds --pool-fraction of the working set (the
system prompts and every conversation's final length), or --concurrency + 1 requests of the
longest length if that is more. Blocks are of one layer group: a model with several (Gemma's
sliding-window and global layers) holds fewer tokens in as many blocks. The same server flags in both modes; "store"
adds --kv-store (a fresh one). Per request: TTFT (to the first streamed token event, queueing
included) and usage.prompt_tokens_details.cached_tokens. Per mode and turn: hit rate (cached /
prompt tokens), TTFT P50 and P99; per mode: prefill tokens computed, and the store's own hit
tokens and writes (/metrics). Prefill saved = computed without the store - computed with it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    add_output_args,
    machine_info,
    percentile,
    print_table,
    replot,
    save_and_plot,
    write_json,
)
from kv_host_tier import kv_bytes_per_block, per_turn, plot
from kv_store_serving import (
    Store,
    TextSource,
    chat,
    child_environment,
    resolve_model,
    start,
    stop,
    tier_counters,
)

MODES = ("no-store", "store")
TEMPLATE_TOKENS = 16   # what a chat template adds per message, for sizing (SmolLM2's adds ~5)
BLOCK = 16


def build_conversations(model, args) -> tuple[list[str], list[list[str]]]:
    """The system prompts, and per conversation the text of each user turn."""
    texts = TextSource(model, args.seed)
    systems = [f"You review code. House style, part {s}:\n{texts.take(args.system_tokens)}"
               for s in range(args.system_prompts)]
    users = [[f"Conversation {c}. Read this code:\n{texts.take(args.first_tokens)}"]
             + [f"And this part:\n{texts.take(args.turn_tokens)}" for _ in range(args.turns - 1)]
             for c in range(args.conversations)]
    return systems, users


async def replay(server, systems: list[str], users: list[list[str]], args) -> list[dict]:
    import aiohttp

    histories = [[{"role": "system", "content": systems[c % len(systems)]}] for c in range(len(users))]
    records: list[dict] = []
    gate = asyncio.Semaphore(args.concurrency)
    started = time.perf_counter()

    async def one(session, c: int, t: int) -> None:
        async with gate:
            messages = [*histories[c], {"role": "user", "content": users[c][t]}]
            result = await chat(session, server, messages, args.answer_tokens, keep_text=True)
        histories[c] = [*messages, {"role": "assistant", "content": result.text}]
        records.append({"conv": c, "turn": t + 1, "prompt_tokens": result.prompt_len, "cached": result.cached_tokens,
                        "ttft_s": result.ttft, "turn_s": result.latency})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await chat(session, server, [{"role": "user", "content": "Say hello."}], 2)   # warm-up, untimed
        for t in range(args.turns):
            await asyncio.gather(*(one(session, c, t) for c in range(len(users))))
            rows = [r for r in records if r["turn"] == t + 1]
            print(f"    turn {t + 1}: hit {sum(r['cached'] for r in rows) / sum(r['prompt_tokens'] for r in rows):.3f}, "
                  f"TTFT P50 {percentile([r['ttft_s'] for r in rows], 50) * 1e3:.1f} ms, "
                  f"P99 {percentile([r['ttft_s'] for r in rows], 99) * 1e3:.1f} ms; "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    return sorted(records, key=lambda r: (r["turn"], r["conv"]))


def pool_size(model, args) -> tuple[int, int, int]:
    """(working set tokens, device pool blocks, max_model_len)."""
    final = args.first_tokens + (args.turns - 1) * args.turn_tokens + args.turns * args.answer_tokens
    final += (2 * args.turns + 1) * TEMPLATE_TOKENS
    working_set = args.system_prompts * args.system_tokens + args.conversations * final
    max_len = args.system_tokens + final + 256
    # At least what --concurrency requests of max_len hold at once (and one more), or the pool
    # thrashes on the requests in flight rather than on the conversations.
    tokens = max(args.pool_fraction * working_set, (args.concurrency + 1) * max_len)
    return working_set, math.ceil(tokens / BLOCK) + 1, max_len   # + the null block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | gemma3-270m | a path")
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--first-tokens", type=int, default=256)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="device KV pool / working set")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--store", choices=("dir", "redis"), default="dir", help="the store of the store mode")
    parser.add_argument("--workdir", default=None, help="where the store and server logs go (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    add_output_args(parser)
    args = parser.parse_args()
    if replot(args, plot):
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    if min(args.conversations, args.turns, args.system_prompts, args.system_tokens, args.first_tokens,
           args.turn_tokens, args.answer_tokens, args.concurrency) < 1 or not 0 < args.pool_fraction <= 1:
        parser.error("counts and lengths must be >= 1, --pool-fraction in (0, 1]")
    child_environment()
    workdir = args.workdir or tempfile.mkdtemp(prefix="kv-store-replay-")
    os.makedirs(workdir, exist_ok=True)
    model = resolve_model(args.model, 0)
    working_set, pool, max_len = pool_size(model, args)
    systems, users = build_conversations(model, args)
    result = {"benchmark": "kv_store_chat_replay", "machine": machine_info(), "args": vars(args), "model": model.name,
              "path": model.path, "working_set_tokens": working_set, "num_kv_blocks": pool,
              "kv_bytes_per_block": kv_bytes_per_block(model.config, BLOCK, "bfloat16"),
              "max_model_len": max_len, "modes": {}}
    print(f"{model.name}: {args.conversations} conversations x {args.turns} turns on {args.system_prompts} system "
          f"prompts; working set ~{working_set} tokens, device pool {pool} blocks of {BLOCK}", flush=True)
    flags = ["--max-model-len", str(max_len), "--num-kv-blocks", str(pool), "--block-size", str(BLOCK)]
    for mode in modes:
        store = Store(args.store, workdir) if mode == "store" else None
        print(f"  {mode}" + (f": {store.url}" if store else ""), flush=True)
        try:
            t = time.perf_counter()
            server = start(model, os.path.join(workdir, f"{mode}.log"), store.url if store else None, *flags)
            try:
                t = time.perf_counter()
                records = asyncio.run(replay(server, systems, users, args))
                run_s = time.perf_counter() - t
                counters = tier_counters(server)
            finally:
                stop(server)
        finally:
            if store is not None:
                store.close()
                if store.kind == "dir":
                    shutil.rmtree(store.path, ignore_errors=True)
        prompt = sum(r["prompt_tokens"] for r in records)
        cached = sum(r["cached"] for r in records)
        ttfts = [r["ttft_s"] for r in records]
        result["modes"][mode] = {"run_s": run_s, "turns": per_turn(records, args.turns), "requests": records,
                                 "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
                                 "hit_rate": cached / prompt, "ttft_p50_s": percentile(ttfts, 50),
                                 "ttft_p99_s": percentile(ttfts, 99), "store_counters": counters}
        write_json(args.out, result)
    if set(MODES) <= set(result["modes"]):
        result["prefill_tokens_saved"] = (result["modes"]["no-store"]["computed_tokens"]
                                          - result["modes"]["store"]["computed_tokens"])
    report(result)
    save_and_plot(args, result, plot)


def report(result: dict) -> None:
    print()
    rows = [{"mode": m, **r, **{k: r[k] * 1e3 for k in ("ttft_p50_s", "ttft_p99_s")}}
            for m, v in result["modes"].items() for r in v["turns"]]
    print_table(rows, [("mode", "mode", ""), ("turn", "turn", "d"), ("prompt_tokens_mean", "prompt", ".0f"),
                       ("hit_rate", "hit rate", ".3f"), ("ttft_p50_s", "TTFT P50 ms", ".1f"),
                       ("ttft_p99_s", "P99 ms", ".1f")])
    print()
    print_table([{"mode": m, **v, "ttft_p50_ms": v["ttft_p50_s"] * 1e3, "ttft_p99_ms": v["ttft_p99_s"] * 1e3,
                  "store_hits": v["store_counters"].get("hits"), "store_writes": v["store_counters"].get("writes")}
                 for m, v in result["modes"].items()],
                [("mode", "mode", ""), ("hit_rate", "hit rate", ".3f"), ("computed_tokens", "prefill computed", "d"),
                 ("store_hits", "store hit tokens", ".0f"), ("store_writes", "store writes", ".0f"),
                 ("ttft_p50_ms", "TTFT P50 ms", ".1f"), ("ttft_p99_ms", "P99 ms", ".1f"), ("run_s", "run s", ".0f")])
    if "prefill_tokens_saved" in result:
        base = result["modes"]["no-store"]["computed_tokens"]
        print(f"prefill tokens saved by the store: {result['prefill_tokens_saved']} "
              f"({result['prefill_tokens_saved'] / max(base, 1):.1%} of the no-store run's)")


if __name__ == "__main__":
    main()
