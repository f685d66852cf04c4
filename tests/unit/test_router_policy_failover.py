"""Every policy fails over (issue 42, item 1): the router app over fake replicas (small FastAPI apps
on loopback threads). Each policy's first choice is a replica that died after the router's last
probe (the next probe is a minute away); the request is answered by the next replica in the
policy's order, the dead one is out of routing at once and its KV index entries are gone. The
same for a prefill replica under P/D, and for the replica the router asks for a prompt's tokens."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from deepinfer.kv_cache.events import BlockStored, KVEventBatch
from deepinfer.router.app import build_app
from deepinfer.router.kv_index import prompt_block_hashes
from deepinfer.router.options import RouterOptions
from tests.unit.test_router_faults import Served

TOKENS = list(range(64))   # what every fake replica's /tokenize answers: four full blocks of 16
HASHES = prompt_block_hashes(TOKENS, model_name="m", model_id="m", block_size=16, kv_cache_dtype="auto")


def replica_app(name: str, calls: list[str] | None = None) -> FastAPI:
    """A replica as the router sees one: health, gauges with the KV facts, a model, /tokenize, chat."""
    app = FastAPI()
    calls = calls if calls is not None else []

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse('deepinfer:cache_config_info{block_size="16",cache_dtype="auto",'
                                 'num_gpu_blocks="100"} 1\n')

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m", "root": "m"}]}

    @app.post("/tokenize")
    async def tokenize(body: dict):
        calls.append("tokenize")
        return {"tokens": TOKENS}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        calls.append("chat")
        return {"choices": [{"message": {"content": name}}], "usage": {}}

    return app


class Cluster:
    """Fake replicas named by letter, in --backend order, behind a router of one policy."""

    def __init__(self, names: str, policy: str, prefill: str = "") -> None:
        self.calls: dict[str, list[str]] = {n: [] for n in names + prefill}
        self.replicas = {n: Served(replica_app(n, self.calls[n])) for n in names + prefill}
        options = RouterOptions(backends=tuple(self.replicas[n].url for n in names), policy=policy,
                                prefill_backends=tuple(self.replicas[n].url for n in prefill),
                                health_interval_s=60, metrics_interval_s=60, uvicorn_log_level="warning")
        self.app = build_app(options)
        self.router = Served(self.app)
        self.names = names
        self.stopped: set[str] = set()

    @property
    def proxy(self):
        return self.app.state.router["proxy"]

    def kill(self, name: str) -> None:
        self.replicas[name].stop()
        self.stopped.add(name)

    def chat(self) -> httpx.Response:
        return httpx.post(self.router.url + "/v1/chat/completions", json={"messages": [], "model": "m"}, timeout=10)

    def state(self) -> dict[str, dict]:
        replicas = httpx.get(self.router.url + "/router/replicas").json()["replicas"]
        return dict(zip(self.names, replicas))

    def close(self) -> None:
        self.router.stop()
        for name, served in self.replicas.items():
            if name not in self.stopped:
                served.stop()


@pytest.fixture
def cluster():
    made = []

    def make(names: str, policy: str, prefill: str = "") -> Cluster:
        made.append(Cluster(names, policy, prefill))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _holds_prefix(c: Cluster, name: str) -> None:
    index = c.proxy.index
    index.apply(c.names.index(name), KVEventBatch(0.0, [BlockStored(HASHES, None, [], 16, None, "GPU")]))


@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
def test_load_policies_take_the_next_replica(cluster, policy):
    c = cluster("ab", policy)   # a: index 0, the first turn and the least-loaded tie
    c.kill("a")
    replies = [c.chat() for _ in range(3)]
    assert [r.status_code for r in replies] == [200] * 3
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == ["b"] * 3
    assert not c.state()["a"]["healthy"] and c.state()["b"]["healthy"]


@pytest.mark.parametrize("policy", ["cache_aware", "cost"])
def test_cache_policies_take_the_next_replica_and_forget_the_dead_ones_blocks(cluster, policy):
    # b is first in --backend order and so the one asked for tokens; c holds the prompt's blocks,
    # so the policy's choice is c, not the load tie's first.
    c = cluster("bc", policy)
    _holds_prefix(c, "c")
    assert c.state()["c"]["kv_blocks_indexed"] == len(HASHES)
    c.kill("c")
    reply = c.chat()
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "b"
    state = c.state()
    assert not state["c"]["healthy"] and state["c"]["kv_blocks_indexed"] == 0   # tried first, found dead
    assert c.calls["b"] == ["tokenize", "chat"]
    # The next request no longer prefers c: it goes straight to b.
    assert c.chat().json()["choices"][0]["message"]["content"] == "b"
    assert 'deepinfer_router_retries_total{replica="' + c.replicas["c"].url + '"} 1.0' in \
        httpx.get(c.router.url + "/metrics").text


def test_a_dead_tokenizing_replica_is_taken_out_and_another_asked(cluster):
    c = cluster("bc", "cache_aware")
    _holds_prefix(c, "c")
    c.kill("b")   # the replica asked for tokens dies; c still holds the prefix and is chosen
    reply = c.chat()
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "c"
    assert c.calls["c"] == ["tokenize", "chat"]
    assert not c.state()["b"]["healthy"]


def test_a_dead_prefill_replica_is_replaced_by_the_next(cluster):
    c = cluster("d", "least_load", prefill="pq")   # p is the least busy prefill replica (index tie)
    c.kill("p")
    reply = c.chat()
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "d"
    assert c.calls["q"] == ["chat"]   # the prefill copy went to q
    prefill = httpx.get(c.router.url + "/router/replicas").json()["prefill_replicas"]
    assert [r["healthy"] for r in prefill] == [False, True]
    assert 'deepinfer_router_prefill_handoffs_total{outcome="ok"} 1.0' in httpx.get(c.router.url + "/metrics").text
