"""Where the time of gpu_fast_path.py's (c) goes: step by step, and kernel by kernel.

    python benchmarks/throughput_profile.py [--requests 1000] [--max-num-seqs 512]
        [--max-num-batched-tokens 16384] [--kv-cache-dtype auto|fp8] [--host] [--kernels] [--out F.json]

1. Times the run as (c) does (overlapped loop, nothing wrapped), twice: cold and warm, each with
   the Triton compiles it met (kernels compiled on first use of a new specialization; Triton's
   disk cache, ~/.triton, turns a repeat into a load of ~0.01 s).
2. Runs it again with the plain loop, whose executor calls return only once the step's
   tokens are on the host, and times each step there. Steps are grouped by kind: decode-only
   steps (by batch size) and mixed steps (with prompt tokens). The sum is the plain loop's
   device-plus-host time; the overlapped loop hides the host part, so the first figure is lower.
3. With --host, times the host's phases of an overlapped run (schedule, forward, sample, collect
   = mostly the wait for the device, update, the rest).
4. With --kernels, profiles the overlapped run (CUDA activity only) and sums kernel time by
   category (weight matmuls, attention, fused elementwise kernels, the rest), the matmuls and the
   attention beside their parts of the floor, and the device's busy time beside the wall.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

import torch
from decode_step_profile import busy_time
from gpu_fast_path import (
    GREEDY,
    SHAPES,
    concurrent_requests,
    random_prompts,
    shape_counts,
    throughput_floor_parts,
    timed,
)
from gpu_reference_baseline import copy_bandwidth, matmul_rate, write_config_dir

# Kernel name patterns, first match wins; names differ across cuBLAS and torch versions.
CATEGORIES = [
    ("matmul (our GEMV)", r"_gemv_kernel"),
    ("matmul (cuBLAS)", r"gemm|gemv|nvjet|cutlass|xmma|cublas"),
    ("attention: decode", r"_decode_split_kernel|_merge_splits_kernel|decode_fp8"),
    ("attention: paged prefill", r"_prefill_kernel"),
    ("attention: SDPA (cuDNN / flash)", r"cudnn|flash|fmha|sdpa"),
    ("rms_norm (+ residual)", r"rms"),
    ("SiLU * up", r"act_and_mul|silu"),
    ("rotary + KV write", r"rotary|kv_write"),
]


def category(name: str) -> str:
    lowered = name.lower()
    return next((label for label, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


class TritonCompiles:
    """Counts Triton JIT compiles (in-memory cache misses) and their seconds, through Triton's hooks."""

    def __init__(self) -> None:
        import triton

        self.count, self.seconds, self._started = 0, 0.0, 0.0
        triton.knobs.runtime.jit_cache_hook = self._before
        triton.knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **_) -> bool:
        self._started = time.perf_counter()
        return False   # a true value would skip the compile

    def _after(self, **_) -> None:
        self.count += 1
        self.seconds += time.perf_counter() - self._started

    def take(self) -> str:
        """Compiles since the last take, as text."""
        text = f"{self.count} Triton compiles, {self.seconds:.2f} s"
        self.count, self.seconds = 0, 0.0
        return text


def step_times(llm, prompts, params) -> list[tuple[int, int, float]]:
    """(decode rows, prompt tokens, seconds) of every step of a plain-loop run: from queuing the
    forward to the collected result (the plain loop makes the executor's three calls in a row)."""
    executor, records, started = llm.engine.executor, [], []
    execute_model, collect = executor.execute_model, executor.collect

    def timed_execute_model(plan):
        started.append((time.perf_counter(), plan))
        return execute_model(plan)

    def timed_collect(launched):
        result = collect(launched)
        start, plan = started.pop()
        decode_rows = sum(1 for c in plan.chunks if c.num_tokens == 1 and c.sample)
        prompt_tokens = sum(c.num_tokens for c in plan.chunks) - decode_rows
        records.append((decode_rows, prompt_tokens, time.perf_counter() - start))
        return result

    executor.execute_model, executor.collect = timed_execute_model, timed_collect
    async_before, llm.engine.async_scheduling = llm.engine.async_scheduling, False
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del executor.execute_model, executor.collect
        llm.engine.async_scheduling = async_before
    return records


