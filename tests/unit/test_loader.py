"""Model loading: GGUF and HF-directory sources give exactly the tensors and config transformers builds.

transformers is the reference here (a test-only dependency). For the GGUFs we call
`load_gguf_checkpoint(..., return_tensors=True, model_to_load=...)`, the function
`from_pretrained(dir, gguf_file=...)` uses to build its state dict (from_pretrained itself refuses
GGUF files without `accelerate`, which deepinfer does not need), on a model built on the meta
device from the config transformers parsed from the same file.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from deepinfer.models.bundled import default_model_path, gemma3_270m_gguf_path
from deepinfer.models.loader import ModelLoadError, load_model_source

transformers = pytest.importorskip("transformers")


def _transformers_reference(path: str, our_config: dict):
    """(config object, {hf name: float32 tensor}) as transformers loads the GGUF."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' reader takes seconds per parse, so parse once: the model passed in only
    # supplies parameter names (built on meta from our config), the config we compare against
    # is the one transformers parses in this same call.
    names_only = AutoConfig.for_model(our_config["model_type"], **{k: v for k, v in our_config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(names_only)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    raw = dict(parsed["config"])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    return config, parsed["tensors"]


@pytest.fixture(scope="module")
def smollm2():
    source = load_model_source(None)
    config, reference = _transformers_reference(default_model_path(), source.hf_config)
    return source, dict(source.iter_weights()), config, reference


# Layers of Gemma 3 compared tensor by tensor: one sliding-window layer and one global layer.
# (Dequantizing all 236 tensors through transformers' legacy reader takes over a minute here;
# every tensor kind of a block is covered by these two, and all names are still compared.)
GEMMA3_LAYERS = (0, 5)


def _transformers_gemma3_subset(path: str):
    """Gemma 3's config as transformers parses it, and the tensors of GEMMA3_LAYERS (plus the
    embedding and final norm) through transformers' own name map and tensor processor, i.e. the
    loop of load_gguf_checkpoint(return_tensors=True) restricted to those tensors."""
    import gguf
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    reader = gguf.GGUFReader(path)  # the slow part (~15 s for 262k tokens): do it once
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda _path: reader)
        raw = dict(load_gguf_checkpoint(path, return_tensors=False)["config"])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS["gemma3"](config=config.to_dict())
    name_map = get_gguf_hf_weights_map(model, processor)
    wanted = tuple(f"blk.{i}." for i in GEMMA3_LAYERS)
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name.startswith(wanted) or tensor.name in ("token_embd.weight", "output_norm.weight"):
            result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name)
            tensors[name_map[result.name]] = torch.from_numpy(result.weights.copy())
    return config, tensors, {name_map[t.name] for t in reader.tensors}


@pytest.fixture(scope="module")
def gemma3():
    path = gemma3_270m_gguf_path()
    source = load_model_source(path)
    config, reference, all_names = _transformers_gemma3_subset(path)
    ours = dict(source.iter_weights())
    assert set(ours) == all_names
    return source, ours, config, reference


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_gguf_tensors_equal_transformers(fixture, request):
    source, ours, _, reference = request.getfixturevalue(fixture)
    # SmolLM2: every tensor. Gemma 3: the GEMMA3_LAYERS subset (its fixture compares all names).
    assert set(reference) <= set(ours) and len(reference) > 20
    if fixture == "smollm2":
        assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == torch.float32, name
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


