"""vLLM's engine and server flags that were unknown here (issue 42 item 10): each parses, and does
what vLLM's does, or is accepted with one warning line saying what happens instead. The server's
own (root path, TLS, CORS, stats log) are exercised on a real server in
tests/e2e/test_server_vllm_flags.py."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli.flags import parse_cli
from deepinfer.cli.main import build_parser
from deepinfer.cli.server_args import serve_config
from deepinfer.config import EngineConfig
from deepinfer.entrypoints.options import ServerOptions
from tests.unit.test_scheduler import make_request, make_scheduler, run_step

COMPAT_LOGGER = "deepinfer.vllm_compat"


def serve(*flags: str):
    return serve_config(parse_cli(build_parser(), ["serve", *flags]))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ------------------------------------------------------------------------------- value forms
def test_human_readable_integers_as_vllm_reads_them():
    from deepinfer.vllm_compat import human_readable_int, human_readable_int_or_auto

    assert [human_readable_int(t) for t in ("4096", "4k", "4K", "25.6k", "2M", "1m")] == [
        4096, 4000, 4096, 25600, 2 * 2**20, 10**6]
    assert human_readable_int_or_auto("auto") is None and human_readable_int_or_auto("-1") is None
    for bad in ("1.5K", "4x", "k", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            human_readable_int(bad)
    config, _ = serve("--max-model-len", "4k", "--max-num-batched-tokens", "2K", "--kv-cache-dtype", "fp8_e5m2",
                      "--load-format", "safetensors")
    assert (config.model.max_model_len, config.scheduler.max_num_batched_tokens) == (4000, 2048)
    assert config.cache.kv_cache_dtype == "fp8_e5m2"


def test_a_bad_value_form_is_an_argparse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        serve("--max-model-len", "4x")
    assert exit_.value.code == 2 and "--max-model-len" in capsys.readouterr().err


# ------------------------------------------------------------------- translated engine flags
def test_vllm_names_of_our_settings():
    config, _ = serve("--scheduling-policy", "priority", "--num-gpu-blocks-override", "77")
    assert (config.scheduler.policy, config.cache.num_kv_blocks) == ("priority", 77)
    from deepinfer.vllm_compat import engine_config

    config = engine_config(scheduling_policy="priority", num_gpu_blocks_override=5)
    assert (config.scheduler.policy, config.cache.num_kv_blocks) == ("priority", 5)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        engine_config(num_gpu_blocks_override=5, num_kv_blocks=6)
    with pytest.raises(TypeError, match="swap_space"):   # the config alone knows only its own names
        EngineConfig.from_kwargs(swap_space=4)


@pytest.mark.parametrize("flags,eager,max_size", [
    (["-O0"], True, None),
    (["-O", "0"], True, None),
    (["--compilation-config", '{"cudagraph_mode": "NONE"}'], True, None),
    (["-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 64}'], False, 64),
    (["--cuda-graph-sizes", "32"], False, 32),
])
def test_cuda_graph_flags_set_ours(flags, eager, max_size, caplog):
    with caplog.at_level(logging.WARNING, logger=COMPAT_LOGGER):
        config, _ = serve(*flags)
    assert (config.model.enforce_eager, config.model.max_cudagraph_capture_size) == (eager, max_size)
    assert warnings_of(caplog) == []   # each does what vLLM's does: nothing to warn


@pytest.mark.parametrize("flags,needle", [
    (["-O3"], "compiles nothing with torch.compile"),
    (["-O", '{"level": 3}'], "compiles nothing with torch.compile"),
    (["-cc", '{"cudagraph_mode": "PIECEWISE"}'], "decode steps only"),
    (["-cc", '{"splitting_ops": []}'], "ignored: splitting_ops"),
    (["--cuda-graph-sizes", "1", "2", "64"], "up to the largest, 64"),
    (["--max-seq-len-to-capture", "8192"], "any context length"),
    (["--swap-space", "16"], "nothing is swapped"),
    (["--tokenizer-mode", "slow"], "one tokenizer"),
])
def test_flags_that_cannot_apply_here_warn_once(flags, needle, caplog):
    with caplog.at_level(logging.WARNING, logger=COMPAT_LOGGER):
        serve(*flags)
    messages = warnings_of(caplog)
    assert len(messages) == 1 and needle in messages[0], messages


def test_flags_that_change_nothing_here_are_quiet(caplog):
    with caplog.at_level(logging.WARNING):
        serve("--tokenizer-mode", "auto", "--limit-mm-per-prompt", '{"image": 0}', "--disable-custom-all-reduce",
              "--swap-space", "0", "--disable-log-stats")
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("kwargs,field", [
    ({"compilation_config": '{"cudagraph_mode": "SOMETIMES"}'}, "cudagraph_mode"),
    ({"compilation_config": "[1, 2]"}, "compilation_config"),
    ({"optimization_level": "7"}, "optimization_level"),
    ({"cuda_graph_sizes": [0]}, "cuda_graph_sizes"),
    ({"limit_mm_per_prompt": '{"image": -1}'}, "limit_mm_per_prompt.image"),
    ({"tokenizer_mode": "fast"}, "tokenizer_mode"),
    ({"hf_overrides": "[1]"}, "hf_overrides"),
    ({"override_generation_config": "{bad"}, "override_generation_config"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
])
def test_bad_values_name_the_field(kwargs, field):
    from deepinfer.vllm_compat import engine_config

    with pytest.raises(ValueError, match=field):
        engine_config(**kwargs)


def test_long_prefill_token_threshold_caps_a_prompts_chunks():
    """vLLM's rule: one request computes at most the threshold per step, so a long prompt leaves
    room for others (and without chunked prefill, it is still cut to it)."""
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    scheduler.add_request(make_request("long", 40))
    scheduler.add_request(make_request("short", 6))
    plan, _ = run_step(scheduler)
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("long", 16), ("short", 6)]
    plan, _ = run_step(scheduler)
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("long", 16), ("short", 1)]
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16,
                               enable_chunked_prefill=False)
    scheduler.add_request(make_request("long", 40))
    assert [c.num_tokens for c in run_step(scheduler)[0].chunks] == [16]


# ------------------------------------------------------------------------------- model loading
@pytest.fixture(scope="module")
def split_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny model without tokenizer files, and its tokenizer in a directory of its own."""
    root = tmp_path_factory.mktemp("split")
    model, tokenizer = root / "model", root / "tokenizer"
    shutil.copytree(tiny_llama, model)
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(str(model / name), str(tokenizer / name))
    return str(model), str(tokenizer)


