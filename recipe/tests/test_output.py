"""Output side: ids → reasoning/content/tool calls, per-protocol events, round trips."""

import json

import pytest
from deepinfer_recipe import get_encoder, parse_request
from deepinfer_recipe.output import OutputSession
from oracle import dr, needs_oracle, v4_encoding

ENCODER = get_encoder("deepseek-v4")
TOK = ENCODER.tokenizer
THINK_END, DSML, EOS = TOK.control_id("</think>"), TOK.control_id("｜DSML｜"), 1
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def model_output(reasoning, content, calls=(), thinking=True):
    """Ids a model would emit: the rendered assistant turn, control tokens as ids."""
    ids = TOK.encode_plain(reasoning) + [THINK_END] if thinking else []
    ids += TOK.encode_plain(content)
    if calls:
        ids += TOK.encode_plain("\n\n<") + [DSML] + TOK.encode_plain("tool_calls>\n")
        for n, (name, params) in enumerate(calls):
            ids += TOK.encode_plain("\n" if n else "") + TOK.encode_plain("<") + [DSML] + TOK.encode_plain(f'invoke name="{name}">\n')
            for key, value in params.items():
                is_string = isinstance(value, str)
                text = value if is_string else json.dumps(value)
                ids += TOK.encode_plain("<") + [DSML] + TOK.encode_plain(f'parameter name="{key}" string="{"true" if is_string else "false"}">{text}</')
                ids += [DSML] + TOK.encode_plain("parameter>\n")
            ids += TOK.encode_plain("</") + [DSML] + TOK.encode_plain("invoke>")
        ids += TOK.encode_plain("\n</") + [DSML] + TOK.encode_plain("tool_calls>")
    return ids + [EOS]


def session_for(body, protocol="chat", **kw):
    encoding = ENCODER.encode(parse_request(protocol, body))
    return OutputSession.for_encoding(ENCODER, encoding, protocol, model="m", call_id=lambda i: f"call_{i}", response_id="r1", created=1, **kw)


CHAT = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
OUTPUT = model_output("Need the tool. 東京?", "Let me check — ok.", [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Köln \"x\""})])


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chat_final_object_independent_of_chunking(chunk):
    session = session_for(CHAT)
    events = session.start()
    for i in range(0, len(OUTPUT), chunk):
        events += session.feed(OUTPUT[i : i + chunk])
    assert session.finished
    message = session.final_response()["choices"][0]["message"]
    assert message["reasoning_content"] == "Need the tool. 東京?"
    assert message["content"] == "Let me check — ok."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris", "days": 2}, {"city": 'Köln "x"'}]
    assert session.final_response()["choices"][0]["finish_reason"] == "tool_calls"
    # The streamed deltas add up to the final object.
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert streamed == message["content"]
    args = "".join(tc["function"].get("arguments", "") for e in events for tc in e["choices"][0]["delta"].get("tool_calls", []) if tc["index"] == 1)
    assert args == message["tool_calls"][1]["function"]["arguments"]
    assert events[-1]["usage"]["completion_tokens"] == len(OUTPUT)


def test_responses_event_sequence():
    session = session_for({"input": "Weather?", "tools": [{"type": "function", **TOOLS[0]["function"]}]}, "responses")
    events = session.start() + session.feed(OUTPUT)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    output = session.final_response()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call", "function_call"]
    assert output[2]["name"] == "get_weather" and json.loads(output[2]["arguments"]) == {"city": "Paris", "days": 2}
    assert "response.function_call_arguments.done" in kinds and "response.reasoning_text.done" in kinds


