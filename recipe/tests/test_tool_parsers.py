"""vLLM's other tool-call formats (`--tool-call-parser llama3_json | mistral | pythonic | qwen3_coder`).

Each sample runs through the real output parser twice: all ids at once, and one character's ids
at a time (so every character boundary is a place where the stream is split). Both runs must give
the same final message, and the streamed chunks must add up to it: content before the calls,
then each call's id and name, then its arguments. Text that is not a call, and a malformed call,
stay content.

Tokenizers: the DeepSeek-V4 BPE with the formats' markers added as special tokens ("tok": only
their ids open a call), and without them ("text": the markers are found in the text).
"""

import json

import pytest
from deepinfer_recipe import get_encoder, parse_request
from deepinfer_recipe.output import OutputSession
from deepinfer_recipe.tokenize import deepseek_v4_tokenizer_path

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKERS = ("<|python_tag|>", "[TOOL_CALLS]", "<tool_call>", "</tool_call>")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}, "where": {"type": "object"},
                                            "temp": {"type": "number"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
END = 129281  # <|im_end|>


def make_encoder(root, specials):
    data = json.loads(deepseek_v4_tokenizer_path().read_text(encoding="utf-8"))
    for offset, content in enumerate(specials):
        data["added_tokens"].append({"id": 129280 + offset, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (root / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}),
                                                encoding="utf-8")
    return get_encoder(f"hf:{root}")


@pytest.fixture(scope="module", params=["tok", "text"])
def encoder(request, tmp_path_factory):
    extra = (*MARKERS, "<|eom_id|>") if request.param == "tok" else ()
    return make_encoder(tmp_path_factory.mktemp(request.param), ("<|im_start|>", "<|im_end|>", *extra))


def ids_of(encoder, text, per_char):
    """Token ids spelling `text`; a marker becomes its token where the tokenizer has one."""
    tokenizer, ids, rest = encoder.tokenizer, [], text
    while rest:
        at = [(rest.find(m), m) for m in MARKERS if m in rest and tokenizer.has_control(m)]
        at, marker = min(at) if at else (len(rest), None)
        piece = rest[:at]
        if per_char:
            ids += [i for c in piece for i in tokenizer.encode_plain(c)]
        else:
            ids += tokenizer.encode_plain(piece) if piece else []
        if marker is not None:
            ids.append(tokenizer.control_id(marker))
        rest = rest[at + len(marker or ""):]
    return ids


def run(encoder, parser, text, per_char, end=True, **fields):
    encoding = encoder.encode(parse_request("chat", {"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": TOOLS, **fields}))
    session = OutputSession.for_encoding(encoder, encoding, "chat", model="m", call_id=lambda i: f"call_{i}",
                                         response_id="r", created=1, tool_format=parser)
    ids = ids_of(encoder, text, per_char) + ([END] if end else [])
    chunks = session.start()
    for piece in ([i] for i in ids) if per_char else [ids]:
        chunks += session.feed(piece)
    if not end:
        chunks += session.finish("length")
    return session.final_response(), chunks


def replay(chunks):
    """The message the streamed chunks add up to, and the order kinds of delta came in."""
    content, calls, order = "", [], []
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        if delta.get("content"):
            content += delta["content"]
            order.append("content")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls)
                calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
                order.append("call")
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, calls, order


def check(encoder, parser, text, content, calls, end=True):
    results = []
    for per_char in (False, True):
        final, chunks = run(encoder, parser, text, per_char, end)
        message = final["choices"][0]["message"]
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
        assert (message["content"] or "", got) == (content, calls), (per_char, message)
        streamed, streamed_calls, order = replay(chunks)
        assert streamed == (message["content"] or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
        assert [c["id"] for c in streamed_calls] == [f"call_{i}" for i in range(len(calls))]
        assert "content" not in order[order.index("call"):] if calls else True   # content comes first
        expected_finish = "tool_calls" if calls and end else ("length" if not end else "stop")
        assert final["choices"][0]["finish_reason"] == expected_finish
        results.append(final["choices"][0]["message"])
    assert results[0] == results[1]


PARIS = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})

