"""The CUDA fast path on a random-weight model of a real shape, against ceilings and anchors
measured in the same run.

    python benchmarks/gpu_fast_path.py [--shape llama3-8b|smollm2-135m] [--layers N]
        [--requests 1000] [--max-num-seqs 512] [--max-num-batched-tokens 16384]
        [--kv-cache-dtype auto|fp8] [--quantization auto|fp8] [--parts check,a,b,c,sweep,hf]
        [--out results.json] [--plot throughput.png]

Prints and writes (JSON):
  ceilings  device-to-device copy bandwidth, bf16 8192^3 matmul rate (and, with --quantization
            fp8, the FP8 one: the projections' floor then counts their FP8 bytes and rate)
  check     greedy tokens of the overlapped loop equal the plain loop's (async_scheduling)
  (a)       batch-1 decode tok/s at 1k context, and the roofline = bandwidth / weight bytes;
            also with the plain loop, and a profile: device time per step vs wall time per step
  (b)       one 8k-token prefill, as a fraction of the measured matmul rate, timed from an idle
            GPU as the rate is (and back to back, beside it)
  (c)       offline throughput, N requests of 1024 in / 256 out, beside the floor
            = FLOPs / matmul rate + (weights per decode step + KV read) bytes / bandwidth,
            where a decode step serves as many requests as max_num_seqs and the KV pool allow,
            and the KV bytes are those of --kv-cache-dtype (2 bytes a value in bf16, 1 in fp8)
  (d)       HF transformers on the same weights' shape: batch-1 decode at 1k and a batch-32 point
  sweep     output tok/s against concurrency: C requests at once (PNG plot with --plot)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import random
import time

import torch
from gpu_reference_baseline import LLAMA3_8B, copy_bandwidth, matmul_rate, write_config_dir

SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192 + 256, tie_word_embeddings=True, torch_dtype="bfloat16")
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2_135M}
GREEDY = dict(temperature=0, ignore_eos=True)
IDLE_S = 1.0   # pause before each timed prefill of (b): see there
PARTS = ("check", "a", "b", "c", "sweep", "hf")


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def shape_counts(config: dict, kv_element_bytes: int = 2, body_weight_bytes: int = 2) -> dict:
    """Parameter and byte counts of a Llama shape. body_weight_bytes: bytes a projection weight
    takes (1 with quantization="fp8": the embeddings and the head stay 2)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    per_layer = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * config["intermediate_size"]
    return dict(layers=layers, hidden=h, head_dim=head_dim, heads=heads, kv_heads=kv_heads,
                body_params=layers * per_layer, head_params=config["vocab_size"] * h,
                kv_bytes_per_token=2 * layers * kv_heads * head_dim * kv_element_bytes,
                body_weight_bytes=body_weight_bytes)


def attention_flops(c: dict, context: int, queries: int) -> float:
    """QK^T and PV products of `queries` new tokens at the end of `context` positions (causal)."""
    keys = queries * context + queries * (queries + 1) / 2
    return 4 * keys * c["heads"] * c["head_dim"] * c["layers"]


def throughput_floor(c: dict, n: int, prompt: int, output: int, max_batch: int, bandwidth: float,
                     flops: float, body_flops: float | None = None) -> float:
    """Seconds the whole offline run needs at least: every matmul at the measured rate, plus
    the weights read once per decode step and each decode step's KV read at the copy bandwidth.
    body_flops: the projections' matmul rate where it is not `flops` (FP8 weights: the FP8 rate)."""
    return sum(throughput_floor_parts(c, n, prompt, output, max_batch, bandwidth, flops, body_flops).values())


def throughput_floor_parts(c: dict, n: int, prompt: int, output: int, max_batch: int, bandwidth: float,
                           flops: float, body_flops: float | None = None) -> dict:
    """throughput_floor's parts, in seconds (throughput_profile.py --kernels sets kernel time beside them)."""
    tokens = n * (prompt + output)
    matmul_s = 2 * c["body_params"] * tokens / (body_flops or flops) + 2 * c["head_params"] * n * output / flops
    attn = n * (attention_flops(c, 0, prompt) + sum(4 * (prompt + i) * c["heads"] * c["head_dim"] * c["layers"]
                                                     for i in range(output)))
    decode_steps = math.ceil(n / max_batch) * output
    weight_bytes = c.get("body_weight_bytes", 2) * c["body_params"] + 2 * c["head_params"]
    kv_read = n * sum(prompt + i for i in range(output)) * c["kv_bytes_per_token"]
    return {"matmul_flops_s": matmul_s, "attention_flops_s": attn / flops,
            "decode_weight_reads_s": decode_steps * weight_bytes / bandwidth, "kv_reads_s": kv_read / bandwidth}


