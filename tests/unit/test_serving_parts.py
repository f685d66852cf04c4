"""Server parts that need no server: IPC messages, request checks, timings."""

from __future__ import annotations

import msgspec
import pytest

from deepinfer.engine.core_proc import AddRequest, Failed, InputMessage, OutputMessage, StepOutputs
from deepinfer.entrypoints import sampling
from deepinfer.entrypoints.errors import APIError
from deepinfer.entrypoints.options import ServerOptions
from deepinfer.entrypoints.request_fields import parse_fields
from deepinfer.metrics.stats import RequestTimings
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.types.plan import EngineCoreOutput, EngineStats
from deepinfer.types.request import RequestTimes


def test_ipc_messages_round_trip():
    params = SamplingParams(n=1, temperature=0.5, seed=3, stop=["x"], logit_bias={"7": 2.5}, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
    add = AddRequest("r-1", [1, 2, 3], params, [2], 100, priority=4, cache_salt="t", extra_key=b"\x00k")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(add), type=InputMessage)
    assert back == add and back.sampling_params.logit_bias == {7: 2.5}
    assert back.sampling_params.output_kind is RequestOutputKind.DELTA

    out = EngineCoreOutput("r-1", [5], [{5: Logprob(-0.25, 1), 9: Logprob(-1.5, 2)}], None, "stop", None, 16)
    step = StepOutputs([out], EngineStats(1, 0, 0.25, 0, [32], [16], [0]), {"r-1": RequestTimes(1.0, 1.5, 2.0, 3.0)})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=OutputMessage)
    assert decoded == step and decoded.outputs[0].new_logprobs[0][9].rank == 2
    assert isinstance(msgspec.msgpack.decode(msgspec.msgpack.encode(Failed("boom")), type=OutputMessage), Failed)


def test_context_check_names_the_numbers():
    sampling.check_context(100, 900, 1024)
    with pytest.raises(APIError, match=r"maximum context length is 1024 tokens.*1100 tokens \(100 in the messages, "
                                       r"1000 in the completion\)") as error:
        sampling.check_context(100, 1000, 1024)
    assert error.value.status == 400 and error.value.param == "max_tokens"
    with pytest.raises(APIError):
        sampling.check_context(1024, None, 1024)   # no room left for even one token


def _params(body: dict, **kwargs) -> SamplingParams:
    fields = parse_fields("chat", body)
    kwargs.setdefault("max_tokens", 4)
    return sampling.build(fields, options=ServerOptions(), vocab_size=1000, **kwargs)


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"), ({"min_tokens": 5}, "min_tokens"),
    ({"seed": 2 ** 70}, "seed"), ({"seed": "42"}, "seed"), ({"priority": -2 ** 64}, "priority"),
    ({"top_k": 2 ** 40}, "top_k"), ({"temperature": float("nan")}, "temperature"),
    ({"cache_salt": ""}, "cache_salt"), ({"logit_bias": {"5": "up"}}, "logit_bias.5"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"), ({"no_such_field": 1}, "no_such_field"),
])
def test_bad_sampling_values_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as error:
        _params(body)
    assert error.value.status == 400 and error.value.param == param, error.value.message


def test_sampling_build_reads_extras():
    params = _params({"top_k": 5, "min_p": 0.1, "ignore_eos": True, "temperature": 0, "seed": 1}, max_tokens=8, n=2)
    assert (params.top_k, params.min_p, params.ignore_eos, params.n, params.max_tokens, params.seed) == (
        5, 0.1, True, 2, 8, 1)


def test_generation_config_defaults_fill_only_unset_fields():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    params = _params({"top_p": 0.5}, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)
    assert _params({}, defaults={}).temperature == 1.0   # OpenAI's default without a generation config


def test_limits_of_the_options_are_400s():
    with pytest.raises(APIError, match="at most 2 stop sequences") as error:
        sampling.build(parse_fields("chat", {}), options=ServerOptions(max_stop_sequences=2), vocab_size=1000,
                       max_tokens=4, stop=["a", "b", "c"])
    assert error.value.param == "stop"
    with pytest.raises(APIError, match="--max-logprobs") as error:
        sampling.build(parse_fields("chat", {}), options=ServerOptions(max_logprobs=3), vocab_size=1000,
                       max_tokens=4, logprobs=4)


@pytest.mark.parametrize("guided, kind", [({"guided_json": {"type": "object"}}, "json"),
                                          ({"guided_regex": "a+"}, "regex"), ({"guided_choice": ["x", "y"]}, "choice"),
                                          ({"guided_grammar": 'root ::= "a"'}, "grammar")])
def test_vllm_guided_fields_constrain_the_output(guided, kind):
    assert _params(guided).structured_outputs.kind == kind
    with pytest.raises(APIError, match="one output constraint"):
        _params({**guided, "structured_outputs": {"regex": "b"}})


def test_request_timings_use_one_clock_each():
    timings = RequestTimings(num_prompt_tokens=10, arrival=100.0)
    assert timings.on_tokens([1], 100.5) is None and timings.ttft == 0.5
    assert timings.on_tokens([1], 100.75) == 0.25
    timings.on_core_finished(0, RequestTimes(arrival=7.0, first_scheduled=7.5, first_token=8.0, finished=9.0))
    assert (timings.queue_time, timings.prefill_time, timings.decode_time) == (0.5, 0.5, 1.0)
    assert (timings.inference_time, timings.mean_time_per_output_token) == (1.5, 1.0)