def test_llama_qk_unpermuted(smollm2):
    """The q/k rows come back in HF's half-split rotary order, not llama.cpp's interleaved one."""
    from deepinfer.models.gguf_loader import GGUFFile

    source, ours, _, _ = smollm2
    gguf = GGUFFile(source.path)
    info = next(t for t in gguf.tensors if t.name == "blk.0.attn_k.weight")
    stored = torch.from_numpy(gguf.read_tensor(info))
    assert not torch.equal(stored, ours["model.layers.0.self_attn.k_proj.weight"])
    # Re-interleaving our rows per head must give back the file's layout exactly.
    n_kv, head_dim = source.hf_config["num_key_value_heads"], source.hf_config["head_dim"]
    k = ours["model.layers.0.self_attn.k_proj.weight"].reshape(n_kv, 2, head_dim // 2, -1)
    assert torch.equal(k.transpose(1, 2).reshape(stored.shape), stored)


def test_gemma3_norms_unshifted(gemma3):
    """llama.cpp stores Gemma norms as 1 + w; the HF convention is w."""
    from deepinfer.models.gguf_loader import GGUFFile

    source, ours, _, _ = gemma3
    gguf = GGUFFile(source.path)
    for gguf_name, hf_name in [("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
                               ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
                               ("output_norm.weight", "model.norm.weight")]:
        info = next(t for t in gguf.tensors if t.name == gguf_name)
        assert torch.equal(torch.from_numpy(gguf.read_tensor(info)) - 1.0, ours[hf_name])


_COMMON_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"]


def test_smollm2_config_matches_transformers(smollm2):
    source, _, config, _ = smollm2
    for field in _COMMON_FIELDS:
        assert source.hf_config[field] == getattr(config, field), field
    assert source.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert source.hf_config["model_type"] == config.model_type == "llama"
    assert source.hf_config["rope_theta"] == config.rope_parameters["rope_theta"] == 100000.0
    assert source.name == "SmolLM2-135M-Instruct"


def test_gemma3_config_matches_transformers(gemma3):
    source, _, config, _ = gemma3
    cfg = source.hf_config
    for field in [*_COMMON_FIELDS, "sliding_window", "layer_types", "query_pre_attn_scalar",
                  "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation"]:
        assert cfg[field] == getattr(config, field), field
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == config.model_type
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == config.rope_parameters["full_attention"]["rope_theta"]
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == cfg["rope_local_base_freq"]
    assert cfg["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]


# -- HF directories ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, smollm2):
    """A tiny random Llama saved by transformers (sharded), with SmolLM2's tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory, max_shard_size="4MB")  # forces model.safetensors.index.json
    tokenizer = smollm2[0].tokenizer
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
         "chat_template": tokenizer.chat_template}))
    return directory, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_directory_loads_identical_tensors(tiny_llama_dir):
    directory, state_dict = tiny_llama_dir
    assert (directory / "model.safetensors.index.json").exists()
    source = load_model_source(str(directory))
    ours = dict(source.iter_weights())
    assert set(ours) == set(state_dict)
    for name, tensor in state_dict.items():
        assert torch.equal(ours[name], tensor), name
    assert source.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert source.name == directory.name
    assert source.tokenizer.eos_token_ids == {2}
    assert source.tokenizer.encode("Hello world") == [19556, 905]
    assert source.generation_config["eos_token_id"] == 2


def test_missing_files_are_named(tmp_path, tiny_llama_dir):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load_model_source(str(missing))
    with pytest.raises(ModelLoadError, match="no_such_dir"):
        load_model_source(str(tmp_path / "no_such_dir" / "x"))
    directory = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama_dir[0], directory)
    os.remove(directory / "tokenizer.json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model_source(str(directory))


def test_truncated_gguf_is_named(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(4 << 20))  # header and the first tensors only
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_model_source(str(truncated))
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(truncated.read_bytes()[:100_000])  # cut inside the vocabulary
    with pytest.raises(ModelLoadError, match="header_cut.gguf"):
        load_model_source(str(header_cut))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_model_source(str(garbage))


def test_corrupt_hf_files_are_named(tmp_path, tiny_llama_dir):
    bad_json = tmp_path / "bad-json"
    shutil.copytree(tiny_llama_dir[0], bad_json)
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_source(str(bad_json))

    bad_weights = tmp_path / "bad-weights"
    shutil.copytree(tiny_llama_dir[0], bad_weights)
    shard = sorted(bad_weights.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model_source(str(bad_weights))


def test_unmappable_gguf_architecture_lists_supported(tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"bert\.gguf.*'bert'.*gemma3.*llama"):
        load_model_source(str(path))


def test_hub_id_offline_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        load_model_source("no-such-org/no-such-model")
