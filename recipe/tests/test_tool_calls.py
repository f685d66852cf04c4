"""Tool calling in the recipe: the forced-call constraint, schema checks, and the Hermes parser.

Models here: the DeepSeek-V4 BPE with ChatML control tokens added, (a) with `<tool_call>` /
`</tool_call>` as special tokens and a Qwen-style template that renders tools, and (b) without
them and with a template that ignores tools (SmolLM2's case), where tools are written inline.
"""

import json

import pytest
from deepinfer_recipe import RequestError, get_encoder, parse_request
from deepinfer_recipe.output import OutputSession
from deepinfer_recipe.tokenize import deepseek_v4_tokenizer_path

QWEN = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def make_dir(root, template, specials):
    data = json.loads(deepseek_v4_tokenizer_path().read_text(encoding="utf-8"))
    for offset, content in enumerate(specials):
        data["added_tokens"].append({"id": 129280 + offset, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (root / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}), encoding="utf-8")
    return get_encoder(f"hf:{root}")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_dir(tmp_path_factory.mktemp("qwen"), QWEN, ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_dir(tmp_path_factory.mktemp("plain"), PLAIN, ("<|im_start|>", "<|im_end|>"))


def encode(encoder, protocol="chat", **fields):
    body = {"messages": ASK, "tools": TOOLS, **fields}
    if protocol == "messages":
        body = {"max_tokens": 50, "messages": ASK, **fields,
                "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]}
    elif protocol == "responses":
        body = {"input": ASK[0]["content"], **fields,
                "tools": [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]}
    return encoder.encode(parse_request(protocol, body))


# ------------------------------------------------------------------------------- constraint
def calls_in(constraint):
    tag = constraint["format"]["tags"][0]
    content = tag["content"]
    alternatives = content["elements"] if content["type"] == "or" else [content]
    return tag, [json.loads(a["elements"][0]["value"] + "{}}")["name"] for a in alternatives]


def test_constraint_per_tool_choice(plain):
    assert encode(plain).constraint is None and encode(plain, tool_choice="none").constraint is None
    required = encode(plain, tool_choice="required").constraint
    tag, names = calls_in(required)
    assert names == ["get_weather", "get_time"] and tag["begin"] == "<tool_call>" and tag["end"] == "</tool_call>"
    assert required["format"]["at_least_one"] and not required["format"]["stop_after_first"]
    assert tag["content"]["elements"][0]["elements"][1]["json_schema"] == WEATHER
    named = encode(plain, tool_choice={"type": "function", "function": {"name": "get_time"}}).constraint
    assert calls_in(named)[1] == ["get_time"] and named["format"]["stop_after_first"]
    assert encode(plain, tool_choice="required", parallel_tool_calls=False).constraint["format"]["stop_after_first"]
    # Anthropic any / tool and Responses required map to the same constraints.
    assert encode(plain, "messages", tool_choice={"type": "any"}).constraint == required
    assert calls_in(encode(plain, "messages", tool_choice={"type": "tool", "name": "get_time"}).constraint)[1] == ["get_time"]
    assert encode(plain, "messages", tool_choice={"type": "any", "disable_parallel_tool_use": True}).constraint["format"]["stop_after_first"]
    assert encode(plain, "responses", tool_choice="required").constraint == required


def test_constraint_requires_the_tag_tokens_where_the_tokenizer_has_them(qwen):
    tag, _ = calls_in(encode(qwen, tool_choice="required").constraint)
    assert tag["begin"] == {"type": "token", "token": "<tool_call>"} and tag["end"] == {"type": "token", "token": "</tool_call>"}


def test_dsml_constraint_for_deepseek_v4():
    encoder = get_encoder("deepseek-v4")
    off = {"thinking": {"type": "disabled"}}
    assert encode(encoder, **off).constraint is None
    constraint = encode(encoder, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **off).constraint
    invokes, closing = constraint["format"]["elements"]
    assert [t["begin"] for t in invokes["tags"]] == ['<｜DSML｜invoke name="get_weather">\n']
    assert invokes["tags"][0]["content"]["style"] == "deepseek_xml" and closing["value"] == "</｜DSML｜tool_calls>"


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "undefined tool 'nope'"),
    ({"tool_choice": "required", "tools": []}, "requires tools"),
])
def test_tool_choice_errors_name_the_field(plain, fields, message):
    with pytest.raises(RequestError, match=message) as info:
        encode(plain, **fields)
    assert info.value.path == "tool_choice"


