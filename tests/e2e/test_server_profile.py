"""vLLM's profiling routes: with DEEPINFER_TORCH_PROFILER_DIR set, `POST /start_profile` and
`POST /stop_profile` record the engine core under torch's profiler and write its timeline and a
table of ops into that directory; without it the routes do not exist."""

from __future__ import annotations

import glob
import gzip
import json
import time

import httpx

from tests.e2e.server_process import start_server, stop_server

FLAGS = ("--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32")


def complete(server) -> None:
    reply = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                       json={"model": "tiny", "prompt": "w3 w17 w250", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text


def test_profile_routes_write_the_core_trace(tiny_llama, tmp_path, monkeypatch):
    traces = tmp_path / "traces"
    monkeypatch.setenv("DEEPINFER_TORCH_PROFILER_DIR", str(traces))
    server = start_server(str(tmp_path / "server.log"), "--model", tiny_llama, *FLAGS)
    try:
        assert httpx.post(f"{server.base_url}/start_profile", headers=server.headers, timeout=10).status_code == 200
        complete(server)
        assert httpx.post(f"{server.base_url}/stop_profile", headers=server.headers, timeout=10).status_code == 200
        deadline = time.monotonic() + 30
        while not glob.glob(str(traces / "*.txt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        complete(server)   # the core goes on serving after writing
    finally:
        stop_server(server)
    [table] = glob.glob(str(traces / "engine_core_*.txt"))
    [trace] = glob.glob(str(traces / "engine_core_*.pt.trace.json.gz"))
    assert "Self CPU" in open(table).read()
    with gzip.open(trace) as f:
        assert json.load(f)["traceEvents"]


def test_profile_routes_absent_without_a_directory(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPINFER_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    server = start_server(str(tmp_path / "server.log"), "--model", tiny_llama, *FLAGS)
    try:
        assert httpx.post(f"{server.base_url}/start_profile", headers=server.headers, timeout=10).status_code == 404
    finally:
        stop_server(server)
