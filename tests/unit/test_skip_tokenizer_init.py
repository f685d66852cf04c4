"""skip_tokenizer_init (vLLM's option): a checkpoint without tokenizer files runs on token ids."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.loader import ModelLoadError, load_model_source
from deepinfer.sampling_params import StructuredOutputsParams

KW = dict(dtype="float32", num_kv_blocks=64)
PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4]]


@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("no_tokenizer") / "model"
    shutil.copytree(tiny_llama, directory)
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer_config.json").unlink()
    return str(directory)


@pytest.fixture(scope="module")
def llm(no_tokenizer_dir):
    return LLM(no_tokenizer_dir, skip_tokenizer_init=True, **KW)


def test_source_loads_without_tokenizer_files(no_tokenizer_dir):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model_source(no_tokenizer_dir)
    source = load_model_source(no_tokenizer_dir, skip_tokenizer_init=True)
    assert source.tokenizer is None
    assert source.eos_token_ids == frozenset({2})   # generation_config.json's eos_token_id


def test_greedy_tokens_equal_a_normal_run(llm, tiny_llama):
    # ignore_eos: the normal run also stops on tokenizer_config.json's eos_token, which a
    # checkpoint without tokenizer files cannot know.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    expected = LLM(tiny_llama, **KW).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                      logprobs=1, detokenize=False), use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)   # detokenize=True asked: forced off
    for want, out in zip(expected, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].text == "" and want.outputs[0].text == ""
        assert out.prompt_token_ids == want.prompt_token_ids
        # Logprobs come without decoded tokens: there is nothing to decode them with.
        assert all(lp.decoded_token is None for entry in out.outputs[0].logprobs for lp in entry.values())
        assert out.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob)


def test_eos_from_generation_config_ends_requests(llm, no_tokenizer_dir, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    # The same checkpoint, whose generation_config.json names that first token as EOS.
    directory = tmp_path / "model"
    shutil.copytree(no_tokenizer_dir, directory)
    config = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [first, 2]}))
    stopping = LLM(str(directory), skip_tokenizer_init=True, **KW)
    assert stopping.eos_token_ids == frozenset({first, 2})
    out = stopping.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [first] and out.text == ""


def test_what_needs_a_tokenizer_is_refused_clearly(llm):
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("w5 w6")
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate({"prompt": "w5 w6"})
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.get_tokenizer()
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop=["w9"]))
    with pytest.raises(ValueError, match="structured outputs need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    # A prompt dict with both keeps working: the ids are used and the text carried along.
    out = llm.generate({"prompt": "w5 w6", "prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].prompt == "w5 w6" and len(out[0].outputs[0].token_ids) <= 2


def test_engine_core_refuses_structured_requests_without_tokenizer(no_tokenizer_dir):
    from deepinfer.config import EngineConfig
    from deepinfer.engine.core import EngineCore
    from deepinfer.types.request import Request

    config = EngineConfig.from_kwargs(model=no_tokenizer_dir, skip_tokenizer_init=True, **KW)
    core = EngineCore(config, load_model_source(no_tokenizer_dir, skip_tokenizer_init=True))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), detokenize=False)
    with pytest.raises(ValueError, match="structured outputs need a tokenizer"):
        core.add_request(Request("r", [5, 6], params, frozenset({2}), 4))


def test_draft_model_speculation_needs_the_tokenizer():
    from deepinfer.config import EngineConfig

    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        EngineConfig.from_kwargs(skip_tokenizer_init=True,
                                 speculative_config={"method": "draft_model", "model": "/x"})
