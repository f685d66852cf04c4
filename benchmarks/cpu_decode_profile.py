#!/usr/bin/env python
"""Where a CPU decode step's time goes: with C requests in decode, times whole engine steps,
then the model's forward alone and the LM head alone (one decode step's inputs, replayed), and
optionally profiles the forward with torch.profiler (ops by self CPU time).

Usage (from the repository root, the engine's venv):

    .venv/bin/python benchmarks/cpu_decode_profile.py --concurrency 1 32 --profile

Each level gets its own engine (max_num_seqs = C) and C random prompts of --input-len tokens,
prefilled first, so every timed step is a pure decode step of C rows. The machine may be
shared: every figure is the fastest of --rounds rounds, and the bf16 matmul rate printed
first says how fast the machine is right now (about 400 GFLOP/s on the quiet 2-core box).
"""

from __future__ import annotations

import argparse
import time

import torch


def fastest(fn, iters: int, rounds: int) -> float:
    """Seconds per call, fastest round of `rounds` rounds of `iters` calls."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def machine_gflops() -> float:
    x, w = torch.randn(128, 576, dtype=torch.bfloat16), torch.randn(3072, 576, dtype=torch.bfloat16)
    return 2 * 128 * 576 * 3072 / fastest(lambda: x @ w.t(), 30, 3) / 1e9


def capture_decode_step(llm):
    """Run one engine step and keep the model's inputs of it (ids, positions, attention metadata)."""
    from deepinfer.layers.attention.metadata import get_forward_context

    model = llm.engine.executor.runner.model
    captured = {}
    original = model.forward

    def spy(*args):   # (input_ids, positions[, the rows whose hidden states are kept])
        captured.update(args=args, meta=get_forward_context())
        return original(*args)

    model.forward = spy
    try:
        llm._step()
    finally:
        model.forward = original
    return captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="engine steps per timing round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile 10 forwards per level")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    from deepinfer import LLM, SamplingParams
    from deepinfer.bench.throughput import synthetic_prompts
    from deepinfer.layers.attention import forward_context

    print(f"machine: bf16 matmul {machine_gflops():.0f} GFLOP/s, {torch.get_num_threads()} threads")
    for concurrency in args.concurrency:
        llm = LLM(args.model, max_num_seqs=concurrency)
        params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
        for prompt in synthetic_prompts(llm.tokenizer, concurrency, args.input_len, 0):
            llm._add_request(None, prompt, params, 0, None)
        scheduler = llm.engine.scheduler
        while (len(scheduler.running) < concurrency
               or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running)):
            llm._step()
        for _ in range(3):
            llm._step()

        step = fastest(llm._step, args.steps, args.rounds)
        model = llm.engine.executor.runner.model
        inputs = capture_decode_step(llm)

        def forward():
            with forward_context(inputs["meta"]), torch.inference_mode():
                return model(*inputs["args"])

        hidden = forward()
        forward_s = fastest(forward, args.steps, args.rounds)
        with torch.inference_mode():
            head_s = fastest(lambda: model.compute_logits(hidden), args.steps, args.rounds)
        print(f"C={concurrency}: engine step {step * 1e3:.2f} ms ({concurrency / step:.1f} out tok/s), "
              f"forward {forward_s * 1e3:.2f} ms, LM head {head_s * 1e3:.2f} ms, "
              f"rest of the step {(step - forward_s - head_s) * 1e3:.2f} ms")
        if args.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    forward()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        del llm


if __name__ == "__main__":
    main()
