"""The CPU fast path (attention backend "cpu") against the reference backend, piece by piece:
batched decode attention through the real step inputs (random mixed batches, random block
tables, sliding windows, GQA), the three-op rotary, the shorter RMSNorm, and the 8-bit head as
two 4-bit halves."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.layers.attention import Attention, forward_context
from deepinfer.layers.attention.cpu_decode import FP32_MAX_ROWS
from deepinfer.layers.linear import Int8Blocks, int4_available, int4_matmul, pack_int4
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.request_states import StepChunk

BS = 16
CASES = [   # (heads, kv_heads, head_dim, window, dtype)
    (8, 2, 64, None, torch.float32),
    (9, 3, 64, None, torch.bfloat16),      # SmolLM2-135M: groups of 3 query heads
    (4, 1, 256, 20, torch.float32),        # Gemma 3 270M's head size, sliding window
    (8, 8, 32, 37, torch.bfloat16),        # no grouping, a window not a multiple of the block
]


def random_batch(rng: random.Random, num_blocks: int, num_decodes: int) -> list[StepChunk]:
    """`num_decodes` decodes of random lengths plus a few prefill chunks, random block tables."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    chunks = []
    kinds = ["decode"] * num_decodes + ["prefill"] * rng.randint(0, 2)
    rng.shuffle(kinds)
    for i, kind in enumerate(kinds):
        context = rng.randint(1 if kind == "decode" else 0, 120)
        num_tokens = 1 if kind == "decode" else rng.randint(2, 30)
        blocks = [free.pop() for _ in range(-(-(context + num_tokens) // BS))]
        chunks.append(StepChunk(f"r{i}", context, num_tokens, [blocks], sample=True))
    return chunks


def run_backends(chunks, heads, kv_heads, head_dim, window, dtype, seed, num_blocks=200, paired=False):
    """`paired`: K and V as the two halves of one tensor, as KVLayout.allocate lays them on the CPU."""
    torch.manual_seed(seed)
    spec = (SlidingWindowSpec(kv_heads, head_dim, dtype, sliding_window=window) if window
            else FullAttentionSpec(kv_heads, head_dim, dtype))
    groups = group_layers([spec])
    cache = (torch.randn(num_blocks * BS, kv_heads, head_dim, dtype=dtype),
             torch.randn(num_blocks * BS, kv_heads, head_dim, dtype=dtype))
    token_ids = {c.request_id: [1] * (c.start + c.num_tokens) for c in chunks}
    layer = Attention(0, heads, kv_heads, head_dim, scale=head_dim ** -0.5, sliding_window=window)
    n = sum(c.num_tokens for c in chunks)
    q, k, v = (torch.randn(n, h, head_dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    outs = {}
    for backend in ("reference", "cpu"):
        pair = torch.stack(cache)
        caches = [(pair[0], pair[1])] if paired else [(cache[0].clone(), cache[1].clone())]
        inputs = build_step_inputs(chunks, token_ids, groups, BS, [0], [0], caches, torch.device("cpu"),
                                   backend=backend)
        with forward_context(inputs.attention):
            outs[backend] = layer(q, k, v).float()
    return outs["reference"], outs["cpu"], inputs


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}w{c[3]}{str(c[4])[6:]}")
@pytest.mark.parametrize("num_decodes", [1, FP32_MAX_ROWS, FP32_MAX_ROWS + 7])   # float32 products, and bf16 ones
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("paired", [False, True], ids=["kv_apart", "kv_paired"])
def test_cpu_decode_matches_reference(case, num_decodes, seed, paired):
    heads, kv_heads, head_dim, window, dtype = case
    rng = random.Random(seed * 100 + num_decodes)
    ref, out, inputs = run_backends(random_batch(rng, 200, num_decodes), heads, kv_heads, head_dim,
                                    window, dtype, seed, paired=paired)
    group = inputs.attention.groups[0]
    assert group.decode_gather is None and group.decode_head_rows is not None
    assert group.decode_kv_paired == paired
    # float32 caches compute in float32 at every batch size; bf16 ones above FP32_MAX_ROWS in bf16.
    tol = 1e-5 if dtype == torch.float32 else (1e-2 if num_decodes <= FP32_MAX_ROWS else 3e-2)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_decode_only_step_and_padding():
    """A decode-only step (returned without a copy) whose rows differ in length: the padding of
    the short rows is hidden from them."""
    chunks = [StepChunk("a", 3, 1, [[5]], sample=True),
              StepChunk("b", 70, 1, [[9, 2, 7, 4, 11]], sample=True)]
    ref, out, inputs = run_backends(chunks, 8, 2, 64, None, torch.float32, seed=3)
    assert inputs.attention.groups[0].decode_bias is not None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_matches_reference(dtype):
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 10000.0}, 512)
    positions = torch.randint(0, 512, (7,))
    qk = torch.randn(7, 12, 64, dtype=dtype)
    q, k = qk[:, :9], qk[:, 9:]                      # side by side, as in the fused qkv output
    ref_q, ref_k = rope(positions, q, k)             # outside any forward: the reference
    both = rope.rotate(positions, qk)
    tol = 1e-6 if dtype == torch.float32 else 2e-2   # one bf16 rounding fewer than the reference
    torch.testing.assert_close(both[:, :9], ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(both[:, 9:], ref_k, atol=tol, rtol=tol)


def test_int8_blocks_as_int4_pair_is_exact():
    rng = np.random.default_rng(0)
    blocks = Int8Blocks(rng.integers(-128, 128, (64, 96), dtype=np.int8),
                        rng.uniform(0.001, 0.05, (64, 3)).astype(np.float32))
    pair = blocks.as_int4_pair()
    assert pair.q.max() <= 15 and pair.q.shape == (64, 192)
    halves = pair.dequantize().double()
    torch.testing.assert_close(halves[:, :96] + halves[:, 96:], blocks.dequantize().double(), atol=1e-6, rtol=0)


@pytest.mark.skipif(not int4_available(torch.device("cpu"), 64), reason="no CPU int4 kernel in this torch")
def test_int8_head_through_int4_kernel():
    rng = np.random.default_rng(1)
    blocks = Int8Blocks(rng.integers(-128, 128, (256, 64), dtype=np.int8),
                        rng.uniform(0.001, 0.05, (256, 2)).astype(np.float32))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out = int4_matmul(torch.cat((x, x), dim=-1), *pack_int4(blocks.as_int4_pair())).float()
    # The kernel keeps the scales in bf16, as the Q4 path does.
    exact = x.double() @ blocks.dequantize().double().t()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cpu_matches_reference(dtype):
    from deepinfer.layers.norm import _rms_norm_cpu

    x = torch.randn(5, 576, dtype=dtype) * 3
    weight = torch.randn(576, dtype=dtype)
    # HF's order: normalise in float32, round to the input dtype, then scale.
    hf = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = _rms_norm_cpu(x, x.shape[-1:], weight, 1e-5)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, hf, atol=tol, rtol=tol)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (576,), weight, 1e-5), atol=tol * 4, rtol=tol)


