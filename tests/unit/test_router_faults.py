"""The router's fault handling against fake replicas (small FastAPI apps on loopback threads):
a replica that dies before answering is replaced by another (passive detection, no probe needed),
a stream cut mid-way ends with the protocol's error event (and [DONE] for OpenAI), never a hang,
and no healthy replica is a 503."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from deepinfer.router.app import build_app
from deepinfer.router.options import RouterOptions
from tests.e2e.server_process import free_port


class Served:
    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def fake_replica(name: str, cut: bool = False) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def metrics():
        return ""

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m", "root": "m"}]}

    async def chunks():
        yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
        await asyncio.sleep(0.05)
        if cut:
            raise RuntimeError("the replica died mid-stream")
        yield b"data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        if body.get("stream"):
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return {"choices": [{"message": {"content": name}}], "usage": {}}

    @app.post("/v1/messages")
    async def messages(body: dict):
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@pytest.fixture
def router_over():
    started = []

    def make(backends, **kw) -> str:
        options = RouterOptions(backends=tuple(backends), policy="round_robin", health_interval_s=60,
                                metrics_interval_s=60, uvicorn_log_level="warning", **kw)
        served = Served(build_app(options))
        started.append(served)
        return served.url

    yield make
    for s in started:
        s.stop()


def test_failure_before_first_byte_is_retried_elsewhere(router_over):
    a, b = Served(fake_replica("a")), Served(fake_replica("b"))
    url = router_over([a.url, b.url])
    a.stop()   # healthy at the router's first probe; the next probe is a minute away
    answers = {httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=10)
               .json()["choices"][0]["message"]["content"] for _ in range(3)}
    assert answers == {"b"}
    state = httpx.get(url + "/router/replicas").json()["replicas"]
    assert [r["healthy"] for r in state] == [False, True]   # passive detection took it out
    assert "deepinfer_router_retries_total" in httpx.get(url + "/metrics").text
    b.stop()


def test_stream_cut_midway_ends_with_an_error_event(router_over):
    cut = Served(fake_replica("cut", cut=True))
    url = router_over([cut.url])
    with httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True}, timeout=10) as response:
        assert response.status_code == 200
        body = b"".join(response.iter_raw())
    frames = [f for f in body.split(b"\n\n") if f]
    assert frames[0].startswith(b'data: {"choices"')
    assert b'"error"' in frames[-2] and frames[-1] == b"data: [DONE]"
    error = json.loads(frames[-2][len(b"data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] == 502   # the server's failure, not the client's
    # The cut took the replica out of routing (passive detection); a second router still routes to it.
    url = router_over([cut.url])
    with httpx.stream("POST", url + "/v1/messages", json={"stream": True}, timeout=10) as response:
        body = b"".join(response.iter_raw())
    last = body.rstrip().split(b"\n\n")[-1]
    assert last.startswith(b"event: error\ndata: ")
    assert json.loads(last.split(b"data: ", 1)[1])["error"]["type"] == "api_error"
    assert b"[DONE]" not in body
    cut.stop()


def test_no_healthy_replica_is_503(router_over):
    url = router_over([f"http://127.0.0.1:{free_port()}"])
    assert httpx.get(url + "/health").status_code == 503
    response = httpx.post(url + "/v1/messages", json={}, timeout=10)
    assert response.status_code == 503 and response.json()["type"] == "error"
