"""Offline throughput of a batch spread over several LoRA adapters, against the base model alone on
the same prompts in the same run (issue 46: the target is LoRA >= 0.85x the base model).

The target is judged on `lora_vs_plain`: the adapter requests against the same prompts on an engine
started WITHOUT LoRA (enable_lora=False), which is what a user compares against (a server started
without --enable-lora). `lora_vs_base` (base-model requests on the LoRA engine) is reported beside
it but flatters LoRA: on that engine the base requests pay for LoRA too (on the CPU the fused
layer path is off, on CUDA the graphs are captured with the LoRA products inside).

    python benchmarks/lora_throughput.py [--shape tiny|llama3-8b] [--prompts 64] [--adapters 8]
        [--rank 16] [--input-len 512] [--output-len 128] [--repeats 2] [--vllm] [--out result.json]

    # CPU smoke size (the tiny random Llama of the tests; needs transformers, the test extra):
    DEEPINFER_ACCELERATOR=cpu python benchmarks/lora_throughput.py --shape tiny --repeats 1
    # the GPU (Llama-3-8B shape, random weights, load_format="dummy"), with vLLM 0.26 beside it:
    DEEPINFER_ACCELERATOR=cuda python benchmarks/lora_throughput.py --shape llama3-8b --vllm --out lora.json

What it does, in one process:
  1. writes --adapters PEFT adapters (adapter_config.json + adapter_model.safetensors) of rank
     --rank into a temp dir, each targeting q,k,v,o,gate,up,down with random A ~ N(0, 1/in) and
     B ~ N(0, (--b-scale)^2 / rank): large enough that the adapters change greedy tokens;
  2. starts one deepinfer.LLM with enable_lora=True, max_loras = --adapters (all resident), no
     prefix caching (the timed runs repeat the prompts);
  3. warms up (every adapter read into its slot, CUDA graphs captured), then --repeats times,
     alternating: the --prompts prompts on the base model, then the same prompts with prompt i
     under adapter i mod --adapters. Each run submits every prompt at once, greedy, ignore_eos;
  4. shuts that engine down and frees it (gc, torch.cuda.empty_cache on CUDA), then starts a
     plain engine with the same options but enable_lora=False, warms it up the same way and times
     the same prompts --repeats times ("plain").

Reports (printed, and JSON with --out): output tok/s and total (input + output) tok/s of each side
(best of --repeats), `lora_vs_plain` = lora output tok/s / plain output tok/s, the ratio the
target is judged on (`meets_target`: >= 0.85), `lora_vs_base` = lora / base output tok/s on the
LoRA engine, `base_vs_plain` (what enabling LoRA costs requests without an adapter), and
`lora_requests_differing_from_base` (how many adapter requests' greedy tokens differ from the
base model's: a check that the adapters were applied at all).

--vllm: afterwards, the same prompts and adapter files through vLLM's `vllm.LLM` (enable_lora,
max_loras and max_lora_rank alike, load_format="dummy" on the same config, skip_tokenizer_init),
base then adapters, in a child process (so each engine has the GPU to itself); its ratio is
lora / base on its LoRA engine, the counterpart of deepinfer's `lora_vs_base`. vLLM is taken from
--vllm-site when that holds it (default /tmp/site, where the GPU machine has vLLM 0.26), else from
this Python's path; without it the vLLM part is skipped with a message saying so, and the rest stands.
The child is also a command line of its own: --engine vllm --model-dir D --adapters-dir A.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import REPO, free_memory, machine_info, print_table, random_ids, shutdown, write_json  # noqa: E402

TARGET = 0.85
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = ("tiny", "llama3-8b")


# ------------------------------------------------------------------------------------ the model


def model_dir(shape: str, max_len: int) -> tuple[str, dict, bool]:
    """(directory, its config.json, whether weights must be drawn: load_format="dummy")."""
    if shape == "tiny":
        # The tests' tiny random Llama (tests/models/tiny_models.py), real safetensors, with room
        # for the benchmark's context.
        sys.path.insert(0, REPO)
        from tests.models.tiny_models import build_tiny_checkpoint

        directory = tempfile.mkdtemp(prefix="deepinfer-lora-tiny-")
        build_tiny_checkpoint("llama", directory, seed=0, max_position_embeddings=max(512, max_len))
        with open(os.path.join(directory, "config.json")) as f:
            return directory, json.load(f), False
    from gpu_reference_baseline import LLAMA3_8B, write_config_dir

    config = dict(LLAMA3_8B, max_position_embeddings=max(LLAMA3_8B["max_position_embeddings"], max_len))
    return write_config_dir(config), config, True


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT target -> (in, out) of a Llama-shaped model's projection."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def write_adapters(config: dict, root: str, count: int, rank: int, b_scale: float, dtype: str) -> list[str]:
    """`count` random PEFT LoRA adapters under `root` (see the module docstring); their paths."""
    import torch
    from safetensors.torch import save_file

    shapes = projection_shapes(config)
    out_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    paths = []
    for n in range(count):
        gen = torch.Generator().manual_seed(1000 + n)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target in TARGETS:
                inputs, outputs = shapes[target]
                part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{target}"
                a = torch.randn(rank, inputs, generator=gen) / inputs ** 0.5
                b = torch.randn(outputs, rank, generator=gen) * (b_scale / rank ** 0.5)
                tensors[f"{key}.lora_A.weight"] = a.to(out_dtype).contiguous()
                tensors[f"{key}.lora_B.weight"] = b.to(out_dtype).contiguous()
        path = os.path.join(root, f"adapter{n}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
                       "target_modules": list(TARGETS), "bias": "none", "lora_dropout": 0.0,
                       "base_model_name_or_path": None, "fan_in_fan_out": False, "use_rslora": False}, f)
        paths.append(path)
    return paths


def prompts_of(args, vocab: int) -> list[list[int]]:
    return [random_ids(args.input_len, vocab, seed=args.seed + i) for i in range(args.prompts)]


def summarize(prefix: str, seconds: list[float], args) -> dict:
    best = min(seconds)
    out_tokens = args.prompts * args.output_len
    return {f"{prefix}_s": best, f"{prefix}_runs_s": seconds, f"{prefix}_output_tok_s": out_tokens / best,
            f"{prefix}_total_tok_s": (out_tokens + args.prompts * args.input_len) / best}


# ------------------------------------------------------------------------------------ deepinfer


def engine_options(args, dummy: bool, num_adapters: int) -> dict:
    """deepinfer.LLM's options; num_adapters 0: an engine without LoRA (the plain one)."""
    options = dict(max_model_len=args.input_len + args.output_len + 8, enable_prefix_caching=False,
                   max_num_seqs=max(args.prompts, 8), enforce_eager=args.enforce_eager)
    if num_adapters:
        options.update(enable_lora=True, max_loras=num_adapters, max_lora_rank=args.rank)
    if dummy:
        options.update(load_format="dummy", gpu_memory_utilization=args.gpu_memory_utilization)
    if args.shape == "tiny":
        options["dtype"] = "float32"
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    return options


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_deepinfer(args, directory: str, dummy: bool, adapter_paths: list[str], vocab: int) -> dict:
    """The LoRA engine (base and adapter runs), then, once it is freed, the plain engine."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.types.lora import LoRARequest

    start = time.perf_counter()
    llm = LLM(directory, **engine_options(args, dummy, len(adapter_paths)))
    result = {"engine_start_s": time.perf_counter() - start}
    loras = [LoRARequest(f"adapter{n}", n + 1, path) for n, path in enumerate(adapter_paths)]
    per_prompt = [loras[i % len(loras)] for i in range(args.prompts)]
    prompts = prompts_of(args, vocab)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    # Warm-up: every adapter into its slot, every batch shape the timed runs meet (graphs, kernels).
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    result["warmup_s"] = time.perf_counter() - start
    base_s, lora_s, base_out, lora_out = [], [], None, None
    for _ in range(args.repeats):
        for side in ("base", "lora"):
            sync()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False,
                                lora_request=per_prompt if side == "lora" else None)
            sync()
            (base_s if side == "base" else lora_s).append(time.perf_counter() - start)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            if side == "base":
                base_out = tokens
            else:
                lora_out = tokens
    assert all(len(t) == args.output_len for t in base_out + lora_out), "ignore_eos: every request runs to max_tokens"
    result.update(summarize("base", base_s, args))
    result.update(summarize("lora", lora_s, args))
    result["lora_requests_differing_from_base"] = sum(b != lo for b, lo in zip(base_out, lora_out))
    shutdown(llm)
    del llm
    free_memory()

    # The plain engine (no LoRA at all), in the same process once the LoRA engine is gone.
    start = time.perf_counter()
    llm = LLM(directory, **engine_options(args, dummy, 0))
    result["plain_engine_start_s"] = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)   # warm-up: the same batch shapes as the timed runs
    result["plain_warmup_s"] = time.perf_counter() - start
    plain_s, plain_out = [], None
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        plain_s.append(time.perf_counter() - start)
        plain_out = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == args.output_len for t in plain_out), "ignore_eos: every request runs to max_tokens"
    result.update(summarize("plain", plain_s, args))
    # Informational: the same base model on two engines (bf16 kernels may round differently).
    result["plain_requests_differing_from_base"] = sum(b != p for b, p in zip(base_out, plain_out))
    shutdown(llm)
    del llm
    free_memory()

    result["lora_vs_plain"] = result["lora_output_tok_s"] / result["plain_output_tok_s"]
    result["lora_vs_base"] = result["lora_output_tok_s"] / result["base_output_tok_s"]
    result["base_vs_plain"] = result["base_output_tok_s"] / result["plain_output_tok_s"]
    result["target_judged_on"] = "lora_vs_plain"
    result["meets_target"] = result["lora_vs_plain"] >= TARGET
    return result


# ------------------------------------------------------------------------------------ vLLM


def run_vllm(args) -> dict:
    """The child's part (--engine vllm): the same work through vllm.LLM."""
    try:
        import vllm
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        return {"skipped": f"vllm is not importable ({e}); install vLLM or point --vllm-site at it"}
    import torch

    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    adapter_paths = sorted(os.path.join(args.adapters_dir, d) for d in os.listdir(args.adapters_dir))
    start = time.perf_counter()
    llm = vllm.LLM(args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=args.input_len + args.output_len + 8, enable_prefix_caching=False,
                   enable_lora=True, max_loras=len(adapter_paths), max_lora_rank=args.rank,
                   max_num_seqs=max(args.prompts, 8), gpu_memory_utilization=args.gpu_memory_utilization,
                   enforce_eager=args.enforce_eager)
    result = {"vllm_version": vllm.__version__, "engine_start_s": time.perf_counter() - start}
    loras = [LoRARequest(f"adapter{n}", n + 1, path) for n, path in enumerate(adapter_paths)]
    per_prompt = [loras[i % len(loras)] for i in range(args.prompts)]
    prompts = [{"prompt_token_ids": ids} for ids in prompts_of(args, vocab)]
    params = vllm.SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    base_s, lora_s = [], []
    for _ in range(args.repeats):
        for side, times in (("base", base_s), ("lora", lora_s)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt if side == "lora" else None)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    result.update(summarize("base", base_s, args))
    result.update(summarize("lora", lora_s, args))
    result["lora_vs_base"] = result["lora_output_tok_s"] / result["base_output_tok_s"]
    return result


