"""A real redis-server for tests: started on a free loopback port in a temp dir, stopped after.
The binary is Debian's redis-server (`make install` installs it); without it the tests that need
it are skipped, saying so."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

BINARY = shutil.which("redis-server") or next(
    (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server")
     if os.path.exists(p)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory, "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.fixture
def redis_server(tmp_path):
    if BINARY is None:
        pytest.skip("redis-server not found (Debian package redis-server; `make install` installs it)")
    server = RedisServer(str(tmp_path))
    server.start()
    yield server
    server.stop()
