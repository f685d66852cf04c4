"""LoRA adapters on the real server (`deepinfer serve --enable-lora --lora-modules ...`), vLLM's way:
a request whose `model` names an adapter runs under it (completions, chat, Anthropic messages),
/v1/models lists the adapters with their parent, and /v1/load_lora_adapter and
/v1/unload_lora_adapter exist only with DEEPINFER_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's variable)
set. Tokens are compared with transformers + PEFT's greedy tokens for the same adapter; every bad
input is a 4xx naming the field, and leaves the served adapters as they were.

The model is the tiny random Llama (tests/models/tiny_models.py); its adapters are random PEFT
adapters of rank 8, so each server starts in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch

pytest.importorskip("peft")

from tests.e2e.server_process import API_KEY, free_port, start_server, stop_server  # noqa: E402
from tests.models.tiny_models import write_peft_adapter  # noqa: E402
from tests.unit.test_lora_engine import greedy  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT = [5, 17, 33, 2, 41, 9]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """name -> (path, PEFT model): three rank-8 adapters, and one of rank 16 (above the limit)."""
    root = tmp_path_factory.mktemp("server-adapters")
    out = {}
    for seed, (name, rank) in enumerate((("sql", 8), ("chat", 8), ("late", 8), ("big", 16)), start=1):
        path = str(root / name)
        out[name] = (path, write_peft_adapter(tiny_llama, path, seed=seed, rank=rank))
    return out


@pytest.fixture(scope="module")
def base_model(tiny_llama):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def serve_args(tiny_llama: str, adapters: dict) -> list[str]:
    chat = json.dumps({"name": "chat", "path": adapters["chat"][0], "base_model_name": "tiny-base"})
    return ["--model", tiny_llama, "--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32",
            "--chat-template", TEMPLATE, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"sql={adapters['sql'][0]}", chat]


@pytest.fixture(scope="module")
def server(tiny_llama, adapters, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:   # the server process inherits it
        env.setenv("DEEPINFER_ALLOW_RUNTIME_LORA_UPDATING", "true")
        srv = start_server(str(tmp_path_factory.mktemp("lora-server") / "server.log"),
                           *serve_args(tiny_llama, adapters))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def completion_tokens(http: httpx.Client, model: str, prompt: list[int]) -> tuple[str, list[int]]:
    """(the response's model, its greedy token ids) of a /v1/completions call."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    return reply["model"], [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]


def models(http: httpx.Client) -> dict[str, dict]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def test_models_lists_the_adapters_beside_the_base_model(http):
    cards = models(http)
    assert list(cards) == ["tiny", "sql", "chat"]
    assert cards["tiny"]["parent"] is None
    assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("tiny", "sql")   # root never a local path
    assert cards["chat"]["parent"] == "tiny-base"   # --lora-modules JSON's base_model_name
    assert http.get("/v1/models/sql").json()["parent"] == "tiny"


def test_completions_run_under_the_named_adapter(http, adapters, base_model):
    for name in ("sql", "chat"):
        model, got = completion_tokens(http, name, PROMPT)
        assert model == name
        assert got == greedy(adapters[name][1], PROMPT, MAX_TOKENS)
    model, got = completion_tokens(http, "tiny", PROMPT)
    assert (model, got) == ("tiny", greedy(base_model, PROMPT, MAX_TOKENS))


def test_chat_and_messages_run_under_the_named_adapter(http, adapters):
    messages = [{"role": "user", "content": "w5 w17 w33"}]
    ids = http.post("/tokenize", json={"model": "chat", "messages": messages}).json()["tokens"]
    want = greedy(adapters["chat"][1], ids, MAX_TOKENS)
    body = {"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True}
    reply = http.post("/v1/chat/completions", json=body).json()
    assert reply["model"] == "chat"
    assert [int(e["token"].removeprefix("token_id:")) for e in reply["choices"][0]["logprobs"]["content"]] == want
    anthropic = http.post("/v1/messages", json={"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS,
                                                "temperature": 0})
    assert anthropic.status_code == 200 and anthropic.json()["model"] == "chat"


def test_an_unknown_model_is_404(http):
    response = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_load_and_unload_at_runtime(http, adapters):
    path, model = adapters["late"]
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert response.status_code == 200 and "added successfully" in response.text
    assert "late" in models(http)
    assert completion_tokens(http, "late", PROMPT) == ("late", greedy(model, PROMPT, MAX_TOKENS))
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert response.status_code == 200 and "removed successfully" in response.text
    assert "late" not in models(http)
    assert http.post("/v1/completions", json={"model": "late", "prompt": PROMPT, "max_tokens": 2}).status_code == 404
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404 and "cannot be found" in again.json()["error"]["message"]


@pytest.mark.parametrize("body,param,message", [
    ({"lora_name": "x"}, "lora_path", "Both 'lora_name' and 'lora_path' must be provided"),
    ({"lora_path": "/x"}, "lora_name", "Both 'lora_name' and 'lora_path' must be provided"),
    ({"lora_name": "x", "lora_path": 3}, "lora_path", "lora_path must be a string"),
    ({"lora_name": "sql", "lora_path": "BIG"}, "lora_name", "The lora adapter 'sql' has already been loaded"),
    ({"lora_name": "tiny", "lora_path": "BIG"}, "lora_name", "is the served model's name"),
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, "lora_path", "is not a directory"),
    ({"lora_name": "x", "lora_path": "BIG"}, "lora_path", "r=16 is above max_lora_rank=8"),
])
def test_bad_loads_are_400_naming_the_field(http, adapters, body, param, message):
    before = models(http)
    body = {k: adapters["big"][0] if v == "BIG" else v for k, v in body.items()}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert models(http) == before   # nothing was registered
    assert completion_tokens(http, "sql", PROMPT)[0] == "sql"   # and the server serves on


def test_unload_needs_a_name(http):
    response = http.post("/v1/unload_lora_adapter", json={})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_name"


def test_runtime_updating_routes_are_absent_without_the_variable(tiny_llama, adapters, tmp_path):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("DEEPINFER_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        env.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        srv = start_server(str(tmp_path / "server.log"), *serve_args(tiny_llama, adapters))
    try:
        with httpx.Client(base_url=srv.base_url, headers=srv.headers, timeout=60) as client:
            body = {"lora_name": "late", "lora_path": adapters["late"][0]}
            assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
            assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
            assert "sql" in models(client)   # the start-up adapters are served all the same
    finally:
        stop_server(srv)


@pytest.mark.parametrize("extra,message", [
    (["--enable-lora", "--max-lora-rank", "8", "--lora-modules", "big=BIG"], "r=16 is above max_lora_rank=8"),
    (["--lora-modules", "sql=SQL"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "no-path"], "expected name=path or a JSON object"),
])
def test_bad_start_up_adapters_stop_the_server_named(tiny_llama, adapters, extra, message):
    extra = [e.replace("BIG", adapters["big"][0]).replace("SQL", adapters["sql"][0])
             for e in extra]
    command = [sys.executable, "-m", "deepinfer", "serve", "--model", tiny_llama, "--host", "127.0.0.1",
               "--port", str(free_port()), "--api-key", API_KEY, "--max-model-len", "256", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
