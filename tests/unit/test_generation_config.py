"""generation_config.json sampling defaults, applied as vLLM applies them (`--generation-config`)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.generation_config import default_sampling_overrides
from deepinfer.models.loader import load_model_source

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                  "max_new_tokens": 3, "do_sample": True, "num_beams": 1, "bos_token_id": 1, "eos_token_id": 2}
AS_SAMPLING = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
               "max_tokens": 3}


@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama, tmp_path_factory):
    """The tiny checkpoint with a generation_config.json that recommends sampling settings."""
    directory = tmp_path_factory.mktemp("with_defaults") / "model"
    shutil.copytree(tiny_llama, directory)
    (directory / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    return str(directory)


def test_overrides_use_vllms_mapping(model_with_defaults, tiny_llama, tmp_path):
    source = load_model_source(model_with_defaults)
    assert default_sampling_overrides("auto", source) == AS_SAMPLING
    assert default_sampling_overrides("vllm", source) == {}
    # A directory: its generation_config.json, not the model's. null values are not defaults.
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_k": None}))
    assert default_sampling_overrides(str(tmp_path), source) == {"temperature": 0.2}
    # The tiny checkpoint's own file holds only token ids: no sampling defaults.
    assert default_sampling_overrides("auto", load_model_source(tiny_llama)) == {}
    with pytest.raises(ValueError, match="generation_config.json does not exist"):
        default_sampling_overrides(str(tmp_path / "nowhere"), source)


def test_gguf_sources_give_no_sampling_defaults():
    source = load_model_source(None, skip_tokenizer_init=True)   # the embedded GGUF, header only
    assert "eos_token_id" in source.generation_config
    assert default_sampling_overrides("auto", source) == {}


def test_llm_applies_the_models_defaults(model_with_defaults, caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer.llm"):
        llm = LLM(model_with_defaults, dtype="float32", num_kv_blocks=64)
    assert "generation config" in caplog.text and "'top_k': 20" in caplog.text
    assert llm.get_default_sampling_params() == SamplingParams(**AS_SAMPLING)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 3 and (len(out.token_ids) == 3 or out.finish_reason == "stop")
    # Given sampling params are used as they are.
    given = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(given[0].outputs[0].token_ids) == 5


def test_vllm_setting_ignores_the_models_defaults(model_with_defaults):
    llm = LLM(model_with_defaults, dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
