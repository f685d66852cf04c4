"""Batch-1 decode matmuls (one row against a big weight): our Triton GEMV against cuBLAS.

    python benchmarks/decode_gemv.py [--shape llama3-8b] [--tune]

For each projection of the shape: the time of cuBLAS (F.linear) and of
deepinfer.layers.fused.gemv, as read bandwidth (weight bytes / time) beside the copy bandwidth
measured in the same run. Every timing replays a CUDA graph of calls that cycle through enough
copies of the weight to exceed the L2 cache, so each call reads from HBM as in a real step; the
GEMV launches with PDL (where the GPU has it), each call following the one before as in a step.
`--tune` searches tile sizes and prints the TUNED table for gemv.py. Then the whole model's
decode matmuls (all layers' projections and the head) in one graph, each way: the matmul part
of one batch-1 decode step. Last, the GEMV fusions (gemv.py's norm_gemv and act=): every
layer's add + RMSNorm, qkv, o, add + RMSNorm, gate_up, act(gate) * up and down as seven kernels,
against four with the norms and the activation inside the GEMVs, each chain in one graph
(with `--tune`, the fused products' tiles are searched too).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from gpu_fast_path import SHAPES
from gpu_reference_baseline import copy_bandwidth

from deepinfer.layers.fused.gemv import gemv, gemv_config, norm_gemv

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


def tune(n: int, k: int, weights: list[torch.Tensor], x: torch.Tensor, product=None,
         block_ns=(2, 4, 8)) -> tuple[tuple[int, int, int], float]:
    """The fastest (BLOCK_N, BLOCK_K, num_warps) for `product(w, config)` (default: gemv(x, w))."""
    product = product or (lambda w, cfg: gemv(x, w, config=cfg))
    best = (None, float("inf"))
    for block_n, block_k, warps in itertools.product(block_ns, (512, 1024, 2048), (4, 8)):
        if block_k > k:
            continue
        cfg = (block_n, block_k, warps)
        t = graph_time([lambda w=w: product(w, cfg) for w in weights] * 4)
        if t < best[1]:
            best = (cfg, t)
    return best


def fusion_chains(config: dict, bandwidth: float, search: bool) -> None:
    """Every layer's norms, four products and activation: seven kernels, or four with the fusions."""
    from deepinfer.layers.fused.activation import act_and_mul
    from deepinfer.layers.fused.rms_norm import rms_norm

    shapes, h = projections(config), config["hidden_size"]
    rand = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device="cuda") * 0.02
    layers = [{p: rand(*shapes[p]) for p in ("qkv", "o", "gate_up", "down")}
              for _ in range(config["num_hidden_layers"])]
    total = sum(w.numel() * 2 for layer in layers for w in layer.values())
    norm_w, x_o, eps = torch.ones(h, dtype=torch.bfloat16, device="cuda"), rand(1, shapes["o"][1]), 1e-5
    hidden, residual = rand(1, h), rand(1, h)

    def unfused(w):
        normed, _ = rms_norm(hidden, norm_w, eps, residual)
        gemv(normed, w["qkv"])
        normed, _ = rms_norm(gemv(x_o, w["o"]), norm_w, eps, residual)
        gemv(act_and_mul(gemv(normed, w["gate_up"])), w["down"])

    def fused(w):
        _, res = norm_gemv(hidden, residual, norm_w, eps, w["qkv"])
        act, _ = norm_gemv(gemv(x_o, w["o"]), res, norm_w, eps, w["gate_up"], act="silu")
        gemv(act, w["down"])

    times = {}
    for label, fn in (("seven kernels a layer", unfused), ("fused, four", fused)):
        times[label] = graph_time([lambda w=w: fn(w) for w in layers]) * len(layers)
        print(f"layers' norms, products and activation, {label}: {times[label] * 1e3:.3f} ms = "
              f"{total / times[label] / bandwidth:.3f} x copy bandwidth", flush=True)
    print(f"fusions: {times['seven kernels a layer'] / times['fused, four']:.3f}x", flush=True)
    del layers
    heads = weight_copies(*shapes["head"])
    t_apart = graph_time([lambda w=w: gemv(rms_norm(hidden, norm_w, eps, residual)[0], w) for w in heads] * 4)
    t_fused = graph_time([lambda w=w: norm_gemv(hidden, residual, norm_w, eps, w) for w in heads] * 4)
    print(f"final norm + head: {t_apart * 1e6:.1f} us as two kernels, {t_fused * 1e6:.1f} us fused "
          f"({t_apart / t_fused:.3f}x)", flush=True)
    del heads
    if not search:
        return
    for name, act in (("qkv", None), ("gate_up", "silu")):
        n, k = shapes[name]
        weights = weight_copies(n, k)
        product = lambda w, cfg, act=act: norm_gemv(hidden, residual, norm_w, eps, w, act=act, config=cfg)
        cfg, t = tune(n, k, weights, hidden, product, block_ns=(1, 2, 4, 8))
        print(f"norm_gemv {name} act={act}: default {gemv_config(n, k, act)} "
              f"{graph_time([lambda w=w: product(w, None) for w in weights] * 4) * 1e6:.1f} us, "
              f"tuned {cfg} {t * 1e6:.1f} us ({n * k * 2 / t / 1e12:.2f} TB/s)", flush=True)
        del weights


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
    del mats
    torch.cuda.empty_cache()
    fusion_chains(config, bandwidth, args.tune)


if __name__ == "__main__":
    main()
