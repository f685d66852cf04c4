"""What a vLLM user's existing launch line and requests do on our server.

Before the hardening commit: boolean flags demanded a value and `--enable-prefix-caching False`
left caching on; `-tp`, `--disable-log-requests`, `--enable-auto-tool-choice`,
`--tool-call-parser`, `--chat-template`, `--reasoning-parser`, `--trust-remote-code`,
`--generation-config` and `--max-logprobs` were unknown; `--served-model-name a b` took one name;
`--dtype half` was refused; `guided_*`, `chat_template_kwargs` and `prompt_logprobs` were dropped
with a 200; `ignore_eos` did nothing on chat routes; generation_config.json was not applied;
`skip_tokenizer_init` did not exist; the SDK's Responses stream helper raised on a cut stream.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.e2e.server_process import start_server, stop_server
from tests.models.tiny_models import build_tiny_checkpoint

HI = [{"role": "user", "content": "What is the capital of Japan?"}]
# A chat template of our own (ChatML like the model's, plus a fixed system line) for --chat-template.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\nZeta here. {% endif %}")


@pytest.fixture(scope="module")
def vllm_line(tmp_path_factory):
    """The server started with a vLLM launch line's flags (item 9 of the hardening issue)."""
    directory = tmp_path_factory.mktemp("vllm-line")
    template = directory / "template.jinja"
    template.write_text(TEMPLATE)
    srv = start_server(str(directory / "server.log"), "--tensor-parallel-size", "1", "--disable-log-requests",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template),
                       "--reasoning-parser", "deepseek_r1", "--trust-remote-code", "--generation-config", "vllm",
                       "--max-logprobs", "5", "--served-model-name", "smol", "other", "--dtype", "half",
                       "--enable-prefix-caching", "False", "--enforce-eager")
    yield srv
    stop_server(srv)


@pytest.fixture
def http(vllm_line):
    with httpx.Client(base_url=vllm_line.base_url, headers=vllm_line.headers, timeout=120) as client:
        yield client


def test_vllm_launch_line_flags_do_what_they_say(vllm_line, http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["smol", "other"]
    reply = http.post("/v1/chat/completions", json={"model": "other", "messages": HI, "max_tokens": 4}).json()
    assert reply["model"] == "smol"   # the first name answers, whichever the request used (issue 42 item 11)
    ids = http.post("/tokenize", json={"messages": HI}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("assistant\nZeta here. ")
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 6}).status_code == 400
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 5}).status_code == 200
    long_prompt = "The history of the city of Kyoto, told slowly and in great detail, begins " * 8
    for _ in range(2):   # --enable-prefix-caching False: the second identical prompt hits nothing
        usage = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    log = open(vllm_line.log_path).read()
    assert "float16" in log                      # --dtype half
    assert "trust_remote_code has no effect" in log
    assert "prompt tokens, n=" not in log        # --disable-log-requests


def test_vllm_request_fields_take_effect(http):
    constrained = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8, "temperature": 0,
                                                          "guided_choice": ["Tokyo", "Kyoto"]}).json()
    assert constrained["choices"][0]["message"]["content"] in ("Tokyo", "Kyoto")
    scored = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "prompt_logprobs": 1}).json()
    prompt_len = scored["usage"]["prompt_tokens"]
    assert len(scored["prompt_logprobs"]) == prompt_len and scored["prompt_logprobs"][0] is None
    assert all(isinstance(entry, dict) and entry for entry in scored["prompt_logprobs"][1:])
    long = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 40, "ignore_eos": True}).json()
    assert long["usage"]["completion_tokens"] == 40 and long["choices"][0]["finish_reason"] == "length"
    kwargs = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2,
                                                     "chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    assert kwargs.status_code == 200, kwargs.text
    bad = http.post("/v1/chat/completions", json={"messages": HI, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.messages"


def test_responses_stream_helper_handles_a_cut_stream(vllm_line):
    client = openai.OpenAI(base_url=f"{vllm_line.base_url}/v1", api_key=vllm_line.api_key, max_retries=0)
    with client.responses.stream(model="smol", input="Tell me about Tokyo.", max_output_tokens=8) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.max_output_tokens == 8 and final.output_text


# ---------------------------------------------------------------- the model's generation config
@pytest.fixture(scope="module")
def tiny_with_generation_config(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-genconfig"))
    build_tiny_checkpoint("llama", directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "max_new_tokens": 5}, f)
    srv = start_server(os.path.join(directory, "server.log"), directory, "--enable-log-requests", "--max-model-len", "512")
    yield srv
    stop_server(srv)


def test_generation_config_defaults_apply_to_fields_left_out(tiny_with_generation_config):
    srv = tiny_with_generation_config
    with httpx.Client(base_url=srv.base_url, headers=srv.headers, timeout=60) as http:
        body = {"prompt": [5, 6, 7], "ignore_eos": True, "max_tokens": None}
        first, second = (http.post("/v1/completions", json=body).json() for _ in range(2))
        assert first["usage"]["completion_tokens"] == 5                 # max_new_tokens
        assert first["choices"][0]["text"] == second["choices"][0]["text"]   # temperature 0.0
        mine = http.post("/v1/completions", json={**body, "max_tokens": 3}).json()
        assert mine["usage"]["completion_tokens"] == 3                  # the request's own value wins
    assert "temperature=0" in open(srv.log_path).read()                 # --enable-log-requests


# ------------------------------------------------------------------------ no tokenizer at all
def test_skip_tokenizer_init_serves_token_ids(tmp_path):
    directory = str(tmp_path / "tiny-no-tokenizer")
    build_tiny_checkpoint("llama", directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(directory, name))
    srv = start_server(str(tmp_path / "server.log"), directory, "--skip-tokenizer-init", "--max-model-len", "512")
    try:
        with httpx.Client(base_url=srv.base_url, headers=srv.headers, timeout=60) as http:
            reply = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True, "return_token_ids": True}).json()
            choice = reply["choices"][0]
            assert len(choice["token_ids"]) == 4 and choice["text"] == "" and choice["prompt_token_ids"] == [5, 6, 7]
            text = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            assert text.status_code == 400 and "--skip-tokenizer-init" in text.json()["error"]["message"]
            assert http.post("/v1/chat/completions", json={"messages": HI}).status_code == 400
    finally:
        stop_server(srv)