# ------------------------------------------------------------------------------ schema checks
@pytest.mark.parametrize("protocol, parameters, path", [
    ("chat", {"type": "object", "properties": {"city": {"type": "strng"}}}, "tools[0].function.parameters.properties.city.type"),
    ("chat", {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 1}}},
     "tools[0].function.parameters.properties.a.minItems"),
    ("chat", {"type": "object", "required": "city"}, "tools[0].function.parameters.required"),
    ("chat", {"type": "object", "properties": {"a": {"anyOf": []}}}, "tools[0].function.parameters.properties.a.anyOf"),
    ("chat", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "tools[0].function.parameters.properties.a.$ref"),
    ("chat", {"type": "array"}, "tools[0].function.parameters"),
    ("responses", {"type": "object", "properties": {"a": 3}}, "tools[0].parameters.properties.a"),
    ("messages", {"type": "object", "properties": {"a": {"enum": []}}}, "tools[0].input_schema.properties.a.enum"),
])
def test_invalid_tool_schema_names_the_field(protocol, parameters, path):
    if protocol == "chat":
        body = {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
    elif protocol == "responses":
        body = {"input": "q", "tools": [{"type": "function", "name": "f", "parameters": parameters}]}
    else:
        body = {"max_tokens": 5, "messages": ASK, "tools": [{"name": "f", "input_schema": parameters}]}
    with pytest.raises(RequestError) as info:
        parse_request(protocol, body)
    assert info.value.path == path and path in str(info.value)


def test_valid_schemas_pass():
    schema = {"type": "object", "$defs": {"p": {"type": "object", "properties": {"x": {"type": ["number", "null"]}}}},
              "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^a"}, True]},
                                                                "minItems": 1, "maxItems": 3},
                             "c": {"enum": ["x", 1]}, "d": {"type": "number", "minimum": 0, "maximum": 1.5}},
              "required": ["a"], "additionalProperties": False, "x-vendor": {"anything": 1}}
    conversation = parse_request("chat", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert conversation.tools[0].schema_path == "tools[0].function.parameters"


# ---------------------------------------------------------------------------------- prompts
def test_templates_that_ignore_tools_get_them_inline(plain):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny<|im_end|>"}]
    encoding = encode(plain, messages=history)
    text = encoding.rendered.text
    assert text.startswith("<|im_start|>system\nYou can call functions.") and '{"name": "get_weather", "description": "Weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny<|im_end|>\n</tool_response><|im_end|>" in text
    assert encoding.token_ids.count(129281) == 4          # the client's "<|im_end|>" stayed text
    assert encoding.parser_start.parse_tool_calls
    without = encode(plain, messages=history, tool_choice="none")
    assert "You can call functions" not in without.rendered.text and not without.parser_start.parse_tool_calls


def test_user_text_spelling_the_tag_is_not_the_tag_token(qwen):
    encoding = encode(qwen, messages=[{"role": "user", "content": 'say <tool_call>{"name": "x"}</tool_call>'}])
    assert 129282 not in encoding.token_ids and 129283 not in encoding.token_ids
    assert "<tools>" in encoding.rendered.text          # this template renders the tools itself


# ----------------------------------------------------------------------------------- parser
def run(encoder, encoding, ids, protocol="chat", chunk=1, finish=None):
    session = OutputSession.for_encoding(encoder, encoding, protocol, model="m", call_id=lambda i: f"call_{i}",
                                         response_id="r", created=1)
    events = session.start()
    for i in range(0, len(ids), chunk):
        events += session.feed(ids[i:i + chunk])
    if finish:
        events += session.finish(finish)
    assert session.finished
    return session.final_response(), events


def text_ids(encoder, text, end=True):
    return encoder.tokenizer.encode_plain(text) + ([129281] if end else [])


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("chunk", [1, 2, 7, 1000])
def test_text_tags_parse_and_stream_the_same(plain, chunk):
    output = "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome")
    final, events = run(plain, encode(plain), text_ids(plain, output), chunk=chunk)
    choice = final["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look.\n"
    calls = choice["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"]) for c in calls] == [("call_0", "get_weather"), ("call_1", "get_weather")]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris", "days": 2}, {"city": "Rome", "days": 2}]
    for index, call in enumerate(calls):
        streamed = "".join(tc["function"].get("arguments", "") for e in events
                           for tc in e["choices"][0]["delta"].get("tool_calls", []) if tc["index"] == index)
        assert streamed == call["function"]["arguments"]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "Let me look.\n"


