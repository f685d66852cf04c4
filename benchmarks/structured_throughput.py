"""Structured output cost: batch-64 decode with a JSON-schema constraint vs none, and compile times.

    python benchmarks/structured_throughput.py [--batch 64] [--output-len 64] [--rounds 3] [--shape llama3-8b]

--shape llama3-8b (GPU): a random-weight Llama-3-8B-shaped model with the default model's
tokenizer, so the forward, not the host, sets the step time (the default model on a GPU is
host-bound: a 135M-parameter forward takes far less than the step's host work).

Same prompts, same max_tokens, greedy. The constrained run uses an open-ended schema (an object
holding a list of strings) (at least 64 strings) so requests run to max_tokens like the unconstrained ones
(`ignore_eos`); throughput is generated tokens / wall time, best of --rounds, the two modes
alternating so machine noise hits both. Every constrained output is checked to be a valid
prefix of the schema's language (complete outputs must validate). Compile time is measured on
the engine's own manager: cold (first sight of a schema) and cached (the same schema again).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jsonschema

from deepinfer import LLM, SamplingParams
from deepinfer.sample.structured import GrammarState
from deepinfer.sampling_params import StructuredOutputsParams

OPEN_SCHEMA = {"type": "object", "required": ["facts"], "additionalProperties": False,
               "properties": {"facts": {"type": "array", "items": {"type": "string"}, "minItems": 64}}}
# A tool-call-like schema of real size, for the compile-time figures.
TOOL_SCHEMA = {
    "type": "object", "required": ["name", "arguments"], "additionalProperties": False,
    "properties": {
        "name": {"enum": ["search", "get_weather", "book_flight", "send_email"]},
        "arguments": {"type": "object", "additionalProperties": False,
                      "required": ["query", "when", "limit"],
                      "properties": {"query": {"type": "string", "maxLength": 200},
                                     "when": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                                     "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                                     "filters": {"type": "array", "maxItems": 5,
                                                 "items": {"anyOf": [{"type": "string"}, {"type": "number"}]}}}}}}
TOPICS = ["Paris", "the Moon", "whales", "volcanoes", "the Roman Empire", "coffee", "Mount Everest", "jazz"]


def run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, int, list]:
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), outputs


def compile_ms(llm: LLM, schema: dict) -> float:
    start = time.perf_counter()
    grammar = llm.engine.structured.grammar_for(StructuredOutputsParams(json=schema))
    grammar.wait(60)
    assert grammar.poll() is GrammarState.READY, grammar.error
    return 1e3 * (time.perf_counter() - start)


def shape_dir(shape: str) -> str:
    """A config directory of a real model shape with the default model's tokenizer (dummy weights)."""
    import os

    from gpu_reference_baseline import LLAMA3_8B, write_config_dir

    from deepinfer.models.loader import load_model_source

    directory = write_config_dir(dict(LLAMA3_8B, max_position_embeddings=4096))
    tokenizer = load_model_source(None).tokenizer
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tokenizer.chat_template, "eos_token": tokenizer.eos_token,
                   "bos_token": tokenizer.bos_token}, f)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", choices=["default", "llama3-8b"], default="default")
    args = parser.parse_args()

    if args.shape == "default":
        llm = LLM(max_num_seqs=args.batch)
    else:
        llm = LLM(shape_dir(args.shape), load_format="dummy", max_num_seqs=args.batch, max_model_len=4096)
    # Compile figures first, on a fresh engine: the first compile also builds xgrammar's view of
    # the vocabulary (once per engine), reported separately.
    first_ms = compile_ms(llm, {"type": "object"})
    cold_ms = compile_ms(llm, TOOL_SCHEMA)
    cached_ms = compile_ms(llm, TOOL_SCHEMA)

    prompts = [[{"role": "user", "content": f"List facts about {TOPICS[i % len(TOPICS)]} as JSON."}]
               for i in range(args.batch)]
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=OPEN_SCHEMA))
    llm.chat(prompts[:4], free, use_tqdm=False)            # warm-up (kernels, allocations)
    llm.chat(prompts[:4], constrained, use_tqdm=False)
    best = {"free": 0.0, "json": 0.0}
    tokens = {}
    for _ in range(args.rounds):
        for name, params in (("free", free), ("json", constrained)):
            elapsed, n_tokens, outputs = run(llm, prompts, params)
            best[name] = max(best[name], n_tokens / elapsed)
            tokens[name] = n_tokens
            if name == "json":
                for out in outputs:
                    text = out.outputs[0].text
                    if out.outputs[0].finish_reason == "stop":
                        jsonschema.validate(json.loads(text), OPEN_SCHEMA)
                    else:
                        assert text.startswith('{"facts"') or text.startswith("{"), text

    ratio = best["json"] / best["free"]
    runner = llm.engine.executor.runner
    device = (__import__("torch").cuda.get_device_name() if runner.platform.name == "cuda"
              else f"{platform.machine()} CPU, {__import__('os').cpu_count()} cores")
    print(f"device: {device}; model: {args.shape}; async_scheduling: {llm.engine.async_scheduling}")
    print(f"batch {args.batch}, output_len {args.output_len}, best of {args.rounds}")
    print(f"unconstrained: {best['free']:.1f} tok/s ({tokens['free']} tokens)")
    print(f"json schema:   {best['json']:.1f} tok/s ({tokens['json']} tokens)")
    print(f"ratio: {ratio:.3f}")
    print(f"compile: first grammar (incl. tokenizer info) {first_ms:.1f} ms; "
          f"tool schema cold {cold_ms:.1f} ms, cached {cached_ms:.3f} ms")


if __name__ == "__main__":
    main()
