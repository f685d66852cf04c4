"""The encoder counters on /metrics of a server whose engine runs several ranks (`-tp 2`, the mp
executor: rank 1 a child process of the engine core). Rank 0's runner sits in the core's process
(executor/ranked.py), so its counters travel as the in-process executor's do (EngineStats.encoder,
as the KV store's worker counters travel); every rank encodes the same images, so rank 0's count
is the instance's. Checked: images encoded, encode seconds and an encoder cache hit."""

from __future__ import annotations

import httpx

from tests.e2e.server_process import start_server, stop_server
from tests.models.test_gemma3_vision_engine import NEW_TOKENS, chat_messages
from tests.models.tiny_models import tiny_vision_chat_model


def encoder_counters(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("deepinfer:encoder_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("deepinfer:encoder_")] = float(value)
    return out


def chat(server, messages) -> None:
    reply = httpx.post(server.base_url + "/v1/chat/completions", headers=server.headers, timeout=120,
                       json={"model": "tiny", "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
                             "ignore_eos": True})
    assert reply.status_code == 200, reply.text


def test_encoder_counters_reach_metrics_with_the_mp_executor(tmp_path):
    directory = str(tmp_path / "model")
    tiny_vision_chat_model(directory)
    server = start_server(str(tmp_path / "server.log"), "--model", directory, "--served-model-name", "tiny",
                          "-tp", "2", "--distributed-executor-backend", "mp", "--dtype", "float32",
                          "--max-model-len", "512")
    try:
        chat(server, chat_messages([8]))
        # The same image after other text: the prefix cache stops before it, the encoder cache has it.
        chat(server, chat_messages([8], text="w7 w9 w11"))
        counters = encoder_counters(server)
        assert counters["images_encoded_total"] == 1 and counters["cache_hits_total"] == 1, counters
        assert counters["encode_seconds_total"] > 0, counters
    finally:
        stop_server(server)
