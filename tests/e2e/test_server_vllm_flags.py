"""vLLM's server flags on the real server (issue 42 items 10 and 11).

Item 11: a response's `model` is the first --served-model-name whichever name the request used,
and the "serving ... on ..." line is logged once the port answers (it came before the engine core
had started). Item 10: a launch line full of vLLM's flags (a --config YAML file, --root-path,
--allowed-origins, TLS, --disable-log-stats, --override-generation-config, ...) starts, and each
does what it says; the ones that cannot apply here each leave one warning line.

The model is the tiny random Llama (tests/models/tiny_models.py), so each server starts in seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.server_process import API_KEY, free_port, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
DEBUG_ENV = {**os.environ, "DEEPINFER_LOGGING_LEVEL": "DEBUG"}   # the idle stats line is DEBUG


def _launch(log_path: str, *args: str, scheme: str = "http", env=None, on_line: str | None = None):
    """A server process; when `on_line` is given, the first moment the log holds it, the port is
    asked at once: (process, base URL, whether /health answered then)."""
    port = free_port()
    command = [sys.executable, "-m", "deepinfer", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--api-key", API_KEY, "--uvicorn-log-level", "warning", *args]
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base = f"{scheme}://127.0.0.1:{port}"
    answered_at_line = None
    deadline = time.monotonic() + 300
    with httpx.Client(verify=False, timeout=2) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{open(log_path).read()[-3000:]}")
            if on_line is not None and answered_at_line is None and on_line in open(log_path).read():
                try:
                    answered_at_line = http.get(f"{base}/health").status_code == 200
                except httpx.HTTPError:
                    answered_at_line = False
            try:
                if http.get(f"{base}/health").status_code == 200 and (on_line is None or answered_at_line is not None):
                    return process, base, answered_at_line
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    _stop(process)
    raise RuntimeError("the server did not become healthy")


def _stop(process) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


# ------------------------------------------------------------------------------------ item 11
def test_the_serving_line_comes_when_the_port_answers(tiny_llama, tmp_path):
    log = str(tmp_path / "server.log")
    process, _, answered = _launch(log, "--model", tiny_llama, "--max-model-len", "256", on_line="serving ")
    try:
        assert answered, open(log).read()[-3000:]
        line = next(x for x in open(log).read().splitlines() if "serving " in x)
        assert "on http://127.0.0.1:" in line
    finally:
        _stop(process)


def test_a_response_names_the_first_served_model_name(tiny_llama, tmp_path):
    srv = start_server(str(tmp_path / "server.log"), "--model", tiny_llama, "--max-model-len", "256",
                       "--served-model-name", "smol", "other", "--chat-template",
                       "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    try:
        with httpx.Client(base_url=srv.base_url, headers=srv.headers, timeout=60) as http:
            for model in ("other", "smol", None):
                body = {"prompt": [5, 6, 7], "max_tokens": 2, **({"model": model} if model else {})}
                assert http.post("/v1/completions", json=body).json()["model"] == "smol"
            chat = {"model": "other", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
            assert http.post("/v1/chat/completions", json=chat).json()["model"] == "smol"
            with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
                chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
            assert chunks and all('"model":"smol"' in c.replace(" ", "") for c in chunks)
            messages = {"model": "other", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
            assert http.post("/v1/messages", json=messages).json()["model"] == "smol"
            assert http.post("/v1/completions", json={"model": "third", "prompt": "w5"}).status_code == 404
    finally:
        stop_server(srv)


# ------------------------------------------------------------------------------------ item 10
@pytest.fixture(scope="module")
def vllm_server(tiny_llama, tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    root = tmp_path_factory.mktemp("vllm-flags")
    key, cert = str(root / "key.pem"), str(root / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    config = root / "serve.yaml"
    config.write_text(f"model: {tiny_llama}\nmax_model_len: 1k\nlong_prefill_token_threshold: 64\n"
                      "served_model_name: [smol, other]\nenable_prefix_caching: false\n")
    log = str(root / "server.log")
    process, base, _ = _launch(
        log, "--config", str(config), "--root-path", "/llm", "--allowed-origins", '["http://ui.example"]',
        "--ssl-keyfile", key, "--ssl-certfile", cert, "--disable-log-stats", "--api-server-count", "2",
        "--override-generation-config", '{"max_new_tokens": 3}', "--hf-overrides", '{"max_position_embeddings": 1024}',
        "--kv-cache-dtype", "fp8_e5m2", "--load-format", "safetensors", "--scheduling-policy", "priority",
        "--num-gpu-blocks-override", "96", "-O0", "--cuda-graph-sizes", "8", "--max-seq-len-to-capture", "1024",
        "--swap-space", "4", "--tokenizer-mode", "auto", "--disable-custom-all-reduce",
        "--limit-mm-per-prompt", '{"image": 0}', "--revision", "main",
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
        scheme="https", env=DEBUG_ENV)
    yield base, log
    _stop(process)


def test_a_vllm_launch_line_serves_over_tls_under_its_root_path(vllm_server):
    base, log = vllm_server
    with httpx.Client(verify=False, headers=HEADERS, timeout=60) as http:
        for prefix in ("/llm", ""):   # the proxy's path, and one that strips the prefix
            cards = http.get(f"{base}{prefix}/v1/models").json()["data"]
            # 1k = 1,000 tokens, past the checkpoint's 512: --hf-overrides raised its context
            assert [c["id"] for c in cards] == ["smol", "other"] and cards[0]["max_model_len"] == 1000
        reply = http.post(f"{base}/llm/v1/completions", json={"model": "other", "prompt": [5, 6, 7],
                                                               "ignore_eos": True, "max_tokens": None}).json()
        assert reply["model"] == "smol"
        assert reply["usage"]["completion_tokens"] == 3   # --override-generation-config max_new_tokens
        preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        allowed = http.options(f"{base}/llm/v1/completions", headers=preflight)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://ui.example"
        other = http.options(f"{base}/llm/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    text = open(log).read()
    assert "serving smol on https://127.0.0.1:" in text and "/llm" in text.split("serving smol on", 1)[1].splitlines()[0]
    # What vLLM's flags did to the engine, as the core logs it.
    assert "fp8_e5m2" in text or "float8_e5m2" in text


def test_flags_that_cannot_apply_here_say_so_once_and_the_stats_line_is_off(vllm_server):
    base, log = vllm_server
    time.sleep(11)   # the stats line's interval: with --disable-log-stats none comes
    text = open(log).read()
    for needle in ("--api-server-count 2", "max_seq_len_to_capture=1024 is ignored", "swap_space=4.0 GiB is ignored",
                   "revision='main' is ignored"):
        assert text.count(needle) == 1, needle
    for quiet in ("tokenizer_mode", "limit_mm_per_prompt", "cuda_graph_sizes", "compiles nothing", "Running:"):
        assert quiet not in text, quiet


def test_the_stats_line_is_logged_without_the_flag(tiny_llama, tmp_path):
    log = str(tmp_path / "server.log")
    process, _, _ = _launch(log, "--model", tiny_llama, "--max-model-len", "256", env=DEBUG_ENV)
    try:
        time.sleep(11)
        assert "Running: 0 reqs" in open(log).read()
    finally:
        _stop(process)
