"""KV store, cross-instance reuse: a prefix one server computed is answered from the store by a
fresh server, in a new process, that never saw it.

    python benchmarks/kv_store_reuse.py [--models smollm2,gemma3-270m] [--stores dir,redis]
        [--model-shape llama3-8b|gemma3-1b] [--prefix-tokens 4096] [--answer-tokens 16]
        [--repeats 3] [--workdir DIR] [--kv-cache-gib G] [--seed 0]
        [--out reuse.json] [--plot reuse.png] [--plot-from reuse.json]

How to run: on the CPU box the defaults (SmolLM2 and Gemma 3 270M, dir:// and redis://, a
4k-token prefix, 3 repeats) take about 10-15 minutes (eight server starts); redis:// needs
Debian's redis-server (`apt-get install redis-server`), started by the script on a free
loopback port. A quick check: `--models smollm2 --stores dir --prefix-tokens 1024 --repeats 1`.
On a GPU: `--model-shape llama3-8b --prefix-tokens 32768 --stores dir --buffer-gib 10` (random weights of
Llama-3-8B's shape, served with `--load-format dummy`; every server seeds them alike, so one's
KV is valid for the next).
Times are for a quiet machine: on a shared 2-core box the engine's threads wait on each other and
TTFTs swing 3-5x between runs.

Per model and store:
  1. server A (a real `deepinfer serve`, loopback) answers turn 1 of `--repeats` conversations:
     a user message of about --prefix-tokens tokens (this Python's standard-library source, a
     different file set per conversation), --answer-tokens greedy tokens back. Its prompt
     tokens are the conversation's prefix, written through to the store.
  2. A is stopped (SIGINT: the engine core flushes the store's pending writes at shutdown); the
     store's entries are counted.
  3. server B, a new process on the same store, answers a warm-up request (a cold prompt of the
     same length), then per conversation (the order alternating) the follow-up (turn 1, A's
     answer, a short new question) and a cold prompt of the same shape it never saw (nor A).
Reported per conversation: the follow-up's usage.prompt_tokens_details.cached_tokens against
the prefix (target >= prefix - block size; a model with sliding-window layers rebuilds them by
SWA Bounded Replay, so its cached tokens are lower by the replayed window, reported beside), and
B's TTFT on the follow-up over its TTFT on the cold prompt (target <= 0.25). TTFT is the time to
the first streamed token event (deepinfer/bench/serving/client.py); B's store counters from
/metrics show where the hit came from.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    add_output_args,
    machine_info,
    median,
    print_table,
    pyplot,
    replot,
    save_and_plot,
    save_figure,
    write_json,
)
from kv_store_serving import (
    MODELS,
    SHAPES,
    Store,
    TextSource,
    chat_once,
    child_environment,
    resolve_model,
    start,
    stop,
    tier_counters,
)

QUESTION = "In two sentences, what is the most surprising thing in that code?"


def conversation(text: str, index: int) -> list[dict]:
    return [{"role": "user", "content": f"Conversation {index}. Read this code:\n{text}"}]


def follow_up(turn1: list[dict], answer: str) -> list[dict]:
    return [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTION}]


def run_pair(model, store_kind: str, args, workdir: str) -> dict:
    """Server A computes, is stopped; server B reuses. One model, one store."""
    store = Store(store_kind, workdir)
    max_len = args.prefix_tokens + args.answer_tokens + 512
    flags = ["--max-model-len", str(max_len), "--kv-store-load-timeout-s", str(args.load_timeout_s),
             "--cpu-kv-cache-bytes", str(int(args.kv_cache_gib * 2**30)),
             "--kv-store-buffer-size", str(args.buffer_gib)]
    texts = TextSource(model, args.seed)
    turn1 = [conversation(texts.take(args.prefix_tokens - 32), r) for r in range(args.repeats)]
    cold1 = [conversation(texts.take(args.prefix_tokens - 32), args.repeats + r) for r in range(args.repeats)]
    # B's warm-up is as long as the timed prompts, so no first-of-its-shape cost lands on them.
    warm = follow_up(conversation(texts.take(args.prefix_tokens - 32), 2 * args.repeats), "Fine.")
    out = {"model": model.name, "store": store_kind, "url": store.url, "sliding_window": model.sliding_window,
           "conversations": []}
    try:
        t = time.perf_counter()
        a = start(model, os.path.join(workdir, f"{model.name}-{store_kind}-A.log"), store.url, *flags)
        out["a_start_s"] = time.perf_counter() - t
        answers = []
        try:
            for messages in turn1:
                result = chat_once(a, messages, args.answer_tokens, keep_text=True)
                answers.append(result.text)
                out["conversations"].append({"prefix_tokens": result.prompt_len, "a_ttft_s": result.ttft})
            out["a_counters"] = tier_counters(a)
        finally:
            t = time.perf_counter()
            stop(a)
            out["a_stop_s"] = time.perf_counter() - t
        out["a_dropped_at_shutdown"] = "dropped" in a.log()
        out["entries_after_a"] = store.entries()
        print(f"  A: {len(turn1)} prefixes of {[c['prefix_tokens'] for c in out['conversations']]} tokens; "
              f"stopped in {out['a_stop_s']:.1f} s; the store holds {out['entries_after_a']} entries", flush=True)

        t = time.perf_counter()
        b = start(model, os.path.join(workdir, f"{model.name}-{store_kind}-B.log"), store.url, *flags)
        out["b_start_s"] = time.perf_counter() - t
        try:
            chat_once(b, warm, 2)   # untimed
            for r in range(args.repeats):
                hit_messages = follow_up(turn1[r], answers[r])
                cold_messages = follow_up(cold1[r], answers[r])
                runs = {}
                for kind in (("hit", "cold") if r % 2 == 0 else ("cold", "hit")):
                    runs[kind] = chat_once(b, hit_messages if kind == "hit" else cold_messages, 2)
                record = out["conversations"][r]
                record.update({"follow_up_tokens": runs["hit"].prompt_len, "cached_tokens": runs["hit"].cached_tokens,
                               "ttft_hit_s": runs["hit"].ttft, "cold_tokens": runs["cold"].prompt_len,
                               "cold_cached_tokens": runs["cold"].cached_tokens, "ttft_cold_s": runs["cold"].ttft})
                print(f"  B, conversation {r}: cached {record['cached_tokens']} of {record['follow_up_tokens']} "
                      f"(prefix {record['prefix_tokens']}), TTFT {record['ttft_hit_s'] * 1e3:.0f} ms; cold "
                      f"{record['ttft_cold_s'] * 1e3:.0f} ms (cached {record['cold_cached_tokens']})", flush=True)
            out["b_counters"] = tier_counters(b)
        finally:
            stop(b)
    finally:
        store.close()
    return summarize(out)


def summarize(out: dict) -> dict:
    block = int(out["b_counters"].get("block_size", 16))
    convs = out["conversations"]
    out["block_size"] = block
    out["cached_target"] = [c["prefix_tokens"] - block - out["sliding_window"] for c in convs]
    out["cached_fraction_min"] = min(c["cached_tokens"] / c["prefix_tokens"] for c in convs)
    out["cached_short_of_prefix_max"] = max(c["prefix_tokens"] - c["cached_tokens"] for c in convs)
    out["ttft_hit_median_s"] = median([c["ttft_hit_s"] for c in convs])
    out["ttft_cold_median_s"] = median([c["ttft_cold_s"] for c in convs])
    out["ttft_ratio"] = out["ttft_hit_median_s"] / out["ttft_cold_median_s"]
    out["ttft_ratio_max"] = max(c["ttft_hit_s"] / c["ttft_cold_s"] for c in convs)
    out["meets_cached_target"] = all(c["cached_tokens"] >= t for c, t in zip(convs, out["cached_target"]))
    out["meets_ttft_target"] = out["ttft_ratio"] <= 0.25
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)} or paths")
    parser.add_argument("--model-shape", choices=SHAPES, default=None,
                        help="instead of --models: random weights of this shape (--load-format dummy), for a GPU")
    parser.add_argument("--stores", default="dir,redis", help="comma-separated: dir, redis")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="conversations per model and store")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="each server's KV pool on the CPU")
    parser.add_argument("--load-timeout-s", type=float, default=60.0, help="--kv-store-load-timeout-s of B")
    parser.add_argument("--buffer-gib", type=float, default=4.0,
                        help="--kv-store-buffer-size of both (a request loads at most half of it: a 32k prefix "
                             "of Llama-3-8B's shape, 4 GiB of KV, needs 10)")
    parser.add_argument("--workdir", default=None, help="where stores and server logs go (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    add_output_args(parser)
    args = parser.parse_args()
    if replot(args, plot):
        return
    if args.prefix_tokens < 256 or args.repeats < 1 or args.answer_tokens < 1:
        parser.error("--prefix-tokens must be >= 256, --repeats and --answer-tokens >= 1")
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not stores or set(stores) - {"dir", "redis"}:
        parser.error(f"--stores takes dir and/or redis, got {args.stores!r}")
    names = [args.model_shape] if args.model_shape else [m.strip() for m in args.models.split(",") if m.strip()]
    child_environment()
    workdir = args.workdir or tempfile.mkdtemp(prefix="kv-store-reuse-")
    os.makedirs(workdir, exist_ok=True)
    result = {"benchmark": "kv_store_reuse", "machine": machine_info(), "args": vars(args), "workdir": workdir,
              "runs": []}
    for name in names:
        model = resolve_model(name, args.prefix_tokens + args.answer_tokens + 1024)
        for store_kind in stores:
            print(f"{name} on {store_kind}:// (prefix ~{args.prefix_tokens} tokens, {args.repeats} conversations)",
                  flush=True)
            result["runs"].append(run_pair(model, store_kind, args, workdir))
            write_json(args.out, result)
    print()
    print_table([{**r, "ttft_hit_ms": r["ttft_hit_median_s"] * 1e3, "ttft_cold_ms": r["ttft_cold_median_s"] * 1e3,
                  "prefix": median([c["prefix_tokens"] for c in r["conversations"]]),
                  "cached": min(c["cached_tokens"] for c in r["conversations"]),
                  "target": min(r["cached_target"])} for r in result["runs"]],
                [("model", "model", ""), ("store", "store", ""), ("prefix", "prefix", ".0f"),
                 ("cached", "cached (min)", "d"), ("target", "target", "d"), ("sliding_window", "replayed", "d"),
                 ("ttft_hit_ms", "TTFT hit ms", ".1f"), ("ttft_cold_ms", "TTFT cold ms", ".1f"),
                 ("ttft_ratio", "hit/cold", ".3f"), ("meets_cached_target", "cached ok", ""),
                 ("meets_ttft_target", "<= 0.25", "")])
    print(f"(stores and server logs in {workdir})")
    save_and_plot(args, result, plot)


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = result["runs"]
    labels = [f"{r['model']}\n{r['store']}://" for r in runs]
    x = range(len(runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar([i - 0.2 for i in x], [r["ttft_cold_median_s"] * 1e3 for r in runs], 0.4, label="B, cold prompt")
    ax1.bar([i + 0.2 for i in x], [r["ttft_hit_median_s"] * 1e3 for r in runs], 0.4, label="B, follow-up (store hit)")
    for i, r in enumerate(runs):
        ax1.annotate(f"{r['ttft_ratio']:.2f}x", (i + 0.2, r["ttft_hit_median_s"] * 1e3), ha="center", va="bottom")
    ax1.set_ylabel("TTFT ms (median)")
    ax2.bar(list(x), [min(c["cached_tokens"] for c in r["conversations"]) for r in runs], 0.5, label="cached (min)")
    ax2.scatter(list(x), [min(r["cached_target"]) for r in runs], color="black", marker="_", s=400, zorder=3,
                label="target: prefix - block - replayed window")
    ax2.set_ylabel("follow-up cached tokens")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels)
        ax.legend(fontsize=8)
    a = result["args"]
    fig.suptitle(f"KV store, cross-instance reuse: ~{a['prefix_tokens']}-token prefix computed by server A, "
                 f"answered by a fresh server B")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
