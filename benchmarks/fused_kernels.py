"""The fused fast-path kernels (deepinfer/layers/fused/) against the PyTorch ops they replace,
one decoder layer's worth at Llama-3-8B's shapes in bf16: checked against the reference, then
timed inside CUDA graphs (as decode steps run), for a few token counts.

    python benchmarks/fused_kernels.py [--tokens 1,16,256,4096] [--layers 32]

Prints, per op and token count, microseconds for the reference and the fused kernel, and per
token count the whole saving of a `--layers`-layer decode step (each layer runs two add+norms,
one activation, one rotary and one KV write).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from deepinfer.layers.fused.activation import act_and_mul
from deepinfer.layers.fused.kv_write import write_kv_cache
from deepinfer.layers.fused.rms_norm import rms_norm
from deepinfer.layers.fused.rotary import apply_rotary_
from deepinfer.layers.rotary import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PER_LAYER = {"add_rms_norm": 2, "silu_and_mul": 1, "rotary": 1, "kv_write": 1}


def cases(tokens: int, dev: str = "cuda", bf16: torch.dtype = torch.bfloat16):
    """(name, reference fn, fused fn, check) per op; check() compares their outputs once."""
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
    residual = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
    weight = torch.randn(HIDDEN, device=dev, dtype=bf16)

    def norm_ref():
        total = residual + x
        return F.rms_norm(total, (HIDDEN,), weight, 1e-5), total

    def norm_check():
        out, _ = rms_norm(x, weight, 1e-5, residual.clone())
        torch.testing.assert_close(out, norm_ref()[0], atol=3e-2, rtol=2e-2)

    fused_residual = residual.clone()
    yield "add_rms_norm", norm_ref, lambda: rms_norm(x, weight, 1e-5, fused_residual), norm_check

    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device=dev, dtype=bf16)

    def act_ref():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def act_check():
        torch.testing.assert_close(act_and_mul(gate_up), act_ref(), atol=3e-2, rtol=2e-2)

    yield "silu_and_mul", act_ref, lambda: act_and_mul(gate_up), act_check

    rotary = RotaryEmbedding(HEAD_DIM, ROPE, 8192).to(dev)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=bf16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k = q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM)
    v = v.view(tokens, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,), device=dev)

    def rotary_check():
        ref_q, ref_k = rotary(positions, q, k)   # outside a forward: the PyTorch path
        out_q, out_k = apply_rotary_(positions, q.clone(), k.clone(), rotary.cos, rotary.sin)
        torch.testing.assert_close(out_q, ref_q, atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(out_k, ref_k, atol=5e-2, rtol=2e-2)

    # The reference looks cos/sin rows up once per forward for all layers (rotary_check() does
    # it here first), so what is timed is its per-layer part, as in the model.
    yield ("rotary", lambda: rotary(positions, q, k),
           lambda: apply_rotary_(positions, q, k, rotary.cos, rotary.sin), rotary_check)

    rows = max(4096, 2 * tokens)
    k_cache = torch.zeros(rows, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(rows, device=dev)[:tokens]

    def kv_ref():
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def kv_check():
        kc, vc = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        write_kv_cache(k, v, kc, vc, slots)
        kv_ref()
        assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)

    yield "kv_write", kv_ref, lambda: write_kv_cache(k, v, k_cache, v_cache, slots), kv_check


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'op':>14} {'tokens':>7} {'reference us':>13} {'fused us':>9} {'speed-up':>9}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        saved_us = 0.0
        for name, reference, fused, check in cases(tokens):
            check()
            # Inside CUDA graphs, as decode steps run: launch latency counts, Python does not.
            ref_us = triton.testing.do_bench_cudagraph(reference) * 1e3
            fused_us = triton.testing.do_bench_cudagraph(fused) * 1e3
            saved_us += PER_LAYER[name] * (ref_us - fused_us)
            print(f"{name:>14} {tokens:>7} {ref_us:>13.2f} {fused_us:>9.2f} {ref_us / fused_us:>8.2f}x")
        print(f"{'':>14} {tokens:>7} saved per {args.layers}-layer step: {saved_us * args.layers / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
