"""A hostile or careless client against the real server: every mistake is a 4xx in the protocol's
shape, nothing leaks a slot or a running request, and the server stays responsive meanwhile.

Each test here failed before the hardening commit (the first line of its docstring says how).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import threading
import time

import httpx
import pytest

from tests.e2e.server_process import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
MAX_PENDING = 64
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("server") / "server.log"),
                       "--max-pending-requests", str(MAX_PENDING))
    yield srv
    stop_server(srv)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
        yield client


def running(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return float(re.search(r"^deepinfer:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))


def wait_until(condition, timeout_s: float, step_s: float = 0.05) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(step_s)
    return time.monotonic() - start


# ----------------------------------------------------------------------- slots and cancellation
def test_failed_requests_free_their_slots(http):
    """Before: a seed beyond int64 passed validation, failed in msgpack after the request was
    registered (500) and kept its slot; 1,024 of them made every route answer 429 forever."""
    bad = [{"prompt": "x", "max_tokens": 2, "seed": 2 ** 70}, {"prompt": "x", "max_tokens": 2, "top_k": 2 ** 64},
           {"prompt": "x", "max_tokens": 2, "priority": -(2 ** 70)}]
    for i in range(1024):
        response = http.post("/v1/completions", json=bad[i % len(bad)])
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] in ("seed", "top_k", "priority")
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_dropped_non_streaming_clients_are_aborted(server):
    """Before: the HTTP middleware hid the disconnect from the route, so 64 dropped clients'
    requests ran on to max_tokens (24 still running 88 s later)."""
    body = {"prompt": "Tell me a long story about the sea.", "max_tokens": 1500, "ignore_eos": True}

    async def drop_all() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers) as client:
            async def one() -> None:
                with pytest.raises(httpx.TimeoutException):
                    await client.post("/v1/completions", json=body, timeout=1.5)
            await asyncio.gather(*(one() for _ in range(64)))

    asyncio.run(drop_all())
    # Run to max_tokens, the 64 requests would hold the engine for minutes. Aborted, the last one
    # leaves within about 1.5-2.3 s of the clients' timeouts on the 2-core box (the tree before
    # this bound measured 1.47-1.87 s, this one 1.59-2.33 s: 2 s was inside the noise).
    assert wait_until(lambda: running(server) == 0, timeout_s=5.0) < 5.0


def test_n_counts_as_n_pending_and_429_says_when_to_retry(http):
    """Before: a request with n > 1 counted as one pending request; 429s had no Retry-After."""
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": MAX_PENDING + 1})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert f"adds {MAX_PENDING + 1}" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- body and nesting
def test_server_stays_responsive_while_huge_and_deep_bodies_are_rejected(server, http):
    """Before: a 20 MB body stalled every route, /health included, for 17-60 s; a JSON Schema
    nested 900 deep stalled the server 36 s, then 500."""
    huge = json.dumps({"prompt": "word " * 4_000_000, "max_tokens": 1}).encode()   # 20 MB
    # Written as text: Python's own json module cannot encode a dict nested this deep.
    deep_schema = '{"type": "object", "properties": {"a": ' * 900 + '{"type": "string"}' + "}}" * 900
    deep_body = ('{"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema", '
                 '"json_schema": {"name": "x", "schema": ' + deep_schema + "}}}").encode()
    results: dict[str, int] = {}

    def attack() -> None:
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            results["huge"] = client.post("/v1/completions", content=huge,
                                          headers={"content-type": "application/json"}).status_code
            # Without Content-Length (chunked): counted as it arrives.
            results["chunked"] = client.post("/v1/completions", content=iter([huge[i:i + 1 << 20] for i in
                                                                              range(0, len(huge), 1 << 20)]),
                                             headers={"content-type": "application/json"}).status_code
            results["deep"] = client.post("/v1/chat/completions", content=deep_body,
                                          headers={"content-type": "application/json"}).status_code

    attacker = threading.Thread(target=attack)
    latencies = []
    attacker.start()
    with httpx.Client(base_url=server.base_url, timeout=10) as probe:
        while attacker.is_alive() or len(latencies) < 50:
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    attacker.join()
    assert results == {"huge": 413, "chunked": 413, "deep": 400}
    p99 = statistics.quantiles(latencies, n=100)[98]
    # The stall this guards against lasted 17-60 s. The probe shares this process's interpreter
    # with the thread sending 20 MB bodies, and the 2-core box's full suite measured 110 ms twice
    # (2026-12-02): a quarter second is far from both.
    assert p99 < 0.25, f"/health P99 {p99 * 1000:.0f} ms while the bad bodies were handled"


@pytest.mark.parametrize("raw", ["[" * 10_000 + "]" * 10_000,
                                 '{"prompt": "x", "logit_bias": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"])
def test_deeply_nested_json_is_a_400(http, raw):
    """Before: 10,000-level nesting raised RecursionError: a 500 with internal text."""
    response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "--max-json-depth" in response.json()["error"]["message"]


def test_client_mistakes_never_carry_internal_text(http):
    """Before: ints beyond int64 were OverflowError 500s; xgrammar's messages carried its C++
    source paths."""
    response = http.post("/v1/chat/completions", json={"messages": HI, "seed": 10 ** 30})
    assert response.status_code == 400 and response.json()["error"]["param"] == "seed"
    response = http.post("/v1/completions", json={"prompt": "x", "structured_outputs": {"regex": "(unclosed"}})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "regex" in message and ".cc" not in message and "/" not in message.split(":", 1)[-1]


# ------------------------------------------------------------------- failures inside a stream
STREAMING_ROUTES = [
    ("/v1/completions", {"prompt": "Hi"}, "openai"),
    ("/v1/chat/completions", {"messages": HI}, "openai"),
    ("/v1/responses", {"input": "Hi"}, "responses"),
    ("/v1/messages", {"messages": HI, "max_tokens": 8}, "anthropic"),
]


@pytest.mark.parametrize("path, body, shape", STREAMING_ROUTES)
def test_engine_failure_during_a_stream_ends_with_an_error_event(http, path, body, shape):
    """Before: HTTP 200, an empty body, no error event and no [DONE] (a grammar compile timeout)."""
    # A schema of its own per route: a compiled grammar is cached, and a cached one cannot time out.
    schema = {"type": "object", "properties": {f"{path}{i}": {"type": "string"} for i in range(40)}}
    body = {**body, "stream": True, "model": MODEL,
            "structured_outputs": {"json": schema, "compile_timeout_s": 1e-6}}
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        text = response.read().decode()
    if shape == "openai":
        assert text.rstrip().endswith("data: [DONE]")
        error = json.loads(text.split("data: ")[-2])
        assert error["error"]["code"] == "request_failed" and "compile" in error["error"]["message"]
    else:
        assert "event: error" in text
        assert "compile" in text.split("event: error", 1)[1]


# -------------------------------------------------------------------------- smaller defects
@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop"),   # default cap 64
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "seed": "42"}, "seed"),
    ("/v1/chat/completions", {"messages": HI, "seed": "42"}, "seed"),
    ("/v1/chat/completions", {"messages": HI, "guided_jsonn": {}}, "guided_jsonn"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"12": "high"}}, "logit_bias.12"),
])
def test_small_mistakes_are_400s_naming_the_field(http, path, body, param):
    """Before: `{"input": []}` generated for minutes, stop lists had no cap, an empty cache_salt
    shared the unsalted cache, string seeds were coerced on chat only, unknown fields were
    dropped, and the logit_bias message did not say which value was wrong."""
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_nan_temperature_says_so(http):
    """Before: the message for a NaN temperature spoke of a negative one."""
    response = http.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "NaN" in response.json()["error"]["message"] or "valid JSON" in response.json()["error"]["message"]


def test_models_route_names_no_path(http):
    """Before: /v1/models showed the model's absolute path on this machine; /v1/models/{id} was 404."""
    card = http.get("/v1/models").json()["data"][0]
    assert "/" not in card["root"] and card["id"] == MODEL
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert http.get("/v1/models/nope").status_code == 404
