"""Parity with HF transformers on the real small models shipped as GGUF files:
SmolLM2-135M-Instruct (Q4_1) and Gemma 3 270M (Q4_K_M), both dequantized, in float32.

transformers loads the same GGUF (it dequantizes too), so both sides run the same weights:
greedy tokens must be identical and top-5 logprobs close, for several prompts in one batch.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.bundled import default_model_path, gemma3_270m_gguf_path

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is Paris. Paris is famous for",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
]


def _models():
    return [pytest.param(default_model_path, id="smollm2-135m"),
            pytest.param(gemma3_270m_gguf_path, id="gemma3-270m", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=_models())
def real_model(request):
    import transformers

    path = request.param()
    directory, name = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(path, dtype="float32", max_model_len=1024, num_kv_blocks=512)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    reference = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=0)
        reference.append((out.sequences[0, len(p):].tolist(), [s[0].log_softmax(-1) for s in out.scores]))
    return llm, prompts, reference


def test_greedy_tokens_and_logprobs_match_transformers(real_model):
    llm, prompts, reference = real_model
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    for _ in range(2):  # the second pass hits the prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for out, (ref_tokens, ref_logprobs) in zip(outputs, reference):
            assert out.outputs[0].token_ids == ref_tokens
            for ours, ref in zip(out.outputs[0].logprobs, ref_logprobs):
                for token_id in ref.topk(5).indices.tolist():
                    assert ours[token_id].logprob == pytest.approx(ref[token_id].item(), abs=1e-3)
    assert llm.engine.stats().prefix_cache_hits[0] > 0
    # One prompt alone: decode steps of one row (on the CUDA fast path, the GEMV projections).
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == reference[0][0]
