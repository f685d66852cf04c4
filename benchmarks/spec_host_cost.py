"""The host's cost of speculative steps on the scheduler side, without a model (any machine).

    python benchmarks/spec_host_cost.py [--batch 64] [--k 5] [--alpha 0.7] [--steps 60]

A batch of requests follows recorded continuations with the replay drafter (spec_decode/replay.py)
through the real Scheduler and SpeculativeDecoder; the "runner" is a loop that accepts each draft
while it matches the recording. It times `schedule()` (drafting, the verification policy, KV
allocation, the plan) and `update()` (applying verdicts, calibration, KV release) per step, for
fixed and adaptive verification: the host work a synchronous verify step exposes on a GPU
(spec_replay.py --phases measures the same phases inside a real engine).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from deepinfer.config import SchedulerConfig, SpeculativeConfig
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode import SpeculativeDecoder
from deepinfer.spec_decode.cost_model import StepCostModel
from deepinfer.spec_decode.replay import Recording, ReplayDrafter
from deepinfer.types.plan import RunnerResult
from deepinfer.types.request import Request


def run(mode: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(ms of schedule, ms of update) per step, and the steps timed."""
    rng = random.Random(0)
    recordings = [Recording([i + 1] * args.prompt_len, [rng.randrange(1000) for _ in range(args.output_len + 8)],
                            args.alpha) for i in range(args.batch)]
    # A GPU-like curve: flat at small batches, rising with drafts at 64.
    cost = StepCostModel({b: [(0.0, 0.005 + b / 16e3), (float(args.k), 0.0055 + b / 5e3)] for b in (1, 4, 16, 64)})
    spec = SpeculativeDecoder(SpeculativeConfig("replay", args.k, verification=mode, replay_path="-"),
                              ReplayDrafter(recordings, 1000), 4096, cost)
    kv = KVCacheManager(group_layers([FullAttentionSpec(8, 128, torch.bfloat16)]), 16384, 16)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=args.batch), kv, 4096, spec)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, r in enumerate(recordings):
        scheduler.add_request(Request(f"r{i}", list(r.prompt_token_ids), params, frozenset({0}), args.output_len,
                                      block_size=16))
    outputs = {f"r{i}": r.output_token_ids for i, r in enumerate(recordings)}
    schedule_s = update_s = 0.0
    steps = 0
    while scheduler.has_unfinished():
        start = time.perf_counter()
        plan = scheduler.schedule()
        planned = time.perf_counter()
        sampled = {}
        for c in plan.chunks:
            done = scheduler.requests[c.request_id].num_output_tokens
            truth = outputs[c.request_id][done:]
            accepted = 0
            while accepted < len(c.spec_token_ids) and c.spec_token_ids[accepted] == truth[accepted]:
                accepted += 1
            sampled[c.request_id] = truth[:accepted + 1]
        applying = time.perf_counter()
        scheduler.update(plan, RunnerResult(sampled))
        if steps:   # the first step is the prefill
            schedule_s += planned - start
            update_s += time.perf_counter() - applying
        steps += 1
    timed = max(steps - 1, 1)
    return 1e3 * schedule_s / timed, 1e3 * update_s / timed, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for mode in ("fixed", "adaptive"):
        best = min((run(mode, args) for _ in range(args.repeats)), key=lambda r: r[0] + r[1])
        print(f"{mode:>8}, batch {args.batch}: schedule {best[0]:.3f} ms, update {best[1]:.3f} ms a step "
              f"({best[2]} steps, best of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()
