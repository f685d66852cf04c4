"""A crashed engine core makes the server unhealthy, ends in-flight streams, and never hangs."""

from __future__ import annotations

import re
import threading
import time

import httpx
import psutil
import pytest

from tests.e2e.server_process import start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv
    stop_server(srv)


def test_killed_engine_core_turns_into_503s(server):
    children = psutil.Process(server.process.pid).children(recursive=True)
    cores = [p for p in children if "spawn" in " ".join(p.cmdline()) or "multiprocessing" in " ".join(p.cmdline())]
    assert cores, [p.cmdline() for p in children]
    http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30)
    body = {"prompt": "Tell me a story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    stream_result: dict = {}

    def read_stream() -> None:
        with http.stream("POST", "/v1/completions", json=body) as response:
            stream_result["lines"] = list(response.iter_lines())

    reader = threading.Thread(target=read_stream)
    reader.start()
    time.sleep(2.0)          # the request is generating
    for core in cores:
        core.kill()
    reader.join(timeout=15)
    assert not reader.is_alive(), "a stream hung after the engine core died"
    assert any("engine is not available" in line for line in stream_result["lines"])

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and http.get("/health").status_code == 200:
        time.sleep(0.2)
    health = http.get("/health")
    assert health.status_code == 503 and "engine core" in health.json()["reason"]
    # /metrics stops describing an engine that is gone: no gauges, a 0 to alert on, counters kept.
    scrape = http.get("/metrics").text
    assert re.search(r"^deepinfer:engine_healthy\{[^}]*\} 0\.0$", scrape, re.MULTILINE)
    assert "deepinfer:num_requests_running" not in scrape and "deepinfer:kv_cache_usage_perc" not in scrape
    assert "deepinfer:prefix_cache_queries_total" in scrape
    start = time.monotonic()
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503 and time.monotonic() - start < 5
    assert response.json()["error"]["message"].startswith("the engine is not available")
    assert server.process.poll() is None     # the HTTP server itself stays up to say so
