"""End to end: the real server, driven by the official `openai` and `anthropic` SDKs.

The model is the embedded SmolLM2-135M-Instruct; greedy decoding makes answers repeatable
("Tokyo" for the capital of Japan). Generation lengths stay short: the suite must run in a few
minutes on a 2-core CPU.
"""

from __future__ import annotations

import asyncio
import re
import time

import anthropic
import httpx
import openai
import pytest

from tests.e2e.server_process import start_server, stop_server
from tests.vllm_dashboard import DASHBOARD_SERIES

MODEL = "SmolLM2-135M-Instruct"
# Greedy answers must not hinge on a near tie (bf16 batches and prefix-cache hits move logits by
# ~0.1): for this question the closest top-2 gap along the answer is 1.0 nat.
JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]
MAX_PENDING = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("server") / "server.log"),
                       "--max-pending-requests", str(MAX_PENDING), "--metrics-vllm-names")
    yield srv
    stop_server(srv)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(rf"^deepinfer:{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"metric deepinfer:{name} missing"
    return float(match.group(1))


# ------------------------------------------------------------------------------ basics
def test_health_version_models(server, oai):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_tokenize_detokenize(server):
    ids = httpx.post(f"{server.base_url}/tokenize", headers=server.headers,
                     json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 2048
    text = httpx.post(f"{server.base_url}/detokenize", headers=server.headers, json={"tokens": ids["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    chat = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, json={"messages": JAPAN}).json()
    assert chat["count"] > ids["count"]   # the chat template adds its turns


# -------------------------------------------------------------------------------- chat
def test_chat_non_streaming(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert "Tokyo" in choice.message.content
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert reply.usage.prompt_tokens > 10 and 0 < reply.usage.completion_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.id.startswith("chatcmpl-") and reply.model == MODEL


def test_chat_streaming_matches_non_streaming(oai):
    full = oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=0, max_tokens=24)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=0, max_tokens=24,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])   # usage only on the last, choice-less chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The same prompt again: its full blocks now come from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_n_and_logprobs(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=1.0, seed=7, n=3, max_tokens=6,
                                        logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    completion_tokens = 0
    for choice in reply.choices:
        entries = choice.logprobs.content
        assert entries and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
        # Each top list is sorted, and the sampled token is never more likely than the best.
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in entries)
        assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in entries)
        assert "".join(e.token for e in entries).startswith(choice.message.content.strip()[:3])
        completion_tokens += len(entries)
    assert reply.usage.completion_tokens == completion_tokens


def test_chat_seed_repeats(oai):
    def sample():
        return oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=1.0, seed=1234,
                                           max_tokens=12).choices[0].message.content
    assert sample() == sample()


def test_chat_stop_sequence(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=0, max_tokens=24, stop=["Tokyo"])
    assert "Tokyo" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content.startswith("The capital of Japan is")


