"""Start and stop the real server (`python -m deepinfer serve`) on a free loopback port.

Each test module starts one server (a module-scoped fixture) running the embedded
SmolLM2-135M-Instruct with a small KV pool; `server.api_key` is required by every /v1 route.
Stopping it sends SIGINT to its process group, so the engine core process goes too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 300


@dataclass
class Server:
    base_url: str
    api_key: str
    process: subprocess.Popen
    log_path: str

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: str, *extra: str, port: int | None = None) -> Server:
    port = port or free_port()
    args = [sys.executable, "-m", "deepinfer", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--api-key", API_KEY, "--cpu-kv-cache-bytes", str(96 << 20), "--max-model-len", "2048",
            "--uvicorn-log-level", "warning", *extra]
    log = open(log_path, "w")
    # A new session, so stopping the server also reaches the engine core process.
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", API_KEY, process, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"the server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGINT)
        try:
            server.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(10)
