"""SamplingParams: vLLM defaults, normalisation, validation messages, cloning and child seeds."""

import dataclasses

import pytest

from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling_params import RequestOutputKind, SamplingParams, SamplingType, StructuredOutputsParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.seed is None and p.logprobs is None and p.prompt_logprobs is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and p.detokenize and not p.ignore_eos
    assert not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.structured_outputs is None
    assert p.sampling_type is SamplingType.RANDOM


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=(5, 6),
                       logit_bias={"7": 1000, 8: -250.5, 9: 3.5})
    assert p.top_k == 0
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 6]
    # JSON bodies carry token ids as strings; values are clamped to OpenAI's [-100, 100].
    assert p.logit_bias == {7: 100.0, 8: -100.0, 9: 3.5}
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n must be at least 1, got 0"),
    ({"n": 1.5}, "n must be an integer, got 1.5"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than 0, got 0.0"),
    ({"temperature": -0.1}, "temperature must be non-negative (0 = greedy), got -0.1"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
    ({"top_k": -2}, "top_k must be 0 or -1 (off) or a positive integer, got -2"),
    ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
    ({"seed": "7"}, "seed must be an integer, got '7'"),
    ({"max_tokens": 0}, "max_tokens must be at least 1 (or None), got 0"),
    ({"min_tokens": -1}, "min_tokens must be non-negative, got -1"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be at most max_tokens=10, got 20"),
    ({"logprobs": -2}, "logprobs must be non-negative, or -1 for the whole vocabulary, got -2"),
    ({"prompt_logprobs": -5}, "prompt_logprobs must be non-negative"),
    ({"stop": ["ok", ""]}, "stop must be a non-empty string or a list of them, got ''"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids must hold non-negative integer token ids, got -1"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias must hold non-negative integer token ids, got 'x'"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"stop": "x", "detokenize": False}, "stop strings need detokenize=True"),
    ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind, got 'delta'"),
    ({"structured_outputs": {"regex": "a+"}},
     "structured_outputs must be a StructuredOutputsParams, got dict"),
])
def test_validation_names_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_boundaries_accepted():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, top_p=1e-6, min_p=1.0,
                   temperature=0, logprobs=-1, prompt_logprobs=0, min_tokens=16)
    assert p.min_tokens == p.max_tokens == 16


def test_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(2)  # a positional 2 could be n or temperature: refuse to guess


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0}, seed=5)
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 1.0
    q.max_tokens = 99
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0} and p.max_tokens == 16
    assert dataclasses.asdict(p.clone()) == dataclasses.asdict(p)


def test_children_get_seed_plus_index():
    p = SamplingParams(n=3, seed=10, stop="x")
    children = [p.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.stop == ["x"] for c in children)
    assert p.n == 3 and p.seed == 10
    unseeded = SamplingParams(n=2)
    assert [unseeded.for_child(i).seed for i in range(2)] == [None, None]
    with pytest.raises(ValueError, match=r"child index must be in \[0, 3\), got 3"):
        p.for_child(3)


def test_verify_token_ids_against_vocab():
    SamplingParams(stop_token_ids=[9], logit_bias={0: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match=r"logit_bias must hold token ids in \[0, 10\), got \[10\]"):
        SamplingParams(logit_bias={10: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 12]).verify_token_ids(10)


def test_outputs_shape():
    out = CompletionOutput(index=0, text="hi", token_ids=[1, 2], cumulative_logprob=-1.5,
                           logprobs=[{1: Logprob(-1.0, 1, "h")}, {2: Logprob(-0.5, 1, "i")}])
    assert not out.finished()
    out.finish_reason, out.stop_reason = "stop", "###"
    assert out.finished()
    req = RequestOutput("r1", "p", [7], None, [out], finished=True)
    assert req.outputs[0].text == "hi" and req.metrics is None and req.num_cached_tokens == 0


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"regex": "a", "compile_timeout_s": 0}, "compile_timeout_s must be positive"),
])
def test_structured_outputs_needs_one_kind(kwargs, message):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert message in str(info.value)
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
