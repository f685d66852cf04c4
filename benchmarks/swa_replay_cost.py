"""SWA Bounded Replay, cost: time to first token of a follow-up turn whose sliding-window KV was
dropped, bounded replay (the last N tokens recomputed for the window layers) beside full
recompute (swa_replay_tokens=0), over growing contexts.

    python benchmarks/swa_replay_cost.py [--model gemma3-270m|gemma3-1b-shape|PATH]
        [--contexts 4096,8192,16384,32768] [--repeats 3] [--tail 64] [--replay-tokens N]
        [--dtype auto] [--num-kv-blocks B] [--max-num-batched-tokens T] [--enforce-eager] [--seed 0]
        [--dry-exact] [--profile] [--out cost.json] [--plot cost.png] [--plot-from cost.json]

Models: on the CPU the real Gemma 3 270M (GGUF, window 512); on CUDA by default a random-weight
model of Gemma 3 1B's shape (bench_common.gemma3_1b_shape: hidden 1152, 26 layers, 4 heads, 1 KV
head, head_dim 256, intermediate 6912, vocab 262144, window 512, every 6th layer global, rope
1e6 / 1e4, 32768 positions; ~1.0B parameters), written as a config-only directory and loaded
with load_format="dummy". The prompt ids are random (what is timed does not depend on them).

For each context C (the follow-up's prompt: turn 1 of C - --tail tokens, cut to a whole block,
plus a --tail token follow-up, capped below the model's positions) both engines, built once and
kept side by side, take turns:
  1. turn 1 runs as a prompt (max_tokens=1, untimed); it finishes, its blocks are cached, and
     swa_retention_s=0 drops its sliding-window blocks at once;
  2. --repeats times: a follow-up (a different tail each time, so each meets the same cache:
     turn 1's full-attention blocks, no window) runs with max_tokens=1; its wall time is the
     TTFT, and the median is reported, with num_cached_tokens.
Before the timed contexts each engine runs one untimed turn 1 + follow-up (kernel warm-up).
Reported: TTFT per context for both, their ratio, and TTFT(largest)/TTFT(smallest) per engine,
labelled 32k/4k with the default contexts.

Beside each measured ratio stands its floor in arithmetic: the forward's FLOPs (matmuls of the
computed tokens, plus their attention over the keys each layer lets them see) at the largest
context over those at the smallest. The full-attention layers of a replayed segment attend to the
whole context, so even bounded replay's FLOPs grow with it (for a model whose global layers are
exact attention; V4's are compressed). --profile (CUDA) then profiles one bounded follow-up at the
smallest and the largest context: device busy time, the longest gaps, the kernels by time.

--dry-exact passes none of the new engine options (today's engine keeps the window's blocks,
so both columns are a cached follow-up); it checks the script, not the feature.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    add_run_args,
    feature_kwargs,
    free_memory,
    gemma3_1b_shape,
    kv_blocks_for,
    layer_kinds,
    machine_info,
    median,
    model_config,
    parameter_count,
    print_table,
    pyplot,
    random_ids,
    replot,
    shutdown,
    sliding_window_of,
    write_json,
    write_shape_dir,
)

MODELS = ("gemma3-270m", "gemma3-1b-shape")


def resolve_model(name: str) -> tuple[str, str]:
    """(path, load_format) of --model."""
    if name == "gemma3-270m":
        from deepinfer.models.bundled import gemma3_270m_gguf_path

        return gemma3_270m_gguf_path(), "auto"
    if name == "gemma3-1b-shape":
        return write_shape_dir(gemma3_1b_shape()), "dummy"
    return name, "auto"


def label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help=f"{' | '.join(MODELS)} | a path (default: gemma3-1b-shape on CUDA, gemma3-270m on CPU)")
    parser.add_argument("--contexts", default="4096,8192,16384,32768", help="follow-up prompt tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed follow-ups per context and engine (median)")
    parser.add_argument("--tail", type=int, default=64, help="tokens of the follow-up user turn")
    parser.add_argument("--replay-tokens", type=int, default=None,
                        help="swa_replay_tokens of the bounded engine (default: the engine's, the window)")
    parser.add_argument("--dry-exact", action="store_true",
                        help="pass none of the new engine options (today's engine; checks the script)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: enough for two longest requests")
    parser.add_argument("--profile", action="store_true", help="CUDA: profile a bounded follow-up (module doc)")
    add_run_args(parser, eager_help="no CUDA graphs")
    args = parser.parse_args()
    if replot(args, plot):
        return

    import torch

    from deepinfer import LLM, SamplingParams
    from deepinfer.platforms import current_platform

    platform = current_platform()
    model = args.model or ("gemma3-1b-shape" if platform.name == "cuda" else "gemma3-270m")
    path, load_format = resolve_model(model)
    config = model_config(path)
    window = sliding_window_of(config)
    vocab = config["vocab_size"]
    contexts = sorted(int(c) for c in args.contexts.split(","))
    max_len = min(config.get("max_position_embeddings") or contexts[-1] + 16, contexts[-1] + 16)
    budget = args.max_num_batched_tokens or platform.batch_limits(True)[1]
    bs = 16
    num_blocks = args.num_kv_blocks or kv_blocks_for(config, max_len, bs, budget)
    base = dict(load_format=load_format, dtype=args.dtype, max_model_len=max_len, enable_prefix_caching=True,
                num_kv_blocks=num_blocks, skip_tokenizer_init=True, block_size=bs, seed=args.seed)
    if args.max_num_batched_tokens:
        base["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.enforce_eager:
        base["enforce_eager"] = True
    engines = {
        "bounded": feature_kwargs(args.dry_exact, swa_retention_s=0, swa_replay_tokens=args.replay_tokens),
        "full": feature_kwargs(args.dry_exact, swa_retention_s=0, swa_replay_tokens=0),
    }
    result = {"benchmark": "swa_replay_cost", "machine": machine_info(), "accelerator": platform.name,
              "args": vars(args), "model": model, "path": path, "load_format": load_format, "window": window,
              "parameters": parameter_count(config), "max_model_len": max_len, "num_kv_blocks": num_blocks,
              "max_num_batched_tokens": budget, "engine_options": engines, "contexts": []}
    print(f"{model} ({result['parameters'] / 1e9:.2f}B parameters, window {window}) on {platform.name}; "
          f"contexts {contexts}, {args.repeats} repeats, tail {args.tail}; {num_blocks} KV blocks", flush=True)
    llms = {}
    for name, options in engines.items():
        t = time.perf_counter()
        torch.manual_seed(args.seed)   # the same random weights in both (load_format="dummy")
        llms[name] = LLM(path, **base, **options)
        result.setdefault("load_s", {})[name] = time.perf_counter() - t
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(llm, prompt: list[int]) -> tuple[float, int]:
        platform.synchronize()
        start = time.perf_counter()
        out = llm.generate([prompt], one, use_tqdm=False)[0]
        platform.synchronize()
        return time.perf_counter() - start, out.num_cached_tokens

    def conversation(context: int, seed: int) -> tuple[list[int], list[list[int]]]:
        prompt_len = min(context, max_len - 8)
        turn1_len = (prompt_len - args.tail) // bs * bs
        turn1 = random_ids(turn1_len, vocab, seed)
        tails = [random_ids(prompt_len - turn1_len, vocab, seed * 1000 + r + 1) for r in range(args.repeats)]
        return turn1, [turn1 + t for t in tails]

    # Warm-up: one whole round at the smallest context, other ids.
    warm_turn1, warm_follow = conversation(contexts[0], args.seed + 99991)
    for llm in llms.values():
        llm.generate([warm_turn1], one, use_tqdm=False)
        ttft(llm, warm_follow[0])
    started = time.perf_counter()
    for i, context in enumerate(contexts):
        turn1, follows = conversation(context, args.seed + i + 1)
        row = {"context": context, "prompt_tokens": len(follows[0]), "turn1_tokens": len(turn1)}
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.generate([turn1], one, use_tqdm=False)
            row[f"{name}_turn1_s"] = time.perf_counter() - t
        times: dict[str, list[float]] = {name: [] for name in llms}
        cached: dict[str, list[int]] = {name: [] for name in llms}
        for r in range(args.repeats):
            order = list(llms) if r % 2 == 0 else list(reversed(llms))   # neither always goes first
            for name in order:
                seconds, hit = ttft(llms[name], follows[r])
                times[name].append(seconds)
                cached[name].append(hit)
        for name in llms:
            row[f"{name}_ttft_s"] = median(times[name])
            row[f"{name}_ttft_all_s"] = times[name]
            row[f"{name}_cached"] = cached[name]
            row[f"{name}_computed_tokens"] = len(follows[0]) - median(cached[name])
        row["full_over_bounded"] = row["full_ttft_s"] / row["bounded_ttft_s"]
        for name in llms:
            computed = int(row[f"{name}_computed_tokens"])
            start = row["prompt_tokens"] - computed
            floor = start if name == "bounded" and computed < row["prompt_tokens"] else 0
            row[f"{name}_gflop"] = forward_flops(config, start, row["prompt_tokens"], floor) / 1e9
        result["contexts"].append(row)
        print(f"  {label(context)}: bounded {row['bounded_ttft_s'] * 1e3:.1f} ms (cached {cached['bounded']}), "
              f"full {row['full_ttft_s'] * 1e3:.1f} ms (cached {cached['full']}); "
              f"{time.perf_counter() - started:.0f} s so far", flush=True)
        write_json(args.out, result)
    if args.profile and platform.name == "cuda":
        result["profiles"] = [profile_follow_up(llms["bounded"], conversation(c, args.seed + 7777 + c), one)
                              for c in (contexts[0], contexts[-1])]
    for llm in llms.values():
        shutdown(llm)
    llms.clear()
    free_memory()

    rows = result["contexts"]
    lo, hi = rows[0], rows[-1]
    key = f"{label(hi['context'])}/{label(lo['context'])}"
    result["ttft_ratio_label"] = key
    for name in engines:
        result[f"{name}_ttft_ratio"] = hi[f"{name}_ttft_s"] / lo[f"{name}_ttft_s"]
        result[f"{name}_flop_ratio"] = hi[f"{name}_gflop"] / lo[f"{name}_gflop"]
    print()
    print_table([{**r, "label": label(r["context"]), "bounded_ms": r["bounded_ttft_s"] * 1e3,
                  "full_ms": r["full_ttft_s"] * 1e3} for r in rows],
                [("label", "context", ""), ("prompt_tokens", "prompt", "d"), ("bounded_ms", "TTFT bounded ms", ".1f"),
                 ("bounded_computed_tokens", "computed", ".0f"), ("full_ms", "TTFT full ms", ".1f"),
                 ("full_computed_tokens", "computed", ".0f"), ("full_over_bounded", "full/bounded", ".2f"),
                 ("bounded_gflop", "GFLOP bounded", ".0f"), ("full_gflop", "GFLOP full", ".0f")])
    print(f"TTFT({key}): bounded {result['bounded_ttft_ratio']:.2f}x (FLOPs {result['bounded_flop_ratio']:.2f}x), "
          f"full recompute {result['full_ttft_ratio']:.2f}x (FLOPs {result['full_flop_ratio']:.2f}x)"
          f"  ({model}, {result['machine'].get('cuda_device') or result['machine']['cpu']})")
    if args.dry_exact:
        print("(dry-exact: no new engine option was passed; both engines are today's)")
    write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)


def forward_flops(config: dict, start: int, end: int, window_floor: int) -> float:
    """FLOPs of a forward computing positions [start, end) over a cache of [0, start): the matmuls
    (2 x non-embedding parameters per token, the LM head for the last token only) plus attention
    (4 x head_dim x heads per query-key pair), each layer's keys as it sees them: a global layer
    [0, p], a sliding one its window, no lower than window_floor (replay)."""
    import numpy as np

    h, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    window = config.get("sliding_window") or 0
    per_layer = (parameter_count(config) - vocab * h * (1 if config.get("tie_word_embeddings") else 2)) \
        / config["num_hidden_layers"]
    p = np.arange(start, end, dtype=np.float64)
    keys = {"full_attention": float((p + 1).sum()),
            "sliding_attention": float((p - np.maximum(np.maximum(p - window + 1, window_floor), 0) + 1).sum())}
    attention = sum(keys[kind] for kind in layer_kinds(config)) * 4 * d * heads
    return 2 * per_layer * config["num_hidden_layers"] * (end - start) + 2 * vocab * h + attention


def profile_follow_up(llm, conv: tuple[list[int], list[list[int]]], params) -> dict:
    """One profiled bounded follow-up (turn 1 run first, untimed): where its TTFT goes on the device."""
    from decode_step_profile import kernel_events, largest_gaps, summarise

    turn1, follows = conv
    llm.generate([turn1], params, use_tqdm=False)
    wall, events = kernel_events(lambda: llm.generate([follows[0]], params, use_tqdm=False))
    s = summarise(events)
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    kernels = sorted(s["by_name"].items(), key=lambda kv: -kv[1][1])[:12]
    gaps = largest_gaps(events, 5)
    print(f"\nprofiled bounded follow-up, {len(follows[0])} tokens: wall {wall * 1e3:.2f} ms, first kernel to last "
          f"{span:.2f} ms, device busy {s['busy_us'] / 1e3:.2f} ms, {s['count']} kernels")
    for us, before, after in gaps:
        print(f"  gap {us / 1e3:7.2f} ms after {before[:50]}  before {after[:50]}")
    for name, (count, us) in kernels:
        print(f"  {us / 1e3:8.2f} ms {count:5d} x  {name[:100]}")
    return {"prompt_tokens": len(follows[0]), "wall_ms": wall * 1e3, "span_ms": span, "busy_ms": s["busy_us"] / 1e3,
            "kernels": s["count"], "gaps_ms": [(us / 1e3, a, b) for us, a, b in gaps],
            "by_kernel_ms": [(name, count, us / 1e3) for name, (count, us) in kernels]}


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["contexts"]
    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["bounded_ttft_s"] * 1e3 for r in rows], "o-", label="bounded replay (default N)")
    ax.plot(x, [r["full_ttft_s"] * 1e3 for r in rows], "s-", label="full recompute (N=0)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("follow-up prompt tokens")
    ax.set_ylabel("TTFT of the follow-up, ms (median)")
    ax.set_title(f"{result['model']} on {result['machine'].get('cuda_device') or result['machine']['cpu']}"
                 + (" [dry-exact]" if result["args"]["dry_exact"] else ""), fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
