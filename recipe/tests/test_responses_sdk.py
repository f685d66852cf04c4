"""Our Responses events and objects, read by the official `openai` SDK: every event and the
final object validate against its types, the object repeats the request's settings, and the
SDK's stream helper (what `client.responses.stream(...)` returns) accumulates our stream into a
final response, also when max_output_tokens cut it short. The stream goes through the SDK's own
SSE decoding (`openai.Stream` over an in-memory HTTP response); nothing is faked."""

import json
import typing

import pytest
from test_output import DSML, EOS, THINK_END, TOK, TOOLS, model_output, session_for

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from openai.lib.streaming.responses import ResponseStream  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

FUNCTION_TOOL = {"type": "function", **TOOLS[0]["function"]}


def _event_types() -> dict:
    """Event type name → the SDK's model for it (ResponseStreamEvent is a tagged union)."""
    union = typing.get_args(ResponseStreamEvent)[0]
    return {name: cls for cls in typing.get_args(union) for name in typing.get_args(cls.model_fields["type"].annotation)}


EVENT_TYPES = _event_types()


def stream(body, ids, finish=None):
    """(events as a client receives them, the final object) for model output `ids`."""
    session = session_for(body, "responses")
    events = session.start() + session.feed(ids)
    if finish:
        events += session.finish(finish)
    return [json.loads(json.dumps(e)) for e in events], session.final_response()


def through_the_sdk(events):
    """Feed the events, as SSE bytes, to the SDK's stream helper; its events and final response."""
    sse = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
    client = openai.OpenAI(api_key="unused", base_url="http://localhost/v1")
    response = httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"},
                              request=httpx.Request("POST", "http://localhost/v1/responses"))
    raw = openai.Stream(cast_to=ResponseStreamEvent, response=response, client=client)
    helper = ResponseStream(raw_stream=raw, text_format=openai.omit, input_tools=openai.omit, starting_after=None)
    seen = [event.type for event in helper]
    return seen, helper.get_final_response()


def assert_valid(events, final):
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)  # strict: raises on a missing field
    Response.model_validate(final)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"] == final


REASONING_AND_CALLS = model_output("Plan.", "Checking.", [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})])
CUT = {  # output stopped by max_output_tokens in each kind of item
    "reasoning": TOK.encode_plain("Still thinking about"),
    "message": TOK.encode_plain("Plan.") + [THINK_END] + TOK.encode_plain("The answer is"),
    "function_call": REASONING_AND_CALLS[: REASONING_AND_CALLS.index(DSML, REASONING_AND_CALLS.index(DSML) + 1) + 12],
}


def test_completed_stream_through_the_sdk():
    events, final = stream({"input": "Weather?", "tools": [FUNCTION_TOOL]}, REASONING_AND_CALLS)
    assert_valid(events, final)
    seen, parsed = through_the_sdk(events)
    assert seen == [e["type"] for e in events]
    assert parsed.status == "completed" and parsed.completed_at is not None
    assert [item.type for item in parsed.output] == ["reasoning", "message", "function_call", "function_call"]
    assert parsed.output_text == "Checking."
    assert json.loads(parsed.output[3].arguments) == {"city": "Rome"}
    assert all(item.status == "completed" for item in parsed.output)


@pytest.mark.parametrize("kind", CUT)
def test_stream_cut_by_max_output_tokens_through_the_sdk(kind):
    """Failed before: the stream ended in `response.incomplete`, after which the SDK's
    get_final_response() raises "Didn't receive a `response.completed` event"."""
    events, final = stream({"input": "Weather?", "tools": [FUNCTION_TOOL], "max_output_tokens": 20}, CUT[kind], finish="length")
    assert_valid(events, final)
    _, parsed = through_the_sdk(events)
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output[-1].type == kind and parsed.output[-1].status == "incomplete"
    assert all(item.status == "completed" for item in parsed.output[:-1])
    assert parsed.max_output_tokens == 20 and parsed.completed_at is None
    # Every item that was opened was also closed, in OpenAI's order.
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(final["output"])
    assert kinds[-2] == "response.output_item.done"


def test_empty_output_through_the_sdk():
    events, final = stream({"input": "q", "reasoning": {"effort": "none"}}, [EOS])
    assert_valid(events, final)
    assert through_the_sdk(events)[1].output == []


def test_snapshots_in_start_events_do_not_change_afterwards():
    """Failed before: response.created held the live output list, so a caller that serialized
    it after feeding saw items there, and the SDK raised "Duplicate response output index 0"."""
    session = session_for({"input": "q"}, "responses")
    events = session.start()
    events += session.feed(REASONING_AND_CALLS)
    assert events[0]["response"]["output"] == [] and events[1]["response"]["status"] == "in_progress"
    through_the_sdk(events)


ECHOED = {
    "instructions": "Be brief.",
    "tools": [dict(FUNCTION_TOOL, description="Weather by city", strict=False)],
    "tool_choice": "none",
    "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 64, "parallel_tool_calls": False,
    "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}, "verbosity": "low"},
    "reasoning": {"effort": "high", "summary": "auto"},
    "metadata": {"team": "a"}, "user": "u-1", "top_logprobs": 2, "truncation": "disabled", "store": True,
}


def test_response_object_repeats_the_request():
    """Failed before: instructions, tools, tool_choice, sampling settings, text, reasoning,
    metadata, ... were missing, and the SDK's Response model rejected the object."""
    events, final = stream(dict(ECHOED, input="Weather?"), model_output("Plan.", "", [("get_weather", {"city": "Oslo"})]))
    assert_valid(events, final)
    for snapshot in (events[0]["response"], events[1]["response"], final):
        for field in ECHOED:
            if field != "store":
                assert snapshot[field] == ECHOED[field], field
        assert snapshot["store"] is False  # nothing is stored, whatever the request asked
        assert snapshot["previous_response_id"] is None and snapshot["object"] == "response"
    parsed = Response.model_validate(final)
    assert parsed.tools[0].name == "get_weather" and parsed.tool_choice == "none"
    assert parsed.text.format.type == "json_schema" and parsed.reasoning.effort == "high"
    assert parsed.usage.output_tokens_details.reasoning_tokens > 0


def test_response_object_defaults_when_the_request_sets_nothing():
    _, final = stream({"input": "hi"}, TOK.encode_plain("x") + [THINK_END] + TOK.encode_plain("y") + [EOS])
    parsed = Response.model_validate(final)
    assert parsed.tools == [] and parsed.tool_choice == "auto" and parsed.parallel_tool_calls is True
    assert parsed.text.format.type == "text" and parsed.truncation == "disabled" and parsed.metadata == {}
    assert parsed.instructions is None and parsed.temperature is None and parsed.max_output_tokens is None


def test_named_tool_choice_is_repeated():
    choice = {"type": "function", "name": "get_weather"}
    # A forced call needs thinking off (DeepSeek-V4); the prompt opens the call, EOS closes it.
    _, final = stream({"input": "q", "tools": [FUNCTION_TOOL], "tool_choice": choice, "reasoning": {"effort": "none"}}, [EOS])
    assert final["tool_choice"] == choice
    assert Response.model_validate(final).tool_choice.name == "get_weather"
