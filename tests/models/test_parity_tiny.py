"""Parity with HF transformers on tiny random-weight models of every supported architecture:
greedy tokens identical and top-5 logprobs close, for several prompts in one batch, with and
without chunked prefill, with and without a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.models.tiny_models import ARCHS, build_tiny_checkpoint

NEW_TOKENS = 32
# Several prompts of different lengths sharing a 20-token prefix (longer than a 16-token block).
SHARED = [(7 * i + 3) % 500 + 2 for i in range(20)]
PROMPTS = [SHARED + [11, 12, 13], SHARED + [40 + i for i in range(17)], [5, 6, 7], SHARED[:9]]


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, no EOS masking
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [s[0].float().log_softmax(-1) for s in out.scores]
    return tokens, logprobs


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    model = build_tiny_checkpoint(request.param, directory)
    reference = [hf_greedy(model, p) for p in PROMPTS]
    return request.param, directory, reference


def check_against_reference(outputs, reference) -> None:
    for out, (ref_tokens, ref_logprobs) in zip(outputs, reference):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens
        for position, (ours, ref) in enumerate(zip(completion.logprobs, ref_logprobs)):
            top_ids = ref.topk(5).indices.tolist()
            for token_id in top_ids:
                assert token_id in ours, f"position {position}: HF top-5 token {token_id} missing"
                assert ours[token_id].logprob == pytest.approx(ref[token_id].item(), abs=2e-4)


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_and_logprobs_match_transformers(tiny, budget):
    arch, directory, reference = tiny
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=budget, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    check_against_reference(llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False), reference)
    # Second pass: the shared prefix is now cached, and the outputs must not change.
    outputs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    assert outputs[0].num_cached_tokens >= 16
    assert llm.engine.stats().prefix_cache_hits[0] > 0
    check_against_reference(outputs, reference)
