"""CLI flags generated from the config dataclasses: vLLM launch lines parse and mean what they say."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing

import pytest

from deepinfer.cli.args import ENGINE_PARTS
from deepinfer.cli.flags import parse_cli
from deepinfer.cli.main import build_parser, main
from deepinfer.cli.server_args import serve_config
from deepinfer.config import EngineConfig, ModelConfig, ParallelConfig
from deepinfer.entrypoints.options import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerOptions


def parse(*argv: str) -> argparse.Namespace:
    return parse_cli(build_parser(), list(argv))


def serve(*flags: str) -> tuple[EngineConfig, ServerOptions]:
    return serve_config(parse("serve", "MODEL", *flags))


def test_full_vllm_launch_line(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config, options = serve(
        "--tensor-parallel-size", "1", "--disable-log-requests", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--chat-template", str(template), "--reasoning-parser", "deepseek_r1",
        "--trust-remote-code", "--generation-config", "vllm", "--max-logprobs", "5",
        "--served-model-name", "a", "b", "--dtype", "half", "--enable-prefix-caching", "False",
        "--enforce-eager", "--no-enable-chunked-prefill")
    assert config.model.model == "MODEL"
    assert config.parallel == ParallelConfig(tensor_parallel_size=1)
    assert config.model.dtype == "float16"
    assert config.model.trust_remote_code is True
    assert config.model.generation_config == "vllm"
    assert config.model.enforce_eager is True
    assert config.model.served_model_name == "a"          # the prefix-cache key's model id
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.enable_chunked_prefill is False
    assert options.served_model_name == ("a", "b")
    assert options.enable_log_requests is False
    assert options.enable_auto_tool_choice is True
    assert options.tool_call_parser == "hermes" and options.reasoning_parser == "deepseek_r1"
    assert options.chat_template == template.read_text()   # the file's text, not its path
    assert options.max_logprobs == 5


@pytest.mark.parametrize(("flags", "expected"), [
    ([], True),
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
    (["--enable-prefix-caching=false"], False),
    (["--enable_prefix_caching", "false"], False),     # vLLM also reads underscores
    *[(["--enable-prefix-caching", word], True) for word in ("true", "True", "1", "yes", "YES")],
    *[(["--enable-prefix-caching", word], False) for word in ("false", "False", "0", "no", "No")],
])
def test_boolean_forms(flags, expected):
    config, _ = serve(*flags)
    assert config.cache.enable_prefix_caching is expected


@pytest.mark.parametrize(("flags", "expected"), [
    ([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False),
    (["--async-scheduling", "0"], False),
])
def test_optional_boolean_keeps_unset_default(flags, expected):
    config, _ = serve(*flags)
    assert config.scheduler.async_scheduling is expected


@pytest.mark.parametrize(("flags", "expected"), [
    (["--disable-log-requests"], False), (["--disable-log-requests", "false"], True),
    (["--enable-log-requests"], True), (["--no-enable-log-requests"], False), ([], False),
])
def test_log_requests_spellings(flags, expected):
    _, options = serve(*flags)
    assert options.enable_log_requests is expected


def test_bare_boolean_flag_leaves_the_next_argument_alone():
    args = parse("generate", "--enforce-eager", "w5 w6", "w7", "--enable-prefix-caching", "no")
    assert args.prompts == ["w5 w6", "w7"]
    assert args.enforce_eager is True and args.enable_prefix_caching is False
    config, _ = serve_config(parse("serve", "--enforce-eager", "MODEL"))
    assert config.model.model == "MODEL" and config.model.enforce_eager is True


@pytest.mark.parametrize(("flags", "named", "listed"), [
    (["--enforce-eager=maybe"], "--enforce-eager", "true/false"),
    (["--enable-prefix-caching=2"], "--enable-prefix-caching", "true/false"),
    (["--no-enforce-eager=1"], "--no-enforce-eager", ""),
    (["--tool-call-parser", "granite"], "--tool-call-parser", "hermes"),
    (["--reasoning-parser", "granite"], "--reasoning-parser", "deepseek_r1"),
    (["--dtype", "bf16"], "--dtype", "half"),
    (["--max-logprobs", "many"], "--max-logprobs", ""),
    (["-tp", "two"], "--tensor-parallel-size/-tp", "invalid int value"),
    (["--distributed-executor-backend", "slurm"], "--distributed-executor-backend", "ray"),
    (["--served-model-name"], "--served-model-name", ""),
])
def test_bad_values_are_argparse_errors_naming_the_flag(flags, named, listed, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("serve", "MODEL", *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {named}" in err and listed in err


def test_parallel_flags_reach_the_config(capsys):
    config, _ = serve("-tp", "2", "-dp", "2", "--enable-expert-parallel", "--expert-parallel-dispatch", "all_reduce",
                      "--distributed-executor-backend", "ray")
    assert config.parallel == ParallelConfig(2, 1, 2, True, "all_reduce", "ray")
    assert config.parallel.world_size == 2 and config.parallel.executor_backend == "ray"
    config, _ = serve("-tp", "2")
    assert config.parallel.executor_backend == "mp"   # vLLM's default for several ranks on one host
    # What is not built is refused by name, and the CLI turns it into status 2 before a server starts.
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2: pipeline parallelism is not implemented"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2)
    assert main(["serve", "MODEL", "-pp", "2"]) == 2
    assert "pipeline_parallel_size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
    config, _ = serve("-tp", "1", "-pp", "1", "-dp", "1", "--enable-expert-parallel",
                      "--distributed-executor-backend", "mp")
    assert config.parallel == ParallelConfig(1, 1, 1, True, distributed_executor_backend="mp")


def test_llm_takes_parallel_kwargs(tiny_llama):
    from deepinfer import LLM

    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, tensor_parallel_size=1,
              distributed_executor_backend="uni")
    assert llm.config.parallel.tensor_parallel_size == 1


def test_every_field_flag_has_the_field_type():
    """int / float / Optional / tuple fields parse into their own types (not strings)."""
    args = parse("serve", "MODEL", "--max-model-len", "64", "--gpu-memory-utilization", "0.5",
                 "--request-timeout-s", "2.5", "--num-kv-blocks", "None", "--port", "9000")
    config, options = serve_config(args)
    assert config.model.max_model_len == 64 and config.cache.gpu_memory_utilization == 0.5
    assert config.cache.num_kv_blocks is None
    assert options.request_timeout_s == 2.5 and options.port == 9000
    # Every field of every engine part and of ServerOptions is reachable by a flag, with its
    # default, so the CLI and the dataclasses cannot drift.
    defaults = parse("serve")
    for klass in (*ENGINE_PARTS, ServerOptions):
        for f in dataclasses.fields(klass):
            if f.name == "model" or (klass is ModelConfig and f.name == "served_model_name"):
                continue
            assert getattr(defaults, f.name) == f.default, f.name
            hint = typing.get_type_hints(klass)[f.name]
            assert hint is not str or isinstance(getattr(defaults, f.name), str)


def test_help_shows_each_flag_with_its_text_and_default(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-enable-prefix-caching" in text and "--disable-log-requests" in text
    assert "Reuse the KV of a prompt prefix computed before" in text
    assert "full blocks). (default: True)" in text
    assert "(default: 20)" in text   # --max-logprobs


def test_model_config_normalizes_vllm_dtype_aliases():
    assert ModelConfig(dtype="half").dtype == "float16"
    assert ModelConfig(dtype="float").dtype == "float32"
    assert ModelConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="bf16")


def test_trust_remote_code_is_accepted_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer.config"):
        assert ModelConfig(trust_remote_code=True).trust_remote_code
    assert "trust_remote_code has no effect" in caplog.text


@pytest.mark.parametrize("name", ["llama3_json", "llama4_json", "mistral", "pythonic", "qwen3_coder"])
def test_vllm_tool_call_parsers_are_accepted_and_name_a_recipe_format(name):
    from deepinfer_recipe.output.call_formats import FORMATS

    _, options = serve("--tool-call-parser", name)
    assert options.tool_call_parser == name and TOOL_CALL_PARSERS[name] in FORMATS


def test_server_options_check_parser_names_and_chat_template(tmp_path):
    assert set(TOOL_CALL_PARSERS) >= {"hermes", "deepseek_v4", "llama3_json", "mistral", "pythonic", "qwen3_coder"}
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "deepseek_v3", "qwen3"}
    with pytest.raises(ValueError, match="accepted: deepseek_v32, deepseek_v4, hermes, llama3_json"):
        ServerOptions(tool_call_parser="granite")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerOptions(reasoning_parser="nope")
    assert ServerOptions(chat_template="{{ messages[0].content }}").chat_template == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="neither a file nor template text"):
        ServerOptions(chat_template=str(tmp_path / "missing.jinja"))
    assert ServerOptions(served_model_name=["x"]).served_model_name == ("x",)
    assert ServerOptions(max_logprobs=-1).max_logprobs == -1


def test_generate_runs_with_vllm_style_engine_flags(tiny_llama, capsys):
    assert main(["generate", "--model", tiny_llama, "--dtype", "float", "--num-kv-blocks", "128",
                 "--enforce-eager", "--enable-prefix-caching", "False", "-tp", "1", "--trust-remote-code",
                 "--max-tokens", "3", "w5 w6 w7"]) == 0
    assert "[3 tokens, finish_reason=length]" in capsys.readouterr().out
