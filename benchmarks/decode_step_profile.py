"""Where one batch-1 decode step's time goes, kernel by kernel, on the CUDA fast path.

    python benchmarks/decode_step_profile.py [--shape llama3-8b] [--context 1024] [--steps 64]
    python benchmarks/decode_step_profile.py --prefill 8192     # one prefill instead, and its gaps
    python benchmarks/decode_step_profile.py --no-profile        # the unprofiled decode rate only

First times the decode unprofiled, as gpu_fast_path.py's (a) does (tok/s and the fraction of the
roofline = copy bandwidth / weight bytes). Then profiles two generations of the same prompt, one of `steps + 1` tokens and one of 1 token (the
prefill alone), and reports their difference divided by `steps`: per decode step, the wall time,
the time the device was busy (union of kernel intervals), the sum of kernel times, the kernel
count, and each kernel name's count and microseconds. Wall minus busy is time the device sat idle
(launch gaps inside the graph, host work between steps).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

import torch
from gpu_fast_path import GREEDY, SHAPES, random_prompts, timed
from gpu_reference_baseline import copy_bandwidth, write_config_dir


def kernel_events(run) -> tuple[float, list[dict]]:
    """(wall seconds, kernel events of the chrome trace) of one profiled call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(run)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return wall, [e for e in events if e.get("cat") == "kernel"]


def largest_gaps(events: list[dict], count: int = 8) -> list[tuple[float, str, str]]:
    """The longest stretches with no kernel running: (microseconds, kernel before, kernel after)."""
    ordered = sorted(events, key=lambda e: e["ts"])
    gaps, end, last = [], ordered[0]["ts"] + ordered[0]["dur"], ordered[0]["name"]
    for e in ordered[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, last, e["name"]))
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e["name"]
    return sorted(gaps, reverse=True)[:count]


def profile_prefill(llm, tokens: int, vocab: int) -> None:
    from deepinfer import SamplingParams

    prompt = random_prompts(1, tokens, vocab, seed=2)
    run = lambda: llm.generate(prompt, SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    run()
    best = min(timed(run) for _ in range(3))
    wall, events = kernel_events(run)
    s = summarise(events)
    first = min(e["ts"] for e in events)
    last = max(e["ts"] + e["dur"] for e in events)
    print(f"prefill of {tokens} tokens: {best * 1e3:.2f} ms unprofiled (best of 3); profiled wall "
          f"{wall * 1e3:.2f} ms, first kernel to last {(last - first) / 1e3:.2f} ms, device busy "
          f"{s['busy_us'] / 1e3:.2f} ms, {s['count']} kernels")
    for us, before, after in largest_gaps(events):
        print(f"  gap {us:8.1f} us after {before[:60]}  before {after[:60]}")
    for name, (count, us) in sorted(s["by_name"].items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"{us / 1e3:9.2f} ms {count:5d} x  {name[:110]}")


def busy_time(intervals) -> float:
    """Length of the union of (start, end) intervals: the time the device ran any kernel."""
    busy, reach = 0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy, reach = busy + end - max(start, reach), end
    return busy


def summarise(events: list[dict]) -> dict:
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    busy = busy_time((e["ts"], e["ts"] + e["dur"]) for e in events)
    for e in events:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    return {"busy_us": busy, "kernel_us": sum(e["dur"] for e in events), "count": len(events), "by_name": by_name}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--plain-loop", action="store_true", help="async_scheduling off")
    parser.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens")
    parser.add_argument("--no-profile", action="store_true", help="the unprofiled decode rate only")
    args = parser.parse_args()
    from deepinfer import LLM, SamplingParams

    config = SHAPES[args.shape]
    llm = LLM(write_config_dir(config), load_format="dummy",
              max_model_len=max(args.context + max(args.steps, 256) + 64, args.prefill + 64),
              max_num_batched_tokens=max(8192, args.prefill), max_num_seqs=8, gpu_memory_utilization=0.5,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager)
    if args.prefill:
        profile_prefill(llm, args.prefill, config["vocab_size"])
        return
    llm.engine.async_scheduling = not args.plain_loop
    prompt = random_prompts(1, args.context, config["vocab_size"], seed=1)

    def generate(tokens: int):
        return lambda: llm.generate(prompt, SamplingParams(max_tokens=tokens, **GREEDY), use_tqdm=False)

    generate(args.steps + 1)()   # warm-up
    bandwidth = copy_bandwidth()
    decode_s = min(timed(generate(257)) - timed(generate(1)) for _ in range(3))
    roofline = bandwidth / llm.engine.executor.runner.weight_bytes
    print(f"decode {256 / decode_s:.1f} tok/s unprofiled (best of 3), roofline {roofline:.1f} tok/s at "
          f"{bandwidth / 1e12:.3f} TB/s: {256 / decode_s / roofline:.3f} of it")
    if args.no_profile:
        return
    wall_1, prefill = kernel_events(generate(1))
    wall_n, full = kernel_events(generate(args.steps + 1))
    a, b = summarise(full), summarise(prefill)
    steps = args.steps
    print(f"{torch.cuda.get_device_name()}, {args.shape}, context {args.context}, {steps} decode steps "
          f"({'plain loop' if args.plain_loop else 'overlapped loop'}, {'eager' if args.enforce_eager else 'graphs'})")
    print(f"per decode step: wall {(wall_n - wall_1) * 1e3 / steps:.3f} ms, device busy "
          f"{(a['busy_us'] - b['busy_us']) / 1e3 / steps:.3f} ms, sum of kernels "
          f"{(a['kernel_us'] - b['kernel_us']) / 1e3 / steps:.3f} ms, {(a['count'] - b['count']) / steps:.1f} kernels")
    rows = []
    for name, (count, us) in a["by_name"].items():
        count_b, us_b = b["by_name"].get(name, (0, 0.0))
        if count > count_b:
            rows.append(((us - us_b) / steps, (count - count_b) / steps, name))
    for us, count, name in sorted(rows, reverse=True):
        print(f"{us:9.1f} us {count:6.1f} x  {us / count:7.2f} us each  {name[:110]}")


if __name__ == "__main__":
    main()
