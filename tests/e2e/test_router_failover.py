"""The cache-aware router fails over when the replica holding the prefix dies (issue 42, items 1 and 5).

Two real replicas of the tiny float32 Llama (each its own process group on loopback, publishing KV
events) behind a real `deepinfer router --policy cache_aware`. Chats sharing one system prompt go
to the replica that holds its blocks; after the eighth, that replica's process group is killed
with SIGKILL while a long stream from it is in flight and more requests are being sent, a few at a
time. Every request sent after the kill is answered 200 in full by the other replica (a request
whose replica dies before the client got a byte is retried there); only a stream that had already
sent bytes may fail, and it ends with a server error event (type server_error, code 502), never a
client error type. The router marks the dead replica down at once and forgets its blocks.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.server_process import API_KEY, free_port, start_server, stop_server
from tests.e2e.test_router import Router, _replica_args

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM = " ".join(f"w{(11 * j) % 400 + 5}" for j in range(100))   # several full blocks, shared by every chat
TOTAL, KILL_AFTER, IN_FLIGHT = 24, 8, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("failover")
    ports = [free_port(), free_port()]
    servers: list = [None, None]

    def start(i: int) -> None:
        servers[i] = start_server(str(root / f"replica{i}.log"), *_replica_args(tiny_llama, ports[i]))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    router = None
    try:
        assert all(servers), "a replica did not start"
        events = [f"tcp://127.0.0.1:{p}" for p in ports]
        router = Router(str(root / "router.log"), servers, "--policy", "cache_aware", "--kv-events", *events)
        yield servers, router
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            if s is not None:
                stop_server(s)


def _chat_body(model: str, i: int, stream: bool, max_tokens: int = 8) -> dict:
    return {"model": model, "stream": stream, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"w{i + 3} w{i + 9}"}]}


def _events(lines) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _send(url: str, body: dict) -> dict:
    """One chat through the router: its status, replica, and (streams) when its first byte came
    and whether it ended with an error event."""
    sent = time.monotonic()
    if not body["stream"]:
        reply = httpx.post(url + "/v1/chat/completions", headers=HEADERS, json=body, timeout=60)
        ok = reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
        return {"sent": sent, "status": reply.status_code, "replica": reply.headers.get("x-deepinfer-replica"),
                "complete": ok, "text": reply.text[:300]}
    with httpx.stream("POST", url + "/v1/chat/completions", headers=HEADERS, json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        first = None
        collected = []
        for line in lines:
            if first is None:
                first = time.monotonic()
            collected.append(line)
        events = _events(collected) if reply.status_code == 200 else []
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    return {"sent": sent, "status": reply.status_code, "replica": reply.headers.get("x-deepinfer-replica"),
            "first": first, "errors": errors, "complete": bool(events) and events[-1] == "[DONE]" and not errors,
            "text": "\n".join(collected)[-300:]}


def test_cache_aware_fails_over_when_the_prefix_holder_dies(cluster):
    servers, router = cluster
    model = httpx.get(servers[0].base_url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
    first = _send(router.url, _chat_body(model, 0, stream=False))
    assert first["status"] == 200, first
    home = first["replica"]
    deadline = time.monotonic() + 10   # the replica's KV events reach the router's index
    while time.monotonic() < deadline and not any(
            r["url"] == home and r["kv_blocks_indexed"] > 0 for r in router.replicas()):
        time.sleep(0.1)
    victim = next(s for s in servers if s.base_url == home)
    survivor = next(s for s in servers if s is not victim)

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        before = list(pool.map(lambda i: _send(router.url, _chat_body(model, i, stream=i % 3 == 0)),
                               range(1, KILL_AFTER)))
    assert all(r["status"] == 200 and r["complete"] for r in before), before
    assert {r["replica"] for r in before} == {home}, "cache_aware did not follow the shared prefix"

    # A long stream from the prefix holder, in flight when it dies.
    long_body = _chat_body(model, 99, stream=True, max_tokens=400)
    with httpx.stream("POST", router.url + "/v1/chat/completions", headers=HEADERS, json=long_body,
                      timeout=60) as cut:
        assert cut.status_code == 200 and cut.headers["x-deepinfer-replica"] == home
        lines = cut.iter_lines()
        head = [next(lines)]
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            futures = [pool.submit(_send, router.url, _chat_body(model, i, stream=i % 3 == 0))
                       for i in range(KILL_AFTER, TOTAL)]
            time.sleep(0.05)   # a few of them are on their way to the victim
            os.killpg(victim.process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            victim.process.wait(10)
            after = [f.result() for f in futures]
        cut_events = _events(head + list(lines))

    # Item 1: every request is answered 200; only a stream whose first byte came before the kill may break.
    for r in after:
        assert r["status"] == 200, r
        if not r["complete"]:
            assert r.get("first") is not None and r["first"] < killed_at and r["replica"] == home, r
            assert r["errors"] and r["errors"][0]["error"]["type"] == "server_error", r
    late = [r for r in after if r["sent"] > killed_at + 0.5]
    assert all(r["complete"] and r["replica"] == survivor.base_url for r in late), late
    state = {r["url"]: r for r in router.replicas()}
    assert not state[home]["healthy"] and state[home]["kv_blocks_indexed"] == 0
    assert state[survivor.base_url]["healthy"]

    # Item 5: the cut stream ends with a server error event, then [DONE].
    errors = [e for e in cut_events if isinstance(e, dict) and "error" in e]
    assert cut_events[-1] == "[DONE]" and len(errors) == 1, cut_events[-3:]
    assert errors[0]["error"]["type"] == "server_error" and errors[0]["error"]["code"] == 502, errors
