"""FP8 weights (layers/quantization/fp8.py): the codes and scales give the weight back within
FP8's rounding, the scaled-mm path agrees with the dequantized reference, and an engine with
quantization="fp8" keeps FP8 codes only and generates what its reference path generates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, SamplingParams
from deepinfer.layers.linear import Linear
from deepinfer.layers.quantization import fp8

# e4m3 keeps 3 mantissa bits: a value's rounding error is at most 2^-4 of it (half a step of 2^-3).
E4M3_RELATIVE = 2.0 ** -4


def test_per_channel_codes_give_the_weight_back():
    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]   # rows of very different sizes
    codes, scale = fp8.quantize_per_channel(w)
    assert codes.dtype == fp8.FP8 and scale.shape == (48, 1)
    back = fp8.dequantize(codes, scale, None, torch.float32)
    # Each row's largest entry is FP8's largest: its error is relative to the row's size.
    row_max = w.abs().amax(dim=1, keepdim=True)
    assert ((back - w).abs() <= E4M3_RELATIVE * row_max + 1e-12).all()
    assert (codes.float().abs().amax(dim=1) == fp8.FP8_MAX).all()


def test_block_codes_give_the_weight_back_on_ragged_shapes():
    torch.manual_seed(1)
    w = torch.randn(200, 300)   # neither a multiple of 128: the last blocks are partial
    codes, scale = fp8.quantize_blocks(w, (128, 128))
    assert codes.shape == (200, 300) and scale.shape == (2, 3)
    back = fp8.dequantize(codes, scale, (128, 128), torch.float32)
    for bi in range(2):
        for bj in range(3):
            rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            block_max = w[rows, cols].abs().max()
            assert ((back[rows, cols] - w[rows, cols]).abs() <= E4M3_RELATIVE * block_max).all()


def test_a_zero_row_stays_zero():
    x = torch.zeros(3, 32)
    codes, scale = fp8.quantize_rows(x)
    assert torch.isfinite(scale).all() and (codes.float() == 0).all()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_per_channel_scaled_mm_matches_the_reference(rows):
    """The scaled mm (activations quantized per token) against the dequantized weight's product:
    they differ by the activations' FP8 rounding only."""
    torch.manual_seed(2)
    w = torch.randn(96, 128)
    codes, scale = fp8.quantize_per_channel(w)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    if not fp8.row_wise_available(x.device):   # this torch's CPU _scaled_mm takes per-tensor scales only
        assert not fp8.per_channel_fast(x, codes)
        pytest.skip("no row-wise FP8 scaled mm in this torch build on the CPU: the reference serves")
    assert fp8.per_channel_fast(x, codes)
    fast = fp8.fp8_linear(x, codes, scale, None, bias)
    reference = fp8.fp8_linear(x, codes, scale, None, bias, reference=True)
    assert fast.dtype == torch.bfloat16 and fast.shape == (rows, 96)
    exact = F.linear(x.float(), fp8.dequantize(codes, scale, None, torch.float32), bias.float())
    # Per output: |sum_k x_k w_k e_k| <= 2^-4 * sum_k |x_k w_k| for the activations' rounding e_k,
    # plus bf16's rounding of the output.
    magnitude = x.float().abs() @ fp8.dequantize(codes, scale, None, torch.float32).abs().T
    output_rounding = 2.0 ** -8 * exact.abs()
    assert ((fast.float() - exact).abs() <= E4M3_RELATIVE * magnitude + output_rounding + 1e-3).all()
    # The reference rounds the weight to bf16 (8 bits of mantissa) and multiplies in bf16.
    assert ((reference.float() - exact).abs() <= 2.0 ** -7 * magnitude + output_rounding + 1e-3).all()


def test_unaligned_shapes_and_float32_take_the_reference():
    codes, scale = fp8.quantize_per_channel(torch.randn(30, 40))   # not multiples of 16
    x = torch.randn(4, 40)
    assert not fp8.per_channel_fast(x.to(torch.bfloat16), codes)
    assert not fp8.per_channel_fast(torch.randn(4, 48), fp8.quantize_per_channel(torch.randn(32, 48))[0])
    got = fp8.fp8_linear(x, codes, scale, None)
    assert torch.equal(got, F.linear(x, fp8.dequantize(codes, scale, None, torch.float32)))


def test_a_linear_becomes_fp8_codes_only():
    torch.manual_seed(3)
    layer = Linear(64, 32, bias=True)
    dense = layer.weight.detach().clone()
    layer.to_fp8()
    assert layer.weight.dtype == fp8.FP8 and not layer.weight.requires_grad
    x = torch.randn(2, 64)
    want = F.linear(x, fp8.dequantize(layer.weight, layer.weight_scale, None, torch.float32), layer.bias)
    assert torch.allclose(layer(x), want)
    assert (layer(x) - F.linear(x, dense, layer.bias)).abs().max() < 0.1


def test_block_layer_is_filled_by_a_loader():
    torch.manual_seed(4)
    layer = Linear(256, 160, bias=False)
    w = torch.randn(160, 256)
    layer.as_fp8_blocks((128, 128))
    assert layer.weight.shape == (160, 256) and layer.weight_scale.shape == (2, 2)
    codes, scale = fp8.quantize_blocks(w, (128, 128))
    layer.weight.data.copy_(codes)
    layer.weight_scale.copy_(scale)
    x = torch.randn(3, 256)
    assert torch.allclose(layer(x), F.linear(x, fp8.dequantize(codes, scale, (128, 128), torch.float32)))


def _generate(path, **kwargs):
    llm = LLM(path, num_kv_blocks=256, block_size=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [[(5 * i + j) % 400 + 2 for j in range(9 + 3 * i)] for i in range(3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_engine_with_fp8_weights_keeps_codes_and_runs_the_scaled_mm(tiny_llama, monkeypatch):
    """bf16 engine with quantization="fp8": every projection is FP8 (the head and embeddings are
    not), the weights take about half their bf16 bytes, and the scaled-mm path gives the tokens
    the reference path gives, with logprobs close."""
    llm, fast = _generate(tiny_llama, dtype="bfloat16", quantization="fp8")
    runner = llm.engine.executor.runner
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == fp8.FP8 for m in linears)
    projection_elements = sum(m.weight.numel() for m in linears)
    dense_llm, dense = _generate(tiny_llama, dtype="bfloat16")
    # Each projection weight went from 2 bytes to 1; nothing else changed.
    assert runner.weight_bytes == dense_llm.engine.executor.runner.weight_bytes - projection_elements
    calls = []
    real = fp8._per_channel_mm
    monkeypatch.setattr(fp8, "_per_channel_mm", lambda *a: (calls.append(1), real(*a))[1])
    _, again = _generate(tiny_llama, dtype="bfloat16", quantization="fp8")
    assert calls, "the scaled mm did not run"
    monkeypatch.setattr(fp8, "per_channel_fast", lambda x, codes: False)
    _, reference = _generate(tiny_llama, dtype="bfloat16", quantization="fp8")
    agree = sum(a == b for (ta, _), (tb, _) in zip(again, reference) for a, b in zip(ta, tb))
    assert agree >= 0.9 * sum(len(t) for t, _ in reference)
    # FP8 is an approximation of the bf16 model: most greedy tokens agree on this tiny model.
    agree_dense = sum(a == b for (ta, _), (tb, _) in zip(fast, dense) for a, b in zip(ta, tb))
    assert agree_dense >= 0.5 * sum(len(t) for t, _ in dense)
