"""LLM.generate_as_completed: generate()'s outputs, yielded as each request finishes."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4], [11, 12], [3, 4, 5, 6]]
MAX_TOKENS = [12, 3, 7, 1]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=64)


def _params():
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def test_same_outputs_as_generate_in_finishing_order(llm):
    expected = llm.generate(PROMPTS, _params(), use_tqdm=False)
    got = list(llm.generate_as_completed(PROMPTS, _params()))
    assert sorted(index for index, _ in got) == list(range(len(PROMPTS)))
    # All start together and each decodes one token a step: the shortest finish first.
    assert [index for index, _ in got] == sorted(range(len(PROMPTS)), key=lambda i: MAX_TOKENS[i])
    for index, output in got:
        assert output.finished and output.outputs[0].token_ids == expected[index].outputs[0].token_ids


def test_leaving_early_aborts_the_rest(llm):
    outputs = llm.generate_as_completed(PROMPTS, _params())
    first, _ = next(outputs)
    outputs.close()      # what a `break` out of the loop does
    assert first == 3 and not llm.engine.has_unfinished()
    again = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == 2
