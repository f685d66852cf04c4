"""`deepinfer router` with real processes on loopback: two replicas of the tiny float32 Llama
(each publishing KV events) behind router processes of several policies.

OpenAI and Anthropic SDK clients, streaming and not, through the router give the same greedy
answers as a direct request; round_robin spreads; cache_aware sends a follow-up with the same long
prefix to the replica that served the first; admission forced to refuse gives 429 + Retry-After;
a replica killed with SIGKILL is removed (the other answers, the router stays healthy) and
re-added once restarted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from tests.e2e.server_process import API_KEY, free_port, start_server, stop_server

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT = " ".join(f"w{(7 * j) % 500 + 2}" for j in range(12))
LONG = " ".join(f"w{(11 * j) % 400 + 5}" for j in range(100))   # several full blocks
GREEDY = {"temperature": 0, "max_tokens": 8}


def _replica_args(model: str, events_port: int) -> tuple[str, ...]:
    return ("--model", model, "--chat-template", TEMPLATE, "--max-model-len", "512", "--dtype", "float32",
            "--cpu-kv-cache-bytes", str(16 << 20), "--kv-events-endpoint", f"tcp://*:{events_port}")


class Router:
    def __init__(self, log_path: str, backends, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [sys.executable, "-m", "deepinfer", "router", "--host", "127.0.0.1", "--port", str(self.port),
                "--api-key", API_KEY, "--health-interval-s", "0.3", "--metrics-interval-s", "0.2",
                "--uvicorn-log-level", "warning", "--backend", *[b.base_url for b in backends], *extra]
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, open(log_path).read()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("router did not start:\n" + open(log_path).read())

    def replicas(self) -> list[dict]:
        return httpx.get(self.url + "/router/replicas", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5).json()["replicas"]

    def oai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("router")
    ports = [free_port(), free_port()]
    servers = [start_server(str(root / f"replica{i}.log"), *_replica_args(tiny_llama, ports[i])) for i in range(2)]
    for s, p in zip(servers, ports):
        s.events_port, s.model = p, tiny_llama
    yield servers
    for s in servers:
        stop_server(s)


@pytest.fixture(scope="module")
def routers(tmp_path_factory, replicas):
    root = tmp_path_factory.mktemp("routers")
    events = [f"tcp://127.0.0.1:{s.events_port}" for s in replicas]
    made = {
        "round_robin": Router(str(root / "rr.log"), replicas, "--policy", "round_robin"),
        "cache_aware": Router(str(root / "ca.log"), replicas, "--policy", "cache_aware", "--kv-events", *events),
        "full": Router(str(root / "full.log"), replicas, "--min-free-kv-blocks", "1000000000"),
    }
    yield made
    for r in made.values():
        r.stop()


def _model(replica) -> str:
    return httpx.get(replica.base_url + "/v1/models", headers=replica.headers).json()["data"][0]["id"]


def test_openai_and_anthropic_match_direct(replicas, routers):
    model = _model(replicas[0])
    direct = openai.OpenAI(base_url=replicas[0].base_url + "/v1", api_key=API_KEY, max_retries=0)
    want = direct.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    want_chat = direct.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                               **GREEDY).choices[0].message.content
    router = routers["round_robin"]
    client = router.oai()
    for _ in range(2):   # both replicas, in turn
        assert client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text == want
        got = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], **GREEDY)
        assert got.choices[0].message.content == want_chat
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    streamed = client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == want

    claude = anthropic.Anthropic(base_url=router.url, api_key=API_KEY, max_retries=0, timeout=60)
    message = claude.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": PROMPT}])
    assert message.content[0].text == want_chat
    with claude.messages.stream(model=model, max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": PROMPT}]) as stream:
        assert "".join(stream.text_stream) == want_chat
    assert [m.id for m in client.models.list().data] == [model]
    # The key is checked by the router itself.
    assert httpx.post(router.url + "/v1/completions", json={"prompt": PROMPT}).status_code == 401


def test_tokenize_renders_each_chat_protocol(replicas, routers):
    """/tokenize's `protocol` (what the cache policies use): a body of each chat route, as it renders."""
    url, h = replicas[0].base_url + "/tokenize", replicas[0].headers
    messages = [{"role": "user", "content": PROMPT}]
    chat = httpx.post(url, headers=h, json={"messages": messages, "stream": True}).json()["tokens"]
    anth = httpx.post(url, headers=h, json={"protocol": "messages", "messages": messages, "max_tokens": 4}).json()
    resp = httpx.post(url, headers=h, json={"protocol": "responses", "input": PROMPT}).json()
    assert chat == anth["tokens"] == resp["tokens"] and len(chat) >= 12
    assert httpx.post(url, headers=h, json={"protocol": "x", "prompt": "w2"}).status_code == 400


