"""Data parallelism without processes: the balancer's choice, each core's devices and KV events
endpoint, and the engine client routing over fake cores (a request and its n children on one
core, aborts and failures kept to their core, the per-core counts back to zero)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from deepinfer.config import EngineConfig, ParallelConfig
from deepinfer.engine.admission import AddRequest, EngineFacts
from deepinfer.engine.core_proc import Abort, InputMessage
from deepinfer.frontend.dp_balancer import DPLoadBalancer, core_device_env
from deepinfer.frontend.engine_client import AsyncEngineClient, EngineDeadError, EngineInfo
from deepinfer.kv_cache.events import rank_endpoint
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.plan import EngineCoreOutput


# -------------------------------------------------------------------------------- the balancer
def test_fewest_unfinished_wins_ties_to_the_lower_index():
    balancer = DPLoadBalancer(3)
    picks = []
    for _ in range(6):
        picks.append(balancer.choose(range(3)))
        balancer.added(picks[-1], 1)
    assert picks == [0, 1, 2, 0, 1, 2]
    balancer.finished(1, 2)
    assert balancer.choose(range(3)) == 1
    balancer.added(1, 4)                      # n = 4: four sequences
    assert balancer.unfinished == [2, 4, 2] and balancer.choose(range(3)) == 0


def test_unavailable_cores_are_skipped():
    balancer = DPLoadBalancer(2)
    balancer.added(1, 5)
    assert balancer.choose([1]) == 1          # core 0 down: the busy one still takes it
    assert balancer.choose([]) is None


def test_counts_never_go_below_zero():
    balancer = DPLoadBalancer(2)
    balancer.added(0, 1)
    with pytest.raises(RuntimeError, match="engine core 0"):
        balancer.finished(0, 2)
    with pytest.raises(ValueError):
        DPLoadBalancer(0)


# ------------------------------------------------------------------------------------ devices
def test_each_core_gets_its_tensor_parallel_slice_of_the_visible_devices(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "auto")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    two_by_two = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="mp")
    assert [core_device_env(two_by_two, r) for r in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert core_device_env(ParallelConfig(data_parallel_size=4), 3) == {"CUDA_VISIBLE_DEVICES": "7"}
    with pytest.raises(ValueError, match="needs 6 CUDA devices, but 4 are visible"):
        core_device_env(ParallelConfig(tensor_parallel_size=2, data_parallel_size=3,
                                       distributed_executor_backend="mp"), 0)
    assert core_device_env(ParallelConfig(), 0) == {}                           # one core: left as it is
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert core_device_env(ParallelConfig(data_parallel_size=2), 1) == {}       # no CUDA: all on the CPU
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert core_device_env(ParallelConfig(data_parallel_size=2), 1) == {}


def test_kv_events_endpoints_are_offset_by_rank_as_vllm_does():
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert rank_endpoint("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert rank_endpoint("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    assert rank_endpoint("inproc://ev", 3) == "inproc://ev_dp3"
    assert rank_endpoint(None, 1) is None
    with pytest.raises(ValueError, match="port"):
        rank_endpoint("tcp://*:65535", 1)


def test_offline_llm_refuses_data_parallelism_by_name():
    from deepinfer import LLM

    with pytest.raises(ValueError, match=r"data_parallel_size=2.*deepinfer serve --data-parallel-size"):
        LLM("no-model-is-loaded", data_parallel_size=2)


# --------------------------------------------------------------------- the client, fake cores
class FakeCore:
    """What the client uses of a CoreProcess, recording what it is sent."""

    def __init__(self) -> None:
        self.alive = True
        self.sent: list = []
        self._decoder = msgspec.msgpack.Decoder(InputMessage)

    def silent_for(self) -> float:
        return 0.0

    def encode(self, message) -> bytes:
        return msgspec.msgpack.encode(message)

    def send_encoded(self, raw: bytes) -> None:
        self.sent.append(self._decoder.decode(raw))

    def send(self, message) -> None:
        self.sent.append(message)

    def added(self) -> list[str]:
        return [m.request_id for m in self.sent if isinstance(m, AddRequest)]

    def aborted(self) -> list[str]:
        return [rid for m in self.sent if isinstance(m, Abort) for rid in m.request_ids]


def fake_client(num_engines: int) -> tuple[AsyncEngineClient, list[FakeCore]]:
    source = SimpleNamespace(tokenizer=None, eos_token_ids=frozenset({1}), name="m", path="m",
                             hf_config={"vocab_size": 32, "max_position_embeddings": 64})
    client = AsyncEngineClient(EngineConfig.from_kwargs(data_parallel_size=num_engines), source)
    cores = [FakeCore() for _ in range(num_engines)]
    for engine, core in zip(client.engines, cores):
        engine.core = core
    client.info = EngineInfo("m", 64, 100, 16)
    client._facts = EngineFacts("m", 64, frozenset({1}))
    return client, cores


def test_requests_are_spread_and_children_stay_with_their_parent():
    async def run():
        client, cores = fake_client(2)
        greedy = SamplingParams(temperature=0, max_tokens=4, detokenize=False)
        for i in range(4):
            client.add_request(f"r{i}", [5, 6, 7], greedy)
        assert cores[0].added() == ["r0", "r2"] and cores[1].added() == ["r1", "r3"]
        # A tie: n = 3 goes to core 0, all three children.
        client.add_request("fan", [5, 6], SamplingParams(n=3, temperature=1.0, max_tokens=4, detokenize=False))
        assert cores[0].added()[2:] == ["fan-0", "fan-1", "fan-2"]
        assert client.balancer.unfinished == [5, 2]
        client.add_request("r4", [5], greedy)
        client.add_request("r5", [5], greedy)
        assert cores[1].added()[2:] == ["r4", "r5"]            # 5 vs 2, then 5 vs 3: core 1 both times

        client.abort("fan")                                   # aborted where it runs, and only there
        assert cores[0].aborted() == ["fan-0", "fan-1", "fan-2"] and cores[1].aborted() == []
        client.abort_child("r1", 0)
        assert cores[1].aborted() == ["r1"]
        client._dispatch(client.engines[1], [EngineCoreOutput("r1", [9], finish_reason="abort"),
                                             EngineCoreOutput("r3", [9, 9], finish_reason="length")])
        assert client.balancer.unfinished == [2, 2]

        # Core 0 dies: its requests fail, core 1's go on, new requests go to core 1.
        waiting = client._requests["r0"]
        cores[0].alive = False
        client._die(client.engines[0], "engine core 0 process exited unexpectedly (exit code -9)")
        assert sorted(client._requests) == ["r4", "r5"] and client.balancer.unfinished == [0, 2]
        with pytest.raises(EngineDeadError, match="engine core 0"):
            await waiting.stream.get()
        assert not client.healthy and client.unhealthy_reason.startswith("engine core 0 process exited")
        client.add_request("r6", [5], greedy)
        assert cores[1].added()[-1] == "r6"
        cores[1].alive = False
        with pytest.raises(EngineDeadError, match="engine core 0 .*; engine core 1 is not running"):
            client.add_request("r7", [5], greedy)

        # Per-core metrics: r3 finished on core 1, by length.
        scrape = client.metrics.render().decode()
        assert 'deepinfer:request_success_total{engine="1",finished_reason="length",model_name="m"} 1.0' in scrape
        assert 'deepinfer:request_success_total{engine="0",finished_reason="length",model_name="m"} 0.0' in scrape
        assert 'deepinfer:engine_healthy{engine="0",model_name="m"} 0.0' in scrape

    asyncio.run(run())
