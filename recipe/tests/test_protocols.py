"""Request validation: unknown fields ignored, invalid ones named by their JSON path."""

import pytest
from corpus import CORPUS, V41
from deepinfer_recipe import RequestError, get_encoder, parse_request
from deepinfer_recipe.conversation import ImagePart, NamedToolChoice


@pytest.mark.parametrize(
    "protocol,body,path",
    [
        ("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": [{"type": "bogus"}]}]}, "messages[2].content[0].type"),
        ("chat", {"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
        ("chat", {"messages": [{"role": "user", "content": "a"}], "temperature": 9}, "temperature"),
        ("chat", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
        ("chat", {}, "messages"),
        ("responses", {"input": [{"type": "function_call", "name": "x"}]}, "input[0].call_id"),
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_video"}]}]}, "input[0].content[0].type"),
        ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
        ("messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        # A discriminator that is a function (Responses items may omit `type`) still names `type`.
        ("responses", {"input": [{"role": "user", "content": "a"}, {"type": "bogus"}]}, "input[1].type"),
        # Among union members the deepest path wins, counting a missing field's own name.
        ("responses", {"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name"),
        ("responses", {"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ("responses", {"input": "x", "reasoning": {"effort": "ultra"}}, "reasoning.effort"),
        ("responses", {"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ("responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strng"}}}}]}, "tools[0].parameters.properties.a.type"),
        ("messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}, "messages[0].content[0].input"),
        ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}}, "thinking.type"),
        ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system[0].type"),
        ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "object", "required": "a"}}]}, "tools[0].input_schema.required"),
        # JSON may escape a lone surrogate ("\ud800"): not a character, so no tokenizer can encode it.
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "a\ud800"}]}]}, "messages[0].content[1].text"),
        ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "\udfff"}]}, "input[0].output"),
        ("messages", {"max_tokens": 5, "system": "\ud83d", "messages": [{"role": "user", "content": "x"}]}, "system"),
    ],
)
def test_invalid_field_is_named(protocol, body, path):
    with pytest.raises(RequestError) as info:
        parse_request(protocol, body)
    assert info.value.path == path
    assert str(info.value).startswith(path + ":")


def test_unknown_fields_are_ignored():
    conversation = parse_request("chat", {
        "model": "m", "frequency_penalty": 0.5, "user": "u",
        "messages": [{"role": "user", "content": "hi", "name": "bob", "future_field": {"x": 1}}],
    })
    assert conversation.messages[0].text == "hi"


FREE_FORM = {"parameters", "input_schema", "schema", "input"}  # client JSON whose keys are data


def _with_unknown_fields(node, key=None):
    """Add an unknown field to every object of a request, except objects whose keys are data
    (JSON schemas, tool inputs)."""
    if isinstance(node, list):
        return [_with_unknown_fields(item) for item in node]
    if not isinstance(node, dict) or key in FREE_FORM:
        return node
    out = {k: _with_unknown_fields(v, k) for k, v in node.items()}
    out["x_future_field"] = {"type": "bogus", "nested": [1, None]}
    return out


@pytest.mark.parametrize("name,protocol,body", CORPUS, ids=[c[0] for c in CORPUS])
def test_unknown_fields_anywhere_change_nothing(name, protocol, body):
    """Every protocol ignores unknown fields at every level (request, messages, content parts,
    items, tools, tool calls, formats) the way the real APIs do: the prompt is the same."""
    fmt = "deepseek-v4.1" if body.get("model") == V41 else "deepseek-v4"
    sprinkled = _with_unknown_fields(body)
    assert sprinkled != body
    assert parse_request(protocol, sprinkled) == parse_request(protocol, body)
    a, b = get_encoder(fmt).encode(parse_request(protocol, sprinkled)), get_encoder(fmt).encode(parse_request(protocol, body))
    assert (a.rendered.text, a.rendered.control_ranges, a.token_ids) == (b.rendered.text, b.rendered.control_ranges, b.token_ids)


def test_chat_fields_reach_the_conversation():
    conversation = parse_request("chat", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "thinking": {"type": "disabled"}, "reasoning_effort": "max", "stop": "END",
        "max_completion_tokens": 7, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
    })
    assert isinstance(conversation.messages[0].content[1], ImagePart)
    assert conversation.tool_choice == NamedToolChoice("f")
    assert conversation.thinking is False and conversation.reasoning_effort == "max"
    assert conversation.stop == ["END"] and conversation.max_tokens == 7
    assert conversation.response_format.schema == {"type": "object"}


