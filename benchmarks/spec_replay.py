"""Speculative decoding's verification machinery at a controlled acceptance rate (GPU).

    python benchmarks/spec_replay.py [--shape llama3-8b|smollm2-135m] [--alphas 0.5 0.7 0.9] [--batch-sizes 1 16 64]
        [--k 5] [--prompt-len 128] [--output-len 128] [--modes fixed adaptive fixed-chain adaptive-chain
        draft-fixed draft-adaptive draft-fixed-eager] [--verify-chain 4] [--draft-shape llama3.2-1b]
        [--phases] [--trace] [--out JSON]

A drafter's quality and the engine's verification cost are two things; this measures the second.
The model is the Llama-3-8B shape (or SmolLM2-135M's) with random weights. First an engine without speculation runs
each cell's prompts (random ids, greedy, --output-len tokens, EOS ignored): its time is the
anchor, and its outputs are recorded. Then engines with the replay drafter
(spec_decode/replay.py: the recorded continuation, each draft token kept with probability alpha,
else changed) run the same prompts, k drafts a request and step, verification fixed (every draft)
or adaptive (the drafts that pay under the step-cost model). At acceptance alpha a fixed step emits
(1 - alpha^(k+1)) / (1 - alpha) tokens a request on average: 1.94 at 0.5, 2.94 at 0.7, 4.69 at
0.9 with k = 5.

Random weights have a flat output distribution: its top two logits are close enough that the
rounding of another batch shape (a verify step's 1 + k rows a request against a decode step's
one) flips the greedy token every few dozen tokens, and the request leaves its recording. So
the weights are made to have one clear greedy continuation (stable_greedy: the head reads the
embedding matrix and the layers' output projections are scaled down, so the model repeats its
last token by a wide margin); every kernel runs as on any weights, so the step costs the same.
The acceptance measured per position is printed beside alpha, and `diverged` counts requests
that left their recording anyway (they get no more drafts).

Modes `draft-fixed`, `draft-adaptive` and `draft-fixed-eager` draft with a second model instead
(method draft_model, spec_decode/draft_model.py): a random-weight model of --draft-shape (Llama
3.2 1B's, the target's vocabulary) made to repeat its last token as the target is (stable_greedy),
so its drafts are the target's continuation and every one is accepted: what they measure is the
cost of drafting with a model and verifying, its decode steps in CUDA graphs or (`-eager`) not.
They run the first alpha's prompts only (their acceptance is the draft model's own).

Modes `fixed-chain` and `adaptive-chain` run verify chains (`verify_chain`, worker/spec/verify_chain.py):
up to --verify-chain verify steps per plan back to back on the device, the later ones drafted on
the device from the same replay table.

The anchor runs two ways: with overlapped scheduling (the engine's default on CUDA), and without
it (`none-sync`), which is how every speculative step runs, since verifying needs the previous
step's tokens on the host: the difference is the host time a synchronous step exposes.

Throughput is generated tokens / wall time of LLM.generate over the batch (the 128-token prefill
included), best of --rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_common import free_memory, machine_info, random_ids, shutdown, write_json  # noqa: E402
from gpu_fast_path import SHAPES  # noqa: E402
from gpu_reference_baseline import LLAMA3_8B, write_config_dir  # noqa: E402
from step_phases import StepPhases  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402


def expected_emitted(alpha: float, k: int) -> float:
    """Tokens a fixed-k verification emits on average at acceptance alpha per position."""
    return k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


# Draft models for the draft-* modes: the target's vocabulary, a smaller body.
DRAFT_SHAPES = {"llama3.2-1b": dict(LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)}


def stable_greedy(llm: LLM, scale: float = 0.05) -> None:
    """Give random weights one clear greedy continuation (see the module docstring): the head
    reads the embedding matrix, so the last token's own embedding wins by ~|e|^2 over any other
    token's, and the layers' additions to the residual stream (attention and MLP output
    projections) are scaled by `scale`. In place, so captured CUDA graphs see it. A draft
    model, if any, gets the same treatment: its greedy continuation is then the target's."""
    stable_greedy_model(llm.engine.executor.runner.model, scale)
    drafter = llm.engine.spec.drafter if llm.engine.spec is not None else None
    if hasattr(drafter, "executor"):   # a draft model (spec_decode/draft_model.py)
        stable_greedy_model(drafter.executor.runner.model, scale)


