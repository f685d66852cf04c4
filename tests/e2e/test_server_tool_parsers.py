"""`--tool-call-parser NAME` picks the format the server reads tool calls in (not only Hermes).

The server runs the default model with `--tool-call-parser pythonic`. The model is small and
would not write a pythonic call by itself, so a `guided_regex` holds its output to one: the
test is about what the server does with such output (a tool call, streamed and not), and that
ordinary text stays content.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server_process import start_server, stop_server

TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": {"type": "object",
                                                          "properties": {"timezone": {"type": "string"}}}}}]
CALL = r'\[get_time\(timezone="UTC"\)\]'
BODY = {"messages": [{"role": "user", "content": "What time is it in London?"}], "tools": TOOLS, "temperature": 0,
        "max_tokens": 24}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("tool-parsers") / "server.log"), "--enable-auto-tool-choice",
                       "--tool-call-parser", "pythonic")
    with httpx.Client(base_url=srv.base_url, headers=srv.headers, timeout=120) as client:
        yield client
    stop_server(srv)


def test_pythonic_call_is_a_tool_call(http):
    reply = http.post("/v1/chat/completions", json={**BODY, "guided_regex": CALL}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", reply
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"timezone": "UTC"}


def test_pythonic_call_streams_as_tool_call_deltas(http):
    calls, content = {}, ""
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "guided_regex": CALL, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
                call["name"] += piece["function"].get("name", "")
                call["arguments"] += piece["function"].get("arguments", "")
    assert content == ""
    assert [c["name"] for c in calls.values()] == ["get_time"]
    assert json.loads(calls[0]["arguments"]) == {"timezone": "UTC"}


def test_text_that_is_not_a_call_stays_content(http):
    reply = http.post("/v1/chat/completions", json={**BODY, "guided_regex": r"\[see the docs\]"}).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == "[see the docs]" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
