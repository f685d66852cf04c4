"""The products of V4's own weight formats against bf16, at V4-Flash's shapes (CUDA).

    python benchmarks/quant_gemm_speed.py [--rows 1,64,8192] [--out quant_gemm.json]

First which block-scaled FP8 product this build and device run (layers/quantization/fp8.py,
block_path: torch's _scaled_mm with two scale layouts, then the Triton kernel), with each
path's reason when it does not. Then, per row count (1: batch-1 decode, 64: a decode batch,
8192: a prefill), the time of:
  fp8 block   x [rows, in] @ W [out, in] with 128 x 128 block scales, the activations quantized
              per row and 128 inputs on the way (fp8_linear, the engine's call), against
              F.linear on the same weight in bf16; for V4's FP8 projections (q_a, q_b, kv,
              o_b, the shared expert's gate / up and down);
  fp4 experts the routed experts' two grouped products over FP4 codes (fp4_moe_triton.py) for
              rows tokens routed to 6 of 256 experts, against torch._grouped_mm on bf16 experts;
  gemv        (one row) the FP8 and bf16 weights on the Triton GEMV, as batch-1 decode runs them;
each beside its roofline: the bytes the weights it reads take / the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, print_table, write_json

# V4-Flash: hidden 4096, q_lora_rank 1024, 64 heads of 512, o_groups 8 x o_lora_rank 1024, experts 256 x 2048.
PROJECTIONS = {"q_a": (1024, 4096), "q_b": (32768, 1024), "kv": (512, 4096), "o_b": (4096, 8192),
               "shared gate/up": (2048, 4096), "shared down": (4096, 2048)}
EXPERTS, TOP_K, HIDDEN, INNER = 256, 6, 4096, 2048


def cuda_time(fn, repeats: int = 20, graph: bool = True) -> float:
    """Device seconds of one call of `fn`: `repeats` calls replayed from one CUDA graph
    (decode_gemv.graph_time), so the host's launch cost (a Triton launch and the few torch ops
    around it take tens of microseconds) is not timed: timing eager calls measured the host
    wherever a call's kernels were shorter than its launches (every one-row tiling came out
    alike). graph=False for a call that reads a tensor on the host (not capturable): eager calls,
    host time included."""
    import torch

    if graph:
        from decode_gemv import graph_time
        return graph_time([fn] * repeats)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,64,8192")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from gpu_reference_baseline import copy_bandwidth

    from deepinfer.layers.quantization import fp4, fp8
    from deepinfer.layers.quantization.fp4_moe_triton import fp4_grouped_mm, kernel_works

    device = torch.device("cuda")
    reasons = {}
    generator = torch.Generator(device=device).manual_seed(0)
    codes, scale = fp8.quantize_blocks(torch.randn(256, 384, device=device, generator=generator), (128, 128))
    x = torch.randn(24, 384, device=device, generator=generator).to(torch.bfloat16)
    want = fp8.block_reference(x, codes, scale)
    for path in fp8.BLOCK_PATHS:
        try:
            got = fp8._blockwise_mm(x, codes, scale, None, path)
            ok = torch.allclose(got.float(), want, rtol=0.02, atol=0.05)
            reasons[path] = "runs, matches the reference" if ok else "runs, WRONG products"
        except Exception as e:
            reasons[path] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"block path {path}: {reasons[path]}", flush=True)
    chosen = fp8.block_path(device)
    bandwidth = copy_bandwidth()
    result = {"benchmark": "quant_gemm_speed", "machine": machine_info(), "torch": torch.__version__,
              "block_paths": reasons, "block_path": chosen, "fp4_kernel_works": kernel_works(device),
              "copy_bandwidth": bandwidth, "rows": []}
    print(f"chosen block path: {chosen}; FP4 kernel works: {result['fp4_kernel_works']}", flush=True)

    # The routed experts of one layer, bf16 and FP4 (built once for every row count).
    gate_up = torch.randn(EXPERTS, 2 * INNER, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INNER, device=device, dtype=torch.bfloat16) * 0.02
    q_gu = [fp4.quantize(gate_up[e], 32) for e in range(EXPERTS)]
    q_dn = [fp4.quantize(down[e], 32) for e in range(EXPERTS)]
    gu_codes, gu_exps = torch.stack([c for c, _ in q_gu]), torch.stack([s for _, s in q_gu])
    dn_codes, dn_exps = torch.stack([c for c, _ in q_dn]), torch.stack([s for _, s in q_dn])
    del q_gu, q_dn
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, 8192, device=device, dtype=torch.bfloat16)
        for name, (out, inner) in PROJECTIONS.items():
            w = torch.randn(out, inner, device=device) * 0.02
            codes, scale = fp8.quantize_blocks(w, (128, 128))
            wb = w.to(torch.bfloat16)
            xi = x[:, :inner]
            fp8_s = cuda_time(lambda: fp8.fp8_linear(xi, codes, scale, (128, 128)))
            bf16_s = cuda_time(lambda: F.linear(xi, wb))
            row = {"rows": rows, "product": f"fp8 block {name} {inner}->{out}", "quantized_ms": fp8_s * 1e3,
                   "bf16_ms": bf16_s * 1e3, "quantized_roofline_ms": (codes.numel() + scale.numel() * 4) / bandwidth * 1e3,
                   "bf16_roofline_ms": wb.numel() * 2 / bandwidth * 1e3}
            if rows == 1:   # batch-1 decode runs one-row products on the Triton GEMV (layers/fused/gemv.py)
                from deepinfer.layers.fused.gemv import gemv
                row["fp8_gemv_ms"] = cuda_time(lambda: gemv(xi, codes, scale=scale, block=(128, 128))) * 1e3
                row["bf16_gemv_ms"] = cuda_time(lambda: gemv(xi, wb)) * 1e3
            result["rows"].append(row)
            print(row, flush=True)
        # The routed experts: rows tokens x TOP_K picks over EXPERTS experts, spread evenly.
        ids = torch.randperm(EXPERTS, device=device)[:TOP_K].repeat(rows) if rows == 1 else \
            torch.randint(0, EXPERTS, (rows * TOP_K,), device=device)
        counts = torch.bincount(ids, minlength=EXPERTS)
        used = int((counts > 0).sum())
        xs = torch.randn(rows * TOP_K, HIDDEN, device=device, dtype=torch.bfloat16)
        offs = counts.cumsum(0).to(torch.int32)
        hidden = torch.randn(rows * TOP_K, INNER, device=device, dtype=torch.bfloat16)

        def fp4_experts():
            fp4_grouped_mm(xs, gu_codes, gu_exps, counts)
            fp4_grouped_mm(hidden, dn_codes, dn_exps, counts)

        def bf16_experts():
            torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
            torch._grouped_mm(hidden, down.transpose(1, 2), offs=offs)

        per_expert_fp4 = (gu_codes[0].numel() + gu_exps[0].numel() + dn_codes[0].numel() + dn_exps[0].numel())
        row = {"rows": rows, "product": f"fp4 experts ({used} of {EXPERTS} used)",
               "quantized_ms": cuda_time(fp4_experts) * 1e3, "bf16_ms": cuda_time(bf16_experts) * 1e3,
               "quantized_roofline_ms": used * per_expert_fp4 / bandwidth * 1e3,
               "bf16_roofline_ms": used * (gate_up[0].numel() + down[0].numel()) * 2 / bandwidth * 1e3}
        result["rows"].append(row)
        print(row, flush=True)
        write_json(args.out, result)
    print()
    print_table(result["rows"], [("rows", "rows", ""), ("product", "product", ""),
                                 ("quantized_ms", "quantized ms", ".4f"), ("quantized_roofline_ms", "its roofline", ".4f"),
                                 ("bf16_ms", "bf16 ms", ".4f"), ("bf16_roofline_ms", "its roofline", ".4f"),
                                 ("fp8_gemv_ms", "fp8 GEMV ms", ".4f"), ("bf16_gemv_ms", "bf16 GEMV ms", ".4f")])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