def stable_greedy_model(model, scale: float) -> None:
    with torch.no_grad():
        if hasattr(model, "lm_head"):   # else the head is tied to the embedding already
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def build(args, path: str, mode: str, replay_path: str | None) -> LLM:
    kwargs = dict(load_format="dummy", max_num_seqs=max(args.batch_sizes),
                  max_model_len=args.prompt_len + args.output_len + args.k + 16,
                  num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False)
    if mode == "none-sync":
        kwargs["async_scheduling"] = False
    elif mode.startswith("draft-"):
        kwargs["speculative_config"] = {"method": "draft_model", "model": args.draft_path,
                                        "verification": mode.split("-")[1], "num_speculative_tokens": args.k,
                                        "enforce_eager": mode.endswith("-eager")}
    elif mode != "none":
        verification, chained = mode.removesuffix("-chain"), mode.endswith("-chain")
        kwargs["speculative_config"] = {"method": "replay", "replay_path": replay_path, "verification": verification,
                                        "num_speculative_tokens": args.k,
                                        "verify_chain": args.verify_chain if chained else 1}
    start = time.perf_counter()
    llm = LLM(path, **kwargs)
    stable_greedy(llm)
    print(f"[{mode}] engine built in {time.perf_counter() - start:.1f} s", flush=True)
    return llm


def timed(llm: LLM, prompts, params: SamplingParams, rounds: int, phases: StepPhases | None = None):
    """(seconds of the fastest round, its outputs, spec counters of that round or None, host
    time by phase of that round or None)."""
    best = None
    for _ in range(rounds):
        if phases is not None:
            phases.take()   # from this round's first step
        before = llm.spec_decode_stats
        # Requests that left their recording (the replay drafter's count; a draft model has none).
        diverged = getattr(llm.engine.spec.drafter, "num_diverged", 0) if llm.engine.spec is not None else 0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        spec = None
        after = llm.spec_decode_stats
        if after is not None:
            steps = after.num_drafts - before.num_drafts
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            spec = {"verifications": steps, "verified": after.num_draft_tokens - before.num_draft_tokens,
                    "accepted": accepted, "mean_emitted": 1 + accepted / steps if steps else 1.0,
                    "acceptance_per_pos": [(a1 - a0) / (v1 - v0) if v1 > v0 else None for a0, a1, v0, v1 in zip(
                        before.accepted_per_pos, after.accepted_per_pos, before.verified_per_pos,
                        after.verified_per_pos)],
                    "diverged": getattr(llm.engine.spec.drafter, "num_diverged", 0) - diverged}
        if best is None or seconds < best[0]:
            best = (seconds, outputs, spec, None if phases is None else phases.take())
    return best


