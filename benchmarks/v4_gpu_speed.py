"""DeepSeek-V4 speed on the engine: V4-Flash's full width, truncated depth, random weights.

    python benchmarks/v4_gpu_speed.py [--layers 4] [--context 1024] [--steps 32] [--prefill 8192]
        [--batch 64] [--modes triton,reference] [--experts grouped|loop] [--shape flash|tiny]
        [--quantization auto|fp8] [--enforce-eager] [--routed-experts N] [--offline N]
        [--profile] [--out v4_speed.json]

The first --layers layers of V4-Flash's schedule (4: sliding, sliding, CSA, HCA; the first 3
MoE layers hash-routed), hidden 4096, 64 heads of 512, 256 experts of 2048, vocab 129280, bf16,
random weights (normal, std 0.02: routing spreads over the experts), no MTP. Per mode (the
attention path: "triton", the Triton kernels of models/deepseek_v4/paged_kernels.py, one sparse
gather-attention and one indexer launch per layer over the whole step; "reference", the paged
reference path of paged.py, per request chunk, all of a CSA layer's rows gathered and scored
densely), on the same engine and weights, in one run (the routed experts run as --experts says:
"grouped", two grouped GEMMs, the engine's; "loop", the reference loop over experts):
  decode batch 1   per-step time at --context tokens (generate 1 + --steps tokens minus 1), against
                   the roofline: active weight bytes (every weight but the routed experts a token
                   does not use) / measured copy bandwidth
  prefill          one --prefill-token prompt, against the matmul floor: 2 x active parameters x
                   tokens / measured bf16 matmul rate (attention's FLOPs not counted: a floor)
  decode batch N   --batch requests of 512 tokens decoding --steps tokens: output tokens / s,
                   against its floor: the weights the batch's tokens route to (expected, random
                   routing) read once a step at the copy bandwidth, or its products at the
                   matmul rate, whichever is slower
then the Triton path's speed-up over the reference, and (CUDA, flash shape) the kernels alone at
these shapes (v4_kernel_times.py: one layer's attention and indexer, in ms).
--profile (CUDA) adds, per mode, the GPU kernels of a batch-1 decode step and of the prefill
(torch.profiler: kernels per step, their summed time, the costliest names), where the time the
figures above lose goes.
--shape tiny runs a small config on any device (checks the script; "triton" on the CPU only under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, print_table, write_json
from v4_kv_memory import v4_flash_config

GREEDY = dict(temperature=0.0, ignore_eos=True)


def shape(name: str, layers: int, max_len: int, experts: int | None = None) -> dict:
    config = v4_flash_config()
    if experts:   # routed experts cut to fit (the full-depth shape on one GPU)
        config.update(n_routed_experts=experts)
    if name == "tiny":
        config.update(hidden_size=256, num_attention_heads=8, head_dim=64, q_lora_rank=64, o_groups=2,
                      o_lora_rank=32, index_n_heads=8, index_head_dim=32, index_topk=16, n_routed_experts=16,
                      num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=4096)
    config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers], num_nextn_predict_layers=0,
                  max_position_embeddings=max_len, torch_dtype="bfloat16", rms_norm_eps=1e-6, num_hash_layers=3,
                  swiglu_limit=10.0, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
                  rope_theta=10000.0, compress_rope_theta=160000.0, tie_word_embeddings=False)
    return config


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def active_bytes(model, tokens: int = 1) -> int:
    """Weight bytes a step of `tokens` tokens reads, in the formats held (scales and exponents
    included): all but the routed experts none of its tokens is routed to. One token reads k of
    E experts; `tokens` tokens routed uniformly at random read E * (1 - (1 - k / E) ^ tokens) of
    them on average (the benchmark's random weights and hash tables spread them so)."""
    import torch

    from deepinfer.models.deepseek_v4.moe import RoutedExperts

    total = _nbytes(model.parameters()) + _nbytes(getattr(m, name) for m in model.modules()
                                                  for name in ("weight_scale", "gate_up_exps", "down_exps")
                                                  if isinstance(getattr(m, name, None), torch.Tensor))
    k = model.cfg.experts_per_token
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            held = _nbytes([module.gate_up_proj, module.down_proj, module.gate_up_exps, module.down_exps])
            used = module.num_local * (1 - (1 - k / module.num_local) ** tokens)
            total -= round(held * (module.num_local - used) / module.num_local)
    return total


def active_params(model) -> int:
    """Weights one token multiplies (an FP4 byte holds two): the prefill floor's FLOPs / 2 / tokens."""
    import torch

    from deepinfer.models.deepseek_v4.moe import RoutedExperts

    total = 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            n = p.numel() * (2 if p.dtype == torch.uint8 else 1)
            if isinstance(module, RoutedExperts):
                n = n * model.cfg.experts_per_token // module.num_local
            total += n
    return total


def _kernel_times(fn) -> dict[str, list[float]]:
    """{kernel name: [launches, summed device ms]} of the GPU kernels fn runs (CUDA graphs'
    kernels included: the profiler traces them one by one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us() / 1e3
    return kernels


def kernel_profile(fn, baseline=None, per: int = 1) -> dict:
    """The kernels of fn (less those of baseline: fn's run without the part measured), per `per`
    repetitions: their count, summed time and the 25 costliest names."""
    kernels = _kernel_times(fn)
    for name, (count, ms) in (_kernel_times(baseline) if baseline else {}).items():
        kernels.setdefault(name, [0, 0.0])
        kernels[name][0] -= count
        kernels[name][1] -= ms
    rows = sorted(({"name": n, "count": c / per, "ms": t / per} for n, (c, t) in kernels.items()),
                  key=lambda r: -r["ms"])
    return {"kernels": sum(r["count"] for r in rows), "kernel_ms": sum(r["ms"] for r in rows), "top": rows[:25]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--modes", default="triton,reference", help="attention paths, in this order")
    parser.add_argument("--experts", choices=["grouped", "loop"], default="grouped")
    parser.add_argument("--shape", choices=["flash", "tiny"], default="flash")
    parser.add_argument("--routed-experts", type=int, default=None, help="routed experts (V4-Flash: 256)")
    parser.add_argument("--offline", type=int, default=0,
                        help="also N requests of 1024 prompt / 256 output tokens at once, against the matmul floor")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--quantization", choices=["auto", "fp8"], default="auto",
                        help="fp8: the weights in V4's own formats (FP8 blocks, FP4 experts; engine.quantize_fp8)")
    parser.add_argument("--profile", action="store_true",
                        help="the kernels of a batch-1 decode step, the prefill and a batch decode step")
    parser.add_argument("--overlap-dequantize", action="store_true",
                        help="a prefill's FP4 experts dequantized on a side stream beside the GEMMs "
                             "(fp4_moe_triton.OVERLAP_DEQUANTIZE)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from gpu_fast_path import random_prompts
    from gpu_reference_baseline import copy_bandwidth, matmul_rate, write_config_dir

    from deepinfer import LLM, SamplingParams
    from deepinfer.models.deepseek_v4.formats import checkpoint_nbytes, held_nbytes
    from deepinfer.models.deepseek_v4.moe import RoutedExperts
    from deepinfer.models.deepseek_v4.paged import V4StepBackend
    from deepinfer.models.deepseek_v4.paged_kernels import V4KernelStepBackend
    from deepinfer.platforms import current_platform

    if args.overlap_dequantize:
        from deepinfer.layers.quantization import fp4_moe_triton
        fp4_moe_triton.OVERLAP_DEQUANTIZE = True
    platform = current_platform()
    cuda = platform.name == "cuda"
    max_len = max(args.prefill, args.context + args.steps, 1280 if args.offline else 0) + 64
    config = shape(args.shape, args.layers, max_len, args.routed_experts)
    # Built on the reference path when it is measured: the start-up profile then sizes the KV pool
    # for its peak (the dense logits of the 8k prefill), the larger of the two paths'. Built on
    # the Triton path otherwise, which then captures its decode graphs at start (unless
    # --enforce-eager); a swap to the reference path runs without them.
    modes = args.modes.split(",")
    llm = LLM(write_config_dir(config), load_format="dummy", dtype="bfloat16", max_model_len=max_len,
              attention_backend="reference" if "reference" in modes else "auto",
              skip_tokenizer_init=True, max_num_seqs=max(args.batch, 256 if args.offline else 0), max_num_batched_tokens=max(args.prefill, 2048),
              enable_prefix_caching=False, quantization=args.quantization, enforce_eager=args.enforce_eager)
    runner = llm.engine.executor.runner
    model = runner.model   # random weights of the shape, drawn by the model (deepseek_v4/dummy_weights.py)
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.grouped = args.experts == "grouped"
    paths = {"triton": V4KernelStepBackend, "reference": V4StepBackend}
    bandwidth = copy_bandwidth() if cuda else None
    flops = matmul_rate() if cuda else None
    vocab = config["vocab_size"]
    weights = active_bytes(model)
    # The weights' device memory (scales and exponents included) beside the bytes a released
    # checkpoint stores them in (formats.checkpoint_nbytes): the model's own formats hold ~1.0x.
    held, stored = held_nbytes(model), checkpoint_nbytes(model)
    result = {"benchmark": "v4_gpu_speed", "machine": machine_info(), "args": vars(args),
              "layer_types": config["layer_types"], "weight_bytes": llm.engine.executor.runner.weight_bytes,
              "held_weight_bytes": held, "checkpoint_weight_bytes": stored, "held_over_checkpoint": held / stored,
              "kv_blocks": runner.num_blocks, "active_weight_bytes": weights, "copy_bandwidth": bandwidth,
              "matmul_rate": flops, "modes": {}}
    print(f"V4 {args.shape}, {args.layers} layers {config['layer_types']}: weights held {held / 2**30:.2f} GiB, "
          f"{held / stored:.3f}x the checkpoint's {stored / 2**30:.2f} GiB; active per token {weights / 2**30:.2f} GiB; "
          f"{runner.num_blocks} KV blocks", flush=True)

    def timed(fn) -> float:
        platform.synchronize()
        start = time.perf_counter()
        fn()
        platform.synchronize()
        return time.perf_counter() - start

    def run(prompts, tokens):
        return lambda: llm.generate(prompts, SamplingParams(max_tokens=tokens, **GREEDY), use_tqdm=False)

    one = random_prompts(1, args.context, vocab, seed=1)
    long = random_prompts(1, args.prefill, vocab, seed=2)
    batch = random_prompts(args.batch, 512, vocab, seed=3)
    graphs = runner.decode_graphs
    result["decode_graphs"] = graphs is not None
    for mode in modes:
        # The runner builds every step's metadata with its backend, and the model takes the path
        # that backend says (engine.py): swapping it switches the path, same weights and KV pools
        # (and the requests' compressor rings); the graphs replay the backend they were built with.
        if type(runner.attention_backend) is not paths[mode]:
            runner.attention_backend = paths[mode](runner.device, runner.kv_cache_dtype, model.rings)
            runner.decode_graphs = None
        elif graphs is not None:
            runner.decode_graphs = graphs
        run(one, 4)()   # warm-up (and the kernels' compiles)
        run(batch, 2)()   # the whole batch: its shapes compile here, not in the timed run
        step_s = min(timed(run(one, 1 + args.steps)) - timed(run(one, 1)) for _ in range(2)) / args.steps
        prefill_s = min(timed(run(long, 1)) for _ in range(2))
        # Best of two: staggered prefills put decode steps at every batch size (and row count)
        # from 1 up, whose kernels (graph buckets, FP4 tilings, FP8 quantization) may first
        # compile inside the first run.
        batch_s = min(timed(run(batch, 1 + args.steps)) - timed(run(batch, 1)) for _ in range(2))
        row = {"decode_b1_step_ms": step_s * 1e3, "prefill_ms": prefill_s * 1e3,
               "decode_batch_tok_s": args.batch * args.steps / batch_s,
               "preemptions": llm.engine.scheduler.num_preemptions}   # so far, every run of this mode
        if args.offline:
            requests = random_prompts(args.offline, 1024, vocab, seed=4)
            offline_s = timed(run(requests, 256))
            row["offline_s"] = offline_s
            if cuda:   # every token's active products at the bf16 matmul rate: a floor
                row["offline_floor_s"] = 2 * active_params(model) * args.offline * (1024 + 256) / flops
        if cuda:
            # Batch decode's floor: each step reads the weights its tokens use (the KV, small
            # beside them at 512 tokens, not counted), or multiplies them at the matmul rate.
            step_floor = max(active_bytes(model, args.batch) / bandwidth,
                             2 * active_params(model) * args.batch / flops)
            row["decode_batch_floor_tok_s"] = args.batch / step_floor
            row["decode_batch_fraction_of_floor"] = row["decode_batch_tok_s"] / row["decode_batch_floor_tok_s"]
            row["roofline_step_ms"] = weights / bandwidth * 1e3
            row["decode_fraction_of_roofline"] = row["roofline_step_ms"] / row["decode_b1_step_ms"]
            row["prefill_floor_ms"] = 2 * active_params(model) * args.prefill / flops * 1e3
            row["prefill_fraction_of_floor"] = row["prefill_floor_ms"] / row["prefill_ms"]
        if args.profile and cuda:
            row["profile"] = {"decode_b1_step": kernel_profile(run(one, 1 + args.steps), run(one, 1), args.steps),
                              "prefill": kernel_profile(run(long, 1)),
                              "decode_batch_step": kernel_profile(run(batch, 1 + args.steps), run(batch, 1), args.steps)}
        result["modes"][mode] = row
        print(f"  {mode}: { {k: v for k, v in row.items() if k != 'profile'} }", flush=True)
        for name, part in row.get("profile", {}).items():
            print(f"  {mode} {name}: {part['kernels']:.0f} kernels, {part['kernel_ms']:.3f} ms of kernels; costliest:")
            for top in part["top"][:12]:
                print(f"    {top['ms']:8.3f} ms  x{top['count']:<6.1f} {top['name'][:110]}")
        write_json(args.out, result)
    modes = result["modes"]
    if "triton" in modes and "reference" in modes:   # > 1: the Triton path is faster
        t, r = modes["triton"], modes["reference"]
        result["triton_speedup"] = {"decode_b1": r["decode_b1_step_ms"] / t["decode_b1_step_ms"],
                                    "prefill": r["prefill_ms"] / t["prefill_ms"],
                                    "decode_batch": t["decode_batch_tok_s"] / r["decode_batch_tok_s"]}
        print(f"  triton speed-up over reference: {result['triton_speedup']}", flush=True)
    if cuda and args.shape == "flash":   # the kernels alone at the same shapes (v4_kernel_times.py)
        try:
            from v4_kernel_times import kernel_times
            result["kernels"] = kernel_times()
        except Exception as e:   # the engine figures above stand without them
            result["kernels_error"] = repr(e)
            print(f"  kernel timings failed: {e!r}", flush=True)
    print()
    print_table([{"mode": m, **r} for m, r in result["modes"].items()],
                [("mode", "attention", ""), ("decode_b1_step_ms", "b1 step ms", ".2f"),
                 ("roofline_step_ms", "roofline ms", ".2f"), ("prefill_ms", f"prefill {args.prefill} ms", ".0f"),
                 ("prefill_floor_ms", "floor ms", ".1f"), ("decode_batch_tok_s", f"batch {args.batch} tok/s", ".1f"),
                 ("decode_batch_floor_tok_s", "floor tok/s", ".0f"),
                 ("offline_s", f"offline {args.offline} s", ".1f"), ("offline_floor_s", "floor s", ".1f")])
    write_json(args.out, result)
    torch.cuda.empty_cache() if cuda else None


if __name__ == "__main__":
    main()
