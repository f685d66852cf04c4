"""DeepSeek-V4's MTP speculation at batch 1 on the GPU: the speedup over decoding without it, at the
acceptance its own MTP layer's drafts reach, and the greedy tokens compared with and without it.

    python benchmarks/v4_mtp_speed.py [--shape flash|tiny] [--layers 4] [--routed-experts N] [--quantization fp8|auto]
        [--configs fixed:1 fixed:2 adaptive:2] [--context 1024] [--output-len 256] [--rounds 2]
        [--phases] [--profile] [--out JSON]

V4-Flash width (v4_gpu_speed.py's shape) with its one MTP layer (sliding attention, a learned
MoE, as released), one engine per configuration: first one without speculation (the anchor), then
one per `--configs` entry, "verification:k" (speculative_config method "mtp", k drafts a step from
the one MTP layer used recursively, verification "fixed" or "adaptive"). An engine is freed before
the next is built, so each has the GPU to itself.

Random weights give the MTP layer nothing to predict, so they are made to have one clear greedy
continuation, as spec_replay.py's stable_greedy does for Llama: the head reads the embedding
matrix and every block's output projections (attention o_b_proj, the shared expert's and the
routed experts' down projections) are scaled by 2^-12, so the model repeats its last token by a wide
margin. The MTP layer gets the same treatment and an identity e_proj, so it drafts that token
too (its input is the next token's embedding). Every kernel runs as on real weights, drafting
included; what this measures is what drafting with the MTP layer and verifying cost, at the
acceptance printed beside each row (per draft position), not how well a trained MTP layer drafts.
`identical` says whether every request's tokens equal the anchor's.

Throughput is generated tokens / wall time of LLM.generate (the prefill included, the same in
every row), best of --rounds. --phases adds each row's host milliseconds a step by phase
(step_phases.py) and the steps each loop took (spec_decode/overlap.py); --profile the GPU kernels
of one more generate (their count, summed time and the costliest), so a row's time splits into
the device's and the host's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import free_memory, machine_info, print_table, random_ids, shutdown, write_json  # noqa: E402
from spec_replay import timed  # noqa: E402
from step_phases import StepPhases  # noqa: E402
from v4_gpu_speed import kernel_profile, shape  # noqa: E402

# Every block's additions to the residual streams are scaled by this (a power of two, so FP4
# experts take it in their exponents).
SCALE_LOG2 = -12


def scale_down(module, log2: int) -> None:
    """Multiply a projection's weight by 2^log2, whatever format it is held in."""
    import torch

    from deepinfer.layers.linear import Linear
    from deepinfer.models.deepseek_v4.moe import RoutedExperts

    if isinstance(module, RoutedExperts):
        if module.fp4_group is not None:   # ue8m0 exponents: the scale's log2 plus 127
            module.down_exps.sub_(-log2)
        else:
            module.down_proj.mul_(2.0 ** log2)
    elif isinstance(module, Linear) and module.is_fp8:
        module.weight_scale.mul_(2.0 ** log2)
    else:
        with torch.no_grad():
            module.weight.mul_(2.0 ** log2)


def identity(linear) -> None:
    """An identity projection, in the layer's format."""
    import torch

    from deepinfer.layers.quantization import fp8

    eye = torch.eye(linear.weight.shape[0], device=linear.weight.device)
    if linear.is_fp8:
        codes, scale = fp8.quantize_blocks(eye, linear.weight_block)
        linear.weight.copy_(codes)
        linear.weight_scale.copy_(scale)
    else:
        linear.weight.copy_(eye)


def stable_greedy(model) -> None:
    """The module docstring's weights, in place (captured CUDA graphs read the same tensors)."""
    import torch

    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for layer in [*model.model.layers, *model.mtp]:
            scale_down(layer.self_attn.o_b_proj, SCALE_LOG2)
            scale_down(layer.mlp.shared_experts.down_proj, SCALE_LOG2)
            scale_down(layer.mlp.experts, SCALE_LOG2)
        for mtp in model.mtp:
            identity(mtp.e_proj)
            scale_down(mtp.h_proj, SCALE_LOG2)


