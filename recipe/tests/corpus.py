"""Conversations for the oracle tests: (name, protocol, request body).

Each protocol, tools and tool results, multi-turn with reasoning, thinking on/off, every effort
level, response formats, images, prefix continuation, reminders, non-ASCII text. The model name
picks the oracle's encoding: V4 → DeepSeek-V4-Pro, V4.1 → DeepSeek-V4.1-Flash.
"""

V4 = "DeepSeek-V4-Pro"
V41 = "DeepSeek-V4.1-Flash"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city (Köln, 東京, ...)",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object", "properties": {"lang": {"type": "string"}}}}},
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}
CHAT_TOOLS = [WEATHER, SEARCH, NO_PARAMS]
RESP_TOOLS = [{"type": "function", **WEATHER["function"]}, {"type": "function", **SEARCH["function"]}]
MSG_TOOLS = [
    {"name": f["function"]["name"], "description": f["function"]["description"], "input_schema": f["function"]["parameters"]}
    for f in (WEATHER, SEARCH)
]


def _call(call_id, name, args):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


AGENT_LOOP = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            _call("c1", "get_weather", '{"city": "Paris", "days": 2}'),
            _call("c2", "get_weather", '{"city": "東京"}'),
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "rain, 18°C"},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24°C"},
    {"role": "assistant", "content": "Paris is sunny; Tokyo rainy.", "reasoning_content": "Summarize."},
    {"role": "user", "content": "Thanks! And tomorrow?"},
]
MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Simple addition."},
    {"role": "user", "content": "Times 3?"},
    {"role": "assistant", "content": "12", "reasoning_content": "4*3=12"},
    {"role": "user", "content": "Minus 5?"},
]

CORPUS: list[tuple[str, str, dict]] = []


def add(name, protocol, body):
    CORPUS.append((name, protocol, body))


