"""Speculative decoding throughput: no speculation vs fixed k vs adaptive (variable-length) verification.

    python benchmarks/spec_decode.py [--model PATH] [--load-format dummy] [--batch-sizes 1 16 64]
        [--method ngram] [--num-speculative-tokens 5] [--output-len 64] [--workloads copy chat]
        [--modes none fixed adaptive fixed-chain adaptive-chain] [--verify-chain 8]

Workloads (chat-templated, greedy, EOS ends a request, at most --output-len tokens):
  copy  prompts that ask to repeat or lightly edit a given paragraph: the answer quotes the
        prompt, so n-gram drafts hit (the case speculation is for);
  chat  open questions: drafts rarely hit, so speculation must not cost much.
One engine per mode is built up front (adaptive profiles its step cost at start-up, not timed);
then for each workload and batch size the modes take turns (so a noisy moment of a shared
machine hits all of them), each warming up once untimed and then timed --rounds times (best
kept). Throughput is generated tokens / wall time of `LLM.chat` over the whole batch (prefill
included). Mean
accepted length (1 + accepted / verifications) and acceptance per position come from the
engine's counters over the timed run. With --load-format dummy the weights are random, so
acceptance means little; use it for step-cost shapes. Runs on the accelerator that
DEEPINFER_ACCELERATOR selects (cuda on a GPU host).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from deepinfer import LLM, SamplingParams

PARAGRAPHS = [
    ("The river rose slowly through the night, and by morning the lower fields were under water. "
     "Farmers moved their animals to the hill behind the church, where the ground stayed dry."),
    ("Our office will be closed on Monday for maintenance. Please save your work on Friday evening, "
     "log out of every shared computer, and take any personal items home with you."),
    ("To make the bread, mix the flour, water, salt and yeast, then knead the dough for ten minutes. "
     "Let it rise for two hours, shape it into a loaf, and bake it until the crust is brown."),
    ("The library opens at nine and closes at six. Members may borrow up to five books at a time "
     "and keep them for three weeks; late returns cost ten cents per book per day."),
    ("def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n"
     "    return 2 * (width + height)\n"),
    ("Dear team, thank you for your hard work this quarter. Sales grew by twelve percent, costs "
     "fell slightly, and two new customers signed long contracts with us in March."),
    ("The train to the coast leaves from platform four at half past eight. It stops at every town "
     "along the valley and reaches the sea a little after eleven o'clock."),
    ("Water boils at one hundred degrees Celsius at sea level. On a high mountain the air pressure "
     "is lower, so water boils at a lower temperature and food takes longer to cook."),
]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rewrite the following text with every sentence on its own line, changing nothing else:\n\n{}",
    "Copy this text and fix any spelling mistakes (there may be none):\n\n{}",
    "Quote the following passage back to me in full:\n\n{}",
]
TOPICS = ["the Moon", "volcanoes", "coffee", "the Roman Empire", "whales", "jazz", "Mount Everest",
          "the printing press", "honey bees", "glaciers", "chess", "the Nile", "bicycles", "tea",
          "lighthouses", "the Sahara"]
CHAT_TASKS = ["Tell me three interesting facts about {}.", "Write a short poem about {}.",
              "Explain {} to a ten-year-old.", "What should a visitor know about {}?"]


def conversations(workload: str, n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        if workload == "copy":
            text = COPY_TASKS[i % len(COPY_TASKS)].format(PARAGRAPHS[(i // len(COPY_TASKS) + i) % len(PARAGRAPHS)])
        else:
            text = CHAT_TASKS[i % len(CHAT_TASKS)].format(TOPICS[(i // len(CHAT_TASKS) + i) % len(TOPICS)])
        out.append([{"role": "user", "content": text}])
    return out


def build(args: argparse.Namespace, mode: str) -> LLM:
    kwargs = {"max_num_seqs": max(args.batch_sizes), "max_model_len": args.max_model_len,
              "load_format": args.load_format}
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if args.num_kv_blocks:   # on a GPU: the engines of all modes share the card, each sized alike
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    if mode != "none":
        spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
                "verification": mode.removesuffix("-chain")}
        if mode.endswith("-chain"):   # verify chains (worker/spec/verify_chain.py)
            spec["verify_chain"] = args.verify_chain
        if args.method == "draft_model":
            spec["model"] = args.draft_model
        kwargs["speculative_config"] = spec
    return LLM(args.model, **kwargs)


def run_one(llm: LLM, prompts, params: SamplingParams) -> tuple[float, int, dict | None]:
    before = llm.spec_decode_stats
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    spec = None
    after = llm.spec_decode_stats
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        verified = after.num_draft_tokens - before.num_draft_tokens
        per_pos = [(a1 - a0) / (v1 - v0) if v1 > v0 else 0.0 for a0, a1, v0, v1 in
                   zip(before.accepted_per_pos, after.accepted_per_pos, before.verified_per_pos,
                       after.verified_per_pos)]
        spec = {"mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
                "verified": verified, "accepted": accepted,
                "proposed": after.num_proposed_tokens - before.num_proposed_tokens,
                "acceptance_per_pos": per_pos}
    return elapsed, tokens, spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks per engine (default: the memory budget; one engine per mode is built)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--workloads", nargs="+", choices=["copy", "chat"], default=["copy", "chat"])
    parser.add_argument("--modes", nargs="+", choices=["none", "fixed", "adaptive", "fixed-chain", "adaptive-chain"],
                        default=["none", "fixed", "adaptive"],
                        help="*-chain: verify chains of up to --verify-chain steps (n-gram drafts on the device)")
    parser.add_argument("--verify-chain", type=int, default=8)
    parser.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    parser.add_argument("--draft-model", default=None, help="draft model path (method draft_model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.method == "draft_model" and not args.draft_model:
        parser.error("--draft-model is required with --method draft_model")

    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    load = os.getloadavg()[0]
    engines = {mode: build(args, mode) for mode in args.modes}
    costs = {}
    if "adaptive" in engines:
        costs["start-up profile"] = engines["adaptive"].engine.spec.cost_model.describe()
    rows = []
    for workload in args.workloads:
        for batch in args.batch_sizes:
            prompts = conversations(workload, batch)
            for mode, llm in engines.items():
                llm.chat(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)   # warm-up
                best = None
                for _ in range(args.rounds):
                    elapsed, tokens, spec = run_one(llm, prompts, params)
                    if best is None or tokens / elapsed > best[1] / best[0]:
                        best = (elapsed, tokens, spec)
                elapsed, tokens, spec = best
                rows.append({"workload": workload, "batch": batch, "mode": mode, "tok_s": tokens / elapsed,
                             "tokens": tokens, "seconds": elapsed, "spec": spec})
                print(json.dumps(rows[-1]), flush=True)
    if "adaptive" in engines:
        costs["after the run (online corrections)"] = engines["adaptive"].engine.spec.cost_model.describe()

    print(f"\nmodel {args.model or 'SmolLM2-135M-Instruct (default)'}, method {args.method}, "
          f"k={args.num_speculative_tokens}, output <= {args.output_len} tokens, greedy; "
          f"{platform.machine()} {os.cpu_count()} CPUs; load average at start {load:.2f}, "
          f"at end {os.getloadavg()[0]:.2f}\n")
    print("| workload | batch | mode | tok/s | vs none | vs fixed | mean accepted length | acceptance per position |")
    print("|---|---|---|---|---|---|---|---|")
    base = {(r["workload"], r["batch"], r["mode"]): r["tok_s"] for r in rows}
    for r in rows:
        none = base.get((r["workload"], r["batch"], "none"))
        fixed = base.get((r["workload"], r["batch"], "fixed"))
        vs_none = f"{r['tok_s'] / none:.2f}x" if none else "-"
        vs_fixed = f"{r['tok_s'] / fixed:.2f}x" if fixed and r["mode"] != "none" else "-"
        spec = r["spec"]
        if spec:
            length = f"{spec['mean_accepted_length']:.2f}"
            curve = (" ".join(f"{p:.2f}" for p in spec["acceptance_per_pos"])
                     + f" (verified {spec['verified']} of {spec['proposed']} proposed)")
        else:
            length, curve = "1.00", "-"
        print(f"| {r['workload']} | {r['batch']} | {r['mode']} | {r['tok_s']:.1f} | {vs_none} | {vs_fixed} | "
              f"{length} | {curve} |")
    for when, description in costs.items():
        print(f"\nadaptive step-cost table, {when}: {description}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rows": rows, "costs": costs, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
