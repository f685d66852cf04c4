"""The real server with two engine cores (`--data-parallel-size 2`) on the tiny random Llama:
concurrent requests all answered, greedy answers equal to the offline LLM's, the load split over
both cores (per-core `engine` labels on /metrics), a request's n children kept on one core, each
core's KV events on its own endpoint stamped with its rank, and a core killed with SIGKILL: its
stream ends with an error, the other core answers meanwhile, and the killed one is restarted."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx
import msgspec
import openai
import psutil
import pytest
import zmq

from deepinfer.kv_cache.events import KVEventBatch
from tests.e2e.server_process import start_server, stop_server

MODEL = "tiny"
PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 500 + 2}" for j in range(6 + i % 5)) for i in range(16)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("dp")
    srv = start_server(str(root / "server.log"), "--model", tiny_llama, "--served-model-name", MODEL,
                       "--dtype", "float32", "--max-model-len", "512", "--cpu-kv-cache-bytes", str(16 << 20),
                       "--data-parallel-size", "2", "--kv-events-endpoint", f"ipc://{root}/events")
    srv.events = f"ipc://{root}/events"
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def events(server):
    """One SUB socket per core: rank 0 on the endpoint as given, rank 1 on `_dp1` (vLLM's rule)."""
    ctx = zmq.Context.instance()
    socks = []
    for address in (server.events, server.events + "_dp1"):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        socks.append(sock)
    time.sleep(0.5)   # the subscriptions reach the publishers before anything is published
    yield socks
    for sock in socks:
        sock.close()


def scrape(server) -> str:
    return httpx.get(f"{server.base_url}/metrics", timeout=10).text


def per_engine(server, name: str, **labels) -> dict[str, float]:
    """{engine: value} of one deepinfer: sample, its other labels as given."""
    out = {}
    for match in re.finditer(rf"^deepinfer:{name}\{{([^}}]*)\}} (\S+)$", scrape(server), re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            out[found["engine"]] = float(match.group(2))
    return out


def core_pids(server) -> dict[int, int]:
    """Engine core index -> pid of its latest process, from the front end's 'ready' log lines."""
    with open(server.log_path, errors="replace") as f:
        return {int(i): int(pid) for i, pid in re.findall(r"engine core (\d+) ready \(pid (\d+)\)", f.read())}


def health(server) -> int:
    return httpx.get(f"{server.base_url}/health", timeout=5).status_code


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def test_concurrent_requests_are_answered_split_and_equal_to_offline(server, events, tiny_llama):
    from deepinfer import LLM, SamplingParams

    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512)
    offline = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)]
    del llm
    assert len(core_pids(server)) == 2
    before = per_engine(server, "request_success_total", finished_reason="length")

    async def ask_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0,
                                    timeout=120)
        replies = await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
            for p in PROMPTS))
        await client.close()
        return [r.choices[0].text for r in replies]

    answers = asyncio.run(ask_all())
    assert answers == offline
    after = per_engine(server, "request_success_total", finished_reason="length")
    served = {engine: after[engine] - before.get(engine, 0) for engine in after}
    assert set(served) == {"0", "1"} and sum(served.values()) == len(PROMPTS)
    assert min(served.values()) >= 1, served            # both cores served some
    assert per_engine(server, "engine_healthy") == {"0": 1.0, "1": 1.0}
    assert set(per_engine(server, "cache_config_info")) == {"0", "1"}

    # Each core's KV events on its own endpoint, stamped with its rank.
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    for rank, sock in enumerate(events):
        assert sock.poll(5000), f"no KV events from core {rank}"
        _, _, payload = sock.recv_multipart()
        assert decoder.decode(payload).data_parallel_rank == rank


def test_a_requests_children_run_on_one_core(server):
    before = per_engine(server, "request_params_n_sum")
    reply = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                       json={"model": MODEL, "prompt": PROMPTS[0], "n": 3, "max_tokens": 4, "seed": 1})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 3
    after = per_engine(server, "request_params_n_sum")
    grew = sorted(after[e] - before.get(e, 0) for e in after)
    assert grew == [0, 3]                                # one core observed the request, with its n


def test_killed_core_fails_its_stream_the_other_serves_and_it_restarts(server):
    http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
    old = core_pids(server)
    result: dict = {}

    def stream() -> None:   # on an idle server the tie goes to core 0
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 480, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            result["lines"] = [line for line in response.iter_lines() if line]

    reader = threading.Thread(target=stream)
    reader.start()
    wait_for(lambda: per_engine(server, "num_requests_running").get("0") == 1, 30, "the stream running on core 0")
    psutil.Process(old[0]).send_signal(signal.SIGKILL)
    reader.join(timeout=15)
    assert not reader.is_alive(), "a stream hung after its engine core died"
    assert any("engine is not available" in line for line in result["lines"]), result["lines"][-3:]
    assert result["lines"][-1] == "data: [DONE]"

    # While core 0 is restarted: /health says which core is down, requests go to core 1.
    wait_for(lambda: health(server) == 503, 5, "/health after the kill")
    reason = httpx.get(f"{server.base_url}/health", timeout=5).json()["reason"]
    assert reason.startswith("engine core 0"), reason
    for prompt in PROMPTS[:3]:
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert reply.status_code == 200, reply.text

    wait_for(lambda: health(server) == 200, 120, "/health after the restart")
    new = core_pids(server)
    assert new[0] != old[0] and new[1] == old[1]
    assert per_engine(server, "engine_healthy") == {"0": 1.0, "1": 1.0}
    replies = [http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 4}) for p in PROMPTS[:2]]
    assert all(r.status_code == 200 for r in replies)
    http.close()