def test_messages_tool_results_become_tool_messages_first():
    conversation = parse_request("messages", {"max_tokens": 5, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}, {"type": "text", "text": "more"}]},
    ]})
    roles = [m.role for m in conversation.messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assert conversation.messages[1].reasoning == "t"
    assert conversation.messages[1].tool_calls[0].arguments == '{"a": 1}'


def test_responses_previous_response_id_is_refused_by_name():
    with pytest.raises(RequestError) as info:
        parse_request("responses", {"input": "x", "previous_response_id": "resp_1"})
    assert info.value.path == "previous_response_id"


def test_forced_tool_choice_with_thinking_is_rejected():
    from deepinfer_recipe import get_encoder

    conversation = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                                          "tools": [{"type": "function", "function": {"name": "f"}}]})
    with pytest.raises(RequestError) as info:
        get_encoder("deepseek-v4").encode(conversation)
    assert info.value.path == "tool_choice"


CHAT_Q = {"messages": [{"role": "user", "content": "q"}]}
MESSAGES_Q = {"max_tokens": 5, "messages": [{"role": "user", "content": "q"}]}
NUMERIC_FIELDS = [
    ("chat", CHAT_Q, "seed"), ("chat", CHAT_Q, "max_tokens"), ("chat", CHAT_Q, "max_completion_tokens"),
    ("chat", CHAT_Q, "temperature"), ("chat", CHAT_Q, "top_p"),
    ("responses", {"input": "q"}, "max_output_tokens"), ("responses", {"input": "q"}, "temperature"),
    ("responses", {"input": "q"}, "top_p"),
    ("messages", MESSAGES_Q, "max_tokens"), ("messages", MESSAGES_Q, "temperature"), ("messages", MESSAGES_Q, "top_p"),
]


@pytest.mark.parametrize("protocol,body,field", NUMERIC_FIELDS, ids=[f"{p}-{f}" for p, _, f in NUMERIC_FIELDS])
@pytest.mark.parametrize("value", ["1", True, "0.5", [1]], ids=["string", "bool", "float-string", "list"])
def test_numbers_must_be_json_numbers(protocol, body, field, value):
    """Failed before for "1" and true: pydantic's lax mode took a numeric string or a bool as a
    number (OpenAI rejects "42" for seed, and so do the engine's own fields)."""
    with pytest.raises(RequestError) as info:
        parse_request(protocol, dict(body, **{field: value}))
    assert info.value.path == field


@pytest.mark.parametrize("protocol,body,field", [f for f in NUMERIC_FIELDS if f[2] in ("seed", "max_tokens", "max_completion_tokens", "max_output_tokens")])
def test_integers_beyond_int64_are_a_request_error(protocol, body, field):
    """Failed before: 2**64 passed validation and overflowed later (msgpack, torch)."""
    with pytest.raises(RequestError) as info:
        parse_request(protocol, dict(body, **{field: 2**64}))
    assert info.value.path == field
    assert parse_request(protocol, dict(body, **{field: 2**63 - 1}))  # the largest int64 is fine


def test_numbers_still_accept_ints_and_floats():
    conversation = parse_request("chat", dict(CHAT_Q, seed=-(2**63), temperature=1, top_p=0.5, max_tokens=3))
    assert (conversation.seed, conversation.temperature, conversation.top_p, conversation.max_tokens) == (-(2**63), 1.0, 0.5, 3)
    with pytest.raises(RequestError) as info:
        parse_request("chat", dict(CHAT_Q, max_tokens=2.0))  # an integer field wants an integer
    assert info.value.path == "max_tokens"
    with pytest.raises(RequestError) as info:
        parse_request("messages", dict(MESSAGES_Q, thinking={"type": "enabled", "budget_tokens": "1024"}))
    assert info.value.path == "thinking.budget_tokens"


@pytest.mark.parametrize("body", [
    {"input": []}, {"input": ""}, {"input": [{"role": "user", "content": ""}]},
    {"input": [{"role": "user", "content": []}, {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": ""}]}]},
    {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}]},
    {"input": [], "instructions": ""},
])
def test_responses_empty_input_is_refused(body):
    """Failed before: {"input": []} was accepted and the model generated until max tokens."""
    with pytest.raises(RequestError) as info:
        parse_request("responses", body)
    assert info.value.path == "input"


@pytest.mark.parametrize("body", [
    {"input": "hi"}, {"input": [], "instructions": "Say hello."},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": ""}]},
])
def test_responses_input_with_something_in_it_is_accepted(body):
    assert parse_request("responses", body).messages