def vllm_child(args, directory: str, adapters_dir: str) -> dict:
    """run_vllm in a child process, with --vllm-site on its path when vllm is not on ours."""
    env = dict(os.environ)
    if os.path.isdir(os.path.join(args.vllm_site, "vllm")):
        # vLLM's site alone, as benchmarks/serve_vs_vllm.sh runs it: deepinfer's extra paths
        # could shadow the versions vLLM was installed with (the child needs none of them).
        env["PYTHONPATH"] = args.vllm_site
    out = os.path.join(adapters_dir, "..", "vllm.json")
    command = [sys.executable, os.path.abspath(__file__), "--engine", "vllm", "--model-dir", directory,
               "--adapters-dir", adapters_dir, "--out", out, *child_flags(args)]
    print("vLLM:", " ".join(command), flush=True)
    done = subprocess.run(command, env=env, timeout=args.vllm_timeout_s)
    if done.returncode != 0:
        return {"failed": f"the vLLM child exited with {done.returncode} (its output is above)"}
    with open(out) as f:
        return json.load(f)


def child_flags(args) -> list[str]:
    return ["--prompts", str(args.prompts), "--rank", str(args.rank), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--repeats", str(args.repeats), "--seed", str(args.seed),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization)] + (
                ["--enforce-eager"] if args.enforce_eager else [])


