"""Server parts that need no server: IPC messages, request checks, timings, bench statistics."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from deepinfer.bench.serve import Result, _percentile, summarize
from deepinfer.engine.core import EngineStats
from deepinfer.engine.core_proc import AddRequest, Failed, InputMessage, OutputMessage, StepOutputs
from deepinfer.engine.plan import EngineCoreOutput
from deepinfer.engine.request import RequestTimes
from deepinfer.entrypoints import sampling
from deepinfer.entrypoints.errors import APIError
from deepinfer.metrics.stats import RequestTimings
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import RequestOutputKind, SamplingParams


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


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"), ({"min_tokens": 5}, "min_tokens"),
])
def test_bad_sampling_values_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as error:
        sampling.build(body, vocab_size=1000, max_tokens=4)
    assert error.value.status == 400 and error.value.param == param


def test_sampling_build_reads_extras():
    params = sampling.build({"top_k": 5, "min_p": 0.1, "ignore_eos": True, "temperature": 0}, vocab_size=1000,
                            max_tokens=8, n=2, seed=1)
    assert (params.top_k, params.min_p, params.ignore_eos, params.n, params.max_tokens) == (5, 0.1, True, 2, 8)


def test_request_timings_use_one_clock_each():
    timings = RequestTimings(num_prompt_tokens=10, arrival=100.0)
    assert timings.on_tokens([1], 100.5) is None and timings.ttft == 0.5
    assert timings.on_tokens([1], 100.75) == 0.25
    timings.on_core_finished(0, RequestTimes(arrival=7.0, first_scheduled=7.5, first_token=8.0, finished=9.0))
    assert (timings.queue_time, timings.prefill_time, timings.decode_time) == (0.5, 0.5, 1.0)
    assert (timings.inference_time, timings.mean_time_per_output_token) == (1.5, 1.0)


def test_bench_percentiles_and_summary():
    values = sorted(np.random.default_rng(0).random(101).tolist())
    for p in (50, 90, 99):
        assert _percentile(values, p) == pytest.approx(np.percentile(values, p))
    results = [Result(True, 10, 5, ttft=0.1, e2e=0.5, itl=[0.1] * 4), Result(True, 10, 5, ttft=0.3, e2e=0.7,
                                                                             itl=[0.1] * 4), Result(False)]
    summary = summarize(results, duration=2.0, percentiles=[50, 99])
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["output_throughput"] == 5.0 and summary["request_throughput"] == 1.0
    assert summary["median_ttft_ms"] == pytest.approx(200) and summary["mean_tpot_ms"] == pytest.approx(100)
    assert summary["p99_itl_ms"] == pytest.approx(100)