def print_steps(records: list[tuple[int, int, float]]) -> None:
    decode = [r for r in records if r[1] == 0]
    mixed = [r for r in records if r[1] > 0]
    total = sum(r[2] for r in records)
    print(f"plain loop: {len(records)} steps, {total:.2f} s")
    for label, rows in (("decode-only", decode), ("mixed (prompt tokens)", mixed)):
        if not rows:
            continue
        secs = sum(r[2] for r in rows)
        print(f"  {label:>22}: {len(rows):5d} steps, {secs:7.2f} s ({secs / total:.0%}), "
              f"{sum(r[0] for r in rows) / len(rows):6.1f} decode rows and "
              f"{sum(r[1] for r in rows) / len(rows):7.1f} prompt tokens per step, {secs / len(rows) * 1e3:7.2f} ms each")
    by_batch = collections.defaultdict(list)
    for rows, _, secs in decode:
        by_batch[(rows + 63) // 64 * 64].append(secs)
    for bucket in sorted(by_batch):
        times = by_batch[bucket]
        print(f"    decode-only, {bucket - 63:4d}-{bucket:4d} rows: {len(times):5d} steps, {sum(times):6.2f} s, "
              f"{sum(times) / len(times) * 1e3:6.2f} ms each")


def host_phases(llm, prompts, params) -> None:
    """Where the host's time goes in an overlapped run. `collect` is mostly the wait for the
    device; when it is near zero the device waited for the host instead (host-bound steps)."""
    engine = llm.engine
    runner = engine.executor.runner
    phases = [(engine.scheduler, "schedule"), (runner, "forward"), (runner, "sample"),
              (runner, "collect"), (engine.scheduler, "update")]
    totals: dict[str, float] = collections.defaultdict(float)
    originals = [(owner, name, getattr(owner, name)) for owner, name in phases]

    def timer(name, fn):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
        return wrapped

    for owner, name, fn in originals:
        setattr(owner, name, timer(name, fn))
    try:
        wall = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    finally:
        for owner, name, _ in originals:
            delattr(owner, name)   # back to the class's method
    rest = wall - sum(totals.values())
    print(f"host phases of an overlapped run ({wall:.2f} s wall): " + ", ".join(
        f"{name} {secs:.2f} s" for name, secs in totals.items()) + f", everything else {rest:.2f} s "
        "(output processing, the loop)")


def kernel_categories(llm, prompts, params, floor: dict) -> dict:
    """Kernel time by category of an overlapped run (CUDA activity only), the weight matmuls and
    the attention each beside its part of the floor (gpu_fast_path.throughput_floor_parts), and
    the time the device was busy at all against the wall (the rest: the device waiting for the
    host)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    spans = [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
             if e.device_type().name == "CUDA" and e.duration_ns() > 0 and not e.name().startswith("Mem")]
    totals: dict[str, float] = collections.defaultdict(float)
    names: dict[str, float] = collections.defaultdict(float)
    for name, start, end in spans:
        totals[category(name)] += (end - start) / 1e9
        names[name] += (end - start) / 1e9
    busy_s, kernels = busy_time((start, end) for _, start, end in spans) / 1e9, sum(totals.values())
    print(f"profiled run: {wall:.2f} s wall, device busy {busy_s:.2f} s (idle {wall - busy_s:.2f} s), "
          f"{kernels:.2f} s of kernel time in {len(spans)} kernels (PDL overlaps neighbours)")
    for label, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:>32}: {secs:7.2f} s ({secs / kernels:.0%})")
    parts = {"weight matmuls": (sum(v for k, v in totals.items() if k.startswith("matmul")),
                                floor["matmul_flops_s"]),
             "attention": (sum(v for k, v in totals.items() if k.startswith("attention")),
                           floor["attention_flops_s"] + floor["kv_reads_s"])}
    for label, (secs, part) in parts.items():
        print(f"  {label}: {secs:.2f} s against its part of the floor {part:.2f} s = {secs / part:.2f} x")
    for name, secs in sorted(names.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {secs:7.2f} s  [{category(name)}]  {name[:100]}")
    return {"profiled_wall_s": wall, "device_busy_s": busy_s, "kernel_s": kernels, "kernels": len(spans),
            "by_category_s": dict(totals), "floor_parts_s": floor}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--kernels", action="store_true", help="also profile kernel time by category")
    parser.add_argument("--host", action="store_true", help="also time the host's phases of an overlapped run")
    parser.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = parser.parse_args()
    from deepinfer import LLM, SamplingParams

    config = SHAPES[args.shape]
    compiles = TritonCompiles()
    llm = LLM(write_config_dir(config), load_format="dummy", max_model_len=args.input_len + args.output_len + 64,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype)
    prompts = random_prompts(args.requests, args.input_len, config["vocab_size"], seed=3)
    params = SamplingParams(max_tokens=args.output_len, **GREEDY)
    print(f"{torch.cuda.get_device_name()}, {args.shape}, {args.requests} x {args.input_len} in / "
          f"{args.output_len} out, max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, {llm.engine.executor.runner.num_blocks} KV blocks "
          f"({args.kv_cache_dtype})")
    print(f"engine start: {compiles.take()}")
    c = shape_counts(config, kv_element_bytes=1 if args.kv_cache_dtype == "fp8" else 2)
    floor = throughput_floor_parts(c, args.requests, args.input_len, args.output_len,
                                   concurrent_requests(llm, args.input_len + args.output_len),
                                   copy_bandwidth(), matmul_rate())
    result = {"device": torch.cuda.get_device_name(), "shape": args.shape, "requests": args.requests,
              "input_len": args.input_len, "output_len": args.output_len, "kv_cache_dtype": args.kv_cache_dtype,
              "floor_s": sum(floor.values())}
    # The first run meets shapes no kernel has seen yet (plans, compiles); the second does not.
    for run in ("first", "second"):
        seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
        result[f"{run}_run_s"] = seconds
        print(f"overlapped loop, {run} run: {seconds:.2f} s = {seconds / result['floor_s']:.3f} x floor "
              f"{result['floor_s']:.2f} s ({compiles.take()})")
    print_steps(step_times(llm, prompts, params))
    if args.host:
        host_phases(llm, prompts, params)
    if args.kernels:
        result.update(kernel_categories(llm, prompts, params, floor))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
