"""kv_cache_dtype="fp8" on the CPU: the casts into e4m3, the pool it sizes, and the engine on
the reference and the "cpu" attention backends (the Triton kernels' side is tested on the GPU in
tests/unit/test_triton_attention.py, test_fused_kernels.py and tests/models/test_fast_path.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kv_cache.dtypes import (
    FP8_DTYPE,
    read_cache_rows,
    resolve_cache_dtype,
    to_cache_dtype,
    write_cache_rows,
)
from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
from deepinfer.platforms import current_platform

pytestmark = pytest.mark.skipif(current_platform().name != "cpu",
                                reason="the CPU's backends (the GPU's side: tests/models/test_fast_path.py)")

PROMPTS = [[(7 * i + 3 * j) % 500 + 2 for j in range(6 + 5 * i)] for i in range(5)]


def test_cast_clamps_and_rounds_to_e4m3():
    x = torch.tensor([1000.0, -1000.0, 1.0, 0.3, 447.0, 0.0])
    # 0.3 lies between e4m3's 0.28125 and 0.3125 (3 mantissa bits at 2**-2): nearest is 0.3125.
    assert to_cache_dtype(x, FP8_DTYPE).float().tolist() == [448.0, -448.0, 1.0, 0.3125, 448.0, 0.0]
    assert resolve_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_cache_dtype("fp8", torch.bfloat16) == resolve_cache_dtype("fp8_e4m3", torch.float32) == FP8_DTYPE


def test_cache_rows_written_and_read_through_fp8():
    cache = torch.zeros(10, 2, 4, dtype=FP8_DTYPE)
    rows = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    slots = torch.tensor([7, 2, 5])
    write_cache_rows(cache, slots, rows)
    back = read_cache_rows(cache, slots, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, rows.to(FP8_DTYPE).to(torch.bfloat16))
    torch.testing.assert_close(back, rows, rtol=2 ** -4, atol=2 ** -9)   # e4m3: 3 mantissa bits
    assert not cache[[0, 1, 3, 4, 6, 8, 9]].float().any()   # other rows untouched


def test_fp8_pages_are_a_quarter_of_float32_pages():
    spec = FullAttentionSpec(2, 8, torch.float32)
    fp8 = FullAttentionSpec(2, 8, torch.float32, FP8_DTYPE)
    assert spec.page_bytes(16) == 4 * fp8.page_bytes(16) == 4 * 2 * 16 * 2 * 8
    assert group_layers([fp8, fp8])[0].spec.storage_dtype == FP8_DTYPE


def test_bad_kv_cache_dtype_names_the_choices(tiny_llama):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int8'"):
        LLM(tiny_llama, kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def outputs(tiny_llama):
    """A float32 tiny Llama with a float32 cache (reference backend) and an fp8 cache (reference
    and cpu backends): greedy outputs with logprobs, twice (the second pass hits the prefix
    cache), the prompts' own logprobs, and each engine's pool size."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    runs, prompt_logprobs, blocks = {}, {}, {}
    for name, engine in {"auto": {"attention_backend": "reference"},
                         "fp8": {"attention_backend": "reference", "kv_cache_dtype": "fp8"},
                         "fp8-cpu": {"attention_backend": "cpu", "kv_cache_dtype": "fp8"}}.items():
        llm = LLM(tiny_llama, dtype="float32", block_size=4, cpu_kv_cache_bytes=1 << 20,
                  max_num_batched_tokens=16, enable_prefix_caching=name != "auto", **engine)
        first = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
        again = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)   # prefix-cache hits
        runs[name] = [o.outputs[0] for o in first + again]
        prompt_logprobs[name] = [[entry[token].logprob for entry, token in zip(o.prompt_logprobs[1:], p[1:])]
                                 for o, p in zip(llm.generate([list(p) for p in PROMPTS], scoring,
                                                              use_tqdm=False), PROMPTS)]
        blocks[name] = llm.engine.executor.runner.num_blocks
        assert llm.engine.executor.runner.kv_caches[0][0].dtype == (torch.float32 if name == "auto" else FP8_DTYPE)
    return runs, prompt_logprobs, blocks


def test_fp8_pool_holds_four_times_the_float32_blocks(outputs):
    blocks = outputs[2]
    assert blocks["fp8"] == blocks["fp8-cpu"] == 4 * blocks["auto"]


def test_fp8_cache_same_on_both_cpu_backends_and_with_prefix_hits(outputs):
    """Both backends read the same e4m3 values (float32 math): identical greedy tokens; the second
    pass, served from cached fp8 blocks, repeats the first."""
    runs = outputs[0]
    n = len(PROMPTS)
    for ref, cpu in zip(runs["fp8"], runs["fp8-cpu"]):
        assert cpu.token_ids == ref.token_ids
        for mine, theirs, token in zip(cpu.logprobs, ref.logprobs, ref.token_ids):
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    assert [o.token_ids for o in runs["fp8"][:n]] == [o.token_ids for o in runs["fp8"][n:]]


def test_fp8_cache_stays_close_to_the_full_precision_cache(outputs):
    """Scored over the same text, every prompt token's logprob with an fp8 cache is within 0.03 of
    the float32 cache's (measured: 0.012 at most on this model): rounded, not garbage. Greedy
    continuations may part at near-ties of this random model, so they are not compared."""
    prompt_logprobs = outputs[1]
    for exact, fp8 in zip(prompt_logprobs["auto"], prompt_logprobs["fp8"]):
        assert len(exact) == len(fp8) > 0
        assert max(abs(a - b) for a, b in zip(exact, fp8)) < 0.03
