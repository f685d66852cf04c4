"""Where the host's time goes in speculative steps (GPU): cProfile over the engine's steps.

    python benchmarks/verify_host_profile.py [--shape llama3-8b] [--alpha 0.7] [--batch-sizes 1 64]
        [--modes none fixed fixed-chain] [--verify-chain 4] [--top 30] [--gaps] [--out JSON]

spec_replay.py's set-up (random weights with one clear greedy continuation, the replay drafter
at acceptance alpha, k drafts), then each batch size's prompts are generated once to warm up and
once under cProfile. A verify step's host work is exposed on the device (the next step is planned
after the verdict), so its functions' own time is what a faster host path would save; the
profiler's overhead inflates every figure alike, so read them as shares, and the `steps` line
beside them (wall time a step without the profiler) as the absolute. With --gaps, instead: the
device's busy time over the run and its idle gaps (torch.profiler), which show where the host
is on the critical path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import free_memory, machine_info, random_ids, shutdown, write_json  # noqa: E402
from gpu_fast_path import SHAPES  # noqa: E402
from gpu_reference_baseline import write_config_dir  # noqa: E402
from spec_replay import build  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402


def profile_generate(llm, prompts, params, top: int) -> dict:
    """Seconds and steps of one plain run, then the cProfile table of a second run."""
    steps = 0
    step = llm.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counted
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    plain_steps = steps
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    llm.engine.step = step
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    # Machine paths out of the table: file names relative to the package or the stdlib.
    table = "\n".join(line.replace(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/", "")
                      for line in text.getvalue().splitlines() if line.strip())
    return {"seconds": seconds, "steps": plain_steps, "ms_per_step": 1e3 * seconds / max(plain_steps, 1),
            "profile": table}


def device_gaps(llm, prompts, params, min_gap_us: float = 20.0) -> dict:
    """One run under torch.profiler: how much of the wall time the device computed (the union of
    its kernels and copies), and the idle gaps between them longer than min_gap_us (their count,
    sum and largest): a host on the critical path shows as gaps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, gaps, end, last = 0.0, [], None, ""
    after: dict[str, list[float]] = {}   # the device work that ran last before each gap, by name
    for a, b, name in spans:
        if end is None or a > end:
            if end is not None and a - end >= min_gap_us:
                gaps.append(a - end)
                entry = after.setdefault(last[:60], [0, 0.0])
                entry[0] += 1
                entry[1] += (a - end) / 1e3
            busy += b - a
            end, last = b, name
        elif b > end:
            busy += b - end
            end, last = b, name
    first = spans[0][0] if spans else 0.0
    return {"wall_s": seconds, "device_busy_ms": busy / 1e3, "device_span_ms": ((end or 0.0) - first) / 1e3,
            "gaps": len(gaps), "gap_ms": sum(gaps) / 1e3, "largest_gap_ms": max(gaps, default=0.0) / 1e3,
            "gaps_after": dict(sorted(after.items(), key=lambda kv: -kv[1][1])[:8])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--modes", nargs="+", choices=["none", "fixed", "adaptive", "fixed-chain", "adaptive-chain"],
                        default=["none", "fixed"])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--gaps", action="store_true",
                        help="instead of cProfile: the device's busy time and idle gaps (torch.profiler)")
    parser.add_argument("--verify-chain", type=int, default=4, help="for the *-chain modes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = dict(SHAPES[args.shape])
    config["num_hidden_layers"] = args.layers = args.layers or config["num_hidden_layers"]
    path = write_config_dir(config)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = {b: [random_ids(args.prompt_len, config["vocab_size"], seed=1000 * b + i) for i in range(b)]
               for b in args.batch_sizes}
    # The recording the replay drafter proposes from (spec_replay.py, step 1).
    recorder = build(args, path, "none", None)
    replay_path = os.path.join(tempfile.mkdtemp(prefix="deepinfer-replay-"), "replay.jsonl")
    with open(replay_path, "w") as f:
        for b in args.batch_sizes:
            for prompt, out in zip(prompts[b], recorder.generate(prompts[b], params, use_tqdm=False)):
                f.write(json.dumps({"prompt_token_ids": prompt, "output_token_ids": out.outputs[0].token_ids,
                                    "acceptance": args.alpha}) + "\n")
    shutdown(recorder)
    del recorder
    free_memory()

    results = []
    for mode in args.modes:
        llm = build(args, path, mode, replay_path)
        for b in args.batch_sizes:
            llm.generate(prompts[b], params, use_tqdm=False)   # warm-up
            if args.gaps:
                row = {"mode": mode, "batch": b, **device_gaps(llm, prompts[b], params)}
                print(json.dumps(row), flush=True)
                results.append(row)
                continue
            row = {"mode": mode, "batch": b, **profile_generate(llm, prompts[b], params, args.top)}
            print(f"\n===== {mode}, batch {b}: {row['steps']} steps, {row['ms_per_step']:.3f} ms a step "
                  f"without the profiler =====\n{row['profile']}", flush=True)
            results.append(row)
        shutdown(llm)
        del llm
        free_memory()
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "rows": results})


if __name__ == "__main__":
    main()
