"""Issue 42's request side against the real server (SmolLM2): stop-sequence limits on every
route (item 3), oversize prompts refused before tokenization (item 4), image parts refused by a
text-only model (item 6), echo's logprob offsets (item 7), vLLM's request fields and the server
flags that set them for every request (item 9).

Each test here failed on the tree before these changes (the commit messages say how): the limits
and refusals answered 200 or tokenized first, the offsets were shifted, the fields were 400s, the
flags unknown.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.e2e.server_process import start_server, stop_server

HI = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv
    stop_server(srv)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client:
        yield client


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ------------------------------------------------------------------------------------ item 3
def test_stop_sequences_are_limited_on_every_route(http):
    many = [f"stop{i}" for i in range(65)]
    chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "stop": many})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "stop"
    assert "64" in chat.json()["error"]["message"] and "--max-stop-sequences" in chat.json()["error"]["message"]
    anthropic = http.post("/v1/messages", json={"messages": HI, "max_tokens": 2, "stop_sequences": many})
    error = anthropic.json()
    assert anthropic.status_code == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "stop_sequences" in error["error"]["message"] and "64" in error["error"]["message"]
    completion = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stop": many})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "stop"
    start = time.monotonic()
    huge = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2,
                                                   "stop": [f"s{i}" for i in range(10_000)]})
    assert huge.status_code == 400 and time.monotonic() - start < 5
    long_one = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "stop": ["x" * 20_000]})
    assert long_one.status_code == 400 and long_one.json()["error"]["param"] == "stop[0]"
    ok = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "stop": many[:64]})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------ item 4
def test_oversize_prompts_are_refused_before_they_are_tokenized(server, http):
    text = "The quick brown fox jumps over the lazy dog while the committee reviews its notes. " * 47_000  # 3.9 MB
    before = peak_rss_mib(server.process.pid)
    for route, body in (("/v1/completions", {"prompt": text, "max_tokens": 4}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4})):
        start = time.monotonic()
        answer = http.post(route, json=body)
        assert answer.status_code == 400 and "characters" in answer.json()["error"]["message"], answer.text[:300]
        assert time.monotonic() - start < 3
    assert peak_rss_mib(server.process.pid) - before < 150   # tokenizing it took about 400 MiB more
    # The default body limit is in proportion to the context (2048 tokens here): 15 MB is a 413 at once.
    huge = json.dumps({"prompt": text * 4, "max_tokens": 4}).encode()
    answer = http.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert answer.status_code == 413 and "--max-request-body-bytes" in answer.json()["error"]["message"]
    # A prompt cut to its last tokens may be longer than the context.
    cut = http.post("/v1/completions", json={"prompt": text[:200_000], "max_tokens": 2, "truncate_prompt_tokens": 100})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 100


# ------------------------------------------------------------------------------------ item 6
def test_image_parts_are_refused_by_a_text_only_model(http):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    chat = http.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is in it?"}, image]}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].content[1]"
    assert "text only" in chat.json()["error"]["message"]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    anthropic = http.post("/v1/messages", json={"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is in it?"}, block]}]})
    assert anthropic.status_code == 400 and anthropic.json()["error"]["type"] == "invalid_request_error"
    assert anthropic.json()["error"]["message"].startswith("messages[0].content[1]: ")
    responses = http.post("/v1/responses", json={"max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What?"},
                                     {"type": "input_image", "image_url": "https://example.com/a.png"}]}]})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "input[0].content[1]"


# ------------------------------------------------------------------------------------ item 7
def test_echo_logprobs_offsets_are_where_each_token_starts(http):
    prompt = "Hello world, how are you"
    choice = http.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1,
                                                **GREEDY}).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"][:6] == ["Hello", " world", ",", " how", " are", " you"]
    assert lp["text_offset"] == [0, 5, 11, 12, 16, 20, 24] and lp["token_logprobs"][0] is None
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token


# ------------------------------------------------------------------------------------ item 9
def test_generation_prompt_continuation_and_echo(http):
    def prompt_text(body: dict) -> str:
        ids = http.post("/tokenize", json=body).json()["tokens"]
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    assert prompt_text({"messages": HI}).endswith("<|im_start|>assistant\n")
    assert prompt_text({"messages": HI, "add_generation_prompt": False}).endswith("France?<|im_end|>\n")
    prefill = [*HI, {"role": "assistant", "content": "The capital of France is"}]
    continued = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    assert prompt_text(continued).endswith("<|im_start|>assistant\nThe capital of France is")
    reply = http.post("/v1/chat/completions", json={**continued, "echo": True, "max_tokens": 4, **GREEDY}).json()
    assert reply["choices"][0]["message"]["content"].startswith("The capital of France is")
    streamed = http.post("/v1/chat/completions", json={**continued, "echo": True, "max_tokens": 4, "stream": True,
                                                       **GREEDY})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events(streamed) if e["choices"])
    assert text == reply["choices"][0]["message"]["content"]
    both = http.post("/v1/chat/completions", json={**continued, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_request_id_names_the_response(http):
    for _ in range(2):   # the same id twice: the engine keeps its own ids
        chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "request_id": "trace-42"})
        assert chat.json()["id"] == "chatcmpl-trace-42"
    completion = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "request_id": "trace-42"})
    assert completion.json()["id"] == "cmpl-trace-42"


def test_truncate_prompt_tokens_and_token_id_logprobs(http):
    words = "one two three four five six seven eight nine ten " * 30
    completion = http.post("/v1/completions", json={"prompt": words, "max_tokens": 2, "truncate_prompt_tokens": 7})
    assert completion.json()["usage"]["prompt_tokens"] == 7
    chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "truncate_prompt_tokens": 5})
    assert chat.json()["usage"]["prompt_tokens"] == 5
    bad = http.post("/v1/completions", json={"prompt": "Hi", "truncate_prompt_tokens": 5000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    logprobs = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "logprobs": True,
                                                       "top_logprobs": 2, "return_tokens_as_token_ids": True}).json()
    content = logprobs["choices"][0]["logprobs"]["content"]
    assert content and all(re.fullmatch(r"token_id:\d+", e["token"]) for e in content)
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for e in content for t in e["top_logprobs"])


def test_bad_words_are_not_generated(http):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "return_token_ids": True, **GREEDY}
    paris = {7042, 38634}   # SmolLM2's " Paris" and "Paris"
    assert paris & set(http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"])
    banned = http.post("/v1/completions", json={**body, "bad_words": ["Paris"]}).json()["choices"][0]
    assert not paris & set(banned["token_ids"])


def test_chat_choices_carry_stop_reason(http):
    body = {"messages": [{"role": "user", "content": "Count from one to ten in words."}], "max_tokens": 24, **GREEDY}
    free = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert "stop_reason" in free and free["stop_reason"] is None
    stop = free["message"]["content"].split()[2]
    stopped = http.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    streamed = events(http.post("/v1/chat/completions", json={**body, "stop": [stop], "stream": True}))
    last = [e["choices"][0] for e in streamed if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert last["stop_reason"] == stop


def test_older_functions_reply_in_kind(http):
    functions = [{"name": "get_weather", "description": "The weather in a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "functions": functions,
            "function_call": {"name": "get_weather"}, "max_tokens": 40, **GREEDY}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    call = choice["message"]["function_call"]
    assert "tool_calls" not in choice["message"] and call["name"] == "get_weather"
    assert isinstance(json.loads(call["arguments"]), dict)
    deltas = [e["choices"][0]["delta"] for e in events(http.post("/v1/chat/completions", json={**body, "stream": True}))
              if e["choices"]]
    pieces = [d["function_call"] for d in deltas if "function_call" in d]
    assert pieces[0]["name"] == "get_weather" and not any("tool_calls" in d for d in deltas)
    assert json.loads("".join(p.get("arguments", "") for p in pieces)) == json.loads(call["arguments"])


def test_fields_without_a_meaning_here_are_accepted_with_a_warning(server, http):
    extras = {"prompt_cache_key": "user-7", "safety_identifier": "u7", "verbosity": "low", "modalities": ["text"],
              "prediction": {"type": "content", "content": "Paris"}, "documents": [{"title": "a", "text": "b"}],
              "mm_processor_kwargs": {}, "kv_transfer_params": {}, "vllm_xargs": {"k": 1}}
    for _ in range(2):
        reply = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **extras})
        assert reply.status_code == 200, reply.text
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "vllm_xargs": {"k": 1}}).status_code == 200
    log = open(server.log_path).read()
    for name in ("prompt_cache_key", "safety_identifier", "verbosity", "prediction", "kv_transfer_params", "vllm_xargs"):
        assert log.count(f"request field '{name}' is accepted and ignored") == 1, name
    audio = http.post("/v1/chat/completions", json={"messages": HI, "modalities": ["text", "audio"]})
    assert audio.status_code == 400 and audio.json()["error"]["param"] == "modalities"


# ----------------------------------------------------------------- the server-wide flags
@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("flagged") / "server.log"), "--return-tokens-as-token-ids",
                       "--enable-force-include-usage", "--no-enable-prompt-tokens-details")
    yield srv
    stop_server(srv)


def test_server_flags_set_the_request_defaults(flagged, http):
    assert "prompt_tokens_details" in http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()["usage"]
    with httpx.Client(base_url=flagged.base_url, headers=flagged.headers, timeout=120) as client:
        completion = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 1}).json()
        assert all(t.startswith("token_id:") for t in completion["choices"][0]["logprobs"]["tokens"])
        assert "prompt_tokens_details" not in completion["usage"]
        own = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 1,
                                                   "return_tokens_as_token_ids": False}).json()
        assert not any(t.startswith("token_id:") for t in own["choices"][0]["logprobs"]["tokens"])
        for route, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "Hi"})):
            streamed = events(client.post(route, json={**body, "max_tokens": 2, "stream": True}))
            assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 2
            assert "prompt_tokens_details" not in streamed[-1]["usage"]