def run_cells(llm: LLM, mode: str, cells, prompts, params: SamplingParams, rounds: int,
              rows: list[dict], phases: bool = False, trace: bool = False) -> dict:
    """Every cell's prompts through `llm`, a row each into `rows`; returns the outputs by cell.
    phases: also time the host's work by phase (step_phases.py) into each row. trace: the loop
    chooser's every measured step (all rounds of the cell) into each row."""
    outputs_by_cell = {}
    timer = StepPhases(llm.engine) if phases else None
    chooser = llm.engine.loop.loop_chooser
    steps: list = []
    if trace and chooser is not None:   # every step the chooser saw: (done, batch, speculative, tokens, drafted)
        observe = chooser.observe

        def traced(done, batch, speculative, tokens, drafted=True):
            steps.append((round(done, 6), batch, speculative, tokens, drafted))
            return observe(done, batch, speculative, tokens, drafted)

        chooser.observe = traced
    for cell in cells:
        loops_before = dict(chooser.counts) if chooser is not None else None
        steps.clear()
        seconds, outputs, spec, by_phase = timed(llm, prompts[cell], params, rounds, timer)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append({"alpha": cell[0], "batch": cell[1], "mode": mode, "seconds": seconds,
                     "tokens": tokens, "tok_s": tokens / seconds, "spec": spec})
        if chooser is not None:   # steps each loop took over the cell's rounds (spec_decode/overlap.py)
            rows[-1]["loop_steps"] = {loop: n - loops_before[loop] for loop, n in chooser.counts.items()}
            if trace:
                rows[-1]["trace"] = list(steps)
        if by_phase is not None:
            rows[-1]["host_ms_per_step"] = by_phase
        print(json.dumps(rows[-1]), flush=True)
        outputs_by_cell[cell] = outputs
    return outputs_by_cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=["fixed", "adaptive", "fixed-chain", "adaptive-chain",
                                                       "draft-fixed", "draft-adaptive", "draft-fixed-eager"],
                        default=["fixed", "adaptive"],
                        help="*-chain: verify chains of up to --verify-chain steps (worker/spec/verify_chain.py); "
                             "draft-*: a draft model of --draft-shape (see the module docstring)")
    parser.add_argument("--draft-shape", choices=list(DRAFT_SHAPES), default="llama3.2-1b")
    parser.add_argument("--verify-chain", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks per engine (they share the GPU)")
    parser.add_argument("--no-sync-anchor", action="store_true", help="skip the anchor without overlapped scheduling")
    parser.add_argument("--phases", action="store_true",
                        help="also report the host's time per step by phase (step_phases.py; the timers cost a little)")
    parser.add_argument("--trace", action="store_true",
                        help="record the loop chooser's every step (adaptive modes; spec_decode/overlap.py) in the JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = dict(SHAPES[args.shape])
    config["num_hidden_layers"] = args.layers = args.layers or config["num_hidden_layers"]
    path = write_config_dir(config)
    args.draft_path = write_config_dir(dict(DRAFT_SHAPES[args.draft_shape], vocab_size=config["vocab_size"]))
    vocab = config["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    cells = [(alpha, batch) for alpha in args.alphas for batch in args.batch_sizes]
    prompts = {cell: [random_ids(args.prompt_len, vocab, seed=hash(cell) % 10**6 + i) for i in range(cell[1])]
               for cell in cells}
    warm_up = [random_ids(args.prompt_len, vocab, seed=999_999)]

    # 1. No speculation: the anchor, and the recording of every cell's greedy continuations.
    rows: list[dict] = []
    llm = build(args, path, "none", None)
    llm.generate(warm_up, params, use_tqdm=False)
    recorded = run_cells(llm, "none", cells, prompts, params, args.rounds, rows, args.phases)
    replay_path = os.path.join(tempfile.mkdtemp(prefix="deepinfer-replay-"), "replay.jsonl")
    with open(replay_path, "w") as f:
        for cell in cells:
            for prompt, out in zip(prompts[cell], recorded[cell]):
                f.write(json.dumps({"prompt_token_ids": prompt, "output_token_ids": out.outputs[0].token_ids,
                                    "acceptance": cell[0]}) + "\n")
    shutdown(llm)
    del llm
    free_memory()

    # 2. The anchor as a speculative engine runs its steps (synchronously), then the replay
    # drafter at each alpha, fixed and adaptive verification.
    costs = {}
    modes = ([] if args.no_sync_anchor else ["none-sync"]) + args.modes
    for mode in modes:
        llm = build(args, path, mode, None if mode == "none-sync" else replay_path)
        if "adaptive" in mode:
            costs[f"{mode}, start-up profile"] = llm.engine.spec.cost_model.describe()
        llm.generate(warm_up, params, use_tqdm=False)
        mode_cells = [c for c in cells if c[0] == args.alphas[0]] if mode.startswith("draft-") else cells
        run_cells(llm, mode, mode_cells, prompts, params, args.rounds, rows, args.phases, args.trace)
        chain = llm.engine.executor.runner.verify_chain
        if chain is not None:
            costs[f"{mode}: verify chains run, their steps"] = f"{chain.num_chains}, {chain.num_steps}"
        if "adaptive" in mode:
            costs[f"{mode}, after the run"] = llm.engine.spec.cost_model.describe()
            if llm.engine.loop.loop_chooser is not None:   # overlapped steps without drafts (spec_decode/overlap.py)
                costs[f"{mode}, loop chooser, tokens a second by loop"] = llm.engine.loop.loop_chooser.describe()
                costs[f"{mode}, loop chooser, steps by loop"] = str(llm.engine.loop.loop_chooser.counts)
        shutdown(llm)
        del llm
        free_memory()

    base = {(r["alpha"], r["batch"]): r["tok_s"] for r in rows if r["mode"] == "none"}
    fixed = {(r["alpha"], r["batch"]): r["tok_s"] for r in rows if r["mode"] == "fixed"}
    print(f"\n{args.shape} shape ({args.layers} layers, random weights), k={args.k}, prompt {args.prompt_len}, "
          f"output {args.output_len} tokens, greedy, best of {args.rounds}\n")
    print("| alpha | batch | mode | tok/s | vs none | vs fixed | emitted/step (expected fixed) "
          "| acceptance per position | diverged |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        key = (r["alpha"], r["batch"])
        spec = r["spec"]
        vs_fixed = f"{r['tok_s'] / fixed[key]:.2f}x" if r["mode"] not in ("none", "none-sync", "fixed") and key in fixed else "-"
        if spec:
            emitted = f"{spec['mean_emitted']:.2f} ({expected_emitted(r['alpha'], args.k):.2f})"
            curve = " ".join("-" if p is None else f"{p:.2f}" for p in spec["acceptance_per_pos"])
            diverged = str(spec["diverged"])
        else:
            emitted, curve, diverged = "1.00", "-", "-"
        print(f"| {r['alpha']} | {r['batch']} | {r['mode']} | {r['tok_s']:.1f} | {r['tok_s'] / base[key]:.2f}x "
              f"| {vs_fixed} | {emitted} | {curve} | {diverged} |")
    if args.phases:
        names = ["schedule", "update", "forward", "sample", "collect", "core", "caller"]
        print("\nhost time per step by phase, ms (step_phases.py; collect waits for the device)\n")
        print("| alpha | batch | mode | steps | " + " | ".join(names) + " |")
        print("|---|---|---|---|" + "---|" * len(names))
        for r in rows:
            ms = r["host_ms_per_step"]
            print(f"| {r['alpha']} | {r['batch']} | {r['mode']} | {ms['steps']} | "
                  + " | ".join(f"{ms.get(n, 0.0):.3f}" for n in names) + " |")
    for when, description in costs.items():
        print(f"\n{when}: {description}")
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "rows": rows, "costs": costs})


if __name__ == "__main__":
    main()