CASES = {
    "llama3_json": [
        ("Hello there {not a call}.", "Hello there {not a call}.", []),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        ('  {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', "",
         [("get_weather", {"city": "Paris", "days": 2})]),
        ('{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        ('{"name": "get_weather", "parameters": {"city": "Pa}ris\\""}}; {"name": "get_time", "parameters": {}}', "",
         [("get_weather", {"city": 'Pa}ris"'}), TIME]),
        ('Let me check.<|python_tag|>{"name": "get_time", "parameters": {}}', "Let me check.", [TIME]),
        ('{"parameters": {}, "name": "get_time"}', "", [TIME]),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ('{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
        ("{oops", "{oops", []),
    ],
    "mistral": [
        ("Sure, [no] calls.", "Sure, [no] calls.", []),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}, '
         '{"name": "get_time", "arguments": {}}]', "", [PARIS, TIME]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "", [PARIS, TIME]),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}', "", [PARIS]),
        ('Checking.[TOOL_CALLS]get_time[ARGS]{}', "Checking.", [TIME]),
        ("[TOOL_CALLS]oops no call", "[TOOL_CALLS]oops no call", []),
        ('[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', []),
    ],
    "pythonic": [
        ("No calls needed: [see](here).", "No calls needed: [see](here).", []),
        ('[get_weather(city="Paris", days=2)]', "", [("get_weather", {"city": "Paris", "days": 2})]),
        ("  [get_weather(city='Pa)r]is'), get_time()]", "", [("get_weather", {"city": "Pa)r]is"}), TIME]),
        ('[get_weather(where={"k": None, "l": [1, -2.5, (3,)]}, metric=True)]', "",
         [("get_weather", {"where": {"k": None, "l": [1, -2.5, [3]]}, "metric": True})]),
        ('[get_weather(city=open("x"))]', '[get_weather(city=open("x"))]', []),
        ('[get_weather("Paris")]', '[get_weather("Paris")]', []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[os.system(cmd='x')]", "[os.system(cmd='x')]", []),
    ],
    "qwen3_coder": [
        ("Plain <b>text</b>.", "Plain <b>text</b>.", []),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "",
         [PARIS]),
        ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan <i>Jose</i>\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=temp>\n2.5\n"
         "</parameter>\n<parameter=where>\n{\"lat\": 1}\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "Let me look.\n",
         [("get_weather", {"city": "San <i>Jose</i>", "days": 3, "metric": True, "temp": 2.5, "where": {"lat": 1},
                           "extra": "7"}), TIME]),
        ("<tool_call>\n<function=get_weather>\n<parameter=days>\nnull\n</parameter>\n<parameter=city>\nParis\n"
         "</function>\n</tool_call>", "", [("get_weather", {"days": None, "city": "Paris"})]),
        ("<tool_call>\nnot a function\n</tool_call>", "<tool_call>\nnot a function\n</tool_call>", []),
    ],
}


@pytest.mark.parametrize(("parser", "text", "content", "calls"),
                         [(p, *case) for p, cases in CASES.items() for case in cases])
def test_format(encoder, parser, text, content, calls):
    check(encoder, parser, text, content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', "", [PARIS]),   # sent as far as it came
    ("pythonic", '[get_weather(city="Paris")', '[get_weather(city="Paris")', []),
    ("mistral", "[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", "", [PARIS]),
])
def test_cut_short_by_max_tokens(encoder, parser, text, content, calls):
    if parser == "llama3_json":   # the arguments stop where the output did: not JSON, checked apart
        final, _ = run(encoder, parser, text, per_char=True, end=False)
        call = final["choices"][0]["message"]["tool_calls"][0]["function"]
        assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Par')
        return
    check(encoder, parser, text, content, calls, end=False)


def test_forced_tool_choice_keeps_the_constrained_form(encoder):
    """tool_choice "required" constrains the output to the Hermes form: parsed as such whatever the parser."""
    encoding = encoder.encode(parse_request("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                     "tool_choice": "required"}))
    assert encoding.constraint is not None
    session = OutputSession.for_encoding(encoder, encoding, "chat", call_id=lambda i: f"call_{i}", tool_format="mistral")
    session.start()
    session.feed(ids_of(encoder, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False) + [END])
    assert session.final_response()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_mistral_default_ids_are_nine_alphanumerics(encoder):
    """Mistral's chat templates refuse tool_call ids that are not 9 letters or digits."""
    encoding = encoder.encode(parse_request("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}))
    session = OutputSession.for_encoding(encoder, encoding, "chat", tool_format="mistral")
    session.start()
    session.feed(ids_of(encoder, "[TOOL_CALLS]get_time[ARGS]{}", False) + [END])
    call_id = session.final_response()["choices"][0]["message"]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()


def test_llama_end_of_message_token_ends_the_turn(encoder):
    """Llama 3.1 ends a tool-call turn with <|eom_id|>, not <|eot_id|>: it is no text of the call."""
    if not encoder.tokenizer.has_control("<|eom_id|>"):
        pytest.skip("the text-marker tokenizer has no <|eom_id|>")
    encoding = encoder.encode(parse_request("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}))
    session = OutputSession.for_encoding(encoder, encoding, "chat", call_id=lambda i: f"call_{i}",
                                         tool_format="llama3_json")
    session.start()
    session.feed(ids_of(encoder, '<|python_tag|>{"name": "get_time", "parameters": {}}', False)
                 + [encoder.tokenizer.control_id("<|eom_id|>")])
    assert session.finished
    choice = session.final_response()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)


def test_unknown_format_is_refused(encoder):
    from deepinfer_recipe.errors import RecipeError

    encoding = encoder.encode(parse_request("chat", {"messages": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(RecipeError, match="tool-call format"):
        OutputSession.for_encoding(encoder, encoding, "chat", tool_format="granite")


PIECES = ['{"name": "get_time", "parameters": {}}', '{"name": "get_weather", "arguments": {"city": "P', "; ", ";", "}",
          "{", "]", "[", '"', "\\", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "get_time", "(", ")", "=", "'x'",
          "<tool_call>", "</tool_call>", "<function=get_weather>", "<parameter=days>", "</parameter>", "</function>",
          "\n", " ", "text", "[get_time()]", "None", "1e999", "-3"]


@pytest.mark.parametrize("parser", list(CASES))
def test_random_output_never_raises_and_streams_what_it_returns(encoder, parser):
    """Any output, however broken: no exception, and the stream adds up to the final message."""
    import random

    rng = random.Random(parser)
    for _ in range(40):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        for per_char in (False, True):
            final, chunks = run(encoder, parser, text, per_char, end=rng.random() < 0.7)
            message = final["choices"][0]["message"]
            content, calls, _ = replay(chunks)
            assert content == (message["content"] or ""), text
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])], text