for model in (V4, V41):
    tag = "v41" if model == V41 else "v4"
    # -- chat completions ------------------------------------------------------------------
    add(f"{tag}-chat-simple", "chat", {"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    add(f"{tag}-chat-system", "chat", {"model": model, "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]})
    add(f"{tag}-chat-nothink", "chat", {"model": model, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Hi"}]})
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        add(f"{tag}-chat-effort-{effort}", "chat", {"model": model, "reasoning_effort": effort, "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Prove it."}]})
    add(f"{tag}-chat-multiturn-think", "chat", {"model": model, "messages": MULTI_TURN})
    add(f"{tag}-chat-multiturn-nothink", "chat", {"model": model, "thinking": {"type": "disabled"}, "messages": MULTI_TURN})
    add(f"{tag}-chat-agent-loop", "chat", {"model": model, "tools": CHAT_TOOLS, "messages": AGENT_LOOP})
    add(f"{tag}-chat-agent-loop-nothink", "chat", {"model": model, "tools": CHAT_TOOLS, "thinking": {"type": "disabled"}, "messages": AGENT_LOOP})
    add(f"{tag}-chat-history-calls-no-tools", "chat", {"model": model, "messages": AGENT_LOOP})
    add(f"{tag}-chat-tools-max", "chat", {"model": model, "tools": CHAT_TOOLS, "reasoning_effort": "max", "messages": [{"role": "user", "content": "Weather?"}]})
    add(f"{tag}-chat-tool-choice-none", "chat", {"model": model, "tools": CHAT_TOOLS, "tool_choice": "none", "messages": MULTI_TURN})
    add(f"{tag}-chat-tool-required", "chat", {"model": model, "tools": CHAT_TOOLS, "tool_choice": "required", "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Weather in Rome"}]})
    add(f"{tag}-chat-tool-named", "chat", {"model": model, "tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Find cats"}]})
    add(f"{tag}-chat-ends-with-tool-result", "chat", {"model": model, "tools": CHAT_TOOLS, "messages": AGENT_LOOP[:5]})
    add(f"{tag}-chat-json-schema", "chat", {"model": model, "thinking": {"type": "disabled"}, "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {"n": {"type": "integer"}, "ü": {"type": "string"}}}}}, "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Give n"}]})
    add(f"{tag}-chat-json-object-tools", "chat", {"model": model, "tools": [WEATHER], "response_format": {"type": "json_object"}, "messages": [{"role": "user", "content": "Answer in JSON"}]})
    add(f"{tag}-chat-mid-system", "chat", {"model": model, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "q1"}, {"role": "system", "content": "new rule"}, {"role": "user", "content": "q2"}]})
    add(f"{tag}-chat-reminder", "chat", {"model": model, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}, {"role": "latest_reminder", "content": "Be brief."}]})
    add(f"{tag}-chat-prefix-content", "chat", {"model": model, "messages": [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "Roses are", "prefix": True}]})
    add(f"{tag}-chat-prefix-reasoning", "chat", {"model": model, "messages": [{"role": "user", "content": "Hard question"}, {"role": "assistant", "content": "", "reasoning_content": "Let me see", "prefix": True}]})
    add(f"{tag}-chat-parts-and-image", "chat", {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, {"type": "text", "text": "briefly"}]}]})
    add(f"{tag}-chat-odd-arguments", "chat", {"model": model, "thinking": {"type": "disabled"}, "tools": CHAT_TOOLS, "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [_call("a", "search", '{"q": "x", "filters": {"lang": ["en", "de"], "n": 1.5, "ok": true, "none": null}}'), _call("b", "now", "{}"), _call("c", "search", "not json"), _call("d", "search", "")]}, {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r1b"}]}, {"role": "tool", "tool_call_id": "b", "content": "12:00"}, {"role": "tool", "tool_call_id": "c", "content": ""}, {"role": "tool", "tool_call_id": "d", "content": "done"}, {"role": "user", "content": "ok"}]})
    add(f"{tag}-chat-unicode", "chat", {"model": model, "messages": [{"role": "user", "content": "Ünïcödé — 数据处理 ひらがな 🙂 1234567 tabs\tand\r\nCRLF"}]})
    add(f"{tag}-chat-unknown-fields", "chat", {"model": model, "user": "u1", "logit_bias": {}, "messages": [{"role": "user", "content": "x", "name": "bob", "extra": 1}]})
    # Found by the random differential test: a request that ends with a finished assistant turn
    # (its reasoning is history too), empty user/system messages, explicit thinking + effort none.
    add(f"{tag}-chat-ends-with-assistant", "chat", {"model": model, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]})
    add(f"{tag}-chat-empty-messages", "chat", {"model": model, "thinking": {"type": "disabled"}, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": ""}, {"role": "system", "content": ""}, {"role": "user", "content": [{"type": "text", "text": ""}]}, {"role": "user", "content": "b"}]})
    add(f"{tag}-chat-thinking-enabled-effort-none", "chat", {"model": model, "thinking": {"type": "enabled"}, "reasoning_effort": "none", "messages": [{"role": "user", "content": "q"}]})
    # -- responses -------------------------------------------------------------------------
    add(f"{tag}-resp-string", "responses", {"model": model, "input": "Hello", "instructions": "Be brief"})
    add(f"{tag}-resp-items", "responses", {"model": model, "instructions": "I", "tools": RESP_TOOLS, "reasoning": {"effort": "low"}, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs1", "summary": [{"type": "summary_text", "text": "summary"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "snow"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It snows."}]},
        {"type": "message", "role": "user", "content": "ok"}]})
    add(f"{tag}-resp-nothink", "responses", {"model": model, "input": "hi", "reasoning": {"effort": "none"}})
    add(f"{tag}-resp-max", "responses", {"model": model, "input": "hi", "reasoning": {"effort": "max"}})
    add(f"{tag}-resp-json-schema", "responses", {"model": model, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}, "max_output_tokens": 64})
    add(f"{tag}-resp-developer-system", "responses", {"model": model, "instructions": "ins", "input": [{"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"}, {"role": "user", "content": "hi"}]})
    # A leading developer message is V4.1's index-0 system block (it takes the effort prefix).
    add(f"{tag}-resp-leading-developer", "responses", {"model": model, "input": [{"role": "developer", "content": "dev"}, {"role": "user", "content": "hi"}]})
    add(f"{tag}-resp-developer-system-developer", "responses", {"model": model, "reasoning": {"effort": "high"}, "input": [{"role": "developer", "content": "d1"}, {"role": "system", "content": "s"}, {"role": "user", "content": "hi"}, {"role": "developer", "content": "d2"}, {"role": "user", "content": "more"}]})
    add(f"{tag}-resp-strict-tool", "responses", {"model": model, "input": "find", "reasoning": {"effort": "none"}, "tools": [{"type": "function", "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "object", "properties": {"c": {"type": "integer"}}}}}}]})
    add(f"{tag}-resp-empty-system-summary-only-reasoning", "responses", {"model": model, "instructions": "i", "input": [{"role": "system", "content": ""}, {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}, {"role": "developer", "content": ""}, {"role": "user", "content": "q2"}]})
    # -- messages --------------------------------------------------------------------------
    add(f"{tag}-msg-simple", "messages", {"model": model, "max_tokens": 100, "system": "sys", "messages": [{"role": "user", "content": "hi"}]})
    add(f"{tag}-msg-system-blocks", "messages", {"model": model, "max_tokens": 100, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "messages": [{"role": "user", "content": "hi"}]})
    add(f"{tag}-msg-thinking-tools", "messages", {"model": model, "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 1024}, "tools": MSG_TOOLS, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "sig"}, {"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Lima", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "warm"}, {"type": "text", "text": "And?"}]}]})
    add(f"{tag}-msg-disabled-stop", "messages", {"model": model, "max_tokens": 100, "thinking": {"type": "disabled"}, "stop_sequences": ["END"], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]})
    add(f"{tag}-msg-parallel-results", "messages", {"model": model, "max_tokens": 100, "thinking": {"type": "disabled"}, "tools": MSG_TOOLS, "messages": [
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "A"}}, {"type": "tool_use", "id": "t2", "name": "search", "input": {"q": "B"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "b1"}, {"type": "text", "text": "b2"}]}, {"type": "tool_result", "tool_use_id": "t1", "content": "a", "is_error": True}]}]})
    add(f"{tag}-msg-effort-max", "messages", {"model": model, "max_tokens": 100, "output_config": {"effort": "max"}, "messages": [{"role": "user", "content": "hi"}]})
    add(f"{tag}-msg-effort-low", "messages", {"model": model, "max_tokens": 100, "output_config": {"effort": "low"}, "messages": [{"role": "user", "content": "hi"}]})
    add(f"{tag}-msg-empty-system-ends-with-assistant", "messages", {"model": model, "max_tokens": 100, "system": "", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "text", "text": "Hello"}]}]})