def test_tokenizer_comes_from_another_directory(split_checkpoint, tiny_llama):
    model, tokenizer = split_checkpoint
    with pytest.raises(Exception, match="tokenizer.json"):
        LLM(model, dtype="float32", num_kv_blocks=32, max_model_len=128)
    llm = LLM(model, tokenizer=tokenizer, dtype="float32", num_kv_blocks=32, max_model_len=128)
    reference = LLM(tiny_llama, dtype="float32", num_kv_blocks=32, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ours, theirs = (x.generate(["w5 w6 w7"], greedy, use_tqdm=False)[0] for x in (llm, reference))
    assert ours.outputs[0].text == theirs.outputs[0].text and ours.prompt_token_ids == [5, 6, 7]


def test_hf_overrides_reach_the_model(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    base = LLM(tiny_llama, dtype="float32", num_kv_blocks=32, max_model_len=128)
    moved = LLM(tiny_llama, hf_overrides='{"rms_norm_eps": 0.5}', dtype="float32", num_kv_blocks=32, max_model_len=128)
    assert moved.config.model.json_field("hf_overrides") == {"rms_norm_eps": 0.5}
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    a, b = (x.generate(prompt, greedy, use_tqdm=False)[0].outputs[0] for x in (base, moved))
    first = [next(iter(step.values())).logprob for step in (a.logprobs[0], b.logprobs[0])]
    assert abs(first[0] - first[1]) > 1e-4   # another norm epsilon: another forward
    # ... so other KV for the same tokens: its blocks never match the plain model's (a shared store)
    assert moved.engine.kv_manager.hash_root != base.engine.kv_manager.hash_root


def test_override_generation_config_sets_the_default_sampling(tiny_llama, caplog):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=32, max_model_len=128, generation_config="vllm",
              override_generation_config={"temperature": 0.0, "max_new_tokens": 3}, revision="main")
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 3)
    assert llm.generate([[5, 6]], use_tqdm=False)[0].outputs[0].token_ids.__len__() == 3
    assert any("revision='main' is ignored" in m for m in warnings_of(caplog))   # a local model
    with pytest.raises(ValueError, match="'max_tokens'"):
        LLM(tiny_llama, dtype="float32", num_kv_blocks=32, max_model_len=128,
            override_generation_config={"max_tokens": 3})