def build(args, path: str, config: str | None):
    from deepinfer import LLM

    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=args.context + args.output_len + 64,
                  skip_tokenizer_init=True, max_num_seqs=8, enable_prefix_caching=False,
                  quantization=args.quantization)
    if config is not None:
        verification, k = config.split(":")
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": int(k),
                                        "verification": verification}
    llm = LLM(path, **kwargs)
    model = llm.engine.executor.runner.model   # random weights drawn by the model (dummy_weights.py)
    stable_greedy(model)
    if getattr(model, "head_packed", None) is not None:   # the CPU's packed copy of the head (--shape tiny)
        model.pack_weights()
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["flash", "tiny"], default="flash",
                        help="tiny: a small config that runs anywhere (checks the script)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--routed-experts", type=int, default=None, help="routed experts (V4-Flash: 256)")
    parser.add_argument("--quantization", choices=["auto", "fp8"], default="fp8",
                        help="fp8: V4's own formats (FP8 blocks, FP4 experts); auto: bf16 (with its MTP layer, 64 GB)")
    parser.add_argument("--configs", nargs="+", default=["fixed:1", "fixed:2", "adaptive:2"],
                        help="verification:k, one engine each")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=2, help="batch-1 requests, one after another")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--phases", action="store_true", help="host time a step by phase, steps by loop")
    parser.add_argument("--profile", action="store_true", help="the kernels of one generate per row")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from gpu_reference_baseline import write_config_dir

    from deepinfer import SamplingParams

    config = shape(args.shape, args.layers, args.context + args.output_len + 64, args.routed_experts)
    config.update(num_nextn_predict_layers=1)
    path = write_config_dir(config)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": random_ids(args.context, config["vocab_size"], seed=i)} for i in range(args.prompts)]
    result = {"benchmark": "v4_mtp_speed", "machine": machine_info(), "args": vars(args), "rows": []}
    anchor = None
    for config_name in [None, *args.configs]:
        llm = build(args, path, config_name)
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        seconds, tokens, spec = 0.0, [], None
        phases = StepPhases(llm.engine) if args.phases else None
        chooser = getattr(llm.engine.loop, "loop_chooser", None)
        loops_before = dict(chooser.counts) if chooser is not None else {}
        for prompt in prompts:   # batch 1: each request alone
            s, outputs, stats, by_phase = timed(llm, [prompt], params, args.rounds, phases)
            seconds += s
            tokens.append(outputs[0].outputs[0].token_ids)
            if stats is not None:   # summed over the requests (per position: the last request's)
                spec = stats if spec is None else {k: (spec[k] + v if isinstance(v, int) else v)
                                                   for k, v in stats.items()}
                spec["mean_emitted"] = 1 + spec["accepted"] / max(1, spec["verifications"])
        row = {"config": config_name or "none", "seconds": seconds,
               "tok_s": sum(len(t) for t in tokens) / seconds}
        if phases is not None:   # the last request's fastest round; loops over every round
            row["host_ms_per_step"] = by_phase
            if chooser is not None:
                row["loop_steps"] = {loop: n - loops_before.get(loop, 0) for loop, n in chooser.counts.items()}
        if args.profile:
            row["kernels"] = kernel_profile(lambda engine=llm: engine.generate(prompts[:1], params, use_tqdm=False))
        if anchor is None:
            anchor = (row["tok_s"], tokens)
        else:
            row.update(speedup=row["tok_s"] / anchor[0], identical=tokens == anchor[1], spec=spec)
        result["rows"].append(row)
        print(row, flush=True)
        write_json(args.out, result)
        shutdown(llm)
        del llm
        free_memory()
    rows = [{**r, "speedup": r.get("speedup", 1.0), "emitted": (r.get("spec") or {}).get("mean_emitted", 1.0),
             "identical": r.get("identical", "-")} for r in result["rows"]]
    print_table(rows, [("config", "config", ""), ("tok_s", "tok/s", ".1f"), ("speedup", "speedup", ".2f"),
                       ("emitted", "tokens a step", ".2f"), ("identical", "identical", "")])

if __name__ == "__main__":
    main()
