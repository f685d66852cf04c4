"""Tilings of the FP4 experts' kernel at V4-Flash's expert shapes, against bf16 and the roofline (CUDA).

    python benchmarks/fp4_moe_tune.py [--tokens 1,64,8192] [--default-only] [--out fp4_moe_tune.json]

For each token count (1: batch-1 decode, 64: a decode batch, 8192: a prefill), the tokens are
routed to 6 of 256 experts (uniformly: every expert about the same rows), and each product of
the routed experts, gate/up (4096 -> 2 x 2048) and down (2048 -> 4096), is timed over the
candidate tilings of fp4_moe_triton.TileConfig that suit that many rows an expert, on bf16
activations and on e4m3 ones (`fp8`); each candidate's products are first checked against the
dequantized weights' (on the activations as that path quantizes them; a tiling that gives wrong
products is reported, never timed). Beside them: the tiling the kernel picks by itself
(default_config), torch._grouped_mm on the same experts in bf16 (and, for the prefill, on them
dequantized a chunk at a time: fp4_grouped_mm_dequantized, what moe.py runs there), and the roofline (the bytes of
the experts with rows, codes and exponents / measured copy bandwidth). Times are the device's:
each call is replayed from a CUDA graph (quant_gemm_speed.cuda_time), as the engine's decode
steps run it. default_config's table is set from this script's output.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, print_table, write_json
from quant_gemm_speed import EXPERTS, HIDDEN, INNER, TOP_K, cuda_time


def candidates(per_expert: float):
    """Tilings worth timing when an expert has `per_expert` rows on average."""
    from deepinfer.layers.quantization.fp4_moe_triton import TileConfig

    found = []
    if per_expert <= 2:   # the one-row GEMV: a partial sum of K/2 x N floats a program, K split in runs
        # (num_stages 1: each K block's loads wait for the last's sums; more: loads in flight ahead)
        for n, k, warps, split, stages in itertools.product((16, 32, 64), (256, 512), (4, 8), (1, 2), (1, 3)):
            if k // 2 * n <= 64 * 32 * warps and k * split <= INNER and (split == 1 or per_expert <= 1):
                found.append(TileConfig(1, n, k, dot=False, num_warps=warps, num_stages=stages, split_k=split))
    for m, n, k, stages in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (3, 4)):
        if m <= max(16, 2 * per_expert) and (m >= 64 or per_expert < 64):
            found.append(TileConfig(m, n, k, dot=True, num_warps=4 if m < 64 else 8, num_stages=stages))
            if m == 16 and stages == 4:
                found.append(TileConfig(m, n, k, dot=True, num_warps=4, num_stages=stages, split_k=2))
                found.append(TileConfig(m, n, k, dot=True, num_warps=4, num_stages=stages, group_scales=True))
                found.append(TileConfig(m, n, k, dot=True, num_warps=4, num_stages=stages, group_scales=True,
                                        bf16_ptx=True))
    # The FP8 tensor-core path (e4m3 activations; block_k is unused there).
    for m, n, stages, warps in itertools.product((16, 32, 64, 128), (64, 128), (3, 4), (4, 8)):
        if m <= max(16, 2 * per_expert) and (m >= 64 or per_expert < 64) and (warps == 4 or m >= 64):
            found.append(TileConfig(m, n, 128, dot=True, num_warps=warps, num_stages=stages, fp8=True))
    return found


def fp8_reference(x, codes, exps, rows_of):
    """The products of the experts of `rows_of` (expert -> its rows) as the FP8 path sees its
    activations (e4m3 per row and 128 inputs, fp8.quantize_rows), in float32."""
    import torch
    import torch.nn.functional as F

    from deepinfer.layers.quantization import fp4, fp8

    xq, xs = fp8.quantize_rows(x, 128)
    seen = (xq.float().view(x.shape[0], -1, 128) * xs[..., None]).view(x.shape)
    return torch.cat([F.linear(seen[rows], fp4.dequantize(codes[e], exps[e])) for e, rows in rows_of.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,64,8192")
    parser.add_argument("--default-only", action="store_true",
                        help="time only the tiling default_config picks (a before/after of the kernel)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from gpu_reference_baseline import copy_bandwidth

    from deepinfer.layers.quantization import fp4
    from deepinfer.layers.quantization.fp4_moe_triton import (
        default_config,
        fp4_grouped_mm,
        fp4_grouped_mm_dequantized,
    )

    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    products = {"gate_up": (2 * INNER, HIDDEN), "down": (HIDDEN, INNER)}
    weights = {}
    for name, (n, k) in products.items():
        dense = torch.randn(EXPERTS, n, k, device=device, dtype=torch.bfloat16) * 0.02
        codes, exps = zip(*(fp4.quantize(dense[e], 32) for e in range(EXPERTS)))
        weights[name] = dense, torch.stack(codes), torch.stack(exps)
    result = {"benchmark": "fp4_moe_tune", "machine": machine_info(), "torch": torch.__version__,
              "copy_bandwidth": bandwidth, "rows": []}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        ids = torch.stack([torch.randperm(EXPERTS, device=device)[:TOP_K] for _ in range(tokens)]).flatten()
        counts = torch.bincount(ids, minlength=EXPERTS)
        rows, used = tokens * TOP_K, int((counts > 0).sum())
        offs = counts.cumsum(0).to(torch.int32)
        for name, (_, k) in products.items():
            dense, codes, exps = weights[name]
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            # The rows of the first two experts that have rows (experts without rows would check nothing).
            first, second = torch.nonzero(counts).flatten()[:2].tolist()
            starts = (counts.cumsum(0) - counts).tolist()
            rows_of = {e: slice(starts[e], starts[e] + int(counts[e])) for e in (first, second)}
            check = torch.cat([torch.arange(r.start, r.stop, device=device) for r in rows_of.values()])
            want = torch.cat([F.linear(x[rows_of[e]].float(), fp4.dequantize(codes[e], exps[e])) for e in (first, second)])
            roofline = used * (codes[0].numel() + exps[0].numel()) / bandwidth
            base = {"tokens": tokens, "product": name, "experts_used": used,
                    "bf16_ms": cuda_time(lambda: torch._grouped_mm(x, dense.transpose(1, 2), offs=offs)) * 1e3,
                    "roofline_ms": roofline * 1e3}
            want_fp8 = fp8_reference(x, codes, exps, rows_of)
            timed = []
            chosen = default_config(rows, EXPERTS)
            tried = [chosen] if args.default_only else [chosen, *candidates(rows / min(EXPERTS, rows))]
            for config in dict.fromkeys(tried):
                try:
                    got = fp4_grouped_mm(x, codes, exps, counts, config)[check].float()
                    if not torch.allclose(got, want_fp8 if config.fp8 else want, atol=0.05, rtol=0.02):
                        print(f"  {tokens} {name} {config}: WRONG products", flush=True)
                        continue
                    ms = cuda_time(lambda: fp4_grouped_mm(x, codes, exps, counts, config)) * 1e3
                except Exception as e:   # out of resources (shared memory, registers): skipped
                    print(f"  {tokens} {name} {config}: {type(e).__name__}", flush=True)
                    continue
                timed.append({"config": config._asdict(), "ms": ms, "default": config == chosen})
            if rows >= 64 * EXPERTS:   # a prefill: also the bf16 grouped GEMMs over dequantized chunks (moe.py)
                base["dequantized_ms"] = cuda_time(lambda: fp4_grouped_mm_dequantized(x, codes, exps, counts), graph=False) * 1e3
            timed.sort(key=lambda t: t["ms"])
            default_ms = next((t["ms"] for t in timed if t["default"]), None)
            row = {**base, "best_ms": timed[0]["ms"] if timed else None, "best": timed[0]["config"] if timed else None,
                   "default_ms": default_ms, "default": chosen._asdict(), "top": timed[:8]}
            row["best_fraction_of_roofline"] = row["roofline_ms"] / row["best_ms"] if timed else None
            result["rows"].append(row)
            print({k: v for k, v in row.items() if k != "top"}, flush=True)
            write_json(args.out, result)
    print()
    print_table(result["rows"], [("tokens", "tokens", ""), ("product", "product", ""), ("experts_used", "experts", ""),
                                 ("best_ms", "best ms", ".4f"), ("default_ms", "default ms", ".4f"),
                                 ("roofline_ms", "roofline ms", ".4f"), ("bf16_ms", "bf16 ms", ".4f"),
                                 ("dequantized_ms", "dequantized ms", ".4f"),
                                 ("best", "best tiling", "")])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