def test_chat_max_completion_tokens_length(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=0, max_completion_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_chat_tools_are_accepted_and_history_round_trips(oai):
    """SmolLM2's chat template has no tool section, so the model cannot call a tool; the tool
    path still has to accept tool definitions, tool_calls in history and tool results."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = JAPAN + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tools"):
        oai.chat.completions.create(model=MODEL, messages=JAPAN, max_tokens=2,
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}])


# --------------------------------------------------------------------------- completions
def test_completions(oai):
    reply = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5,
                                   logprobs=2)
    choice = reply.choices[0]
    assert "Paris" in choice.text and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 5 == reply.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)


def test_completions_batch_n_stop_and_stream(oai):
    reply = oai.completions.create(model=MODEL, prompt=["The capital of France is", "One, two, three,"],
                                   temperature=0, max_tokens=8, n=2, stop=["."])
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    by_index = {c.index: c for c in reply.choices}
    assert by_index[0].text == by_index[1].text and "." not in by_index[0].text   # greedy: the same twice
    assert "four" in by_index[2].text
    full = oai.completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=8)
    chunks = list(oai.completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=8,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_token_ids_prompt(oai, server):
    ids = httpx.post(f"{server.base_url}/tokenize", headers=server.headers,
                     json={"prompt": "The capital of France is"}).json()["tokens"]
    by_ids = oai.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4)
    by_text = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert by_ids.choices[0].text == by_text.choices[0].text


# ----------------------------------------------------------------------------- responses
def test_responses(oai):
    reply = oai.responses.create(model=MODEL, input="What is the capital of Japan?", temperature=0,
                                 max_output_tokens=24)
    assert "Tokyo" in reply.output_text and reply.status == "completed"
    assert reply.usage.input_tokens > 10 and reply.usage.output_tokens > 0
    events = list(oai.responses.create(model=MODEL, input="What is the capital of Japan?", temperature=0,
                                       max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    short = oai.responses.create(model=MODEL, input="Count to ten.", temperature=0, max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


# ------------------------------------------------------------------------------ messages
# This anthropic SDK has no temperature argument; the API field still exists.
GREEDY = {"temperature": 0}


def test_messages(claude):
    reply = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=JAPAN)
    assert reply.type == "message" and reply.role == "assistant"
    assert "Tokyo" in reply.content[0].text and reply.stop_reason == "end_turn"
    assert reply.usage.output_tokens > 0
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 10


def test_messages_streaming_and_stop_sequence(claude):
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=JAPAN) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Tokyo" in text and final.content[0].text == text
    stopped = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=JAPAN,
                                     stop_sequences=["Tokyo"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Tokyo"
    assert "Tokyo" not in stopped.content[0].text
    capped = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=JAPAN)
    assert capped.stop_reason == "max_tokens" and capped.usage.output_tokens == 2


def test_messages_count_tokens(claude, server):
    count = claude.messages.count_tokens(model=MODEL, messages=JAPAN)
    ids = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, json={"messages": JAPAN}).json()
    assert count.input_tokens == ids["count"]


# -------------------------------------------------------------------------------- errors
def test_error_statuses_openai(oai, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="no-such-model", messages=JAPAN)
    with pytest.raises(openai.BadRequestError, match=r"maximum context length is 2048 tokens.*5000 in the completion"):
        oai.chat.completions.create(model=MODEL, messages=JAPAN, max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model=MODEL, messages=JAPAN, logprobs=True, top_logprobs=99)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.completions.create(model=MODEL, prompt="x", logit_bias={"99999999": 5})
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    response = httpx.post(f"{server.base_url}/v1/chat/completions", headers=server.headers, content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_error_statuses_anthropic(claude, server):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=4, messages=JAPAN)
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        claude.messages.create(model=MODEL, max_tokens=5000, messages=JAPAN)
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=4, messages=JAPAN)
    response = httpx.post(f"{server.base_url}/v1/messages", headers={"x-api-key": server.api_key},
                          json={"model": MODEL, "messages": JAPAN})   # max_tokens is required
    assert response.status_code == 400
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"


GARBAGE = [b"", b"null", b"[]", b'"text"', b"{", b'{"messages": 5}', b'{"messages": [{}]}',
           b'{"prompt": [[]]}', b'{"prompt": [-1]}', b'{"prompt": "x", "max_tokens": "many"}',
           b'{"prompt": "x", "n": true}', b'{"input": {"a": 1}}', b'{"max_tokens": 1, "messages": [{"role": "x"}]}',
           b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', b'{"tokens": ["a"]}',
           b'{"prompt": "x", "stop": [""]}', b'{"prompt": "x", "logprobs": -5}', b'{"prompt": "x", "seed": 1.5}']


def test_no_request_crashes_the_server(server):
    routes = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/tokenize", "/detokenize"]
    headers = {**server.headers, "x-api-key": server.api_key, "content-type": "application/json"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        for route in routes:
            for body in GARBAGE:
                response = http.post(route, content=body)
                # A few bodies are valid for the tokenizer routes (extra fields are ignored).
                assert response.status_code < 500, (route, body, response.text)
                if route.startswith("/v1") or response.status_code != 200:
                    assert 400 <= response.status_code < 500 and "error" in response.json(), (route, body)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ------------------------------------------------------------------ disconnects, backpressure, metrics
LONG = {"model": MODEL, "prompt": "Write a long story about a river.", "max_tokens": 1500, "ignore_eos": True,
        "stream": True, "temperature": 0}


def assert_kv_freed(server, timeout_s: float = 20) -> None:
    """Every request gone from the core and every KV block free again, within `timeout_s`."""
    names = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
    deadline = time.monotonic() + timeout_s
    while True:
        values = {name: metric(server, name) for name in names}
        if not any(values.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(values.values()), f"{values}\nserver log:\n{server.log()}"


def test_disconnect_mid_stream_frees_kv_blocks(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(12)) if line.startswith("data:")]
            assert received
            assert metric(server, "kv_cache_usage_perc") > 0
            assert metric(server, "num_requests_running") == 1
    assert_kv_freed(server)


def test_queue_limit_returns_429(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as http:
            streams = [http.stream("POST", "/v1/completions", json=LONG) for _ in range(MAX_PENDING)]
            opened = [await s.__aenter__() for s in streams]
            try:
                assert all(r.status_code == 200 for r in opened)
                extra = await http.post("/v1/completions", json={**LONG, "stream": False})
                assert extra.status_code == 429
                error = extra.json()["error"]
                assert error["type"] == "rate_limit_error" and "max-pending-requests" in error["message"]
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
    asyncio.run(scenario())
    assert_kv_freed(server)


def test_metrics(server, oai):
    before = metric(server, "generation_tokens_total")
    oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert metric(server, "generation_tokens_total") == before + 4
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket"):
        assert f"deepinfer:{name}" in text, name
    assert f'model_name="{MODEL}"' in text
    for _ in range(2):   # the second one finds the first one's full blocks (system prompt + question)
        oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=0, max_completion_tokens=1)
    assert metric(server, "prefix_cache_hits_total") > 0


def test_metrics_serve_vllms_dashboard_and_scrapers(server, oai):
    before = {name: metric(server, name) for name in ("iteration_tokens_total_sum", "iteration_tokens_total_count")}
    reply = oai.completions.create(model=MODEL, prompt="The river", max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})
    # vLLM's rule: a step counts its new tokens, plus the whole prompt of a request it gave its first token.
    assert metric(server, "iteration_tokens_total_sum") == before["iteration_tokens_total_sum"] + \
        reply.usage.prompt_tokens + 4
    assert metric(server, "iteration_tokens_total_count") == before["iteration_tokens_total_count"] + 4
    oai.chat.completions.create(model=MODEL, messages=JAPAN, temperature=0, max_completion_tokens=4)
    text = httpx.get(f"{server.base_url}/metrics").text
    for prefix in ("deepinfer:", "vllm:"):   # ours, and vLLM's names under --metrics-vllm-names
        missing = [name for name in DASHBOARD_SERIES if not re.search(rf"^{prefix}{name}[{{ ]", text, re.MULTILINE)]
        assert not missing, prefix
    assert "_created" not in text
    assert re.search(r'^http_requests_total\{handler="/v1/completions",method="POST",status="2xx"\} [1-9]', text,
                     re.MULTILINE)
    assert 'http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"}' in text
    for name in ("http_request_duration_seconds_bucket", "http_request_duration_highr_seconds_count",
                 "http_request_size_bytes_count", "http_response_size_bytes_sum", "process_resident_memory_bytes",
                 "process_cpu_seconds_total", "python_info", "deepinfer_engine_core_process_resident_memory_bytes",
                 "deepinfer:request_inference_time_seconds_sum", "deepinfer:request_time_per_output_token_seconds_sum",
                 "deepinfer:request_params_n_sum", "deepinfer:request_params_max_tokens_sum"):
        assert re.search(rf"^{name}[{{ ]", text, re.MULTILINE), name
    info = re.search(r'^deepinfer:cache_config_info\{([^}]*)\} 1\.0$', text, re.MULTILINE)
    assert info and re.search(r'num_gpu_blocks="[1-9]', info.group(1)) and 'block_size="16"' in info.group(1)
    assert metric(server, "engine_healthy") == 1