def fp8_matmul_rate() -> float:
    """FLOP/s of an 8192^3 FP8 product with row-wise scales (what quantization="fp8" runs)."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")

    def run():
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        run()
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1e3)


def prefill_attention_kernels(c: dict, tokens: int = 8192) -> dict:
    """TFLOP/s of one layer's causal attention over `tokens`: our paged Triton kernel vs SDPA."""
    import triton.testing

    from deepinfer.layers.attention.triton_prefill import paged_prefill_attention

    heads, kv_heads, d, bs = c["heads"], c["kv_heads"], c["head_dim"], 16
    q = torch.randn(tokens, heads, d, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.randn(tokens, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(tokens // bs, device="cuda", dtype=torch.int32)[None]
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    flops = attention_flops(dict(c, layers=1), 0, tokens)
    ours = triton.testing.do_bench(lambda: paged_prefill_attention(
        q, k_cache, v_cache, table, seq_lens, starts, tokens, d ** -0.5, None, bs))
    qt, kt, vt = q.transpose(0, 1)[None], k_cache.transpose(0, 1)[None], v_cache.transpose(0, 1)[None]
    sdpa = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, is_causal=True, enable_gqa=True))
    return {"prefill_attn_layer_triton_ms": ours, "prefill_attn_triton_tflop_s": flops / ours / 1e9,
            "prefill_attn_layer_sdpa_ms": sdpa, "prefill_attn_sdpa_tflop_s": flops / sdpa / 1e9}


def decode_profile(llm, prompt: list[int], steps: int = 32) -> dict:
    """Device time per decode step (sum of kernel times) against wall time per step, and the
    kernels that take it: the gap between the two is host time the device waited for."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer import SamplingParams

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(lambda: llm.generate(prompt, SamplingParams(max_tokens=steps + 1, **GREEDY), use_tqdm=False))
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    device_us = sum(e.self_device_time_total for e in events)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
    # The prefill step is included in both; at 1k tokens it is small beside 32 decode steps.
    return {"profile_wall_ms_per_step": wall * 1e3 / (steps + 1),
            "profile_device_ms_per_step": device_us / 1e3 / (steps + 1)}


def hf_anchor(config_dir: str, vocab: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):   # random init on the GPU: seconds, not minutes on the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    out = {}
    gen = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}

    def generate(hf_model, ids: torch.Tensor, new_tokens: int) -> float:
        return timed(lambda: hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                               **gen))

    for batch, new in ((1, 64), (32, 64)):
        ids = torch.tensor(random_prompts(batch, 1024, vocab, seed=batch), device="cuda")
        generate(model, ids, 4)   # warm-up
        prefill = generate(model, ids, 1)
        total = generate(model, ids, new + 1)
        out[f"hf_decode_b{batch}_1k_tok_s"] = batch * new / (total - prefill)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def report(result: dict, key: str, value, out: str | None) -> None:
    """Print one figure as soon as it exists (and rewrite the JSON), so a cut-off run keeps it."""
    result[key] = value
    print(f"{key:>34}: {value:.4g}" if isinstance(value, float) else f"{key:>34}: {value}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--requests", type=int, default=1000)
    # vLLM's defaults for its LLM class on a GPU of 70 GiB or more are 16384 batched tokens and
    # 1024 sequences. Ours capture decode CUDA graphs up to 512 rows, and 1024 measured slower
    # (50.3 s against 42.6 s at 512 for (c) on the H200, 19:14 UTC 2026-11-30): 512 is the default.
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the engine's KV cache dtype; the floor of (c) counts its bytes")
    parser.add_argument("--quantization", choices=["auto", "fp8"], default="auto",
                        help="fp8: the projections' weights FP8 per channel (the floors count their bytes and "
                             "the FP8 matmul rate, measured in the same run)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which measurements to run, comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--skip-hf", action="store_true", help="same as leaving hf out of --parts")
    parser.add_argument("--sweep", default="1,8,32,128,256,512")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--plot-from", default=None, help="only draw --plot from a saved result JSON")
    args = parser.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot)
        return
    parts = set(args.parts.split(",")) - ({"hf"} if args.skip_hf else set())
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {','.join(PARTS)}")
    from deepinfer import LLM

    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    fp8_weights = args.quantization == "fp8"
    c = shape_counts(config, kv_element_bytes=1 if args.kv_cache_dtype == "fp8" else 2,
                     body_weight_bytes=1 if fp8_weights else 2)
    vocab = config["vocab_size"]
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    body_flops = fp8_matmul_rate() if fp8_weights else flops
    config_dir = write_config_dir(config)
    result: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
                    "layers": c["layers"], "copy_bandwidth_tb_s": bandwidth / 1e12,
                    "bf16_matmul_tflop_s": flops / 1e12, "enforce_eager": args.enforce_eager,
                    "attention_backend": args.attention_backend, "max_num_seqs": args.max_num_seqs,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "gpu_memory_utilization": args.gpu_memory_utilization, "kv_cache_dtype": args.kv_cache_dtype,
                    "quantization": args.quantization, "projection_matmul_tflop_s": body_flops / 1e12}
    for key, value in list(result.items()):
        report(result, key, value, args.out)

    t = time.perf_counter()
    # No prefix caching: timed runs repeat prompts, and a hit would skip the work measured.
    llm = LLM(config_dir, load_format="dummy", max_model_len=8192 + 256,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    report(result, "engine_start_s", time.perf_counter() - t, args.out)
    runner = llm.engine.executor.runner
    report(result, "weight_gb", runner.weight_bytes / 1e9, args.out)
    report(result, "kv_blocks", runner.num_blocks, args.out)

    def emit(figures: dict) -> None:
        for key, value in figures.items():
            report(result, key, value, args.out)

    if "check" in parts:
        emit(check_loops(llm, vocab))
    if "a" in parts:
        emit(decode_batch1(llm, vocab, bandwidth))
    if "b" in parts:
        emit(prefill_8k(llm, c, vocab, flops, body_flops))
    if "c" in parts:
        emit(offline_throughput(llm, c, vocab, args.requests, bandwidth, flops, body_flops))
    if "sweep" in parts:
        emit(concurrency_sweep(llm, vocab, [int(x) for x in args.sweep.split(",") if x], args.max_num_seqs))

    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    if "hf" in parts:
        emit(hf_anchor(config_dir, vocab))
        if "a" in parts:
            emit({"decode_b1_vs_hf": result["decode_b1_1k_tok_s"] / result["hf_decode_b1_1k_tok_s"]})

    if args.plot and "sweep" in parts:
        plot(result, args.plot)


def check_loops(llm, vocab: int) -> dict:
    """The overlapped loop and the plain loop give the same greedy tokens."""
    from deepinfer import SamplingParams

    core = llm.engine
    overlapped = core.async_scheduling
    prompts = random_prompts(8, 300, vocab, seed=4)
    params = [SamplingParams(max_tokens=24 + 5 * i, **GREEDY) for i in range(8)]
    outs = []
    for mode in (True, False):
        core.async_scheduling = mode
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    core.async_scheduling = overlapped
    return {"check_overlapped_equals_plain_loop": outs[0] == outs[1]}


def decode_batch1(llm, vocab: int, bandwidth: float) -> dict:
    """(a) batch-1 decode at 1k context, with each loop, against the bandwidth roofline."""
    from deepinfer import SamplingParams

    core = llm.engine
    prompt = random_prompts(1, 1024, vocab, seed=1)
    llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)   # warm-up

    def decode_b1() -> float:
        prefill_1k = timed(lambda: llm.generate(prompt, SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False))
        total = timed(lambda: llm.generate(prompt, SamplingParams(max_tokens=257, **GREEDY), use_tqdm=False))
        return 256 / (total - prefill_1k)

    overlapped = core.async_scheduling
    out = {"async_scheduling": overlapped, "decode_b1_1k_tok_s": decode_b1(),
           "roofline_tok_s": bandwidth / llm.engine.executor.runner.weight_bytes}
    out["decode_fraction_of_roofline"] = out["decode_b1_1k_tok_s"] / out["roofline_tok_s"]
    core.async_scheduling = not overlapped
    out[f"decode_b1_1k_tok_s_async_{not overlapped}"] = decode_b1()
    core.async_scheduling = overlapped
    out.update(decode_profile(llm, prompt))
    return out


def prefill_8k(llm, c: dict, vocab: int, flops: float, body_flops: float | None = None) -> dict:
    """(b) one 8k-token prefill against the matmul rate, and one layer's attention kernels.

    The matmul rate is measured in a short burst on an idle GPU. A prefill that starts right after
    another finds the GPU hot and its clock lowered: on the H200 back-to-back 8k prefills took
    214-215 ms where ones after a 1 s pause took 205-206 (18:37 UTC, 2026-11-30). So each timed
    prefill starts from an idle GPU (IDLE_S), as the rate does; the back-to-back figure is
    reported beside it."""
    from deepinfer import SamplingParams

    long_prompt = random_prompts(1, 8192, vocab, seed=2)

    def prefill() -> float:
        return timed(lambda: llm.generate(long_prompt, SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False))

    prefill()
    back_to_back_s = min(prefill() for _ in range(3))
    from_idle_s = min(time.sleep(IDLE_S) or prefill() for _ in range(3))
    # The floor: the projections at their rate (FP8's with FP8 weights), the head and attention at bf16's.
    floor_s = (2 * c["body_params"] * 8192 / (body_flops or flops)
               + (2 * c["head_params"] + attention_flops(c, 0, 8192)) / flops)
    out = {"prefill_8k_ms": from_idle_s * 1e3,
           "prefill_fraction_of_matmul_rate": floor_s / from_idle_s,
           "prefill_8k_ms_back_to_back": back_to_back_s * 1e3,
           "prefill_fraction_back_to_back": floor_s / back_to_back_s}
    # Where (b)'s time goes: the attention kernel of one layer alone, against SDPA's flash kernel.
    out.update(prefill_attention_kernels(c))
    return out


def offline_throughput(llm, c: dict, vocab: int, requests: int, bandwidth: float, flops: float,
                       body_flops: float | None = None) -> dict:
    """(c) `requests` prompts of 1024 tokens, 256 greedy tokens each, submitted at once."""
    from deepinfer import SamplingParams

    prompts = random_prompts(requests, 1024, vocab, seed=3)
    params = SamplingParams(max_tokens=256, **GREEDY)
    run_s = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    batch = concurrent_requests(llm, 1024 + 256)
    floor = throughput_floor(c, requests, 1024, 256, batch, bandwidth, flops, body_flops)
    return {"throughput_requests": requests, "throughput_concurrency": batch, "throughput_s": run_s,
            "floor_s": floor, "time_over_floor": run_s / floor, "output_tok_s": requests * 256 / run_s,
            "total_tok_s": requests * 1280 / run_s}


def concurrent_requests(llm, tokens_per_request: int) -> int:
    """How many requests of this length run at once: max_num_seqs, or fewer if the KV pool is
    smaller (the floor's weight reads per decode step count batches of this size)."""
    runner, config = llm.engine.executor.runner, llm.engine.scheduler.config
    blocks_each = math.ceil(tokens_per_request / runner.block_size)
    return min(config.max_num_seqs, runner.num_blocks // blocks_each)


def concurrency_sweep(llm, vocab: int, sizes: list[int], max_num_seqs: int) -> dict:
    """Output tok/s against concurrency: C requests of 1024 / 128 submitted at once."""
    from deepinfer import SamplingParams

    sweep = {}
    for conc in sizes:
        if conc > max_num_seqs:
            continue
        batch = random_prompts(conc, 1024, vocab, seed=10 + conc)
        llm_s = timed(lambda batch=batch: llm.generate(batch, SamplingParams(max_tokens=128, **GREEDY),
                                                       use_tqdm=False))
        sweep[conc] = conc * 128 / llm_s
        print(f"{'sweep C=' + str(conc):>34}: {sweep[conc]:.4g} output tok/s", flush=True)
    return {"sweep_output_tok_s": sweep}


def plot(result: dict, path: str) -> None:
    """Output tok/s against concurrency, from a result dict (also: --plot-from JSON)."""
    sweep = {int(k): v for k, v in result["sweep_output_tok_s"].items()}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = sorted(sweep)
    ax.plot(xs, [sweep[x] for x in xs], marker="o", label="deepinfer")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (1024 in / 128 out)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['shape']} ({result['layers']} layers, random bf16) on {result['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