def test_packed_dense_weight_matches_plain_linear():
    from deepinfer.layers.linear import Linear, onednn_packing_available

    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    if not onednn_packing_available(layer.weight):
        pytest.skip("no oneDNN weight packing in this torch")
    layer.pack_weight()
    assert layer.packed_weight is not None
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        # The same oneDNN product on a pre-packed weight: equal bit for bit.
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])   # 40: above LAYER_NORM_MAX_ROWS, the six-op norm
def test_rms_norm_cpu_with_residual_matches_reference(dtype, rows):
    from deepinfer.layers.norm import rms_norm_cpu

    x, residual = torch.randn(rows, 576, dtype=dtype) * 3, torch.randn(rows, 576, dtype=dtype)
    weight = torch.randn(576, dtype=dtype)
    total = residual + x
    hf = weight * (total.float() * torch.rsqrt(total.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out, new_residual = rms_norm_cpu(x, weight, 1e-5, residual)
    assert out.dtype == dtype and out.is_contiguous() and torch.equal(new_residual, total)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, hf, atol=tol, rtol=tol)
    torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-5), rms_norm_cpu(x.clone(), weight, 1e-5, None))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_flat_cpu_layers_match_module_path(dtype, monkeypatch):
    """The CPU backend's flat layers (llama.CpuLayerPlan) run the module path's ops: the same
    tokens and the same logprobs, bit for bit, over mixed prefill/decode steps."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.layers.attention.backends.cpu import CpuBackend
    from deepinfer.models.llama import CpuLayerPlan

    # No prefix cache: the second pass must run the same steps as the first.
    llm = LLM(dtype=dtype, attention_backend="cpu", max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village"]
    flat = llm.generate(texts, params, use_tqdm=False)
    plans = llm.engine.executor.runner.model.model.__dict__.get("_cpu_plans")
    assert plans and all(isinstance(p, CpuLayerPlan) for p in plans)
    monkeypatch.setattr(CpuBackend, "flat_cpu_layers", False)
    modules = llm.generate(texts, params, use_tqdm=False)
    for a, b in zip(flat, modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: p.logprob for t, p in la.items()} == {t: p.logprob for t, p in lb.items()}
