"""The CPU int4 fast path (GGUF 4-bit matrices kept 4-bit) against the dense reference path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.bundled import default_model_path
from deepinfer.models.gguf_loader import GGUFFile, read_int4_blocks
from deepinfer.platforms import current_platform

pytestmark = pytest.mark.skipif(current_platform().name != "cpu", reason="the int4 copy is a CPU path")

TEXTS = ["The capital of France is Paris. Paris is famous for",
         "def add(a, b):\n    return", "Water boils at a temperature of"]


def test_int4_blocks_are_the_exact_gguf_values():
    gguf = GGUFFile(default_model_path())
    info = next(t for t in gguf.tensors if t.name == "blk.0.ffn_up.weight")
    blocks = read_int4_blocks(gguf, info)
    assert blocks is not None and blocks.q.max() <= 15
    np.testing.assert_array_equal(blocks.dequantize().numpy(), gguf.read_tensor(info))


def check_logprobs_close(reference, candidate, k: int = 5) -> None:
    """Tokens agree until the first divergence; there, each side's token is in the other's top-k
    (vLLM's rule: a near-tie flipped by rounding, not a different model)."""
    for ref, cand in zip(reference, candidate):
        for position, (r, c) in enumerate(zip(ref.token_ids, cand.token_ids)):
            if r != c:
                assert r in cand.logprobs[position] and c in ref.logprobs[position], (
                    f"position {position}: {r} vs {c} is not a near-tie")
                break


@pytest.fixture(scope="module")
def both_paths():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    dense = LLM(dtype="bfloat16", quantization="none", max_model_len=512, num_kv_blocks=64)
    fast = LLM(dtype="bfloat16", max_model_len=512, num_kv_blocks=64)
    assert any(getattr(m, "int4_weight", None) is not None for m in fast.engine.executor.runner.model.modules())
    assert all(getattr(m, "int4_weight", None) is None for m in dense.engine.executor.runner.model.modules())
    return ([o.outputs[0] for o in dense.generate(TEXTS, params, use_tqdm=False)],
            [o.outputs[0] for o in fast.generate(TEXTS, params, use_tqdm=False)], fast)


def test_int4_decode_agrees_with_dense_reference(both_paths):
    reference, candidate, _ = both_paths
    check_logprobs_close(reference, candidate)
    # Same model, same weights up to bf16 rounding of the scales: the top logprob barely moves.
    diffs = [abs(next(iter(r.values())).logprob - next(iter(c.values())).logprob)
             for ref, cand in zip(reference, candidate) for r, c in zip(ref.logprobs[:4], cand.logprobs[:4])]
    assert max(diffs) < 0.15


def test_int4_and_dense_linear_agree_on_random_inputs(both_paths):
    _, _, fast = both_paths
    layer = fast.engine.executor.runner.model.model.layers[3].mlp.gate_up_proj
    x = torch.randn(4, layer.in_features, dtype=torch.bfloat16)
    fast_out = layer(x).float()
    dense_out = torch.nn.functional.linear(x.float(), layer.weight.float())
    assert ((fast_out - dense_out).norm() / dense_out.norm()).item() < 1e-2
