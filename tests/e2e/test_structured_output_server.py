"""Structured output through the real server and the openai SDK.

`response_format` json_schema (strict) and json_object on /v1/chat/completions, vLLM's
`structured_outputs` in extra_body on /v1/completions, and the 400s that carry xgrammar's reason.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.e2e.server_process import start_server, stop_server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population_millions"],
          "properties": {"city": {"type": "string", "maxLength": 30},
                         "country": {"enum": ["France", "Germany", "Italy"]},
                         "population_millions": {"type": "number", "minimum": 0, "maximum": 50}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A compile timeout small enough to test yet far above what these schemas need.
    srv = start_server(str(tmp_path_factory.mktemp("structured") / "server.log"),
                       "--structured-outputs-compile-timeout-s", "20")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)


def test_response_format_json_schema_strict(client):
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=80, n=2,
        messages=[{"role": "user", "content": "Give facts about Paris as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_and_extra_body(client):
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0.7, top_p=0.9, seed=4, max_tokens=120,
        messages=[{"role": "user", "content": 'Reply with a short JSON object like {"a": 1}.'}],
        response_format={"type": "json_object"}, extra_body={"top_k": 20})
    if response.choices[0].finish_reason == "stop":   # a sampled object may outrun max_tokens
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    completion = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="A US phone number:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", completion.choices[0].text)
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=5,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chat.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("kwargs, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}},
     "nowhere"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing_rule"}}}, "missing_rule"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "exactly one of"),
])
def test_invalid_constraint_is_a_400_with_the_reason(client, kwargs, reason):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=5,
                                       messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert reason in info.value.message
