"""Issue 46 items 2 and 3 against the real server (SmolLM2, float32), one server for both:

- /v1/embeddings: the openai SDK's calls (float, and base64, its default, which it decodes
  itself), OpenAI's four input shapes, usage, embeddings in flight beside generation, and every
  client mistake a 400 naming its field while other requests carry on;
- `deepinfer run-batch` on 100 requests (chat, completions, embeddings) plus bad lines: killed
  mid-way, a cut-off last line added as a crash would leave it, resumed; every line answered
  once, and each answer equal to the server's for the same body (greedy text, vectors).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.server_process import start_server, stop_server

HIDDEN = 576   # SmolLM2-135M's hidden size
MAX_MODEL_LEN = 256
# The server's and run-batch's engine: the same flags, so the same answers.
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--cpu-kv-cache-bytes", str(96 << 20))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # float32: the same input batched differently gives the same vector to 1e-4 (bf16: to ~1e-3).
    srv = start_server(str(tmp_path_factory.mktemp("server") / "server.log"), *ENGINE_FLAGS)
    yield srv
    stop_server(srv)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_sdk_float_and_base64(oai, http):
    text = "The capital of France is Paris."
    as_float = oai.embeddings.create(model="SmolLM2-135M-Instruct", input=text, encoding_format="float")
    assert as_float.object == "list" and len(as_float.data) == 1
    item = as_float.data[0]
    assert item.object == "embedding" and item.index == 0 and len(item.embedding) == HIDDEN
    assert np.linalg.norm(item.embedding) == pytest.approx(1.0, abs=1e-3)   # normalized (vLLM's default)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens > 0
    # Without encoding_format the SDK asks for base64 and decodes the float32 bytes itself.
    as_base64 = oai.embeddings.create(model="SmolLM2-135M-Instruct", input=text)
    assert len(as_base64.data[0].embedding) == HIDDEN
    assert cosine(as_base64.data[0].embedding, item.embedding) >= 0.9999
    # Several inputs, text and token ids: one vector each, in order; the same ids, the same vector.
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    many = oai.embeddings.create(model="SmolLM2-135M-Instruct", input=[text, "Bonjour", ids, [1, 2, 3]],
                                 encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2, 3]
    assert cosine(many.data[0].embedding, item.embedding) >= 0.9999
    assert cosine(many.data[2].embedding, item.embedding) >= 0.9999
    assert cosine(many.data[1].embedding, item.embedding) < 0.9999
    bonjour = http.post("/tokenize", json={"prompt": "Bonjour"}).json()["count"]
    assert many.usage.prompt_tokens == 2 * len(ids) + bonjour + 3


def test_vllm_extras_normalize_and_truncate(http):
    text = "one two three four five six seven eight"
    raw = http.post("/v1/embeddings", json={"input": text, "normalize": False}).json()["data"][0]["embedding"]
    norm = http.post("/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
    assert abs(np.linalg.norm(raw) - 1) > 1e-2 and cosine(raw, norm) >= 0.9999
    # LAST pooling: the last 3 tokens alone differ from the whole input, and equal those 3 sent as ids.
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    cut = http.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 3})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 3
    alone = http.post("/v1/embeddings", json={"input": ids[-3:]}).json()["data"][0]["embedding"]
    assert cosine(cut.json()["data"][0]["embedding"], alone) >= 0.9999


def test_embeddings_beside_generation(oai):
    def chat():
        return oai.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Count to ten."}])

    def embed(i):
        return oai.embeddings.create(model="SmolLM2-135M-Instruct", input=[f"sentence {i}"] * 3,
                                     encoding_format="float")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        chats = [pool.submit(chat) for _ in range(2)]
        embeds = [pool.submit(embed, i) for i in range(6)]
        replies = [c.result() for c in chats]
        vectors = [e.result() for e in embeds]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert all(len(v.data) == 3 and len(v.data[0].embedding) == HIDDEN for v in vectors)


@pytest.mark.parametrize("body, param, words", [
    ({}, "input", "required"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "non-empty"),
    ({"input": ["ok", ""]}, "input[1]", "empty"),
    ({"input": [[1, 2], [5, 10**6]]}, "input[1]", "[0, 49152)"),
    ({"input": [-1]}, "input", "[0, 49152)"),
    ({"input": [7] * (MAX_MODEL_LEN + 1)}, "input", str(MAX_MODEL_LEN)),
    ({"input": ["a", 3]}, "input[1]", "string or a list of token ids"),
    ({"input": "hi", "dimensions": 64}, "dimensions", "matryoshka"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "hi", "encoding_format": "binary"}, "encoding_format", "float"),
    ({"input": "hi", "truncate_prompt_tokens": 4096}, "truncate_prompt_tokens", str(MAX_MODEL_LEN)),
    ({"input": "hi", "messages": []}, "messages", "unknown"),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
])
def test_bad_input_is_a_400_naming_the_field(http, body, param, words):
    response = http.post("/v1/embeddings", json=body)
    error = response.json()["error"]
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert error["param"] == param and words in error["message"], error
    # The server carries on.
    assert http.post("/v1/embeddings", json={"input": "still here"}).status_code == 200


def test_too_long_input_fits_once_truncated(http):
    response = http.post("/v1/embeddings", json={"input": [7] * 3000, "truncate_prompt_tokens": -1})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_openai_sdk_error_for_dimensions(oai):
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        oai.embeddings.create(model="SmolLM2-135M-Instruct", input="hi", dimensions=64)


# -------------------------------------------------------------------------------- run-batch
def batch_requests() -> list[dict]:
    requests = []
    for i in range(100):
        kind = i % 3
        if kind == 0:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Name a fruit, {i}."}],
                                                 "max_tokens": 5, "temperature": 0}
        elif kind == 1:
            url, body = "/v1/completions", {"prompt": f"Day {i} of the journey was", "max_tokens": 5,
                                            "temperature": 0}
        else:
            url, body = "/v1/embeddings", {"input": [f"sentence number {i}", f"another one, {i}"]}
        requests.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return requests


BAD_LINES = ['{"custom_id": "broken", "method": "POST", "url": ',                        # not JSON
             json.dumps({"custom_id": "images", "method": "POST", "url": "/v1/images/generations", "body": {}}),
             json.dumps({"custom_id": "negative", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "x", "max_tokens": -1}}),
             json.dumps({"custom_id": "streamed", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "x", "stream": True}})]


def run_batch(input_path, output_path, log_path, *extra) -> subprocess.Popen:
    args = [sys.executable, "-m", "deepinfer", "run-batch", "-i", str(input_path), "-o", str(output_path),
            "--no-progress", *ENGINE_FLAGS, *extra]
    return subprocess.Popen(args, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def lines_of(path) -> list[str]:
    return open(path).read().splitlines() if os.path.exists(path) else []


def test_run_batch_killed_and_resumed_answers_as_the_server(server, http, tmp_path):
    requests = batch_requests()
    input_path, output_path = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in requests[:50]) + "\n".join(BAD_LINES) + "\n"
                          + "".join(json.dumps(r) + "\n" for r in requests[50:]))
    # First run, slowed to a few requests at a time, killed (engine core too) once 20 lines are out.
    first = run_batch(input_path, output_path, tmp_path / "first.log", "--max-num-seqs", "2",
                      "--max-concurrency", "2")
    deadline = time.monotonic() + 240
    while len(lines_of(output_path)) < 20 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, open(tmp_path / "first.log").read()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    written = len(lines_of(output_path))
    assert 20 <= written < len(requests) + len(BAD_LINES)
    with open(output_path, "a") as f:   # what a crash in the middle of a write leaves
        f.write('{"id": "batch_req_cut", "custom_id": "req-99", "response": {"status_')
    resumed = run_batch(input_path, output_path, tmp_path / "resumed.log")
    assert resumed.wait(300) == 0, open(tmp_path / "resumed.log").read()[-3000:]

    results = [json.loads(line) for line in lines_of(output_path)]
    by_id = {r["custom_id"]: r for r in results}
    assert len(results) == len(requests) + len(BAD_LINES) == len(by_id), "a line answered twice or not at all"
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["response"] is None
    assert by_id["images"]["error"]["code"] == "invalid_url"
    assert by_id["streamed"]["error"]["code"] == "invalid_body"
    negative = by_id["negative"]["response"]
    assert negative["status_code"] == 400 and negative["body"]["error"]["param"] == "max_tokens"

    def ask(request):
        return http.post(request["url"], json=request["body"]).json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, requests))
    for request, expected in zip(requests, answers):
        result = by_id[request["custom_id"]]
        assert result["error"] is None and result["response"]["status_code"] == 200, result
        body = result["response"]["body"]
        if request["url"] == "/v1/embeddings":
            assert len(body["data"]) == 2 and body["usage"] == expected["usage"]
            for ours, theirs in zip(body["data"], expected["data"]):
                assert cosine(ours["embedding"], theirs["embedding"]) >= 0.9999
        elif request["url"] == "/v1/chat/completions":
            assert body["choices"][0]["message"] == expected["choices"][0]["message"], request["custom_id"]
        else:
            assert body["choices"][0]["text"] == expected["choices"][0]["text"], request["custom_id"]
