"""E/P/D with real processes on loopback: an encode instance (`serve --kv-role encode`) and a serving
instance on one dir:// store, behind `deepinfer router --encoder URL --backend URL`, on the tiny
random Gemma3ForConditionalGeneration. Chats with 1 and 2 images answer the greedy tokens of a
colocated engine, the serving instance loading every encoder output from the store (its vision
tower never runs); with the encode instance killed, every request is still answered the same,
the serving instance encoding the images itself. The router probes encode instances: a dead one
is skipped until a probe finds it back (restarted on its port)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from deepinfer import LLM
from tests.e2e.server_process import API_KEY, free_port, start_server, stop_server
from tests.e2e.test_router import Router
from tests.models.test_gemma3_vision_engine import GREEDY, NEW_TOKENS, chat_messages
from tests.models.tiny_models import tiny_vision_chat_model

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHATS = [(21,), (22, 23), (24,), (25, 26)]   # the first two with the encoder up, the last two after it is gone


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("epd_model"))
    tiny_vision_chat_model(directory)
    return directory


def _chat(router: Router, seeds) -> list[int]:
    body = {"model": "tiny", "messages": chat_messages(list(seeds)), "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "return_tokens_as_token_ids": True}
    reply = httpx.post(router.url + "/v1/chat/completions", headers=HEADERS, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return [int(e["token"].split(":")[1]) for e in reply.json()["choices"][0]["logprobs"]["content"]]


def _counters(url: str, prefix: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", headers=HEADERS, timeout=5).text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix(prefix)] = out.get(name.split("{")[0].removeprefix(prefix), 0) + float(value)
    return out


def test_encode_instance_behind_the_router(model_dir, tmp_path):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    want = {seeds: llm.chat(chat_messages(list(seeds)), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for seeds in CHATS}
    llm.engine.shutdown()
    store = f"dir://{tmp_path / 'store'}"
    common = ("--model", model_dir, "--served-model-name", "tiny", "--max-model-len", "512", "--dtype", "float32",
              "--kv-store", store)
    encoder = start_server(str(tmp_path / "encode.log"), *common, "--kv-role", "encode")
    serving = start_server(str(tmp_path / "serve.log"), *common)
    router = None
    try:
        router = Router(str(tmp_path / "router.log"), [serving], "--encoder", encoder.base_url)
        for seeds in CHATS[:2]:
            assert _chat(router, seeds) == want[seeds]
        served = _counters(serving.base_url, "deepinfer:encoder_")
        assert served.get("store_loaded_total") == 3 and served.get("images_encoded_total", 0) == 0, served
        assert _counters(encoder.base_url, "deepinfer:encoder_")["images_encoded_total"] == 3
        assert _counters(router.url, "deepinfer_router_encode_handoffs_total") == {"": 2}

        # The encode instance gone: the serving instance encodes; every request is answered the same.
        psutil.Process(encoder.process.pid).kill()
        encoder.process.wait(10)
        for seeds in CHATS[2:]:
            assert _chat(router, seeds) == want[seeds]
        served = _counters(serving.base_url, "deepinfer:encoder_")
        assert served["images_encoded_total"] == 3 and served["store_misses_total"] == 3, served
    finally:
        _stop(router, encoder, serving)


def _stop(router: Router | None, encoder, serving) -> None:
    """The test's router (if it started) and both instances."""
    if router is not None:
        router.stop()
    stop_server(encoder)
    stop_server(serving)


def _handoffs(router: Router) -> dict[str, float]:
    """deepinfer_router_encode_handoffs_total by outcome."""
    out = {}
    for line in httpx.get(router.url + "/metrics", headers=HEADERS, timeout=5).text.splitlines():
        if line.startswith("deepinfer_router_encode_handoffs_total{"):
            out[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _wait_encoder(router: Router, healthy: bool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(router.url + "/router/replicas", headers=HEADERS, timeout=5).json()["encoders"][0]
        if state["healthy"] == healthy:
            return
        time.sleep(0.1)
    raise AssertionError(f"the router never saw the encoder {'up' if healthy else 'down'}: {state}")


def test_router_probes_encoders_a_dead_one_is_skipped_until_it_is_back(model_dir, tmp_path):
    """The router probes encode instances as it probes replicas: once a probe finds the encoder
    dead, image requests skip the encode stage (`unavailable`, no connection tried) and are
    answered by the serving instance; an encoder restarted on the same port is found by a probe
    and used again."""
    store = f"dir://{tmp_path / 'store'}"
    common = ("--model", model_dir, "--served-model-name", "tiny", "--max-model-len", "512", "--dtype", "float32",
              "--kv-store", store)
    port = free_port()
    encoder = start_server(str(tmp_path / "encode.log"), *common, "--kv-role", "encode", port=port)
    serving = start_server(str(tmp_path / "serve.log"), *common)
    router = None
    try:
        router = Router(str(tmp_path / "router.log"), [serving], "--encoder", encoder.base_url)
        _wait_encoder(router, True)
        _chat(router, (31,))
        assert _handoffs(router) == {"ok": 1}

        os.killpg(encoder.process.pid, signal.SIGKILL)   # its whole group: nothing left on the port
        encoder.process.wait(10)
        _wait_encoder(router, False)
        for seeds in ((32,), (33, 34)):
            _chat(router, seeds)
        assert _handoffs(router) == {"ok": 1, "unavailable": 2}   # no request tried the dead encoder
        served = _counters(serving.base_url, "deepinfer:encoder_")
        assert served["images_encoded_total"] == 3, served

        encoder = start_server(str(tmp_path / "encode-again.log"), *common, "--kv-role", "encode", port=port)
        _wait_encoder(router, True)
        _chat(router, (35,))
        assert _handoffs(router) == {"ok": 2, "unavailable": 2}
        served = _counters(serving.base_url, "deepinfer:encoder_")
        assert served["store_loaded_total"] == 2 and served["images_encoded_total"] == 3, served
    finally:
        _stop(router, encoder, serving)