# ------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--b-scale", type=float, default=1.0, help="the adapters' B weights' standard deviation "
                        "times sqrt(rank): how far each adapter moves the model")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each side; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM on the same work (child process)")
    parser.add_argument("--vllm-site", default="/tmp/site", help="where vLLM is installed, if not on this path")
    parser.add_argument("--vllm-timeout-s", type=int, default=420)
    parser.add_argument("--engine", choices=("deepinfer", "vllm"), default="deepinfer",
                        help="vllm: only the vLLM part, on --model-dir and --adapters-dir (what --vllm runs)")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--adapters-dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.engine == "vllm":
        if not (args.model_dir and args.adapters_dir):
            parser.error("--engine vllm needs --model-dir and --adapters-dir")
        result = run_vllm(args)
        print(json.dumps(result, indent=1), flush=True)
        write_json(args.out, result)
        return

    max_len = args.input_len + args.output_len + 8
    directory, config, dummy = model_dir(args.shape, max_len)
    root = tempfile.mkdtemp(prefix="deepinfer-lora-adapters-")
    adapters_dir = os.path.join(root, "adapters")
    os.makedirs(adapters_dir)
    start = time.perf_counter()
    paths = write_adapters(config, adapters_dir, args.adapters, args.rank, args.b_scale,
                           "float32" if args.shape == "tiny" else "bfloat16")
    result = {"machine": machine_info(), "shape": args.shape, "layers": config["num_hidden_layers"],
              "prompts": args.prompts, "adapters": args.adapters, "rank": args.rank, "input_len": args.input_len,
              "output_len": args.output_len, "repeats": args.repeats, "target_lora_vs_plain": TARGET,
              "adapter_write_s": time.perf_counter() - start, "adapters_dir": adapters_dir}
    print(f"{args.adapters} adapters of rank {args.rank} written to {adapters_dir} "
          f"({result['adapter_write_s']:.1f} s)", flush=True)
    result["deepinfer"] = run_deepinfer(args, directory, dummy, paths, config["vocab_size"])
    write_json(args.out, result)
    if args.vllm:
        result["vllm"] = vllm_child(args, directory, adapters_dir)
        write_json(args.out, result)

    rows = []
    for engine in ("deepinfer", "vllm"):
        r = result.get(engine) or {}
        if "base_output_tok_s" in r:
            rows.append({"engine": engine, "plain": r.get("plain_output_tok_s"), "base": r["base_output_tok_s"],
                         "lora": r["lora_output_tok_s"], "plain_total": r.get("plain_total_tok_s"),
                         "lora_total": r["lora_total_tok_s"], "vs_plain": r.get("lora_vs_plain"),
                         "vs_base": r["lora_vs_base"]})
        elif r:
            print(f"{engine}: {r.get('skipped') or r.get('failed')}")
    print(f"\n{args.prompts} prompts x {args.input_len} in / {args.output_len} out, {args.adapters} adapters "
          f"of rank {args.rank}, shape {args.shape} (output tok/s, best of {args.repeats}; plain: an engine "
          "without LoRA, base: no adapter on the LoRA engine)")
    print_table(rows, [("engine", "engine", ""), ("plain", "plain out tok/s", ".1f"),
                       ("base", "base out tok/s", ".1f"), ("lora", "lora out tok/s", ".1f"),
                       ("plain_total", "plain total tok/s", ".1f"), ("lora_total", "lora total tok/s", ".1f"),
                       ("vs_plain", "lora/plain", ".3f"), ("vs_base", "lora/base", ".3f")])
    d = result["deepinfer"]
    print(f"deepinfer lora/plain = {d['lora_vs_plain']:.3f}: the target (>= {TARGET}) is judged on this one, "
          f"{'met' if d['meets_target'] else 'NOT met'}; lora/base = {d['lora_vs_base']:.3f} (base requests on "
          f"the LoRA engine, which pay for LoRA too); base/plain = {d['base_vs_plain']:.3f}")
    print(f"{d['lora_requests_differing_from_base']}/{args.prompts} adapter requests' tokens differ from the base "
          f"model's; {d['plain_requests_differing_from_base']}/{args.prompts} plain-engine requests' tokens differ "
          "from the LoRA engine's base requests'")
    if "deepinfer" in result and "base_output_tok_s" in result.get("vllm", {}):
        v = result["vllm"]
        result["lora_tok_s_vs_vllm"] = d["lora_output_tok_s"] / v["lora_output_tok_s"]
        result["base_tok_s_vs_vllm"] = d["base_output_tok_s"] / v["base_output_tok_s"]
        print(f"deepinfer / vLLM output tok/s: lora {result['lora_tok_s_vs_vllm']:.3f}, "
              f"base {result['base_tok_s_vs_vllm']:.3f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