def test_messages_event_sequence():
    body = {"max_tokens": 50, "messages": [{"role": "user", "content": "Weather?"}], "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]}
    session = session_for(body, "messages")
    events = session.start() + session.feed(OUTPUT)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    final = session.final_response()
    assert [b["type"] for b in final["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert final["content"][0]["signature"] == "r1"
    assert final["content"][2]["input"] == {"city": "Paris", "days": 2}
    assert final["stop_reason"] == "tool_use"


def test_stop_sequence_and_length():
    session = session_for({"messages": [{"role": "user", "content": "q"}], "stop": ["STOP"], "thinking": {"type": "disabled"}})
    session.feed(TOK.encode_plain("Hello ST") + TOK.encode_plain("OP and more"))
    assert session.finished
    final = session.final_response()["choices"][0]
    assert final["message"]["content"] == "Hello " and final["finish_reason"] == "stop"
    session = session_for({"max_tokens": 5, "messages": [{"role": "user", "content": "q"}], "thinking": {"type": "disabled"}}, "messages")
    session.feed(TOK.encode_plain("partial answer"))
    session.finish("length")
    assert session.final_response()["stop_reason"] == "max_tokens"


def test_stop_sequences_follow_the_engine_rules():
    """The chat parser and the engine's detokenizer share one stop-string checker: the stop
    string that completes first wins (here "bc", though "abcd" is listed first and starts
    earlier), and the streamed content never shows the start of a stop string."""
    body = {"messages": [{"role": "user", "content": "q"}], "stop": ["abcd", "bc"], "thinking": {"type": "disabled"}}
    session = session_for(body)
    session.feed(TOK.encode_plain("zabcd"))
    assert session.final_response()["choices"][0]["message"]["content"] == "za"
    assert session.parser.stop_sequence == "bc"


@pytest.mark.parametrize("seed", range(3))
def test_chat_stops_where_the_engine_detokenizer_stops(seed):
    import random

    from deepinfer_recipe.output.detokenize import IncrementalDetokenizer

    rng = random.Random(seed)
    pieces = ["ab", "a", "b", " ", "世界", "🙂", "c", "ba", " the"]
    for _ in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        stops = ["".join(rng.choice("ab世🙂 ") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        ids = TOK.encode_plain(text)
        detok = IncrementalDetokenizer(TOK, stop=stops)
        session = session_for({"messages": [{"role": "user", "content": "q"}], "stop": stops, "thinking": {"type": "disabled"}})
        events = []
        for token_id in ids:
            detok.update([token_id])
            events += session.feed([token_id])
            if session.finished:
                break
        if not session.finished:
            events += session.finish("length")
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        content = session.final_response()["choices"][0]["message"]["content"] or ""
        assert (session.parser.stop_sequence, content) == (detok.stop_reason, detok.output_text), (text, stops)
        assert streamed == content, (text, stops)


def test_multibyte_characters_split_across_tokens_are_whole():
    session = session_for({"messages": [{"role": "user", "content": "q"}], "thinking": {"type": "disabled"}})
    text = "🙂🚀 emoji and ŧĥïś"
    events = []
    for token_id in TOK.encode_plain(text) + [EOS]:
        events += session.feed([token_id])
    deltas = [e["choices"][0]["delta"].get("content") for e in events if e["choices"][0]["delta"].get("content")]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_forced_tool_choice_starts_inside_the_block():
    body = {"messages": [{"role": "user", "content": "q"}], "tools": TOOLS, "tool_choice": "required", "thinking": {"type": "disabled"}}
    ids = model_output("", "", [("get_weather", {"city": "Rome"})], thinking=False)
    start = ids.index(DSML, 0)
    after_block_open = ids[start + 1 + len(TOK.encode_plain("tool_calls>\n")):]
    session = session_for(body)
    session.feed(after_block_open)
    calls = session.final_response()["choices"][0]["message"]["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


@needs_oracle
@pytest.mark.parametrize("protocol", ["chat", "messages"])
def test_same_answer_as_oracle_stream_processor(protocol):
    body = dict(CHAT, model="DeepSeek-V4-Pro") if protocol == "chat" else {
        "model": "DeepSeek-V4-Pro", "max_tokens": 50, "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]}
    request_type = dr.ChatCompletionRequest if protocol == "chat" else dr.MessagesRequest
    request = request_type(json.dumps(body)).convert(dr.ConversionOptions())
    processor = dr.StreamProcessor(request_type.chunk_generator(request, "r1", "m"), request.parsing_options, dr.Tokenizer.from_file(str(__import__("deepinfer_recipe").tokenize.deepseek_v4_tokenizer_path())))
    response = (dr.ChatCompletionResponse if protocol == "chat" else dr.MessagesResponse)("r1", "m", 1, 0, 0)
    for event in processor.push(dr.InferenceChunk.ready()) + processor.push(dr.InferenceChunk.tokens(OUTPUT[:-1])) + processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + processor.finish():
        response.accumulate(event)
    theirs = json.loads(response.to_json())
    session = session_for(body, protocol)
    session.feed(OUTPUT)
    ours = session.final_response()
    if protocol == "chat":
        a, b = theirs["choices"][0]["message"], ours["choices"][0]["message"]
        assert (a["reasoning_content"], a["content"]) == (b["reasoning_content"], b["content"])
        assert [json.loads(c["function"]["arguments"]) for c in a["tool_calls"]] == [json.loads(c["function"]["arguments"]) for c in b["tool_calls"]]
    else:
        strip = lambda blocks: [{k: v for k, v in blk.items() if k not in ("id", "signature")} for blk in blocks]  # noqa: E731
        assert strip(theirs["content"]) == strip(ours["content"])
        assert theirs["stop_reason"] == ours["stop_reason"]


@needs_oracle
@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_round_trip_parsed_turn_rerendered_matches_oracle_ids(protocol):
    """Parse the model's turn, send it back as history the way each client would, and check
    the next prompt's ids against the oracle's."""
    first = {
        "chat": CHAT,
        "responses": {"input": "Weather in Paris?", "tools": [{"type": "function", **TOOLS[0]["function"]}]},
        "messages": {"max_tokens": 9, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]},
    }[protocol]
    session = session_for(first, protocol)
    session.feed(OUTPUT)
    final = session.final_response()
    if protocol == "chat":
        message = final["choices"][0]["message"]
        body = {"model": "DeepSeek-V4-Pro", "tools": TOOLS, "messages": CHAT["messages"] + [message] + [
            {"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in message["tool_calls"]]}
    elif protocol == "responses":
        items = [{"type": "message", "role": "user", "content": "Weather in Paris?"}] + [
            {k: v for k, v in item.items() if k != "status"} for item in final["output"]]
        items += [{"type": "function_call_output", "call_id": i["call_id"], "output": "sunny"} for i in final["output"] if i["type"] == "function_call"]
        body = {"model": "DeepSeek-V4-Pro", "tools": [{"type": "function", **TOOLS[0]["function"]}], "input": items}
    else:
        body = {"model": "DeepSeek-V4-Pro", "max_tokens": 9, "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
                "messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": final["content"]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": "sunny"} for b in final["content"] if b["type"] == "tool_use"]}]}
    ours = ENCODER.encode(parse_request(protocol, body)).token_ids
    request_type = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}[protocol]
    theirs = v4_encoding().encode(request_type(json.dumps(body)).convert(dr.ConversionOptions()).conversation)
    assert ours == theirs


ROUND_TRIP_TURNS = {
    "reasoning-content-calls": ("Need the tool. 東京?", "Let me check — ok.", [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": 'Köln "x"'})]),
    "reasoning-content": ("Just answer.", "Paris is sunny, 24°C.\n\nEnjoy!", []),
    "calls-only": ("", "", [("get_weather", {"city": "Rome", "days": 1})]),
}


def _chat_turn(reasoning, content, calls):
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        turn["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                              for i, (n, a) in enumerate(calls)]
    return turn


def _follow_up(protocol, final):
    """The next request a client of `protocol` sends: its history plus our parsed turn, then
    the tool results (if the turn called tools) or a new user message."""
    tools_chat = TOOLS
    if protocol == "chat":
        message = final["choices"][0]["message"]
        after = [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in message.get("tool_calls") or []]
        return {"model": "DeepSeek-V4-Pro", "tools": tools_chat, "messages": CHAT["messages"] + [message] + (after or [{"role": "user", "content": "And tomorrow?"}])}
    if protocol == "responses":
        items = [{"type": "message", "role": "user", "content": "Weather in Paris?"}] + [
            {k: v for k, v in item.items() if k != "status"} for item in final["output"]]
        after = [{"type": "function_call_output", "call_id": i["call_id"], "output": "sunny"} for i in final["output"] if i["type"] == "function_call"]
        return {"model": "DeepSeek-V4-Pro", "tools": [{"type": "function", **TOOLS[0]["function"]}],
                "input": items + (after or [{"type": "message", "role": "user", "content": "And tomorrow?"}])}
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "sunny"} for b in final["content"] if b["type"] == "tool_use"]
    return {"model": "DeepSeek-V4-Pro", "max_tokens": 9, "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
            "messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": final["content"]},
                         {"role": "user", "content": results or "And tomorrow?"}]}


@needs_oracle
@pytest.mark.parametrize("turn", ROUND_TRIP_TURNS)
@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_round_trip_reproduces_the_model_turn_ids(protocol, turn):
    """The ids of an assistant turn exactly as the format writes it (taken from the oracle's
    render of that turn in history) → our parser → the client's next request in its protocol →
    our prompt: it contains those very ids, and equals the oracle's prompt for that request."""
    reasoning, content, calls = ROUND_TRIP_TURNS[turn]
    after = [{"role": "tool", "tool_call_id": f"call_{i}", "content": "r"} for i in range(len(calls))] or [{"role": "user", "content": "x"}]
    history = {"model": "DeepSeek-V4-Pro", "tools": TOOLS, "messages": CHAT["messages"] + [_chat_turn(reasoning, content, calls)] + after}
    rendered = v4_encoding().encode(dr.ChatCompletionRequest(json.dumps(history)).convert(dr.ConversionOptions()).conversation)
    start = rendered.index(TOK.control_id("<｜Assistant｜>")) + 2  # after <｜Assistant｜><think>
    model_ids = rendered[start : rendered.index(EOS, start) + 1]
    assert TOK.control_id("<think>") == rendered[start - 1]

    first = {"chat": CHAT, "responses": {"input": "Weather in Paris?", "tools": [{"type": "function", **TOOLS[0]["function"]}]},
             "messages": {"max_tokens": 9, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                          "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]}}[protocol]
    session = session_for(first, protocol)
    session.feed(model_ids)
    assert session.finished
    body = _follow_up(protocol, session.final_response())
    ours = ENCODER.encode(parse_request(protocol, body)).token_ids
    request_type = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}[protocol]
    assert ours == v4_encoding().encode(request_type(json.dumps(body)).convert(dr.ConversionOptions()).conversation)
    header = [TOK.control_id("<｜Assistant｜>"), TOK.control_id("<think>")]
    assert any(ours[i : i + len(model_ids) + 2] == header + model_ids for i in range(len(ours))), "the turn's ids changed"


def test_ignore_eos_generates_past_the_end_token():
    """Failed before (no such option): the end token always finished the choice, so with the
    request's ignore_eos everything the engine generated after it was dropped."""
    after = TOK.encode_plain(" and more") + [0] + TOK.encode_plain("<｜User｜>")  # 0: BOS, a special token
    answer = model_output("Think.", "Answer.")  # ends with the EOS id
    for protocol, body in (("chat", CHAT), ("responses", {"input": "q"}), ("messages", {"max_tokens": 99, "messages": CHAT["messages"]})):
        session = session_for(body, protocol, ignore_eos=True)
        session.start()
        session.feed(answer + after)
        assert not session.finished
        session.finish("length")
        final = session.final_response()
        # EOS and BOS (special) are left out; <｜User｜> is not special: it stays, as in vLLM.
        if protocol == "chat":
            choice = final["choices"][0]
            assert choice["message"]["content"] == "Answer. and more<｜User｜>"
            assert choice["finish_reason"] == "length"
            assert final["usage"]["completion_tokens"] == len(answer + after)
        elif protocol == "responses":
            assert final["output"][-1]["content"][0]["text"] == "Answer. and more<｜User｜>"
            assert final["status"] == "incomplete"
        else:
            assert final["content"][-1]["text"] == "Answer. and more<｜User｜>"
            assert final["stop_reason"] == "max_tokens"


def test_ignore_eos_still_parses_tool_calls_and_stop_sequences():
    session = session_for(CHAT, ignore_eos=True)
    session.feed(OUTPUT + TOK.encode_plain("more"))  # OUTPUT: two DSML calls, then EOS
    session.finish("length")
    assert len(session.final_response()["choices"][0]["message"]["tool_calls"]) == 2
    session = session_for(dict(CHAT, stop=["STOP"], thinking={"type": "disabled"}), ignore_eos=True)
    session.feed(TOK.encode_plain("a") + [EOS] + TOK.encode_plain("b STOP c"))
    assert session.finished  # a stop sequence still ends it
    assert session.final_response()["choices"][0]["message"]["content"] == "ab "


def test_without_ignore_eos_the_end_token_finishes():
    session = session_for(CHAT)
    session.feed(OUTPUT + TOK.encode_plain(" and more"))
    assert session.finished
    assert session.final_response()["choices"][0]["finish_reason"] == "tool_calls"
