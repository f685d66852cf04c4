"""Real tool calls from the default model, through the real server and the official SDKs.

SmolLM2-135M-Instruct's own template ignores tools, so the recipe writes the tool list, earlier
calls and tool results into the messages in the Hermes convention, and a forced tool choice
(`required`, a named function, Anthropic `any` / `tool`) makes the recipe return a structural tag
that the engine compiles like any other constraint: `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` with the arguments held to the tool's JSON Schema. The output parser turns that text
back into OpenAI `tool_calls`, Responses `function_call` items and Anthropic `tool_use` blocks.
Generation stays short (greedy, small max_tokens): the suite runs on a 2-core CPU.
"""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server_process import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 24},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["timezone"],
        "properties": {"timezone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


def fresh() -> dict:
    """A new prefix-cache namespace: a request compared with another computes its whole prompt
    the same way (a cache hit can move logits enough to flip a greedy near tie)."""
    return {"cache_salt": uuid.uuid4().hex}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("tool-calls") / "server.log"))
    yield srv
    stop_server(srv)


def check_call(name: str, arguments: str, expected_name: str | None = None) -> dict:
    assert name in SCHEMAS and (expected_name is None or name == expected_name), name
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


# ------------------------------------------------------------------------- chat completions
def test_chat_required_tool_call_stream_and_result(oai):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=48, **GREEDY)
    reply = oai.chat.completions.create(**kwargs, extra_body=fresh())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    check_call(call.function.name, call.function.arguments)

    # The streamed deltas assemble to the same call.
    names, arguments, ids, finish = {}, {}, {}, None
    for chunk in oai.chat.completions.create(**kwargs, stream=True, extra_body=fresh()):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            if delta_call.id:
                ids[delta_call.index] = delta_call.id
            if delta_call.function.name:
                names[delta_call.index] = delta_call.function.name
            arguments[delta_call.index] = arguments.get(delta_call.index, "") + (delta_call.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert (names, arguments) == ({0: call.function.name}, {0: call.function.arguments}) and ids[0]

    # The tool's result goes back and the model answers in prose.
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees celsius."}]
    final = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                        max_tokens=16, **GREEDY)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_chat_named_tool_choice(oai):
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=48, **GREEDY)
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    check_call(call.function.name, call.function.arguments, "get_time")


def test_tool_choice_none_and_auto_do_not_force(server, oai):
    def prompt(tool_choice: str) -> str:
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
        ids = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, json=body).json()["tokens"]
        return httpx.post(f"{server.base_url}/detokenize", headers=server.headers, json={"tokens": ids}).json()["prompt"]

    assert "get_weather" not in prompt("none") and '"name": "get_weather"' in prompt("auto")
    reply = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                        **GREEDY)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("parameters, field", [
    ({"type": "object", "properties": {"city": {"type": "strin"}}}, "tools[0].function.parameters.properties.city.type"),
    ({"type": "object", "properties": {"city": {"$ref": "#/$defs/place"}}}, "tools[0].function.parameters.properties.city.$ref"),
    ({"type": "object", "properties": {"city": {"type": "string", "pattern": "(("}}}, "tools[0].function.parameters"),
])
def test_invalid_tool_schema_is_a_400_naming_the_field(oai, parameters, field):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required", max_tokens=8)
    assert info.value.body["param"] == field and field in info.value.message


# -------------------------------------------------------------------------------- responses
def test_responses_required_function_call(oai):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    kwargs = dict(model=MODEL, input="What is the weather in Paris?", tools=tools, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=48, **GREEDY)
    reply = oai.responses.create(**kwargs, extra_body=fresh())
    [item] = [o for o in reply.output if o.type == "function_call"]
    assert reply.status == "completed" and item.call_id
    check_call(item.name, item.arguments)
    events = list(oai.responses.create(**kwargs, stream=True, extra_body=fresh()))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert streamed == item.arguments and done.item.name == item.name


# --------------------------------------------------------------------------------- messages
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_messages_any_tool_use_stream_and_result(claude):
    kwargs = dict(model=MODEL, max_tokens=48, messages=ASK, tools=CLAUDE_TOOLS,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    reply = claude.messages.create(**kwargs, extra_body={**GREEDY, **fresh()})
    assert reply.stop_reason == "tool_use"
    [block] = [b for b in reply.content if b.type == "tool_use"]
    assert block.id.startswith("toolu_")   # Anthropic's id shape, as its SDK users expect
    check_call(block.name, json.dumps(block.input))

    with claude.messages.stream(**kwargs, extra_body={**GREEDY, **fresh()}) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (block.name, block.input) and final.stop_reason == "tool_use"

    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                   "content": "Sunny, 21 degrees celsius."}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=16, messages=history, tools=CLAUDE_TOOLS,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text


def test_messages_named_tool(claude):
    reply = claude.messages.create(model=MODEL, max_tokens=48, tools=CLAUDE_TOOLS, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
                                   tool_choice={"type": "tool", "name": "get_time"})
    assert reply.stop_reason == "tool_use"
    [block] = [b for b in reply.content if b.type == "tool_use"]
    check_call(block.name, json.dumps(block.input), "get_time")