def test_token_tags_only_count_as_ids(qwen):
    encoding = encode(qwen)
    spelled, _ = run(qwen, encoding, text_ids(qwen, CALL))       # the tags written as characters
    assert spelled["choices"][0]["message"]["content"] == CALL and "tool_calls" not in spelled["choices"][0]["message"]
    assert spelled["choices"][0]["finish_reason"] == "stop"
    body = CALL[len("<tool_call>"):-len("</tool_call>")]
    ids = [129282] + qwen.tokenizer.encode_plain(body) + [129283, 129281]
    final, _ = run(qwen, encoding, ids)
    [call] = final["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert final["choices"][0]["finish_reason"] == "tool_calls"
    broken, _ = run(qwen, encoding, [129282] + qwen.tokenizer.encode_plain("oops") + [129283, 129281])
    assert broken["choices"][0]["message"]["content"] == "<tool_call>oops</tool_call>"
    cut, _ = run(qwen, encoding, [129282] + qwen.tokenizer.encode_plain("oops"), finish="length")
    assert cut["choices"][0]["message"]["content"] == "<tool_call>oops"


def test_list_form_malformed_block_and_tool_choice_none(plain):
    listed = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]</tool_call>'
    final, _ = run(plain, encode(plain), text_ids(plain, listed))
    calls = final["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    broken = "<tool_call>not json</tool_call> ok"
    final, _ = run(plain, encode(plain), text_ids(plain, broken))
    assert final["choices"][0]["message"]["content"] == broken and final["choices"][0]["finish_reason"] == "stop"
    final, _ = run(plain, encode(plain), text_ids(plain, "<tool_call>cut", end=False), finish="length")
    assert final["choices"][0]["message"]["content"] == "<tool_call>cut"
    final, _ = run(plain, encode(plain, tool_choice="none"), text_ids(plain, CALL))
    assert final["choices"][0]["message"]["content"] == CALL


def test_cut_short_inside_a_call(plain):
    final, _ = run(plain, encode(plain), text_ids(plain, CALL[:-6], end=False), finish="length")
    choice = final["choices"][0]
    assert choice["finish_reason"] == "length"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_responses_and_messages_shapes(plain):
    ids = text_ids(plain, CALL)
    final, events = run(plain, encode(plain, "responses"), ids, "responses", chunk=3)
    [item] = final["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["call_id"] == "call_0"
    assert json.loads(item["arguments"]) == {"city": "Paris", "days": 2}
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == item["arguments"]
    final, events = run(plain, encode(plain, "messages"), ids, "messages", chunk=3)
    assert final["stop_reason"] == "tool_use"
    assert final["content"] == [{"type": "tool_use", "id": "call_0", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris", "days": 2}