def test_load_format_names_the_kind_of_model(tiny_llama, caplog):
    from deepinfer.models.bundled import default_model_path
    from deepinfer.models.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(default_model_path(), load_format="safetensors")
    with pytest.raises(ModelLoadError, match="safetensors checkpoint"):
        LLM(tiny_llama, load_format="gguf", num_kv_blocks=32, max_model_len=128)
    LLM(tiny_llama, load_format="safetensors", dtype="float32", num_kv_blocks=32, max_model_len=128)
    with caplog.at_level(logging.WARNING):
        LLM(tiny_llama, load_format="pt", dtype="float32", num_kv_blocks=32, max_model_len=128)
    assert any("load_format='pt'" in m for m in warnings_of(caplog))
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(tiny_llama, load_format="zip")


def test_an_fp8_e5m2_cache_holds_e5m2(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_dtype="fp8_e5m2", dtype="float32", num_kv_blocks=32, max_model_len=128)
    k, _ = llm.engine.executor.runner.kv_caches[0]
    assert k.dtype == torch.float8_e5m2
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert k.view(torch.uint8).any()   # written, as e5m2


# ------------------------------------------------------------------------------ server options
def test_server_option_checks_name_the_flag(tmp_path, caplog):
    key = tmp_path / "key.pem"
    key.write_text("x")
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile"):
        ServerOptions(ssl_keyfile=str(key))
    with pytest.raises(ValueError, match="--ssl-certfile"):
        ServerOptions(ssl_keyfile=str(key), ssl_certfile=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--root-path"):
        ServerOptions(root_path="llm/")
    assert ServerOptions(allowed_origins=('["http://a", "http://b"]',)).allowed_origins == ("http://a", "http://b")
    with caplog.at_level(logging.WARNING):
        ServerOptions(api_server_count=4)
    assert any("--api-server-count 4" in m for m in warnings_of(caplog))


def test_structured_outputs_config(caplog):
    from deepinfer.entrypoints import sampling
    from deepinfer.entrypoints.request_fields import CompletionFields

    options = ServerOptions(structured_outputs_config='{"backend": "xgrammar", "disable_any_whitespace": true, '
                                                      '"reasoning_parser": "deepseek_r1"}')
    assert options.reasoning_parser == "deepseek_r1"
    fields = CompletionFields(prompt="x", structured_outputs={"json": {"type": "object"}})
    params = sampling.build(fields, options=options, vocab_size=512, max_tokens=4)
    assert params.structured_outputs.disable_any_whitespace
    mine = CompletionFields(prompt="x", structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": False})
    assert not sampling.build(mine, options=options, vocab_size=512, max_tokens=4).structured_outputs.disable_any_whitespace
    with caplog.at_level(logging.WARNING):
        ServerOptions(structured_outputs_config='{"backend": "guidance"}')
    assert any("xgrammar runs" in m for m in warnings_of(caplog))
    for bad, needle in (('{"backend": "x"}', "backend"), ('{"fallback": 1}', "unknown key"),
                        ('{"reasoning_parser": "nope"}', "reasoning_parser"), ("[", "not valid JSON")):
        with pytest.raises(ValueError, match=needle):
            ServerOptions(structured_outputs_config=bad)


# -------------------------------------------------------------------------------- --config YAML
def test_config_file_sets_flags_and_the_command_line_wins(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text("max_model_len: 4k\nport: 9001\nenable-prefix-caching: false\nserved_model_name: [a, b]\n"
                    "hf_overrides: {rope_theta: 1000.0}\ndisable_log_stats: true\nallowed_origins: ['http://x']\n")
    config, options = serve("--config", str(path), "--port", "9002")
    assert (config.model.max_model_len, options.port, config.cache.enable_prefix_caching) == (4000, 9002, False)
    assert options.served_model_name == ("a", "b") and options.disable_log_stats
    assert json.loads(config.model.hf_overrides) == {"rope_theta": 1000.0}
    assert options.allowed_origins == ("http://x",)
    for text, needle in (("bogus: 1\n", "'bogus' is not a flag"), ("max_model_len: lots\n", "max_model_len"),
                         ("- a\n", "a mapping")):
        path.write_text(text)
        with pytest.raises(SystemExit) as exit_:
            serve(f"--config={path}")
        assert exit_.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve("--config", str(tmp_path / "none.yaml"))
    assert "No such file" in capsys.readouterr().err
    assert os.path.exists(path)
