"""Batch-1 decode matmuls (one row against a big weight): our Triton GEMV against cuBLAS.

    python benchmarks/decode_gemv.py [--shape llama3-8b] [--tune]

For each projection of the shape: the time of cuBLAS (F.linear) and of
deepinfer.layers.fused.gemv, as read bandwidth (weight bytes / time) beside the copy bandwidth
measured in the same run. Every timing replays a CUDA graph of calls that cycle through enough
copies of the weight to exceed the L2 cache, so each call reads from HBM as in a real step; the
GEMV launches with PDL (where the GPU has it), each call following the one before as in a step.
`--tune` searches tile sizes and prints the TUNED table for gemv.py. Last, the whole model's
decode matmuls (all layers' projections and the head) in one graph, each way: the matmul part
of one batch-1 decode step.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from gpu_fast_path import SHAPES
from gpu_reference_baseline import copy_bandwidth

from deepinfer.layers.fused.gemv import gemv, gemv_config

L2_BYTES = 256 << 20   # copies of a weight add up to at least this: every read misses the L2


def projections(config: dict) -> dict[str, tuple[int, int]]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return {"qkv": (qkv, h), "o": (h, config["num_attention_heads"] * head_dim), "gate_up": (2 * inter, h),
            "down": (h, inter), "head": (config["vocab_size"], h)}


def graph_time(calls) -> float:
    """Seconds per call of `calls` (a list of no-argument functions), replayed in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:   # warm-up: Triton compiles outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return best


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    count = max(2, -(-L2_BYTES // (n * k * 2)))
    return [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(count)]


def tune(n: int, k: int, weights: list[torch.Tensor], x: torch.Tensor) -> tuple[tuple[int, int, int], float]:
    best = (None, float("inf"))
    for block_n, block_k, warps in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8)):
        if block_k > k:
            continue
        cfg = (block_n, block_k, warps)
        t = graph_time([lambda w=w: gemv(x, w, config=cfg) for w in weights] * 4)
        if t < best[1]:
            best = (cfg, t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()
    config = SHAPES[args.shape]
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s  ({torch.cuda.get_device_name()})", flush=True)
    tuned = {}
    for name, (n, k) in projections(config).items():
        weights = weight_copies(n, k)
        nbytes = n * k * 2
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        err = (gemv(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max().item()
        t_blas = graph_time([lambda w=w: F.linear(x, w) for w in weights] * 4)
        t_ours = graph_time([lambda w=w: gemv(x, w) for w in weights] * 4)
        line = (f"{name:>8} N={n:<6} K={k:<6}: cuBLAS {t_blas * 1e6:7.1f} us ({nbytes / t_blas / 1e12:.2f} TB/s)  "
                f"gemv {gemv_config(n, k)} {t_ours * 1e6:7.1f} us ({nbytes / t_ours / 1e12:.2f} TB/s)  "
                f"x{t_blas / t_ours:.3f}  max|diff| {err:.2e}")
        if args.tune:
            cfg, t_best = tune(n, k, weights, x)
            tuned[(n, k)] = cfg
            line += f"  tuned {cfg} {t_best * 1e6:.1f} us ({nbytes / t_best / 1e12:.2f} TB/s)"
        print(line, flush=True)
        del weights
        torch.cuda.empty_cache()
    if tuned:
        print("TUNED =", {key: value for key, value in tuned.items()}, flush=True)

    # One decode step's matmuls, one row: every layer's four projections and the head.
    shapes = projections(config)
    layers = config["num_hidden_layers"]
    mats = [torch.randn(*shapes[p], dtype=torch.bfloat16, device="cuda") * 0.02
            for _ in range(layers) for p in ("qkv", "o", "gate_up", "down")]
    mats.append(torch.randn(*shapes["head"], dtype=torch.bfloat16, device="cuda") * 0.02)
    total = sum(m.numel() * 2 for m in mats)
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for k in {m.shape[1] for m in mats}}
    for label, fn in (("cuBLAS", F.linear), ("gemv", gemv)):
        t = graph_time([lambda m=m: fn(xs[m.shape[1]], m) for m in mats]) * len(mats)
        print(f"all decode matmuls ({len(mats)} products, {total / 1e9:.2f} GB) with {label}: {t * 1e3:.3f} ms = "
              f"{total / t / 1e12:.2f} TB/s = {total / t / bandwidth:.3f} x copy bandwidth", flush=True)


if __name__ == "__main__":
    main()