def test_round_robin_spreads(replicas, routers):
    router = routers["round_robin"]
    before = [r["routed"] for r in router.replicas()]
    client = router.oai()
    seen = set()
    for _ in range(4):
        raw = client.completions.with_raw_response.create(model=_model(replicas[0]), prompt=PROMPT, **GREEDY)
        seen.add(raw.headers["x-deepinfer-replica"])
    after = [r["routed"] for r in router.replicas()]
    assert seen == {s.base_url for s in replicas}
    assert [a - b for a, b in zip(after, before)] == [2, 2]


def test_cache_aware_follows_the_prefix(replicas, routers):
    router = routers["cache_aware"]
    client = router.oai()
    model = _model(replicas[0])
    first = client.completions.with_raw_response.create(model=model, prompt=LONG + " w7", **GREEDY)
    home = first.headers["x-deepinfer-replica"]
    deadline = time.monotonic() + 10   # the replica's KV events reach the router
    while time.monotonic() < deadline:
        if any(r["url"] == home and r["kv_blocks_indexed"] > 0 for r in router.replicas()):
            break
        time.sleep(0.1)
    for tail in (" w8 w9", " w10", " w11 w12 w13"):
        again = client.completions.with_raw_response.create(model=model, prompt=LONG + tail, **GREEDY)
        assert again.headers["x-deepinfer-replica"] == home
        assert again.parse().usage.prompt_tokens_details.cached_tokens > 0
    metrics = httpx.get(router.url + "/metrics").text
    assert "deepinfer_router_expected_cached_tokens_total" in metrics


def test_admission_rejects_with_retry_after(replicas, routers):
    router = routers["full"]
    response = httpx.post(router.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": _model(replicas[0]), "prompt": PROMPT, "max_tokens": 4})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "rate_limit_error"
    claude = anthropic.Anthropic(base_url=router.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.RateLimitError):
        claude.messages.create(model=_model(replicas[0]), max_tokens=4, messages=[{"role": "user", "content": "w3"}])
    assert 'deepinfer_router_rejected_total{reason="admission"}' in httpx.get(router.url + "/metrics").text


def test_killed_replica_is_removed_then_readded(replicas, routers, tmp_path):
    router = routers["round_robin"]
    victim, survivor = replicas
    model = _model(survivor)
    os.killpg(victim.process.pid, signal.SIGKILL)
    victim.process.wait(10)
    client = router.oai()
    for _ in range(4):   # whatever the probes know yet: every request is answered, by the survivor
        raw = client.completions.with_raw_response.create(model=model, prompt=PROMPT, **GREEDY)
        assert raw.headers["x-deepinfer-replica"] == survivor.base_url
    assert httpx.get(router.url + "/health").status_code == 200
    assert [r["healthy"] for r in router.replicas()] == [False, True]
    port = int(victim.base_url.rsplit(":", 1)[1])
    restarted = start_server(str(tmp_path / "restarted.log"), *_replica_args(victim.model, victim.events_port),
                             port=port)
    replicas[0] = restarted   # the module fixture stops it
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not router.replicas()[0]["healthy"]:
        time.sleep(0.2)
    assert router.replicas()[0]["healthy"]
    seen = {client.completions.with_raw_response.create(model=model, prompt=PROMPT, **GREEDY)
            .headers["x-deepinfer-replica"] for _ in range(2)}
    assert seen == {victim.base_url, survivor.base_url}
