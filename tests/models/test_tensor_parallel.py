"""Tensor parallelism on the CPU (gloo) through the `mp` executor: the same greedy tokens as one
rank and logprobs within float32 rounding (the ranks' partial sums add in another order), for
every architecture family, with KV heads replicated when fewer than the ranks, from an HF
directory and from a GGUF file; clear errors when the sizes do not divide and when a rank dies.

Each engine here starts real rank processes (`python -m deepinfer.worker.rank_worker`) that
meet rank 0 over loopback."""

from __future__ import annotations

import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.executor.ranked import RankFailedError
from deepinfer.sampling_params import StructuredOutputsParams
from tests.models.tiny_models import build_tiny_checkpoint

NEW_TOKENS = 12
PROMPTS = [[(7 * i + 5 * j) % 500 + 2 for j in range(9 + 13 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)


def run(model: str, tp: int, params: SamplingParams = GREEDY, prompts=PROMPTS, **kwargs):
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, **kwargs)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def assert_same(got, want, atol: float = 1e-4) -> None:
    for ours, ref in zip(got, want):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for mine, theirs in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            for token, logprob in theirs.items():
                assert mine[token].logprob == pytest.approx(logprob.logprob, abs=atol)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mistral"])
def test_two_ranks_match_one(arch, tmp_path):
    """Llama (rope scaling), Qwen3 (q/k norms), Gemma 3 (sliding + global layers, tied head,
    softcapping-free GeLU MLP) and Mistral (sliding window): 4 heads, 2 KV heads over 2 ranks."""
    build_tiny_checkpoint(arch, str(tmp_path))
    assert_same(run(str(tmp_path), 2, num_kv_blocks=256), run(str(tmp_path), 1, num_kv_blocks=256))


def test_kv_heads_replicated_over_more_ranks(tiny_llama):
    """4 ranks over 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1."""
    assert_same(run(tiny_llama, 4, num_kv_blocks=128), run(tiny_llama, 1, num_kv_blocks=128))


def test_gguf_checkpoint_shards_by_rank():
    """The embedded SmolLM2-135M GGUF (9 heads, 3 KV heads) over 3 ranks: each rank cuts its
    slice of the dequantized tensors (no 4-bit copies under tensor parallelism)."""
    prompts = [[1, 4093, 2156, 314, 253, 3575, 30, 2], [1, 504, 3458, 282]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    got = run("default", 3, params, prompts, num_kv_blocks=64, max_model_len=256)
    want = run("default", 1, params, prompts, num_kv_blocks=64, max_model_len=256)
    assert_same(got, want, atol=2e-3)


def test_seeded_sampling_matches_one_rank(tiny_llama):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)
    got, want = run(tiny_llama, 2, params, num_kv_blocks=64), run(tiny_llama, 1, params, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_speculation_and_grammar_masks_reach_every_rank(tiny_llama):
    """n-gram drafts (the verify step on every rank) and a regex constraint (the step's grammar
    mask sent to every rank with the sampling call) give one rank's tokens."""
    repeating = [5, 6, 7, 8] * 6
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                             structured_outputs=StructuredOutputsParams(regex="(w5w7|w12){1,3}"))]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    prompts = [repeating, PROMPTS[1]]

    def tokens(tp: int) -> list[list[int]]:
        llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=128, tensor_parallel_size=tp, speculative_config=spec)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [o.outputs[0].token_ids for o in outs]

    assert tokens(2) == tokens(1)


def test_sizes_that_do_not_divide_are_refused(tiny_llama):
    with pytest.raises(Exception, match=r"not divisible by tensor_parallel_size \(3\)"):
        LLM(tiny_llama, dtype="float32", num_kv_blocks=64, tensor_parallel_size=3)


def test_pipeline_parallel_and_uni_with_ranks_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="pipeline parallelism is not implemented"):
        LLM(tiny_llama, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="uni")


def test_a_dead_rank_is_a_clear_error_not_a_hang(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
        rank = llm.engine.executor.ranks[0]
        rank.process.kill()
        rank.process.wait(10)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1"):
            llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        start = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - start < 30
